//! Proxy mode: each client connection is forwarded to its own upstream connection (RabbitMQ),
//! and the proxy applies every dead-letter rule itself, with the policies from the TOML file.
//!
//! The handshake (protocol header, SASL, vhost) passes through, so the upstream authenticates
//! the client and the proxy keeps no credentials. The proxy only applies what the upstream
//! cannot see: `proxy.loopback_users` refused from non-loopback peers ([`handshake`]), and
//! `limits.max_connections` ([`crate::admission`]). Frames that need no change are forwarded as
//! the bytes that arrived, in order, with backpressure both ways. The proxy takes over:
//! - `queue.declare`: client arguments are validated and merged with the policy; the upstream
//!   queue gets the TTL and length limits and dead-letters into the proxy's capture exchange
//!   ([`declare`], [`capture`]);
//! - `basic.reject` / `basic.nack` with `requeue=false` on a queue with a dead-letter
//!   exchange: the proxy publishes the rewritten message to the DLX on its own channel with
//!   publisher confirms and only then acks the original ([`intercept`], [`publisher`],
//!   [`outgoing`]): at-least-once;
//! - requeues on queues with a delivery limit: republished with `x-delivery-count`, and
//!   dead-lettered as `delivery_limit` past the limit;
//! - messages that expire or overflow upstream come back through the capture queue and are
//!   dead-lettered as their original queue would have;
//! - BCC keys ([`bcc`]): the upstream strips `BCC` at publish, yet RabbitMQ routes a dead
//!   letter (without a dead-letter routing key) with them. A client publish whose content
//!   header carries `BCC` gets the keys copied into the private header `x-dlx-proxy-bcc`
//!   (array of longstr), which the upstream keeps; the proxy routes dead letters with them
//!   (never listing them in x-death), removes the header from everything it delivers to a
//!   client, and drops a client's own. Consumers connected straight to the upstream do see it.
//!   Other publishes stay untouched bytes.
//!
//! The proxy uses the three highest channel numbers of each upstream connection (the client is
//! offered three fewer in connection.tune): one to probe whether a declared queue exists, one
//! for its publishes (with confirms), one for the capture consumer. Client channel numbers,
//! delivery tags and confirm sequence numbers are untouched; the proxy's settlements of client
//! deliveries go on the client's channel with the upstream's own delivery tags.
//!
//! Failures: a dead-letter publish that is nacked, times out (`proxy.confirm_timeout_secs`)
//! or is lost with the proxy's channel leaves the original to be delivered again (it is
//! requeued with basic.nack; a captured message after a 1 s pause). A missing dead-letter
//! exchange (404 on the proxy's channel, which is reopened) or an unroutable dead letter
//! (basic.return) drops the message and counts it (`no_dlx`, `unroutable`), as RabbitMQ does.
//! The upstream gone → the client gets `connection.close 320` (during the handshake, where
//! RabbitMQ refuses some clients by closing the socket, the client's socket is closed
//! instead), and can reconnect at once: its new connection is dialled to the next reachable
//! node of `upstream.urls` ([`upstream::UpstreamPool`]); an upstream connection.close (403, 530, 504, ...) is passed on as it is. The
//! client gone → the proxy's
//! own publishes are settled, then the upstream connection is closed and the upstream
//! requeues the client's unacked deliveries.
//!
//! Where proxy mode differs from a broker doing it itself (documented limits):
//! - a dead letter whose rewritten properties (x-death grows with every death) no longer fit
//!   one content-header frame of the upstream's `frame_max` cannot be published; keep
//!   `frame_max` at RabbitMQ's default (128 KiB) so this needs thousands of history entries;
//! - a publish whose content header would outgrow `frame_max` with the kept BCC keys keeps
//!   none: dead-lettered, it is routed with its publish key and CC keys only;
//! - a requeue counted against a delivery limit puts the message at the queue's tail (classic
//!   queues requeue at the head), with `redelivered = false`, exchange `""` and the queue name
//!   as routing key; its `CC` header is removed so the copy reaches only that queue;
//! - TTL and length limits (from arguments or policies) are set on the upstream queue when it
//!   is first declared through the proxy; without `upstream.management_url`, later policy
//!   changes to them need the queue to be recreated. Dead-letter target and delivery-limit
//!   policy changes apply at once. With it, the policies are also upstream policies
//!   ([`policy_sync`]) and their changes reach every matching queue, within RabbitMQ's rules:
//!   one policy per queue (the highest priority), queue arguments winning where RabbitMQ says
//!   so, and TTL fixed for a message when it is enqueued (docs/semantics.md);
//! - a queue that already exists upstream is declared passively (no capture exchange added):
//!   its rejections follow the policies; without `upstream.management_url` its own expiries
//!   and overflows stay the upstream's, with it the upstream policy `dlx-proxy.<name>` gives
//!   it the policy's limits and dead-letters its deaths into the capture path;
//! - a redeclare is checked for equivalence (durable, exclusive, auto-delete and the
//!   x-arguments RabbitMQ compares, with the embedded broker's 406 texts) against the
//!   declaration this proxy instance remembers ([`registry`]). A queue this instance has not
//!   seen declared (after a restart, or declared through another instance) takes the first
//!   declaration it sees as that reference: AMQP cannot read a queue's arguments back, and
//!   RabbitMQ compares none the proxy could carry them in;
//! - the cycle rule on a DLX other than the default exchange catches a loop one lap later
//!   than RabbitMQ (see [`outgoing`]);
//! - when a missing DLX closes the proxy's channel, other dead letters still unconfirmed on
//!   it are requeued and delivered again;
//! - a client settling a tag it already rejected is ignored (RabbitMQ closes the channel with
//!   406); acks the proxy sends on a transactional channel join the client's transaction;
//! - the capture queue is consumed by the proxy's connections of a vhost: with no client
//!   connected there, captured messages wait in it;
//! - `compat = "4"`: an x-death history on a message is always continued;
//! - a channel.open numbered above the negotiated channel_max is refused with 530 even while
//!   fewer channels are open (RabbitMQ counts channels only): those numbers are the proxy's;
//! - a method of an unknown class or method gets 540 NOT_IMPLEMENTED (RabbitMQ drops the
//!   connection without a reply);
//! - queue.declare and basic.consume whose arguments nest deeper than
//!   `limits.max_table_depth` are refused by the proxy (501, the client connection closed);
//!   other methods with tables are forwarded unread, and RabbitMQ accepts them;
//! - a delivery keeps its content (to be dead-lettered or republished by the proxy) only when
//!   its queue can dead-letter when it is delivered (`ProxyShared::may_take_over`); a
//!   policy that adds a dead-letter exchange later applies to such a delivery only through
//!   the capture queue (queues declared through the proxy), see docs/semantics.md.
//!
//! Module map: [`session`] (the connection task and its life), [`forward`] (frame dispatch),
//! [`intercept`] (the changed methods), [`inflight`] (kept deliveries), [`bcc`], [`publisher`],
//! [`capture`], [`declare`], [`probe`], [`outgoing`], [`handshake`], [`upstream`] (the upstream
//! nodes, failover between them, TCP/TLS),
//! [`outbox`] (socket writes), [`wire`] (frames and adaptive reads), [`busy_poll`] (polling
//! before sleeping), [`channels`], [`ops`], [`registry`], [`policy_sync`] (the policies as
//! upstream policies, through the management API).

