//! Shared test support, compiled into every integration test binary that says `mod common;`:
//! start the embedded broker in-process on free ports and connect lapin to it; unique names,
//! polling and metric parsing; the raw AMQP client ([`raw_client`]); free ports, admin HTTP
//! and the real binary as a child process for the operations tests; frames with tables nested
//! thousands of levels deep ([`deep`]); and, in [`dl`] and [`dl_policy`], the helpers of the
//! dead-letter suites. `tests/proxy_support` builds the proxy-mode helpers on top of this
//! module.
#![allow(dead_code)]

pub mod deep;
pub mod netns;
pub mod pki;
mod raw_client;

use std::net::SocketAddr;
use std::time::Duration;

use dlx_proxy::config::Config;
use dlx_proxy::service::{self, RunningService};
use lapin::{Channel, Connection, ConnectionProperties};

// Not every test binary uses all of it.
#[allow(unused_imports)]
pub use raw_client::{
    RawClient, RawDelivery, capabilities, encode_method, encode_publish, with_failure_close,
};

/// An embedded broker started for one test.
pub struct TestBroker {
    pub service: RunningService,
    pub addr: SocketAddr,
}

impl TestBroker {
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    pub fn uri_as(&self, user: &str, pass: &str, vhost: &str) -> String {
        let v = vhost.replace('/', "%2f");
        format!("amqp://{user}:{pass}@{}/{v}", self.addr)
    }

    pub async fn connect(&self) -> Connection {
        Connection::connect(&self.uri(), ConnectionProperties::default())
            .await
            .expect("connect")
    }

    pub async fn channel(&self) -> (Connection, Channel) {
        let c = self.connect().await;
        let ch = c.create_channel().await.expect("channel");
        (c, ch)
    }

    pub fn metrics_text(&self) -> String {
        self.service.metrics.encode()
    }
}

/// Test configuration: embedded mode on free ports, admin off, storage off (every
/// in-process broker of the test process would otherwise share `./data`; the `storage_*`
/// suites run the binary in a directory of its own).
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.listen.amqp = "127.0.0.1:0".into();
    c.listen.admin = String::new();
    c.storage.dir = String::new();
    c
}

pub async fn start() -> TestBroker {
    start_with(test_config()).await
}

pub async fn start_with(config: Config) -> TestBroker {
    let service = service::start(config).await.expect("service starts");
    let addr = service.amqp_addr.expect("amqp listener");
    TestBroker { service, addr }
}

/// A name no other test, and no earlier run against the same RabbitMQ, uses.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    format!("t-{prefix}-{}-{micros}-{n}", std::process::id())
}

/// Calls `attempt` every `every` until it returns a value, for at most `limit` (it is called
/// at least once); `None` when it never did.
pub async fn poll<T>(
    limit: Duration,
    every: Duration,
    mut attempt: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = attempt().await {
            return Some(value);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Whether `condition` holds within 3 s (checked every 10 ms).
pub async fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    poll(
        Duration::from_secs(3),
        Duration::from_millis(10),
        async || condition().then_some(()),
    )
    .await
    .is_some()
}

/// Polls `check` every 100 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_until(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let held = poll(limit, Duration::from_millis(100), async || {
        check().await.then_some(())
    })
    .await;
    assert!(held.is_some(), "timed out waiting for {what}");
}

/// Waits until `metrics` (a service's own registry) shows `value` for `name_and_labels`.
pub async fn wait_local_metric(
    metrics: &dlx_proxy::metrics::Metrics,
    name_and_labels: &str,
    value: f64,
) {
    let seen = poll(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || (metric_value(&metrics.encode(), name_and_labels) == Some(value)).then_some(()),
    )
    .await;
    assert!(
        seen.is_some(),
        "{name_and_labels} stayed at {:?}, not {value}",
        metric_value(&metrics.encode(), name_and_labels)
    );
}

/// The value of a Prometheus sample line `name{labels} value` in the text format.
pub fn metric_value(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A series as the text format writes it: `name{k1="v1",k2="v2"}`, or `name` without labels.
/// The text format orders labels by name, so `labels` must come in that order.
pub fn series(name: &str, labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return name.to_string();
    }
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", labels.join(","))
}

// ------------------------------------------------------------------------------------------
// Operations tests: free ports, admin HTTP, and the real binary as a child process
// ------------------------------------------------------------------------------------------

