//! Reading the PEM files named in the configuration, with the PEM parser of rustls-pki-types
//! (`PemObject`). Every error names the configuration key and the file, because the same
//! functions run at start (where the error stops the service) and on a reload (where it is
//! logged and the previous material stays in force).

use std::path::Path;

use anyhow::{Context, anyhow};
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::RootCertStore;

/// Turns a PEM parse error into one naming `key` and `path`; `what` is what the file should
/// hold ("certificate", "private key").
fn pem_error(key: &str, path: &str, what: &str, error: pem::Error) -> anyhow::Error {
    match error {
        pem::Error::Io(io) => anyhow!("{key}: cannot read {path}: {io}"),
        pem::Error::NoItemsFound => anyhow!("{key}: {path} holds no PEM {what}"),
        other => anyhow!("{key}: {path} is not a valid PEM {what} file: {other}"),
    }
}

/// Every certificate in `path`, in file order (a chain: the leaf first). An empty or
/// certificate-less file is an error.
pub fn load_certs(path: &str, key: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(Path::new(path))
        .map_err(|e| pem_error(key, path, "certificate", e))?
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(key, path, "certificate", e))?;
    if certs.is_empty() {
        return Err(pem_error(
            key,
            path,
            "certificate",
            pem::Error::NoItemsFound,
        ));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in `path`.
pub fn load_key(path: &str, key: &str) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(Path::new(path))
        .map_err(|e| pem_error(key, path, "private key", e))
}

/// A trust store of every certificate in `path`.
pub fn load_roots(path: &str, key: &str) -> anyhow::Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for cert in load_certs(path, key)? {
        store
            .add(cert)
            .with_context(|| format!("{key}: invalid CA certificate in {path}"))?;
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(std::path::PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let dir =
                std::env::temp_dir().join(format!("dlx-proxy-pem-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        fn write(&self, name: &str, text: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_string()
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn self_signed() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn reads_certificates_keys_and_roots() {
        let dir = Dir::new("good");
        let (cert, key) = self_signed();
        let (other, _) = self_signed();
        let chain = dir.write("chain.pem", &format!("{cert}\n{other}"));
        let key_file = dir.write("key.pem", &key);
        assert_eq!(load_certs(&chain, "tls.cert_file").unwrap().len(), 2);
        assert!(matches!(
            load_key(&key_file, "tls.key_file").unwrap(),
            PrivateKeyDer::Pkcs8(_)
        ));
        assert_eq!(load_roots(&chain, "tls.client_ca_file").unwrap().len(), 2);
    }

    #[test]
    fn errors_name_the_key_and_the_file() {
        let dir = Dir::new("bad");
        let (cert, key) = self_signed();
        let missing = dir.0.join("missing.pem").to_str().unwrap().to_string();
        let error = load_certs(&missing, "tls.cert_file")
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with(&format!("tls.cert_file: cannot read {missing}: ")),
            "{error}"
        );

        let garbage = dir.write("garbage.pem", "not a certificate\n");
        let error = load_certs(&garbage, "upstream.tls_ca_file")
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            format!("upstream.tls_ca_file: {garbage} holds no PEM certificate")
        );

        // A key file holding only a certificate, and a certificate file holding only a key.
        let cert_only = dir.write("cert.pem", &cert);
        let error = load_key(&cert_only, "tls.key_file")
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            format!("tls.key_file: {cert_only} holds no PEM private key")
        );
        let key_only = dir.write("key.pem", &key);
        let error = load_certs(&key_only, "tls.cert_file")
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            format!("tls.cert_file: {key_only} holds no PEM certificate")
        );

        // A section cut short.
        let cut = dir.write("cut.pem", &cert[..cert.len() / 2]);
        let error = load_certs(&cut, "tls.cert_file").unwrap_err().to_string();
        assert!(
            error.starts_with(&format!(
                "tls.cert_file: {cut} is not a valid PEM certificate file: "
            )),
            "{error}"
        );
    }
}
