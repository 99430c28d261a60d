//! The embedded-mode AMQP server: an accept loop and one task per client connection.
//!
//! [`connection`] runs the handshake and the frame loop and hands each channel frame to
//! [`channel`], which turns methods into broker operations; both share the
//! [`connection_context::ConnectionContext`] the handshake produced. [`publish`] assembles
//! published content into messages, [`blocking`] holds publishers while the memory alarm is
//! raised. Bytes go out through the connection's [`crate::broker::write_queue::WriteQueue`],
//! drained by a writer task.

pub mod blocking;
pub mod channel;
pub mod connection;
pub mod connection_context;
pub mod publish;

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admission::{Admission, ConnectionSlots};
use crate::broker::Broker;
use crate::broker::auth::UserDb;
use crate::config::LimitsConfig;
use crate::shutdown::Shutdown;

/// What every connection task shares.
pub struct ServerContext {
    pub broker: Arc<Broker>,
    pub users: RwLock<Arc<UserDb>>,
    pub limits: RwLock<LimitsConfig>,
    /// `limits.max_connections`: each connection task holds a slot.
    pub connections: Arc<ConnectionSlots>,
    /// The memory alarm (true = raised), set by [`crate::memory::monitor`]; publishing
    /// connections block while it is raised ([`blocking`]).
    pub memory_alarm: watch::Sender<bool>,
    /// The disk alarm (true = raised), set by [`crate::storage::disk`]; blocks publishers
    /// the same way.
    pub disk_alarm: watch::Sender<bool>,
    /// `storage.disk_free_limit` in bytes (set at start and on reload).
    pub disk_free_limit: std::sync::atomic::AtomicU64,
}

impl ServerContext {
    pub fn new(broker: Arc<Broker>, users: UserDb, limits: LimitsConfig) -> Arc<Self> {
        let connections = ConnectionSlots::new(limits.max_connections, broker.metrics.clone());
        Arc::new(ServerContext {
            broker,
            users: RwLock::new(Arc::new(users)),
            limits: RwLock::new(limits),
            connections,
            memory_alarm: watch::Sender::new(false),
            disk_alarm: watch::Sender::new(false),
            disk_free_limit: std::sync::atomic::AtomicU64::new(0),
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

/// Runs one client connection (plain TCP or TLS) in a new task that holds one of the
/// `limits.max_connections` slots; over the limit the client is refused with 530
/// ([`crate::admission`]).
pub fn spawn_connection<S>(stream: S, peer: SocketAddr, ctx: Arc<ServerContext>, shutdown: Shutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let admission = ctx.connections.reserve(peer);
    spawn_admitted(admission, stream, peer, ctx, shutdown);
}

/// [`spawn_connection`] for a connection whose slot was reserved when it arrived (the amqps
/// listener reserves before its TLS handshake).
pub fn spawn_admitted<S>(
    admission: Admission,
    stream: S,
    peer: SocketAddr,
    ctx: Arc<ServerContext>,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let within = Duration::from_secs(ctx.limits().handshake_timeout_secs.max(1));
    let tasks = shutdown.clone();
    admission.spawn(stream, within, &tasks, move |stream| {
        connection::run(stream, peer, ctx, shutdown)
    });
}
