//! Wires a validated [`Config`] into running tasks: the embedded broker (with its memory
//! monitor) or the proxy, the admin HTTP server, the broker's timer task, configuration
//! reload, TLS certificate rotation, and the shutdown signal threaded through all of them.
//!
//! [`start`] binds everything and returns a [`RunningService`] handle (used by `main` and by
//! the integration tests); it also starts watching the TLS files, so rotated certificates
//! apply to new connections. [`run`] is `start` plus signal handling: SIGHUP or a change of
//! the config file reloads (SIGHUP reloads the TLS files too), SIGTERM/SIGINT shut down
//! gracefully.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::admin::{AdminState, AdminToken, PolicyControl, Readiness};
use crate::admission::ConnectionSlots;
use crate::broker::auth::UserDb;
use crate::broker::{Broker, BrokerOptions};
use crate::config::{Config, Mode, PolicyConfig};
use crate::deadletter::DeadLetterOptions;
use crate::memory::monitor::{Monitor, MonitorSettings};
use crate::memory::{MemorySources, Watermark};
use crate::metrics::Metrics;
use crate::policy::PolicySet;
use crate::server::{self, ServerContext};
use crate::shutdown::ShutdownTrigger;
use crate::tls::TlsRotation;

/// Takes the runtime policies storage kept into `state`, one by one: a policy the TOML
/// policies in force no longer accept alongside (say a name clash turned invalid) is logged
/// and dropped, from `stored` too, so the next snapshot no longer has it.
fn restore_runtime_policies(state: &mut PolicyHubState, stored: &mut Vec<PolicyConfig>) {
    stored.retain(|policy| {
        let key = (policy.vhost.clone(), policy.name.clone());
        let previous = state.runtime.insert(key.clone(), policy.clone());
        match PolicySet::from_configs(&PolicyHub::merged(state)) {
            Ok(_) => true,
            Err(e) => {
                tracing::error!(vhost = %policy.vhost, policy = %policy.name, error = %e, "stored runtime policy dropped: invalid with the policies in force");
                match previous {
                    Some(p) => state.runtime.insert(key, p),
                    None => state.runtime.remove(&key),
                };
                false
            }
        }
    });
    if !stored.is_empty() {
        tracing::info!(
            policies = stored.len(),
            "runtime policies restored from storage"
        );
    }
}

/// Where a new policy set goes.
#[derive(Clone)]
enum PolicySink {
    Broker(Arc<Broker>),
    Shared(Arc<RwLock<PolicySet>>),
}

/// TOML policies plus runtime policies from the admin API; rebuilds and applies the
/// [`PolicySet`] on every change.
pub struct PolicyHub {
    inner: Mutex<PolicyHubState>,
    sink: PolicySink,
    /// Notified after every applied change (the upstream policy sync waits on it).
    changed: Arc<tokio::sync::Notify>,
}

struct PolicyHubState {
    from_config: Vec<PolicyConfig>,
    runtime: BTreeMap<(String, String), PolicyConfig>,
}

impl PolicyHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, PolicyHubState> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// All policies in force: the config's, with runtime ones replacing same-named ones.
    fn merged(state: &PolicyHubState) -> Vec<PolicyConfig> {
        let mut out: Vec<PolicyConfig> = state
            .from_config
            .iter()
            .filter(|p| {
                !state
                    .runtime
                    .contains_key(&(p.vhost.clone(), p.name.clone()))
            })
            .cloned()
            .collect();
        out.extend(state.runtime.values().cloned());
        out
    }

    fn apply(&self, state: &PolicyHubState) -> Result<(), String> {
        let set = PolicySet::from_configs(&Self::merged(state)).map_err(|e| e.to_string())?;
        match &self.sink {
            PolicySink::Broker(b) => {
                b.apply_policies(set);
                // Kept on disk when storage is on.
                b.set_runtime_policies(state.runtime.values().cloned().collect());
            }
            PolicySink::Shared(shared) => match shared.write() {
                Ok(mut g) => *g = set,
                Err(p) => *p.into_inner() = set,
            },
        }
        self.changed.notify_one();
        Ok(())
    }

    /// Replaces the policies that come from the configuration file.
    pub fn set_config_policies(&self, policies: Vec<PolicyConfig>) -> Result<(), String> {
        let mut state = self.lock();
        let previous = std::mem::replace(&mut state.from_config, policies);
        if let Err(e) = self.apply(&state) {
            state.from_config = previous;
            return Err(e);
        }
        Ok(())
    }
}

