//! The upstream brokers: where they are (parsed once from `upstream.urls`, or `upstream.url`
//! alone), how to reach one over TCP or TLS (`amqps://`), and which one to dial.
//!
//! [`UpstreamPool`] is the one way the proxy opens an upstream connection. It dials the
//! targets in the order [`order::TargetOrder`] gives (the last one that worked first, failing
//! ones skipped for a backoff), each attempt within `upstream.connect_timeout_secs`, counts
//! every attempt in `upstream_connect_attempts_total{upstream,result}`, and keeps the last
//! known reachability (`upstream_reachable`, and `/readyz`). [`UpstreamPool::watch`] is the
//! small task that refreshes that knowledge: while no upstream is known to be reachable, it
//! dials the targets every [`CHECK_INTERVAL`]; while one is, it sleeps until a connect fails or
//! an upstream connection is lost ([`UpstreamPool::report_lost`]), then checks once.
//!
//! The TLS client configuration comes from [`crate::tls`] and is taken afresh for each
//! connection, so a rotated CA file applies to the next one; all targets share it.
//!
//! Credentials and the vhost in the URLs are ignored: every client connection brings its own
//! SASL exchange and `connection.open`, which pass through unchanged.

pub mod order;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

use crate::config::{UpstreamConfig, redact_url_password};
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::tls::Reloadable;
use order::TargetOrder;

/// How often the reachability check dials the targets while none is known to be reachable.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// Why the upstream settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// `key` is `upstream.urls[i]` or `upstream.url`.
    #[error("{key} {url:?} is not an AMQP URL: {detail}")]
    BadUrl {
        key: String,
        url: String,
        detail: String,
    },
    #[error("upstream.urls: no upstream URL given (upstream.urls or upstream.url)")]
    NoUrl,
    #[error("upstream TLS setup: {0}")]
    Tls(String),
}

/// Where one upstream broker node listens and how to talk to it.
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
    /// Parses every upstream URL (`upstream.urls`, else `upstream.url`) in order, and prepares
    /// one TLS client for the `amqps` ones. An empty list is an error naming `upstream.urls`.
    pub fn all_from_config(config: &UpstreamConfig) -> Result<Vec<UpstreamTarget>, UpstreamError> {
        let urls = config.targets();
        if urls.is_empty() {
            return Err(UpstreamError::NoUrl);
        }
        let mut tls = None;
        let mut targets = Vec::with_capacity(urls.len());
        for (key, url) in urls {
            targets.push(Self::parse(config, &key, url, &mut tls)?);
        }
        Ok(targets)
    }

    /// The first upstream URL's target (for callers that need one address).
    pub fn from_config(config: &UpstreamConfig) -> Result<Self, UpstreamError> {
        let mut targets = Self::all_from_config(config)?;
        Ok(targets.swap_remove(0))
    }

    /// One URL (`key` names it in errors); the TLS client is created by the first `amqps`
    /// URL and shared by the others.
    fn parse(
        config: &UpstreamConfig,
        key: &str,
        url: &str,
        shared_tls: &mut Option<Arc<Reloadable<rustls::ClientConfig>>>,
    ) -> Result<Self, UpstreamError> {
        let shown = redact_url_password(url);
        let uri = AMQPUri::from_str(url).map_err(|detail| UpstreamError::BadUrl {
            key: key.to_string(),
            url: shown.clone(),
            // The parser's message may quote the URL: never with its password.
            detail: detail.replace(url, &shown),
        })?;
        let host = uri.authority.host.clone();
        if host.is_empty() {
            return Err(UpstreamError::BadUrl {
                key: key.to_string(),
                url: shown,
                detail: "no host".into(),
            });
        }
        let tls = match uri.scheme {
            AMQPScheme::AMQP => None,
            AMQPScheme::AMQPS => {
                let client = match shared_tls {
                    Some(client) => client.clone(),
                    None => {
                        let client = Arc::new(
                            crate::tls::upstream_material(&config.tls_ca_file, config.tls_verify)
                                .map_err(|e| UpstreamError::Tls(format!("{e:#}")))?,
                        );
                        *shared_tls = Some(client.clone());
                        client
                    }
                };
                Some((client, server_name(config, &host)?))
            }
        };
        Ok(UpstreamTarget {
            host,
            port: uri.authority.port,
            tls,
            connect_timeout: Duration::from_secs(config.connect_timeout_secs.max(1)),
        })
    }

    /// `host:port` for messages and the `upstream` metric label.
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
}

fn server_name(config: &UpstreamConfig, host: &str) -> Result<ServerName<'static>, UpstreamError> {
    let name = if config.tls_server_name.is_empty() {
        host
    } else {
        config.tls_server_name.as_str()
    };
    ServerName::try_from(name.to_string())
        .map_err(|e| UpstreamError::Tls(format!("server name {name:?}: {e}")))
}

/// The upstream nodes and which one to dial: every upstream connection of the proxy is opened
/// here (see the module documentation).
pub struct UpstreamPool {
    targets: Vec<Arc<UpstreamTarget>>,
    order: Mutex<TargetOrder>,
    /// The last known state: some target accepted the last dial (a client's or the check's).
    reachable: Arc<AtomicBool>,
    /// Wakes [`UpstreamPool::watch`] for a check.
    check: Notify,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for UpstreamPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool")
            .field("targets", &self.targets)
            .field("reachable", &self.is_reachable())
            .finish()
    }
}

