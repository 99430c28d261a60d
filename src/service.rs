//! Wires a validated [`Config`] into running listeners: the embedded broker or the proxy, the
//! admin HTTP server, the broker's timer task, and the shutdown signal threaded through all
//! of them.
//!
//! [`start`] binds everything and returns a [`RunningService`] handle (used by `main` and by
//! the integration tests); [`run`] is `start` plus waiting for SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::broker::auth::UserDb;
use crate::broker::{Broker, BrokerOptions};
use crate::config::{Config, Mode};
use crate::deadletter::DeadLetterOptions;
use crate::metrics::Metrics;
use crate::policy::PolicySet;
use crate::server::{self, ServerContext};
use crate::shutdown::{Shutdown, ShutdownTrigger};

/// A started service.
pub struct RunningService {
    pub amqp_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    pub broker: Option<Arc<Broker>>,
    trigger: ShutdownTrigger,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningService {
    /// Stops accepting, closes client connections with 320 and waits for the tasks.
    pub async fn shutdown(self) {
        self.trigger.trigger();
        for t in self.tasks {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), t).await;
        }
    }
}

/// Dead-letter options from the configuration.
pub fn dead_letter_options(config: &Config) -> anyhow::Result<DeadLetterOptions> {
    let mut o = DeadLetterOptions {
        x_death_total: config.dead_letter.x_death_total,
        max_hops: (config.dead_letter.max_hops > 0).then_some(config.dead_letter.max_hops),
        ..Default::default()
    };
    o.compat = config
        .dead_letter
        .compat
        .parse()
        .map_err(|_| anyhow::anyhow!("dead_letter.compat: expected \"3\" or \"4\""))?;
    Ok(o)
}

/// Binds the listeners and starts every task.
pub async fn start(config: Config) -> anyhow::Result<RunningService> {
    let trigger = ShutdownTrigger::new();
    let shutdown = trigger.subscribe();
    let metrics = Metrics::new(config.metrics.max_queue_labels);
    let policies = PolicySet::from_configs(&config.policies).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut tasks = Vec::new();
    let mut amqp_addr = None;
    let mut broker_handle = None;
    match config.mode {
        Mode::Embedded => {
            let users = UserDb::from_config(&config.users).map_err(|e| anyhow::anyhow!(e))?;
            let broker = Broker::new(
                &config.vhosts,
                policies,
                BrokerOptions {
                    dead_letter: dead_letter_options(&config)?,
                    default_delivery_limit: (config.dead_letter.default_delivery_limit > 0)
                        .then_some(config.dead_letter.default_delivery_limit as u64),
                    max_queues: config.limits.max_queues,
                },
                metrics.clone(),
            );
            tasks.push(tokio::spawn(broker.clone().timer_loop(shutdown.clone())));
            let ctx = ServerContext::new(broker.clone(), users, config.limits.clone());
            if !config.listen.amqp.is_empty() {
                let listener = TcpListener::bind(&config.listen.amqp)
                    .await
                    .with_context(|| format!("listen.amqp: cannot bind {}", config.listen.amqp))?;
                amqp_addr = Some(listener.local_addr()?);
                tracing::info!(addr = %listener.local_addr()?, "AMQP listener (embedded broker)");
                tasks.push(tokio::spawn(server::serve(
                    listener,
                    ctx.clone(),
                    shutdown.clone(),
                )));
            }
            broker_handle = Some(broker);
        }
        Mode::Proxy => {
            anyhow::bail!("proxy mode is not available in this build yet");
        }
    }
    Ok(RunningService {
        amqp_addr,
        metrics,
        broker: broker_handle,
        trigger,
        tasks,
    })
}

/// Runs until SIGTERM or SIGINT, then shuts down gracefully.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let service = start(config).await?;
    wait_for_signal().await;
    tracing::info!("shutting down");
    service.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[allow(dead_code)]
fn _shutdown_type_check(_: Shutdown) {}