impl PolicyControl for PolicyHub {
    fn set_policy(&self, cfg: PolicyConfig) -> Result<(), String> {
        let mut state = self.lock();
        let key = (cfg.vhost.clone(), cfg.name.clone());
        let previous = state.runtime.insert(key.clone(), cfg);
        if let Err(e) = self.apply(&state) {
            match previous {
                Some(p) => state.runtime.insert(key, p),
                None => state.runtime.remove(&key),
            };
            return Err(e);
        }
        Ok(())
    }

    fn clear_policy(&self, vhost: &str, name: &str) -> bool {
        let mut state = self.lock();
        let removed = state
            .runtime
            .remove(&(vhost.to_string(), name.to_string()))
            .is_some();
        if removed && let Err(e) = self.apply(&state) {
            tracing::error!(error = %e, "policy set invalid after clearing a policy");
        }
        removed
    }

    fn list_policies(&self) -> Vec<PolicyConfig> {
        Self::merged(&self.lock())
    }
}

/// Where the admin API's queue inspection reads: the broker, else the upstream management
/// API when `upstream.management_url` is set.
fn inspector(
    config: &Config,
    broker: Option<Arc<Broker>>,
) -> anyhow::Result<crate::dlq_inspect::Inspector> {
    use crate::dlq_inspect::Inspector;
    use crate::proxy::policy_sync::management::{ManagementClient, ManagementEndpoint};
    if let Some(broker) = broker {
        return Ok(Inspector::Broker(broker));
    }
    let upstream = &config.upstream;
    if upstream.management_url.is_empty() {
        return Ok(Inspector::Unavailable);
    }
    let endpoint = ManagementEndpoint::parse(&upstream.management_url)
        .map_err(|e| anyhow::anyhow!("upstream.management_url: {e}"))?;
    let (user, password) = crate::config::service_credentials(config);
    let timeout = Duration::from_secs(upstream.connect_timeout_secs.max(1) * 5);
    Ok(Inspector::Management(ManagementClient::new(
        endpoint, &user, &password, timeout,
    )))
}

/// A started service.
pub struct RunningService {
    pub amqp_addr: Option<SocketAddr>,
    pub amqps_addr: Option<SocketAddr>,
    pub admin_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    pub broker: Option<Arc<Broker>>,
    pub policies: Arc<PolicyHub>,
    pub readiness: Readiness,
    /// The admin API's bearer token, re-read on reload.
    admin_token: AdminToken,
    server: Option<Arc<ServerContext>>,
    /// `limits.max_connections` of either mode (a reload changes the limit).
    connection_slots: Arc<ConnectionSlots>,
    drain: Duration,
    /// The settings a reload cannot change, as the service started with them.
    fixed_settings: BTreeMap<&'static str, serde_json::Value>,
    /// Fires first on shutdown: the listeners stop accepting (and the tasks that only
    /// matter while accepting stop). A child of `connections_trigger`.
    accept_trigger: ShutdownTrigger,
    /// Fires after the drain: connections are closed with 320, every other task stops. Its
    /// tracker holds every task of the service, connections included, but the service
    /// connections.
    connections_trigger: ShutdownTrigger,
    /// Fires once the client connections are closed (or their time is up): the proxy's
    /// service and declare connections stop last, because a closing client connection still
    /// hands them work (a consumer's dead letters and delivery-limit returns). Its own tracker.
    services_trigger: ShutdownTrigger,
    /// The accept loops: they end (dropping their listeners) when `accept_trigger` fires.
    listeners: Vec<JoinHandle<()>>,
    /// The reloadable TLS materials (listener, upstream CA) and the watchers of their files.
    tls: TlsRotation,
    _tls_watchers: Vec<notify::RecommendedWatcher>,
}

impl RunningService {
    /// Deliveries sent to clients and not settled yet: the proxy's (the inflight gauge) plus
    /// the embedded broker's unacknowledged deliveries.
    fn unsettled_deliveries(&self) -> usize {
        let proxied = usize::try_from(self.metrics.inflight_deliveries()).unwrap_or(0);
        let embedded = self.broker.as_ref().map_or(0, |broker| {
            broker
                .lock()
                .channels
                .values()
                .map(|channel| channel.unacked.len())
                .sum()
        });
        proxied + embedded
    }

