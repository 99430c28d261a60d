//! The embedded-mode AMQP server: an accept loop and one task per client connection.
//!
//! [`connection`] runs the handshake and the frame loop, [`channel`] turns methods into broker
//! operations, [`publish`] assembles published content into messages, [`blocking`] holds
//! publishers while the memory alarm is raised. Bytes go out through
//! the connection's [`crate::broker::outbox::Outbox`], drained by a writer task.

pub mod blocking;
pub mod channel;
pub mod connection;
pub mod publish;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::broker::Broker;
use crate::broker::auth::UserDb;
use crate::config::LimitsConfig;
use crate::shutdown::Shutdown;

/// What every connection task shares.
pub struct ServerContext {
    pub broker: Arc<Broker>,
    pub users: RwLock<Arc<UserDb>>,
    pub limits: RwLock<LimitsConfig>,
    pub connections: AtomicUsize,
    /// The memory alarm (true = raised), set by [`crate::memory::monitor`]; publishing
    /// connections block while it is raised ([`blocking`]).
    pub memory_alarm: watch::Sender<bool>,
}

impl ServerContext {
    pub fn new(broker: Arc<Broker>, users: UserDb, limits: LimitsConfig) -> Arc<Self> {
        Arc::new(ServerContext {
            broker,
            users: RwLock::new(Arc::new(users)),
            limits: RwLock::new(limits),
            connections: AtomicUsize::new(0),
            memory_alarm: watch::Sender::new(false),
        })
    }

    pub fn users(&self) -> Arc<UserDb> {
        match self.users.read() {
            Ok(u) => u.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    pub fn limits(&self) -> LimitsConfig {
        match self.limits.read() {
            Ok(l) => l.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// Accepts connections until shutdown; each one runs in its own task.
/// `stop` ends accepting; `connections` is handed to each connection (it closes them).
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<ServerContext>,
    stop: Shutdown,
    connections: Shutdown,
) {
    crate::listener::accept_tcp(listener, stop, |stream, peer| {
        spawn_connection(stream, peer, ctx.clone(), connections.clone())
    })
    .await
}

/// Runs one client connection (plain TCP or TLS) in a new task.
pub fn spawn_connection<S>(stream: S, peer: SocketAddr, ctx: Arc<ServerContext>, shutdown: Shutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let max = ctx.limits().max_connections;
    if ctx.connections.fetch_add(1, Ordering::SeqCst) >= max {
        ctx.connections.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!(%peer, max, "connection refused: max_connections reached");
        return;
    }
    tokio::spawn(async move {
        ctx.broker.metrics.connection_opened();
        connection::run(stream, peer, ctx.clone(), shutdown).await;
        ctx.broker.metrics.connection_closed();
        ctx.connections.fetch_sub(1, Ordering::SeqCst);
    });
}
