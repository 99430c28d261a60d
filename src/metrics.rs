//! Every Prometheus metric of the service, named in one place (prefix `dlx_proxy_`).
//!
//! [`Metrics`] owns its own `prometheus::Registry` (never the global default one), so tests and
//! several services in one process do not share counters. The rest of the crate calls the typed
//! methods (`dead_lettered`, `dropped`, `set_queue_depth`, ...) and never names a metric; the
//! admin server renders [`Metrics::encode`] at `/metrics`.
//!
//! Label cardinality is bounded: at most `max_queue_labels` distinct (vhost, queue) pairs get
//! their own series. Further queues are counted under the queue label `_other` (and each such
//! use bumps `dlx_proxy_metric_labels_folded_total`, but for the held-retries gauge of a queue
//! already on `_other`, which stays there until its held messages are gone); their depth
//! gauges are not exported, as a gauge shared by several queues would show whichever was set
//! last. [`Metrics::remove_queue`] drops a deleted queue's series and frees its slot.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Prefix of every metric name.
pub const PREFIX: &str = "dlx_proxy_";

/// The queue label used once `max_queue_labels` distinct queues have their own series.
pub const OTHER_QUEUE: &str = "_other";

/// `upstream_connections_blocked{connection}`: a client's upstream connection.
pub const BLOCKED_CLIENT: &str = "client";
/// `upstream_connections_blocked{connection}`: a vhost's service connection.
pub const BLOCKED_SERVICE: &str = "service";

/// Metric names without the prefix, for documentation and tests.
pub const METRIC_NAMES: &[&str] = &[
    "dead_lettered_total",
    "dead_letter_dropped_total",
    "dead_letter_publish_failures_total",
    "dead_letter_retries_total",
    "publisher_channel_reopens_total",
    "dead_letters_by_service_total",
    "consumer_dead_letters_by_service_total",
    "upstream_connections_blocked",
    "dead_letters_held",
    "deliveries_kept_tag_only_total",
    "consumer_timeouts_total",
    "dead_letters_kept_total",
    "retries_total",
    "retry_held_messages",
    "retry_exhausted_total",
    "messages_published_total",
    "messages_delivered_total",
    "messages_acked_total",
    "connections_opened_total",
    "build_info",
    "connections_refused_total",
    "frames_total",
    "bytes_total",
    "config_reloads_total",
    "tls_reloads_total",
    "metric_labels_folded_total",
    "connections",
    "channels",
    "consumers",
    "queues",
    "exchanges",
    "bindings",
    "queue_messages",
    "queue_bytes",
    "inflight_deliveries",
    "inflight_bytes",
    "verified_queues",
    "session_queue_settings",
    "outbox_bytes",
    "upstream_outbox_bytes",
    "outbox_read_buffers",
    "admin_connections",
    "memory_alarm",
    "memory_used_bytes",
    "memory_limit_bytes",
    "memory_high_watermark_bytes",
    "blocked_connections",
    "connection_blocks_total",
    "memory_releases_total",
    "dead_letter_latency_seconds",
    "message_age_at_dead_letter_seconds",
    "upstream_connect_attempts_total",
    "upstream_reachable",
    "capture_consumers",
    "declare_connections",
    "capture_unacked",
    "service_reconnects_total",
    "captured_total",
    "service_vhosts",
    "service_vhosts_refused_total",
    "service_declares_refused_total",
    "upstream_policy_sync_total",
    "upstream_policies_synced",
    "storage_bytes",
    "storage_segments",
    "storage_fsync_seconds",
    "storage_recovered_messages",
    "storage_recovery_damaged_records",
    "storage_recovery_torn_bytes",
    "storage_recovery_seconds",
    "storage_paging_budget_bytes",
    "storage_resident_bytes",
    "storage_paged_messages",
    "storage_paged_bytes",
    "storage_page_outs_total",
    "storage_page_ins_total",
    "storage_page_in_reads_total",
    "storage_page_in_failures_total",
    "storage_page_in_retries_total",
    "disk_alarm",
    "disk_free_bytes",
    "disk_free_limit_bytes",
    "redriven_total",
    "redrive_skipped_total",
    "redrive_failed_total",
    "redrive_jobs_running",
];

/// The `outcome` label of `captured_total`: the captured message was dead-lettered (the
/// publish to its dead-letter exchange confirmed).
pub const CAPTURED_DEAD_LETTERED: &str = "dead_lettered";
/// ... discarded: its queue has no dead-letter exchange (as RabbitMQ discards it).
pub const CAPTURED_DISCARDED: &str = "discarded";
/// ... dropped, counted by cause in `dead_letter_dropped_total` (cycle, no_dlx, unroutable,
/// hop_limit) or unreadable (no death record, properties that do not decode).
pub const CAPTURED_DROPPED: &str = "dropped";
/// ... refused (publish nacked, timed out, lost with the channel, 403): held unacked and
/// published again after the backoff of `proxy.retry_initial_ms` (counted at each refusal).
pub const CAPTURED_RETRIED: &str = "retried";
/// ... an expired dead letter put back into its queue (`dead_letter.ttl_on_dead_letters =
/// false`; also counted in `dead_letters_kept_total`).
pub const CAPTURED_KEPT: &str = "kept";
/// ... a message whose retry delay passed, published back into its queue (retry tiers).
pub const CAPTURED_RETURNED: &str = "returned";
/// ... a rejection the upstream dead-lettered on a queue with retry tiers, now waiting in its
/// delay queue.
pub const CAPTURED_HELD: &str = "held";
const CAPTURED_OUTCOMES: &[&str] = &[
    CAPTURED_RETURNED,
    CAPTURED_HELD,
    CAPTURED_DEAD_LETTERED,
    CAPTURED_KEPT,
    CAPTURED_DISCARDED,
    CAPTURED_DROPPED,
    CAPTURED_RETRIED,
];

/// The `reason` label of `connections_refused_total` for a connection over
/// `limits.max_connections`.
pub const REFUSED_MAX_CONNECTIONS: &str = "max_connections";
/// ... for a loopback-only user connecting from another address (proxy mode).
pub const REFUSED_LOOPBACK_ONLY: &str = "loopback_only";
/// ... for a client whose upstream cannot be reached (proxy mode).
pub const REFUSED_UPSTREAM_UNREACHABLE: &str = "upstream_unreachable";
/// ... for an admin HTTP connection from a peer address that holds its share of the admin
/// server's connections already.
pub const REFUSED_ADMIN_PER_PEER: &str = "admin_per_peer";
/// `dead_letter_retries_total{reason}` labels (proxy mode): why a held dead letter is
/// published again.
pub const RETRY_REASONS: &[&str] = &[
    "nacked",
    "timeout",
    "channel_lost",
    "access_refused",
    "unroutable",
];

const REFUSAL_REASONS: &[&str] = &[
    REFUSED_MAX_CONNECTIONS,
    REFUSED_LOOPBACK_ONLY,
    REFUSED_UPSTREAM_UNREACHABLE,
    REFUSED_ADMIN_PER_PEER,
];

/// Buckets of `dead_letter_latency_seconds`: 100 µs to 60 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// Buckets of `message_age_at_dead_letter_seconds`: 1 ms to 1 day.
const AGE_BUCKETS: &[f64] = &[
    0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
    21600.0, 43200.0, 86400.0,
];

