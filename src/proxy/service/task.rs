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
//!
//! The vhost's declare connection ([`super::declare_task`]) opens, keeps its heartbeats,
//! closes and reconnects with the same pieces ([`open`], [`Heartbeat`], [`Reconnect`]).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::ShortString;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::watch;

use super::backoff::Backoff;
use super::handshake::{ClientHandshake, Tuned, connection_name};
use super::link::{self, CaptureLink};
use super::{ServiceInbox, Status};
use crate::amqp::codec::{FRAME_METHOD, FrameError, PROTOCOL_HEADER, put_heartbeat};
use crate::amqp::reply;
use crate::config::ServiceIdentity;
use crate::proxy::ProxyShared;
use crate::proxy::publisher::Outcome;
use crate::proxy::upstream::{UpstreamStream, UpstreamTarget};
use crate::proxy::wire::{FrameReader, WireFrame, method_frame, upstream_frame_limit};
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
pub(super) enum End {
    Shutdown,
    Lost(String),
}

/// A connection of the service identity, logged in to its vhost.
pub(super) struct Opened {
    /// Reads frames of at most the agreed `frame_max`.
    pub(super) reader: FrameReader<ReadHalf<UpstreamStream>>,
    pub(super) write: WriteHalf<UpstreamStream>,
    pub(super) tuned: Tuned,
    pub(super) target: Arc<UpstreamTarget>,
}

/// Dials any node and logs in to `vhost` as `identity`, naming the connection `name`; never
/// longer than the handshake timeout or the shutdown allow.
pub(super) async fn open(
    shared: &ProxyShared,
    identity: &ServiceIdentity,
    vhost: &str,
    name: String,
    shutdown: &mut Shutdown,
) -> Result<Opened, End> {
    let stream = tokio::select! {
        s = dial(shared) => s,
        _ = shutdown.recv() => return Err(End::Shutdown),
    };
    // The error names every node tried.
    let (stream, target) = stream.map_err(|err| End::Lost(err.to_string()))?;
    let (read, mut write) = tokio::io::split(stream);
    let mut reader = FrameReader::new(read, shared.handshake_frame_max);
    let opened = tokio::select! {
        r = tokio::time::timeout(
            shared.handshake_timeout,
            handshake(
                &mut reader,
                &mut write,
                ClientHandshake::new(identity.clone(), vhost, name),
            ),
        ) => r,
        _ = shutdown.recv() => return Err(End::Shutdown),
    };
    let tuned = match opened {
        Ok(Ok(tuned)) => tuned,
        Ok(Err(why)) => return Err(End::Lost(why)),
        Err(_) => return Err(End::Lost("handshake did not complete in time".into())),
    };
    reader.set_frame_max(upstream_frame_limit(tuned.frame_max));
    Ok(Opened {
        reader,
        write,
        tuned,
        target,
    })
}

/// The heartbeats of an open connection, as agreed at its tune (none when 0): one sent when
/// nothing was written for half the interval, the connection lost when nothing was read for
/// two intervals.
pub(super) struct Heartbeat {
    interval: Option<Duration>,
    last_rx: Instant,
    last_tx: Instant,
}

impl Heartbeat {
    pub(super) fn new(tuned: &Tuned, now: Instant) -> Self {
        Heartbeat {
            interval: (tuned.heartbeat > 0)
                .then(|| Duration::from_secs(u64::from(tuned.heartbeat))),
            last_rx: now,
            last_tx: now,
        }
    }

    pub(super) fn received(&mut self, now: Instant) {
        self.last_rx = now;
    }

    pub(super) fn sent(&mut self, now: Instant) {
        self.last_tx = now;
    }

    /// The earlier of `wake` and when the timer is next due. A heartbeat is due only when
    /// nothing else waits to be written (`writing`: a blocked socket must not turn the timer
    /// into a busy loop).
    pub(super) fn wake(&self, wake: Instant, writing: bool) -> Instant {
        let Some(interval) = self.interval else {
            return wake;
        };
        let mut wake = wake.min(self.last_rx + interval * 2);
        if !writing {
            wake = wake.min(self.last_tx + interval / 2);
        }
        wake
    }

    /// The timer fired at `now`: a heartbeat into `out` when one is due, `Err` when the
    /// upstream went silent.
    pub(super) fn on_timer(&self, now: Instant, out: &mut BytesMut) -> Result<(), End> {
        let Some(interval) = self.interval else {
            return Ok(());
        };
        if now >= self.last_rx + interval * 2 {
            return Err(End::Lost("missed heartbeats".into()));
        }
        if now >= self.last_tx + interval / 2 && out.is_empty() {
            put_heartbeat(out);
        }
        Ok(())
    }
}

