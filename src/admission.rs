//! Who may connect, shared by both modes: the `limits.max_connections` slots, the refusal a
//! client gets over the limit, and what counts as a loopback peer.
//!
//! A connection is admitted by taking a [`ConnectionSlot`] (a `tokio::sync::Semaphore` permit
//! wrapped with the open-connection count and the `connections` gauge) when it is accepted,
//! *before* its task is spawned (on the amqps listener before its TLS handshake, see
//! [`ConnectionSlots::reserve`]); the slot moves into
//! the task, so however the task ends (close, error, panic) the slot is released when the task
//! is dropped. Over the limit, the client is told so with [`refuse_client`]: the server's side
//! of the handshake up to `connection.start-ok`, then `connection.close 530 NOT_ALLOWED`
//! (RabbitMQ refuses connections over a vhost or user connection limit with 530 as well).
//! Refusals in progress are bounded too ([`MAX_REFUSALS_IN_PROGRESS`]); past that bound the
//! socket is closed at once. Every refusal is counted in
//! `connections_refused_total{reason="max_connections"}`.
//!
//! A reload may lower the limit below the number of open connections: nothing is closed, and
//! the surplus slots disappear as those connections end.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::codec::FramedRead;

use crate::amqp::codec::{FRAME_METHOD, FrameCodec, INITIAL_FRAME_MAX, decode_method, put_method};
use crate::amqp::reply::{self, AmqpError};
use crate::metrics::{Metrics, REFUSED_MAX_CONNECTIONS};
use crate::shutdown::Shutdown;

/// Most clients over the connection limit that are being told so at one time.
pub const MAX_REFUSALS_IN_PROGRESS: usize = 64;

/// Whether `ip` is a loopback address (an IPv4-mapped IPv6 loopback address counts).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(v6.is_loopback(), |v4| v4.is_loopback()),
    }
}

/// The limit and the slot debt left by a lowered limit.
#[derive(Debug)]
struct Limit {
    max: usize,
    /// Slots still to be withdrawn as connections end (the limit was lowered below the
    /// number of open connections).
    owed: usize,
}

/// The connection slots of one service (both listeners, plain and TLS, share them).
pub struct ConnectionSlots {
    slots: Arc<Semaphore>,
    limit: Mutex<Limit>,
    open: AtomicUsize,
    refusals: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

/// One admitted connection's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct ConnectionSlot {
    permit: Option<OwnedSemaphorePermit>,
    slots: Arc<ConnectionSlots>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.slots.open.fetch_sub(1, Ordering::SeqCst);
        self.slots.metrics.connection_closed();
        let mut limit = self.slots.lock();
        if let Some(permit) = self.permit.take()
            && limit.owed > 0
        {
            limit.owed -= 1;
            permit.forget();
        }
    }
}

impl std::fmt::Debug for ConnectionSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionSlots")
            .field("limit", &*self.lock())
            .field("open", &self.open())
            .finish_non_exhaustive()
    }
}

