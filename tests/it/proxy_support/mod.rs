//! Shared helpers for the proxy-mode integration tests: start a proxy in-process in front of
//! the reference RabbitMQ, talk to it with lapin, read the upstream directly, read metrics.
//!
//! The upstream is the RabbitMQ node the tests start themselves ([`crate::rabbit::reference`]),
//! started on first use; without `rabbitmq-server` installed these tests fail and say so.
//!
//! Built on `common`, whose general helpers it re-exports, so that `use proxy_support::*` is a
//! proxy test's one import of helpers.
#![allow(dead_code)]

pub mod fleet;

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use dlx_proxy::config::{Config, Mode, PolicyConfig};
use dlx_proxy::metrics::Metrics;
use dlx_proxy::policy::PolicySet;
use dlx_proxy::proxy::{ProxyShared, serve};
use dlx_proxy::shutdown::ShutdownTrigger;
use lapin::message::{Delivery, DeliveryResult};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::mpsc;

use crate::common::{metric_value, poll, series};

// Re-exported for the proxy tests (not every test binary uses all of them).
#[allow(unused_imports)]
pub use crate::common::dl::{
    bind, consume_empty, declare, declare_dead_lettering, declare_dlx, exchange, header, ls,
    message_count, payload, table,
};
#[allow(unused_imports)]
pub use crate::common::{RawClient, RawDelivery, unique};

/// `host:port` of the reference RabbitMQ's AMQP listener (starts the node on first use).
/// A name unique to this run of at most the prefix and 16 bytes, short enough that
/// RabbitMQ's refusal texts quoting a queue's capture tag fit 255 bytes (an instance reads a
/// queue it did not declare back from them).
pub fn short_unique(prefix: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    unique(prefix).hash(&mut hasher);
    format!("{prefix}{:x}", hasher.finish())
}

pub fn upstream_host() -> String {
    crate::rabbit::reference().amqp.to_string()
}

/// `amqp://guest:guest@host:port/%2f` of the reference RabbitMQ.
pub fn upstream_uri() -> String {
    crate::rabbit::reference().uri()
}

/// A policy for the queues matching `pattern` in vhost "/", priority 0.
pub fn policy(name: &str, pattern: &str, definition: serde_json::Value) -> PolicyConfig {
    crate::common::dl_policy::pattern(name, pattern, 0, definition)
}

/// A proxy running in this process.
pub struct TestProxy {
    pub addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    pub shared: Arc<ProxyShared>,
    pub capture: String,
    /// The policies the proxy reads (what a config reload or the admin API replaces).
    policies: Arc<RwLock<PolicySet>>,
    trigger: ShutdownTrigger,
}

impl TestProxy {
    /// Starts a proxy in front of the reference RabbitMQ with these policies.
    pub async fn start(policies: Vec<PolicyConfig>) -> TestProxy {
        Self::start_with(policies, |_| {}).await
    }

    /// Starts a proxy after `tweak` adjusted the configuration.
    pub async fn start_with(
        policies: Vec<PolicyConfig>,
        tweak: impl FnOnce(&mut Config),
    ) -> TestProxy {
        Self::start_listening("127.0.0.1:0".parse().unwrap(), policies, tweak).await
    }

    /// Like [`TestProxy::start_with`], listening on `listen` (an address of a test's own
    /// network namespace link, for instance).
    pub async fn start_listening(
        listen: SocketAddr,
        policies: Vec<PolicyConfig>,
        tweak: impl FnOnce(&mut Config),
    ) -> TestProxy {
        Self::launch(listen, policies, &unique("capture"), tweak).await
    }

    /// Another instance of the same proxy deployment as `first` (the same capture exchange
    /// and queue, the same policies): what a second pod, or `first` after a restart, is.
    pub async fn instance_of(first: &TestProxy, policies: Vec<PolicyConfig>) -> TestProxy {
        let listen = "127.0.0.1:0".parse().unwrap();
        Self::launch(listen, policies, &first.capture, |_| {}).await
    }

