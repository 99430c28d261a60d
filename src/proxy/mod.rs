//! Proxy mode: each client connection is forwarded to its own upstream connection (RabbitMQ),
//! and the proxy applies every dead-letter rule itself, with the policies from the TOML file.
//!
//! The handshake (protocol header, SASL, vhost) passes through, so the upstream authenticates
//! the client and the proxy keeps no client credentials. The proxy only applies what the upstream
//! cannot see: `proxy.loopback_users` refused from non-loopback peers ([`handshake`]), and
//! `limits.max_connections` ([`crate::admission`]). Frames that need no change are forwarded as
//! the bytes that arrived, in order, with backpressure both ways. The proxy takes over:
//! - `queue.declare` (of a classic or quorum queue: a stream, or an `x-queue-type` the proxy
//!   does not know, goes upstream as sent and is left to RabbitMQ, see
//!   [`declare::passes_through`]): client arguments are validated; the upstream queue gets every client
//!   argument natively (policy values fill the ones the client did not send, or replace a
//!   higher TTL or length limit) and dead-letters
//!   into the proxy's capture exchange, with the client's dead-letter arguments (and a classic
//!   queue's delivery limit) in its dead-letter routing key ([`declare`], [`capture`]). The
//!   upstream queue is the truth: RabbitMQ judges every declare, and its refusals are given to
//!   the client in the client's terms ([`arbiter`]); the instance only caches what RabbitMQ
//!   confirmed ([`registry`]). Least privilege: a probe on the client's own connection has
//!   RabbitMQ check the client's user's permissions for the declare, creating nothing
//!   ([`permission`]; its 403 goes to the client as it is); the declares that carry the
//!   proxy's arguments (the check's rounds, which create the queue) are made by the vhost's
//!   declare connection as the service user ([`service::judge`]), and the client's declare-ok
//!   comes from a passive declare on its own connection. Exclusive and server-named queues,
//!   which only the client's connection can declare, get the capture exchange when the
//!   client's user may write it (asked once per connection, [`capture_write`]), and otherwise
//!   keep their own dead-letter arguments upstream (RabbitMQ dead-letters their expiries and
//!   overflows natively);
//! - `basic.reject` / `basic.nack` with `requeue=false` on a queue with verified settings and
//!   a dead-letter exchange: the proxy publishes the rewritten message to the DLX on its own
//!   channel with publisher confirms and only then acks the original (`intercept`,
//!   [`publisher`], [`outgoing`]): at-least-once. When that channel gets 403 (the client's
//!   user may not publish to the DLX, which RabbitMQ does not check when it dead-letters), the
//!   publish is handed to the vhost's service connection, and the original is acked on its
//!   confirm (one carrying a `user_id` stays held on the client's connection). Without
//!   verified settings the rejection is passed through and the upstream dead-letters it into
//!   the capture exchange;
//! - the same rejections on a queue with retry tiers (`x-retry-delays`, policy `retry-delays`)
//!   while tiers remain: held in a proxy-owned delay queue on the upstream and published back
//!   into the queue when the delay has passed ([`retry_tiers`], docs/semantics.md "Retry
//!   tiers (proxy mode)");
//! - requeues on classic queues with a delivery limit (verified settings): republished with
//!   `x-delivery-count`, and dead-lettered as `delivery_limit` past the limit; the same for
//!   the deliveries a client leaves unsettled when it closes a channel or its connection, or
//!   dies. Quorum queues count all of these upstream (`x-delivery-count`); the one return that
//!   passes a quorum queue's limit, when it is a client's requeue or a delivery left on a
//!   closed channel, is dead-lettered by the proxy as RabbitMQ would on that return, in one
//!   hop instead of through the capture queue;
//! - messages that expire or overflow upstream come back through the capture queue and are
//!   dead-lettered as their original queue would have, by the vhost's *service connection*
//!   ([`service`]): the proxy's own upstream connection, logged in as its own user
//!   (`upstream.user`), which declares the capture exchange and the capture queue (a durable
//!   quorum queue), consumes it whether or not any client is connected, and reconnects with
//!   backoff after any loss. A client's queue.declare naming the capture exchange is forwarded
//!   only once the capture objects exist (RabbitMQ drops dead letters to a missing exchange
//!   silently); after `proxy.capture_ready_timeout_secs` the client connection is closed with
//!   320;
//! - BCC keys ([`bcc`]): the upstream strips `BCC` at publish, yet RabbitMQ routes a dead
//!   letter (without a dead-letter routing key) with them. A client publish whose content
//!   header carries `BCC` gets the keys copied into the private header `x-dlx-proxy-bcc`
//!   (array of longstr), which the upstream keeps; the proxy routes dead letters with them
//!   (never listing them in x-death), removes the header from everything it delivers to a
//!   client, and drops a client's own. Consumers connected straight to the upstream do see it.
//!   Other publishes stay untouched bytes.
//!
//! The proxy uses the two highest channel numbers of each client's upstream connection (the
//! client is offered two fewer in connection.tune): one for the permission probe (open only
//! while a check runs), one for its publishes (with confirms). Client channel numbers,
//! delivery tags and confirm sequence numbers are untouched; the proxy's settlements of client
//! deliveries go on the client's channel with the upstream's own delivery tags.
//!
//! Failures: a dead-letter publish that is nacked (a DLQ at its length limit with
//! `reject-publish`), times out (`proxy.confirm_timeout_secs`), is lost with the proxy's
//! channel, or is refused to the publishing user (403: the service user, or a client's user
//! for a message with a `user_id`; 406 for a `user_id` the service user may not set) is
//! *held* ([`retry`]): the original
//! (client delivery, or capture delivery on a service connection) stays unacked upstream, is
//! not delivered again, and the same publish is retried after `proxy.retry_initial_ms`
//! doubling to `proxy.retry_max_ms` (jittered) until it is confirmed; then the original is
//! acked. A client connection's dead letters, held or in flight, are charged against
//! `proxy.max_inflight_bytes` (counted in the inflight gauges, held ones in
//! `dead_letters_held`): past the bound its new deliveries keep no content, so it cannot take
//! more over, but it goes on reading (the client holds nothing it could settle); a service
//! connection holds at most its capture prefetch. At-least-once: when the client's channel or connection, or the
//! upstream connection, goes away meanwhile, the held messages are let go unsettled and the
//! upstream requeues their originals (a client delivery to its queue, a captured message to
//! the capture queue). A missing dead-letter exchange (404 on the proxy's channel, which is
//! reopened) or an unroutable dead letter (basic.return) drops the message and counts it
//! (`no_dlx`, `unroutable`), as RabbitMQ does; docs/semantics.md lists every drop cause.
//! The upstream gone → the client gets `connection.close 320` (during the handshake, where
//! RabbitMQ refuses some clients by closing the socket, the client's socket is closed
//! instead), and can reconnect at once: its new connection is dialled to the next reachable
//! node of `upstream.urls` ([`upstream::UpstreamPool`]); an upstream connection.close (403, 530, 504, ...) is passed on as it is. The
//! client gone → the proxy's
//! own publishes are settled (and its unacked deliveries of delivery-limited classic queues
//! counted), then the upstream connection is closed and the upstream requeues the rest.
//!
//! Where proxy mode differs from a broker doing it itself (documented limits):
//! - a dead letter whose rewritten properties (x-death grows with every death) no longer fit
//!   one content-header frame of the upstream's `frame_max` cannot be published; keep
//!   `frame_max` at RabbitMQ's default (128 KiB) so this needs thousands of history entries;
//! - a publish whose content header would outgrow `frame_max` with the kept BCC keys keeps
//!   none: dead-lettered, it is routed with its publish key and CC keys only;
//! - a requeue counted against a delivery limit puts the message at the queue's tail (classic
//!   queues requeue at the head), with `redelivered = false`, exchange `""` and the queue name
//!   as routing key; its `CC` header is removed so the copy reaches only that queue; being a
//!   new publish, its queue TTL and `expiration` start again (RabbitMQ keeps a requeued
//!   message's expiry), and a queue at its `max-length` with `reject-publish` refuses it (held
//!   and retried, where RabbitMQ's requeue ignores the limit; with `reject-publish-dlx` each
//!   refusal is also dead-lettered as `maxlen`); a publisher's own `x-delivery-count` header
//!   on a classic queue is taken as the count; on a transactional channel the republish and
//!   the ack of the original are not part of the client's transaction;
//! - TTL and length limits from policies are set on the upstream queue when it is first
//!   declared through the proxy (for the arguments the client did not give, and where the
//!   policy's value is lower than the client's); without `upstream.management_url`, later
//!   policy changes to them need the queue to be recreated. With it, the policies are also
//!   upstream policies ([`policy_sync`]) and their changes reach every matching queue, within
//!   RabbitMQ's rules: one policy per queue (the highest priority), queue arguments winning
//!   where RabbitMQ says so, and TTL fixed for a message when it is enqueued
//!   (docs/semantics.md). Dead-letter target and delivery-limit policy changes apply at once. A
//!   redeclare is not compared on an argument whose upstream value is a policy's: a client
//!   TTL of 60000 against a queue declared with 30000 under a policy of 100 is accepted;
//! - a stream is RabbitMQ's alone: no TOML policy applies to it (RabbitMQ does not
//!   dead-letter from streams, and a policy's `max-length-bytes` could only be given as a
//!   declare argument, which RabbitMQ would compare on redeclare; use a RabbitMQ policy);
//! - a queue that was not declared through a proxy (another dead-letter exchange, or none) is
//!   upstream-owned: a client's declare goes upstream as sent and RabbitMQ judges it, and its
//!   rejections, expiries and overflows follow RabbitMQ's own rules (the TOML policies reach
//!   it only as upstream policies, with `upstream.management_url`);
//! - a redeclare that names the queue's dead-letter arguments differently gets RabbitMQ's 406
//!   text rebuilt in the client's terms; when RabbitMQ cut its text at 255 bytes (very long
//!   queue, exchange or routing-key names) the proxy cannot read it back and passes it on as
//!   it is, naming the proxy's capture arguments. A classic queue's `x-delivery-limit` is
//!   compared too (RabbitMQ ignores it on classic queues; the proxy enforces it);
//! - a queue this instance has not verified (its clients did not declare it through this
//!   instance since it started) is read back from the upstream at the first basic.consume or
//!   basic.get on it ([`readback`]), by the vhost's declare connection: a passive declare,
//!   then one non-passive declare per argument RabbitMQ names, a round trip each; what those
//!   replies cannot tell (a reply cut at 255 bytes, most often) is read from the management
//!   API's listing of the queue when `upstream.management_url` is set. A queue
//!   that cannot be read (a reply cut at 255 bytes without the management API, exclusive to
//!   another connection, no configure permission for the service user) is tried again at
//!   the next consume or get; meanwhile its rejections are passed through (they still reach
//!   the dead-letter exchange through the capture) and its requeues are not counted against a
//!   classic queue's delivery limit. A queue deleted in the round trip between the passive
//!   and the first non-passive declare would be created again by the latter;
//! - deliveries the upstream requeues itself (a channel it closes, basic.recover) are not
//!   counted against a classic queue's delivery limit;
//! - the cycle rule on a DLX other than the default exchange catches a loop one lap later
//!   than RabbitMQ, and only for messages that reached the queue by the proxy's own
//!   dead-lettering (`x-dlx-proxy-hop`, see [`outgoing`]): a client's republish with its
//!   history is not judged by its source queue (RabbitMQ judges the target);
//! - when a missing DLX closes the proxy's channel, other dead letters still unconfirmed on
//!   it are held and published again (a duplicate if the upstream had routed one before the
//!   close);
//! - only the upstream connection carries the dead letters' confirms, behind the deliveries:
//!   with the client's unsettled deliveries at `proxy.max_inflight_bytes`, the upstream is
//!   still read while a publish awaits its confirm, deliveries arriving meanwhile are kept as
//!   tags only, and at twice the bound reads stop until the client settles (the confirms'
//!   deadlines wait meanwhile, so a confirm left unread is not taken for a refusal);
//! - a dead letter whose first routing key is longer than 255 bytes (a long `CC` entry) cannot
//!   be published and is dropped (`unpublishable`);
//! - a client settling a tag it already rejected is ignored (RabbitMQ closes the channel with
//!   406); acks the proxy sends on a transactional channel join the client's transaction;
//! - a vhost past `proxy.max_service_vhosts` has no service connection: declares there that
//!   would dead-letter into the capture exchange are refused (320);
//! - `compat = "4"`: an x-death history on a message is always continued;
//! - a channel.open numbered above the negotiated channel_max is refused with 530 even while
//!   fewer channels are open (RabbitMQ counts channels only): those numbers are the proxy's;
//! - a method of an unknown class or method gets 540 NOT_IMPLEMENTED (RabbitMQ drops the
//!   connection without a reply);
//! - retry tiers: a message carrying a `user_id` is not retried (it dies at once); a redeclare
//!   with other tiers is refused (`inequivalent arg 'x-retry-delays'`, embedded mode does not
//!   compare them); tiers whose capture tag would exceed 255 bytes are refused at the declare;
//!   none with `proxy.delegate_to_upstream`;
//! - dead-letter exchange and routing key names whose capture tag would exceed 255 bytes
//!   together are refused at the declare (406 `invalid arg 'x-dead-letter-exchange'`), as
//!   the upstream queue could not record them (not with `proxy.delegate_to_upstream`);
//! - queue.declare and basic.consume whose arguments nest deeper than
//!   `limits.max_table_depth` are refused by the proxy (501, the client connection closed);
//!   other methods with tables are forwarded unread, and RabbitMQ accepts them;
//! - a delivery keeps its content (to be dead-lettered or republished by the proxy) only when
//!   its queue has verified settings and can dead-letter when it is delivered
//!   (`ProxyShared::may_take_over`); a policy that adds a dead-letter exchange later applies
//!   to such a delivery only through the capture queue (queues declared through the proxy),
//!   see docs/semantics.md.
//!
//! Module map: `session_task` (the task of one client connection: sockets in, sockets
//! out), `client_session` (that connection and its upstream connection as a state machine
//! with no socket, and its life), `forward` (frame dispatch), `passthrough` (runs of frames
//! that are only forwarded, handled on the read buffer), `intercept` (the changed
//! methods), `pending` (what a connection holds back while it waits), [`inflight`] (kept
//! deliveries), [`retry`] (held dead
//! letters and their backoff), [`retry_tiers`] (rejections held for their retry delay),
//! [`bcc`], [`publisher`], [`capture`], `death` (what becomes of
//! a dead message), [`service`] (the service connections), [`declare`], [`arbiter`] (the
//! declare check), [`readback`], [`probe`] (the check channel), [`permission`] (the probe of
//! the client's permissions), [`capture_write`] (may the client's user write the capture
//! exchange: how its own queues dead-letter), [`outgoing`], [`handshake`],
//! [`upstream`] (the upstream nodes, failover between them, TCP/TLS),
//! [`outbox`] (socket writes), [`wire`] (frames and adaptive reads), [`busy_poll`] (polling
//! before sleeping), [`channels`], [`ops`], [`registry`], [`policy_sync`] (the policies as
//! upstream policies, through the management API).

