//! A redrive pass in proxy mode ([`crate::redrive`] registers and reports the job): the proxy
//! opens its own upstream connection for the vhost, logged in as the service identity
//! (`upstream.user`, through the same pool and handshake as the service connections,
//! [`super::service`]), and moves the messages of the dead-letter queue with AMQP:
//!
//! - channel 1 consumes the dead-letter queue with a prefetch of [`WINDOW`]; each delivery is
//!   decided by the same pure plan as in embedded mode ([`crate::redrive::plan`]);
//! - channel 2 is a [`Publisher`] in confirm mode: a message to move is published to the
//!   default exchange with its target's name as routing key, `mandatory`, its properties with
//!   `x-redriven-count` one higher and no `x-retry-count`, x-death kept; publishes are
//!   pipelined, paced by the token
//!   bucket. The dead-letter delivery is acked only once its publish is confirmed. A publish
//!   that comes back with basic.return (no such queue) fails as `no_queue`, a nack (a target
//!   at a `reject-publish` length limit) as `target_full`;
//! - skipped and failed messages (and, in a dry run, every message) stay unacked until the end
//!   of the pass, then one `basic.nack multiple requeue=true` gives them back; RabbitMQ puts
//!   them back at their place, marked redelivered. A consumer whose whole window is held by
//!   such messages gets no more deliveries, so the pass then starts a new consumer (with a
//!   window of its own) and cancels the full one: messages left behind cost no window;
//! - the pass ends once as many messages were looked at as the queue held at the start (its
//!   passive declare's `message_count`), or at the `max`, or on cancel (messages waiting for
//!   their publish are given back too). When another consumer takes messages the pass counted,
//!   the pass ends once no delivery came for `pass::IDLE` with room in its window.
//!
//! The bookkeeping of a pass (frames in, frames out, no socket) is `pass`; this file dials,
//! logs in and moves the bytes.
//!
//! At-least-once: when the connection breaks (the proxy crashes, the upstream goes away) the
//! upstream requeues every delivery not acked; a message whose publish was confirmed but whose
//! ack did not get out is then in both queues (a duplicate), never in neither.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, channel, connection, queue};
use amq_protocol::types::{FieldTable, ShortString};
use bytes::BytesMut;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio_util::sync::CancellationToken;

mod pass;

use pass::PassState;

use super::ProxyShared;
use super::publisher::Publisher;
use super::service::handshake;
use super::service::handshake::ClientHandshake;
use super::upstream::UpstreamStream;
use super::wire::{FrameReader, WireFrame, method_frame, upstream_frame_limit};
use crate::amqp::codec::{FRAME_METHOD, decode_method, put_heartbeat};
use crate::amqp::reply;
use crate::config::ServiceIdentity;
use crate::redrive::bucket::TokenBucket;
use crate::redrive::plan::Plan;

/// Deliveries a consumer of the pass holds unacked at most (its prefetch).
pub const WINDOW: u16 = 256;
/// The channel that consumes the dead-letter queue.
pub const CONSUME_CHANNEL: u16 = 1;
/// The channel that publishes the moved messages (confirm mode).
pub const PUBLISH_CHANNEL: u16 = 2;
/// How long the upstream gets to answer connection.close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Why a pass could not start.
#[derive(Debug)]
pub enum OpenError {
    /// The dead-letter queue does not exist upstream (404).
    NotFound(String),
    /// The upstream could not be reached or refused the login.
    Upstream(String),
}

/// What a pass did since its last report.
#[derive(Debug, Default)]
pub struct Progress {
    pub examined: u64,
    pub moved: Vec<String>,
    pub skipped: u64,
    pub failed: Vec<&'static str>,
}

/// What a pass does.
pub struct Pass {
    pub plan: Plan,
    pub dry_run: bool,
    /// Moves a second at most.
    pub rate: Option<f64>,
    /// Moves at most.
    pub max: Option<u64>,
    pub cancel: CancellationToken,
}

/// How a pass ended.
#[derive(Debug, PartialEq, Eq)]
pub enum PassEnd {
    Done,
    Cancelled,
}

/// The pass's own upstream connection, its consume channel open and the queue's length read.
pub struct RedriveConnection {
    reader: FrameReader<ReadHalf<UpstreamStream>>,
    write: WriteHalf<UpstreamStream>,
    frame_max: u32,
    heartbeat: Option<Duration>,
    confirm_timeout: Duration,
    timeout: Duration,
    queue: String,
    /// Messages in the queue when it was opened.
    pub total: u64,
}

