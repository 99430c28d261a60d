//! The amqps listener's rustls `ServerConfig` from `[tls]`: certificate chain and key, and
//! client-certificate verification against `tls.client_ca_file` (optional or required).
//! [`server_material`] wraps it in a [`Reloadable`] that re-reads the same files.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::anyhow;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::server::WebPkiClientVerifier;

use super::material::Reloadable;
use super::pem::{load_certs, load_key, load_roots};
use super::provider;
use crate::config::TlsConfig;

/// Builds the listener configuration, reading every file named in `cfg`. A key that does not
/// match the certificate is refused here (rustls compares their public keys).
pub fn server_config(cfg: &TlsConfig) -> anyhow::Result<Arc<ServerConfig>> {
    if cfg.cert_file.is_empty() || cfg.key_file.is_empty() {
        return Err(anyhow!(
            "tls.cert_file and tls.key_file are required when listen.amqps is set"
        ));
    }
    let certs = load_certs(&cfg.cert_file, "tls.cert_file")?;
    let key = load_key(&cfg.key_file, "tls.key_file")?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow!("tls: {e}"))?;
    let builder = if cfg.client_ca_file.is_empty() {
        builder.with_no_client_auth()
    } else {
        let store = load_roots(&cfg.client_ca_file, "tls.client_ca_file")?;
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider());
        let verifier = if cfg.require_client_cert {
            verifier.build()
        } else {
            verifier.allow_unauthenticated().build()
        }
        .map_err(|e| anyhow!("tls.client_ca_file: {}: {e}", cfg.client_ca_file))?;
        builder.with_client_cert_verifier(verifier)
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        anyhow!(
            "tls.cert_file/tls.key_file: {} and {}: {e}",
            cfg.cert_file,
            cfg.key_file
        )
    })?;
    config.alpn_protocols = vec![b"amqp".to_vec()];
    Ok(Arc::new(config))
}

/// The listener configuration, rebuilt from the same files on [`Reloadable::reload`].
pub fn server_material(cfg: &TlsConfig) -> anyhow::Result<Reloadable<ServerConfig>> {
    let mut files = vec![PathBuf::from(&cfg.cert_file), PathBuf::from(&cfg.key_file)];
    if !cfg.client_ca_file.is_empty() {
        files.push(PathBuf::from(&cfg.client_ca_file));
    }
    let cfg = cfg.clone();
    Reloadable::new("amqps listener certificate", files, move || {
        server_config(&cfg)
    })
}
