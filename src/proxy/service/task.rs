//! The task of one vhost's service connection: dial (through the [`UpstreamPool`](crate::proxy::upstream::UpstreamPool), so to any
//! node of `upstream.urls`), log in ([`ClientHandshake`]), run the
//! capture link ([`CaptureLink`]) until the connection or its consumer is lost, then wait
//! ([`Backoff`]) and start again, until shutdown. Only bytes move here; every decision is in
//! the pure pieces.
//!
//! Lost means: the socket failed or closed, the upstream sent connection.close (an operator's
//! `rabbitmqctl close_connection`, a node going down), the capture channel was closed or the
//! consumer cancelled (the capture queue deleted, or its quorum leader moved), or two
//! heartbeat intervals passed without a frame. Every capture delivery not acked yet is
//! requeued by the upstream when the connection goes, so nothing is lost in between. Each loss
//! is reported to the pool ([`report_lost`](crate::proxy::upstream::UpstreamPool::report_lost)), whose check keeps `/readyz` true to
//! reachability, and the next dial starts with the node that last worked, skipping the ones
//! that just failed.
//!
//! Shutdown: the consumer is cancelled, dead-letter publishes still in flight are settled
//! (within `proxy.confirm_timeout_secs`), then the connection is closed.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::ShortString;
use bytes::BytesMut;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::watch;

use super::backoff::Backoff;
use super::handshake::{ClientHandshake, Tuned, connection_name};
use super::judge::{DECLARE_CHANNEL, Judge};
use super::link::CaptureLink;
use super::{ServiceInbox, Status};
use crate::amqp::codec::{FRAME_METHOD, FrameError, PROTOCOL_HEADER, put_heartbeat};
use crate::amqp::reply;
use crate::config::ServiceIdentity;
use crate::proxy::ProxyShared;
use crate::proxy::upstream::{UpstreamStream, UpstreamTarget};
use crate::proxy::wire::{FrameReader, WireFrame, method_frame};
use crate::shutdown::Shutdown;

/// connection.blocked and connection.unblocked (RabbitMQ's extension; the handshake asks
/// for them).
const CONNECTION_BLOCKED: (u16, u16) = (10, 60);
const CONNECTION_UNBLOCKED: (u16, u16) = (10, 61);

/// A connection that consumed at least this long starts its next backoff from the beginning.
const STABLE: Duration = Duration::from_secs(10);
/// How long the upstream gets to answer the proxy's connection.close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Opens a TCP/TLS connection to the first upstream node that accepts, through the pool that
/// every upstream connection of the proxy uses (so a service connection fails over to any
/// node, starting with the last one that worked).
async fn dial(shared: &ProxyShared) -> io::Result<(UpstreamStream, Arc<UpstreamTarget>)> {
    shared.upstream.connect().await
}

/// How a connection ended.
enum End {
    Shutdown,
    Lost(String),
}

/// Runs the vhost's service connection until shutdown.
pub(super) async fn run(
    shared: Arc<ProxyShared>,
    identity: ServiceIdentity,
    vhost: String,
    status: watch::Sender<Status>,
    mut inbox: ServiceInbox,
    mut shutdown: Shutdown,
) {
    let metrics = shared.metrics.clone();
    let mut backoff = Backoff::new();
    let mut first = true;
    loop {
        if shutdown.is_shutdown() {
            break;
        }
        if !first {
            metrics.service_reconnected(&vhost);
        }
        first = false;
        let started = Instant::now();
        let end = connect_and_serve(
            &shared,
            &identity,
            &vhost,
            &status,
            &mut inbox,
            &mut shutdown,
        )
        .await;
        status.send_modify(|s| {
            s.consuming = false;
            s.blocked = false;
        });
        shared.services.consumer_changed();
        metrics.set_capture_consumer(&vhost, false);
        let why = match end {
            End::Shutdown => break,
            End::Lost(why) => why,
        };
        // The node may be down: the pool's reachability check looks (and /readyz follows).
        shared.upstream.report_lost();
        if started.elapsed() >= STABLE {
            backoff.reset();
        }
        let delay = backoff.next_delay(rand::random::<f64>());
        tracing::warn!(
            vhost = %vhost,
            reason = %why,
            retry_in_ms = delay.as_millis() as u64,
            "service connection lost; captured messages wait in the capture queue until it is back"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.recv() => break,
        }
    }
    tracing::debug!(vhost = %vhost, "service connection stopped");
}