/// Connects, logs in to `vhost` and reads the length of `queue` (passive declare).
pub async fn open(
    shared: &ProxyShared,
    identity: &ServiceIdentity,
    vhost: &str,
    queue: &str,
) -> Result<RedriveConnection, OpenError> {
    let (stream, _) = shared
        .upstream
        .connect()
        .await
        .map_err(|e| OpenError::Upstream(format!("upstream: {e}")))?;
    let (read, mut write) = tokio::io::split(stream);
    let mut reader = FrameReader::new(read, shared.handshake_frame_max);
    let login = ClientHandshake::new(
        identity.clone(),
        vhost,
        format!("dlx-proxy redrive {vhost} {queue}"),
    );
    let tuned = tokio::time::timeout(
        shared.handshake_timeout,
        handshake(&mut reader, &mut write, login),
    )
    .await
    .map_err(|_| OpenError::Upstream("upstream login did not complete in time".into()))?
    .map_err(|e| OpenError::Upstream(format!("upstream login to vhost {vhost:?}: {e}")))?;
    reader.set_frame_max(upstream_frame_limit(tuned.frame_max));
    let mut conn = RedriveConnection {
        reader,
        write,
        frame_max: tuned.frame_max,
        heartbeat: (tuned.heartbeat > 0).then(|| Duration::from_secs(u64::from(tuned.heartbeat))),
        confirm_timeout: shared.confirm_timeout,
        timeout: shared.handshake_timeout,
        queue: queue.to_string(),
        total: 0,
    };
    let name = ShortString::try_new(queue.to_string())
        .map_err(|_| OpenError::NotFound(format!("no queue {queue:?}: name too long")))?;
    let mut out = BytesMut::new();
    out.extend_from_slice(&method_frame(
        CONSUME_CHANNEL,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    out.extend_from_slice(&method_frame(
        CONSUME_CHANNEL,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name,
            passive: true,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    ));
    conn.send(&out).await.map_err(OpenError::Upstream)?;
    conn.expect((20, 11), vhost).await?;
    if let AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) = conn.expect((50, 11), vhost).await?
    {
        conn.total = u64::from(ok.message_count);
    }
    Ok(conn)
}

impl RedriveConnection {
    async fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.write
            .write_all(bytes)
            .await
            .map_err(|e| format!("upstream write: {e}"))
    }

    async fn next_frame(&mut self) -> Result<WireFrame, String> {
        match self.reader.next().await {
            Some(Ok(frame)) => Ok(frame),
            Some(Err(e)) => Err(format!("upstream: {e}")),
            None => Err("the upstream closed the connection".into()),
        }
    }

    /// Waits for method `ids` on the consume channel; a channel or connection close is the
    /// error (404: the queue is missing).
    async fn expect(&mut self, ids: (u16, u16), vhost: &str) -> Result<AMQPClass, OpenError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let frame = tokio::time::timeout_at(deadline, self.next_frame())
                .await
                .map_err(|_| OpenError::Upstream("the upstream did not answer in time".into()))?
                .map_err(OpenError::Upstream)?;
            if frame.kind != FRAME_METHOD {
                continue;
            }
            match decode_method(frame.payload()) {
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close)))
                    if close.reply_code == reply::NOT_FOUND =>
                {
                    return Err(OpenError::NotFound(format!(
                        "no queue {:?} in vhost {vhost:?} upstream",
                        self.queue
                    )));
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    return Err(OpenError::Upstream(format!(
                        "upstream: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    )));
                }
                Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                    return Err(OpenError::Upstream(format!(
                        "upstream closed the connection: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    )));
                }
                Some(method) if frame.channel == CONSUME_CHANNEL && frame.method_ids() == ids => {
                    return Ok(method);
                }
                _ => {}
            }
        }
    }

    /// Runs the pass (see the module comment), reporting each step to `report`.
    pub async fn run(
        mut self,
        pass: Pass,
        mut report: impl FnMut(Progress),
    ) -> Result<PassEnd, String> {
        let mut state = PassState::new(
            &self.queue,
            self.total,
            &pass,
            Publisher::new(
                PUBLISH_CHANNEL,
                self.frame_max as usize,
                self.confirm_timeout,
            ),
        )?;
        let mut bucket = pass.rate.map(|rate| {
            let burst = (rate / 10.0).ceil() as u64;
            TokenBucket::new(rate, burst.clamp(1, u64::from(WINDOW)), Instant::now())
        });
        let mut last_tx = Instant::now();
        let mut last_rx = Instant::now();
        loop {
            let over = state.step(bucket.as_mut(), Instant::now(), &mut report)?;
            if !state.out.is_empty() {
                let out = std::mem::take(&mut state.out);
                self.send(&out).await?;
                last_tx = Instant::now();
            }
            if over {
                break;
            }
            let now = Instant::now();
            let mut wake = now + Duration::from_secs(30);
            if let Some(at) = state.idle_until() {
                wake = wake.min(at);
            }
            if let Some(at) = state.publisher.next_deadline() {
                wake = wake.min(at);
            }
            if state.waiting()
                && let Some(b) = &mut bucket
            {
                wake = wake.min(now + b.wait(now));
            }
            if let Some(interval) = self.heartbeat {
                wake = wake.min(last_tx + interval / 2).min(last_rx + interval * 2);
            }
            tokio::select! {
                frame = self.reader.next() => {
                    last_rx = Instant::now();
                    let frame = match frame {
                        Some(Ok(frame)) => frame,
                        Some(Err(e)) => return Err(format!("upstream: {e}")),
                        None => return Err("the upstream closed the connection".into()),
                    };
                    state.on_frame(&frame, &pass, &mut report)?;
                }
                () = tokio::time::sleep_until(wake.into()) => {
                    let now = Instant::now();
                    state.expire(now, &mut report)?;
                    if let Some(interval) = self.heartbeat {
                        if now >= last_rx + interval * 2 {
                            return Err("the upstream missed its heartbeats".into());
                        }
                        if now >= last_tx + interval / 2 {
                            put_heartbeat(&mut state.out);
                        }
                    }
                }
                () = pass.cancel.cancelled(), if !state.cancelled => state.cancelled = true,
            }
        }
        // Everything not moved goes back, in its order; then the connection closes.
        state.give_back();
        state.out.extend_from_slice(&method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: reply::REPLY_SUCCESS,
                reply_text: ShortString::from("redrive pass over"),
                class_id: 0,
                method_id: 0,
            })),
        ));
        let out = std::mem::take(&mut state.out);
        self.send(&out).await?;
        let _ = tokio::time::timeout(CLOSE_GRACE, async {
            while let Ok(frame) = self.next_frame().await {
                if frame.channel == 0 && frame.method_ids() == (10, 51) {
                    break;
                }
            }
        })
        .await;
        Ok(if state.cancelled {
            PassEnd::Cancelled
        } else {
            PassEnd::Done
        })
    }
}