/// The reconnect policy of one connection of a vhost, shared by the service and the declare
/// connection: every attempt after the first counts in `service_reconnects_total`; after a
/// loss the pool is told (its reachability check looks, `/readyz` follows), the log names the
/// connection, why, and what waits meanwhile, and the next attempt waits its backoff (from
/// the start again when the connection had run [`STABLE`]).
pub(super) struct Reconnect {
    /// "service" or "declare".
    connection: &'static str,
    /// What waits while the connection is away.
    meanwhile: &'static str,
    backoff: Backoff,
    attempts: u64,
    started: Instant,
}

impl Reconnect {
    pub(super) fn new(connection: &'static str, meanwhile: &'static str) -> Self {
        Reconnect {
            connection,
            meanwhile,
            backoff: Backoff::new(),
            attempts: 0,
            started: Instant::now(),
        }
    }

    /// Whether to dial (again): false once shutdown fired.
    pub(super) fn attempt(
        &mut self,
        shared: &ProxyShared,
        vhost: &str,
        shutdown: &Shutdown,
    ) -> bool {
        if shutdown.is_shutdown() {
            return false;
        }
        if self.attempts > 0 {
            shared.metrics.service_reconnected(vhost);
        }
        self.attempts += 1;
        self.started = Instant::now();
        true
    }

    /// How the attempt ended: after a loss, waits the backoff out. False when the task is to
    /// stop (shutdown, before or during the wait).
    pub(super) async fn after(
        &mut self,
        end: End,
        shared: &ProxyShared,
        vhost: &str,
        shutdown: &mut Shutdown,
    ) -> bool {
        let End::Lost(why) = end else {
            tracing::debug!(vhost, "{} connection stopped", self.connection);
            return false;
        };
        shared.upstream.report_lost();
        if self.started.elapsed() >= STABLE {
            self.backoff.reset();
        }
        let delay = self.backoff.next_delay(rand::random::<f64>());
        tracing::warn!(
            vhost,
            reason = %why,
            retry_in_ms = delay.as_millis() as u64,
            meanwhile = self.meanwhile,
            "{} connection lost",
            self.connection
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = shutdown.recv() => false,
        }
    }
}

/// What the frame reader gave: a frame, or how the connection ended.
pub(super) fn frame_or_end(read: Option<Result<WireFrame, FrameError>>) -> Result<WireFrame, End> {
    match read {
        Some(Ok(frame)) => Ok(frame),
        Some(Err(FrameError::Io(err))) => Err(End::Lost(format!("socket: {err}"))),
        Some(Err(err)) => Err(End::Lost(format!("malformed frame: {err}"))),
        None => Err(End::Lost("the upstream closed the socket".into())),
    }
}

/// The upstream's connection.close, if `frame` is one: the close-ok to send and why.
pub(super) fn upstream_close(frame: &WireFrame) -> Option<(Bytes, String)> {
    if frame.channel != 0 || frame.kind != FRAME_METHOD {
        return None;
    }
    let Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) =
        crate::amqp::codec::decode_method(frame.payload())
    else {
        return None;
    };
    let close_ok = method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    );
    let why = format!(
        "connection closed by the upstream: {} {}",
        close.reply_code,
        close.reply_text.as_str()
    );
    Some((close_ok, why))
}

/// Writes `out` (a close-ok owed to the upstream) if the socket takes it at once.
pub(super) async fn write_last(write: &mut WriteHalf<UpstreamStream>, out: &[u8]) {
    let _ = tokio::time::timeout(Duration::from_millis(200), write.write_all(out)).await;
}