pub mod ack_batch;
pub mod arbiter;
pub mod bcc;
pub mod busy_poll;
pub mod capture;
pub mod capture_write;
mod channel_map;
pub mod channels;
mod client_session;
mod consumer_timeout;
mod death;
pub mod declare;
mod forward;
pub mod handshake;
pub mod inflight;
mod intercept;
pub mod ops;
pub mod outbox;
pub mod outgoing;
mod passthrough;
mod pending;
pub mod permission;
pub mod policy_sync;
pub mod probe;
pub mod publisher;
pub mod readback;
pub mod redrive;
pub mod registry;
pub mod retry;
pub mod retry_tiers;
pub mod service;
mod session_task;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
pub mod upstream;
mod view_cache;
pub mod wire;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use amq_protocol::protocol::BasicProperties;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

use crate::admission::{Admission, ConnectionSlots};
use crate::config::Config;
use crate::deadletter::DeadLetterOptions;
use crate::deadletter::X_DELIVERY_COUNT;
use crate::metrics::Metrics;
use crate::policy::{EffectiveQueueSettings, PolicySet, effective_settings_with_policy};
use crate::rabbit::args::{QueueArguments, QueueType, amqp_integer};
use crate::shutdown::Shutdown;

pub use capture::DEFAULT_CAPTURE_NAME;
use registry::QueueRegistry;
use service::ServiceRegistry;
use upstream::UpstreamPool;