/// A queue's depth gauges (messages and body bytes of ready messages).
#[derive(Clone, Debug)]
pub struct QueueDepthGauges {
    messages: IntGauge,
    bytes: IntGauge,
}

impl QueueDepthGauges {
    pub fn set(&self, messages: u64, bytes: u64) {
        self.messages.set(saturating_i64(messages));
        self.bytes.set(saturating_i64(bytes));
    }
}

/// Which way frames and bytes travelled. Embedded mode only uses the client directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Read from a client socket.
    ClientIn,
    /// Written to a client socket.
    ClientOut,
    /// Read from an upstream socket (proxy mode).
    UpstreamIn,
    /// Written to an upstream socket (proxy mode).
    UpstreamOut,
}

impl Direction {
    /// How many directions there are (`UpstreamOut` is the last variant), the length of the
    /// per-direction series caches.
    const COUNT: usize = Direction::UpstreamOut as usize + 1;

    /// The `direction` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::ClientIn => "client_in",
            Direction::ClientOut => "client_out",
            Direction::UpstreamIn => "upstream_in",
            Direction::UpstreamOut => "upstream_out",
        }
    }
}

/// The series kept for one admitted (vhost, queue) pair, so that they can be removed.
#[derive(Default)]
struct QueueSeries {
    reasons: BTreeSet<String>,
    causes: BTreeSet<String>,
    consumer_timeouts: bool,
    dead_letters_kept: bool,
    retry_tiers: BTreeSet<u64>,
    retry_held: bool,
    retry_exhausted: bool,
    has_depth: bool,
    redriven: bool,
    redrive_skipped: bool,
    redrive_failures: BTreeSet<String>,
}

/// Admits at most `max` distinct (vhost, queue) pairs as label values.
struct QueueLabels {
    max: usize,
    admitted: Mutex<HashMap<(String, String), QueueSeries>>,
    /// Held retries counted under `_other`, per queue: such a queue stays there until they are
    /// gone, so each decrement meets its increment under the same label even if a slot frees
    /// up meanwhile (one entry per folded queue holding messages).
    folded_held: Mutex<HashMap<(String, String), i64>>,
}

impl QueueLabels {
    fn lock(&self) -> MutexGuard<'_, HashMap<(String, String), QueueSeries>> {
        // A panic while holding the lock leaves the map consistent: keep using it.
        self.admitted.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn folded_held(&self) -> MutexGuard<'_, HashMap<(String, String), i64>> {
        self.folded_held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What [`Metrics::before_scrape`] keeps: sets gauges read off live state.
type ScrapeRefresh = Box<dyn Fn(&Metrics) + Send + Sync>;

/// All metrics of one service instance.
pub struct Metrics {
    registry: Registry,
    queue_labels: QueueLabels,
    dead_lettered: IntCounterVec,
    dead_letter_dropped: IntCounterVec,
    dead_letter_publish_failures: IntCounterVec,
    dead_letter_retries: IntCounterVec,
    publisher_channel_reopens: IntCounterVec,
    dead_letters_by_service: IntCounter,
    consumer_dead_letters_by_service: IntCounter,
    upstream_connections_blocked: IntGaugeVec,
    dead_letters_held: IntGauge,
    deliveries_kept_tag_only: IntCounter,
    consumer_timeouts: IntCounterVec,
    dead_letters_kept: IntCounterVec,
    retries: IntCounterVec,
    retry_held: IntGaugeVec,
    retry_exhausted: IntCounterVec,
    messages_published: IntCounter,
    messages_delivered: IntCounter,
    messages_acked: IntCounter,
    connections_opened_total: IntCounter,
    connections_refused: IntCounterVec,
    frames: IntCounterVec,
    bytes: IntCounterVec,
    /// The frames and the bytes series of each direction, looked up in the vectors once, at
    /// their first use: `traffic` runs for every socket write and read.
    frame_series: [OnceLock<IntCounter>; Direction::COUNT],
    byte_series: [OnceLock<IntCounter>; Direction::COUNT],
    config_reloads: IntCounterVec,
    tls_reloads: IntCounterVec,
    labels_folded: IntCounter,
    connections: IntGauge,
    channels: IntGauge,
    consumers: IntGauge,
    queues: IntGauge,
    exchanges: IntGauge,
    bindings: IntGauge,
    /// Run by [`Metrics::encode`] before it gathers: sets the gauges read off live state.
    before_scrape: std::sync::OnceLock<ScrapeRefresh>,
    queue_messages: IntGaugeVec,
    queue_bytes: IntGaugeVec,
    inflight_deliveries: IntGauge,
    /// Woken whenever deliveries are settled (released from the inflight gauges): the drain
    /// at shutdown waits on it instead of polling.
    settled: tokio::sync::Notify,
    inflight_bytes: IntGauge,
    verified_queues: IntGauge,
    session_queue_settings: IntGauge,
    outbox_bytes: IntGauge,
    admin_connections: IntGauge,
    upstream_outbox_bytes: IntGauge,
    outbox_read_buffers: IntGauge,
    memory_alarm: IntGauge,
    memory_used: IntGauge,
    memory_limit: IntGauge,
    memory_watermark: IntGauge,
    blocked_connections: IntGauge,
    connection_blocks: IntCounter,
    memory_releases: IntCounter,
    dead_letter_latency: Histogram,
    message_age_at_dead_letter: Histogram,
    capture_consumers: IntGaugeVec,
    declare_connections: IntGaugeVec,
    capture_unacked: IntGaugeVec,
    service_reconnects: IntCounterVec,
    captured: IntCounterVec,
    service_vhosts: IntGauge,
    service_vhosts_refused: IntCounter,
    service_declares_refused: IntCounter,
    upstream_connect_attempts: IntCounterVec,
    upstream_reachable: IntGauge,
    redriven: IntCounterVec,
    redrive_skipped: IntCounterVec,
    redrive_failed: IntCounterVec,
    redrive_jobs: IntGauge,
    upstream_policy_sync: IntCounterVec,
    upstream_policies_synced: IntGauge,
    storage_bytes: IntGauge,
    storage_segments: IntGauge,
    storage_fsync: Histogram,
    storage_recovered: IntGauge,
    storage_damaged: IntGauge,
    storage_torn: IntGauge,
    storage_recovery_seconds: Gauge,
    paging_budget: IntGauge,
    paging_resident: IntGauge,
    paged_messages: IntGauge,
    paged_bytes: IntGauge,
    page_outs: IntCounter,
    page_ins: IntCounter,
    page_in_reads: IntCounter,
    page_in_failures: IntCounter,
    page_in_retries: IntCounter,
    disk_alarm: IntGauge,
    disk_free: IntGauge,
    disk_free_limit: IntGauge,
}

/// Creates and registers metrics on one registry.
struct Builder<'a> {
    registry: &'a Registry,
}