/// One connection: dial, handshake, serve. Never longer than the shutdown allows.
async fn connect_and_serve(
    shared: &Arc<ProxyShared>,
    identity: &ServiceIdentity,
    vhost: &str,
    status: &watch::Sender<Status>,
    inbox: &mut ServiceInbox,
    shutdown: &mut Shutdown,
) -> End {
    let stream = tokio::select! {
        s = dial(shared) => s,
        _ = shutdown.recv() => return End::Shutdown,
    };
    let (stream, target) = match stream {
        Ok(dialled) => dialled,
        // The error names every node tried.
        Err(err) => return End::Lost(err.to_string()),
    };
    let (read, mut write) = tokio::io::split(stream);
    let mut reader = FrameReader::new(read, shared.handshake_frame_max);
    let opened = tokio::select! {
        r = tokio::time::timeout(
            shared.handshake_timeout,
            handshake(
                &mut reader,
                &mut write,
                ClientHandshake::new(
                    identity.clone(),
                    vhost,
                    connection_name(&shared.capture_name, vhost),
                ),
            ),
        ) => r,
        _ = shutdown.recv() => return End::Shutdown,
    };
    let tuned = match opened {
        Ok(Ok(tuned)) => tuned,
        Ok(Err(why)) => return End::Lost(why),
        Err(_) => return End::Lost("handshake did not complete in time".into()),
    };
    reader.set_frame_max(tuned.frame_max);
    tracing::info!(vhost, upstream = %target.address(), "service connection open");
    Connection {
        shared,
        vhost,
        status,
        reader,
        write,
        out: BytesMut::new(),
        heartbeat: (tuned.heartbeat > 0).then(|| Duration::from_secs(u64::from(tuned.heartbeat))),
        link: CaptureLink::new(shared, vhost, tuned.frame_max),
        inbox,
        judge: Judge::default(),
    }
    .serve(shutdown)
    .await
}

/// Protocol header, then the handshake frames until connection.open-ok (also the login of
/// the redrive's own connection, [`crate::proxy::redrive`]).
pub(crate) async fn handshake(
    reader: &mut FrameReader<ReadHalf<UpstreamStream>>,
    write: &mut WriteHalf<UpstreamStream>,
    mut machine: ClientHandshake,
) -> Result<Tuned, String> {
    write
        .write_all(&PROTOCOL_HEADER)
        .await
        .map_err(|e| format!("write: {e}"))?;
    loop {
        let frame = match reader.next().await {
            Some(Ok(frame)) => frame,
            Some(Err(err)) => return Err(format!("handshake: {err}")),
            None => {
                return Err("the upstream closed the socket during the handshake \
                            (login refused?)"
                    .into());
            }
        };
        let step = machine.on_frame(&frame).map_err(|e| e.to_string())?;
        if let Some(bytes) = step.write {
            write
                .write_all(&bytes)
                .await
                .map_err(|e| format!("write: {e}"))?;
        }
        if let Some(tuned) = step.open {
            return Ok(tuned);
        }
    }
}

/// An open service connection.
struct Connection<'a> {
    shared: &'a Arc<ProxyShared>,
    vhost: &'a str,
    status: &'a watch::Sender<Status>,
    reader: FrameReader<ReadHalf<UpstreamStream>>,
    write: WriteHalf<UpstreamStream>,
    /// Bytes waiting to be written.
    out: BytesMut,
    heartbeat: Option<Duration>,
    link: CaptureLink,
    /// Declares and dead letters the vhost's sessions have this connection make; they wait
    /// here while the connection is away.
    inbox: &'a mut ServiceInbox,
    judge: Judge,
}

impl Drop for Connection<'_> {
    fn drop(&mut self) {
        // Whatever way the connection ended, what it held goes back to the capture queue.
        self.link.end(self.shared);
    }
}

