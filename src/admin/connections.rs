//! The admin server's accept loop: HTTP/1 connections served by hyper with the admin router,
//! at most [`MAX_ADMIN_CONNECTIONS`] at a time, each with [`HEADER_READ_TIMEOUT`] to send a
//! request's headers. The admin port is often reachable from the whole cluster network: without
//! these, clients that open connections and send half a request would hold a file descriptor
//! each for ever, until the AMQP listener and the storage could open none.
//!
//! One peer address holds at most [`MAX_ADMIN_CONNECTIONS_PER_PEER`] of them: past that its
//! new connections are closed at once (counted in
//! `connections_refused_total{reason="admin_per_peer"}`), so one client, however many
//! connections it opens or keeps busy, cannot take every slot and starve the kubelet's
//! `/healthz` and `/readyz` probes or the Prometheus scrape, which come from other addresses.
//!
//! On shutdown the loop stops accepting and asks every connection to end after its current
//! request, waiting at most [`SHUTDOWN_GRACE`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

use crate::metrics::{Metrics, REFUSED_ADMIN_PER_PEER};
use crate::shutdown::Shutdown;

/// Admin connections served at once; further clients wait in the listen backlog.
pub const MAX_ADMIN_CONNECTIONS: usize = 256;
/// Admin connections one peer address may hold at once (a quarter of the slots).
pub const MAX_ADMIN_CONNECTIONS_PER_PEER: usize = MAX_ADMIN_CONNECTIONS / 4;
/// Time a client has to send a request's headers (the first, and each on a kept-alive
/// connection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open connections get to finish their requests once shutdown fires, or once
/// they reach [`MAX_CONNECTION_AGE`].
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long one connection is served: then it is asked to end after its current request
/// (and dropped after [`SHUTDOWN_GRACE`]), so a client that keeps a connection busy or never
/// reads its answer holds a slot for a bounded time. Scrapers and probes reconnect.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// The bounds of the accept loop.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub max_per_peer: usize,
    pub header_read_timeout: Duration,
    pub max_age: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: MAX_ADMIN_CONNECTIONS,
            max_per_peer: MAX_ADMIN_CONNECTIONS_PER_PEER,
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_age: MAX_CONNECTION_AGE,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    metrics: Arc<Metrics>,
    limits: ConnectionLimits,
    mut shutdown: Shutdown,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let peers = Arc::new(PeerCounts::default());
    let connections = TaskTracker::new();
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = shutdown.recv() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => (stream, peer.ip()),
                Err(err) => {
                    // A connection that failed before it was accepted: the next one at once.
                    // Out of file descriptors or memory: try again shortly.
                    if !is_connection_error(&err) {
                        tracing::warn!(%err, "admin server: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
            _ = shutdown.recv() => break,
        };
        let Some(peer_slot) = peers.take(peer, limits.max_per_peer) else {
            metrics.connection_refused(REFUSED_ADMIN_PER_PEER);
            tracing::debug!(%peer, "admin server: connection refused, the peer holds its share");
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let mut stop = shutdown.clone();
        let metrics = metrics.clone();
        connections.spawn(async move {
            let _peer_slot = peer_slot;
            metrics.add_admin_connections(1);
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let finished = tokio::select! {
                result = connection.as_mut() => Some(result),
                _ = stop.recv() => None,
                _ = tokio::time::sleep(limits.max_age) => None,
            };
            if finished.is_none() {
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection).await;
            }
            metrics.add_admin_connections(-1);
            drop(slot);
        });
    }
    connections.close();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, connections.wait()).await;
    Ok(())
}

/// The admin connections each peer address holds now (an entry per address with at least
/// one, so at most as many entries as slots).
#[derive(Default)]
struct PeerCounts {
    held: Mutex<HashMap<IpAddr, usize>>,
}

impl PeerCounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One more connection for `peer`, unless it holds `max` already.
    fn take(self: &Arc<Self>, peer: IpAddr, max: usize) -> Option<PeerSlot> {
        let mut held = self.lock();
        let count = held.entry(peer).or_insert(0);
        if *count >= max.max(1) {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            peer,
        })
    }
}