    /// Graceful shutdown: stop accepting, give in-flight work the drain time
    /// (`shutdown.drain_secs`: clients can still settle their unacknowledged deliveries), then
    /// close client connections with 320 CONNECTION_FORCED, stop every other task and wait
    /// for all of them (connections of both modes, timers, the admin server: the tracker of
    /// `connections_trigger`) for at most the drain time again; then stop the proxy's service
    /// connections, which settle what the closing client connections handed them, in what is
    /// left of that time (at least a second).
    pub async fn shutdown(mut self) {
        self.readiness.set_ready(false);
        self.accept_trigger.trigger();
        let deadline = tokio::time::Instant::now() + self.drain;
        // The listening sockets are closed before any client is told to go, so a client that
        // reconnects at once is refused here and goes to another instance.
        let listeners = futures_util::future::join_all(std::mem::take(&mut self.listeners));
        if tokio::time::timeout_at(deadline, listeners).await.is_err() {
            tracing::warn!("drain time over before every listener stopped");
        }
        let unsettled = self.unsettled_deliveries();
        if unsettled > 0 {
            tracing::info!(
                unsettled,
                drain_secs = self.drain.as_secs(),
                "draining: waiting for unsettled deliveries"
            );
        }
        // Woken when the count reaches zero, not by a timer: the notification is registered
        // before the count is read, so one that lands in between is not missed.
        let metrics = Arc::clone(&self.metrics);
        loop {
            let settled = metrics.settled();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if self.unsettled_deliveries() == 0
                || tokio::time::timeout_at(deadline, settled).await.is_err()
            {
                break;
            }
        }
        let unsettled = self.unsettled_deliveries();
        if unsettled > 0 {
            tracing::warn!(unsettled, "drain time over; closing connections");
        }
        self.connections_trigger.trigger();
        let tasks = self.connections_trigger.tracker().clone();
        tasks.close();
        // At least a second, so that clients get their connection.close even with no drain.
        let closing = tokio::time::Instant::now() + self.drain.max(Duration::from_secs(1));
        if tokio::time::timeout_at(closing, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                tasks = tasks.len(),
                connections = self.connection_slots.open(),
                "tasks still running after the drain time; exiting without them"
            );
        }
        // Then the service connections settle what the closed client connections handed them
        // (in what is left of that time, at least a second).
        self.services_trigger.trigger();
        let services = self.services_trigger.tracker().clone();
        services.close();
        let left = closing
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_secs(1));
        if tokio::time::timeout(left, services.wait()).await.is_err() {
            tracing::warn!(
                tasks = services.len(),
                "service connections still settling after the drain time; exiting without them"
            );
        }
        // Everything the broker wrote (lazy removals included) made stable before exit.
        if let Some(broker) = &self.broker
            && broker.storage().is_some()
        {
            let broker = broker.clone();
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(storage) = broker.storage() {
                    storage.close();
                }
            })
            .await;
        }
    }

    /// Re-reads every TLS file (listener certificate, key and client CA; upstream CA), as
    /// SIGHUP does: new connections use what loaded, a file that does not load is logged and
    /// counted in `tls_reloads_total{result="failure"}` and the previous material stays.
    pub fn reload_tls(&self) {
        self.tls.reload_all();
    }

    /// Applies a new configuration without dropping connections: policies, users (each
    /// `password_file` is read again), limits (except `limits.consumer_timeout` and
    /// `limits.max_consumers_per_channel`),
    /// `storage.disk_free_limit`, `storage.paging_budget` and the admin token (`admin.token_file` is read again). Every
    /// other setting (listeners,
    /// mode, TLS file names, vhosts, ...) needs a restart; a change to one is logged as a
    /// warning and the running value stays. (The content of the TLS files is reloaded
    /// separately: [`RunningService::reload_tls`].)
    pub fn reload(&self, config: &Config) -> anyhow::Result<()> {
        config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        let admin_token = config
            .admin
            .resolve_token()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let changed = changed_fixed_settings(&self.fixed_settings, config);
        if !changed.is_empty() {
            tracing::warn!(
                settings = changed.join(", "),
                "changed settings need a restart; their running values stay in force"
            );
        }
        self.policies
            .set_config_policies(config.policies.clone())
            .map_err(|e| anyhow::anyhow!(e))?;
        if let Some(ctx) = &self.server {
            let users = UserDb::from_config(&config.users).map_err(|e| anyhow::anyhow!(e))?;
            match ctx.users.write() {
                Ok(mut u) => *u = Arc::new(users),
                Err(p) => *p.into_inner() = Arc::new(users),
            }
            match ctx.limits.write() {
                Ok(mut l) => *l = config.limits.clone(),
                Err(p) => *p.into_inner() = config.limits.clone(),
            }
            ctx.disk_free_limit
                .store(config.storage.disk_free_limit_bytes(), Ordering::Relaxed);
        }
        if let Some(broker) = &self.broker {
            broker.set_definition_limits(
                config.limits.max_queues,
                config.limits.max_exchanges,
                config.limits.max_bindings,
            );
        }
        if let Some(paging) = self.broker.as_ref().and_then(|b| b.paging()) {
            paging.set_budget(config.storage.paging_budget_bytes());
        }
        self.connection_slots.set_max(config.limits.max_connections);
        self.admin_token.set(admin_token);
        Ok(())
    }
}

