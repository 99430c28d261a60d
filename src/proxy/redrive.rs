//! A redrive pass in proxy mode ([`crate::redrive`] registers and reports the job): the proxy
//! opens its own upstream connection for the vhost, logged in as the service identity
//! (`upstream.user`, through the same pool and handshake as the service connections,
//! [`super::service`]), and moves the messages of the dead-letter queue with AMQP:
//!
//! - channel 1 consumes the dead-letter queue with a prefetch of [`WINDOW`]; each delivery is
//!   decided by the same pure plan as in embedded mode ([`crate::redrive::plan`]);
//! - channel 2 is a [`Publisher`] in confirm mode: a message to move is published to the
//!   default exchange with its target's name as routing key, `mandatory`, its properties with
//!   `x-redriven-count` one higher, x-death kept; publishes are pipelined, paced by the token
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
//!   their publish are given back too).
//!
//! At-least-once: when the connection breaks (the proxy crashes, the upstream goes away) the
//! upstream requeues every delivery not acked; a message whose publish was confirmed but whose
//! ack did not get out is then in both queues (a duplicate), never in neither.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, basic, channel, connection, queue};
use amq_protocol::types::{FieldTable, ShortString};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio_util::sync::CancellationToken;

use super::ProxyShared;
use super::publisher::{NACKED, Outcome, OutgoingMessage, Publisher};
use super::service::handshake;
use super::service::handshake::ClientHandshake;
use super::upstream::UpstreamStream;
use super::wire::{FrameReader, WireFrame, content_body_size, method_frame};
use crate::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, decode_method, put_heartbeat};
use crate::amqp::content::{BodyCollector, encode_properties_from, parse_content_header};
use crate::amqp::reply;
use crate::config::ServiceIdentity;
use crate::redrive::bucket::TokenBucket;
use crate::redrive::plan::{Decision, Plan, stamp};

/// Deliveries a consumer of the pass holds unacked at most (its prefetch).
pub const WINDOW: u16 = 256;
const CONSUME_CHANNEL: u16 = 1;
const PUBLISH_CHANNEL: u16 = 2;
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

/// A message on its way in (a delivery's method, header and body frames).
struct Incoming {
    tag: u64,
    consumer_tag: String,
    header: Option<Bytes>,
    body: Option<BodyCollector>,
}

/// A message decided to move, waiting for a token.
struct Pending {
    tag: u64,
    /// The consumer it was delivered to.
    consumer: u64,
    message: OutgoingMessage,
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
    reader.set_frame_max(tuned.frame_max);
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
            match decode_method(&frame.payload) {
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
        let mut state = PassState {
            publisher: Publisher::new(
                PUBLISH_CHANNEL,
                self.frame_max as usize,
                self.confirm_timeout,
            ),
            inflight: HashMap::new(),
            pending: VecDeque::new(),
            incoming: None,
            seen: 0,
            left: pass.max.unwrap_or(u64::MAX),
            consumer: 0,
            kept_here: 0,
            consuming: false,
            left_behind: 0,
            cancelled: false,
            out: BytesMut::new(),
            queue: self.queue.clone(),
            total: self.total,
        };
        if !pass.dry_run {
            state.out.extend_from_slice(&state.publisher.open_frames());
        }
        state.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: WINDOW,
                global: false,
            })),
        ));
        if self.total > 0 {
            state.consume()?;
        }
        let mut bucket = pass.rate.map(|rate| {
            let burst = (rate / 10.0).ceil() as u64;
            TokenBucket::new(rate, burst.clamp(1, u64::from(WINDOW)), Instant::now())
        });
        let mut last_tx = Instant::now();
        let mut last_rx = Instant::now();
        loop {
            let reading_done = state.seen >= self.total || state.left == 0 || state.cancelled;
            if reading_done && state.consuming {
                state.cancel_consumer();
            }
            if !reading_done && !state.consuming {
                // Failed publishes gave back some of the max: carry on reading.
                state.consume()?;
            }
            if state.cancelled {
                for p in state.pending.drain(..) {
                    state.left_behind = state.left_behind.max(p.tag);
                }
            }
            // Publish what the rate allows.
            while let Some(p) = state.pending.front() {
                let now = Instant::now();
                if let Some(b) = &mut bucket
                    && b.take(1, now) == 0
                {
                    break;
                }
                let tag = p.tag;
                match state.publisher.publish(tag, &p.message, now) {
                    Ok(bytes) => {
                        state.out.extend_from_slice(&bytes);
                        state
                            .inflight
                            .insert(tag, (p.message.routing_key.clone(), p.consumer));
                    }
                    Err(_) => {
                        // A name longer than a short string: no such queue can exist.
                        state.left_behind = state.left_behind.max(tag);
                        state.left = state.left.saturating_add(1);
                        report(Progress {
                            failed: vec!["no_queue"],
                            ..Progress::default()
                        });
                    }
                }
                state.pending.pop_front();
            }
            if !state.out.is_empty() {
                let out = std::mem::take(&mut state.out);
                self.send(&out).await?;
                last_tx = Instant::now();
            }
            if reading_done && state.pending.is_empty() && state.publisher.unconfirmed() == 0 {
                break;
            }
            let now = Instant::now();
            let mut wake = now + Duration::from_secs(30);
            if let Some(at) = state.publisher.next_deadline() {
                wake = wake.min(at);
            }
            if !state.pending.is_empty()
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
                    for settled in state.publisher.expire(now) {
                        state.settle(settled.op, &settled.outcome, &mut report)?;
                    }
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
        if state.left_behind > 0 {
            state.out.extend_from_slice(&method_frame(
                CONSUME_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: state.left_behind,
                    multiple: true,
                    requeue: true,
                })),
            ));
        }
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

