//! One client connection in embedded mode: protocol header, connection.start/tune/open,
//! then the frame loop, heartbeats and an orderly close.
//!
//! Reading happens here; writing happens in a separate writer task that drains the
//! connection's write queue, so a delivery written by another connection's publish never waits on
//! this task.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::FramedRead;

use super::ServerContext;
use super::blocking::{Throttle, has_capability, wants_blocked_notifications};
use super::channel::{ChannelTable, Flow};
use super::connection_context::ConnectionContext;
use crate::admission::is_loopback;
use crate::amqp::codec::{
    FRAME_HEARTBEAT, FRAME_METHOD, FrameCodec, FrameError, INITIAL_FRAME_MAX, PROTOCOL_HEADER,
    RawFrame, decode_method, decode_method_within, method_ids, put_heartbeat, put_method,
};
use crate::amqp::reply::{self, AmqpError};
use crate::broker::ack_timeout::timeout_error;
use crate::broker::auth::{login_refused, parse_amqplain, parse_sasl_plain};
use crate::broker::write_queue::WriteQueue;
use crate::metrics::Direction;
use crate::shutdown::Shutdown;

fn short(s: &str) -> ShortString {
    crate::broker::delivery::short(s)
}

fn server_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "per_consumer_qos",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        caps.insert(short(cap), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert(short("capabilities"), AMQPValue::FieldTable(caps));
    props.insert(
        short("product"),
        AMQPValue::LongString(LongString::from("dlx-proxy")),
    );
    props.insert(
        short("version"),
        AMQPValue::LongString(LongString::from(env!("CARGO_PKG_VERSION"))),
    );
    props.insert(
        short("platform"),
        AMQPValue::LongString(LongString::from("Rust")),
    );
    props.insert(
        short("cluster_name"),
        AMQPValue::LongString(LongString::from("dlx-proxy")),
    );
    props
}

/// Runs a connection to completion.
pub async fn run<S>(stream: S, peer: SocketAddr, ctx: Arc<ServerContext>, shutdown: Shutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = ctx.limits();
    let (mut reader, mut writer) = tokio::io::split(stream);

    // Protocol header.
    // One deadline for the whole handshake, from the protocol header to connection.open:
    // heartbeats or slow steps do not extend it, so a client that never logs in gives its
    // connection slot back.
    let mut header = [0u8; 8];
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(limits.handshake_timeout_secs.max(1));
    match tokio::time::timeout_at(deadline, reader.read_exact(&mut header)).await {
        Ok(Ok(_)) => {}
        _ => return,
    }
    if header != PROTOCOL_HEADER {
        let _ = writer.write_all(&PROTOCOL_HEADER).await;
        let _ = writer.shutdown().await;
        tracing::debug!(%peer, "bad protocol header; answered with AMQP 0-9-1");
        return;
    }

    let write_queue = Arc::new(WriteQueue::counted(
        limits.connection_outbox_bytes,
        ctx.broker.metrics.clone(),
    ));
    let conn_id = Arc::new(AtomicU64::new(0));
    let heartbeat_secs = Arc::new(AtomicU64::new(0));
    let written = Arc::new(AtomicU64::new(0));
    let writer_task = tokio::spawn(write_loop(
        writer,
        write_queue.clone(),
        ctx.clone(),
        conn_id.clone(),
        heartbeat_secs.clone(),
        written.clone(),
    ));

    let initial_frame_max = limits.frame_max.min(INITIAL_FRAME_MAX);
    let mut frames = FramedRead::new(reader, FrameCodec::new(initial_frame_max));
    let handshake = handshake(&mut frames, &write_queue, &ctx, peer, &limits);
    let conn = match tokio::time::timeout_at(deadline, handshake).await {
        Ok(Some(s)) => s,
        Ok(None) | Err(_) => {
            write_queue.close();
            finish_writer(writer_task, &written).await;
            return;
        }
    };
    conn_id.store(conn.conn_id, Ordering::SeqCst);
    frames.decoder_mut().set_frame_max(conn.frame_max as u32);
    let heartbeat = conn.heartbeat;
    heartbeat_secs.store(heartbeat, Ordering::SeqCst);
    tracing::debug!(%peer, conn = conn.conn_id, user = %conn.user, vhost = %conn.vhost, "connection open");

    frame_loop(&mut frames, &conn, &ctx, shutdown, heartbeat).await;

    ctx.broker.close_connection(conn.conn_id);
    tracing::debug!(%peer, conn = conn.conn_id, "connection closed");
    write_queue.close();
    finish_writer(writer_task, &written).await;
}