/// Most queues whose verified settings are cached.
const REGISTRY_CAPACITY: usize = 100_000;

/// What every connection of the proxy shares.
pub struct ProxyShared {
    /// The upstream nodes: every upstream connection is dialled through it.
    pub(crate) upstream: Arc<UpstreamPool>,
    pub(crate) policies: Arc<RwLock<PolicySet>>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) queues: QueueRegistry,
    pub(crate) dead_letter_options: DeadLetterOptions,
    pub(crate) default_delivery_limit: Option<u64>,
    /// `limits.consumer_timeout` (ms; None = off): the proxy enforces consumer timeouts itself.
    pub(crate) consumer_timeout: Option<u64>,
    /// `dead_letter.ttl_on_dead_letters = false`: expired dead letters the upstream captured
    /// go back into their queue ([`death::kept_in_queue`]).
    pub(crate) keep_dead_letters: bool,
    pub(crate) max_inflight_bytes: usize,
    /// `limits.max_consumers_per_channel`: a client channel's consumers, started and asked
    /// for, the proxy keeps track of.
    pub(crate) max_consumers_per_channel: usize,
    pub(crate) confirm_timeout: Duration,
    /// `proxy.capture_prefetch`.
    pub(crate) capture_prefetch: u16,

    /// Delays between publishes of a held dead letter (`proxy.retry_initial_ms`,
    /// `proxy.retry_max_ms`).
    pub(crate) retry_backoff: retry::Backoff,
    pub(crate) delegate_to_upstream: bool,
    pub(crate) capture_name: String,
    pub(crate) outbox_bytes: usize,
    pub(crate) handshake_timeout: Duration,
    /// How long a connection task polls after its last traffic before it sleeps
    /// (`proxy.busy_poll_us`; zero: never).
    pub(crate) busy_poll: Duration,
    /// Frame size accepted before tune (and the fallback when both peers say "no limit").
    pub(crate) handshake_frame_max: u32,
    /// Highest channel number offered to clients (`limits.channel_max`, lowered further when
    /// the upstream offers fewer).
    pub(crate) channel_max: u16,
    /// Users refused from non-loopback peers (`proxy.loopback_users`).
    pub(crate) loopback_users: HashSet<String>,
    /// `limits.max_connections`: each connection task holds a slot.
    pub(crate) connections: Arc<ConnectionSlots>,
    /// `limits.max_table_depth`: deepest field tables in the client methods the proxy decodes.
    pub(crate) max_table_depth: usize,
    /// The service connection of each vhost (capture objects and consumer).
    pub(crate) services: ServiceRegistry,
    /// `proxy.capture_ready_timeout_secs`: how long a declare naming the capture exchange
    /// waits for the vhost's capture objects.
    pub(crate) capture_ready_timeout: Duration,
    /// The upstream's management API (`upstream.management_url`, as the service identity):
    /// where a read-back that the reply texts cannot finish asks for the queue's arguments.
    pub(crate) management: Option<policy_sync::management::ManagementClient>,
}

