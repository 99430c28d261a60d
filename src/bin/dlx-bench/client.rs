//! The AMQP side of the benchmark (lapin): connections, topology, producers that publish
//! stamped bodies with a window of unconfirmed messages, and consumers that settle deliveries
//! (ack or reject) without waiting for each one, recording ids and latencies as they go.
//!
//! Producers and consumers each get their own connection and channel, as separate
//! applications would.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesOrdered, FuturesUnordered};
use futures_util::task::noop_waker_ref;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::watch;

use crate::payload::{self, IdTracker, Latencies, Stamp};

/// Nanoseconds since the benchmark process started (monotonic; all stamps use it).
pub fn now_nanos() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Opens a connection named after its role (visible in the broker's connection list).
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let props = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("dlx-bench {name}")));
    Connection::connect(url, props)
        .await
        .with_context(|| format!("connecting to {url} ({name})"))
}

/// One connection with one channel.
pub async fn open_channel(url: &str, name: &str) -> Result<(Connection, Channel)> {
    let conn = connect(url, name).await?;
    let ch = conn
        .create_channel()
        .await
        .with_context(|| format!("opening a channel ({name})"))?;
    Ok((conn, ch))
}

/// Time a connection or channel close may take. lapin can leave a close unanswered when many
/// connections close at once; the benchmark then moves on (the socket goes with the process).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes a connection; false if it failed or took longer than [`CLOSE_TIMEOUT`].
pub async fn close(conn: &Connection) -> bool {
    matches!(
        tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "done".into())).await,
        Ok(Ok(()))
    )
}

async fn close_channel(ch: &Channel) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, ch.close(200, "bye".into())).await;
}

pub fn short(s: &str) -> Result<ShortString> {
    ShortString::try_new(s.to_string()).map_err(|_| anyhow::anyhow!("name too long: {s}"))
}

/// Queue arguments.
#[derive(Clone, Debug, Default)]
pub struct QueueArgs {
    pub dead_letter_exchange: Option<String>,
    pub message_ttl_ms: Option<u32>,
    pub max_length: Option<u32>,
    pub overflow_drop_head: bool,
    /// A durable quorum queue (needed for x-delivery-limit on RabbitMQ 3.10).
    pub quorum: bool,
    /// A durable queue (implied by `quorum`).
    pub durable: bool,
    pub delivery_limit: Option<u32>,
    /// RabbitMQ's own at-least-once dead-lettering (a quorum queue only): the
    /// at-least-once strategy with overflow reject-publish, which it requires.
    pub at_least_once: bool,
}

impl QueueArgs {
    /// The queue --queue-type names, without other arguments.
    pub fn of_type(kind: crate::QueueType) -> QueueArgs {
        QueueArgs {
            quorum: kind == crate::QueueType::Quorum,
            durable: kind != crate::QueueType::Transient,
            ..QueueArgs::default()
        }
    }

    fn table(&self) -> FieldTable {
        let mut t = FieldTable::default();
        if let Some(x) = &self.dead_letter_exchange {
            t.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(LongString::from(x.as_str())),
            );
        }
        if let Some(ttl) = self.message_ttl_ms {
            t.insert("x-message-ttl".into(), AMQPValue::LongInt(ttl as i32));
        }
        if let Some(max) = self.max_length {
            t.insert("x-max-length".into(), AMQPValue::LongInt(max as i32));
        }
        if self.quorum {
            t.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(LongString::from("quorum")),
            );
        }
        if let Some(limit) = self.delivery_limit {
            t.insert("x-delivery-limit".into(), AMQPValue::LongInt(limit as i32));
        }
        if self.at_least_once {
            t.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString(LongString::from("at-least-once")),
            );
            t.insert(
                "x-overflow".into(),
                AMQPValue::LongString(LongString::from("reject-publish")),
            );
        }
        if self.overflow_drop_head {
            t.insert(
                "x-overflow".into(),
                AMQPValue::LongString(LongString::from("drop-head")),
            );
        }
        t
    }
}

/// Deletes a queue if it exists, on a throwaway channel (a missing queue may close it).
pub async fn delete_queue(conn: &Connection, name: &str) {
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch
            .queue_delete(
                short(name).unwrap_or_default(),
                QueueDeleteOptions::default(),
            )
            .await;
        close_channel(&ch).await;
    }
}

