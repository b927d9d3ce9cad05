//! What the TLS of every backend shares: the CAs a server's certificate may
//! be signed by.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The certificates of a PEM file (`--tls-ca-file`), as trust roots.
pub fn roots_from(file: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(file)
        .map_err(|e| format!("cannot read the CA file {}: {e}", file.display()))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("the CA file {}: {e}", file.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("the CA file {}: {e}", file.display()))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "the CA file {} holds no certificate",
            file.display()
        ));
    }
    Ok(roots)
}

/// A client certificate chain and its private key, from PEM files.
pub fn client_identity(
    cert_file: &Path,
    key_file: &Path,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ),
    String,
> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| format!("cannot read --tls-cert-file {}: {e}", cert_file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--tls-cert-file {}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "--tls-cert-file {} holds no certificate",
            cert_file.display()
        ));
    }
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("--tls-key-file {}: {e}", key_file.display()))?;
    Ok((certs, key))
}

/// The well-known public roots.
pub fn public_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}