/// A TCP port on 127.0.0.1 that was free a moment ago (bound, then released), for
/// configuration files of a child process where `:0` could not be discovered.
///
/// Ports come from 20000–32767, below Linux's ephemeral range (32768–60999), and each is
/// handed out once per test process. A port from the ephemeral range could meanwhile become
/// the local port of one of the many client sockets the tests open, and a connect to a closed
/// port in that range can even connect to itself (TCP simultaneous open), which made "is this
/// port refused?" checks flaky.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_768;
    // Start where other test processes running at the same time are unlikely to be.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(2_654_435_761)) % COUNT,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % COUNT) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port in {FIRST}..{}", FIRST + COUNT);
}

/// An AMQP and an admin address on 127.0.0.1, each on a [`free_port`].
pub fn free_addresses() -> (SocketAddr, SocketAddr) {
    let amqp = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    (amqp, admin)
}

/// One HTTP/1.1 request to the admin server: (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    admin_call(addr, method, path, None, None).await
}

/// One admin request with a JSON `body` and, for writes, the bearer `token`: (status, body).
pub async fn admin_call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> (u16, String) {
    let (method, path) = (method.to_string(), path.to_string());
    let body = body.map(str::to_string);
    let token = token.map(dlx_proxy::secret::Secret::from);
    tokio::task::spawn_blocking(move || {
        dlx_proxy::admin::request_with_token(
            &addr.to_string(),
            &method,
            &path,
            body.as_deref(),
            token.as_ref(),
            Duration::from_secs(5),
        )
    })
    .await
    .expect("request task")
    .expect("admin HTTP request")
}

/// GET `/metrics` from the admin server over HTTP.
pub async fn scrape(admin: SocketAddr) -> String {
    let (status, body) = http(admin, "GET", "/metrics").await;
    assert_eq!(status, 200, "GET /metrics: {body}");
    body
}

/// Polls `/metrics` until `name_and_labels` has `value` (or 5 s pass); returns that text.
pub async fn wait_metric(admin: SocketAddr, name_and_labels: &str, value: f64) -> String {
    let wanted = format!("{value}");
    let accept = |found: Option<f64>| found == Some(value);
    wait_metric_where(
        admin,
        name_and_labels,
        Duration::from_secs(5),
        &wanted,
        accept,
    )
    .await
}

/// Asserts that `err` is the refusal of a connection over `limits.max_connections = limit`
/// (530 and its text), counted in `connections_refused_total` (exactly once so far) while
/// `limit` connections are open, as the admin server at `admin` shows.
pub async fn assert_over_connection_limit(err: &lapin::Error, admin: SocketAddr, limit: usize) {
    assert_eq!(
        (dl::amqp_code(err), dl::amqp_text(err)),
        (
            Some(530),
            format!("NOT_ALLOWED - connection limit ({limit}) is reached")
        )
    );
    let text = wait_metric(
        admin,
        r#"dlx_proxy_connections_refused_total{reason="max_connections"}"#,
        1.0,
    )
    .await;
    assert_eq!(
        metric_value(&text, "dlx_proxy_connections"),
        Some(limit as f64)
    );
}

/// Polls `/metrics` until `name_and_labels` is at least `min`, a series that does not exist
/// yet counting as 0 (or 10 s pass); returns that text.
pub async fn wait_metric_at_least(admin: SocketAddr, name_and_labels: &str, min: f64) -> String {
    let wanted = format!("at least {min}");
    let accept = |found: Option<f64>| found.unwrap_or(0.0) >= min;
    wait_metric_where(
        admin,
        name_and_labels,
        Duration::from_secs(10),
        &wanted,
        accept,
    )
    .await
}

async fn wait_metric_where(
    admin: SocketAddr,
    name_and_labels: &str,
    limit: Duration,
    wanted: &str,
    accept: impl Fn(Option<f64>) -> bool,
) -> String {
    let every = Duration::from_millis(50);
    let found = poll(limit, every, async || {
        let text = scrape(admin).await;
        accept(metric_value(&text, name_and_labels)).then_some(text)
    })
    .await;
    match found {
        Some(text) => text,
        None => {
            let text = scrape(admin).await;
            panic!(
                "{name_and_labels} never reached {wanted} (last: {:?}):\n{text}",
                metric_value(&text, name_and_labels)
            );
        }
    }
}

/// A scratch directory removed on drop.
/// The resident set size of a process, in bytes (VmRSS of /proc/PID/status).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib * 1024
}

pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to `path` atomically: a sibling temporary file renamed over it.
pub fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, text).expect("write temp file");
    std::fs::rename(&tmp, path).expect("rename over the target");
}

