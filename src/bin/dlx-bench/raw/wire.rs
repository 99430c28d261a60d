//! One AMQP 0-9-1 connection of the raw client, with one channel (number 1): the socket, a
//! read buffer that frames are cut from, a write buffer that frames are generated into, the
//! handshake (protocol header, start/start-ok with PLAIN, tune/tune-ok, open, channel.open),
//! synchronous method calls and the closing sequence.
//!
//! Frames are generated and parsed with amq-protocol; the socket is read and written in large
//! chunks, so one system call carries many frames. A [`Wire`] is unusable after any error.

use std::time::Duration;

use amq_protocol::auth::Credentials;
use amq_protocol::frame::{AMQPFrame, ProtocolVersion, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::{AMQPClass, channel, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::{AMQPScheme, AMQPUri, SASLMechanism};
use anyhow::{Context, Result, anyhow, bail};
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The only channel the raw client opens on a connection.
pub const CHANNEL: u16 = 1;

/// Bytes a frame adds around its payload: type, channel, size (7) and the end octet.
pub const FRAME_OVERHEAD: usize = 8;
const FRAME_END: u8 = 0xCE;
/// The smallest frame_max AMQP allows (frame-min-size).
const FRAME_MIN_SIZE: u32 = 4096;
/// Frame size accepted before connection.tune names the real limit.
const HANDSHAKE_FRAME_MAX: u32 = 1 << 20;
/// Free space the read buffer keeps before each read.
const READ_CHUNK: usize = 64 * 1024;
/// Time the closing handshake may take before the socket is simply dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the broker sent that ends the connection or channel.
#[derive(Debug, thiserror::Error)]
pub enum ClosedByBroker {
    #[error("broker closed the connection: {0}")]
    Connection(String),
    #[error("broker closed the channel: {0}")]
    Channel(String),
    #[error("broker closed the socket")]
    Socket,
}

/// The size of the first frame in `buf` if all of it is there, None if more bytes are needed;
/// an error if its header announces more than `frame_max` (0: no limit) or is not a frame.
pub fn complete_frame_len(buf: &[u8], frame_max: u32) -> Result<Option<usize>> {
    if buf.first() == Some(&b'A') {
        // A protocol header: the broker refuses our version and names its own.
        return Ok((buf.len() >= 8).then_some(8));
    }
    if buf.len() < 7 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    let total = size + FRAME_OVERHEAD;
    if frame_max != 0 && total > frame_max as usize {
        bail!(
            "frame of {total} bytes (type {}) exceeds frame_max {frame_max}",
            buf[0]
        );
    }
    if buf.len() < total {
        return Ok(None);
    }
    if buf[total - 1] != FRAME_END {
        bail!("frame end octet is {:#04x}, expected 0xce", buf[total - 1]);
    }
    Ok(Some(total))
}

/// Host and port of an amqp:// URL. (amq-protocol's URI parser only keeps host names, not IP
/// addresses, so the host is cut out here.)
pub fn host_port(url: &str, default_port: u16) -> Result<(String, u16)> {
    let rest = url
        .split_once("://")
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("no scheme in {url}"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| anyhow!("unclosed [ in {url}"))?;
        (host, after.strip_prefix(':'))
    } else {
        match host_port.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        }
    };
    let port = match port {
        Some(p) if !p.is_empty() => p
            .parse::<u16>()
            .with_context(|| format!("bad port in {url}"))?,
        _ => default_port,
    };
    let host = if host.is_empty() { "localhost" } else { host };
    Ok((host.to_string(), port))
}

pub fn short(s: &str) -> Result<ShortString> {
    ShortString::try_new(s).map_err(|_| anyhow!("longer than 255 bytes: {s}"))
}

/// The error a connection.close or channel.close from the broker stands for, if it is one.
pub fn broker_close(class: &AMQPClass) -> Option<ClosedByBroker> {
    let reply = |code: u16, text: &ShortString, class: u16, method: u16| {
        if class == 0 && method == 0 {
            format!("{code} {text}")
        } else {
            format!("{code} {text} (in reply to method {class}.{method})")
        }
    };
    match class {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(
            ClosedByBroker::Connection(reply(c.reply_code, &c.reply_text, c.class_id, c.method_id)),
        ),
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Some(ClosedByBroker::Channel(reply(
            c.reply_code,
            &c.reply_text,
            c.class_id,
            c.method_id,
        ))),
        _ => None,
    }
}