impl Builder<'_> {
    fn opts(name: &str, help: &str) -> Opts {
        Opts::new(format!("{PREFIX}{name}"), help)
    }

    fn register<C: prometheus::core::Collector + Clone + 'static>(
        &self,
        collector: C,
    ) -> prometheus::Result<C> {
        self.registry.register(Box::new(collector.clone()))?;
        Ok(collector)
    }

    fn counter(&self, name: &str, help: &str) -> prometheus::Result<IntCounter> {
        self.register(IntCounter::with_opts(Self::opts(name, help))?)
    }

    fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::Result<IntCounterVec> {
        self.register(IntCounterVec::new(Self::opts(name, help), labels)?)
    }

    fn gauge(&self, name: &str, help: &str) -> prometheus::Result<IntGauge> {
        self.register(IntGauge::with_opts(Self::opts(name, help))?)
    }

    fn float_gauge(&self, name: &str, help: &str) -> prometheus::Result<Gauge> {
        self.register(Gauge::with_opts(Self::opts(name, help))?)
    }

    fn gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::Result<IntGaugeVec> {
        self.register(IntGaugeVec::new(Self::opts(name, help), labels)?)
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> prometheus::Result<Histogram> {
        let opts = HistogramOpts::new(format!("{PREFIX}{name}"), help).buckets(buckets.to_vec());
        self.register(Histogram::with_opts(opts)?)
    }
}

const QUEUE_LABELS: &[&str] = &["vhost", "queue"];

impl Metrics {
    /// A fresh registry with every metric registered; at most `max_queue_labels` distinct
    /// (vhost, queue) pairs get their own series.
    pub fn new(max_queue_labels: usize) -> Arc<Metrics> {
        // Names, help texts and label sets are constants tested below: registering cannot fail.
        Arc::new(Self::build(max_queue_labels).expect("metric definitions are valid and unique"))
    }