/// The start of a configuration file for a child process: embedded mode on the given ports,
/// a short drain. Append sections (policies, `[log]`, ...) to it.
pub fn process_config(amqp: SocketAddr, admin: SocketAddr, drain_secs: u64) -> String {
    format!(
        "mode = \"embedded\"\n\n[listen]\namqp = \"{amqp}\"\nadmin = \"{admin}\"\n\n\
         [shutdown]\ndrain_secs = {drain_secs}\n"
    )
}

/// The `dlx-proxy` binary running `run --config FILE` as a child process. Its stdout and
/// stderr go to files in `dir`; it is killed on drop if still running.
pub struct ServiceProcess {
    pub child: std::process::Child,
    pub amqp: SocketAddr,
    pub admin: SocketAddr,
    pub stdout_path: std::path::PathBuf,
    pub stderr_path: std::path::PathBuf,
}

impl ServiceProcess {
    /// Starts the binary on `config` (no inherited `DLX_PROXY_*` or `RUST_LOG`); `amqp` and
    /// `admin` are the addresses written in that file.
    pub fn spawn(
        binary: &str,
        dir: &std::path::Path,
        config: &std::path::Path,
        amqp: SocketAddr,
        admin: SocketAddr,
    ) -> ServiceProcess {
        let stdout_path = dir.join("stdout.log");
        let stderr_path = dir.join("stderr.log");
        let mut command = std::process::Command::new(binary);
        command
            .arg("run")
            .arg("--config")
            .arg(config)
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
            .stderr(std::fs::File::create(&stderr_path).expect("stderr file"));
        for (name, _) in std::env::vars() {
            if name.starts_with("DLX_PROXY_") || name == "RUST_LOG" {
                command.env_remove(name);
            }
        }
        let child = command.spawn().expect("spawn dlx-proxy");
        ServiceProcess {
            child,
            amqp,
            admin,
            stdout_path,
            stderr_path,
        }
    }