/// How long a closed connection's writer may go without writing a byte while it flushes
/// what is left.
const WRITER_GRACE: Duration = Duration::from_secs(5);
/// How long a closed connection's writer may flush in all, however slowly the peer reads.
const WRITER_MAX_FLUSH: Duration = Duration::from_secs(120);

/// Lets the writer flush what is left while the peer reads (`written`, the bytes it wrote,
/// moves at least every [`WRITER_GRACE`], for at most [`WRITER_MAX_FLUSH`]), then stops it. A
/// peer that reads nothing (its receive window closed) would otherwise keep the writer in its
/// write for as long as the peer's kernel keeps the connection: the socket, the batch it was
/// writing (up to a whole message) and the connection's write queue with its counted bytes.
async fn finish_writer(writer_task: tokio::task::JoinHandle<()>, written: &AtomicU64) {
    let abort = writer_task.abort_handle();
    let until = tokio::time::Instant::now() + WRITER_MAX_FLUSH;
    let mut task = writer_task;
    let mut seen = written.load(Ordering::Relaxed);
    loop {
        if tokio::time::timeout(WRITER_GRACE, &mut task).await.is_ok() {
            return;
        }
        let now_written = written.load(Ordering::Relaxed);
        if now_written == seen || tokio::time::Instant::now() >= until {
            abort.abort();
            tracing::debug!("writer stopped: the peer stopped reading");
            return;
        }
        seen = now_written;
    }
}

/// `write_all` that counts every byte the socket takes in `written` as it goes (what
/// [`finish_writer`] watches for progress).
async fn write_counted<W: AsyncWrite + Unpin>(
    writer: &mut W,
    bytes: &[u8],
    written: &AtomicU64,
) -> std::io::Result<()> {
    let mut at = 0;
    while at < bytes.len() {
        let n = writer.write(&bytes[at..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        at += n;
        written.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Reads the next frame, failing on a silent peer.
async fn next_frame<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    timeout: Option<Duration>,
) -> Result<Option<RawFrame>, FrameError> {
    let next = match timeout {
        Some(t) => match tokio::time::timeout(t, frames.next()).await {
            Ok(n) => n,
            Err(_) => {
                return Err(FrameError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "missed heartbeats from client",
                )));
            }
        },
        None => frames.next().await,
    };
    next.transpose()
}

fn send_close(write_queue: &WriteQueue, err: &AmqpError) {
    write_queue.push(|out| {
        put_method(
            out,
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: err.code,
                reply_text: short(err.short_text()),
                class_id: err.class_id,
                method_id: err.method_id,
            })),
        )
    });
}

/// Resolves after `timeout`; never without one (heartbeats off).
async fn silence(timeout: Option<Duration>) {
    match timeout {
        Some(t) => tokio::time::sleep(t).await,
        None => std::future::pending().await,
    }
}

/// Answers the client's connection.close.
fn send_close_ok(write_queue: &WriteQueue) {
    write_queue.push(|out| {
        put_method(
            out,
            0,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        )
    });
}

