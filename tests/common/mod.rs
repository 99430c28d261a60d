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