impl Connection<'_> {
    async fn serve(mut self, shutdown: &mut Shutdown) -> End {
        self.out.extend_from_slice(&self.link.start_frames());
        let mut last_rx = Instant::now();
        let mut last_tx = Instant::now();
        let mut stopping: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if let Some(deadline) = stopping
                && (self.link.is_drained() || now >= deadline)
            {
                return self.close().await;
            }
            let mut wake = now + Duration::from_secs(60);
            if let Some(at) = self.link.next_deadline() {
                wake = wake.min(at);
            }
            if let Some(interval) = self.heartbeat {
                wake = wake.min(last_rx + interval * 2);
                // A heartbeat is due only when nothing else waits to be written (a blocked
                // socket must not turn the timer into a busy loop).
                if self.out.is_empty() {
                    wake = wake.min(last_tx + interval / 2);
                }
            }
            if let Some(deadline) = stopping {
                wake = wake.min(deadline);
            }
            let writing = !self.out.is_empty();
            let judging = self.judge.ready() && stopping.is_none();
            let forwarding = self.link.takes_forwarded() && stopping.is_none();
            tokio::select! {
                request = self.inbox.publishes.recv(), if forwarding => {
                    if let Some(request) = request
                        && let Some(bytes) = self.link.publish_for(request, Instant::now())
                    {
                        self.out.extend_from_slice(&bytes);
                    }
                }
                request = self.inbox.declares.recv(), if judging => {
                    // The registry keeps a sender for as long as the task runs.
                    if let Some(request) = request
                        && let Some(bytes) = self.judge.start(request)
                    {
                        self.out.extend_from_slice(&bytes);
                    }
                }
                frame = self.reader.next() => {
                    last_rx = Instant::now();
                    match frame {
                        Some(Ok(frame)) => {
                            if let Some(end) = self.on_frame(frame, last_rx) {
                                // A close-ok (or channel close-ok) owed to the upstream goes
                                // out if the socket takes it at once.
                                let out = std::mem::take(&mut self.out);
                                let _ = tokio::time::timeout(
                                    Duration::from_millis(200),
                                    self.write.write_all(&out),
                                )
                                .await;
                                return end;
                            }
                        }
                        Some(Err(FrameError::Io(err))) => {
                            return End::Lost(format!("socket: {err}"));
                        }
                        Some(Err(err)) => return End::Lost(format!("malformed frame: {err}")),
                        None => return End::Lost("the upstream closed the socket".into()),
                    }
                }
                written = self.write.write(&self.out), if writing => {
                    match written {
                        Ok(0) | Err(_) => return End::Lost("socket write failed".into()),
                        Ok(n) => {
                            let _ = self.out.split_to(n);
                            last_tx = Instant::now();
                        }
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {
                    let now = Instant::now();
                    let step = self.link.on_timer(self.shared, now);
                    self.out.extend_from_slice(&step.write);
                    if let Some(interval) = self.heartbeat {
                        if now >= last_rx + interval * 2 {
                            return End::Lost("missed heartbeats".into());
                        }
                        if now >= last_tx + interval / 2 && self.out.is_empty() {
                            put_heartbeat(&mut self.out);
                        }
                    }
                }
                _ = shutdown.recv(), if stopping.is_none() => {
                    // Stop taking messages; settle what is in flight, then close.
                    if let Some(cancel) = self.link.stop(self.shared) {
                        self.out.extend_from_slice(&cancel);
                    }
                    stopping = Some(Instant::now() + self.shared.confirm_timeout);
                }
            }
        }
    }

    /// Handles one frame, received at `now`; `Some` ends the connection.
    fn on_frame(&mut self, frame: WireFrame, now: Instant) -> Option<End> {
        if frame.channel == 0 {
            if frame.kind == FRAME_METHOD
                && let Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) =
                    crate::amqp::codec::decode_method(frame.payload())
            {
                self.out.extend_from_slice(&method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                ));
                return Some(End::Lost(format!(
                    "connection closed by the upstream: {} {}",
                    close.reply_code,
                    close.reply_text.as_str()
                )));
            }
            match frame.method_ids() {
                CONNECTION_BLOCKED => {
                    tracing::warn!(
                        vhost = self.vhost,
                        "service connection blocked by a RabbitMQ resource alarm; dead letters \
                         wait until it clears"
                    );
                    self.link.blocked(self.shared, now);
                    self.status.send_modify(|s| s.blocked = true);
                }
                CONNECTION_UNBLOCKED => {
                    tracing::info!(vhost = self.vhost, "service connection unblocked");
                    self.link.unblocked(self.shared, now);
                    self.status.send_modify(|s| s.blocked = false);
                }
                _ => {}
            }
            return None;
        }
        if frame.channel == DECLARE_CHANNEL {
            if let Some(bytes) = self.judge.on_frame(&frame) {
                self.out.extend_from_slice(&bytes);
            }
            return None;
        }
        let step = self.link.on_frame(self.shared, &frame, now);
        self.out.extend_from_slice(&step.write);
        if step.declared {
            self.status.send_modify(|s| s.declared = true);
        }
        if step.consuming {
            self.status.send_modify(|s| s.consuming = true);
            self.shared.services.consumer_changed();
            self.shared.metrics.set_capture_consumer(self.vhost, true);
            tracing::info!(vhost = self.vhost, "capture consumer subscribed");
        }
        step.lost.map(End::Lost)
    }

    /// Sends connection.close and waits (briefly) for close-ok.
    async fn close(mut self) -> End {
        self.out.extend_from_slice(&method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: reply::REPLY_SUCCESS,
                reply_text: ShortString::from("dlx-proxy is shutting down"),
                class_id: 0,
                method_id: 0,
            })),
        ));
        let out = std::mem::take(&mut self.out);
        let _ = tokio::time::timeout(CLOSE_GRACE, async {
            self.write.write_all(&out).await?;
            while let Some(Ok(frame)) = self.reader.next().await {
                if frame.channel == 0 && frame.method_ids() == (10, 51) {
                    break;
                }
            }
            self.write.shutdown().await
        })
        .await;
        End::Shutdown
    }
}
