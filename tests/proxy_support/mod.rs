//! Shared helpers for the proxy-mode integration tests: start a proxy in-process in front of
//! the reference RabbitMQ, talk to it with lapin, read the upstream directly, read metrics.
//!
//! RabbitMQ is expected at amqp://guest:guest@127.0.0.1:5673/%2f (`.ci/rabbitmq.sh start`).
//! When it is not reachable a test prints "skipping: …" and passes, unless `CI` is set, in
//! which case it fails.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlx_proxy::config::{Config, Mode, PolicyConfig};
use dlx_proxy::metrics::Metrics;
use dlx_proxy::policy::PolicySet;
use dlx_proxy::proxy::{ProxyShared, serve};
use dlx_proxy::shutdown::ShutdownTrigger;
use lapin::message::{Delivery, DeliveryResult};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::mpsc;

/// Where the reference RabbitMQ listens.
pub const UPSTREAM_HOST: &str = "127.0.0.1:5673";
pub const UPSTREAM_URI: &str = "amqp://guest:guest@127.0.0.1:5673/%2f";

/// Whether the upstream is reachable; prints a skip note (or panics under CI) when not.
pub async fn upstream_available() -> bool {
    let reachable = matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(UPSTREAM_HOST)
        )
        .await,
        Ok(Ok(_))
    );
    if !reachable {
        if std::env::var_os("CI").is_some() {
            panic!(
                "RabbitMQ not reachable at {UPSTREAM_HOST} (start it with .ci/rabbitmq.sh start)"
            );
        }
        eprintln!("skipping: RabbitMQ not reachable at {UPSTREAM_HOST}");
    }
    reachable
}

/// Returns from the test when RabbitMQ is not there.
#[macro_export]
macro_rules! require_upstream {
    () => {
        if !proxy_support::upstream_available().await {
            return;
        }
    };
}

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros();
    format!("t-{prefix}-{}-{t}-{n}", std::process::id())
}

/// A policy for `pattern` (anchored) in vhost "/".
pub fn policy(name: &str, pattern: &str, definition: serde_json::Value) -> PolicyConfig {
    let serde_json::Value::Object(map) = definition else {
        panic!("definition must be an object");
    };
    PolicyConfig {
        name: name.into(),
        vhost: "/".into(),
        pattern: pattern.into(),
        apply_to: "queues".into(),
        priority: 0,
        definition: map.into_iter().collect(),
    }
}