impl ConnectionSlots {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(ConnectionSlots {
            slots: Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))),
            limit: Mutex::new(Limit { max, owed: 0 }),
            open: AtomicUsize::new(0),
            refusals: Arc::new(Semaphore::new(MAX_REFUSALS_IN_PROGRESS)),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Limit> {
        // The guarded numbers are updated in one step: a poisoned lock still holds valid ones.
        self.limit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection, or `None` at the limit.
    pub fn admit(self: &Arc<Self>) -> Option<ConnectionSlot> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        self.open.fetch_add(1, Ordering::SeqCst);
        self.metrics.connection_opened();
        Some(ConnectionSlot {
            permit: Some(permit),
            slots: self.clone(),
        })
    }

    /// Connections holding a slot now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// The current limit.
    pub fn max(&self) -> usize {
        self.lock().max
    }

    /// Applies a new limit (configuration reload). Open connections are never closed: when
    /// the limit drops below them, slots are withdrawn as they end.
    pub fn set_max(&self, max: usize) {
        let max = max.min(Semaphore::MAX_PERMITS);
        let mut limit = self.lock();
        if max >= limit.max {
            let mut more = max - limit.max;
            let cancelled = more.min(limit.owed);
            limit.owed -= cancelled;
            more -= cancelled;
            self.slots.add_permits(more);
        } else {
            let fewer = limit.max - max;
            let withdrawn = self.slots.forget_permits(fewer);
            limit.owed += fewer - withdrawn;
        }
        limit.max = max;
    }

    /// Runs `serve` on an admitted connection in its own task, which owns the slot; over the
    /// limit the client is refused (see the module documentation). `within` bounds a refusal.
    /// Both tasks join the tracker of `shutdown`, so the service waits for them.
    pub fn spawn<S, F, Fut>(
        self: &Arc<Self>,
        stream: S,
        peer: SocketAddr,
        within: Duration,
        shutdown: &Shutdown,
        serve: F,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: FnOnce(S) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.reserve(peer).spawn(stream, within, shutdown, serve);
    }

    /// Decides what becomes of a connection that just arrived, before anything is read from
    /// it: a slot, or a refusal (counted and logged here), or, with too many refusals in
    /// progress, nothing (the caller closes the socket). The amqps listener reserves before
    /// its TLS handshake, so handshakes in progress are bounded by the same slots.
    pub fn reserve(self: &Arc<Self>, peer: SocketAddr) -> Admission {
        if let Some(slot) = self.admit() {
            return Admission::Admitted(slot);
        }
        let max = self.max();
        self.metrics.connection_refused(REFUSED_MAX_CONNECTIONS);
        tracing::warn!(%peer, max, "connection refused: limits.max_connections reached");
        match self.refusals.clone().try_acquire_owned() {
            Ok(permit) => Admission::Refused { max, permit },
            // Too many refusals at once: the socket is dropped (closed).
            Err(_) => Admission::Dropped,
        }
    }
}

/// What [`ConnectionSlots::reserve`] decided for a new connection.
#[derive(Debug)]
pub enum Admission {
    /// It has a slot.
    Admitted(ConnectionSlot),
    /// Over the limit: it is told so (one of the bounded refusals in progress).
    Refused {
        max: usize,
        permit: OwnedSemaphorePermit,
    },
    /// Over the limit with too many refusals in progress: closed without a word.
    Dropped,
}

impl Admission {
    /// Whether the connection is closed without a word ([`Admission::Dropped`]).
    pub fn is_dropped(&self) -> bool {
        matches!(self, Admission::Dropped)
    }

    /// Runs `serve` on the connection in its own task, which owns the slot, or refuses it;
    /// `within` bounds a refusal. The task joins the tracker of `shutdown`.
    pub fn spawn<S, F, Fut>(self, stream: S, within: Duration, shutdown: &Shutdown, serve: F)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: FnOnce(S) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        match self {
            Admission::Admitted(slot) => {
                let connection = serve(stream);
                shutdown.spawn(async move {
                    let _slot = slot;
                    connection.await;
                });
            }
            Admission::Refused { max, permit } => {
                shutdown.spawn(async move {
                    let _permit = permit;
                    let refusal =
                        AmqpError::not_allowed(format!("connection limit ({max}) is reached"));
                    refuse_client(stream, &refusal, within).await;
                });
            }
            Admission::Dropped => {}
        }
    }
}

/// The `connection.start` of a server that only refuses.
fn refusing_start() -> AMQPClass {
    let mut capabilities = FieldTable::default();
    for capability in ["connection.blocked", "authentication_failure_close"] {
        capabilities.insert(ShortString::from(capability), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    properties.insert(
        ShortString::from("capabilities"),
        AMQPValue::FieldTable(capabilities),
    );
    properties.insert(
        ShortString::from("product"),
        AMQPValue::LongString(LongString::from("dlx-proxy")),
    );
    AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: properties,
        mechanisms: LongString::from("PLAIN AMQPLAIN"),
        locales: LongString::from("en_US"),
    }))
}

/// Plays the server's side of the handshake just far enough to refuse the client with a
/// `connection.close` carrying `refusal`: reads the protocol header (unless `header_read`),
/// sends `connection.start`, waits for `start-ok`, sends the close and waits briefly for
/// close-ok. Bounded by `within`; the socket is closed at the end.
pub async fn refuse_client<S>(client: S, refusal: &AmqpError, within: Duration)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    refuse_after_header(client, refusal, within, false).await
}

/// [`refuse_client`] for a client whose protocol header was already read.
pub async fn refuse_client_after_header<S>(client: S, refusal: &AmqpError, within: Duration)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    refuse_after_header(client, refusal, within, true).await
}

