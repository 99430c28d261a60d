//! A raw AMQP 0-9-1 client on a plain socket, for the tests that must see or send exact
//! frames: malformed and unusual input, byte-for-byte replies, which frames arrive in which
//! order, and a consumer that stops reading its socket. Used against the embedded broker and
//! through the proxy alike; lapin is the client everywhere else.
//!
//! Methods it sends are encoded with amq-protocol, not with the crate under test. Replies are
//! split into frames with the crate's [`WireCodec`] (so a frame above 131072 bytes, the
//! `frame_max` both servers offer and this client accepts, is an error).

use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, basic, channel, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::{Bytes, BytesMut};
use dlx_proxy::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_METHOD, PROTOCOL_HEADER, decode_method,
};
use dlx_proxy::proxy::wire::{WireCodec, WireFrame, content_body_size};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Decoder;

/// The largest frame the client reads.
const FRAME_MAX: u32 = 131_072;
/// How long the client waits for the next frame.
const FRAME_WAIT: Duration = Duration::from_secs(15);
/// How long [`RawClient::read_to_end`] waits for more bytes.
const BYTES_WAIT: Duration = Duration::from_secs(5);

/// basic.publish, its content header with `properties` and the body in frames of at most
/// [`FRAME_MAX`] bytes, encoded (many of them can go out in one write).
pub fn encode_publish(
    channel: u16,
    exchange: &str,
    routing_key: &str,
    properties: amq_protocol::protocol::BasicProperties,
    body: &[u8],
) -> Vec<u8> {
    let mut bytes = encode_method(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: ShortString::try_new(exchange).expect("an exchange name"),
            routing_key: ShortString::try_new(routing_key).expect("a routing key"),
            mandatory: false,
            immediate: false,
        })),
    );
    bytes.extend(encode_frame(&AMQPFrame::Header(
        channel,
        AMQPContentHeader {
            class_id: 60,
            body_size: body.len() as u64,
            properties,
        },
    )));
    for chunk in body.chunks(FRAME_MAX as usize - 8) {
        bytes.extend(encode_frame(&AMQPFrame::Body(channel, chunk.to_vec())));
    }
    bytes
}

/// The encoded method frame (independent of the crate's own encoder).
pub fn encode_method(channel: u16, method: AMQPClass) -> Vec<u8> {
    encode_frame(&AMQPFrame::Method(channel, method))
}

fn encode_frame(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .expect("encode")
        .write
}

