//! The rustls `ClientConfig` of the connections to an amqps upstream: verified against the CA
//! bundle in `upstream.tls_ca_file`, or (with `upstream.tls_verify = false`) not verified at
//! all. [`upstream_material`] wraps it in a [`Reloadable`] that re-reads the CA file.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::anyhow;
use tokio_rustls::rustls;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use super::material::Reloadable;
use super::pem::load_roots;
use super::provider;

/// The upstream client configuration. `ca_file` empty is refused when verification is on (the
/// proxy has no system trust store on purpose: a sidecar trusts what it is told to).
pub fn client_config(ca_file: &str, verify: bool) -> anyhow::Result<Arc<ClientConfig>> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow!("tls: {e}"))?;
    let config = if verify {
        if ca_file.is_empty() {
            return Err(anyhow!(
                "upstream.tls_ca_file is required for an amqps upstream with tls_verify = true"
            ));
        }
        builder
            .with_root_certificates(load_roots(ca_file, "upstream.tls_ca_file")?)
            .with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider())))
            .with_no_client_auth()
    };
    Ok(Arc::new(config))
}

/// The upstream client configuration, rebuilt from the CA file on [`Reloadable::reload`]
/// (nothing to re-read without verification).
pub fn upstream_material(ca_file: &str, verify: bool) -> anyhow::Result<Reloadable<ClientConfig>> {
    let files = if verify && !ca_file.is_empty() {
        vec![PathBuf::from(ca_file)]
    } else {
        Vec::new()
    };
    let ca_file = ca_file.to_string();
    Reloadable::new("upstream CA", files, move || {
        client_config(&ca_file, verify)
    })
}

/// Verification switched off by `upstream.tls_verify = false` (tests, private networks):
/// encryption without authentication of the upstream.
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
