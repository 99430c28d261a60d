//! Proxy mode under a slow client: a consumer that stops reading its socket slows the proxy's
//! upstream reads, and nothing the proxy holds grows past a configured limit.
//!
//! The proxy runs as the real binary (its own process, so its RSS is its own) in front of the
//! reference RabbitMQ, with small limits: `proxy.max_inflight_bytes` (kept deliveries, held so
//! that a reject can be dead-lettered) and `limits.connection_outbox_bytes` (encoded frames
//! waiting for the client's socket). A sampler scrapes `/metrics` on the admin port and reads
//! `/proc/<pid>/status` all along; the tests assert on the peaks it saw, on what the proxy read
//! from RabbitMQ (`messages_delivered_total`, `bytes_total{direction="upstream_in"}`) and on
//! what RabbitMQ still holds (`rabbitmqctl list_queues`).
//!
//! - A raw client that consumes (manual ack, no prefetch limit) and then does not read while
//!   32 MiB are published: the proxy stops reading at the first bound it meets (the kept
//!   deliveries' bound when the queue can dead-letter, so deliveries keep their content; the
//!   outbox bound when it cannot, or with `proxy.delegate_to_upstream`: deliveries are then
//!   tracked as tags only), the rest stays in RabbitMQ, and once the client reads and acks
//!   again every message arrives exactly once, in order.
//! - A lapin client on a queue with a dead-letter exchange that reads but does not ack: the
//!   deliveries stop at about `max_inflight_bytes` worth, and resume when it acks.
//! - Messages larger than `max_inflight_bytes` on such a queue: forwarded but kept as their
//!   tag only, so reads do not stop; a reject of one is still dead-lettered.

use crate::common;
use crate::proxy_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    RawClient, ServiceProcess, TempDir, free_addresses, metric_value, rss_bytes, scrape, unique,
    wait_until,
};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldTable};
use proxy_support::{
    consume, declare, declare_dead_lettering, declare_dlx, delete_capture, delete_upstream, field,
    get, ls, next, rabbitmqctl, upstream_connection, upstream_host, x_death,
};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// The proxy's kept-deliveries bound in these tests.
const MAX_INFLIGHT: usize = 256 * 1024;
/// The proxy's client outbox bound in these tests.
const OUTBOX: usize = 1024 * 1024;
/// Most read buffers the runs queued in one outbox keep alive (the proxy's bound).
const SHARED_BUFFERS_MAX: f64 = 16.0;
/// The largest frame (the default `limits.frame_max`, which RabbitMQ also offers): the outbox
/// stops being fed once it holds its limit, so it can exceed it by at most one frame.
const FRAME_MAX: usize = 131_072;
/// What the proxy adds to a delivery's charge besides its body: properties, exchange, routing
/// key and a fixed 128 bytes (`inflight::KEPT_OVERHEAD`). The routing keys here are queue
/// names under 100 bytes and the properties are empty.
const CHARGE_OVERHEAD_MIN: usize = 128;
const CHARGE_OVERHEAD_MAX: usize = 128 + 2 + 100;

/// The proxy binary in proxy mode in front of the reference RabbitMQ.
struct ProxyProcess {
    process: ServiceProcess,
    capture: String,
    _dir: TempDir,
}

/// What stops the proxy's upstream reads in the stalled-consumer scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stall {
    /// A policy gives the queue a dead-letter exchange: deliveries keep their content and
    /// `proxy.max_inflight_bytes` is reached first.
    KeptDeliveries,
    /// No dead-letter exchange: deliveries are tracked as tags only, the outbox fills first.
    OutboxTagsOnly,
    /// `proxy.delegate_to_upstream`: the same, with the upstream doing the dead-lettering.
    OutboxDelegated,
}

impl ProxyProcess {
    async fn start(delegate_to_upstream: bool) -> ProxyProcess {
        Self::start_with_policy(delegate_to_upstream, None).await
    }