impl UpstreamPool {
    /// The pool of the configured upstream URLs. Until the first successful dial the upstream
    /// counts as unreachable.
    pub fn from_config(
        config: &UpstreamConfig,
        metrics: Arc<Metrics>,
    ) -> Result<UpstreamPool, UpstreamError> {
        let targets: Vec<Arc<UpstreamTarget>> = UpstreamTarget::all_from_config(config)?
            .into_iter()
            .map(Arc::new)
            .collect();
        for target in &targets {
            metrics.upstream_target(&target.address());
        }
        metrics.set_upstream_reachable(false);
        Ok(UpstreamPool {
            order: Mutex::new(TargetOrder::new(targets.len())),
            targets,
            reachable: Arc::new(AtomicBool::new(false)),
            check: Notify::new(),
            metrics,
        })
    }

    /// The reloadable TLS client configuration the `amqps` targets share (for certificate
    /// rotation); `None` when every target is plain `amqp`.
    pub fn tls_material(&self) -> Option<Arc<Reloadable<rustls::ClientConfig>>> {
        self.targets.iter().find_map(|target| target.tls_material())
    }

    /// The targets, in the configured order.
    pub fn targets(&self) -> &[Arc<UpstreamTarget>] {
        &self.targets
    }

    fn order(&self) -> MutexGuard<'_, TargetOrder> {
        // The order is consistent after any panic: keep using it.
        self.order.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a connection to the first target that accepts one, in the order of
    /// [`TargetOrder::attempts`]; returns it with the target it reached. When every target
    /// fails, the error names each (`upstream HOST:PORT unreachable: ...`, joined by `; `).
    pub async fn connect(&self) -> io::Result<(UpstreamStream, Arc<UpstreamTarget>)> {
        self.connect_then(|stream| async { Ok(stream) }).await
    }

    /// [`connect`](Self::connect), where a target counts as reached only once `greet` has
    /// succeeded on its connection (a client's dial reads the node's connection.start): a
    /// node that accepts the connection and then closes it, as one going down does, or does not
    /// greet within `upstream.connect_timeout_secs`, fails like a refused dial, backs off, and
    /// the next target is dialled.
    pub async fn connect_then<T, F, Fut>(
        &self,
        mut greet: F,
    ) -> io::Result<(T, Arc<UpstreamTarget>)>
    where
        F: FnMut(UpstreamStream) -> Fut,
        Fut: Future<Output = io::Result<T>>,
    {
        let attempts = self.order().attempts(Instant::now());
        let mut failures = Vec::new();
        let mut kind = io::ErrorKind::ConnectionRefused;
        for index in attempts {
            let target = &self.targets[index];
            let attempt = match target.connect().await {
                // The greeting gets the attempt's timeout too.
                Ok(stream) => {
                    match tokio::time::timeout(target.connect_timeout, greet(stream)).await {
                        Ok(greeted) => greeted,
                        Err(_) => Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("no greeting within {:?}", target.connect_timeout),
                        )),
                    }
                }
                Err(err) => Err(err),
            };
            match attempt {
                Ok(greeted) => {
                    self.order().succeeded(index);
                    self.metrics
                        .upstream_connect_attempt(&target.address(), true);
                    self.set_reachable(true);
                    return Ok((greeted, target.clone()));
                }
                Err(err) => {
                    self.order().failed(index, Instant::now());
                    self.metrics
                        .upstream_connect_attempt(&target.address(), false);
                    tracing::warn!(upstream = %target.address(), %err, "upstream connect failed");
                    kind = err.kind();
                    failures.push(format!("upstream {} unreachable: {err}", target.address()));
                }
            }
        }
        self.set_reachable(false);
        self.check.notify_one();
        Err(io::Error::new(kind, failures.join("; ")))
    }

    /// The last known state: whether some upstream accepted the last dial.
    pub fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Acquire)
    }

    /// The flag behind [`is_reachable`](Self::is_reachable), for `/readyz`.
    pub fn reachability(&self) -> Arc<AtomicBool> {
        self.reachable.clone()
    }

    /// An upstream connection died: [`watch`](Self::watch) checks whether a node is still
    /// reachable.
    pub fn report_lost(&self) {
        self.check.notify_one();
    }

    fn set_reachable(&self, reachable: bool) {
        let was = self.reachable.swap(reachable, Ordering::AcqRel);
        self.metrics.set_upstream_reachable(reachable);
        if was != reachable {
            if reachable {
                tracing::info!("upstream reachable");
            } else {
                tracing::warn!("no upstream reachable");
            }
        }
    }

    /// Dials the targets in order until one accepts a TCP (and TLS) connection, which is
    /// closed at once; updates the dial order and the reachability. Not counted as a connect
    /// attempt.
    pub async fn check_now(&self) -> bool {
        let attempts = self.order().attempts(Instant::now());
        for index in attempts {
            if self.targets[index].connect().await.is_ok() {
                self.order().succeeded(index);
                self.set_reachable(true);
                return true;
            }
            self.order().failed(index, Instant::now());
        }
        self.set_reachable(false);
        false
    }

    /// The reachability check, until `shutdown` fires: checks at once, then every
    /// [`CHECK_INTERVAL`] while no upstream is reachable; while one is, only after a failed
    /// connect or a lost connection.
    pub async fn watch(self: Arc<Self>, mut shutdown: Shutdown) {
        loop {
            let reachable = tokio::select! {
                reachable = self.check_now() => reachable,
                _ = shutdown.recv() => return,
            };
            let wake = async {
                if reachable {
                    self.check.notified().await;
                } else {
                    tokio::time::sleep(CHECK_INTERVAL).await;
                }
            };
            tokio::select! {
                _ = wake => {}
                _ = shutdown.recv() => return,
            }
        }
    }
}

/// A connection to the upstream, plain or TLS.
#[derive(Debug)]
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

    // Vectored writes pass through: without them the outbox writes its pieces one `send`
    // each (a burst of publishes cut into several runs took five sends instead of one).
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamStream::Tcp(s) => s.is_write_vectored(),
            UpstreamStream::Tls(s) => s.is_write_vectored(),
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
mod tests;