/// The top-level settings that only take effect at start, by name, as JSON values (so that
/// they can be compared without every section implementing `PartialEq`).
fn fixed_settings(config: &Config) -> BTreeMap<&'static str, serde_json::Value> {
    fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
        serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
    }
    let mut fixed = BTreeMap::from([
        ("mode", json(&config.mode)),
        ("listen", json(&config.listen)),
        ("upstream", json(&config.upstream)),
        ("dead_letter", json(&config.dead_letter)),
        // Read into the broker's and the proxy's options at start (the other limits reload).
        (
            "limits.consumer_timeout",
            json(&config.limits.consumer_timeout),
        ),
        (
            "limits.max_consumers_per_channel",
            json(&config.limits.max_consumers_per_channel),
        ),
        ("proxy", json(&config.proxy)),
        ("tls", json(&config.tls)),
        ("log", json(&config.log)),
        ("metrics", json(&config.metrics)),
        ("shutdown", json(&config.shutdown)),
        ("runtime", json(&config.runtime)),
        ("vhosts", json(&config.vhosts)),
        // The storage thread and its files are set up at start (disk_free_limit reloads).
        ("storage.dir", json(&config.storage.dir)),
        ("storage.fsync", json(&config.storage.fsync)),
        ("storage.segment_size", json(&config.storage.segment_size)),
    ]);
    if config.mode == Mode::Proxy {
        // The proxy reads its limits once, at start; only max_connections reloads.
        let mut limits = config.limits.clone();
        limits.max_connections = 0;
        fixed.insert("limits (proxy mode, but max_connections)", json(&limits));
    }
    fixed
}

/// Names of the start-only settings that differ between `running` and `config`.
fn changed_fixed_settings(
    running: &BTreeMap<&'static str, serde_json::Value>,
    config: &Config,
) -> Vec<&'static str> {
    fixed_settings(config)
        .into_iter()
        .filter(|(name, value)| running.get(name) != Some(value))
        .map(|(name, _)| name)
        .collect()
}

/// Dead-letter options from the configuration.
pub fn dead_letter_options(config: &Config) -> anyhow::Result<DeadLetterOptions> {
    DeadLetterOptions::from_config(&config.dead_letter).map_err(|e| anyhow::anyhow!("{e}"))
}

async fn bind(addr: &str, key: &str) -> anyhow::Result<Option<TcpListener>> {
    if addr.is_empty() {
        return Ok(None);
    }
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("{key}: cannot bind {addr}"))?;
    Ok(Some(l))
}

/// The memory monitor's settings from the limits in force.
fn memory_settings(limits: &crate::config::LimitsConfig) -> Option<MonitorSettings> {
    Some(MonitorSettings {
        watermark: Watermark::parse(&limits.memory_high_watermark).ok()?,
        interval: Duration::from_millis(limits.memory_check_interval_ms),
    })
}