    fn build(max_queue_labels: usize) -> prometheus::Result<Metrics> {
        let registry = Registry::new();
        let b = Builder {
            registry: &registry,
        };
        let metrics = Metrics {
            queue_labels: QueueLabels {
                max: max_queue_labels,
                admitted: Mutex::new(HashMap::new()),
                folded_held: Mutex::new(HashMap::new()),
            },
            dead_lettered: b.counter_vec(
                "dead_lettered_total",
                "Messages dead-lettered, by source queue and reason \
                 (rejected, expired, maxlen, delivery_limit).",
                &["vhost", "queue", "reason"],
            )?,
            consumer_timeouts: b.counter_vec(
                "consumer_timeouts_total",
                "Channels closed because a delivery stayed unacknowledged past its consumer \
                 timeout, by the queue of that delivery.",
                &["vhost", "queue"],
            )?,
            dead_letters_kept: b.counter_vec(
                "dead_letters_kept_total",
                "Proxy mode, dead_letter.ttl_on_dead_letters = false: dead letters the upstream \
                 expired that were put back into their queue instead of dead-lettered, by queue.",
                &["vhost", "queue"],
            )?,
            retries: b.counter_vec(
                "retries_total",
                "Messages rejected with requeue=false on a queue with retry tiers \
                 (x-retry-delays) and held for a retry, by queue and tier (1-based).",
                &["vhost", "queue", "tier"],
            )?,
            retry_held: b.gauge_vec(
                "retry_held_messages",
                "Messages waiting for their retry delay to pass, by queue.",
                &["vhost", "queue"],
            )?,
            retry_exhausted: b.counter_vec(
                "retry_exhausted_total",
                "Rejections on a queue with retry tiers after its last tier: dead-lettered \
                 (or dropped without a DLX) as usual, by queue.",
                &["vhost", "queue"],
            )?,
            dead_letter_dropped: b.counter_vec(
                "dead_letter_dropped_total",
                "Messages that died but were not dead-lettered, by source queue and cause \
                 (cycle, no_dlx, unroutable, hop_limit, target_full, unpublishable, \
                 undecodable).",
                &["vhost", "queue", "cause"],
            )?,
            dead_letter_publish_failures: b.counter_vec(
                "dead_letter_publish_failures_total",
                "Dead-letter publishes to the upstream that failed, by cause (nack, timeout, \
                 channel closed, access_refused); the original stays unacked upstream, held by \
                 the proxy, and the publish is retried.",
                &["cause"],
            )?,
            publisher_channel_reopens: b.counter_vec(
                "publisher_channel_reopens_total",
                "The proxy's own confirm-mode publisher channels opened again (proxy mode), by \
                 cause: closed (the upstream closed the channel) or nacks (the channel only \
                 nacked and was recycled).",
                &["cause"],
            )?,
            dead_letter_retries: b.counter_vec(
                "dead_letter_retries_total",
                "Refused dead-letter publishes (proxy mode) scheduled to be published again \
                 with backoff, by reason (nacked, timeout, channel_lost, access_refused).",
                &["reason"],
            )?,
            dead_letters_by_service: b.counter(
                "dead_letters_by_service_total",
                "Dead letters of client rejections, and requeues counted against a classic \
                 queue's delivery limit (proxy mode), that the client's user may not publish \
                 (403), handed to the vhost's service connection to be published as the \
                 proxy's service user.",
            )?,
            consumer_dead_letters_by_service: b.counter(
                "consumer_dead_letters_by_service_total",
                "Dead letters and delivery-limit requeues (proxy mode) of client connections \
                 that never published, handed to the vhost's service connection to publish so \
                 that a RabbitMQ resource alarm never blocks a consumer's connection (one the \
                 service user is refused goes back to the client's connection).",
            )?,
            upstream_connections_blocked: b.gauge_vec(
                "upstream_connections_blocked",
                "Proxy mode: upstream connections RabbitMQ holds blocked (connection.blocked: a \
                 memory or disk alarm, after a publish on them), by connection (client, \
                 service); the proxy's dead letters on them wait, their confirm deadlines \
                 stopped.",
                &["connection"],
            )?,
            redriven: b.counter_vec(
                "redriven_total",
                "Messages a redrive moved out of a dead-letter queue, by vhost and target queue.",
                &["vhost", "queue"],
            )?,
            redrive_skipped: b.counter_vec(
                "redrive_skipped_total",
                "Messages a redrive left in their dead-letter queue because of its filter, by \
                 dead-letter queue.",
                &["vhost", "queue"],
            )?,
            redrive_failed: b.counter_vec(
                "redrive_failed_total",
                "Messages a redrive could not move (they stay in the dead-letter queue), by \
                 dead-letter queue and cause (no_queue, target_full, no_source, same_queue, \
                 undecodable; embedded mode also unreadable; proxy mode also timed_out, \
                 publish_failed, unpublishable).",
                &["vhost", "queue", "cause"],
            )?,
            redrive_jobs: b.gauge("redrive_jobs_running", "Redrive jobs running.")?,
            dead_letters_held: b.gauge(
                "dead_letters_held",
                "Dead letters (proxy mode) whose publish was refused, held unacked upstream \
                 while the proxy retries them; counted in inflight_deliveries/bytes too.",
            )?,
            deliveries_kept_tag_only: b.counter(
                "deliveries_kept_tag_only_total",
                "Deliveries (proxy mode) of queues the proxy dead-letters for, kept as their tag \
                 only because their connection's kept bytes were at proxy.max_inflight_bytes; a \
                 reject or nack of one goes upstream as sent and reaches the proxy through the \
                 capture route.",
            )?,
            messages_published: b
                .counter("messages_published_total", "Messages published by clients.")?,
            messages_delivered: b.counter(
                "messages_delivered_total",
                "Messages delivered to clients (basic.deliver and basic.get-ok).",
            )?,
            messages_acked: b.counter(
                "messages_acked_total",
                "Deliveries acknowledged by clients.",
            )?,
            connections_opened_total: b
                .counter("connections_opened_total", "Client connections accepted.")?,
            connections_refused: b.counter_vec(
                "connections_refused_total",
                "Client connections refused, by reason (max_connections, loopback_only, \
                 upstream_unreachable; admin_per_peer for the admin HTTP server).",
                &["reason"],
            )?,
            frames: b.counter_vec("frames_total", "AMQP frames, by direction.", &["direction"])?,
            bytes: b.counter_vec(
                "bytes_total",
                "Bytes of AMQP traffic, by direction.",
                &["direction"],
            )?,
            frame_series: Default::default(),
            byte_series: Default::default(),
            config_reloads: b.counter_vec(
                "config_reloads_total",
                "Configuration reloads, by result (success, failure).",
                &["result"],
            )?,
            tls_reloads: b.counter_vec(
                "tls_reloads_total",
                "TLS certificate, key and CA reloads (file change or SIGHUP), by result \
                 (success, failure: the previous material stays in force).",
                &["result"],
            )?,
            labels_folded: b.counter(
                "metric_labels_folded_total",
                "Metric updates whose queue label was folded into \"_other\" because the \
                 distinct-queue cap (metrics.max_queue_labels) was reached.",
            )?,
            connections: b.gauge("connections", "Open client connections.")?,
            channels: b.gauge("channels", "Open client channels.")?,
            consumers: b.gauge(
                "consumers",
                "Consumers on client channels (each channel holds at most \
                 limits.max_consumers_per_channel).",
            )?,
            queues: b.gauge(
                "queues",
                "Queues in every vhost (embedded mode; at most limits.max_queues per vhost), \
                 read when scraped.",
            )?,
            exchanges: b.gauge(
                "exchanges",
                "Exchanges declared in every vhost (embedded mode; at most \
                 limits.max_exchanges per vhost; the default and amq.* exchanges every \
                 vhost has are not counted), read when scraped.",
            )?,
            bindings: b.gauge(
                "bindings",
                "Bindings in every vhost (embedded mode; at most limits.max_bindings per \
                 vhost), read when scraped.",
            )?,
            before_scrape: std::sync::OnceLock::new(),
            queue_messages: b.gauge_vec(
                "queue_messages",
                "Messages in a queue (embedded mode).",
                QUEUE_LABELS,
            )?,
            queue_bytes: b.gauge_vec(
                "queue_bytes",
                "Body bytes of the messages in a queue (embedded mode).",
                QUEUE_LABELS,
            )?,
            inflight_deliveries: b.gauge(
                "inflight_deliveries",
                "Deliveries sent to clients and not yet settled, and dead letters being \
                 published or held (proxy mode).",
            )?,
            settled: tokio::sync::Notify::new(),
            inflight_bytes: b.gauge(
                "inflight_bytes",
                "Body bytes of the deliveries sent to clients and not yet settled, and of \
                 dead letters being published or held (proxy mode).",
            )?,
            verified_queues: b.gauge(
                "verified_queues",
                "Proxy mode: queues whose settings the upstream confirmed to this instance \
                 (the bounded cache of verified declarations).",
            )?,
            session_queue_settings: b.gauge(
                "session_queue_settings",
                "Proxy mode: queue settings the client connections keep for their settlements \
                 (at most 64 queues per connection, dropped when policies or verified queues \
                 change).",
            )?,
            outbox_bytes: b.gauge(
                "outbox_bytes",
                "Encoded bytes waiting to be written to client sockets.",
            )?,
            admin_connections: b.gauge(
                "admin_connections",
                "Open connections to the admin HTTP server (at most 256).",
            )?,
            upstream_outbox_bytes: b.gauge(
                "upstream_outbox_bytes",
                "Proxy mode: bytes waiting to be written to upstream sockets.",
            )?,
            outbox_read_buffers: b.gauge(
                "outbox_read_buffers",
                "Proxy mode: read buffers kept alive by forwarded runs queued without a copy \
                 (at most 16 per outbox and 64 KiB or one frame each; counted from the first \
                 run queued from a buffer until that run is written).",
            )?,
            memory_alarm: b.gauge(
                "memory_alarm",
                "1 while the memory alarm is raised (used memory above the high watermark: \
                 publishing connections are blocked), else 0 (embedded mode).",
            )?,
            memory_used: b.gauge(
                "memory_used_bytes",
                "Resident memory of the process as the memory alarm last sampled it.",
            )?,
            memory_limit: b.gauge(
                "memory_limit_bytes",
                "Memory available to the process: its cgroup limit, or the total RAM.",
            )?,
            memory_watermark: b.gauge(
                "memory_high_watermark_bytes",
                "Used memory above which the memory alarm is raised \
                 (limits.memory_high_watermark).",
            )?,
            blocked_connections: b.gauge(
                "blocked_connections",
                "Client connections not being read because they published while the memory \
                 alarm was raised.",
            )?,
            connection_blocks: b.counter(
                "connection_blocks_total",
                "Times a client connection was blocked by the memory alarm.",
            )?,
            memory_releases: b.counter(
                "memory_releases_total",
                "Times free allocator memory was handed back to the operating system.",
            )?,
            dead_letter_latency: b.histogram(
                "dead_letter_latency_seconds",
                "Time from the death of a message (reject, expiry, overflow) to its confirmed \
                 republish to the dead-letter exchange.",
                LATENCY_BUCKETS,
            )?,
            message_age_at_dead_letter: b.histogram(
                "message_age_at_dead_letter_seconds",
                "Time a message spent in its queue before it was dead-lettered.",
                AGE_BUCKETS,
            )?,
            capture_consumers: b.gauge_vec(
                "capture_consumers",
                "Proxy mode: 1 while the vhost's service connection consumes its capture queue, \
                 else 0.",
                &["vhost"],
            )?,
            declare_connections: b.gauge_vec(
                "declare_connections",
                "Proxy mode: 1 while the vhost's declare connection (the service user's \
                 connection that checks client declares; it never publishes) is open, else 0.",
                &["vhost"],
            )?,
            capture_unacked: b.gauge_vec(
                "capture_unacked",
                "Proxy mode: capture deliveries the vhost's service connection holds unacked \
                 (dead letters in flight, held, or confirmed and waiting for their run's ack); \
                 at most proxy.capture_prefetch.",
                &["vhost"],
            )?,
            service_reconnects: b.counter_vec(
                "service_reconnects_total",
                "Proxy mode: attempts to open a vhost's service connection again after it or \
                 its capture consumer was lost (or an attempt failed), by vhost.",
                &["vhost"],
            )?,
            captured: b.counter_vec(
                "captured_total",
                "Proxy mode: messages taken from the capture queue, by vhost and outcome \
                 (dead_lettered, discarded, dropped, kept; retried: its dead letter was refused \
                 and is held for another publish; held: a rejection now waiting for its retry \
                 tier; returned: a message whose retry delay passed, back in its queue).",
                &["vhost", "outcome"],
            )?,
            service_vhosts: b.gauge(
                "service_vhosts",
                "Proxy mode: vhosts with a service connection (proxy.vhosts and the vhosts \
                 clients opened), at most proxy.max_service_vhosts.",
            )?,
            service_vhosts_refused: b.counter(
                "service_vhosts_refused_total",
                "Proxy mode: vhosts opened by clients that got no service connection because \
                 proxy.max_service_vhosts was reached.",
            )?,
            service_declares_refused: b.counter(
                "service_declares_refused_total",
                "Proxy mode: client queue.declares whose check the vhost's declare connection \
                 could not take (its queue of 1024 waiting declares full, or the connection \
                 gone); the client connection was closed with 320.",
            )?,
            upstream_connect_attempts: b.counter_vec(
                "upstream_connect_attempts_total",
                "Connections the proxy tried to open to an upstream node (host:port of \
                 upstream.urls), by result (success, failure); reachability checks are not \
                 counted.",
                &["upstream", "result"],
            )?,
            upstream_reachable: b.gauge(
                "upstream_reachable",
                "1 while some upstream node accepted the last connection or check, else 0 \
                 (proxy mode; /readyz answers 503 while it is 0).",
            )?,
            upstream_policy_sync: b.counter_vec(
                "upstream_policy_sync_total",
                "Reconciliations of one vhost's upstream policies with the proxy's \
                 (upstream.management_url), by result (success, failure, capture_missing).",
                &["result"],
            )?,
            upstream_policies_synced: b.gauge(
                "upstream_policies_synced",
                "Upstream policies of this deployment that match the proxy's policies, over \
                 every vhost, after the last reconciliation.",
            )?,
            storage_bytes: b.gauge(
                "storage_bytes",
                "Bytes of message log segments on disk (embedded mode with storage.dir).",
            )?,
            storage_segments: b.gauge("storage_segments", "Message log segment files on disk.")?,
            storage_fsync: b.histogram(
                "storage_fsync_seconds",
                "Duration of each fsync of the message log (one per group commit).",
                LATENCY_BUCKETS,
            )?,
            storage_recovered: b.gauge(
                "storage_recovered_messages",
                "Messages restored into durable queues at the last start.",
            )?,
            storage_damaged: b.gauge(
                "storage_recovery_damaged_records",
                "Damaged records skipped in the middle of segments at the last start (at most \
                 this many messages lost).",
            )?,
            storage_torn: b.gauge(
                "storage_recovery_torn_bytes",
                "Bytes of torn records cut off the ends of segments at the last start.",
            )?,
            storage_recovery_seconds: b.float_gauge(
                "storage_recovery_seconds",
                "Seconds the last start took to read the storage directory and load the \
                 definitions and messages into the broker.",
            )?,
            paging_budget: b.gauge(
                "storage_paging_budget_bytes",
                "storage.paging_budget: content bytes of queued persistent messages held in \
                 memory before queues page out.",
            )?,
            paging_resident: b.gauge(
                "storage_resident_bytes",
                "Content bytes (exchange, keys, properties, body) of queued messages kept on \
                 disk that are also held in memory.",
            )?,
            paged_messages: b.gauge(
                "storage_paged_messages",
                "Queued messages whose content is on disk only (paged out).",
            )?,
            paged_bytes: b.gauge(
                "storage_paged_bytes",
                "Body bytes of the queued messages whose content is on disk only.",
            )?,
            page_outs: b.counter(
                "storage_page_outs_total",
                "Queued messages whose content was dropped from memory (paged out).",
            )?,
            page_ins: b.counter(
                "storage_page_ins_total",
                "Paged-out messages whose content was read back (delivery, dead-lettering, \
                 inspection).",
            )?,
            page_in_reads: b.counter(
                "storage_page_in_reads_total",
                "Positioned reads of the message log for page-ins (one serves the messages \
                 after it too: read-ahead).",
            )?,
            page_in_failures: b.counter(
                "storage_page_in_failures_total",
                "Paged-out messages whose content could not be read back (lost: disk fault).",
            )?,
            page_in_retries: b.counter(
                "storage_page_in_retries_total",
                "Reads of paged-out messages that failed with an error that may pass (too many \
                 open files, I/O); the message stays queued and is read again.",
            )?,
            disk_alarm: b.gauge(
                "disk_alarm",
                "1 while free space on the storage.dir file system is below \
                 storage.disk_free_limit (publishers are blocked), else 0.",
            )?,
            disk_free: b.gauge(
                "disk_free_bytes",
                "Free bytes on the storage.dir file system at the last check.",
            )?,
            disk_free_limit: b.gauge(
                "disk_free_limit_bytes",
                "storage.disk_free_limit in bytes (0: no disk alarm).",
            )?,
            registry,
        };
        // Every refusal reason is exported from the start (at 0), for alerts on increase().
        for reason in REFUSAL_REASONS {
            metrics.connections_refused.with_label_values(&[reason]);
        }
        for reason in RETRY_REASONS {
            metrics.dead_letter_retries.with_label_values(&[reason]);
        }
        for cause in [
            crate::proxy::publisher::REOPEN_CLOSED,
            crate::proxy::publisher::REOPEN_NACKS,
        ] {
            metrics
                .publisher_channel_reopens
                .with_label_values(&[cause]);
        }
        for connection in [BLOCKED_CLIENT, BLOCKED_SERVICE] {
            metrics
                .upstream_connections_blocked
                .with_label_values(&[connection]);
        }
        metrics.register_process_metrics()?;
        Ok(metrics)
    }

