//! The upstream broker: where it is (parsed once from `upstream.url`) and how to reach it over
//! TCP or TLS (`amqps://`). The TLS client configuration comes from [`crate::tls`] and is
//! taken afresh for each connection, so a rotated CA file applies to the next one.
//!
//! Credentials and the vhost in the URL are ignored: every client connection brings its own
//! SASL exchange and `connection.open`, which pass through unchanged.

use std::io;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

use crate::config::UpstreamConfig;
use crate::tls::Reloadable;

/// Why the upstream settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream.url {url:?} is not an AMQP URL: {detail}")]
    BadUrl { url: String, detail: String },
    #[error("upstream TLS setup: {0}")]
    Tls(String),
}

/// Where the upstream broker listens and how to talk to it.
#[derive(Clone)]
pub struct UpstreamTarget {
    pub host: String,
    pub port: u16,
    /// The TLS client configuration (reloaded when the CA file changes) and the name to verify.
    tls: Option<(Arc<Reloadable<rustls::ClientConfig>>, ServerName<'static>)>,
    connect_timeout: Duration,
}

impl std::fmt::Debug for UpstreamTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTarget")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl UpstreamTarget {
    /// Parses `upstream.url` and prepares the TLS client when the scheme is `amqps`.
    pub fn from_config(config: &UpstreamConfig) -> Result<Self, UpstreamError> {
        let uri = AMQPUri::from_str(&config.url).map_err(|detail| UpstreamError::BadUrl {
            url: config.url_for_display(),
            // The parser's message may quote the URL: never with its password.
            detail: detail.replace(&config.url, &config.url_for_display()),
        })?;
        let host = uri.authority.host.clone();
        if host.is_empty() {
            return Err(UpstreamError::BadUrl {
                url: config.url_for_display(),
                detail: "no host".into(),
            });
        }
        let tls = match uri.scheme {
            AMQPScheme::AMQP => None,
            AMQPScheme::AMQPS => Some(tls_client(config, &host)?),
        };
        Ok(UpstreamTarget {
            host,
            port: uri.authority.port,
            tls,
            connect_timeout: Duration::from_secs(config.connect_timeout_secs.max(1)),
        })
    }

    /// `host:port` for messages.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Opens one connection (TCP, then TLS when configured) within the connect timeout.
    pub async fn connect(&self) -> io::Result<UpstreamStream> {
        let attempt = async {
            let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
            tcp.set_nodelay(true)?;
            match &self.tls {
                None => Ok(UpstreamStream::Tcp(tcp)),
                Some((client, name)) => {
                    let connector = TlsConnector::from(client.current());
                    let tls = connector.connect(name.clone(), tcp).await?;
                    Ok(UpstreamStream::Tls(Box::new(tls)))
                }
            }
        };
        match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no connection to {} within {:?}",
                    self.address(),
                    self.connect_timeout
                ),
            )),
        }
    }

    /// The reloadable TLS client configuration of an `amqps` upstream (for certificate
    /// rotation); `None` for a plain `amqp` upstream.
    pub fn tls_material(&self) -> Option<Arc<Reloadable<rustls::ClientConfig>>> {
        self.tls.as_ref().map(|(client, _)| client.clone())
    }

    /// Whether a TCP connection to the upstream opens within `within`.
    pub async fn reachable(&self, within: Duration) -> bool {
        matches!(
            tokio::time::timeout(within, TcpStream::connect((self.host.as_str(), self.port))).await,
            Ok(Ok(_))
        )
    }
}

fn tls_client(
    config: &UpstreamConfig,
    host: &str,
) -> Result<(Arc<Reloadable<rustls::ClientConfig>>, ServerName<'static>), UpstreamError> {
    let client = crate::tls::upstream_material(&config.tls_ca_file, config.tls_verify)
        .map_err(|e| UpstreamError::Tls(format!("{e:#}")))?;
    let name = if config.tls_server_name.is_empty() {
        host
    } else {
        config.tls_server_name.as_str()
    };
    let server_name = ServerName::try_from(name.to_string())
        .map_err(|e| UpstreamError::Tls(format!("server name {name:?}: {e}")))?;
    Ok((Arc::new(client), server_name))
}

/// A connection to the upstream, plain or TLS.
pub enum UpstreamStream {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> UpstreamConfig {
        UpstreamConfig {
            url: url.into(),
            ..UpstreamConfig::default()
        }
    }

    #[test]
    fn parses_plain_urls() {
        let target =
            UpstreamTarget::from_config(&config("amqp://guest:pw@rabbit:5673/%2f")).unwrap();
        assert_eq!(target.host, "rabbit");
        assert_eq!(target.port, 5673);
        assert_eq!(target.address(), "rabbit:5673");
        let target = UpstreamTarget::from_config(&config("amqp://rabbit")).unwrap();
        assert_eq!(target.port, 5672);
    }

    #[test]
    fn tls_needs_a_ca_file_unless_verification_is_off() {
        assert!(matches!(
            UpstreamTarget::from_config(&config("amqps://rabbit")),
            Err(UpstreamError::Tls(_))
        ));
        let mut cfg = config("amqps://rabbit");
        cfg.tls_verify = false;
        let target = UpstreamTarget::from_config(&cfg).unwrap();
        assert_eq!(target.port, 5671);
    }

    #[test]
    fn bad_urls_are_errors_without_passwords() {
        let err = UpstreamTarget::from_config(&config("http://user:secret@x")).unwrap_err();
        assert!(!err.to_string().contains("secret"));
    }

    #[tokio::test]
    async fn unreachable_upstream_is_reported() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target =
            UpstreamTarget::from_config(&config(&format!("amqp://127.0.0.1:{port}"))).unwrap();
        assert!(target.reachable(Duration::from_secs(1)).await);
        drop(listener);
        assert!(!target.reachable(Duration::from_secs(1)).await);
        assert!(target.connect().await.is_err());
    }
}