async fn refuse_after_header<S>(client: S, refusal: &AmqpError, within: Duration, header_read: bool)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut reader, mut writer) = tokio::io::split(client);
    let exchange = async {
        if !header_read {
            let mut header = [0u8; 8];
            tokio::io::AsyncReadExt::read_exact(&mut reader, &mut header).await?;
            if header != crate::amqp::codec::PROTOCOL_HEADER {
                writer
                    .write_all(&crate::amqp::codec::PROTOCOL_HEADER)
                    .await?;
                return Ok(());
            }
        }
        // A client being refused is never tuned: its frames are the small ones of a handshake.
        let mut frames = FramedRead::new(reader, FrameCodec::new(INITIAL_FRAME_MAX));
        let mut out = BytesMut::new();
        put_method(&mut out, 0, refusing_start());
        writer.write_all(&out).await?;
        // Wait for start-ok (or anything that is not a handshake reply), then close.
        while let Some(frame) = frames.next().await {
            let frame = frame.map_err(std::io::Error::other)?;
            if frame.kind == FRAME_METHOD && frame.channel == 0 {
                break;
            }
        }
        let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: refusal.code,
            reply_text: ShortString::try_new(refusal.short_text())
                .unwrap_or_else(|_| ShortString::from(reply::reply_name(refusal.code))),
            class_id: 0,
            method_id: 0,
        }));
        out.clear();
        put_method(&mut out, 0, close);
        writer.write_all(&out).await?;
        writer.flush().await?;
        // Give the client a moment to answer close-ok before the socket goes.
        while let Some(Ok(frame)) = frames.next().await {
            if frame.kind == FRAME_METHOD
                && matches!(
                    decode_method(&frame.payload),
                    Some(AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                )
            {
                break;
            }
        }
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(within, exchange).await;
    let _ = writer.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(max: usize) -> Arc<ConnectionSlots> {
        ConnectionSlots::new(max, Metrics::new(10))
    }

    #[test]
    fn loopback_addresses() {
        assert!(is_loopback("127.0.0.1".parse().unwrap()));
        assert!(is_loopback("127.0.0.2".parse().unwrap()));
        assert!(is_loopback("::1".parse().unwrap()));
        assert!(is_loopback("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!is_loopback("10.0.0.1".parse().unwrap()));
        assert!(!is_loopback("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!is_loopback("fe80::1".parse().unwrap()));
    }

    #[test]
    fn slots_are_released_when_dropped() {
        let slots = slots(2);
        let a = slots.admit().unwrap();
        let b = slots.admit().unwrap();
        assert!(slots.admit().is_none());
        assert_eq!(slots.open(), 2);
        drop(a);
        assert_eq!(slots.open(), 1);
        let c = slots.admit().unwrap();
        drop((b, c));
        assert_eq!(slots.open(), 0);
    }

    #[test]
    fn a_lowered_limit_withdraws_slots_as_connections_end() {
        let slots = slots(3);
        let a = slots.admit().unwrap();
        let b = slots.admit().unwrap();
        slots.set_max(1);
        assert!(slots.admit().is_none());
        drop(a);
        // One connection open at limit one: no room.
        assert!(slots.admit().is_none());
        drop(b);
        let c = slots.admit().unwrap();
        assert!(slots.admit().is_none());
        slots.set_max(3);
        let d = slots.admit().unwrap();
        let e = slots.admit().unwrap();
        assert!(slots.admit().is_none());
        drop((c, d, e));
        assert_eq!(slots.open(), 0);
    }

    #[test]
    fn raising_a_lowered_limit_cancels_the_debt_first() {
        let slots = slots(2);
        let a = slots.admit().unwrap();
        let b = slots.admit().unwrap();
        slots.set_max(0);
        slots.set_max(1);
        drop(a);
        assert!(
            slots.admit().is_none(),
            "one connection still open at limit 1"
        );
        drop(b);
        let c = slots.admit().unwrap();
        assert!(slots.admit().is_none());
        drop(c);
    }

    #[tokio::test]
    async fn a_panicking_connection_task_frees_its_slot() {
        let slots = slots(1);
        let slot = slots.admit().unwrap();
        let task = tokio::spawn(async move {
            let _slot = slot;
            panic!("connection task fails");
        });
        assert!(task.await.is_err());
        assert_eq!(slots.open(), 0);
        assert!(slots.admit().is_some());
    }
}
