//! Shared test support: start the service in-process on free ports, connect lapin, and a
//! raw AMQP client for byte-level and malformed-input tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{FieldTable, LongString};
use bytes::BytesMut;
use dlx_proxy::amqp::codec::{FrameCodec, PROTOCOL_HEADER, RawFrame, decode_method};
use dlx_proxy::config::Config;
use dlx_proxy::service::{self, RunningService};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Decoder;

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

/// Test configuration: embedded mode on free ports, admin off.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.listen.amqp = "127.0.0.1:0".into();
    c.listen.admin = String::new();
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

/// A unique name for queues and exchanges of one test.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}.{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Waits for a condition with a bounded poll.
pub async fn eventually<F: FnMut() -> bool>(mut f: F) -> bool {
    for _ in 0..300 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The value of a Prometheus sample line `name{labels} value` in the text format.
pub fn metric_value(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A raw AMQP client speaking frames directly, for malformed input and byte checks.
pub struct RawClient {
    pub stream: TcpStream,
    codec: FrameCodec,
    buf: BytesMut,
}

pub fn encode_method(channel: u16, m: AMQPClass) -> Vec<u8> {
    let f = AMQPFrame::Method(channel, m);
    gen_frame(&f)(WriteContext::from(Vec::new()))
        .expect("encode")
        .write
}

impl RawClient {
    /// Connects and completes the handshake as guest on vhost "/".
    pub async fn connect(addr: SocketAddr) -> RawClient {
        let mut c = Self::connect_no_handshake(addr).await;
        c.stream.write_all(&PROTOCOL_HEADER).await.expect("header");
        let start = c.read_method().await;
        assert!(matches!(
            start,
            AMQPClass::Connection(connection::AMQPMethod::Start(_))
        ));
        c.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            })),
        )
        .await;
        let tune = c.read_method().await;
        let AMQPClass::Connection(connection::AMQPMethod::Tune(t)) = tune else {
            panic!("expected tune, got {tune:?}");
        };
        c.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: t.channel_max,
                frame_max: t.frame_max,
                heartbeat: 0,
            })),
        )
        .await;
        c.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        )
        .await;
        let ok = c.read_method().await;
        assert!(matches!(
            ok,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
        ));
        c
    }

    pub async fn connect_no_handshake(addr: SocketAddr) -> RawClient {
        RawClient {
            stream: TcpStream::connect(addr).await.expect("tcp"),
            codec: FrameCodec::new(1 << 20),
            buf: BytesMut::new(),
        }
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    pub async fn send_method(&mut self, channel: u16, m: AMQPClass) {
        let b = encode_method(channel, m);
        self.send_raw(&b).await;
    }

    /// Next frame (skipping heartbeats), or None at EOF / timeout.
    pub async fn read_frame(&mut self) -> Option<RawFrame> {
        loop {
            if let Ok(Some(f)) = self.codec.decode(&mut self.buf) {
                if f.kind == 8 {
                    continue;
                }
                return Some(f);
            }
            let mut tmp = [0u8; 65536];
            let n = tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut tmp))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&tmp[..n]);
        }
    }

    pub async fn read_method(&mut self) -> AMQPClass {
        let f = self.read_frame().await.expect("a frame");
        assert_eq!(f.kind, 1, "expected a method frame, got {f:?}");
        decode_method(&f.payload).expect("decodable method")
    }

    /// Reads raw bytes until EOF (or 5 s).
    pub async fn read_to_end(&mut self) -> Vec<u8> {
        let mut out = self.buf.to_vec();
        let mut tmp = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut tmp)).await {
                Ok(Ok(0)) | Err(_) | Ok(Err(_)) => return out,
                Ok(Ok(n)) => out.extend_from_slice(&tmp[..n]),
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Operations tests: free ports, admin HTTP, and the real binary as a child process
// ------------------------------------------------------------------------------------------

/// A TCP port on 127.0.0.1 that was free a moment ago (bound, then released), for
/// configuration files of a child process where `:0` could not be discovered.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// One HTTP/1.1 request to the admin server: (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let (method, path) = (method.to_string(), path.to_string());
    tokio::task::spawn_blocking(move || {
        dlx_proxy::admin::request(
            &addr.to_string(),
            &method,
            &path,
            None,
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

/// Polls `/metrics` until `name_and_labels` has `value` (or 5 s pass); returns the last text.
pub async fn wait_metric(admin: SocketAddr, name_and_labels: &str, value: f64) -> String {
    let mut text = String::new();
    for _ in 0..100 {
        text = scrape(admin).await;
        if metric_value(&text, name_and_labels) == Some(value) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{name_and_labels} never reached {value} (last: {:?}):\n{text}",
        metric_value(&text, name_and_labels)
    );
}

/// A scratch directory removed on drop.
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

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