/// A proxy running in this process.
pub struct TestProxy {
    pub addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    pub shared: Arc<ProxyShared>,
    pub capture: String,
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
        let mut config = Config {
            mode: Mode::Proxy,
            policies: policies.clone(),
            ..Config::default()
        };
        config.upstream.url = format!("amqp://{UPSTREAM_HOST}");
        config.proxy.confirm_timeout_secs = 5;
        tweak(&mut config);
        let set = PolicySet::from_configs(&config.policies).expect("valid policies");
        let metrics = Metrics::new(1000);
        let capture = unique("capture");
        let shared = ProxyShared::with_capture_name(
            &config,
            Arc::new(RwLock::new(set)),
            metrics.clone(),
            &capture,
        )
        .expect("proxy settings");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let trigger = ShutdownTrigger::new();
        tokio::spawn(serve(listener, shared.clone(), trigger.subscribe()));
        TestProxy {
            addr,
            metrics,
            shared,
            capture,
            trigger,
        }
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
        let wanted = if labels.is_empty() {
            format!("dlx_proxy_{name} ")
        } else {
            let inner: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            format!("dlx_proxy_{name}{{{}}} ", inner.join(","))
        };
        self.metrics
            .encode()
            .lines()
            .find_map(|line| {
                line.strip_prefix(&wanted)
                    .map(|v| v.trim().parse().unwrap_or(0.0))
            })
            .unwrap_or(0.0)
    }

    /// Polls `counter` until it reaches `value`.
    pub async fn wait_counter(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let now = self.counter(name, labels);
            if now >= value {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "counter {name}{labels:?} is {now}, expected {value}\n{}",
                    self.metrics.encode()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Fires the service's shutdown signal (connections are closed with 320).
    pub fn trigger_shutdown(&self) {
        self.trigger.trigger();
    }

    /// Stops accepting connections and removes the capture exchange and queue.
    pub async fn stop(self) {
        self.trigger.trigger();
        if let Ok(conn) = Connection::connect(UPSTREAM_URI, ConnectionProperties::default()).await
            && let Ok(ch) = conn.create_channel().await
        {
            let _ = ch
                .queue_delete(self.capture.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = ch
                .exchange_delete(self.capture.as_str().into(), Default::default())
                .await;
            let _ = conn.close(200, "done".into()).await;
        }
    }
}

/// A connection straight to RabbitMQ (to look behind the proxy).
pub async fn upstream_connection() -> Connection {
    Connection::connect(UPSTREAM_URI, ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ")
}

pub fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Declares a queue (not durable, not exclusive) with these arguments.
pub async fn declare(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap_or_else(|e| panic!("declare {name}: {e}"));
}

/// Declares a direct exchange and binds `queue` to it with `key`.
pub async fn declare_dlx(ch: &Channel, exchange: &str, queue: &str, key: &str) {
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    declare(ch, queue, FieldTable::default()).await;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// Polls basic.get (no auto-ack) until a message arrives.
pub async fn get(ch: &Channel, queue: &str) -> Delivery {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(message) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
        {
            return message.delivery;
        }
        if Instant::now() > deadline {
            panic!("no message in {queue}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// basic.get that expects an empty queue.
pub async fn assert_empty(ch: &Channel, queue: &str) {
    let got = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(
        got.is_none(),
        "{queue} should be empty, got {:?}",
        got.map(|m| String::from_utf8_lossy(&m.delivery.data).into_owned())
    );
}

/// The message count of a queue (passive declare).
pub async fn message_count(ch: &Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

/// Waits until a queue holds `count` messages.
pub async fn wait_count(ch: &Channel, queue: &str, count: u32) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = message_count(ch, queue).await;
        if now == count {
            return;
        }
        if Instant::now() > deadline {
            panic!("{queue} holds {now} messages, expected {count}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
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

pub fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

/// A header of a delivery.
pub fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(name))
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

/// Runs a rabbitmqctl command through the CI helper.
pub fn rabbitmqctl(args: &[&str]) -> std::process::Output {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/rabbitmq.sh");
    let script = if script.exists() {
        script
    } else {
        std::path::PathBuf::from("/work/main/.ci/rabbitmq.sh")
    };
    std::process::Command::new("bash")
        .arg(script)
        .arg("ctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl")
}

/// A minimal AMQP client on a raw socket, to see exactly which frames arrive.
pub struct RawClient {
    reader: dlx_proxy::proxy::wire::FrameReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

impl RawClient {
    /// Connects and completes the handshake as guest on vhost "/" (with a connection name,
    /// visible upstream as the `connection_name` client property).
    pub async fn connect(addr: SocketAddr, connection_name: &str) -> RawClient {
        use dlx_proxy::proxy::wire::{FrameReader, method_frame};
        use lapin::protocol::{AMQPClass, connection};
        use tokio::io::AsyncWriteExt;
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (read, mut writer) = stream.into_split();
        writer.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        let mut client = RawClient {
            reader: FrameReader::new(read, 131_072),
            writer,
        };
        client.expect_method(10, 10).await;
        let mut props = FieldTable::default();
        props.insert("connection_name".into(), long_string(connection_name));
        let start_ok =
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            }));
        client
            .writer
            .write_all(&method_frame(0, start_ok))
            .await
            .unwrap();
        let tune = client.expect_method(10, 30).await;
        let Some(AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) =
            dlx_proxy::amqp::codec::decode_method(&tune)
        else {
            panic!("bad tune");
        };
        let tune_ok = AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tune.channel_max,
            frame_max: tune.frame_max,
            heartbeat: 0,
        }));
        client
            .writer
            .write_all(&method_frame(0, tune_ok))
            .await
            .unwrap();
        let open = AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        }));
        client
            .writer
            .write_all(&method_frame(0, open))
            .await
            .unwrap();
        client.expect_method(10, 41).await;
        client
    }

    /// Reads frames until a method with these ids arrives; returns its payload.
    pub async fn expect_method(&mut self, class_id: u16, method_id: u16) -> bytes::Bytes {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(15), self.reader.next())
                .await
                .expect("frame within 15 s")
                .expect("connection open")
                .expect("valid frame");
            if frame.method_ids() == (class_id, method_id) {
                return frame.payload;
            }
        }
    }

    /// Writes raw bytes (frames built with `dlx_proxy::proxy::wire::method_frame`).
    pub async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.writer.write_all(bytes).await.unwrap();
    }

    /// The next method frame (other frames are skipped): its channel, ids and payload.
    pub async fn next_method(&mut self) -> (u16, (u16, u16), bytes::Bytes) {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(15), self.reader.next())
                .await
                .expect("frame within 15 s")
                .expect("connection open")
                .expect("valid frame");
            if frame.kind == dlx_proxy::amqp::codec::FRAME_METHOD {
                return (frame.channel, frame.method_ids(), frame.payload);
            }
        }
    }

    /// Waits for connection.close; returns its reply code and text.
    pub async fn expect_connection_close(&mut self) -> (u16, String) {
        use lapin::protocol::{AMQPClass, connection};
        let payload = self.expect_method(10, 50).await;
        match dlx_proxy::amqp::codec::decode_method(&payload) {
            Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                (close.reply_code, close.reply_text.as_str().to_string())
            }
            _ => panic!("bad connection.close"),
        }
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