pub async fn delete_exchange(conn: &Connection, name: &str) {
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch
            .exchange_delete(
                short(name).unwrap_or_default(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        close_channel(&ch).await;
    }
}

/// Declares a fresh (deleted first) queue, non-durable unless `args` say otherwise.
pub async fn fresh_queue(conn: &Connection, name: &str, args: &QueueArgs) -> Result<()> {
    delete_queue(conn, name).await;
    declare_queue(conn, name, args).await
}

/// Declares a queue (it may exist already with the same arguments).
pub async fn declare_queue(conn: &Connection, name: &str, args: &QueueArgs) -> Result<()> {
    let ch = conn.create_channel().await?;
    let options = QueueDeclareOptions {
        durable: args.quorum || args.durable,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(short(name)?, options, args.table())
        .await
        .with_context(|| format!("declaring queue {name} with {args:?}"))?;
    close_channel(&ch).await;
    Ok(())
}

/// Declares a fanout exchange and a fresh queue bound to it (a dead-letter target).
pub async fn fanout_with_queue(conn: &Connection, exchange: &str, queue: &str) -> Result<()> {
    delete_exchange(conn, exchange).await;
    fresh_queue(conn, queue, &QueueArgs::default()).await?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        short(exchange)?,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .with_context(|| format!("declaring exchange {exchange}"))?;
    ch.queue_bind(
        short(queue)?,
        short(exchange)?,
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .with_context(|| format!("binding {queue} to {exchange}"))?;
    close_channel(&ch).await;
    Ok(())
}

/// Ready messages in a queue (passive declare).
pub async fn queue_depth(ch: &Channel, name: &str) -> Result<u64> {
    let q = ch
        .queue_declare(
            short(name)?,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("passive declare of {name}"))?;
    Ok(u64::from(q.message_count()))
}

/// What one producer publishes.
#[derive(Clone, Debug)]
pub struct PublishSpec {
    pub url: String,
    pub producer: u32,
    pub routing_key: String,
    /// Stop after this many messages ...
    pub count: Option<u64>,
    /// ... or at this instant.
    pub until: Option<Instant>,
    pub size: usize,
    pub confirms: bool,
    /// Unconfirmed messages allowed before waiting for the oldest confirm.
    pub confirm_window: usize,
    /// basic.publish calls in flight towards the client's I/O loop.
    pub pipeline: usize,
    /// delivery_mode 2.
    pub persistent: bool,
}

/// The properties of every published message.
pub fn properties(persistent: bool) -> BasicProperties {
    if persistent {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    }
}

/// What one producer did.
#[derive(Clone, Debug, Default)]
pub struct PublishResult {
    /// Messages handed to the client (sequence numbers 0..published).
    pub published: u64,
    pub acked: u64,
    pub nacked: u64,
    pub started_nanos: u64,
    pub finished_nanos: u64,
}

/// Publishes stamped bodies to the default exchange. With confirms, the result counts acks and
/// nacks and returns only once every publish is confirmed.
pub async fn publish(spec: PublishSpec) -> Result<PublishResult> {
    let (conn, ch) = open_channel(&spec.url, &format!("producer {}", spec.producer)).await?;
    if spec.confirms {
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
    }
    let routing_key = short(&spec.routing_key)?;
    let mut result = PublishResult {
        started_nanos: now_nanos(),
        ..PublishResult::default()
    };
    let props = properties(spec.persistent);
    let mut sending = FuturesOrdered::new();
    let mut confirming: VecDeque<lapin::PublisherConfirm> = VecDeque::new();
    let pipeline = spec.pipeline.max(1);
    let window = spec.confirm_window.max(1);
    let mut seq = 0u64;
    loop {
        if spec.count.is_some_and(|c| seq >= c) || spec.until.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        let body = payload::encode(
            Stamp {
                sent_nanos: now_nanos(),
                producer: spec.producer,
                seq,
            },
            spec.size,
        );
        let ch2 = ch.clone();
        let key = routing_key.clone();
        let props = props.clone();
        sending.push_back(async move {
            ch2.basic_publish("".into(), key, BasicPublishOptions::default(), &body, props)
                .await
        });
        seq += 1;
        while sending.len() >= pipeline {
            if let Some(sent) = sending.next().await {
                confirming.push_back(sent.context("basic.publish")?);
            }
        }
        if spec.confirms {
            while confirming.len() >= window {
                if let Some(c) = confirming.pop_front() {
                    settle_confirm(c, &mut result).await?;
                }
            }
        } else {
            confirming.clear();
        }
    }
    while let Some(sent) = sending.next().await {
        confirming.push_back(sent.context("basic.publish")?);
    }
    if spec.confirms {
        while let Some(c) = confirming.pop_front() {
            settle_confirm(c, &mut result).await?;
        }
    }
    result.published = seq;
    result.finished_nanos = now_nanos();
    close(&conn).await;
    Ok(result)
}

async fn settle_confirm(c: lapin::PublisherConfirm, result: &mut PublishResult) -> Result<()> {
    let confirmation = c.await.context("waiting for a publisher confirm")?;
    if confirmation.is_nack() {
        result.nacked += 1;
    } else {
        result.acked += 1;
    }
    Ok(())
}

/// How a consumer settles each delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// basic.ack (with multiple=true every `ack_every` deliveries).
    Ack,
    /// basic.reject requeue=false (dead-letters the message).
    Reject,
    /// basic.nack multiple=false: requeue=false dead-letters the message, requeue=true puts it
    /// back (counted against a delivery limit).
    Nack { requeue: bool },
}

/// When each message's death was caused, for latencies measured from that event rather than
/// from the publish: the settle that killed it (reject, nack, the requeue past a delivery
/// limit; the latest one per message wins), else the publish time plus `after_publish_ns`
/// (a queue TTL).
#[derive(Debug, Default)]
pub struct EventTimes {
    settled: std::sync::Mutex<std::collections::HashMap<(u32, u64), u64>>,
    pub after_publish_ns: u64,
}

impl EventTimes {
    pub fn new(after_publish_ns: u64) -> Arc<EventTimes> {
        Arc::new(EventTimes {
            after_publish_ns,
            ..EventTimes::default()
        })
    }

    /// The message with this body was settled (killed, or requeued) at `at`.
    pub fn settled(&self, body: &[u8], at: u64) {
        if let Some(stamp) = payload::decode(body) {
            let mut map = self.settled.lock().unwrap_or_else(|e| e.into_inner());
            map.insert((stamp.producer, stamp.seq), at);
        }
    }

    /// When the death of `stamp`'s message was caused.
    pub fn event(&self, stamp: &Stamp) -> u64 {
        let map = self.settled.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&(stamp.producer, stamp.seq)) {
            Some(&at) => at,
            None => stamp.sent_nanos + self.after_publish_ns,
        }
    }
}

/// The latency of a delivery that arrived at `arrived`: from its event (see [`EventTimes`])
/// when `events` is given, else from its publish.
pub fn latency_of(stamp: &Stamp, events: Option<&EventTimes>, arrived: u64) -> u64 {
    let from = events.map_or(stamp.sent_nanos, |e| e.event(stamp));
    arrived.saturating_sub(from)
}

#[derive(Clone, Debug)]
pub struct ConsumeSpec {
    pub url: String,
    pub name: String,
    pub queue: String,
    pub prefetch: u16,
    pub settle: Settle,
    pub ack_every: u64,
    /// Record ids and latencies (false for a consumer that only rejects).
    pub record: bool,
    /// A rejecting consumer notes its settles here; a recording one measures from them.
    pub events: Option<Arc<EventTimes>>,
}

/// Counters shared by the consumers of one queue and the task waiting for them.
#[derive(Debug, Default)]
pub struct Progress {
    pub received: AtomicU64,
    /// now_nanos() of the latest delivery.
    pub last_nanos: AtomicU64,
}

impl Progress {
    pub fn new() -> Arc<Progress> {
        Arc::new(Progress::default())
    }

    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Waits until `target` deliveries arrived, or until nothing arrived for `idle` (returns
    /// false then).
    pub async fn wait_for(&self, target: u64, idle: Duration) -> bool {
        let mut last = self.received();
        let mut last_change = Instant::now();
        loop {
            let now = self.received();
            if now >= target {
                return true;
            }
            if now != last {
                last = now;
                last_change = Instant::now();
            } else if last_change.elapsed() >= idle {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// What one consumer saw.
#[derive(Debug, Default)]
pub struct ConsumeResult {
    pub ids: IdTracker,
    pub latencies: Latencies,
    pub settle_errors: u64,
}

/// A started consumer: its task and the switch that stops it.
pub struct RunningConsumer {
    pub task: tokio::task::JoinHandle<Result<ConsumeResult>>,
}

/// Starts a consumer on its own connection; returns once basic.consume-ok arrived.
pub async fn start_consumer(
    spec: ConsumeSpec,
    progress: Arc<Progress>,
    stop: watch::Receiver<bool>,
) -> Result<RunningConsumer> {
    let (conn, ch) = open_channel(&spec.url, &spec.name).await?;
    ch.basic_qos(spec.prefetch, BasicQosOptions::default())
        .await?;
    let consumer = ch
        .basic_consume(
            short(&spec.queue)?,
            short(&spec.name.replace(' ', "-"))?,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("basic.consume on {}", spec.queue))?;
    let task = tokio::spawn(consume_loop(conn, consumer, spec, progress, stop));
    Ok(RunningConsumer { task })
}

async fn consume_loop(
    conn: Connection,
    mut consumer: lapin::Consumer,
    spec: ConsumeSpec,
    progress: Arc<Progress>,
    mut stop: watch::Receiver<bool>,
) -> Result<ConsumeResult> {
    let mut result = ConsumeResult::default();
    let mut settling: FuturesUnordered<SettleFuture> = FuturesUnordered::new();
    let mut since_ack = 0u64;
    let ack_every = spec.ack_every.max(1);
    let mut last_acker: Option<lapin::Acker> = None;
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            Some(done) = settling.next(), if !settling.is_empty() => {
                let done: lapin::Result<bool> = done;
                if done.is_err() {
                    result.settle_errors += 1;
                }
            }
            next = consumer.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("consumer stream")?;
                let arrived = now_nanos();
                if spec.record
                    && let Some(stamp) = result.ids.record_body(&delivery.data)
                {
                    result.latencies.push(latency_of(&stamp, spec.events.as_deref(), arrived));
                }
                progress.received.fetch_add(1, Ordering::Relaxed);
                progress.last_nanos.fetch_max(arrived, Ordering::Relaxed);
                if !spec.record && let Some(events) = &spec.events {
                    events.settled(&delivery.data, now_nanos());
                }
                let acker = delivery.acker;
                match spec.settle {
                    Settle::Reject => start_settle(
                        async move { acker.reject(BasicRejectOptions { requeue: false }).await }
                            .boxed(),
                        &mut settling,
                        &mut result,
                    ),
                    Settle::Nack { requeue } => start_settle(
                        async move {
                            acker
                                .nack(BasicNackOptions { requeue, multiple: false })
                                .await
                        }
                        .boxed(),
                        &mut settling,
                        &mut result,
                    ),
                    Settle::Ack => {
                        since_ack += 1;
                        if since_ack >= ack_every {
                            since_ack = 0;
                            last_acker = None;
                            if ack_every > 1 {
                                // The client may reorder settles in flight, and a
                                // multiple=true ack overtaken by a later one names an
                                // unknown tag: wait for each.
                                if acker.ack(BasicAckOptions { multiple: true }).await.is_err() {
                                    result.settle_errors += 1;
                                }
                            } else {
                                start_settle(
                                    async move { acker.ack(BasicAckOptions::default()).await }
                                        .boxed(),
                                    &mut settling,
                                    &mut result,
                                );
                            }
                        } else {
                            last_acker = Some(acker);
                        }
                    }
                }
            }
        }
    }
    if let Some(acker) = last_acker
        && acker.ack(BasicAckOptions { multiple: true }).await.is_err()
    {
        result.settle_errors += 1;
    }
    let drain = async {
        while let Some(done) = settling.next().await {
            if done.is_err() {
                result.settle_errors += 1;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
    close(&conn).await;
    Ok(result)
}

type SettleFuture = BoxFuture<'static, lapin::Result<bool>>;

/// Polls a settle once so its command is queued at once, then keeps it until it is done.
fn start_settle(
    mut settle: SettleFuture,
    settling: &mut FuturesUnordered<SettleFuture>,
    result: &mut ConsumeResult,
) {
    let mut cx = TaskContext::from_waker(noop_waker_ref());
    match settle.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(_)) => {}
        Poll::Ready(Err(_)) => result.settle_errors += 1,
        Poll::Pending => settling.push(settle),
    }
}

/// Stops consumers and merges what they saw.
pub async fn stop_consumers(
    stop: &watch::Sender<bool>,
    consumers: Vec<RunningConsumer>,
) -> Result<ConsumeResult> {
    let _ = stop.send(true);
    let mut merged = ConsumeResult::default();
    for c in consumers {
        let r = c.task.await.context("consumer task")??;
        merged.ids.merge(&r.ids);
        merged.latencies.merge(r.latencies);
        merged.settle_errors += r.settle_errors;
    }
    Ok(merged)
}

/// Takes every ready message out of a queue with basic.get (no ack), recording ids.
pub async fn drain_with_get(ch: &Channel, queue: &str, ids: &mut IdTracker) -> Result<u64> {
    let mut n = 0;
    while let Some(m) = ch
        .basic_get(short(queue)?, BasicGetOptions { no_ack: true })
        .await
        .with_context(|| format!("basic.get on {queue}"))?
    {
        ids.record_body(&m.delivery.data);
        n += 1;
        if n > 100_000_000 {
            bail!("queue {queue} does not drain");
        }
    }
    Ok(n)
}