/// A connection with channel [`CHANNEL`] open.
pub struct Wire {
    stream: TcpStream,
    read_buf: BytesMut,
    write_buf: Vec<u8>,
    /// Bytes at the start of `write_buf` already written to the socket.
    written: usize,
    frame_max: u32,
    name: String,
}

impl Wire {
    /// Connects, runs the handshake and opens channel [`CHANNEL`].
    pub async fn open(url: &str, name: &str) -> Result<Wire> {
        let uri: AMQPUri = url
            .parse()
            .map_err(|e: String| anyhow!("bad broker URL {url}: {e}"))?;
        if uri.scheme != AMQPScheme::AMQP {
            bail!("the raw client speaks plain amqp:// only, not {url}");
        }
        let (host, port) = host_port(url, uri.scheme.default_port())?;
        let stream = TcpStream::connect((host.as_str(), port))
            .await
            .with_context(|| format!("connecting to {host}:{port} ({name})"))?;
        stream.set_nodelay(true)?;
        let mut wire = Wire {
            stream,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: Vec::with_capacity(READ_CHUNK),
            written: 0,
            frame_max: HANDSHAKE_FRAME_MAX,
            name: format!("dlx-bench {name}"),
        };
        wire.handshake(&uri)
            .await
            .with_context(|| format!("AMQP handshake with {host}:{port} ({name})"))?;
        Ok(wire)
    }