    async fn launch(
        listen: SocketAddr,
        policies: Vec<PolicyConfig>,
        capture: &str,
        tweak: impl FnOnce(&mut Config),
    ) -> TestProxy {
        let capture = capture.to_string();
        let mut config = Config {
            mode: Mode::Proxy,
            policies: policies.clone(),
            ..Config::default()
        };
        config.upstream.url = format!("amqp://{}", upstream_host());
        // The reference node's administrator is the proxy's service identity.
        config.upstream.user = "guest".into();
        config.upstream.password = "guest".into();
        config.proxy.confirm_timeout_secs = 5;
        tweak(&mut config);
        let set = PolicySet::from_configs(&config.policies).expect("valid policies");
        let metrics = Metrics::new(1000);
        let policies = Arc::new(RwLock::new(set));
        let shared =
            ProxyShared::with_capture_name(&config, policies.clone(), metrics.clone(), &capture)
                .expect("proxy settings");
        let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let trigger = ShutdownTrigger::new();
        if !config.proxy.delegate_to_upstream {
            let identity = config
                .upstream
                .service_identity()
                .expect("service identity")
                .expect("a service user");
            shared.start_services(identity, trigger.subscribe());
        }
        tokio::spawn(serve(listener, shared.clone(), trigger.subscribe()));
        TestProxy {
            addr,
            metrics,
            shared,
            capture,
            policies,
            trigger,
        }
    }

    /// Replaces the policies, as a config reload does.
    pub fn set_policies(&self, policies: &[PolicyConfig]) {
        let set = PolicySet::from_configs(policies).expect("valid policies");
        *self.policies.write().unwrap() = set;
    }

    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// A client connection through the proxy.
    pub async fn connect(&self) -> Connection {
        Connection::connect(&self.uri(), ConnectionProperties::default())
            .await
            .expect("connect through the proxy")
    }