/// Waits briefly for connection.close-ok after we sent connection.close.
async fn await_close_ok<R: AsyncRead + Unpin>(frames: &mut FramedRead<R, FrameCodec>) {
    let deadline = Duration::from_secs(3);
    let _ = tokio::time::timeout(deadline, async {
        while let Some(Ok(frame)) = frames.next().await {
            if frame.kind == FRAME_METHOD
                && frame.channel == 0
                && matches!(
                    decode_method(&frame.payload),
                    Some(AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                )
            {
                return;
            }
        }
    })
    .await;
}

async fn handshake<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    write_queue: &Arc<WriteQueue>,
    ctx: &Arc<ServerContext>,
    peer: SocketAddr,
    limits: &crate::config::LimitsConfig,
) -> Option<ConnectionContext> {
    write_queue.push(|out| {
        put_method(
            out,
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: server_properties(),
                mechanisms: LongString::from("PLAIN AMQPLAIN"),
                locales: LongString::from("en_US"),
            })),
        )
    });
    let fail = |err: AmqpError| {
        send_close(write_queue, &err);
        None::<ConnectionContext>
    };
    // start-ok
    let start_ok = match expect_method(frames, limits.max_table_depth).await {
        Ok(AMQPClass::Connection(connection::AMQPMethod::StartOk(s))) => s,
        Ok(_) => return fail(AmqpError::command_invalid("expected connection.start-ok")),
        Err(None) => return None,
        Err(Some(e)) => return fail(e),
    };
    let credentials = match start_ok.mechanism.as_str() {
        "PLAIN" => parse_sasl_plain(start_ok.response.as_bytes()),
        "AMQPLAIN" => parse_amqplain(start_ok.response.as_bytes()),
        other => {
            return fail(AmqpError::access_refused(format!(
                "unsupported authentication mechanism '{other}'"
            )));
        }
    };
    let mechanism = start_ok.mechanism.as_str().to_string();
    let blocked_notifications = wants_blocked_notifications(&start_ok.client_properties);
    let cancel_notify = has_capability(&start_ok.client_properties, "consumer_cancel_notify");
    let Some((user, password)) = credentials else {
        return fail(AmqpError::access_refused(login_refused(&mechanism)));
    };
    if let Err(err) = ctx
        .users()
        .authenticate(&user, &password, is_loopback(peer.ip()))
    {
        tracing::warn!(%peer, %user, %err, "authentication failed");
        let e = AmqpError::access_refused(login_refused(&mechanism));
        send_close(write_queue, &e);
        return None;
    }
    // tune
    write_queue.push(|out| {
        put_method(
            out,
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: limits.channel_max,
                frame_max: limits.frame_max,
                heartbeat: limits.heartbeat_secs,
            })),
        )
    });
    let tune_ok = match expect_method(frames, limits.max_table_depth).await {
        Ok(AMQPClass::Connection(connection::AMQPMethod::TuneOk(t))) => t,
        Ok(_) => return fail(AmqpError::command_invalid("expected connection.tune-ok")),
        Err(None) => return None,
        Err(Some(e)) => return fail(e),
    };
    let frame_max = match tune_ok.frame_max {
        0 => limits.frame_max,
        f => f.min(limits.frame_max),
    };
    if frame_max < crate::amqp::codec::FRAME_MIN_SIZE {
        return fail(AmqpError::syntax_error(format!(
            "frame_max={frame_max} < {} min size",
            crate::amqp::codec::FRAME_MIN_SIZE
        )));
    }
    let channel_max = match tune_ok.channel_max {
        0 => limits.channel_max,
        c => c.min(limits.channel_max),
    };
    // open
    let open = match expect_method(frames, limits.max_table_depth).await {
        Ok(AMQPClass::Connection(connection::AMQPMethod::Open(o))) => o,
        Ok(_) => return fail(AmqpError::command_invalid("expected connection.open")),
        Err(None) => return None,
        Err(Some(e)) => return fail(e),
    };
    let vhost = open.virtual_host.as_str().to_string();
    if !ctx.users().has_vhost_access(&user, &vhost) {
        return fail(AmqpError::not_allowed(format!(
            "access to vhost '{vhost}' refused for user '{user}'"
        )));
    }
    let conn_id =
        match ctx
            .broker
            .open_connection(write_queue.clone(), frame_max as usize, &user, &vhost)
        {
            Ok(id) => id,
            Err(e) => return fail(e),
        };
    ctx.broker.set_cancel_notify(conn_id, cancel_notify);
    write_queue.push(|out| {
        put_method(
            out,
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        )
    });
    Some(ConnectionContext {
        conn_id,
        peer,
        user,
        vhost,
        frame_max: frame_max as usize,
        channel_max,
        heartbeat: tune_ok.heartbeat as u64,
        write_queue: write_queue.clone(),
        blocked_notifications,
    })
}

