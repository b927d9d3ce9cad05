//! TLS for PostgreSQL connections, with libpq's `sslmode` meanings: what is
//! verified of the server's certificate depends on the mode (see `url.rs`).
//! One rustls configuration per backend; the handshake's signatures are
//! always checked, whatever the mode.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::url::Tls;

/// What is checked of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Nothing but the handshake (libpq's `prefer` and `require`).
    Nothing,
    /// Signed by a trusted CA (`verify-ca`).
    Chain,
    /// Signed by a trusted CA and naming the host (`verify-full`).
    ChainAndName,
}

/// The connector for a mode; `ca_file` from `sslrootcert` or
/// `--tls-ca-file`. A CA given with `require` makes it `verify-ca`, as in
/// libpq.
pub fn connector(tls: Tls, ca_file: Option<&Path>) -> Result<MakeRustlsConnect, String> {
    let check = match (tls, ca_file) {
        (Tls::Disable | Tls::Prefer, _) | (Tls::Require, None) => Check::Nothing,
        (Tls::Require | Tls::VerifyCa, _) => Check::Chain,
        (Tls::VerifyFull, _) => Check::ChainAndName,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let config = if check == Check::Nothing {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unchecked(
                provider.signature_verification_algorithms,
            )))
            .with_no_client_auth()
    } else {
        let roots = Arc::new(roots(ca_file)?);
        let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| e.to_string())?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Verified {
                webpki,
                check_name: check == Check::ChainAndName,
            }))
            .with_no_client_auth()
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The CAs a certificate may be signed by: the file given, else libpq's
/// `~/.postgresql/root.crt`, else the well-known public roots.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let default = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".postgresql/root.crt"))
        .filter(|path| path.is_file());
    match ca_file.map(Path::to_path_buf).or(default) {
        Some(file) => crate::backend::tls::roots_from(&file),
        None => Ok(crate::backend::tls::public_roots()),
    }
}

/// `verify-ca` and `verify-full`: the public-key infrastructure's verdict,
/// with a certificate for another name let through for `verify-ca`.
#[derive(Debug)]
struct Verified {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Verified {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let verdict =
            self.webpki
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now);
        match verdict {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// `prefer` and `require`: any certificate, as libpq takes it; the
/// handshake's signatures are still checked.
#[derive(Debug)]
struct Unchecked(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}