    /// With a policy giving the queues `pattern` matches a dead-letter exchange.
    async fn start_with_policy(delegate_to_upstream: bool, pattern: Option<&str>) -> ProxyProcess {
        let dir = TempDir::new("backpressure");
        let (amqp, admin) = free_addresses();
        let capture = unique("bp-capture");
        let upstream = upstream_host();
        let config = format!(
            "mode = \"proxy\"\n\n\
             [listen]\namqp = \"{amqp}\"\nadmin = \"{admin}\"\n\n\
             [upstream]\nurl = \"amqp://{upstream}\"\nuser = \"guest\"\npassword = \"guest\"\n\n\
             [limits]\nconnection_outbox_bytes = {OUTBOX}\n\n\
             [proxy]\nmax_inflight_bytes = {MAX_INFLIGHT}\nconfirm_timeout_secs = 5\n\
             delegate_to_upstream = {delegate_to_upstream}\ncapture_name = \"{capture}\"\n\n\
             [log]\nfilter = \"warn\"\n\n\
             [shutdown]\ndrain_secs = 1\n"
        );
        let config = match pattern {
            Some(pattern) => format!(
                "{config}\n[[policies]]\nname = \"bp-dlx\"\nvhost = \"/\"\npattern = \"{pattern}\"\n\
                 definition = {{ dead-letter-exchange = \"bp-dlx\" }}\n"
            ),
            None => config,
        };
        let path = dir.join("config.toml");
        std::fs::write(&path, config).unwrap();
        let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
        ProxyProcess {
            process,
            capture,
            _dir: dir,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.process.amqp
    }

    fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr())
    }

    async fn metrics(&self) -> Metrics {
        Metrics::parse(&scrape(self.process.admin).await)
    }

    fn sampler(&self) -> Sampler {
        Sampler::start(self.process.admin, self.process.pid())
    }

    /// Stops the process and removes the capture exchange and queue it declared upstream.
    async fn stop(mut self) {
        self.process.signal("TERM");
        if self
            .process
            .wait_exit(Duration::from_secs(15))
            .await
            .is_none()
        {
            panic!("the proxy did not exit:\n{}", self.process.logs());
        }
        let logs = self.process.logs();
        assert!(!logs.contains("panicked"), "{logs}");
        delete_capture(&self.capture).await;
    }
}

/// The proxy's metrics this test reads.
#[derive(Clone, Copy, Debug, Default)]
struct Metrics {
    inflight_bytes: f64,
    inflight_deliveries: f64,
    outbox_bytes: f64,
    upstream_outbox_bytes: f64,
    read_buffers: f64,
    delivered: f64,
    acked: f64,
    upstream_in_bytes: f64,
}

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let value = |name: &str| metric_value(text, &format!("dlx_proxy_{name}")).unwrap_or(0.0);
        Metrics {
            inflight_bytes: value("inflight_bytes"),
            inflight_deliveries: value("inflight_deliveries"),
            outbox_bytes: value("outbox_bytes"),
            upstream_outbox_bytes: value("upstream_outbox_bytes"),
            read_buffers: value("outbox_read_buffers"),
            delivered: value("messages_delivered_total"),
            acked: value("messages_acked_total"),
            upstream_in_bytes: value("bytes_total{direction=\"upstream_in\"}"),
        }
    }
}

/// The most a TCP socket's send buffer grows to by itself (the third value of tcp_wmem).
fn tcp_send_buffer_max() -> usize {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|text| text.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(4 * 1024 * 1024)
}

/// The largest values seen by a [`Sampler`].
#[derive(Clone, Copy, Debug, Default)]
struct Peaks {
    inflight_bytes: f64,
    inflight_deliveries: f64,
    outbox_bytes: f64,
    read_buffers: f64,
    rss: u64,
    samples: u64,
}

/// Scrapes `/metrics` and reads the proxy's RSS every 20 ms until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Peaks>,
}

impl Sampler {
    fn start(admin: SocketAddr, pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut peaks = Peaks::default();
            loop {
                let done = flag.load(Ordering::Acquire);
                let m = Metrics::parse(&scrape(admin).await);
                peaks.inflight_bytes = peaks.inflight_bytes.max(m.inflight_bytes);
                peaks.inflight_deliveries = peaks.inflight_deliveries.max(m.inflight_deliveries);
                peaks.outbox_bytes = peaks.outbox_bytes.max(m.outbox_bytes);
                peaks.read_buffers = peaks.read_buffers.max(m.read_buffers);
                peaks.rss = peaks.rss.max(rss_bytes(pid));
                peaks.samples += 1;
                if done {
                    return peaks;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Sampler { stop, task }
    }

    async fn finish(self) -> Peaks {
        self.stop.store(true, Ordering::Release);
        self.task.await.unwrap()
    }
}

/// A message body: its sequence number, then filler that depends on it.
fn payload(seq: u32, size: usize) -> Vec<u8> {
    let mut body = vec![(seq % 251) as u8; size];
    body[..4].copy_from_slice(&seq.to_be_bytes());
    body
}

/// Checks a body made by [`payload`]; returns its sequence number.
fn check_payload(body: &[u8], size: usize) -> u32 {
    assert_eq!(body.len(), size, "body size");
    let seq = u32::from_be_bytes(body[..4].try_into().unwrap());
    assert!(
        body[4..].iter().all(|b| *b == (seq % 251) as u8),
        "body of message {seq} is corrupted"
    );
    seq
}

/// Publishes `count` bodies of `size` bytes straight to RabbitMQ, with confirms.
async fn publish_direct(queue: &str, count: u32, size: usize) {
    let conn = upstream_connection().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(count as usize);
    for seq in 0..count {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &payload(seq, size),
                AMQPProperties::default(),
            )
            .await
            .unwrap(),
        );
    }
    for (seq, confirm) in confirms.into_iter().enumerate() {
        assert!(
            confirm.await.unwrap().is_ack(),
            "publish {seq} not confirmed"
        );
    }
    conn.close(200, "done".into()).await.unwrap();
}