impl std::fmt::Debug for ProxyShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyShared")
            .field("upstream", &self.upstream)
            .field("capture_name", &self.capture_name)
            .finish_non_exhaustive()
    }
}

/// Who counts a queue's returns against the delivery limit the proxy applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReturnCounter {
    /// No delivery limit the proxy acts on (none set, or the upstream applies it).
    Nobody,
    /// The proxy counts every requeue and carries the count with the message (classic
    /// queues).
    Proxy,
    /// A quorum queue: RabbitMQ counts every return (its `x-delivery-count`), and the proxy
    /// dead-letters the client's requeue that passes the limit itself, in one hop, instead of
    /// letting RabbitMQ dead-letter it into the capture queue (the same decision, as RabbitMQ
    /// would make it on that return).
    QuorumQueue,
}

/// A queue's settings as the proxy applies them.
#[derive(Clone, Debug)]
pub(crate) struct QueueView {
    pub settings: EffectiveQueueSettings,
    pub returns_counted_by: ReturnCounter,
}

impl QueueView {
    /// Whether the proxy settles a client's requeue of `delivery` itself: every requeue of a
    /// classic queue with a delivery limit (the proxy counts them), and the requeue of a
    /// quorum queue's delivery that RabbitMQ would dead-letter on its return.
    pub(crate) fn takes_over_requeue(&self, delivery: &inflight::KeptDelivery) -> bool {
        match self.returns_counted_by {
            ReturnCounter::Nobody => return false,
            ReturnCounter::Proxy => return true,
            ReturnCounter::QuorumQueue => {}
        }
        if !delivery.redelivered {
            // Never returned before (whatever its headers say): no need to read them.
            return !self.within_delivery_limit(1);
        }
        // Only the count is needed: read that one header, not the whole properties (a message
        // whose headers do not scan would not decode either, and is left to RabbitMQ).
        let Ok(count) =
            crate::amqp::headers::header_value(delivery.raw_properties(), X_DELIVERY_COUNT)
        else {
            return false;
        };
        let returns = count.as_ref().and_then(amqp_integer).unwrap_or(0).max(0);
        !self.within_delivery_limit(returns.saturating_add(1))
    }

