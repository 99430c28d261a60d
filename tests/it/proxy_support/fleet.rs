//! Proxies as separate processes, for the fleet tests: [`ProxyProcess`] runs the real
//! `dlx-proxy` binary (`run --config FILE`) in proxy mode on free ports, the way a sidecar runs,
//! so that a test can SIGKILL it, stop it with SIGTERM and start it again; [`Fleet`] is a few
//! of them sharing one configuration (one capture name, the same policies) in front of the
//! RabbitMQ cluster of [`crate::rabbit::cluster`].
//!
//! Built on [`crate::common::ServiceProcess`] (the child process, its logs, `/readyz`). The
//! configuration is written by [`fleet_toml`]; tests change any setting by passing TOML that is
//! merged over it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use dlx_proxy::config::PolicyConfig;
use lapin::{Connection, ConnectionProperties};

use crate::common::{ServiceProcess, TempDir, free_addresses, metric_value, poll, scrape, series};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// The proxy-mode configuration of a fleet member in front of `upstreams` (AMQP URIs, the
/// node to try first first; all of them in `upstream.urls`), with the service user guest,
/// with `policies`, capturing into `capture_name`, with `overrides`
/// (TOML, may be empty) merged over it table by table. `[listen]` is left to
/// [`ProxyProcess::spawn`].
pub fn fleet_toml(
    upstreams: &[String],
    policies: &[PolicyConfig],
    capture_name: &str,
    overrides: &str,
) -> String {
    assert!(!upstreams.is_empty(), "at least one upstream URL");
    let urls = upstreams
        .iter()
        .map(|url| format!("{url:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let base = format!(
        "mode = \"proxy\"\n\n\
         [upstream]\n\
         urls = [{urls}]\n\
         user = \"guest\"\n\
         password = \"guest\"\n\n\
         [proxy]\n\
         capture_name = {capture_name:?}\n\
         confirm_timeout_secs = 5\n\n\
         [shutdown]\n\
         drain_secs = 1\n"
    );
    let mut table: toml::Table = base.parse().expect("fleet base TOML");
    #[derive(serde::Serialize)]
    struct Policies<'a> {
        policies: &'a [PolicyConfig],
    }
    let policies: toml::Table = toml::Table::try_from(Policies { policies }).expect("policies");
    merge(&mut table, policies);
    let overrides: toml::Table = overrides
        .parse()
        .unwrap_or_else(|e| panic!("overrides are not TOML: {e}\n{overrides}"));
    merge(&mut table, overrides);
    toml::to_string(&table).expect("serialize the fleet TOML")
}

/// Merges `over` into `base`: tables key by key, anything else replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(value)) => merge(inner, value),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// The `dlx-proxy` binary running as a child process on free AMQP and admin ports; killed on
/// drop.
pub struct ProxyProcess {
    pub amqp: SocketAddr,
    pub admin: SocketAddr,
    dir: TempDir,
    config: PathBuf,
    /// Started runs (each logs into a directory of its own).
    runs: usize,
    process: ServiceProcess,
}

impl ProxyProcess {
    /// Writes `config_toml` (with `[listen]` set to free ports) and starts the binary on it;
    /// returns once `/readyz` answers 200 (panics with its logs otherwise).
    pub async fn spawn(config_toml: &str) -> ProxyProcess {
        let mut proxy = Self::launch(config_toml);
        proxy.process.wait_ready().await;
        proxy
    }

    /// Starts the process without waiting for it to be ready.
    fn launch(config_toml: &str) -> ProxyProcess {
        let (amqp, admin) = free_addresses();
        let dir = TempDir::new("fleet-proxy");
        let mut table: toml::Table = config_toml
            .parse()
            .unwrap_or_else(|e| panic!("proxy config is not TOML: {e}\n{config_toml}"));
        let listen = format!("[listen]\namqp = \"{amqp}\"\nadmin = \"{admin}\"\n");
        merge(&mut table, listen.parse().expect("listen TOML"));
        let config = dir.join("dlx-proxy.toml");
        std::fs::write(&config, toml::to_string(&table).expect("TOML")).expect("write config");
        let process = Self::run(&dir, &config, 1, amqp, admin);
        ProxyProcess {
            amqp,
            admin,
            dir,
            config,
            runs: 1,
            process,
        }
    }