/// The next message of `dlq` is message `seq` ([`payload`] of `size` bytes), rejected once
/// in `q`; acks it, then waits until RabbitMQ's `q` is empty.
async fn dead_lettered_once(ch: &lapin::Channel, dlq: &str, q: &str, size: usize, seq: u32) {
    let dead = get(ch, dlq).await;
    assert_eq!(check_payload(&dead.data, size), seq);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1);
    assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
    assert_eq!(field(&deaths[0], "queue"), &ls(q));
    assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
    dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    wait_until(
        "RabbitMQ's queue to empty",
        Duration::from_secs(30),
        async || upstream_queue_counts(q) == (0, 0),
    )
    .await;
}

/// A queue `<prefix>-…` dead-lettering through a direct exchange into a DLQ: the exchange and
/// DLQ declared on RabbitMQ directly, the queue through the proxy, which so knows the queue
/// dead-letters and keeps the content of its deliveries.
struct DeadLettering {
    upstream: lapin::Connection,
    uch: lapin::Channel,
    conn: lapin::Connection,
    ch: lapin::Channel,
    q: String,
    dlx: String,
    dlq: String,
}

impl DeadLettering {
    async fn declare(proxy: &ProxyProcess, prefix: &str) -> DeadLettering {
        let upstream = upstream_connection().await;
        let uch = upstream.create_channel().await.unwrap();
        let q = unique(prefix);
        let dlx = unique(&format!("{prefix}-dlx"));
        let dlq = unique(&format!("{prefix}-dlq"));
        declare_dlx(&uch, &dlx, &dlq).await;
        let conn = lapin::Connection::connect(&proxy.uri(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        declare_dead_lettering(&ch, &q, &dlx, &dlq).await;
        DeadLettering {
            upstream,
            uch,
            conn,
            ch,
            q,
            dlx,
            dlq,
        }
    }
}

/// RabbitMQ's (messages_ready, messages_unacknowledged) of a queue.
fn upstream_queue_counts(queue: &str) -> (u64, u64) {
    let out = rabbitmqctl(&[
        "list_queues",
        "-q",
        "--no-table-headers",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ]);
    assert!(out.status.success(), "list_queues: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() == 3 && cols[0] == queue {
            return (cols[1].parse().unwrap(), cols[2].parse().unwrap());
        }
    }
    panic!("{queue} not in list_queues:\n{text}");
}

/// Waits until the proxy has stopped reading from RabbitMQ: the deliveries it read and the
/// bytes it read upstream stay the same for two seconds (bytes are added to the metrics at
/// least once a second). Returns the metrics then.
async fn wait_until_reads_stop(proxy: &ProxyProcess) -> Metrics {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = proxy.metrics().await;
    let mut steady_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = proxy.metrics().await;
        if now.delivered != last.delivered || now.upstream_in_bytes != last.upstream_in_bytes {
            steady_since = Instant::now();
        } else if steady_since.elapsed() >= Duration::from_secs(2) && now.delivered > 0.0 {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never stopped reading: {now:?}"
        );
        last = now;
    }
}