/// One connection's share of its peer's count; dropping it gives the share back.
struct PeerSlot {
    peers: Arc<PeerCounts>,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.peers.lock();
        if let Some(count) = held.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

/// Whether an accept error concerns only the connection being accepted (the peer reset or
/// aborted it), not the listener's means.
fn is_connection_error(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        err.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shutdown::ShutdownTrigger;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn started(
        limits: ConnectionLimits,
    ) -> (std::net::SocketAddr, Arc<Metrics>, ShutdownTrigger) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let metrics = Metrics::new(10);
        let trigger = ShutdownTrigger::new();
        let app = Router::new().route("/healthz", get(|| async { "ok" }));
        tokio::spawn(serve(
            listener,
            app,
            metrics.clone(),
            limits,
            trigger.subscribe(),
        ));
        (address, metrics, trigger)
    }

    /// What the server sends on `stream` until it closes it (at most 5 s).
    async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got))
            .await
            .expect("the server closes the connection")
            .expect("read");
        got
    }

    async fn healthz(address: std::net::SocketAddr) -> Vec<u8> {
        healthz_on(TcpStream::connect(address).await.unwrap()).await
    }

    /// A /healthz request on `stream`; what the server sends until it closes.
    async fn healthz_on(mut stream: TcpStream) -> Vec<u8> {
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        until_closed(&mut stream).await
    }

    /// A client that sends half a request head is closed after the header timeout.
    #[tokio::test]
    async fn half_a_request_head_is_closed_after_the_header_timeout() {
        let limits = ConnectionLimits {
            max_connections: 4,
            max_per_peer: 4,
            header_read_timeout: Duration::from_millis(200),
            max_age: Duration::from_secs(60),
        };
        let (address, _metrics, _trigger) = started(limits).await;
        let mut slow = TcpStream::connect(address).await.unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        let answer = until_closed(&mut slow).await;
        assert!(!answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
        assert!(healthz(address).await.starts_with(b"HTTP/1.1 200"));
    }

    /// Past the connection limit a client waits until a slot frees up; the gauge counts the
    /// open connections.
    #[tokio::test]
    async fn connections_past_the_limit_wait_for_a_free_slot() {
        let limits = ConnectionLimits {
            max_connections: 2,
            max_per_peer: 2,
            header_read_timeout: Duration::from_secs(60),
            max_age: Duration::from_secs(60),
        };
        let (address, metrics, _trigger) = started(limits).await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(TcpStream::connect(address).await.unwrap());
        }
        let gauge = || {
            metrics
                .encode()
                .lines()
                .any(|l| l == "dlx_proxy_admin_connections 2")
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !gauge() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}",
                metrics.encode()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let waiting = tokio::spawn(healthz(address));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "a third connection was served");
        drop(idle.pop());
        let answer = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("served once a slot is free")
            .unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    }

    /// A client that keeps its connection busy (a request every so often, within the header
    /// timeout) is closed once the connection reaches its age.
    #[tokio::test]
    async fn a_kept_alive_connection_ends_at_its_age() {
        let limits = ConnectionLimits {
            max_connections: 4,
            max_per_peer: 4,
            header_read_timeout: Duration::from_secs(60),
            max_age: Duration::from_millis(300),
        };
        let (address, _metrics, _trigger) = started(limits).await;
        let mut busy = TcpStream::connect(address).await.unwrap();
        let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
        busy.write_all(request).await.unwrap();
        let mut answer = [0u8; 12];
        busy.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"HTTP/1.1 200");
        // Past its age the server ends the connection after the answer it owes.
        let rest = until_closed(&mut busy).await;
        assert!(rest.ends_with(b"ok"), "{rest:?}");
    }

    /// One peer address holds at most its share of the slots: its next connection is closed
    /// at once and counted, while another address is still served.
    #[tokio::test]
    async fn one_peer_holds_at_most_its_share_of_the_slots() {
        let limits = ConnectionLimits {
            max_connections: 4,
            max_per_peer: 2,
            header_read_timeout: Duration::from_secs(60),
            max_age: Duration::from_secs(60),
        };
        let (address, metrics, _trigger) = started(limits).await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(TcpStream::connect(address).await.unwrap());
        }
        let mut third = TcpStream::connect(address).await.unwrap();
        let refused = until_closed(&mut third).await;
        assert!(refused.is_empty(), "{refused:?}");
        let counted = "dlx_proxy_connections_refused_total{reason=\"admin_per_peer\"} 1";
        assert!(
            metrics.encode().lines().any(|l| l == counted),
            "{}",
            metrics.encode()
        );
        // Another address (127.0.0.2 is loopback too) gets a slot of its own.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let answer = healthz_on(socket.connect(address).await.unwrap()).await;
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
        // A connection that ends gives its share back.
        drop(idle.pop());
        let served = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if healthz(address).await.starts_with(b"HTTP/1.1 200") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(served.is_ok(), "no slot after a connection ended");
    }
}