    fn run(
        dir: &TempDir,
        config: &std::path::Path,
        run: usize,
        amqp: SocketAddr,
        admin: SocketAddr,
    ) -> ServiceProcess {
        let logs = dir.join(&format!("run-{run}"));
        std::fs::create_dir_all(&logs).expect("log directory");
        ServiceProcess::spawn(BINARY, &logs, config, amqp, admin)
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.amqp)
    }

    /// A client connection through this proxy.
    pub async fn connect(&self) -> Connection {
        Connection::connect(&self.uri(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect through {}: {e}\n{}", self.amqp, self.logs()))
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The configuration file it runs with.
    pub fn config_path(&self) -> &std::path::Path {
        &self.config
    }

    /// The current run's stdout and stderr.
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    /// `/metrics` over HTTP.
    pub async fn metrics_text(&self) -> String {
        scrape(self.admin).await
    }

    /// The value of the counter `dlx_proxy_<name>{labels}` (0 when absent); `labels` in the
    /// order Prometheus prints them (alphabetical).
    pub async fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let series = series(&format!("dlx_proxy_{name}"), labels);
        metric_value(&self.metrics_text().await, &series).unwrap_or(0.0)
    }

    /// Polls [`ProxyProcess::counter`] until it reaches at least `value` (panics after 15 s).
    pub async fn wait_counter(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.wait_metric("counter", name, labels, value, |found| found >= value)
            .await;
    }

    /// Polls a gauge until it equals `value` (panics after 15 s). A gauge that follows
    /// something seen upstream is set after it, so it is never read only once.
    pub async fn wait_gauge(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.wait_metric("gauge", name, labels, value, |found| found == value)
            .await;
    }

    async fn wait_metric(
        &self,
        kind: &str,
        name: &str,
        labels: &[(&str, &str)],
        value: f64,
        accept: impl Fn(f64) -> bool,
    ) {
        let reached = poll(
            Duration::from_secs(15),
            Duration::from_millis(100),
            async || accept(self.counter(name, labels).await).then_some(()),
        )
        .await;
        if reached.is_none() {
            panic!(
                "{kind} {name}{labels:?} is {}, expected {value}\n{}",
                self.counter(name, labels).await,
                self.metrics_text().await
            );
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.process.child.try_wait(), Ok(None))
    }

    /// SIGKILL: the process ends at once, without closing anything.
    pub fn kill(&mut self) {
        if self.running() {
            let _ = self.process.child.kill();
        }
        let _ = self.process.child.wait();
    }

    /// Sends the signal `name` ("TERM", "INT", ...) without waiting for anything.
    pub fn signal(&self, name: &str) {
        self.process.signal(name);
    }

    /// Waits up to `limit` for the process to exit; `None` if it still runs.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(limit).await
    }

    /// SIGTERM, then waits for the exit (panics after 30 s): a graceful shutdown.
    pub async fn terminate(&mut self) -> ExitStatus {
        self.process.signal("TERM");
        self.process
            .wait_exit(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("dlx-proxy ignored SIGTERM for 30 s\n{}", self.logs()))
    }

    /// Starts the process again on the same configuration and ports (killing it first if it
    /// still runs) and waits until it is ready.
    pub async fn restart(&mut self) {
        self.kill();
        self.runs += 1;
        self.process = Self::run(&self.dir, &self.config, self.runs, self.amqp, self.admin);
        self.process.wait_ready().await;
    }
}

/// `n` proxies sharing one configuration: the same capture name and policies, in front of the
/// same upstreams. Proxy `i` lists the upstreams starting at the `i`-th (round), so that a
/// fleet in front of a cluster spreads over its nodes: proxy 0 on node 0, proxy 1 on node 1.
pub struct Fleet {
    pub proxies: Vec<ProxyProcess>,
    /// The capture exchange and queue the fleet shares (unique per fleet).
    pub capture: String,
    upstreams: Vec<String>,
}

impl Fleet {
    /// Starts `n` proxies in front of `upstreams` with `policies` and `overrides` (see
    /// [`fleet_toml`]), side by side; returns once all are ready.
    pub async fn start(
        n: usize,
        upstreams: &[String],
        policies: &[PolicyConfig],
        overrides: &str,
    ) -> Fleet {
        let capture = crate::common::unique("fleet-capture");
        let mut proxies: Vec<ProxyProcess> = (0..n)
            .map(|i| {
                let mut list = upstreams.to_vec();
                list.rotate_left(i % upstreams.len().max(1));
                ProxyProcess::launch(&fleet_toml(&list, policies, &capture, overrides))
            })
            .collect();
        for proxy in &mut proxies {
            proxy.process.wait_ready().await;
        }
        Fleet {
            proxies,
            capture,
            upstreams: upstreams.to_vec(),
        }
    }