    /// How many times a delivery was returned to its queue before: the proxy's own count on a
    /// classic queue, and a quorum queue's `x-delivery-count`, which RabbitMQ sets on every
    /// redelivery (a delivery that is not a redelivery was returned 0 times, whatever a
    /// publisher put in that header).
    pub(crate) fn returns_before(&self, props: &BasicProperties, redelivered: bool) -> i64 {
        if self.returns_counted_by == ReturnCounter::QuorumQueue && !redelivered {
            return 0;
        }
        outgoing::delivery_count(props)
    }

    /// Whether a message returned `count` times stays in its queue.
    pub(crate) fn within_delivery_limit(&self, count: i64) -> bool {
        let limit = self
            .settings
            .delivery_limit
            .map_or(i64::MAX, |l| i64::try_from(l).unwrap_or(i64::MAX));
        count <= limit
    }
}

impl ProxyShared {
    /// Shared state for proxy mode, from the validated configuration.
    pub fn new(
        config: &Config,
        policies: Arc<RwLock<PolicySet>>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Arc<Self>> {
        Self::with_capture_name(config, policies, metrics, DEFAULT_CAPTURE_NAME)
    }

    /// Like [`ProxyShared::new`] with another name for the capture exchange and queue (several
    /// proxy deployments with different policies on one upstream must not share one).
    pub fn with_capture_name(
        config: &Config,
        policies: Arc<RwLock<PolicySet>>,
        metrics: Arc<Metrics>,
        capture_name: &str,
    ) -> anyhow::Result<Arc<Self>> {
        if capture_name.is_empty() || capture_name.len() > 255 {
            anyhow::bail!("capture name must be 1 to 255 bytes");
        }
        let upstream = Arc::new(UpstreamPool::from_config(
            &config.upstream,
            metrics.clone(),
        )?);
        let dead_letter_options = DeadLetterOptions::from_config(&config.dead_letter)
            .map_err(|e| anyhow::anyhow!("dead_letter.compat: {e}"))?;
        let limits = &config.limits;
        let management = if config.upstream.management_url.is_empty() {
            None
        } else {
            let endpoint =
                policy_sync::management::ManagementEndpoint::parse(&config.upstream.management_url)
                    .map_err(|e| anyhow::anyhow!("upstream.management_url: {e}"))?;
            let (user, password) = crate::config::service_credentials(config);
            Some(policy_sync::management::ManagementClient::new(
                endpoint,
                &user,
                &password,
                Duration::from_secs(config.upstream.connect_timeout_secs.max(1) * 2),
            ))
        };
        Ok(Arc::new(ProxyShared {
            management,
            upstream,
            policies,
            queues: QueueRegistry::new(
                REGISTRY_CAPACITY.min(limits.max_queues.max(1)),
                Duration::from_secs(config.proxy.verified_queue_max_age_secs),
                metrics.clone(),
            ),
            dead_letter_options,
            default_delivery_limit: (config.dead_letter.default_delivery_limit > 0)
                .then_some(u64::from(config.dead_letter.default_delivery_limit)),
            consumer_timeout: (config.limits.consumer_timeout > 0)
                .then_some(config.limits.consumer_timeout),
            keep_dead_letters: !config.dead_letter.ttl_on_dead_letters,
            max_inflight_bytes: config.proxy.max_inflight_bytes.max(1),
            max_consumers_per_channel: config.limits.max_consumers_per_channel,
            confirm_timeout: Duration::from_secs(config.proxy.confirm_timeout_secs.max(1)),
            capture_prefetch: config.proxy.capture_prefetch.max(1),
            retry_backoff: retry::Backoff::new(
                Duration::from_millis(config.proxy.retry_initial_ms),
                Duration::from_millis(config.proxy.retry_max_ms),
            ),
            busy_poll: Duration::from_micros(config.proxy.busy_poll_us),
            delegate_to_upstream: config.proxy.delegate_to_upstream,
            capture_name: capture_name.to_string(),
            outbox_bytes: limits.connection_outbox_bytes.max(64 * 1024),
            handshake_timeout: Duration::from_secs(limits.handshake_timeout_secs.max(1)),
            handshake_frame_max: limits.frame_max.max(crate::amqp::codec::FRAME_MIN_SIZE),
            channel_max: limits.channel_max,
            loopback_users: config.proxy.loopback_users.iter().cloned().collect(),
            connections: ConnectionSlots::new(limits.max_connections, metrics.clone()),
            services: ServiceRegistry::new(
                config.proxy.vhosts.clone(),
                config.proxy.max_service_vhosts,
                metrics.clone(),
            ),
            capture_ready_timeout: Duration::from_secs(
                config.proxy.capture_ready_timeout_secs.max(1),
            ),
            metrics,
            max_table_depth: limits.max_table_depth,
        }))
    }

    /// Whether some upstream node accepts a connection now (dials them in order; see
    /// [`UpstreamPool::check_now`]).
    pub async fn upstream_reachable(&self) -> bool {
        self.upstream.check_now().await
    }

    /// The upstream nodes (the reachability check and `/readyz` follow it).
    pub fn upstream(&self) -> &Arc<UpstreamPool> {
        &self.upstream
    }

    /// For /readyz: whether every vhost of `proxy.vhosts` has its capture consumer running and
    /// its declare connection open (always true when dead-lettering is left to the upstream).
    pub fn capture_consuming(&self) -> bool {
        self.delegate_to_upstream || self.services.configured_consuming()
    }

    /// The readiness condition of the service connections: true while every vhost of
    /// `proxy.vhosts` consumes its capture queue and has its declare connection open (always
    /// when dead-lettering is left to the upstream).
    pub fn capture_readiness(&self) -> Arc<std::sync::atomic::AtomicBool> {
        if self.delegate_to_upstream {
            return Arc::new(std::sync::atomic::AtomicBool::new(true));
        }
        self.services.consuming_flag()
    }

    /// The status of a vhost's service connection (`None`: it has none).
    pub fn service_status(&self, vhost: &str) -> Option<service::Status> {
        self.services.status(vhost)
    }

    /// The `limits.max_connections` slots of proxy mode (the service applies reloads to them).
    pub fn connection_slots(&self) -> &Arc<ConnectionSlots> {
        &self.connections
    }

    /// The name of the capture exchange and queue.
    pub fn capture_name(&self) -> &str {
        &self.capture_name
    }

    /// The settings a queue with these (client) arguments has now, merged with the current
    /// policy.
    pub(crate) fn queue_view(
        &self,
        vhost: &str,
        queue: &str,
        arguments: &QueueArguments,
    ) -> QueueView {
        let policies = self.policies.read().unwrap_or_else(|e| e.into_inner());
        let mut settings = effective_settings_with_policy(
            arguments,
            policies.for_queue(vhost, queue),
            self.default_delivery_limit,
        );
        if self.delegate_to_upstream {
            // No service connection holds retried messages: no tiers (docs/semantics.md).
            settings.retry_delays = None;
        }
        let limited = settings.delivery_limit.is_some() && !self.delegate_to_upstream;
        let returns_counted_by = match (limited, arguments.queue_type) {
            (false, _) => ReturnCounter::Nobody,
            (true, QueueType::Quorum) => ReturnCounter::QuorumQueue,
            (true, _) => ReturnCounter::Proxy,
        };
        QueueView {
            returns_counted_by,
            settings,
        }
    }

    /// The settings of a queue whose arguments this instance verified with the upstream;
    /// `None` for a queue it has not verified or whose own dead-letter exchange RabbitMQ
    /// applies (upstream-owned): the upstream decides its dead letters.
    pub(crate) fn verified_view(&self, vhost: &str, queue: &str) -> Option<QueueView> {
        let arguments = self.queues.decided_by_proxy(vhost, queue)?;
        Some(self.queue_view(vhost, queue, &arguments))
    }
}

/// What a cached per-queue decision was taken from: the policy set's revision and the
/// declaration registry's generation. A decision cached with other values is taken again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SettingsRevision {
    policies: u64,
    registry: u64,
}

