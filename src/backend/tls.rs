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

/// The well-known public roots.
pub fn public_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}