    /// The value of a counter line of the metrics text (0 when absent). `labels` must be in
    /// the order Prometheus prints them (alphabetical).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let series = series(&format!("dlx_proxy_{name}"), labels);
        metric_value(&self.metrics.encode(), &series).unwrap_or(0.0)
    }

    /// Waits until `dead_lettered_total` of `queue` in vhost "/" for `reason` reaches `value`
    /// and asserts it is no more. The proxy counts a dead letter at its confirm, which may come
    /// after the dead-letter queue shows it.
    pub async fn wait_dead_lettered(&self, queue: &str, reason: &str, value: f64) {
        let labels = [("queue", queue), ("reason", reason), ("vhost", "/")];
        self.wait_counter("dead_lettered_total", &labels, value)
            .await;
        assert_eq!(self.counter("dead_lettered_total", &labels), value);
    }

    /// The sum of every series of the counter `name`, whatever its labels.
    pub fn counter_all_labels(&self, name: &str) -> f64 {
        let name = format!("dlx_proxy_{name}");
        self.metrics
            .encode()
            .lines()
            .filter(|line| {
                line.strip_prefix(name.as_str())
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Asserts that `counter` stays at `value` for `during`: for what, done wrongly, would be
    /// counted only at a confirm that comes after what the test saw.
    pub async fn stays(&self, name: &str, labels: &[(&str, &str)], value: f64, during: Duration) {
        let end = tokio::time::Instant::now() + during;
        loop {
            assert_eq!(self.counter(name, labels), value, "{name}{labels:?}");
            if tokio::time::Instant::now() >= end {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls `counter` until it reaches `value` (panics after 15 s).
    pub async fn wait_counter(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        let reached = poll(POLL_LIMIT, POLL_EVERY, async || {
            (self.counter(name, labels) >= value).then_some(())
        })
        .await;
        if reached.is_none() {
            panic!(
                "counter {name}{labels:?} is {}, expected {value}\n{}",
                self.counter(name, labels),
                self.metrics.encode()
            );
        }
    }

    /// Polls a gauge until it equals `value` (panics after 15 s).
    pub async fn wait_gauge(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        let reached = poll(POLL_LIMIT, POLL_EVERY, async || {
            (self.counter(name, labels) == value).then_some(())
        })
        .await;
        if reached.is_none() {
            panic!(
                "gauge {name}{labels:?} is {}, expected {value}",
                self.counter(name, labels)
            );
        }
    }

    /// Fires the service's shutdown signal (connections are closed with 320).
    pub fn trigger_shutdown(&self) {
        self.trigger.trigger();
    }

    /// Stops accepting connections and removes the capture exchange and queue.
    pub async fn stop(self) {
        self.trigger.trigger();
        delete_capture(&self.capture).await;
    }

    /// Stops this instance only: the deployment's capture exchange and queue stay for its
    /// other instances ([`TestProxy::instance_of`]).
    pub fn stop_instance(self) {
        self.trigger.trigger();
    }
}

/// Removes a proxy's capture exchange and queue from the upstream (best effort: a test that
/// ends early may have created neither).
pub async fn delete_capture(capture: &str) {
    if let Ok(conn) = Connection::connect(&upstream_uri(), ConnectionProperties::default()).await
        && let Ok(ch) = conn.create_channel().await
    {
        let _ = ch
            .queue_delete(capture.into(), QueueDeleteOptions::default())
            .await;
        let _ = ch.exchange_delete(capture.into(), Default::default()).await;
        let _ = conn.close(200, "done".into()).await;
    }
}

/// A connection straight to RabbitMQ (to look behind the proxy).
pub async fn upstream_connection() -> Connection {
    Connection::connect(&upstream_uri(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ")
}

/// How long the polling helpers below wait, and how often they look.
const POLL_LIMIT: Duration = Duration::from_secs(15);
const POLL_EVERY: Duration = Duration::from_millis(50);

/// Deletes queues and exchanges a test left on the upstream broker.
pub async fn delete_upstream(ch: &Channel, queues: &[&str], exchanges: &[&str]) {
    for queue in queues {
        ch.queue_delete((*queue).into(), QueueDeleteOptions::default())
            .await
            .unwrap_or_else(|e| panic!("delete queue {queue}: {e}"));
    }
    for exchange in exchanges {
        ch.exchange_delete((*exchange).into(), Default::default())
            .await
            .unwrap_or_else(|e| panic!("delete exchange {exchange}: {e}"));
    }
}

/// Waits until the upstream broker itself reports `queue` empty (everything was settled).
pub async fn wait_upstream_empty(queue: &str) {
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    wait_count(&ch, queue, 0).await;
    let _ = upstream.close(200, "done".into()).await;
}

/// Publishes "m0", "m1", … (`count` messages) to `queue` on a channel in confirm mode and
/// checks that each is acked.
pub async fn publish_acked(ch: &Channel, queue: &str, count: usize) {
    publish_acked_named(ch, queue, "m", count).await;
}

/// [`publish_acked`] with bodies `{prefix}0`, `{prefix}1`, …
pub async fn publish_acked_named(ch: &Channel, queue: &str, prefix: &str, count: usize) {
    for i in 0..count {
        let body = format!("{prefix}{i}");
        let confirm = crate::common::dl::publish_to(
            ch,
            "",
            queue,
            body.as_bytes(),
            lapin::BasicProperties::default(),
        )
        .await;
        assert!(confirm.is_ack(), "publish {body}: {confirm:?}");
    }
}

/// A new channel in confirm mode and a new queue (named from `prefix`) declared on it.
pub async fn confirming_channel(conn: &Connection, prefix: &str) -> (Channel, String) {
    let ch = conn.create_channel().await.unwrap();
    let queue = unique(prefix);
    declare(&ch, &queue, FieldTable::default()).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (ch, queue)
}

/// Polls basic.get (no auto-ack) until a message arrives (panics after 15 s).
pub async fn get(ch: &Channel, queue: &str) -> Delivery {
    let got = poll(POLL_LIMIT, POLL_EVERY, async || {
        ch.basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
            .map(|message| message.delivery)
    })
    .await;
    got.unwrap_or_else(|| panic!("no message in {queue}"))
}

/// Waits until a queue holds `count` messages (panics after 15 s).
pub async fn wait_count(ch: &Channel, queue: &str, count: u32) {
    let reached = poll(POLL_LIMIT, POLL_EVERY, async || {
        (message_count(ch, queue).await == count).then_some(())
    })
    .await;
    if reached.is_none() {
        let now = message_count(ch, queue).await;
        panic!("{queue} holds {now} messages, expected {count}");
    }
}

/// Forwards deliveries, in order, to a channel (lapin runs the futures of a delegate
/// concurrently, so the send happens when lapin hands the delivery over).
struct OrderedDelegate {
    tx: mpsc::UnboundedSender<Result<Delivery, lapin::Error>>,
}

impl lapin::ConsumerDelegate for OrderedDelegate {
    fn on_new_delivery(
        &self,
        delivery: DeliveryResult,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        match delivery {
            Ok(Some(d)) => {
                let _ = self.tx.send(Ok(d));
            }
            Ok(None) => {}
            Err(e) => {
                let _ = self.tx.send(Err(e));
            }
        }
        Box::pin(std::future::ready(()))
    }
}

/// Starts a consumer whose deliveries (or its error) arrive on a channel, in order.
pub async fn consume(
    ch: &Channel,
    queue: &str,
    options: BasicConsumeOptions,
) -> mpsc::UnboundedReceiver<Result<Delivery, lapin::Error>> {
    let consumer = ch
        .basic_consume(queue.into(), "".into(), options, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("consume {queue}: {e}"));
    let (tx, rx) = mpsc::unbounded_channel();
    consumer.set_delegate(OrderedDelegate { tx });
    rx
}

/// The next delivery of a consumer (panics after 15 s).
pub async fn next(rx: &mut mpsc::UnboundedReceiver<Result<Delivery, lapin::Error>>) -> Delivery {
    match tokio::time::timeout(Duration::from_secs(15), rx.recv()).await {
        Ok(Some(Ok(d))) => d,
        Ok(Some(Err(e))) => panic!("consumer error: {e}"),
        Ok(None) => panic!("consumer ended"),
        Err(_) => panic!("no delivery within 15 s"),
    }
}

/// The x-death entries of a delivery, as tables.
pub fn x_death(d: &Delivery) -> Vec<FieldTable> {
    match header(d, "x-death") {
        Some(AMQPValue::FieldArray(a)) => a
            .as_slice()
            .iter()
            .map(|v| match v {
                AMQPValue::FieldTable(t) => t.clone(),
                other => panic!("x-death element is not a table: {other:?}"),
            })
            .collect(),
        None => Vec::new(),
        Some(other) => panic!("x-death is not an array: {other:?}"),
    }
}

pub fn field<'a>(t: &'a FieldTable, name: &str) -> &'a AMQPValue {
    t.inner()
        .get(name)
        .unwrap_or_else(|| panic!("x-death entry lacks {name}: {t:?}"))
}

/// Runs `rabbitmqctl` against the reference RabbitMQ.
pub fn rabbitmqctl(args: &[&str]) -> std::process::Output {
    crate::rabbit::reference().ctl(args)
}

/// A user of the reference RabbitMQ for one test, deleted on drop.
pub struct RabbitUser(String);

impl RabbitUser {
    /// A user with every permission on vhost "/".
    pub fn create(name: &str, password: &str) -> RabbitUser {
        Self::create_with(name, password, ".*")
    }

    /// A user who may configure and read everything on vhost "/" and write what `write`
    /// matches.
    pub fn create_with(name: &str, password: &str, write: &str) -> RabbitUser {
        let added = rabbitmqctl(&["add_user", name, password]);
        assert!(
            added.status.success(),
            "add_user: {}",
            String::from_utf8_lossy(&added.stderr)
        );
        let user = RabbitUser(name.to_string());
        user.set_write(write);
        user
    }

    /// Replaces the user's write permission on vhost "/".
    pub fn set_write(&self, write: &str) {
        self.set_permissions(".*", write, ".*");
    }

    /// Replaces the user's permissions on vhost "/" (RabbitMQ regexes).
    pub fn set_permissions(&self, configure: &str, write: &str, read: &str) {
        let permitted = rabbitmqctl(&[
            "set_permissions",
            "-p",
            "/",
            &self.0,
            configure,
            write,
            read,
        ]);
        assert!(
            permitted.status.success(),
            "set_permissions: {}",
            String::from_utf8_lossy(&permitted.stderr)
        );
    }
}

impl Drop for RabbitUser {
    fn drop(&mut self) {
        let _ = rabbitmqctl(&["delete_user", &self.0]);
    }
}

/// Closes the upstream connection(s) whose client named itself `connection_name`, the way an
/// operator does (`rabbitmqctl close_connection`): the broker sends 320 CONNECTION_FORCED.
pub fn close_upstream_connection(connection_name: &str, reason: &str) -> usize {
    let listing = rabbitmqctl(&["list_connections", "-q", "pid", "client_properties"]);
    let text = String::from_utf8_lossy(&listing.stdout);
    let mut closed = 0;
    for line in text.lines().filter(|l| l.contains(connection_name)) {
        let Some(pid) = line.split_whitespace().next() else {
            continue;
        };
        let out = rabbitmqctl(&["close_connection", pid, reason]);
        assert!(out.status.success(), "close_connection: {out:?}");
        closed += 1;
    }
    closed
}

// ------------------------------------------------------------------------------------------
// The amqps listener of the reference RabbitMQ
// ------------------------------------------------------------------------------------------

/// The port of the reference RabbitMQ's amqps listener (certificate for `localhost` and
/// 127.0.0.1, signed by [`upstream_tls_ca`]).
pub fn upstream_tls_port() -> u16 {
    crate::rabbit::reference().amqps.port()
}

/// The CA file that signed the amqps listener's certificate.
pub fn upstream_tls_ca() -> std::path::PathBuf {
    crate::rabbit::reference().ca_file.clone()
}
