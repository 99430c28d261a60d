//! TLS with tokio-rustls: the client-facing amqps acceptor (certificate, key, optional client
//! certificate verification) and the connector for amqps upstreams.
//!
//! Both use the aws-lc-rs crypto provider explicitly, so the result does not depend on which
//! providers other crates happen to enable.

use std::fs::File;
use std::io::BufReader;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, anyhow};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::TlsConfig;
use crate::shutdown::Shutdown;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider())
}

fn load_certs(path: &str, key: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let file = File::open(path).with_context(|| format!("{key}: cannot open {path}"))?;
    let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut BufReader::new(file)).collect();
    let certs = certs.with_context(|| format!("{key}: {path} is not a PEM certificate file"))?;
    if certs.is_empty() {
        return Err(anyhow!("{key}: {path} holds no certificate"));
    }
    Ok(certs)
}

fn load_key(path: &str) -> anyhow::Result<PrivateKeyDer<'static>> {
    let file = File::open(path).with_context(|| format!("tls.key_file: cannot open {path}"))?;
    rustls_pemfile::private_key(&mut BufReader::new(file))
        .with_context(|| format!("tls.key_file: {path} is not a PEM key file"))?
        .ok_or_else(|| anyhow!("tls.key_file: {path} holds no private key"))
}

fn roots(path: &str, key: &str) -> anyhow::Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for cert in load_certs(path, key)? {
        store
            .add(cert)
            .with_context(|| format!("{key}: invalid CA certificate in {path}"))?;
    }
    Ok(store)
}

/// The amqps acceptor from `[tls]`.
pub fn acceptor(cfg: &TlsConfig) -> anyhow::Result<TlsAcceptor> {
    if cfg.cert_file.is_empty() || cfg.key_file.is_empty() {
        return Err(anyhow!(
            "tls.cert_file and tls.key_file are required when listen.amqps is set"
        ));
    }
    let certs = load_certs(&cfg.cert_file, "tls.cert_file")?;
    let key = load_key(&cfg.key_file)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow!("tls: {e}"))?;
    let builder = if cfg.client_ca_file.is_empty() {
        builder.with_no_client_auth()
    } else {
        let store = roots(&cfg.client_ca_file, "tls.client_ca_file")?;
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider());
        let verifier = if cfg.require_client_cert {
            verifier.build()
        } else {
            verifier.allow_unauthenticated().build()
        }
        .map_err(|e| anyhow!("tls.client_ca_file: {e}"))?;
        builder.with_client_cert_verifier(verifier)
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| anyhow!("tls.cert_file/tls.key_file: {e}"))?;
    config.alpn_protocols = vec![b"amqp".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A connector for amqps upstreams. `ca_file` empty is refused when verification is on (the
/// proxy has no system trust store on purpose: a sidecar trusts what it is told to).
pub fn connector(ca_file: &str, verify: bool) -> anyhow::Result<TlsConnector> {
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
            .with_root_certificates(roots(ca_file, "upstream.tls_ca_file")?)
            .with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider())))
            .with_no_client_auth()
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Connects to `addr` and runs the TLS handshake for `server_name`.
pub async fn connect(
    connector: &TlsConnector,
    stream: TcpStream,
    server_name: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = ServerName::try_from(server_name.to_string())
        .map_err(|e| anyhow!("upstream.tls_server_name: {e}"))?;
    Ok(connector.connect(name, stream).await?)
}

/// Accepts TLS connections until `stop`; each completed handshake is handed to `on_conn`.
pub async fn serve<F>(listener: TcpListener, acceptor: TlsAcceptor, mut stop: Shutdown, on_conn: F)
where
    F: Fn(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr) + Send + Sync + 'static,
{
    let on_conn = Arc::new(on_conn);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let acceptor = acceptor.clone();
                let on_conn = on_conn.clone();
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(
                        std::time::Duration::from_secs(10),
                        acceptor.accept(stream),
                    )
                    .await;
                    match handshake {
                        Ok(Ok(tls)) => on_conn(tls, peer),
                        Ok(Err(err)) => tracing::info!(%peer, %err, "TLS handshake failed"),
                        Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                    }
                });
            }
            _ = stop.recv() => return,
        }
    }
}

/// Verification switched off by `upstream.tls_verify = false` (tests, private networks).
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl tokio_rustls::rustls::client::danger::ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: tokio_rustls::rustls::pki_types::UnixTime,
    ) -> Result<tokio_rustls::rustls::client::danger::ServerCertVerified, tokio_rustls::rustls::Error>
    {
        Ok(tokio_rustls::rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        tokio_rustls::rustls::crypto::verify_tls12_signature(
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
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        tokio_rustls::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<tokio_rustls::rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// True if `path` exists (for config validation messages).
pub fn file_exists(path: &str) -> bool {
    Path::new(path).exists()
}