    /// Starts `n` proxies in front of the shared cluster ([`crate::rabbit::cluster`]).
    pub async fn in_front_of_cluster(
        n: usize,
        policies: &[PolicyConfig],
        overrides: &str,
    ) -> Fleet {
        Self::start(n, &crate::rabbit::cluster().uris(), policies, overrides).await
    }

    pub fn proxy(&self, i: usize) -> &ProxyProcess {
        &self.proxies[i]
    }

    pub fn proxy_mut(&mut self, i: usize) -> &mut ProxyProcess {
        &mut self.proxies[i]
    }

    /// The sum of a counter over the fleet's proxies (see [`ProxyProcess::counter`]).
    pub async fn counter_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut sum = 0.0;
        for proxy in &self.proxies {
            sum += proxy.counter(name, labels).await;
        }
        sum
    }

    /// [`Fleet::counter_sum`] once it reaches `at_least`, or after 15 s as it is then. Dead
    /// letters are counted at their confirm, which may come after the DLQ shows them.
    pub async fn counter_sum_reaching(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        at_least: f64,
    ) -> f64 {
        let reached = poll(
            Duration::from_secs(15),
            Duration::from_millis(100),
            async || {
                let sum = self.counter_sum(name, labels).await;
                (sum >= at_least).then_some(sum)
            },
        )
        .await;
        match reached {
            Some(sum) => sum,
            None => self.counter_sum(name, labels).await,
        }
    }

    /// Kills every proxy and removes the fleet's capture exchange and queue from the upstream
    /// (best effort).
    pub async fn stop(self) {
        self.stop_deleting(&[], &[]).await;
    }

    /// [`Fleet::stop`], also deleting a test's `queues` and `exchanges` on the upstream
    /// (panics when one of those cannot be deleted).
    pub async fn stop_deleting(mut self, queues: &[&str], exchanges: &[&str]) {
        for proxy in &mut self.proxies {
            proxy.kill();
        }
        // A node that has just been restarted may reset a connection or refuse a quorum
        // queue's delete for a while: try every node, a few rounds.
        let mut last = String::new();
        for _ in 0..10 {
            for uri in &self.upstreams {
                match delete_at(uri, queues, exchanges, &self.capture).await {
                    Ok(()) => return,
                    Err(e) => last = format!("{uri}: {e}"),
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        panic!("no upstream of the fleet deletes the test's objects; last: {last}");
    }
}

/// Deletes `queues`, `exchanges` and the fleet's capture queue and exchange on the broker at
/// `uri`, on a connection of its own.
async fn delete_at(
    uri: &str,
    queues: &[&str],
    exchanges: &[&str],
    capture: &str,
) -> Result<(), lapin::Error> {
    let conn = Connection::connect(uri, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    for queue in queues {
        ch.queue_delete((*queue).into(), Default::default()).await?;
    }
    for exchange in exchanges {
        ch.exchange_delete((*exchange).into(), Default::default())
            .await?;
    }
    // The capture objects may be gone already (another test's cleanup); best effort, last.
    let _ = ch.queue_delete(capture.into(), Default::default()).await;
    let _ = ch.exchange_delete(capture.into(), Default::default()).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// The message count of `queue` as the broker at `uri` reports it (a passive declare on a
/// connection of its own, straight to the broker); `None` while it cannot answer (node down,
/// no such queue, a quorum queue without a leader).
pub async fn count_at(uri: &str, queue: &str) -> Option<u32> {
    let conn = Connection::connect(uri, ConnectionProperties::default())
        .await
        .ok()?;
    let ch = conn.create_channel().await.ok()?;
    let declared = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await;
    let _ = conn.close(200, "done".into()).await;
    declared.ok().map(|q| q.message_count())
}

/// Waits up to `limit` until the broker at `uri` reports `count` messages in `queue`; the
/// last count seen otherwise.
pub async fn wait_count_at(
    uri: &str,
    queue: &str,
    count: u32,
    limit: Duration,
) -> Result<(), Option<u32>> {
    let reached = poll(limit, Duration::from_millis(200), async || {
        (count_at(uri, queue).await == Some(count)).then_some(())
    })
    .await;
    match reached {
        Some(()) => Ok(()),
        None => Err(count_at(uri, queue).await),
    }
}