    /// `dlx_proxy_build_info{version} 1`, and the standard process metrics of this process
    /// (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`,
    /// `process_max_fds`, `process_virtual_memory_bytes`, `process_start_time_seconds`; Linux
    /// only) with the `dlx_proxy_` prefix like every other metric (RabbitMQ prefixes them
    /// `rabbitmq_` likewise).
    fn register_process_metrics(&self) -> prometheus::Result<()> {
        let b = Builder {
            registry: &self.registry,
        };
        let build_info = b.gauge_vec(
            "build_info",
            "Always 1; the labels say which build is running.",
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        #[cfg(target_os = "linux")]
        self.registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::new(
                std::process::id() as i32,
                PREFIX.trim_end_matches('_'),
            ),
        ))?;
        Ok(())
    }

    /// The registry holding every metric (to add process collectors, for instance).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Whether (vhost, queue) has its own label values, admitting the pair if there is room;
    /// `false` means it is folded into `_other`. `record` notes the series about to be written.
    fn queue_label(&self, vhost: &str, queue: &str, record: impl FnOnce(&mut QueueSeries)) -> bool {
        let mut admitted = self.queue_labels.lock();
        let key = (vhost.to_string(), queue.to_string());
        if let Some(series) = admitted.get_mut(&key) {
            record(series);
            return true;
        }
        if admitted.len() < self.queue_labels.max {
            let mut series = QueueSeries::default();
            record(&mut series);
            admitted.insert(key, series);
            return true;
        }
        drop(admitted);
        self.labels_folded.inc();
        false
    }

    /// One message dead-lettered from `queue` for `reason` (rejected, expired, maxlen,
    /// delivery_limit).
    pub fn dead_lettered(&self, vhost: &str, queue: &str, reason: &str) {
        let own = self.queue_label(vhost, queue, |s| {
            if !s.reasons.contains(reason) {
                s.reasons.insert(reason.to_string());
            }
        });
        let queue = if own { queue } else { OTHER_QUEUE };
        self.dead_lettered
            .with_label_values(&[vhost, queue, reason])
            .inc();
    }

    /// One message that died in `queue` but was dropped instead of dead-lettered, for `cause`
    /// (docs/semantics.md lists every cause).
    pub fn dropped(&self, vhost: &str, queue: &str, cause: &str) {
        let own = self.queue_label(vhost, queue, |s| {
            if !s.causes.contains(cause) {
                s.causes.insert(cause.to_string());
            }
        });
        let queue = if own { queue } else { OTHER_QUEUE };
        self.dead_letter_dropped
            .with_label_values(&[vhost, queue, cause])
            .inc();
    }

    /// A channel was closed because a delivery from `queue` was not acknowledged in time.
    pub fn consumer_timed_out(&self, vhost: &str, queue: &str) {
        let own = self.queue_label(vhost, queue, |s| s.consumer_timeouts = true);
        let queue = if own { queue } else { OTHER_QUEUE };
        self.consumer_timeouts
            .with_label_values(&[vhost, queue])
            .inc();
    }

    /// Proxy mode: a dead letter the upstream expired from `queue` was put back into it
    /// (`dead_letter.ttl_on_dead_letters = false`).
    pub fn dead_letter_kept(&self, vhost: &str, queue: &str) {
        let own = self.queue_label(vhost, queue, |s| s.dead_letters_kept = true);
        let queue = if own { queue } else { OTHER_QUEUE };
        self.dead_letters_kept
            .with_label_values(&[vhost, queue])
            .inc();
    }

    /// One dead-letter publish to the upstream failed (`cause`: nack, timeout).
    pub fn dead_letter_publish_failed(&self, cause: &str) {
        self.dead_letter_publish_failures
            .with_label_values(&[cause])
            .inc();
    }

    /// Whether the vhost's service connection consumes its capture queue.
    pub fn set_capture_consumer(&self, vhost: &str, consuming: bool) {
        self.capture_consumers
            .with_label_values(&[vhost])
            .set(i64::from(consuming));
    }

    /// The gauge of the capture deliveries `vhost`'s service connection holds unacked (kept
    /// by the connection, so that setting it costs no label lookup).
    pub fn capture_unacked(&self, vhost: &str) -> prometheus::IntGauge {
        self.capture_unacked.with_label_values(&[vhost])
    }

    /// A vhost's service connection was opened again.
    pub fn service_reconnected(&self, vhost: &str) {
        self.service_reconnects.with_label_values(&[vhost]).inc();
    }

    /// Whether the vhost's declare connection is open.
    pub fn set_declare_connection(&self, vhost: &str, open: bool) {
        self.declare_connections
            .with_label_values(&[vhost])
            .set(i64::from(open));
    }

    /// A service connection for `vhost` started (reconnects counted from 0, outcomes at 0).
    pub fn service_started(&self, vhost: &str) {
        self.service_reconnects.with_label_values(&[vhost]);
        for outcome in CAPTURED_OUTCOMES {
            self.captured.with_label_values(&[vhost, outcome]);
        }
        self.set_capture_consumer(vhost, false);
        self.set_declare_connection(vhost, false);
        self.capture_unacked.with_label_values(&[vhost]).set(0);
        self.service_vhosts.inc();
    }

    /// A vhost got no service connection (over `proxy.max_service_vhosts`).
    pub fn service_vhost_refused(&self) {
        self.service_vhosts_refused.inc();
    }

    /// A client's dead letter refused to its user went to the service connection.
    pub fn dead_letter_by_service(&self) {
        self.dead_letters_by_service.inc();
    }

    /// A consume-only client connection's dead letter went to the service connection.
    pub fn consumer_dead_letter_by_service(&self) {
        self.consumer_dead_letters_by_service.inc();
    }

    /// An upstream connection (`connection`: [`BLOCKED_CLIENT`] or [`BLOCKED_SERVICE`]) was
    /// blocked by RabbitMQ (+1) or unblocked or closed while blocked (-1).
    pub fn add_upstream_connection_blocked(&self, connection: &str, change: i64) {
        self.upstream_connections_blocked
            .with_label_values(&[connection])
            .add(change);
    }

    /// A declare could not be handed to the vhost's declare connection.
    pub fn service_declare_refused(&self) {
        self.service_declares_refused.inc();
    }

    /// A captured message ended with `outcome` (one of the `CAPTURED_*` constants).
    pub fn captured(&self, vhost: &str, outcome: &str) {
        self.captured.with_label_values(&[vhost, outcome]).inc();
    }

    /// A refused dead-letter publish is held and will be retried (`reason`: one of
    /// [`RETRY_REASONS`]).
    pub fn dead_letter_retry(&self, reason: &str) {
        self.dead_letter_retries.with_label_values(&[reason]).inc();
    }

    /// A proxy publisher channel is being opened again (`cause`:
    /// [`crate::proxy::publisher::REOPEN_CLOSED`] or [`crate::proxy::publisher::REOPEN_NACKS`]).
    pub fn publisher_channel_reopened(&self, cause: &str) {
        self.publisher_channel_reopens
            .with_label_values(&[cause])
            .inc();
    }

    /// A delivery was kept as its tag only for want of room.
    pub fn delivery_kept_tag_only(&self) {
        self.deliveries_kept_tag_only.inc();
    }

    /// Held dead letters went up or down by `delta`.
    pub fn add_held_dead_letters(&self, delta: i64) {
        self.dead_letters_held.add(delta);
    }

    /// Time from a message's death to its confirmed republish.
    pub fn observe_dead_letter_latency(&self, latency: Duration) {
        self.dead_letter_latency.observe(latency.as_secs_f64());
    }

    /// How long a message had been in its queue when it was dead-lettered.
    pub fn observe_message_age_at_dead_letter(&self, age: Duration) {
        self.message_age_at_dead_letter.observe(age.as_secs_f64());
    }

    /// `count` messages published by clients.
    pub fn published(&self, count: u64) {
        self.messages_published.inc_by(count);
    }

    /// `count` messages delivered to clients.
    pub fn delivered(&self, count: u64) {
        self.messages_delivered.inc_by(count);
    }

    /// `count` deliveries acknowledged by clients.
    pub fn acked(&self, count: u64) {
        self.messages_acked.inc_by(count);
    }

    /// A client connection was refused (`reason`: one of the `REFUSED_*` labels).
    pub fn connection_refused(&self, reason: &str) {
        self.connections_refused.with_label_values(&[reason]).inc();
    }

    /// Exports both series of one upstream node at 0 (the label set is bounded by
    /// `upstream.urls`).
    pub fn upstream_target(&self, address: &str) {
        for result in ["success", "failure"] {
            self.upstream_connect_attempts
                .with_label_values(&[address, result]);
        }
    }

    /// One connection attempt to the upstream node `address` (`host:port`).
    pub fn upstream_connect_attempt(&self, address: &str, succeeded: bool) {
        let result = if succeeded { "success" } else { "failure" };
        self.upstream_connect_attempts
            .with_label_values(&[address, result])
            .inc();
    }

    /// Whether some upstream node is reachable (last known state).
    pub fn set_upstream_reachable(&self, reachable: bool) {
        self.upstream_reachable.set(i64::from(reachable));
    }

    /// Exports the series of these upstream policy sync results at 0.
    pub fn upstream_policy_sync_results(&self, results: &[&str]) {
        for result in results {
            self.upstream_policy_sync.with_label_values(&[result]);
        }
    }

    /// One vhost's upstream policies reconciled with this result.
    pub fn upstream_policy_sync(&self, result: &str) {
        self.upstream_policy_sync.with_label_values(&[result]).inc();
    }

    /// How many of the proxy's upstream policies are in place.
    pub fn set_upstream_policies_synced(&self, count: u64) {
        self.upstream_policies_synced
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// A client connection was accepted (counts it and raises the open-connections gauge).
    pub fn connection_opened(&self) {
        self.connections_opened_total.inc();
        self.connections.inc();
    }

    /// A client connection ended.
    pub fn connection_closed(&self) {
        self.connections.dec();
    }

    /// A client channel was opened.
    pub fn channel_opened(&self) {
        self.channels.inc();
    }

    /// `count` client channels were closed.
    pub fn channels_closed(&self, count: u64) {
        self.channels.sub(saturating_i64(count));
    }

    /// A consumer was started on a client channel.
    pub fn consumer_started(&self) {
        self.consumers.inc();
    }

    /// `count` consumers ended (cancelled, their queue deleted, or their channel closed).
    pub fn consumers_ended(&self, count: u64) {
        if count > 0 {
            self.consumers.sub(saturating_i64(count));
        }
    }

    /// Consumers were started (`delta` > 0) or ended (`delta` < 0).
    pub fn consumers_changed(&self, delta: i64) {
        if delta != 0 {
            self.consumers.add(delta);
        }
    }

    /// `frames` frames totalling `bytes` bytes went `direction`.
    pub fn traffic(&self, direction: Direction, frames: u64, bytes: u64) {
        let label = [direction.as_str()];
        let slot = direction as usize;
        if frames > 0 {
            self.frame_series[slot]
                .get_or_init(|| self.frames.with_label_values(&label))
                .inc_by(frames);
        }
        if bytes > 0 {
            self.byte_series[slot]
                .get_or_init(|| self.bytes.with_label_values(&label))
                .inc_by(bytes);
        }
    }

    /// Sets a queue's depth (messages and body bytes), if the queue has its own labels.
    pub fn set_queue_depth(&self, vhost: &str, queue: &str, messages: u64, bytes: u64) {
        if self.queue_label(vhost, queue, |s| s.has_depth = true) {
            let labels = [vhost, queue];
            self.queue_messages
                .with_label_values(&labels)
                .set(saturating_i64(messages));
            self.queue_bytes
                .with_label_values(&labels)
                .set(saturating_i64(bytes));
        }
    }

    /// Handles on a queue's depth gauges, so the broker can update them with an atomic store
    /// on the hot path instead of a label lookup; `None` while the queue is folded.
    pub fn queue_depth_gauges(&self, vhost: &str, queue: &str) -> Option<QueueDepthGauges> {
        if !self.queue_label(vhost, queue, |s| s.has_depth = true) {
            return None;
        }
        let labels = [vhost, queue];
        Some(QueueDepthGauges {
            messages: self.queue_messages.with_label_values(&labels),
            bytes: self.queue_bytes.with_label_values(&labels),
        })
    }

    /// A message rejected from `queue` is held for its retry tier `tier` (1-based).
    pub fn retried(&self, vhost: &str, queue: &str, tier: u64) {
        let own = self.queue_label(vhost, queue, |s| {
            s.retry_tiers.insert(tier);
        });
        let queue = if own { queue } else { OTHER_QUEUE };
        self.retries
            .with_label_values(&[vhost, queue, &tier.to_string()])
            .inc();
    }

    /// `delta` more (or fewer) messages of `queue` wait for their retry delay.
    pub fn add_retry_held(&self, vhost: &str, queue: &str, delta: i64) {
        let key = (vhost.to_string(), queue.to_string());
        let mut folded = self.queue_labels.folded_held();
        let own = match folded.get_mut(&key) {
            Some(held) => {
                *held += delta;
                if *held <= 0 {
                    folded.remove(&key);
                }
                false
            }
            None => {
                let own = self.queue_label(vhost, queue, |s| s.retry_held = true);
                if !own && delta > 0 {
                    folded.insert(key, delta);
                }
                own
            }
        };
        drop(folded);
        let queue = if own { queue } else { OTHER_QUEUE };
        self.retry_held
            .with_label_values(&[vhost, queue])
            .add(delta);
    }

    /// A rejection from `queue` after its last retry tier: it dead-letters as usual.
    pub fn retry_exhausted(&self, vhost: &str, queue: &str) {
        let own = self.queue_label(vhost, queue, |s| s.retry_exhausted = true);
        let queue = if own { queue } else { OTHER_QUEUE };
        self.retry_exhausted
            .with_label_values(&[vhost, queue])
            .inc();
    }

    /// Removes every series of a deleted queue and frees its label slot.
    pub fn remove_queue(&self, vhost: &str, queue: &str) {
        let key = (vhost.to_string(), queue.to_string());
        // Its held retries counted under `_other` went with it.
        let folded = self.queue_labels.folded_held().remove(&key);
        if let Some(held) = folded {
            self.retry_held
                .with_label_values(&[vhost, OTHER_QUEUE])
                .sub(held);
        }
        let Some(series) = self.queue_labels.lock().remove(&key) else {
            return;
        };
        // Removing a series that was never written is not an error worth reporting.
        for reason in &series.reasons {
            let _ = self
                .dead_lettered
                .remove_label_values(&[vhost, queue, reason.as_str()]);
        }
        for cause in &series.causes {
            let _ = self
                .dead_letter_dropped
                .remove_label_values(&[vhost, queue, cause.as_str()]);
        }
        if series.consumer_timeouts {
            let _ = self.consumer_timeouts.remove_label_values(&[vhost, queue]);
        }
        if series.dead_letters_kept {
            let _ = self.dead_letters_kept.remove_label_values(&[vhost, queue]);
        }
        for tier in &series.retry_tiers {
            let _ = self
                .retries
                .remove_label_values(&[vhost, queue, &tier.to_string()]);
        }
        if series.retry_held {
            let _ = self.retry_held.remove_label_values(&[vhost, queue]);
        }
        if series.retry_exhausted {
            let _ = self.retry_exhausted.remove_label_values(&[vhost, queue]);
        }
        if series.redriven {
            let _ = self.redriven.remove_label_values(&[vhost, queue]);
        }
        if series.redrive_skipped {
            let _ = self.redrive_skipped.remove_label_values(&[vhost, queue]);
        }
        for cause in &series.redrive_failures {
            let _ = self
                .redrive_failed
                .remove_label_values(&[vhost, queue, cause.as_str()]);
        }
        if series.has_depth {
            let _ = self.queue_messages.remove_label_values(&[vhost, queue]);
            let _ = self.queue_bytes.remove_label_values(&[vhost, queue]);
        }
    }

    /// Changes the unsettled-deliveries gauges by `deliveries` and `bytes` (negative to
    /// release).
    /// Deliveries the proxy keeps until they are settled (the drain waits for zero).
    pub fn inflight_deliveries(&self) -> i64 {
        self.inflight_deliveries.get()
    }

    /// Sets the size of proxy mode's verified-settings cache.
    pub fn set_verified_queues(&self, queues: usize) {
        self.verified_queues
            .set(i64::try_from(queues).unwrap_or(i64::MAX));
    }

    pub fn verified_queues(&self) -> i64 {
        self.verified_queues.get()
    }

    /// Queue settings kept by client sessions: `delta` more (or fewer).
    pub fn add_session_queue_settings(&self, delta: i64) {
        self.session_queue_settings.add(delta);
    }

    pub fn session_queue_settings(&self) -> i64 {
        self.session_queue_settings.get()
    }

    pub fn add_inflight(&self, deliveries: i64, bytes: i64) {
        self.inflight_deliveries.add(deliveries);
        self.inflight_bytes.add(bytes);
        // Only the drain waits, and only for zero: the release that brings the count to zero
        // reads it afterwards and sees zero, unless a delivery was kept in between, whose own
        // release to zero reads it again.
        if deliveries < 0 && self.inflight_deliveries.get() <= 0 {
            self.settled.notify_waiters();
        }
    }

    /// Resolves the next time releases bring the unsettled deliveries to zero after it was
    /// created (see [`tokio::sync::Notify`]: enable it, then check the count, then await it, so
    /// none is missed).
    pub fn settled(&self) -> tokio::sync::futures::Notified<'_> {
        self.settled.notified()
    }

    /// Changes the open admin HTTP connections gauge by `delta`.
    pub fn add_admin_connections(&self, delta: i64) {
        self.admin_connections.add(delta);
    }

    /// Changes the bytes-waiting-for-client-sockets gauge by `delta`.
    pub fn add_outbox_bytes(&self, delta: i64) {
        self.outbox_bytes.add(delta);
    }

    /// Changes the bytes-waiting-for-upstream-sockets gauge by `delta` (proxy mode).
    pub fn add_upstream_outbox_bytes(&self, delta: i64) {
        self.upstream_outbox_bytes.add(delta);
    }

    /// Changes the gauge of read buffers that queued runs keep alive by `delta`.
    pub fn add_outbox_read_buffers(&self, delta: i64) {
        self.outbox_read_buffers.add(delta);
    }

    /// Size of the message log on disk.
    pub fn set_storage(&self, bytes: u64, segments: u64) {
        self.storage_bytes.set(saturating_i64(bytes));
        self.storage_segments.set(saturating_i64(segments));
    }

    /// One fsync of the message log.
    pub fn observe_storage_fsync(&self, took: std::time::Duration) {
        self.storage_fsync.observe(took.as_secs_f64());
    }

    /// What recovery found at start.
    pub fn set_storage_recovery(&self, messages: u64, damaged_records: u64, torn_bytes: u64) {
        self.storage_recovered.set(saturating_i64(messages));
        self.storage_damaged.set(saturating_i64(damaged_records));
        self.storage_torn.set(saturating_i64(torn_bytes));
    }

    /// How long the last start's recovery took.
    pub fn set_storage_recovery_time(&self, took: std::time::Duration) {
        self.storage_recovery_seconds.set(took.as_secs_f64());
    }

    /// The paging account (gauges) and its counters (raised to their new totals).
    pub fn set_paging(&self, s: &crate::broker::paging::PagingStats) {
        self.paging_budget.set(saturating_i64(s.budget));
        self.paging_resident.set(saturating_i64(s.resident_bytes));
        self.paged_messages.set(saturating_i64(s.paged_messages));
        self.paged_bytes.set(saturating_i64(s.paged_bytes));
        for (counter, total) in [
            (&self.page_outs, s.page_outs),
            (&self.page_ins, s.page_ins),
            (&self.page_in_reads, s.page_in_reads),
            (&self.page_in_failures, s.page_in_failures),
            (&self.page_in_retries, s.page_in_retries),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// The disk alarm was raised (`true`) or cleared.
    pub fn set_disk_alarm(&self, raised: bool) {
        self.disk_alarm.set(i64::from(raised));
    }

    /// The latest disk sample: free bytes and the limit.
    pub fn set_disk(&self, free: u64, limit: u64) {
        self.disk_free.set(saturating_i64(free));
        self.disk_free_limit.set(saturating_i64(limit));
    }

    /// The memory alarm was raised (`true`) or cleared.
    pub fn set_memory_alarm(&self, raised: bool) {
        self.memory_alarm.set(i64::from(raised));
    }

    /// The latest memory sample: used bytes, the limit and the high watermark.
    pub fn set_memory(&self, used: u64, limit: u64, watermark: u64) {
        self.memory_used.set(saturating_i64(used));
        self.memory_limit.set(saturating_i64(limit));
        self.memory_watermark.set(saturating_i64(watermark));
    }

    /// A client connection was blocked by the memory alarm.
    pub fn connection_blocked(&self) {
        self.connection_blocks.inc();
        self.blocked_connections.inc();
    }

    /// A blocked client connection was unblocked (or ended).
    pub fn connection_unblocked(&self) {
        self.blocked_connections.dec();
    }

    /// Free allocator memory was handed back to the operating system.
    pub fn memory_released(&self) {
        self.memory_releases.inc();
    }

    /// What one redrive batch did on dead-letter queue `from`: the target of each moved
    /// message, how many it skipped, the cause of each failure.
    pub fn redrive_counted(
        &self,
        vhost: &str,
        from: &str,
        moved: &[String],
        skipped: u64,
        failed: &[&str],
    ) {
        // In name order, so which queues get a label of their own under the cap is stable.
        let mut counts: std::collections::BTreeMap<&str, u64> = Default::default();
        for target in moved {
            *counts.entry(target.as_str()).or_default() += 1;
        }
        for (target, n) in counts {
            let own = self.queue_label(vhost, target, |s| s.redriven = true);
            let target = if own { target } else { OTHER_QUEUE };
            self.redriven.with_label_values(&[vhost, target]).inc_by(n);
        }
        if skipped > 0 {
            let own = self.queue_label(vhost, from, |s| s.redrive_skipped = true);
            let queue = if own { from } else { OTHER_QUEUE };
            self.redrive_skipped
                .with_label_values(&[vhost, queue])
                .inc_by(skipped);
        }
        for cause in failed {
            let own = self.queue_label(vhost, from, |s| {
                if !s.redrive_failures.contains(*cause) {
                    s.redrive_failures.insert(cause.to_string());
                }
            });
            let queue = if own { from } else { OTHER_QUEUE };
            self.redrive_failed
                .with_label_values(&[vhost, queue, cause])
                .inc();
        }
    }

    /// How many redrive jobs run.
    pub fn set_redrive_jobs(&self, running: usize) {
        self.redrive_jobs.set(running as i64);
    }

    /// A configuration reload finished (`succeeded` or not).
    pub fn config_reloaded(&self, succeeded: bool) {
        let result = if succeeded { "success" } else { "failure" };
        self.config_reloads.with_label_values(&[result]).inc();
    }

    /// A TLS material reload finished (`succeeded` or not).
    pub fn tls_reloaded(&self, succeeded: bool) {
        let result = if succeeded { "success" } else { "failure" };
        self.tls_reloads.with_label_values(&[result]).inc();
    }

    /// Sets what runs before each [`Self::encode`] to read gauges off live state (the
    /// embedded broker's definitions); the first call wins.
    pub fn before_scrape(&self, refresh: impl Fn(&Metrics) + Send + Sync + 'static) {
        let _ = self.before_scrape.set(Box::new(refresh));
    }

    /// The queues, exchanges (declared ones) and bindings of every vhost.
    pub fn set_definitions(&self, queues: usize, exchanges: usize, bindings: usize) {
        self.queues.set(saturating_i64(queues as u64));
        self.exchanges.set(saturating_i64(exchanges as u64));
        self.bindings.set(saturating_i64(bindings as u64));
    }

    /// Every metric in the Prometheus text exposition format (version 0.0.4).
    pub fn encode(&self) -> String {
        if let Some(refresh) = self.before_scrape.get() {
            refresh(self);
        }
        let mut text = String::new();
        if let Err(error) = TextEncoder::new().encode_utf8(&self.registry.gather(), &mut text) {
            tracing::warn!(%error, "cannot encode metrics");
        }
        text
    }

    /// The content type of [`encode`](Self::encode)'s output.
    pub fn content_type(&self) -> String {
        TextEncoder::new().format_type().to_string()
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