/// Starts the memory monitor of the embedded broker; it re-reads the watermark and interval
/// from the limits in force before each sample, so a reload changes them.
fn spawn_memory_monitor(
    ctx: &Arc<ServerContext>,
    metrics: &Arc<Metrics>,
    stop: crate::shutdown::Shutdown,
) -> anyhow::Result<()> {
    let key = "limits.memory_high_watermark";
    let initial = memory_settings(&ctx.limits())
        .ok_or_else(|| anyhow::anyhow!("key `{key}`: invalid (validate the config first)"))?;
    let monitor = Monitor::new(
        MemorySources::default(),
        initial.watermark,
        metrics.clone(),
        ctx.memory_alarm.clone(),
    )
    .map_err(|message| anyhow::anyhow!("key `{key}`: {message}"))?;
    let ctx = ctx.clone();
    let settings = move || memory_settings(&ctx.limits()).unwrap_or(initial);
    stop.clone().spawn(monitor.run(settings, stop));
    Ok(())
}

/// Binds the listeners and starts every task.
pub async fn start(config: Config) -> anyhow::Result<RunningService> {
    let connections_trigger = ShutdownTrigger::new();
    let accept_trigger = connections_trigger.child();
    let services_trigger = ShutdownTrigger::new();
    // Every task of the service joins the tracker of the triggers (mini-redis style), so
    // that the shutdown waits for them.
    let tasks = connections_trigger.subscribe();
    let accepting = accept_trigger.subscribe();
    let metrics = Metrics::new(config.metrics.max_queue_labels);
    let admin_token = AdminToken::new(
        config
            .admin
            .resolve_token()
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let initial = PolicySet::from_configs(&config.policies).map_err(|e| anyhow::anyhow!("{e}"))?;
    let readiness = Readiness::new();
    let policy_changes = Arc::new(tokio::sync::Notify::new());
    let mut listeners = Vec::new();
    let amqp = bind(&config.listen.amqp, "listen.amqp").await?;
    let amqps = bind(&config.listen.amqps, "listen.amqps").await?;
    let admin = bind(&config.listen.admin, "listen.admin").await?;
    let amqp_addr = amqp.as_ref().and_then(|l| l.local_addr().ok());
    let amqps_addr = amqps.as_ref().and_then(|l| l.local_addr().ok());
    let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
    let mut tls = TlsRotation::new(metrics.clone());
    let tls_server = match &amqps {
        Some(_) => {
            let server = Arc::new(crate::tls::server_material(&config.tls)?);
            tls.add(server.clone());
            Some(server)
        }
        None => None,
    };

    let mut hub_state = PolicyHubState {
        from_config: config.policies.clone(),
        runtime: BTreeMap::new(),
    };
    // Proxy mode: redrives log in to the upstream as the service identity.
    let mut proxy_redrive = None;
    let (sink, broker_handle, server_ctx, connection_slots) = match config.mode {
        Mode::Embedded => {
            let users = UserDb::from_config(&config.users).map_err(|e| anyhow::anyhow!(e))?;
            let broker = Broker::new(
                &config.vhosts,
                initial,
                BrokerOptions {
                    dead_letter: dead_letter_options(&config)?,
                    default_delivery_limit: (config.dead_letter.default_delivery_limit > 0)
                        .then_some(config.dead_letter.default_delivery_limit as u64),
                    max_queues: config.limits.max_queues,
                    max_exchanges: config.limits.max_exchanges,
                    max_bindings: config.limits.max_bindings,
                    max_consumers_per_channel: config.limits.max_consumers_per_channel,
                    consumer_timeout: (config.limits.consumer_timeout > 0)
                        .then_some(config.limits.consumer_timeout),
                    keep_dead_letters: !config.dead_letter.ttl_on_dead_letters,
                },
                metrics.clone(),
            );
            // Read when scraped; a weak handle, so the metrics do not keep the broker alive.
            let definitions = Arc::downgrade(&broker);
            metrics.before_scrape(move |metrics| {
                if let Some(broker) = definitions.upgrade() {
                    let (queues, exchanges, bindings) = broker.definition_counts();
                    metrics.set_definitions(queues, exchanges, bindings);
                }
            });
            if let Some(options) = config.storage.options() {
                let started = std::time::Instant::now();
                let dir = options.dir.display().to_string();
                let storage_metrics = metrics.clone();
                let (storage, recovered) = tokio::task::spawn_blocking(move || {
                    crate::storage::Storage::open(options, Some(storage_metrics))
                })
                .await
                .context("storage recovery task")?
                .with_context(|| format!("opening storage.dir {dir:?}"))?;
                let mut recovered = recovered;
                restore_runtime_policies(&mut hub_state, &mut recovered.definitions.policies);
                if !hub_state.runtime.is_empty() {
                    let merged = PolicyHub::merged(&hub_state);
                    // Checked by restore_runtime_policies: the merged set is valid.
                    if let Ok(set) = PolicySet::from_configs(&merged) {
                        broker.apply_policies(set);
                    }
                }
                broker.restore(recovered, Arc::new(storage));
                metrics.set_storage_recovery_time(started.elapsed());
            }
            tasks.spawn(broker.clone().timer_loop(tasks.clone()));
            let ctx = ServerContext::new(broker.clone(), users, config.limits.clone());
            if let Some(options) = config.storage.options() {
                ctx.disk_free_limit
                    .store(config.storage.disk_free_limit_bytes(), Ordering::Relaxed);
                let limit_ctx = ctx.clone();
                tasks.spawn(crate::storage::disk::run(
                    options.dir,
                    move || limit_ctx.disk_free_limit.load(Ordering::Relaxed),
                    metrics.clone(),
                    ctx.disk_alarm.clone(),
                    tasks.clone(),
                ));
            }
            spawn_memory_monitor(&ctx, &metrics, tasks.clone())?;
            if let Some(listener) = amqp {
                tracing::info!(addr = %ListenAddr(amqp_addr), "AMQP listener (embedded broker)");
                listeners.push(tasks.spawn(server::serve(
                    listener,
                    ctx.clone(),
                    accepting.clone(),
                    tasks.clone(),
                )));
            }
            if let (Some(listener), Some(server)) = (amqps, tls_server) {
                tracing::info!(addr = %ListenAddr(amqps_addr), "AMQPS listener (embedded broker)");
                let tls_ctx = ctx.clone();
                let conn_stop = tasks.clone();
                listeners.push(tasks.spawn(crate::tls::serve(
                    listener,
                    server,
                    ctx.connections.clone(),
                    accepting.clone(),
                    move |stream, peer, admission| {
                        server::spawn_admitted(
                            admission,
                            stream,
                            peer,
                            tls_ctx.clone(),
                            conn_stop.clone(),
                        )
                    },
                )));
            }
            readiness.set_ready(true);
            let slots = ctx.connections.clone();
            (
                PolicySink::Broker(broker.clone()),
                Some(broker),
                Some(ctx),
                slots,
            )
        }
        Mode::Proxy => {
            let shared_policies = Arc::new(RwLock::new(initial));
            let proxy = crate::proxy::ProxyShared::with_capture_name(
                &config,
                shared_policies.clone(),
                metrics.clone(),
                &config.proxy.capture_name,
            )?;
            if let Some(upstream_tls) = proxy.upstream().tls_material() {
                tls.add(upstream_tls);
            }
            if let Some(listener) = amqp {
                tracing::info!(addr = %ListenAddr(amqp_addr), upstream = %config.upstream.urls_for_display(), "AMQP listener (proxy)");
                let shared = proxy.clone();
                let conn_stop = tasks.clone();
                listeners.push(tasks.spawn(crate::listener::accept_tcp(
                    listener,
                    accepting.clone(),
                    move |stream, peer| {
                        crate::proxy::spawn_connection(
                            stream,
                            peer,
                            shared.clone(),
                            conn_stop.clone(),
                        );
                    },
                )));
            }
            if let (Some(listener), Some(server)) = (amqps, tls_server) {
                tracing::info!(addr = %ListenAddr(amqps_addr), "AMQPS listener (proxy)");
                let tls_proxy = proxy.clone();
                let conn_stop = tasks.clone();
                listeners.push(tasks.spawn(crate::tls::serve(
                    listener,
                    server,
                    proxy.connection_slots().clone(),
                    accepting.clone(),
                    move |stream, peer, admission| {
                        crate::proxy::spawn_admitted(
                            admission,
                            stream,
                            peer,
                            tls_proxy.clone(),
                            conn_stop.clone(),
                        );
                    },
                )));
            }
            if let Some(identity) = config
                .upstream
                .service_identity()
                .map_err(|e| anyhow::anyhow!("{e}"))?
            {
                proxy_redrive = Some(crate::redrive::Backend::Proxy {
                    shared: proxy.clone(),
                    identity,
                });
            }
            // The service connections (capture objects and consumers) run until the
            // connections are closed, after the drain.
            if !config.proxy.delegate_to_upstream
                && let Some(identity) = config
                    .upstream
                    .service_identity()
                    .map_err(|e| anyhow::anyhow!("{e}"))?
            {
                proxy.start_services(identity, services_trigger.subscribe());
            }
            // Readiness follows upstream reachability (the pool's check runs until the
            // shutdown signal) and the capture consumers of proxy.vhosts (liveness never
            // does).
            readiness.require_upstream(proxy.upstream().reachability());
            readiness.require_capture(proxy.capture_readiness());
            readiness.set_ready(true);
            tasks.spawn(proxy.upstream().clone().watch(accepting.clone()));
            if let Some(sync) = crate::proxy::policy_sync::UpstreamPolicySync::from_config(
                &config,
                proxy.capture_name(),
                shared_policies.clone(),
                metrics.clone(),
                policy_changes.clone(),
            )? {
                tasks.spawn(sync.run(accepting.clone()));
            }
            let slots = proxy.connection_slots().clone();
            (PolicySink::Shared(shared_policies), None, None, slots)
        }
    };
    let policies = Arc::new(PolicyHub {
        inner: Mutex::new(hub_state),
        sink,
        changed: policy_changes,
    });
    if let Some(listener) = admin {
        tracing::info!(
            addr = %ListenAddr(admin_addr),
            writes = if admin_token.is_set() { "bearer token required" } else { "disabled (no admin token)" },
            "admin HTTP listener"
        );
        let state = AdminState {
            metrics: metrics.clone(),
            readiness: readiness.clone(),
            policies: policies.clone(),
            token: admin_token.clone(),
            inspector: inspector(&config, broker_handle.clone())?,
            redrive: crate::redrive::Redriver::new(
                match (&broker_handle, proxy_redrive) {
                    (Some(broker), _) => crate::redrive::Backend::Broker(broker.clone()),
                    (None, Some(proxy)) => proxy,
                    (None, None) => crate::redrive::Backend::Unavailable,
                },
                metrics.clone(),
            ),
        };
        let stop = tasks.clone();
        tasks.spawn(async move {
            if let Err(err) = crate::admin::serve(listener, state, stop).await {
                tracing::error!(%err, "admin server failed");
            }
        });
    }
    let tls_watchers = tls.watch();
    Ok(RunningService {
        amqp_addr,
        amqps_addr,
        admin_addr,
        metrics,
        broker: broker_handle,
        policies,
        readiness,
        admin_token,
        server: server_ctx,
        connection_slots,
        drain: Duration::from_secs(config.shutdown.drain_secs),
        fixed_settings: fixed_settings(&config),
        accept_trigger,
        connections_trigger,
        services_trigger,
        listeners,
        tls,
        _tls_watchers: tls_watchers,
    })
}

/// Reloads from `path` (and the environment); a broken configuration is logged and the old
/// one stays in force.
fn reload_from(service: &RunningService, path: Option<&std::path::Path>) {
    match crate::config::load(path).map_err(|e| anyhow::anyhow!("{e}")) {
        Ok(cfg) => match service.reload(&cfg) {
            Ok(()) => {
                service.metrics.config_reloaded(true);
                tracing::info!("configuration reloaded");
            }
            Err(err) => {
                service.metrics.config_reloaded(false);
                tracing::error!(error = %err, "configuration reload rejected; keeping the old one");
            }
        },
        Err(err) => {
            service.metrics.config_reloaded(false);
            tracing::error!(error = %err, "configuration reload rejected; keeping the old one");
        }
    }
}

/// Runs until SIGTERM or SIGINT, then shuts down gracefully (a second signal cuts the drain
/// short); SIGHUP or a change of the config file reloads.
pub async fn run(config: Config, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    // Handlers first: `start` reports ready, and a SIGTERM or SIGHUP sent from then on must
    // not hit the default action (terminate) before the loop below waits for it.
    let mut stop = crate::shutdown::TerminationSignals::install()
        .context("installing the SIGTERM/SIGINT handlers")?;
    let mut hup = crate::shutdown::reload_signals().context("installing the SIGHUP handler")?;
    // A rotated admin token or user password (a Kubernetes Secret update) reloads like a
    // config change.
    let secret_files: Vec<PathBuf> = std::iter::once(&config.admin.token_file)
        .chain(config.users.iter().map(|user| &user.password_file))
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .collect();
    let service = start(config).await?;
    let (watch_tx, mut watch_rx) = tokio::sync::mpsc::channel::<()>(1);
    let watch = |path: &std::path::Path, what: &str| match crate::reload::watch_config(
        path,
        watch_tx.clone(),
    ) {
        Ok(w) => Some(w),
        Err(err) => {
            tracing::warn!(%err, watching = what, path = %path.display(), "file watching unavailable; SIGHUP still reloads");
            None
        }
    };
    let _watcher = config_path.as_deref().and_then(|p| watch(p, "config file"));
    let _secret_watcher = (!secret_files.is_empty())
        .then(|| crate::reload::watch_files(&secret_files, watch_tx.clone()))
        .and_then(|watcher| match watcher {
            Ok(w) => Some(w),
            Err(err) => {
                tracing::warn!(%err, "admin token / password file watching unavailable; SIGHUP still reloads");
                None
            }
        });
    loop {
        tokio::select! {
            signal = stop.recv() => {
                tracing::info!(signal, "shutting down");
                break;
            }
            _ = hup.recv() => {
                reload_from(&service, config_path.as_deref());
                service.reload_tls();
            }
            Some(()) = watch_rx.recv() => reload_from(&service, config_path.as_deref()),
        }
    }
    // A second SIGTERM/SIGINT (an impatient operator) skips the rest of the drain.
    tokio::select! {
        () = service.shutdown() => {}
        signal = stop.recv() => {
            tracing::warn!(signal, "second signal during shutdown; exiting without finishing the drain");
        }
    }
    Ok(())
}

/// A listener address in a log line: `127.0.0.1:5672`, or `off` when not listening (rather
/// than a Debug rendering such as `Some(127.0.0.1:5672)`).
struct ListenAddr(Option<std::net::SocketAddr>);

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(addr) => addr.fmt(f),
            None => f.write_str("off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_start_time_settings_are_reported_as_needing_a_restart() {
        let running = Config::default();
        let fixed = fixed_settings(&running);
        let mut reloadable = running.clone();
        reloadable.limits.max_connections += 1;
        reloadable.users.clear();
        reloadable.storage.disk_free_limit = "1.5x".into();
        reloadable.policies.push(PolicyConfig {
            name: "p".into(),
            vhost: "/".into(),
            pattern: ".*".into(),
            apply_to: "queues".into(),
            priority: 0,
            definition: BTreeMap::new(),
        });
        assert!(changed_fixed_settings(&fixed, &reloadable).is_empty());

        let mut moved = running.clone();
        moved.listen.amqp = "127.0.0.1:5999".into();
        moved.vhosts.push("other".into());
        moved.shutdown.drain_secs += 1;
        moved.limits.consumer_timeout = 1000;
        assert_eq!(
            changed_fixed_settings(&fixed, &moved),
            vec!["limits.consumer_timeout", "listen", "shutdown", "vhosts"]
        );

        let mut storage = running.clone();
        storage.storage.dir = "elsewhere".into();
        storage.storage.fsync = "never".into();
        storage.storage.segment_size = 1 << 20;
        assert_eq!(
            changed_fixed_settings(&fixed, &storage),
            vec!["storage.dir", "storage.fsync", "storage.segment_size"]
        );

        // Proxy mode reads its limits at start: a change is reported, but for
        // max_connections.
        let proxy = Config {
            mode: Mode::Proxy,
            ..Config::default()
        };
        let fixed = fixed_settings(&proxy);
        let mut connections = proxy.clone();
        connections.limits.max_connections += 1;
        assert!(changed_fixed_settings(&fixed, &connections).is_empty());
        let mut depth = proxy.clone();
        depth.limits.max_table_depth = 8;
        assert_eq!(
            changed_fixed_settings(&fixed, &depth),
            vec!["limits (proxy mode, but max_connections)"]
        );
    }
}