impl ProxyShared {
    /// The current [`SettingsRevision`]; read it before taking the decision it guards.
    pub(crate) fn settings_revision(&self) -> SettingsRevision {
        let policies = self.policies.read().unwrap_or_else(|e| e.into_inner());
        SettingsRevision {
            policies: policies.revision(),
            registry: self.queues.generation(),
        }
    }

    /// The consumer timeout of deliveries from `queue` (ms): the lower of
    /// `limits.consumer_timeout` and the queue's own (argument or policy). A queue this
    /// instance has not verified gets its policy's and the configured one.
    pub(crate) fn consumer_timeout(&self, vhost: &str, queue: &str) -> Option<u64> {
        let queue_timeout = match self.verified_view(vhost, queue) {
            Some(view) => view.settings.consumer_timeout,
            None => {
                let policies = self.policies.read().unwrap_or_else(|e| e.into_inner());
                policies
                    .for_queue(vhost, queue)
                    .and_then(|p| p.definition.consumer_timeout)
            }
        };
        crate::broker::ack_timeout::delivery_timeout(self.consumer_timeout, queue_timeout)
    }

    /// Whether the proxy may take over a negative settlement of this queue's deliveries (it
    /// has a dead-letter exchange to publish to, or a delivery limit the proxy counts), so it
    /// must keep their content. Other deliveries are settled natively: what the upstream
    /// dead-letters of them still reaches the proxy through the capture queue.
    pub(crate) fn may_take_over(&self, vhost: &str, queue: &str) -> bool {
        self.verified_view(vhost, queue).is_some_and(|view| {
            view.settings.dead_letter_exchange.is_some()
                || view.settings.retry_delays.is_some()
                || view.returns_counted_by == ReturnCounter::Proxy
        })
    }
}