pub mod bcc;
pub mod busy_poll;
pub mod capture;
pub mod channels;
pub mod declare;
mod forward;
pub mod handshake;
pub mod inflight;
mod intercept;
pub mod ops;
pub mod outbox;
pub mod outgoing;
pub mod policy_sync;
pub mod probe;
pub mod publisher;
pub mod registry;
mod session;
pub mod upstream;
pub mod wire;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

use crate::admission::ConnectionSlots;
use crate::config::Config;
use crate::deadletter::DeadLetterOptions;
use crate::metrics::Metrics;
use crate::policy::{EffectiveQueueSettings, PolicySet, effective_settings_with_policy};
use crate::rabbit::args::{QueueArguments, QueueType};
use crate::shutdown::Shutdown;

pub use capture::DEFAULT_CAPTURE_NAME;
use registry::QueueRegistry;
use upstream::UpstreamPool;

/// Most queues whose declared arguments are remembered.
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
    pub(crate) max_inflight_bytes: usize,
    pub(crate) confirm_timeout: Duration,
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
}

impl std::fmt::Debug for ProxyShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyShared")
            .field("upstream", &self.upstream)
            .field("capture_name", &self.capture_name)
            .finish_non_exhaustive()
    }
}

/// A queue's settings as the proxy applies them.
#[derive(Clone, Debug)]
pub(crate) struct QueueView {
    pub settings: EffectiveQueueSettings,
    /// The proxy counts requeues against the delivery limit (classic queues; quorum queues
    /// count natively upstream).
    pub proxy_delivery_limit: bool,
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
        Ok(Arc::new(ProxyShared {
            upstream,
            policies,
            queues: QueueRegistry::new(REGISTRY_CAPACITY.min(limits.max_queues.max(1))),
            dead_letter_options,
            default_delivery_limit: (config.dead_letter.default_delivery_limit > 0)
                .then_some(u64::from(config.dead_letter.default_delivery_limit)),
            max_inflight_bytes: config.proxy.max_inflight_bytes.max(1),
            confirm_timeout: Duration::from_secs(config.proxy.confirm_timeout_secs.max(1)),
            busy_poll: Duration::from_micros(config.proxy.busy_poll_us),
            delegate_to_upstream: config.proxy.delegate_to_upstream,
            capture_name: capture_name.to_string(),
            outbox_bytes: limits.connection_outbox_bytes.max(64 * 1024),
            handshake_timeout: Duration::from_secs(limits.handshake_timeout_secs.max(1)),
            handshake_frame_max: limits.frame_max.max(crate::amqp::codec::FRAME_MIN_SIZE),
            channel_max: limits.channel_max,
            loopback_users: config.proxy.loopback_users.iter().cloned().collect(),
            connections: ConnectionSlots::new(limits.max_connections, metrics.clone()),
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

    /// The `limits.max_connections` slots of proxy mode (the service applies reloads to them).
    pub fn connection_slots(&self) -> &Arc<ConnectionSlots> {
        &self.connections
    }

    /// The name of the capture exchange and queue.
    pub fn capture_name(&self) -> &str {
        &self.capture_name
    }

    /// The settings a queue has now: its declared arguments (`arguments`, else what this proxy
    /// saw declared) merged with the current policy.
    pub(crate) fn queue_view(
        &self,
        vhost: &str,
        queue: &str,
        arguments: Option<&QueueArguments>,
    ) -> QueueView {
        let registered;
        let arguments = match arguments {
            Some(arguments) => arguments,
            None => {
                registered = self.queues.lookup(vhost, queue).unwrap_or_default();
                &registered
            }
        };
        let policies = self.policies.read().unwrap_or_else(|e| e.into_inner());
        let settings = effective_settings_with_policy(
            arguments,
            policies.for_queue(vhost, queue),
            self.default_delivery_limit,
        );
        QueueView {
            proxy_delivery_limit: settings.delivery_limit.is_some()
                && arguments.queue_type != QueueType::Quorum
                && !self.delegate_to_upstream,
            settings,
        }
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

    /// Whether the proxy may take over a negative settlement of this queue's deliveries (it
    /// has a dead-letter exchange to publish to, or a delivery limit the proxy counts), so it
    /// must keep their content. Other deliveries are settled natively: what the upstream
    /// dead-letters of them still reaches the proxy through the capture queue.
    pub(crate) fn may_take_over(&self, vhost: &str, queue: &str) -> bool {
        let view = self.queue_view(vhost, queue, None);
        view.settings.dead_letter_exchange.is_some() || view.proxy_delivery_limit
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
    let slots = shared.connections.clone();
    let within = shared.handshake_timeout;
    slots.spawn(client, peer, within, move |client| {
        session::run(client, peer, shared, shutdown)
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