/// Reads one method frame on channel 0 during the handshake (the caller bounds the whole
/// handshake by one deadline). `Err(None)` = peer gone.
async fn expect_method<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    max_table_depth: usize,
) -> Result<AMQPClass, Option<AmqpError>> {
    loop {
        let frame = match next_frame(frames, None).await {
            Ok(Some(f)) => f,
            Ok(None) => return Err(None),
            Err(FrameError::Io(_)) => return Err(None),
            Err(e) => return Err(Some(AmqpError::frame_error(e.to_string()))),
        };
        if frame.kind == FRAME_HEARTBEAT {
            continue;
        }
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            return Err(Some(AmqpError::unexpected_frame(
                "expected a method frame on channel 0 during the handshake",
            )));
        }
        return decode_method_within(&frame.payload, max_table_depth).map_err(|err| {
            let (c, m) = method_ids(&frame.payload);
            Some(err.to_amqp_error(c, m))
        });
    }
}

async fn frame_loop<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    conn: &ConnectionContext,
    ctx: &Arc<ServerContext>,
    mut shutdown: Shutdown,
    heartbeat: u64,
) {
    let timeout = (heartbeat > 0).then(|| Duration::from_secs(heartbeat * 2));
    let mut channels = ChannelTable::new(&ctx.limits());
    let mut traffic = TrafficCounter::new(ctx.clone(), Direction::ClientIn);
    let mut throttle = Throttle::new(
        ctx.memory_alarm.subscribe(),
        ctx.disk_alarm.subscribe(),
        conn.blocked_notifications,
    );
    let ack_alarm = ctx
        .broker
        .ack_alarm(conn.conn_id)
        .unwrap_or_else(|| Arc::new(tokio::sync::Notify::new()));
    // The loop ends with the error to close the connection with, or None when the peer is
    // gone or closed it.
    let close_with = loop {
        // Answers the client has not read yet hold more than twice the write queue's budget:
        // read no more requests until the writer has made room (or gave up on the socket).
        // Consumer timeouts are acted on while it waits, as while it reads.
        // Its heartbeats are not read meanwhile, so a client that reads nothing for two
        // heartbeat intervals (a hung process with its socket open) is taken for gone, as
        // missed heartbeats would have it: its unacked deliveries go back to their queues.
        if conn.write_queue.is_over_read_limit() && !conn.write_queue.is_closed() {
            tokio::select! {
                _ = conn.write_queue.wait_for_room() => {}
                _ = shutdown.recv() => break Some(shutdown_error()),
                _ = ack_alarm.notified() => close_timed_out(&mut channels, conn, ctx),
                _ = silence(timeout) => {
                    tracing::debug!(peer = %conn.peer, conn = conn.conn_id, "client read nothing for two heartbeat intervals; dropped");
                    break None;
                }
            }
            continue;
        }
        let frame = tokio::select! {
            f = next_frame(frames, timeout) => f,
            _ = shutdown.recv() => break Some(shutdown_error()),
            _ = ack_alarm.notified() => {
                close_timed_out(&mut channels, conn, ctx);
                continue;
            }
        };
        let frame = match frame {
            Ok(Some(f)) => f,
            Ok(None) => break None,
            Err(FrameError::Io(err)) => {
                tracing::debug!(peer = %conn.peer, conn = conn.conn_id, %err, "connection read ended");
                break None;
            }
            Err(err) => break Some(AmqpError::frame_error(err.to_string())),
        };
        traffic.add(1, frame.wire_len() as u64);
        let blocks = throttle.must_block(&frame);
        match channels.handle(frame, conn, ctx) {
            Flow::Continue => {}
            Flow::CloseConnection(err) => break Some(err),
            Flow::ClientClose => {
                ctx.broker.close_connection(conn.conn_id);
                send_close_ok(&conn.write_queue);
                break None;
            }
            Flow::Closed => break None,
        }
        // A publish while an alarm is raised: stop reading until every alarm clears (acting
        // on consumer timeouts meanwhile).
        if blocks {
            let clear =
                throttle.wait_until_clear(&conn.write_queue, &ctx.broker.metrics, &mut shutdown);
            tokio::pin!(clear);
            let cleared = loop {
                tokio::select! {
                    cleared = &mut clear => break cleared,
                    _ = ack_alarm.notified() => close_timed_out(&mut channels, conn, ctx),
                }
            };
            if !cleared {
                break Some(shutdown_error());
            }
        }
    };
    ctx.broker
        .metrics
        .channels_closed(channels.open_channels() as u64);
    if let Some(err) = close_with {
        tracing::debug!(peer = %conn.peer, conn = conn.conn_id, code = err.code, %err, "closing connection");
        // As RabbitMQ: the channels are closed first (consumers gone, unacked deliveries
        // back in their queues), so nothing is delivered behind the close, where the client
        // discards it (a no-ack delivery would be lost).
        ctx.broker.close_connection(conn.conn_id);
        send_close(&conn.write_queue, &err);
        await_close_ok(frames).await;
    }
}