/// Client properties whose `capabilities` table sets each of `names` to true (as RabbitMQ's
/// clients announce `connection.blocked`).
pub fn capabilities(names: &[&str]) -> FieldTable {
    let mut capabilities = FieldTable::default();
    for name in names {
        capabilities.insert((*name).into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}

/// One delivery read by [`RawClient::next_delivery`].
#[derive(Debug)]
pub struct RawDelivery {
    pub channel: u16,
    pub delivery_tag: u64,
    pub redelivered: bool,
    /// The property flags and list exactly as received.
    pub properties: Bytes,
    pub body: Vec<u8>,
}

/// A client connection: the socket and the bytes read from it but not yet taken as frames.
pub struct RawClient {
    stream: TcpStream,
    codec: WireCodec,
    buffer: BytesMut,
}

impl RawClient {
    /// Connects and completes the handshake as guest on vhost "/", without client properties.
    pub async fn connect(addr: SocketAddr) -> RawClient {
        let mut client = Self::connect_no_handshake(addr).await;
        client.handshake(FieldTable::default(), None).await;
        client
    }

    /// Like [`RawClient::connect`], with a connection name (RabbitMQ shows it as the
    /// `connection_name` client property of the proxy's upstream connection).
    pub async fn connect_named(addr: SocketAddr, connection_name: &str) -> RawClient {
        let mut client = Self::connect_no_handshake(addr).await;
        client.handshake(named(connection_name), None).await;
        client
    }

    /// Like [`RawClient::connect_named`], with the socket's receive buffer set to
    /// `receive_buffer` bytes before it connects, so that the kernel holds little of what the
    /// server sends while the test does not read.
    pub async fn connect_with_receive_buffer(
        addr: SocketAddr,
        connection_name: &str,
        receive_buffer: u32,
    ) -> RawClient {
        Self::connect_with_receive_buffer_and_heartbeat(addr, connection_name, receive_buffer, 0)
            .await
    }

    /// [`RawClient::connect_with_receive_buffer`] with heartbeats every `heartbeat` seconds
    /// (the test sends none: a client that hangs).
    pub async fn connect_with_receive_buffer_and_heartbeat(
        addr: SocketAddr,
        connection_name: &str,
        receive_buffer: u32,
        heartbeat: u16,
    ) -> RawClient {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .set_recv_buffer_size(receive_buffer)
            .expect("receive buffer size");
        let mut client = Self::over(socket.connect(addr).await.expect("tcp"));
        client
            .handshake_with_heartbeat(named(connection_name), None, heartbeat)
            .await;
        client
    }

    /// Like [`RawClient::connect`], with these client properties (see [`capabilities`]).
    pub async fn connect_with_properties(
        addr: SocketAddr,
        client_properties: FieldTable,
    ) -> RawClient {
        let mut client = Self::connect_no_handshake(addr).await;
        client.handshake(client_properties, None).await;
        client
    }

    /// A TCP connection and nothing sent yet (not even the protocol header).
    pub async fn connect_no_handshake(addr: SocketAddr) -> RawClient {
        Self::over(TcpStream::connect(addr).await.expect("tcp"))
    }

    /// Completes the handshake as guest on vhost "/" over a socket connected elsewhere (from
    /// another network namespace, for instance).
    pub async fn connect_over(stream: TcpStream) -> RawClient {
        let mut client = Self::over(stream);
        client.handshake(FieldTable::default(), None).await;
        client
    }

    /// A client on a connected socket, nothing sent yet.
    pub fn over(stream: TcpStream) -> RawClient {
        RawClient {
            stream,
            codec: WireCodec::new(FRAME_MAX),
            buffer: BytesMut::new(),
        }
    }

    /// Like [`RawClient::connect`], asking for at most `channel_max` channels in tune-ok.
    pub async fn connect_with_channel_max(addr: SocketAddr, channel_max: u16) -> RawClient {
        let mut client = Self::connect_no_handshake(addr).await;
        client
            .handshake(FieldTable::default(), Some(channel_max))
            .await;
        client
    }

    /// Protocol header, start-ok (PLAIN, guest) with these client properties, tune-ok with
    /// the offered limits (or `channel_max`) and no heartbeats, open "/": each reply must be
    /// the next method.
    async fn handshake(&mut self, client_properties: FieldTable, channel_max: Option<u16>) {
        self.handshake_with_heartbeat(client_properties, channel_max, 0)
            .await;
    }

    /// [`RawClient::handshake`] asking for heartbeats every `heartbeat` seconds.
    async fn handshake_with_heartbeat(
        &mut self,
        client_properties: FieldTable,
        channel_max: Option<u16>,
        heartbeat: u16,
    ) {
        self.start_ok("PLAIN", b"\0guest\0guest", client_properties)
            .await;
        let tune = self.read_method().await;
        let AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) = tune else {
            panic!("expected connection.tune, got {tune:?}");
        };
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: channel_max.unwrap_or(tune.channel_max),
                frame_max: tune.frame_max,
                heartbeat,
            })),
        )
        .await;
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        )
        .await;
        let ok = self.read_method().await;
        assert!(
            matches!(ok, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))),
            "expected connection.open-ok, got {ok:?}"
        );
    }

    /// Protocol header, then (after connection.start) a start-ok with this mechanism, SASL
    /// response and client properties; what the server answers is the test's to read.
    pub async fn start_ok(
        &mut self,
        mechanism: &str,
        response: &[u8],
        client_properties: FieldTable,
    ) {
        self.send_raw(&PROTOCOL_HEADER).await;
        let start = self.read_method().await;
        assert!(
            matches!(
                start,
                AMQPClass::Connection(connection::AMQPMethod::Start(_))
            ),
            "expected connection.start, got {start:?}"
        );
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties,
                mechanism: ShortString::try_new(mechanism).expect("a short mechanism name"),
                response: LongString::from(response.to_vec()),
                locale: "en_US".into(),
            })),
        )
        .await;
    }

    // ---------------------------------------------------------------------------------------
    // Sending
    // ---------------------------------------------------------------------------------------

    /// Writes bytes as they are (frames built by hand, several frames in one write, junk).
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    pub async fn send_method(&mut self, channel: u16, method: AMQPClass) {
        self.send_raw(&encode_method(channel, method)).await;
    }

    /// Answers a connection.close.
    pub async fn send_close_ok(&mut self) {
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        )
        .await;
    }

    /// Opens channel `channel`; the next method must be its open-ok.
    pub async fn open_channel(&mut self, channel: u16) {
        self.send_method(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
        let ok = self.read_method().await;
        assert!(
            matches!(ok, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
            "expected channel.open-ok, got {ok:?}"
        );
    }

    /// Starts a consumer on `queue` (server-named tag) and waits for consume-ok.
    pub async fn consume(&mut self, channel: u16, queue: &str, no_ack: bool) {
        self.send_method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: ShortString::try_new(queue).expect("a queue name of at most 255 bytes"),
                consumer_tag: "".into(),
                no_local: false,
                no_ack,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await;
        self.expect_method(60, 21).await;
    }

    /// Sends basic.publish, its content header (no properties) and the body in frames of at
    /// most [`FRAME_MAX`] bytes, all in one write.
    pub async fn publish(&mut self, channel: u16, exchange: &str, routing_key: &str, body: &[u8]) {
        let bytes = encode_publish(channel, exchange, routing_key, Default::default(), body);
        self.send_raw(&bytes).await;
    }

    pub async fn ack(&mut self, channel: u16, delivery_tag: u64, multiple: bool) {
        self.send_method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag,
                multiple,
            })),
        )
        .await;
    }

    // ---------------------------------------------------------------------------------------
    // Receiving
    // ---------------------------------------------------------------------------------------

    /// The next frame of any kind: `Ok(None)` at a clean end of the stream, `Err` on an
    /// invalid frame, a read error, an end in the middle of a frame or after [`FRAME_WAIT`].
    async fn receive(&mut self) -> Result<Option<WireFrame>, String> {
        self.receive_within(FRAME_WAIT).await
    }

    async fn receive_within(&mut self, wait: Duration) -> Result<Option<WireFrame>, String> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match self.codec.decode(&mut self.buffer) {
                Ok(Some(frame)) => return Ok(Some(frame)),
                Ok(None) => {}
                Err(err) => return Err(format!("invalid frame: {err}")),
            }
            self.buffer.reserve(64 * 1024);
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buffer)).await {
                Err(_) => return Err(format!("no frame within {wait:?}")),
                Ok(Err(err)) => return Err(format!("read: {err}")),
                Ok(Ok(0)) if self.buffer.is_empty() => return Ok(None),
                Ok(Ok(0)) => return Err("the connection closed in the middle of a frame".into()),
                Ok(Ok(_)) => {}
            }
        }
    }

    /// The next frame of any kind, heartbeats included (panics at the end of the stream, on
    /// an invalid frame or after 15 s).
    pub async fn next_frame(&mut self) -> WireFrame {
        match self.receive().await {
            Ok(Some(frame)) => frame,
            Ok(None) => panic!("the connection closed while a frame was expected"),
            Err(err) => panic!("{err}"),
        }
    }

    /// The next frame other than a heartbeat; `None` at the end of the stream, on an invalid
    /// frame or after 15 s.
    pub async fn read_frame(&mut self) -> Option<WireFrame> {
        loop {
            match self.receive().await {
                Ok(Some(frame)) if frame.is_heartbeat() => continue,
                Ok(frame) => return frame,
                Err(_) => return None,
            }
        }
    }

    /// The next method frame that arrives within `wait` (heartbeats skipped), decoded; `None`
    /// when nothing but heartbeats came in that time. Panics on any other frame, an invalid
    /// frame or the end of the stream.
    pub async fn method_within(&mut self, wait: Duration) -> Option<(u16, AMQPClass)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.receive_within(left).await {
                Ok(Some(frame)) if frame.is_heartbeat() => continue,
                Ok(Some(frame)) => {
                    assert_eq!(
                        frame.kind, FRAME_METHOD,
                        "expected a method frame, got {frame:?}"
                    );
                    let method = decode_method(frame.payload()).expect("decodable method");
                    return Some((frame.channel, method));
                }
                Ok(None) => panic!("the connection closed while a method was awaited"),
                Err(err) if err.starts_with("no frame within") => return None,
                Err(err) => panic!("{err}"),
            }
        }
    }

    /// The next frame other than a heartbeat, which must be a method frame, decoded.
    pub async fn read_method(&mut self) -> AMQPClass {
        let frame = self.read_frame().await.expect("a frame");
        assert_eq!(
            frame.kind, FRAME_METHOD,
            "expected a method frame, got {frame:?}"
        );
        decode_method(frame.payload()).expect("decodable method")
    }

    /// The next method frame (other frames are skipped): its channel, ids and payload.
    pub async fn next_method(&mut self) -> (u16, (u16, u16), Bytes) {
        loop {
            let frame = self.next_frame().await;
            if frame.kind == FRAME_METHOD {
                return (frame.channel, frame.method_ids(), frame.payload_bytes());
            }
        }
    }

    /// Reads frames until a method with these ids arrives; returns its payload.
    pub async fn expect_method(&mut self, class_id: u16, method_id: u16) -> Bytes {
        loop {
            let (_, ids, payload) = self.next_method().await;
            if ids == (class_id, method_id) {
                return payload;
            }
        }
    }

    /// Reads frames until connection.close arrives on channel 0; returns its reply code and
    /// text (without answering it: see [`RawClient::send_close_ok`]).
    pub async fn expect_connection_close(&mut self) -> (u16, String) {
        loop {
            let (channel, ids, payload) = self.next_method().await;
            if channel != 0 || ids != (10, 50) {
                continue;
            }
            match decode_method(&payload) {
                Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                    return (close.reply_code, close.reply_text.as_str().to_string());
                }
                other => panic!("bad connection.close: {other:?}"),
            }
        }
    }

    /// Asserts that the server ends the connection (within 15 s) without sending any frame.
    pub async fn expect_end(&mut self) {
        match self.receive().await {
            Ok(None) => {}
            Ok(Some(frame)) => panic!("expected the end of the connection, got {frame:?}"),
            Err(err) => panic!("expected the end of the connection: {err}"),
        }
    }

    /// Reads the next basic.deliver with its content (heartbeats are skipped; panics on any
    /// other frame).
    pub async fn next_delivery(&mut self) -> RawDelivery {
        let (channel, deliver) = loop {
            let frame = self.next_frame().await;
            if frame.kind != FRAME_METHOD {
                assert!(
                    frame.is_heartbeat(),
                    "content outside a delivery: {frame:?}"
                );
                continue;
            }
            match decode_method(frame.payload()) {
                Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => break (frame.channel, d),
                other => panic!("expected basic.deliver, got {other:?}"),
            }
        };
        let (properties, body) = self.next_content().await;
        RawDelivery {
            channel,
            delivery_tag: deliver.delivery_tag,
            redelivered: deliver.redelivered,
            properties,
            body,
        }
    }

    /// Reads the content that follows a basic.deliver or basic.get-ok: its property section
    /// as sent, and its body (panics on any other frame).
    pub async fn next_content(&mut self) -> (Bytes, Vec<u8>) {
        let header = self.next_frame().await;
        assert_eq!(header.kind, FRAME_HEADER, "content header after the method");
        let size = content_body_size(header.payload()).expect("a body size") as usize;
        let mut body = Vec::with_capacity(size);
        while body.len() < size {
            let frame = self.next_frame().await;
            assert_eq!(frame.kind, FRAME_BODY, "content body");
            body.extend_from_slice(frame.payload());
        }
        (header.payload_bytes().slice(12..), body)
    }

    /// Every byte until the server closes the connection, or until it sends nothing for 5 s
    /// (bytes already read but not taken as frames come first).
    pub async fn read_to_end(&mut self) -> Vec<u8> {
        let mut out = self.buffer.split().to_vec();
        let mut chunk = [0u8; 4096];
        loop {
            match tokio::time::timeout(BYTES_WAIT, self.stream.read(&mut chunk)).await {
                Ok(Ok(0)) | Err(_) | Ok(Err(_)) => return out,
                Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// Client properties with a `connection_name`.
fn named(connection_name: &str) -> FieldTable {
    let mut properties = FieldTable::default();
    properties.insert(
        "connection_name".into(),
        AMQPValue::LongString(LongString::from(connection_name)),
    );
    properties
}

/// Client properties announcing the `authentication_failure_close` capability (lapin and
/// most clients do): RabbitMQ then explains a refused login with a 403 connection.close
/// instead of only closing the socket.
pub fn with_failure_close() -> FieldTable {
    let mut capabilities = FieldTable::default();
    capabilities.insert(
        "authentication_failure_close".into(),
        AMQPValue::Boolean(true),
    );
    let mut properties = FieldTable::default();
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}