/// The bookkeeping of a running pass.
struct PassState {
    publisher: Publisher,
    /// The target and consumer of each publish in flight, by dead-letter delivery tag.
    inflight: HashMap<u64, (String, u64)>,
    pending: VecDeque<Pending>,
    incoming: Option<Incoming>,
    /// Messages looked at.
    seen: u64,
    /// Moves still allowed (in flight and waiting ones taken off).
    left: u64,
    /// The current consumer's number and the deliveries it holds that stay.
    consumer: u64,
    kept_here: u16,
    consuming: bool,
    /// The highest delivery tag that is not acked (the end's nack covers it and all before).
    left_behind: u64,
    cancelled: bool,
    out: BytesMut,
    queue: String,
    total: u64,
}

fn consumer_tag(n: u64) -> String {
    format!("dlx-proxy-redrive-{n}")
}

impl PassState {
    /// Starts the next consumer (with a window of its own) and cancels the current one.
    fn consume(&mut self) -> Result<(), String> {
        if self.consuming {
            self.cancel_consumer();
        }
        self.consumer += 1;
        self.kept_here = 0;
        self.consuming = true;
        let queue = ShortString::try_new(self.queue.clone()).map_err(|_| "queue name too long")?;
        self.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue,
                consumer_tag: ShortString::from(consumer_tag(self.consumer)),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ));
        Ok(())
    }

    fn cancel_consumer(&mut self) {
        self.consuming = false;
        self.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: ShortString::from(consumer_tag(self.consumer)),
                nowait: false,
            })),
        ));
    }

    fn on_frame(
        &mut self,
        frame: &WireFrame,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        match frame.channel {
            0 => {
                if frame.kind == FRAME_METHOD
                    && let Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) =
                        decode_method(&frame.payload)
                {
                    return Err(format!(
                        "the upstream closed the connection: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    ));
                }
            }
            PUBLISH_CHANNEL => {
                let step = self.publisher.on_frame(frame);
                if let Some(bytes) = step.write {
                    self.out.extend_from_slice(&bytes);
                }
                for settled in step.settled {
                    self.settle(settled.op, &settled.outcome, report)?;
                }
            }
            CONSUME_CHANNEL => self.on_consume_frame(frame, pass, report)?,
            _ => {}
        }
        Ok(())
    }

    fn on_consume_frame(
        &mut self,
        frame: &WireFrame,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        match frame.kind {
            FRAME_METHOD => match decode_method(&frame.payload) {
                Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    self.incoming = Some(Incoming {
                        tag: d.delivery_tag,
                        consumer_tag: d.consumer_tag.as_str().to_string(),
                        header: None,
                        body: None,
                    });
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    return Err(format!(
                        "the upstream cancelled the consumer of {:?} (queue deleted?)",
                        self.queue
                    ));
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    return Err(format!(
                        "the upstream closed the consuming channel: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    ));
                }
                _ => {}
            },
            FRAME_HEADER => {
                if let Some(incoming) = &mut self.incoming {
                    let size = content_body_size(&frame.payload).unwrap_or(0);
                    incoming.header = Some(frame.payload.clone());
                    incoming.body = Some(BodyCollector::new(size));
                }
            }
            FRAME_BODY => {
                if let Some(body) = self.incoming.as_mut().and_then(|i| i.body.as_mut()) {
                    body.push(frame.payload.clone())
                        .map_err(|e| format!("upstream delivery: {e}"))?;
                }
            }
            _ => {}
        }
        let complete = self
            .incoming
            .as_ref()
            .is_some_and(|i| i.body.as_ref().is_some_and(BodyCollector::is_complete));
        if complete && let Some(incoming) = self.incoming.take() {
            self.on_message(incoming, pass, report)?;
        }
        Ok(())
    }

    /// The number of the consumer a delivery came to (0: not one of the pass's).
    fn consumer_of(&self, tag: &str) -> u64 {
        tag.strip_prefix("dlx-proxy-redrive-")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// A delivery of `consumer` stays in the queue: the end's nack gives it back. When the
    /// current consumer's window is all such deliveries, a new consumer carries on.
    fn keep(&mut self, tag: u64, consumer: u64) -> Result<(), String> {
        self.left_behind = self.left_behind.max(tag);
        if consumer == self.consumer && self.consuming {
            self.kept_here = self.kept_here.saturating_add(1);
            if self.kept_here >= WINDOW
                && self.seen < self.total
                && self.left > 0
                && !self.cancelled
            {
                self.consume()?;
            }
        }
        Ok(())
    }

    fn on_message(
        &mut self,
        incoming: Incoming,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        let Incoming {
            tag,
            consumer_tag,
            header,
            body,
        } = incoming;
        if self.seen >= self.total || self.left == 0 || self.cancelled {
            // After the pass's end: it goes back untouched.
            self.left_behind = self.left_behind.max(tag);
            return Ok(());
        }
        self.seen += 1;
        let consumer = self.consumer_of(&consumer_tag);
        let mut progress = Progress {
            examined: 1,
            ..Progress::default()
        };
        let header = header.map(|h| parse_content_header(&h));
        match header {
            Some(Ok(header)) => match pass.plan.decide(&header.properties, &self.queue) {
                Decision::Skip => {
                    progress.skipped = 1;
                    self.keep(tag, consumer)?;
                }
                Decision::Fail(cause) => {
                    progress.failed.push(cause);
                    self.keep(tag, consumer)?;
                }
                Decision::Move(target) if pass.dry_run => {
                    progress.moved.push(target);
                    self.left = self.left.saturating_sub(1);
                    self.keep(tag, consumer)?;
                }
                Decision::Move(target) => {
                    self.left = self.left.saturating_sub(1);
                    let properties =
                        encode_properties_from(&stamp(&header.properties), &header.raw_properties);
                    self.pending.push_back(Pending {
                        tag,
                        consumer,
                        message: OutgoingMessage {
                            exchange: String::new(),
                            routing_key: target,
                            raw_properties: properties,
                            body: body.map(BodyCollector::finish).unwrap_or_default(),
                        },
                    });
                }
            },
            _ => {
                progress.failed.push("undecodable");
                self.keep(tag, consumer)?;
            }
        }
        report(progress);
        Ok(())
    }

    /// A publish settled: ack its dead-letter delivery, or leave it there.
    fn settle(
        &mut self,
        tag: u64,
        outcome: &Outcome,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        let Some((target, consumer)) = self.inflight.remove(&tag) else {
            return Ok(());
        };
        let cause = match outcome {
            Outcome::Confirmed => {
                self.out.extend_from_slice(&method_frame(
                    CONSUME_CHANNEL,
                    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: tag,
                        multiple: false,
                    })),
                ));
                report(Progress {
                    moved: vec![target],
                    ..Progress::default()
                });
                return Ok(());
            }
            Outcome::Unroutable | Outcome::ExchangeMissing => "no_queue",
            Outcome::Failed(NACKED) => "target_full",
            Outcome::TimedOut => "timed_out",
            Outcome::AccessRefused | Outcome::Failed(_) => "publish_failed",
        };
        self.left = self.left.saturating_add(1);
        report(Progress {
            failed: vec![cause],
            ..Progress::default()
        });
        self.keep(tag, consumer)
    }
}