/// Serves one client connection (plain TCP or TLS already accepted) in its own task, which
/// holds one of the `limits.max_connections` slots; over the limit the client is refused with
/// 530 ([`crate::admission`]).
pub fn spawn_connection<S>(
    client: S,
    peer: SocketAddr,
    shared: Arc<ProxyShared>,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let admission = shared.connections.reserve(peer);
    spawn_admitted(admission, client, peer, shared, shutdown);
}

/// [`spawn_connection`] for a connection whose slot was reserved when it arrived (the amqps
/// listener reserves before its TLS handshake).
pub fn spawn_admitted<S>(
    admission: Admission,
    client: S,
    peer: SocketAddr,
    shared: Arc<ProxyShared>,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let within = shared.handshake_timeout;
    let tasks = shutdown.clone();
    admission.spawn(client, within, &tasks, move |client| {
        session_task::run(client, peer, shared, shutdown)
    });
}

/// Accepts client connections until shutdown; one task per connection.
pub async fn serve(listener: TcpListener, shared: Arc<ProxyShared>, shutdown: Shutdown) {
    let connections = shutdown.clone();
    crate::listener::accept_tcp(listener, shutdown, move |stream, peer| {
        spawn_connection(stream, peer, shared.clone(), connections.clone())
    })
    .await
}