/// The stalled-consumer scenario.
async fn stalled_consumer(stall: Stall) {
    const COUNT: u32 = 1024;
    const SIZE: usize = 32 * 1024;
    let volume = COUNT as usize * SIZE;
    let q = unique("bp-stalled");
    let proxy = match stall {
        Stall::KeptDeliveries => {
            ProxyProcess::start_with_policy(false, Some(&format!("^{q}$"))).await
        }
        Stall::OutboxTagsOnly => ProxyProcess::start(false).await,
        Stall::OutboxDelegated => ProxyProcess::start(true).await,
    };
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    declare(&uch, &q, FieldTable::default()).await;

    // A consumer with manual acks and no prefetch limit, on a socket with a small receive
    // buffer, that then stops reading.
    let mut client = RawClient::connect_with_receive_buffer(proxy.addr(), &q, 32 * 1024).await;
    client.open_channel(1).await;
    client.consume(1, &q, false).await;
    let rss_before = rss_bytes(proxy.process.pid());
    let sampler = proxy.sampler();

    publish_direct(&q, COUNT, SIZE).await;
    let stalled = wait_until_reads_stop(&proxy).await;
    let (ready, unacked) = upstream_queue_counts(&q);
    let stalled_rss = rss_bytes(proxy.process.pid());

    // Every message is still in RabbitMQ; the proxy read only a small part of them.
    assert_eq!(ready + unacked, u64::from(COUNT), "nothing lost or settled");
    assert!(
        stalled.upstream_in_bytes < volume as f64 / 2.0,
        "the proxy read {} of {COUNT} deliveries ({} bytes of {volume})",
        stalled.delivered,
        stalled.upstream_in_bytes
    );
    if stall != Stall::KeptDeliveries {
        // Only tags are kept (a fixed charge each): the client's outbox is what stopped the
        // reads, and it is full. A delivery is kept once its content is all read; the reads
        // may stop inside the last one.
        assert!(
            stalled.inflight_deliveries == stalled.delivered
                || stalled.inflight_deliveries + 1.0 == stalled.delivered,
            "{stalled:?}"
        );
        assert_eq!(
            stalled.inflight_bytes,
            stalled.inflight_deliveries * CHARGE_OVERHEAD_MIN as f64,
            "{stalled:?}"
        );
        // Full by its bytes, or by the read buffers its runs keep alive (each holds one or
        // two deliveries here, so that bound is near the byte limit).
        assert!(
            (stalled.outbox_bytes >= OUTBOX as f64 || stalled.read_buffers == SHARED_BUFFERS_MAX)
                && stalled.outbox_bytes >= (OUTBOX / 2) as f64
                && stalled.outbox_bytes <= (OUTBOX + FRAME_MAX) as f64,
            "outbox at the stall: {stalled:?}"
        );
        // A delivery's 32 KiB body frame is as large as the largest read, so it waits as a
        // frame of its own (its buffer holds little else); runs of smaller frames cut from
        // the read buffers are what the gauge counts, never past its bound.
        assert!(
            stalled.read_buffers <= SHARED_BUFFERS_MAX,
            "read buffers at the stall: {stalled:?}"
        );
        // What was read is in the outbox or in the kernel's buffers of the client connection:
        // the proxy's send buffer (at most tcp_wmem's maximum) and the client's small receive
        // buffer (which the kernel doubles; 256 KiB leaves room for its bookkeeping).
        let sockets = tcp_send_buffer_max() + 256 * 1024;
        assert!(
            stalled.upstream_in_bytes <= (OUTBOX + FRAME_MAX + sockets) as f64,
            "read {} bytes upstream; outbox {OUTBOX} + socket buffers {sockets}",
            stalled.upstream_in_bytes
        );
    } else {
        // The kept deliveries reached their bound first: exactly as many as it takes to reach
        // it, and every one of them went into the client's outbox.
        let most = MAX_INFLIGHT.div_ceil(SIZE + CHARGE_OVERHEAD_MIN) as f64;
        let least = MAX_INFLIGHT.div_ceil(SIZE + CHARGE_OVERHEAD_MAX) as f64;
        assert!(
            stalled.delivered >= least && stalled.delivered <= most,
            "{least}..={most} deliveries before the stall: {stalled:?}"
        );
        assert_eq!(stalled.inflight_deliveries, stalled.delivered);
        assert!(
            stalled.inflight_bytes >= MAX_INFLIGHT as f64
                && stalled.inflight_bytes < (MAX_INFLIGHT + SIZE + CHARGE_OVERHEAD_MAX) as f64,
            "{stalled:?}"
        );
        assert!(stalled.outbox_bytes <= OUTBOX as f64, "{stalled:?}");
    }
    let grown = stalled_rss.saturating_sub(rss_before);
    assert!(
        grown < (volume / 4) as u64,
        "RSS grew by {grown} bytes while the client stalled ({volume} bytes published)"
    );

    // The client reads again and acks as it goes: everything arrives once, in order.
    for expected in 0..COUNT {
        let delivery = client.next_delivery().await;
        assert_eq!(check_payload(&delivery.body, SIZE), expected);
        assert!(!delivery.redelivered, "message {expected} redelivered");
        assert_eq!(delivery.delivery_tag, u64::from(expected) + 1);
        client.ack(1, delivery.delivery_tag, false).await;
    }
    wait_until(
        "RabbitMQ's queue to empty",
        Duration::from_secs(30),
        async || upstream_queue_counts(&q) == (0, 0),
    )
    .await;
    let peaks = sampler.finish().await;
    let end = proxy.metrics().await;
    assert_eq!(end.delivered, f64::from(COUNT), "deliveries read upstream");
    // Every ack of a tracked delivery is counted, with or without its content.
    assert_eq!(end.acked, f64::from(COUNT), "acks of tracked deliveries");
    assert_eq!(end.inflight_deliveries, 0.0);
    assert_eq!(end.inflight_bytes, 0.0);
    assert_eq!(end.outbox_bytes, 0.0);
    assert_eq!(end.upstream_outbox_bytes, 0.0);
    assert_eq!(end.read_buffers, 0.0, "every queued run written");

    // Throughout, stalled and flowing: the bounds held and the process stayed small.
    assert!(peaks.samples > 10, "{peaks:?}");
    // One connection: its client outbox and its upstream outbox.
    assert!(
        peaks.read_buffers <= 2.0 * SHARED_BUFFERS_MAX,
        "read buffers peaked at {}",
        peaks.read_buffers
    );
    assert!(
        peaks.inflight_bytes < (MAX_INFLIGHT + SIZE + CHARGE_OVERHEAD_MAX) as f64,
        "kept bytes peaked at {} (bound {MAX_INFLIGHT})",
        peaks.inflight_bytes
    );
    assert!(
        peaks.outbox_bytes <= (OUTBOX + FRAME_MAX) as f64,
        "outbox peaked at {} (bound {OUTBOX})",
        peaks.outbox_bytes
    );
    let grown = peaks.rss.saturating_sub(rss_before);
    assert!(
        grown < (volume / 4) as u64,
        "RSS grew by {grown} bytes at its peak ({volume} bytes went through)"
    );
    eprintln!(
        "stalled: {stalled:?}; rss before {rss_before}, stalled {stalled_rss}; peaks {peaks:?}"
    );

    uch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    upstream.close(200, "done".into()).await.unwrap();
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_stops_upstream_reads_at_the_kept_delivery_bound() {
    stalled_consumer(Stall::KeptDeliveries).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_stops_upstream_reads_at_the_outbox_bound() {
    stalled_consumer(Stall::OutboxTagsOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_stops_upstream_reads_at_the_outbox_bound_when_delegating() {
    stalled_consumer(Stall::OutboxDelegated).await;
}

/// A client that reads but does not ack, on a queue with a dead-letter exchange: deliveries
/// stop at about `max_inflight_bytes` worth and resume with the acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_deliveries_stop_at_the_inflight_bound_until_acked() {
    const COUNT: u32 = 160;
    const SIZE: usize = 16 * 1024;
    let proxy = ProxyProcess::start(false).await;
    let DeadLettering {
        upstream,
        uch,
        conn,
        ch,
        q,
        dlx,
        dlq,
    } = DeadLettering::declare(&proxy, "bp-kept").await;
    publish_direct(&q, COUNT, SIZE).await;

    let sampler = proxy.sampler();
    let mut deliveries = consume(&ch, &q, BasicConsumeOptions::default()).await;

    // The proxy reads deliveries until the kept bytes reach the bound, then pauses.
    let least = MAX_INFLIGHT.div_ceil(SIZE + CHARGE_OVERHEAD_MAX);
    let most = MAX_INFLIGHT.div_ceil(SIZE + CHARGE_OVERHEAD_MIN);
    let mut held = Vec::new();
    while held.len() < least {
        held.push(next(&mut deliveries).await);
    }
    let stalled = wait_until_reads_stop(&proxy).await;
    // The client gets exactly what the proxy read, and no more while it does not ack.
    while (held.len() as f64) < stalled.delivered {
        held.push(next(&mut deliveries).await);
    }
    let extra = tokio::time::timeout(Duration::from_millis(500), deliveries.recv()).await;
    assert!(extra.is_err(), "a delivery past the pause: {extra:?}");
    assert!(
        held.len() >= least && held.len() <= most,
        "{} deliveries of {SIZE} bytes before the pause; expected {least}..={most}",
        held.len()
    );
    assert_eq!(stalled.delivered, held.len() as f64, "{stalled:?}");
    assert_eq!(
        stalled.inflight_deliveries,
        held.len() as f64,
        "{stalled:?}"
    );
    assert!(
        stalled.inflight_bytes >= MAX_INFLIGHT as f64
            && stalled.inflight_bytes < (MAX_INFLIGHT + SIZE + CHARGE_OVERHEAD_MAX) as f64,
        "{stalled:?}"
    );
    let (ready, unacked) = upstream_queue_counts(&q);
    assert_eq!(ready + unacked, u64::from(COUNT));

    // Acks free room: the rest arrives, in order, once each. The last one is rejected and
    // dead-lettered from the kept copy.
    let mut seen = 0u32;
    for d in held.drain(..) {
        assert_eq!(check_payload(&d.data, SIZE), seen);
        assert!(!d.redelivered);
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
        seen += 1;
    }
    while seen < COUNT {
        let d = next(&mut deliveries).await;
        assert_eq!(check_payload(&d.data, SIZE), seen);
        assert!(!d.redelivered);
        if seen == COUNT - 1 {
            d.acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
        } else {
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
        seen += 1;
    }
    dead_lettered_once(&uch, &dlq, &q, SIZE, COUNT - 1).await;
    let peaks = sampler.finish().await;
    let end = proxy.metrics().await;
    assert_eq!(end.delivered, f64::from(COUNT));
    assert_eq!(end.inflight_deliveries, 0.0);
    assert_eq!(end.inflight_bytes, 0.0);
    assert!(
        peaks.inflight_bytes < (MAX_INFLIGHT + SIZE + CHARGE_OVERHEAD_MAX) as f64,
        "kept bytes peaked at {} (bound {MAX_INFLIGHT})",
        peaks.inflight_bytes
    );
    assert!(peaks.inflight_deliveries <= most as f64, "{peaks:?}");
    eprintln!("kept: {stalled:?}; peaks {peaks:?}");

    conn.close(200, "done".into()).await.unwrap();
    delete_upstream(&uch, &[&q, &dlq], &[&dlx]).await;
    upstream.close(200, "done".into()).await.unwrap();
    proxy.stop().await;
}

/// One message larger than `max_inflight_bytes` on a queue that dead-letters: the proxy
/// forwards it but does not copy it (kept as its tag only, counted), so the kept bytes stay
/// under the bound; the client's reject of it is forwarded, and RabbitMQ's dead-lettering
/// into the capture queue still brings it to the DLQ with its x-death.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_the_bound_is_kept_as_its_tag_and_still_dead_lettered() {
    const SIZE: usize = 4 * MAX_INFLIGHT;
    let proxy = ProxyProcess::start(false).await;
    let DeadLettering {
        upstream,
        uch,
        conn,
        ch,
        q,
        dlx,
        dlq,
    } = DeadLettering::declare(&proxy, "bp-big").await;
    publish_direct(&q, 2, SIZE).await;
    let mut deliveries = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let first = next(&mut deliveries).await;
    let second = next(&mut deliveries).await;
    assert_eq!(check_payload(&first.data, SIZE), 0);
    assert_eq!(check_payload(&second.data, SIZE), 1);
    let held = proxy.metrics().await;
    assert_eq!(held.inflight_deliveries, 2.0, "{held:?}");
    assert!(
        held.inflight_bytes < MAX_INFLIGHT as f64,
        "two {SIZE}-byte deliveries kept {} bytes (bound {MAX_INFLIGHT})",
        held.inflight_bytes
    );
    let tag_only = metric_value(
        &scrape(proxy.process.admin).await,
        "dlx_proxy_deliveries_kept_tag_only_total",
    );
    assert_eq!(tag_only, Some(2.0));

    first
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    second.acker.ack(BasicAckOptions::default()).await.unwrap();
    dead_lettered_once(&uch, &dlq, &q, SIZE, 0).await;
    assert_eq!(proxy.metrics().await.inflight_bytes, 0.0);
    conn.close(200, "done".into()).await.unwrap();
    delete_upstream(&uch, &[&q, &dlq], &[&dlx]).await;
    upstream.close(200, "done".into()).await.unwrap();
    proxy.stop().await;
}