/// Where the reference RabbitMQ listens with TLS (`.ci/rabbitmq.sh start` opens it).
pub const UPSTREAM_TLS_PORT: u16 = 5674;

/// The directory `.ci/rabbitmq.sh start` writes the TLS files to: `$DLX_RABBITMQ_TLS_DIR`, by
/// default `/tmp/dlx-ci-rabbitmq-tls`. `ca.pem` in it signed the listener's certificate
/// (subjectAltName `localhost` and `127.0.0.1`).
pub fn upstream_tls_dir() -> std::path::PathBuf {
    std::env::var_os("DLX_RABBITMQ_TLS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp/dlx-ci-rabbitmq-tls"))
}

/// The CA file of the amqps listener when the listener is up; prints a skip note (or panics
/// under CI, like [`upstream_available`]) when the CA file or the listener is missing.
pub async fn upstream_tls_ca() -> Option<std::path::PathBuf> {
    let ca = upstream_tls_dir().join("ca.pem");
    let problem = if !ca.is_file() {
        Some(format!("no CA file at {}", ca.display()))
    } else {
        let listening = matches!(
            tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect(("127.0.0.1", UPSTREAM_TLS_PORT))
            )
            .await,
            Ok(Ok(_))
        );
        (!listening).then(|| format!("nothing listens on 127.0.0.1:{UPSTREAM_TLS_PORT}"))
    };
    match problem {
        None => Some(ca),
        Some(problem) => {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "RabbitMQ's amqps listener is not usable: {problem} \
                     (restart it with .ci/rabbitmq.sh stop && .ci/rabbitmq.sh start)"
                );
            }
            eprintln!("skipping: RabbitMQ's amqps listener is not usable: {problem}");
            None
        }
    }
}

/// Returns from the test when RabbitMQ's amqps listener is not there; otherwise evaluates to
/// the path of its CA file.
#[macro_export]
macro_rules! require_upstream_tls {
    () => {
        match proxy_support::upstream_tls_ca().await {
            Some(ca) => ca,
            None => return,
        }
    };
}

// ------------------------------------------------------------------------------------------
// Raw client: a small receive buffer, and whole deliveries
// ------------------------------------------------------------------------------------------

/// One delivery read by [`RawClient::next_delivery`].
#[derive(Debug)]
pub struct RawDelivery {
    pub channel: u16,
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub body: Vec<u8>,
}

impl RawClient {
    /// Like [`RawClient::connect`], with the socket's receive buffer set to `receive_buffer`
    /// bytes before it connects, so that the kernel holds little of what the proxy sends while
    /// the test does not read.
    pub async fn connect_with_receive_buffer(
        addr: SocketAddr,
        connection_name: &str,
        receive_buffer: u32,
    ) -> RawClient {
        use tokio::io::AsyncWriteExt;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(receive_buffer).unwrap();
        let stream = socket.connect(addr).await.unwrap();
        let (read, mut writer) = stream.into_split();
        writer.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        let mut client = RawClient {
            reader: dlx_proxy::proxy::wire::FrameReader::new(read, 131_072),
            writer,
        };
        client.finish_handshake(connection_name).await;
        client
    }