/// Sends `out` and connection.close, and waits (briefly) for the close-ok.
pub(super) async fn close_politely(
    reader: &mut FrameReader<ReadHalf<UpstreamStream>>,
    write: &mut WriteHalf<UpstreamStream>,
    mut out: BytesMut,
) {
    out.extend_from_slice(&method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: reply::REPLY_SUCCESS,
            reply_text: ShortString::from("dlx-proxy is shutting down"),
            class_id: 0,
            method_id: 0,
        })),
    ));
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        write.write_all(&out).await?;
        while let Some(Ok(frame)) = reader.next().await {
            if frame.channel == 0 && frame.method_ids() == (10, 51) {
                break;
            }
        }
        write.shutdown().await
    })
    .await;
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
    let mut reconnect = Reconnect::new("service", "captured messages wait in the capture queue");
    while reconnect.attempt(&shared, &vhost, &shutdown) {
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
        shared.metrics.set_capture_consumer(&vhost, false);
        if !reconnect.after(end, &shared, &vhost, &mut shutdown).await {
            break;
        }
    }
    // Sessions still waiting on a dead letter queued here learn that it was not published
    // (they settle nothing for it: the original goes back to its queue), and no more come.
    inbox.publishes.close();
    while let Ok(request) = inbox.publishes.try_recv() {
        let _ = request
            .reply
            .send((request.op, Outcome::Failed(link::FORWARD_LOST)));
    }
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
    let Opened {
        reader,
        write,
        tuned,
        target,
    } = match open(
        shared,
        identity,
        vhost,
        connection_name(&shared.capture_name, vhost),
        shutdown,
    )
    .await
    {
        Ok(opened) => opened,
        Err(end) => return end,
    };
    tracing::info!(vhost, upstream = %target.address(), "service connection open");
    Connection {
        shared,
        vhost,
        status,
        reader,
        write,
        out: BytesMut::new(),
        heartbeat: Heartbeat::new(&tuned, Instant::now()),
        link: CaptureLink::new(shared, vhost, tuned.frame_max),
        inbox,
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
    heartbeat: Heartbeat,
    link: CaptureLink,
    /// Dead letters the vhost's sessions have this connection publish; they wait here while
    /// the connection is away.
    inbox: &'a mut ServiceInbox,
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
            wake = self.heartbeat.wake(wake, !self.out.is_empty());
            if let Some(deadline) = stopping {
                wake = wake.min(deadline);
            }
            let writing = !self.out.is_empty();
            let forwarding = self.link.takes_forwarded() && stopping.is_none();
            tokio::select! {
                request = self.inbox.publishes.recv(), if forwarding => {
                    if let Some(request) = request
                        && let Some(bytes) = self.link.publish_for(request, Instant::now())
                    {
                        self.out.extend_from_slice(&bytes);
                    }
                }
                frame = self.reader.next() => {
                    let now = Instant::now();
                    self.heartbeat.received(now);
                    let frame = match frame_or_end(frame) {
                        Ok(frame) => frame,
                        Err(end) => return end,
                    };
                    if let Some(end) = self.on_frame(frame, now) {
                        // A close-ok (or channel close-ok) owed to the upstream goes out if
                        // the socket takes it at once.
                        write_last(&mut self.write, &self.out).await;
                        return end;
                    }
                }
                written = self.write.write(&self.out), if writing => {
                    match written {
                        Ok(0) | Err(_) => return End::Lost("socket write failed".into()),
                        Ok(n) => {
                            let _ = self.out.split_to(n);
                            self.heartbeat.sent(Instant::now());
                        }
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {
                    let now = Instant::now();
                    let step = self.link.on_timer(self.shared, now);
                    self.out.extend_from_slice(&step.write);
                    if let Err(end) = self.heartbeat.on_timer(now, &mut self.out) {
                        return end;
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
        if let Some((close_ok, why)) = upstream_close(&frame) {
            self.out.extend_from_slice(&close_ok);
            return Some(End::Lost(why));
        }
        if frame.channel == 0 {
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
        let out = std::mem::take(&mut self.out);
        close_politely(&mut self.reader, &mut self.write, out).await;
        End::Shutdown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuned(heartbeat: u16) -> Tuned {
        Tuned {
            channel_max: 16,
            frame_max: 4096,
            heartbeat,
        }
    }

    #[test]
    fn a_heartbeat_goes_out_after_half_the_interval_of_silence_and_two_intervals_lose_it() {
        let start = Instant::now();
        let mut beat = Heartbeat::new(&tuned(10), start);
        let later = start + Duration::from_secs(60);
        assert_eq!(beat.wake(later, false), start + Duration::from_secs(5));
        // Something waits to be written: only the read deadline wakes.
        assert_eq!(beat.wake(later, true), start + Duration::from_secs(20));
        let mut out = BytesMut::new();
        assert!(
            beat.on_timer(start + Duration::from_secs(4), &mut out)
                .is_ok()
        );
        assert!(out.is_empty());
        assert!(
            beat.on_timer(start + Duration::from_secs(5), &mut out)
                .is_ok()
        );
        assert_eq!(out.len(), 8, "one heartbeat frame");
        beat.sent(start + Duration::from_secs(5));
        beat.received(start + Duration::from_secs(15));
        assert_eq!(beat.wake(later, true), start + Duration::from_secs(35));
        let mut out = BytesMut::new();
        assert!(matches!(
            beat.on_timer(start + Duration::from_secs(35), &mut out),
            Err(End::Lost(why)) if why == "missed heartbeats"
        ));
    }

    #[test]
    fn no_heartbeats_when_none_were_agreed() {
        let start = Instant::now();
        let beat = Heartbeat::new(&tuned(0), start);
        let later = start + Duration::from_secs(60);
        assert_eq!(beat.wake(later, false), later);
        let mut out = BytesMut::new();
        assert!(
            beat.on_timer(start + Duration::from_secs(3600), &mut out)
                .is_ok()
        );
        assert!(out.is_empty());
    }
}