/// Closes (406) the channels holding a delivery past its consumer timeout.
fn close_timed_out(
    channels: &mut ChannelTable,
    conn: &ConnectionContext,
    ctx: &Arc<ServerContext>,
) {
    for (channel, timeout) in ctx.broker.take_ack_timeouts(conn.conn_id) {
        channels.close_on_error(channel, timeout_error(channel, timeout), conn, ctx);
    }
}

/// The close sent to clients when the service shuts down.
fn shutdown_error() -> AmqpError {
    AmqpError::new(
        reply::CONNECTION_FORCED,
        "broker forced connection closure with reason 'shutdown'",
    )
}

/// Frame and byte counts kept locally and added to the metrics every 64 frames and when the
/// connection ends (one metric update per batch, not per frame).
struct TrafficCounter {
    ctx: Arc<ServerContext>,
    direction: Direction,
    frames: u64,
    bytes: u64,
}

impl TrafficCounter {
    fn new(ctx: Arc<ServerContext>, direction: Direction) -> Self {
        TrafficCounter {
            ctx,
            direction,
            frames: 0,
            bytes: 0,
        }
    }

    fn add(&mut self, frames: u64, bytes: u64) {
        self.frames += frames;
        self.bytes += bytes;
        if self.frames >= 64 {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.frames > 0 || self.bytes > 0 {
            self.ctx
                .broker
                .metrics
                .traffic(self.direction, self.frames, self.bytes);
            self.frames = 0;
            self.bytes = 0;
        }
    }
}

impl Drop for TrafficCounter {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Number of complete frames in an encoded batch (walks the 7-byte headers).
fn count_frames(batch: &[u8]) -> u64 {
    let mut at = 0usize;
    let mut n = 0u64;
    while at + 7 <= batch.len() {
        let size = u32::from_be_bytes([batch[at + 3], batch[at + 4], batch[at + 5], batch[at + 6]]);
        at += size as usize + 8;
        n += 1;
    }
    n
}

/// Drains the write queue to the socket, sends heartbeats, and resumes dispatch after the queue
/// was too full to take deliveries.
async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    write_queue: Arc<WriteQueue>,
    ctx: Arc<ServerContext>,
    conn_id: Arc<AtomicU64>,
    heartbeat_secs: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut idle_secs = 0u64;
    let mut traffic = TrafficCounter::new(ctx.clone(), Direction::ClientOut);
    loop {
        // `queued`: the batch came from the write queue (a heartbeat did not).
        let (batch, queued): (BytesMut, bool) = tokio::select! {
            b = write_queue.next_batch() => (b, true),
            _ = tick.tick() => {
                let hb = heartbeat_secs.load(Ordering::Relaxed);
                idle_secs += 1;
                if hb > 0 && idle_secs >= hb.div_ceil(2).max(1) {
                    let mut b = BytesMut::new();
                    put_heartbeat(&mut b);
                    (b, false)
                } else {
                    continue;
                }
            }
        };
        if batch.is_empty() {
            // Closed: flush whatever is left and stop.
            let rest = write_queue.try_batch();
            let _ = write_counted(&mut writer, &rest, &written).await;
            let _ = writer.flush().await;
            let _ = writer.shutdown().await;
            return;
        }
        idle_secs = 0;
        let n = batch.len();
        if write_counted(&mut writer, &batch, &written).await.is_err() {
            write_queue.close();
            return;
        }
        if queued {
            write_queue.written(n);
        }
        traffic.add(count_frames(&batch), n as u64);
        if write_queue.take_starved_with_room() {
            let id = conn_id.load(Ordering::SeqCst);
            if id != 0 {
                ctx.broker.resume_connection(id);
            }
        }
    }
}