    async fn handshake(&mut self, uri: &AMQPUri) -> Result<()> {
        self.put(&AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()))?;
        self.flush().await?;
        let start = match self.next_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
            other => bail!("expected connection.start, got {other:?}"),
        };
        let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
        if !mechanisms.split_whitespace().any(|m| m == "PLAIN") {
            bail!("broker does not offer PLAIN authentication (offers {mechanisms})");
        }
        let credentials = Credentials::from(uri.authority.userinfo.clone());
        self.put_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: self.client_properties(),
                mechanism: short("PLAIN")?,
                response: credentials.sasl_auth_string(SASLMechanism::Plain),
                locale: short("en_US")?,
            })),
        )?;
        self.flush().await?;
        let tune = match self.next_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            other => bail!("expected connection.tune, got {other:?}"),
        };
        let mut frame_max = tune.frame_max;
        if let Some(wanted) = uri.query.frame_max
            && wanted != 0
            && (frame_max == 0 || wanted < frame_max)
        {
            frame_max = wanted;
        }
        if frame_max != 0 {
            frame_max = frame_max.max(FRAME_MIN_SIZE);
        }
        self.put_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max,
                heartbeat: 0,
            })),
        )?;
        self.frame_max = frame_max;
        self.put_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: short(&uri.vhost)?,
            })),
        )?;
        self.call_on(0, None, |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))
        })
        .await
        .context("connection.open")?;
        self.call(
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
        )
        .await
        .context("channel.open")?;
        Ok(())
    }

    fn client_properties(&self) -> FieldTable {
        let mut capabilities = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
        ] {
            capabilities.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        props.insert(
            "product".into(),
            AMQPValue::LongString(LongString::from("dlx-bench raw client")),
        );
        props.insert(
            "connection_name".into(),
            AMQPValue::LongString(LongString::from(self.name.as_str())),
        );
        props.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        props
    }

    /// The negotiated frame_max (0: no limit).
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Appends one frame to the write buffer.
    pub fn put(&mut self, frame: &AMQPFrame) -> Result<()> {
        let buf = std::mem::take(&mut self.write_buf);
        match gen_frame(frame)(WriteContext::from(buf)) {
            Ok(ctx) => {
                self.write_buf = ctx.write;
                Ok(())
            }
            Err(e) => {
                // The partly written buffer went with the error: the connection is done.
                self.written = 0;
                Err(anyhow!("cannot encode {frame}: {e:?}"))
            }
        }
    }

    /// Appends a method frame.
    pub fn put_method(&mut self, channel: u16, method: AMQPClass) -> Result<()> {
        self.put(&AMQPFrame::Method(channel, method))
    }

    /// Appends bytes that already are whole frames.
    pub fn put_bytes(&mut self, bytes: &[u8]) {
        self.write_buf.extend_from_slice(bytes);
    }

    /// Bytes waiting in the write buffer.
    pub fn unwritten(&self) -> usize {
        self.write_buf.len() - self.written
    }

    /// The next whole frame from the read buffer, None if the buffer holds no whole frame.
    pub fn next_frame(&mut self) -> Result<Option<AMQPFrame>> {
        let Some(len) = complete_frame_len(&self.read_buf, self.frame_max)? else {
            if self.read_buf.capacity() - self.read_buf.len() < READ_CHUNK / 4 {
                self.read_buf.reserve(READ_CHUNK);
            }
            return Ok(None);
        };
        let frame = match parse_frame(&self.read_buf[..len]) {
            Ok((_, frame)) => frame,
            Err(e) => bail!(
                "cannot parse a frame from the broker ({} bytes, type {}): {e:?}",
                len,
                self.read_buf[0]
            ),
        };
        self.read_buf.advance(len);
        if let AMQPFrame::ProtocolHeader(version) = frame {
            bail!("broker refused AMQP 0-9-1 and offered {version}");
        }
        Ok(Some(frame))
    }

    /// Waits for the socket once: writes some of the write buffer if it can, else reads
    /// whatever arrived into the read buffer. Cancel safe.
    pub async fn io(&mut self) -> Result<()> {
        let (mut reader, mut writer) = self.stream.split();
        if self.written < self.write_buf.len() {
            tokio::select! {
                biased;
                n = writer.write(&self.write_buf[self.written..]) => {
                    let n = n.context("writing to the broker")?;
                    if n == 0 {
                        return Err(ClosedByBroker::Socket.into());
                    }
                    self.written += n;
                    if self.written == self.write_buf.len() {
                        self.write_buf.clear();
                        self.written = 0;
                    }
                }
                n = reader.read_buf(&mut self.read_buf) => {
                    if n.context("reading from the broker")? == 0 {
                        return Err(ClosedByBroker::Socket.into());
                    }
                }
            }
        } else if reader
            .read_buf(&mut self.read_buf)
            .await
            .context("reading from the broker")?
            == 0
        {
            return Err(ClosedByBroker::Socket.into());
        }
        Ok(())
    }

    /// Writes the whole write buffer.
    pub async fn flush(&mut self) -> Result<()> {
        if self.written < self.write_buf.len() {
            self.stream
                .write_all(&self.write_buf[self.written..])
                .await
                .context("writing to the broker")?;
        }
        self.write_buf.clear();
        self.written = 0;
        Ok(())
    }

    /// The next frame, reading as needed (writing any pending output meanwhile).
    pub async fn read_frame(&mut self) -> Result<AMQPFrame> {
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(frame);
            }
            self.io().await?;
        }
    }

    /// The next method frame (any channel), skipping heartbeats; fails on a close.
    async fn next_method(&mut self) -> Result<AMQPClass> {
        loop {
            match self.read_frame().await? {
                AMQPFrame::Method(_, method) => {
                    if let Some(closed) = broker_close(&method) {
                        return Err(closed.into());
                    }
                    return Ok(method);
                }
                AMQPFrame::Heartbeat | AMQPFrame::InvalidHeartbeat(_) => {}
                other => bail!("unexpected {other} while waiting for a method"),
            }
        }
    }

    /// Sends `method` on [`CHANNEL`] and waits for the reply `is_reply` accepts.
    pub async fn call(
        &mut self,
        method: AMQPClass,
        is_reply: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass> {
        self.call_on(CHANNEL, Some(method), is_reply).await
    }

    /// Sends `method` (if any) on `channel`, then waits for the reply. Only connection.blocked
    /// and unblocked may come in between.
    async fn call_on(
        &mut self,
        channel: u16,
        method: Option<AMQPClass>,
        is_reply: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass> {
        if let Some(method) = method {
            self.put_method(channel, method)?;
        }
        self.flush().await?;
        loop {
            let reply = self.next_method().await?;
            if is_reply(&reply) {
                return Ok(reply);
            }
            if !matches!(
                reply,
                AMQPClass::Connection(
                    connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_)
                )
            ) {
                bail!("unexpected {reply:?} while waiting for a reply");
            }
        }
    }

    /// Closes the channel, then the connection, each waiting for its close-ok; whatever else
    /// arrives meanwhile (late deliveries, confirms) is dropped. False if the broker did not
    /// answer in time or the connection failed.
    pub async fn close(mut self) -> bool {
        let closing = async {
            let channel_close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: short("bye")?,
                class_id: 0,
                method_id: 0,
            }));
            self.call_skipping(CHANNEL, channel_close, |f| {
                matches!(
                    f,
                    AMQPFrame::Method(CHANNEL, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
                )
            })
            .await?;
            let connection_close =
                AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                    reply_code: 200,
                    reply_text: short("done")?,
                    class_id: 0,
                    method_id: 0,
                }));
            self.call_skipping(0, connection_close, |f| {
                matches!(
                    f,
                    AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                )
            })
            .await?;
            anyhow::Ok(())
        };
        matches!(
            tokio::time::timeout(CLOSE_TIMEOUT, closing).await,
            Ok(Ok(()))
        )
    }

    /// Like [`Self::call_on`], but drops whatever arrives before the reply (deliveries,
    /// confirms): for closing.
    async fn call_skipping(
        &mut self,
        channel: u16,
        method: AMQPClass,
        is_reply: impl Fn(&AMQPFrame) -> bool,
    ) -> Result<()> {
        self.put_method(channel, method)?;
        self.flush().await?;
        self.skip_until(is_reply).await
    }

    async fn skip_until(&mut self, done: impl Fn(&AMQPFrame) -> bool) -> Result<()> {
        loop {
            let frame = self.read_frame().await?;
            if done(&frame) {
                return Ok(());
            }
            if let AMQPFrame::Method(_, method) = &frame
                && let Some(closed) = broker_close(method)
            {
                return Err(closed.into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::basic;

    fn encoded(frame: &AMQPFrame) -> Vec<u8> {
        gen_frame(frame)(WriteContext::from(Vec::new()))
            .unwrap()
            .write
    }

    #[test]
    fn frames_are_cut_only_when_whole() {
        let ack = encoded(&AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 9,
                multiple: true,
            })),
        ));
        for cut in 0..ack.len() {
            assert_eq!(complete_frame_len(&ack[..cut], 4096).unwrap(), None);
        }
        assert_eq!(complete_frame_len(&ack, 4096).unwrap(), Some(ack.len()));
        let mut two = ack.clone();
        two.extend_from_slice(&ack);
        assert_eq!(complete_frame_len(&two, 0).unwrap(), Some(ack.len()));
    }

    #[test]
    fn oversized_and_broken_frames_are_refused() {
        let body = encoded(&AMQPFrame::Body(1, vec![7; 5000]));
        assert!(complete_frame_len(&body[..7], 4096).is_err());
        assert!(complete_frame_len(&body, 0).unwrap().is_some());
        let mut bad_end = encoded(&AMQPFrame::Body(1, vec![1, 2, 3]));
        let last = bad_end.len() - 1;
        bad_end[last] = 0;
        assert!(complete_frame_len(&bad_end, 4096).is_err());
    }

    #[test]
    fn a_protocol_header_is_one_frame() {
        assert_eq!(complete_frame_len(b"AMQP\x00\x00", 4096).unwrap(), None);
        assert_eq!(
            complete_frame_len(b"AMQP\x00\x00\x09\x01", 4096).unwrap(),
            Some(8)
        );
    }

    #[test]
    fn host_and_port_come_from_the_authority() {
        let cases = [
            ("amqp://guest:guest@127.0.0.1:5673/%2f", ("127.0.0.1", 5673)),
            ("amqp://127.0.0.1/%2f", ("127.0.0.1", 5672)),
            ("amqp://u:p@broker.example:1234", ("broker.example", 1234)),
            ("amqp://u:p@[::1]:5680/vh?frame_max=8192", ("::1", 5680)),
            ("amqp://[::1]", ("::1", 5672)),
            ("amqp://", ("localhost", 5672)),
        ];
        for (url, (host, port)) in cases {
            assert_eq!(
                host_port(url, 5672).unwrap(),
                (host.to_string(), port),
                "{url}"
            );
        }
        assert!(host_port("127.0.0.1:5672", 5672).is_err());
        assert!(host_port("amqp://h:99999/", 5672).is_err());
    }

    #[test]
    fn closes_from_the_broker_become_errors() {
        let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 406,
            reply_text: "PRECONDITION_FAILED - unknown delivery tag 5".into(),
            class_id: 60,
            method_id: 80,
        }));
        let err = broker_close(&close).unwrap().to_string();
        assert!(err.contains("406") && err.contains("unknown delivery tag"));
        assert!(err.contains("method 60.80"));
        assert!(
            broker_close(&AMQPClass::Channel(channel::AMQPMethod::OpenOk(
                channel::OpenOk {}
            )))
            .is_none()
        );
    }
}