    /// [`ServiceProcess::spawn`], then [`ServiceProcess::wait_ready`].
    pub async fn start(
        binary: &str,
        dir: &std::path::Path,
        config: &std::path::Path,
        amqp: SocketAddr,
        admin: SocketAddr,
    ) -> ServiceProcess {
        let mut process = Self::spawn(binary, dir, config, amqp, admin);
        process.wait_ready().await;
        process
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (TERM, INT, HUP) with the `kill` command.
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Both log files.
    pub fn logs(&self) -> String {
        let out = std::fs::read_to_string(&self.stdout_path).unwrap_or_default();
        let err = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        format!("--- stdout ---\n{out}--- stderr ---\n{err}")
    }

    /// Waits until `/readyz` answers 200 (panics with the logs after 15 s or on exit).
    pub async fn wait_ready(&mut self) {
        for _ in 0..300 {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("dlx-proxy exited early with {status}:\n{}", self.logs());
            }
            let admin = self.admin.to_string();
            let ready = tokio::task::spawn_blocking(move || {
                dlx_proxy::admin::request(&admin, "GET", "/readyz", None, Duration::from_secs(1))
            })
            .await
            .expect("request task");
            if matches!(ready, Ok((200, _))) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("dlx-proxy never became ready:\n{}", self.logs());
    }

    /// Waits up to `limit` for the process to exit.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if tokio::time::Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The binary in embedded mode with `[admin] token`, started in a fresh directory, and a
/// lapin connection with a channel to it (the CLI tests run the binary's subcommands on
/// `config`).
pub struct TokenService {
    pub dir: TempDir,
    pub config: std::path::PathBuf,
    pub process: ServiceProcess,
    pub conn: Connection,
    pub ch: Channel,
}

impl TokenService {
    pub async fn start(binary: &str, tag: &str, token: &str) -> TokenService {
        let dir = TempDir::new(tag);
        let (amqp, admin) = free_addresses();
        let config = dir.join("config.toml");
        write_atomically(
            &config,
            &format!(
                "{}\n[admin]\ntoken = {token:?}\n",
                process_config(amqp, admin, 1)
            ),
        );
        let process = ServiceProcess::start(binary, dir.path(), &config, amqp, admin).await;
        let conn = Connection::connect(
            &format!("amqp://guest:guest@{amqp}/%2f"),
            ConnectionProperties::default(),
        )
        .await
        .expect("connect");
        let ch = conn.create_channel().await.expect("channel");
        TokenService {
            dir,
            config,
            process,
            conn,
            ch,
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Helpers for the dead-letter suites (`tests/dead_letter_*.rs`): queue counts from the broker's
/// state, declare/publish/get shortcuts named after the upstream RabbitMQ suite's helpers, and
/// strict decoding of the headers a dead-lettered message carries. `tests/proxy_support`
/// re-exports the ones that do not need the embedded broker (values, tables, declares).
pub mod dl {
    use super::TestBroker;
    use std::time::Duration;

    pub use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
    pub use lapin::message::Delivery;
    pub use lapin::options::*;
    pub use lapin::{BasicProperties, Channel, Confirmation, Consumer, ExchangeKind};

    use futures_util::StreamExt;

    /// A longstr value.
    pub fn ls(text: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(text))
    }

    /// A signed 32-bit integer value (what most clients send for x-arguments).
    pub fn int(n: i32) -> AMQPValue {
        AMQPValue::LongInt(n)
    }

    /// An array of longstr values (CC / BCC headers).
    pub fn ls_array(items: &[&str]) -> AMQPValue {
        AMQPValue::FieldArray(FieldArray::from(
            items.iter().map(|s| ls(s)).collect::<Vec<_>>(),
        ))
    }

    /// A field table from pairs.
    pub fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    /// Queue arguments that dead-letter to `queue` through the default exchange
    /// (`x-dead-letter-exchange = ""`, `x-dead-letter-routing-key = queue`), plus `extra`.
    pub fn dead_letter_to(queue: &str, extra: &[(&str, AMQPValue)]) -> FieldTable {
        let mut args = vec![
            ("x-dead-letter-exchange", ls("")),
            ("x-dead-letter-routing-key", ls(queue)),
        ];
        args.extend(extra.iter().cloned());
        table(&args)
    }

    /// Queue arguments that dead-letter through the default exchange with the message's own
    /// routing key (`x-dead-letter-exchange = ""`), plus `extra`: a message published to the
    /// queue by name comes back to it.
    pub fn self_loop(extra: &[(&str, AMQPValue)]) -> FieldTable {
        let mut args = vec![("x-dead-letter-exchange", ls(""))];
        args.extend(extra.iter().cloned());
        table(&args)
    }

    /// Wall clock, seconds.
    pub fn now_secs() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// The reply code of a lapin protocol error.
    pub fn amqp_code(err: &lapin::Error) -> Option<u16> {
        match err.kind() {
            lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
            _ => None,
        }
    }

    /// Publishes one `x` body on a channel in confirm mode and returns the error that ends it:
    /// the publish failing at once, or the channel closing before a confirm arrives. Panics
    /// when the publish is confirmed instead.
    pub async fn publish_refused(
        ch: &Channel,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
    ) -> lapin::Error {
        let publish = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                b"x",
                properties,
            )
            .await;
        match publish {
            Ok(confirm) => match confirm.await {
                Ok(answer) => panic!("publish to {exchange:?}/{routing_key:?} got {answer:?}"),
                Err(e) => e,
            },
            Err(e) => e,
        }
    }

    /// The reason the broker closed a channel, when `e` only says that the channel was found
    /// closed: lapin reports a channel.close that arrived between two calls that way, while a
    /// client library such as pika reports the broker's reply. `events` must have been taken
    /// from the connection (`events_listener`) before the close.
    pub async fn broker_close(
        events: &mut (impl futures_util::Stream<Item = lapin::Event> + Unpin),
        e: lapin::Error,
    ) -> lapin::Error {
        if !matches!(e.kind(), lapin::ErrorKind::InvalidChannelState(..)) {
            return e;
        }
        let end = tokio::time::Instant::now() + Duration::from_secs(1);
        while let Ok(Some(event)) = tokio::time::timeout_at(end, events.next()).await {
            if let lapin::Event::Error(reason) = event
                && matches!(reason.kind(), lapin::ErrorKind::ProtocolError(_))
            {
                return reason;
            }
        }
        e
    }

    /// The reply text of a lapin protocol error.
    pub fn amqp_text(err: &lapin::Error) -> String {
        match err.kind() {
            lapin::ErrorKind::ProtocolError(e) => e.get_message().as_str().to_string(),
            other => format!("{other:?}"),
        }
    }

    impl TestBroker {
        /// (ready, unacked) of a queue in vhost "/", read from the broker's state.
        pub fn queue_counts(&self, queue: &str) -> Option<(usize, usize)> {
            self.queue_counts_in("/", queue)
        }

        pub fn queue_counts_in(&self, vhost: &str, queue: &str) -> Option<(usize, usize)> {
            let broker = self.service.broker.as_ref()?;
            let st = broker.lock();
            let q = st.vhosts.get(vhost)?.queues.get(queue)?;
            Some((q.state.len(), q.unacked))
        }

        /// The upstream suite's `wait_for_messages`: polls until the queue has `ready` ready
        /// and `unacked` unacknowledged messages (total = ready + unacked), or panics.
        pub async fn wait_counts(&self, queue: &str, ready: usize, unacked: usize) {
            let ok = super::eventually(|| self.queue_counts(queue) == Some((ready, unacked))).await;
            assert!(
                ok,
                "queue {queue}: expected (ready, unacked) = ({ready}, {unacked}), got {:?}",
                self.queue_counts(queue)
            );
        }

        /// Asserts the counts stay as given for `ms` milliseconds.
        pub async fn stays_counts(&self, queue: &str, ready: usize, unacked: usize, ms: u64) {
            let until = tokio::time::Instant::now() + Duration::from_millis(ms);
            while tokio::time::Instant::now() < until {
                assert_eq!(self.queue_counts(queue), Some((ready, unacked)), "{queue}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }

        /// `dlx_proxy_dead_lettered_total{vhost="/",queue,reason}` (0 when absent).
        pub fn dead_lettered(&self, queue: &str, reason: &str) -> u64 {
            self.counter("dlx_proxy_dead_lettered_total", queue, "reason", reason)
        }

        /// `dlx_proxy_dead_letter_dropped_total{vhost="/",queue,cause}` (0 when absent).
        pub fn dropped(&self, queue: &str, cause: &str) -> u64 {
            self.counter("dlx_proxy_dead_letter_dropped_total", queue, "cause", cause)
        }

        fn counter(&self, name: &str, queue: &str, label: &str, value: &str) -> u64 {
            // The text format lists labels sorted by name.
            let mut labels = [(label, value), ("queue", queue), ("vhost", "/")];
            labels.sort_by_key(|(name, _)| *name);
            let series = super::series(name, &labels);
            super::metric_value(&self.metrics_text(), &series).unwrap_or(0.0) as u64
        }

        /// Polls until a counter reaches `value`, or panics.
        pub async fn wait_dead_lettered(&self, queue: &str, reason: &str, value: u64) {
            let ok = super::eventually(|| self.dead_lettered(queue, reason) == value).await;
            assert!(
                ok,
                "dead_lettered_total{{queue={queue},reason={reason}}}: expected {value}, got {}",
                self.dead_lettered(queue, reason)
            );
        }
    }

    pub async fn declare(ch: &Channel, queue: &str, args: FieldTable) {
        declare_with(ch, queue, QueueDeclareOptions::default(), args).await;
    }

    /// A durable queue (quorum queues must be durable).
    pub async fn declare_durable(ch: &Channel, queue: &str, args: FieldTable) {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        declare_with(ch, queue, durable, args).await;
    }

    /// queue.declare with these options; panics naming the queue when it fails.
    pub async fn declare_with(
        ch: &Channel,
        queue: &str,
        options: QueueDeclareOptions,
        args: FieldTable,
    ) {
        ch.queue_declare(queue.into(), options, args)
            .await
            .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
    }

    /// A passive queue.declare: the queue's counts, or the broker's refusal (404 when it
    /// does not exist).
    pub async fn passive_declare(ch: &Channel, queue: &str) -> Result<lapin::Queue, lapin::Error> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        ch.queue_declare(queue.into(), passive, FieldTable::default())
            .await
    }

    /// The messages ready in a queue (a passive declare).
    pub async fn message_count(ch: &Channel, queue: &str) -> u32 {
        passive_declare(ch, queue)
            .await
            .unwrap_or_else(|e| panic!("passive declare {queue}: {e}"))
            .message_count()
    }

    pub async fn try_declare(
        ch: &Channel,
        queue: &str,
        args: FieldTable,
    ) -> Result<lapin::Queue, lapin::Error> {
        ch.queue_declare(queue.into(), QueueDeclareOptions::default(), args)
            .await
    }

    pub async fn exchange(ch: &Channel, name: &str, kind: ExchangeKind) {
        let options = ExchangeDeclareOptions::default();
        exchange_with(ch, name, kind, options, FieldTable::default()).await;
    }

    /// exchange.declare with these options and arguments; panics naming the exchange when it
    /// fails.
    pub async fn exchange_with(
        ch: &Channel,
        name: &str,
        kind: ExchangeKind,
        options: ExchangeDeclareOptions,
        args: FieldTable,
    ) {
        ch.exchange_declare(name.into(), kind, options, args)
            .await
            .unwrap_or_else(|e| panic!("exchange.declare {name}: {e}"));
    }

    /// exchange.bind: `source` routes to `destination` by `key`.
    pub async fn exchange_bind(ch: &Channel, destination: &str, source: &str, key: &str) {
        ch.exchange_bind(
            destination.into(),
            source.into(),
            key.into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("exchange.bind {destination} {source} {key}: {e}"));
    }

    /// queue.unbind of the binding `exchange` → `queue` by `key`.
    pub async fn unbind(ch: &Channel, queue: &str, exchange: &str, key: &str) {
        ch.queue_unbind(
            queue.into(),
            exchange.into(),
            key.into(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("queue.unbind {queue} {exchange} {key}: {e}"));
    }

    pub async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str) {
        bind_with(ch, queue, exchange, key, FieldTable::default()).await;
    }

    pub async fn bind_with(ch: &Channel, queue: &str, exchange: &str, key: &str, args: FieldTable) {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            args,
        )
        .await
        .unwrap_or_else(|e| panic!("queue.bind {queue} {exchange} {key}: {e}"));
    }

    /// A round trip on the channel: the server has handled every method sent before it (a
    /// passive declare of amq.direct, which always exists and needs no permission).
    pub async fn sync(ch: &Channel) {
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        exchange_with(
            ch,
            "amq.direct",
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await;
    }

    /// Puts the channel in confirm mode.
    pub async fn confirm_select(ch: &Channel) {
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm.select");
    }

    /// Publishes through `exchange`; returns the confirmation (`NotRequested` without
    /// confirms). Returns only once the broker has handled the publish.
    pub async fn publish_to(
        ch: &Channel,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Confirmation {
        let confirmation = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirmation");
        if matches!(confirmation, Confirmation::NotRequested) {
            sync(ch).await;
        }
        confirmation
    }

    /// The upstream `publish(Ch, Q, Payloads)`: default exchange, routing key Q, no properties.
    pub async fn publish(ch: &Channel, queue: &str, payloads: &[&str]) {
        for p in payloads {
            publish_to(ch, "", queue, p.as_bytes(), BasicProperties::default()).await;
        }
    }

    /// The same with the `headers` property.
    pub async fn publish_headers(ch: &Channel, queue: &str, payload: &str, headers: FieldTable) {
        publish_to(
            ch,
            "",
            queue,
            payload.as_bytes(),
            BasicProperties::default().with_headers(headers),
        )
        .await;
    }

    /// basic.get with no_ack = false.
    pub async fn get(ch: &Channel, queue: &str) -> Option<Delivery> {
        ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
            .map(|m| m.delivery)
    }

    /// basic.get that must return a message.
    pub async fn get_one(ch: &Channel, queue: &str) -> Delivery {
        get(ch, queue)
            .await
            .unwrap_or_else(|| panic!("basic.get {queue}: get-empty"))
    }

    pub fn payload(d: &Delivery) -> String {
        String::from_utf8_lossy(&d.data).into_owned()
    }

    /// The upstream `consume(Ch, Q, Payloads)`: one basic.get per payload, order asserted;
    /// returns the delivery tags.
    pub async fn consume(ch: &Channel, queue: &str, payloads: &[&str]) -> Vec<u64> {
        let mut tags = Vec::new();
        for p in payloads {
            let d = get_one(ch, queue).await;
            assert_eq!(payload(&d), *p, "payload order in {queue}");
            tags.push(d.delivery_tag);
        }
        tags
    }

    /// The upstream `consume_empty(Ch, Q)`.
    pub async fn consume_empty(ch: &Channel, queue: &str) {
        if let Some(d) = get(ch, queue).await {
            panic!("{queue}: expected get-empty, got {:?}", payload(&d));
        }
    }

    /// The upstream `[DTag] = consume(Ch, Q, [P])` then `basic.reject` without requeue: takes
    /// the next message of `queue`, which must be `payload`, and rejects it.
    pub async fn get_and_reject(ch: &Channel, queue: &str, payload: &str) {
        let tag = consume(ch, queue, &[payload]).await[0];
        reject(ch, tag, false).await;
    }

    /// The same with `basic.nack` (not multiple, no requeue).
    pub async fn get_and_nack(ch: &Channel, queue: &str, payload: &str) {
        let tag = consume(ch, queue, &[payload]).await[0];
        nack(ch, tag, false, false).await;
    }

    /// basic.nack; returns once the broker handled it (as do `reject` and `ack`).
    pub async fn nack(ch: &Channel, tag: u64, multiple: bool, requeue: bool) {
        ch.basic_nack(tag, BasicNackOptions { multiple, requeue })
            .await
            .expect("nack");
        sync(ch).await;
    }

    pub async fn reject(ch: &Channel, tag: u64, requeue: bool) {
        ch.basic_reject(tag, BasicRejectOptions { requeue })
            .await
            .expect("reject");
        sync(ch).await;
    }

    pub async fn ack(ch: &Channel, tag: u64, multiple: bool) {
        ch.basic_ack(tag, BasicAckOptions { multiple })
            .await
            .expect("ack");
        sync(ch).await;
    }

    /// A direct exchange `dlx` and a queue `dlq` bound to it with routing key `dlq`.
    pub async fn declare_dlx(ch: &Channel, dlx: &str, dlq: &str) {
        exchange(ch, dlx, ExchangeKind::Direct).await;
        declare(ch, dlq, FieldTable::default()).await;
        bind(ch, dlq, dlx, dlq).await;
    }

    /// `queue` dead-lettering to exchange `dlx` with routing key `dlk`.
    pub async fn declare_dead_lettering(ch: &Channel, queue: &str, dlx: &str, dlk: &str) {
        let args = [
            ("x-dead-letter-exchange", ls(dlx)),
            ("x-dead-letter-routing-key", ls(dlk)),
        ];
        declare(ch, queue, table(&args)).await;
    }

    /// The upstream `declare_dead_letter_queues(Q, DLQ, Extra)`: a direct DLX named after the
    /// test, Q with `x-dead-letter-exchange = DLX`, `x-dead-letter-routing-key = DLQ` plus
    /// `extra`, DLQ without arguments, bound to the DLX with key DLQ. Returns the DLX name.
    pub async fn declare_dead_letter_queues(
        ch: &Channel,
        queue: &str,
        dlq: &str,
        extra: &[(&str, AMQPValue)],
    ) -> String {
        let dlx = format!("{queue}_dlx_exchange");
        exchange(ch, &dlx, ExchangeKind::Direct).await;
        let mut args = vec![
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(dlq)),
        ];
        args.extend(extra.iter().cloned());
        declare(ch, queue, table(&args)).await;
        declare(ch, dlq, FieldTable::default()).await;
        bind(ch, dlq, &dlx, dlq).await;
        dlx
    }

    pub async fn consumer(ch: &Channel, queue: &str, tag: &str) -> Consumer {
        try_consumer(ch, queue, tag)
            .await
            .unwrap_or_else(|e| panic!("basic.consume {queue}: {e}"))
    }

    /// Starts consumer `tag` on `queue`, or the error the server answered (lapin cancels the
    /// consumer when the returned one is dropped).
    pub async fn try_consumer(ch: &Channel, queue: &str, tag: &str) -> lapin::Result<Consumer> {
        ch.basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    }

    /// The next delivery (5 s at most).
    pub async fn next(consumer: &mut Consumer) -> Delivery {
        tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .expect("a delivery in time")
            .expect("consumer open")
            .expect("delivery ok")
    }

    /// Asserts that nothing is delivered for `ms` milliseconds.
    pub async fn no_delivery(consumer: &mut Consumer, ms: u64) {
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(ms), consumer.next()).await
        {
            panic!("unexpected delivery: {:?}", d.map(|d| payload(&d)));
        }
    }

    /// A header of a delivery.
    pub fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
        d.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }

    /// Header names, in wire order.
    pub fn header_names(d: &Delivery) -> Vec<String> {
        d.properties
            .headers()
            .as_ref()
            .map(|h| h.inner().keys().map(|k| k.as_str().to_string()).collect())
            .unwrap_or_default()
    }

    /// A longstr value's text; panics on any other type.
    pub fn longstr(v: &AMQPValue) -> String {
        match v {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("expected a longstr, got {other:?}"),
        }
    }

    /// A longstr header's text (panics when absent or of another type).
    pub fn header_str(d: &Delivery, name: &str) -> String {
        longstr(header(d, name).unwrap_or_else(|| panic!("header {name} missing")))
    }

    /// One x-death entry, decoded after its field types were checked.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Death {
        pub queue: String,
        pub reason: String,
        pub exchange: String,
        pub routing_keys: Vec<String>,
        pub count: i64,
        pub time: u64,
        pub original_expiration: Option<String>,
    }

    impl Death {
        /// (queue, reason, count): the usual comparison.
        pub fn qrc(&self) -> (&str, &str, i64) {
            (&self.queue, &self.reason, self.count)
        }
    }

    /// The x-death header, strictly: a FieldArray of FieldTables, each with exactly `count`
    /// (LongLongInt), `reason`/`queue`/`exchange` (LongString), `time` (Timestamp, seconds,
    /// within 60 s of now), `routing-keys` (FieldArray of LongString) and, optionally,
    /// `original-expiration` (LongString). Newest first. Panics when absent or mistyped.
    pub fn x_death(d: &Delivery) -> Vec<Death> {
        let value = header(d, "x-death").expect("x-death header");
        let AMQPValue::FieldArray(entries) = value else {
            panic!("x-death is not a field array: {value:?}");
        };
        let now = now_secs();
        entries
            .as_slice()
            .iter()
            .map(|e| {
                let AMQPValue::FieldTable(t) = e else {
                    panic!("x-death element is not a table: {e:?}");
                };
                let f = t.inner();
                for k in f.keys() {
                    assert!(
                        [
                            "count",
                            "reason",
                            "queue",
                            "time",
                            "exchange",
                            "routing-keys",
                            "original-expiration"
                        ]
                        .contains(&k.as_str()),
                        "unexpected x-death field {k:?}"
                    );
                }
                let count = match f.get("count") {
                    Some(AMQPValue::LongLongInt(n)) => *n,
                    other => panic!("count must be LongLongInt, got {other:?}"),
                };
                let time = match f.get("time") {
                    Some(AMQPValue::Timestamp(t)) => *t,
                    other => panic!("time must be Timestamp, got {other:?}"),
                };
                assert!(
                    time.abs_diff(now) <= 60,
                    "time {time} is not within 60 s of now ({now}): seconds expected"
                );
                let routing_keys = match f.get("routing-keys") {
                    Some(AMQPValue::FieldArray(a)) => a.as_slice().iter().map(longstr).collect(),
                    other => panic!("routing-keys must be a FieldArray, got {other:?}"),
                };
                let s = |k: &str| longstr(f.get(k).unwrap_or_else(|| panic!("x-death.{k}")));
                Death {
                    queue: s("queue"),
                    reason: s("reason"),
                    exchange: s("exchange"),
                    routing_keys,
                    count,
                    time,
                    original_expiration: f.get("original-expiration").map(longstr),
                }
            })
            .collect()
    }

    /// Asserts the x-first-death-* headers (LongString).
    pub fn assert_first_death(d: &Delivery, reason: &str, queue: &str, exchange: &str) {
        assert_eq!(header_str(d, "x-first-death-reason"), reason);
        assert_eq!(header_str(d, "x-first-death-queue"), queue);
        assert_eq!(header_str(d, "x-first-death-exchange"), exchange);
    }
}

/// Policy helpers for the dead-letter suites (`tests/proxy_support` builds its `policy` on them).
pub mod dl_policy {
    use super::TestBroker;
    use dlx_proxy::admin::PolicyControl;
    use dlx_proxy::config::PolicyConfig;

    /// A policy on vhost "/" for queues whose name is exactly `queue`.
    pub fn exact(name: &str, queue: &str, definition: serde_json::Value) -> PolicyConfig {
        pattern(name, &format!("^{}$", regex::escape(queue)), 0, definition)
    }

    /// A policy on vhost "/" for queues matching `pattern`, with a priority.
    pub fn pattern(
        name: &str,
        pattern: &str,
        priority: i32,
        definition: serde_json::Value,
    ) -> PolicyConfig {
        let serde_json::Value::Object(map) = definition else {
            panic!("a policy definition is a JSON object");
        };
        PolicyConfig {
            name: name.into(),
            vhost: "/".into(),
            pattern: pattern.into(),
            apply_to: "queues".into(),
            priority,
            definition: map.into_iter().collect(),
        }
    }

    impl TestBroker {
        /// Sets a runtime policy (the admin API's path) and applies it to existing queues.
        pub fn set_policy(&self, policy: PolicyConfig) {
            self.service
                .policies
                .set_policy(policy)
                .unwrap_or_else(|e| panic!("set_policy: {e}"));
        }

        pub fn clear_policy(&self, name: &str) -> bool {
            self.service.policies.clear_policy("/", name)
        }
    }
}