    /// start-ok as guest, tune-ok with the offered limits and no heartbeats, open "/".
    async fn finish_handshake(&mut self, connection_name: &str) {
        use dlx_proxy::proxy::wire::method_frame;
        use lapin::protocol::{AMQPClass, connection};
        self.expect_method(10, 10).await;
        let mut props = FieldTable::default();
        props.insert("connection_name".into(), long_string(connection_name));
        let start_ok =
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            }));
        self.send(&method_frame(0, start_ok)).await;
        let tune = self.expect_method(10, 30).await;
        let Some(AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) =
            dlx_proxy::amqp::codec::decode_method(&tune)
        else {
            panic!("bad tune");
        };
        let tune_ok = AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tune.channel_max,
            frame_max: tune.frame_max,
            heartbeat: 0,
        }));
        self.send(&method_frame(0, tune_ok)).await;
        let open = AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        }));
        self.send(&method_frame(0, open)).await;
        self.expect_method(10, 41).await;
    }

    /// The next frame of any kind (panics after 15 s or at the end of the stream).
    pub async fn next_frame(&mut self) -> dlx_proxy::proxy::wire::WireFrame {
        tokio::time::timeout(Duration::from_secs(15), self.reader.next())
            .await
            .expect("frame within 15 s")
            .expect("connection open")
            .expect("valid frame")
    }

    /// Opens channel `channel` and waits for open-ok.
    pub async fn open_channel(&mut self, channel: u16) {
        use dlx_proxy::proxy::wire::method_frame;
        use lapin::protocol::{AMQPClass, channel as channel_class};
        let open = AMQPClass::Channel(channel_class::AMQPMethod::Open(channel_class::Open {}));
        self.send(&method_frame(channel, open)).await;
        self.expect_method(20, 11).await;
    }

    /// Starts a consumer on `queue` (server-named tag) and waits for consume-ok.
    pub async fn consume(&mut self, channel: u16, queue: &str, no_ack: bool) {
        use dlx_proxy::proxy::wire::method_frame;
        use lapin::protocol::{AMQPClass, basic};
        let consume = AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: ShortString::try_new(queue).unwrap(),
            consumer_tag: "".into(),
            no_local: false,
            no_ack,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        }));
        self.send(&method_frame(channel, consume)).await;
        self.expect_method(60, 21).await;
    }

    /// Sends basic.ack.
    pub async fn ack(&mut self, channel: u16, delivery_tag: u64, multiple: bool) {
        use dlx_proxy::proxy::wire::method_frame;
        use lapin::protocol::{AMQPClass, basic};
        let ack = AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        }));
        self.send(&method_frame(channel, ack)).await;
    }

    /// Reads the next basic.deliver with its content (panics on any other method).
    pub async fn next_delivery(&mut self) -> RawDelivery {
        use dlx_proxy::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD};
        use lapin::protocol::{AMQPClass, basic};
        let deliver = loop {
            let frame = self.next_frame().await;
            if frame.kind != FRAME_METHOD {
                assert!(
                    frame.is_heartbeat(),
                    "content outside a delivery: {frame:?}"
                );
                continue;
            }
            match dlx_proxy::amqp::codec::decode_method(&frame.payload) {
                Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => break (frame.channel, d),
                other => panic!("expected basic.deliver, got {other:?}"),
            }
        };
        let (channel, deliver) = deliver;
        let header = self.next_frame().await;
        assert_eq!(header.kind, FRAME_HEADER, "content header after deliver");
        let size = dlx_proxy::proxy::wire::content_body_size(&header.payload).unwrap() as usize;
        let mut body = Vec::with_capacity(size);
        while body.len() < size {
            let frame = self.next_frame().await;
            assert_eq!(frame.kind, FRAME_BODY, "content body");
            body.extend_from_slice(&frame.payload);
        }
        RawDelivery {
            channel,
            delivery_tag: deliver.delivery_tag,
            redelivered: deliver.redelivered,
            body,
        }
    }
}
