//! One client connection and its upstream connection as a state machine ([`ClientSession`], as
//! opposed to the proxy's own service connections of [`super::service`]), with no socket: the
//! task around it ([`super::session_task`]) hands it each frame read from either side
//! ([`ClientSession::client_read`], [`ClientSession::upstream_read`]) and the time
//! ([`ClientSession::on_timer`]), and writes what it queued in its two outboxes
//! ([`super::outbox`]) to the sockets. What each frame means is decided in
//! [`super::forward`] (the handshake, channels, pass-through) and [`super::intercept`]
//! (declares, settlements, dead letters); unit tests drive it with in-memory frames
//! (`client_session/tests.rs`).
//!
//! Each side is `Open`, `Draining` (upstream only: the client is gone; the deliveries it held
//! of queues whose delivery limit the proxy counts are republished with their count, and the
//! proxy's publishes are settled before the upstream connection is closed so nothing the
//! client rejected is lost), `Closing` (a connection.close is out, waiting for close-ok, with
//! a deadline) or `Closed`. The connection ends when both sides are closed
//! ([`ClientSession::is_done`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::ShortString;
use bytes::{Buf, Bytes, BytesMut};
use tokio::sync::{mpsc, oneshot, watch};

use super::channel_map::ChannelMap;
use super::channels::ClientChannel;
use super::handshake::Negotiated;
use super::ops::{Op, Origin};
use super::outbox::Outbox;
use super::pending::{HeldDeclare, PendingCheck, PendingRead};
use super::policy_sync::management::ArgumentsListing;
use super::probe::{CheckAnswer, CheckChannel};
use super::publisher::{OpId, Outcome, Publisher};
use super::retry::RetrySchedule;
use super::service::ServiceHandle;
use super::service::Status;
use super::service::link::OutcomeSender;
use super::view_cache::ViewCache;
use super::wire::{WireFrame, method_frame};
use super::{ProxyShared, SettingsRevision};
use crate::amqp::codec::{FrameError, put_heartbeat};
use crate::amqp::reply;
use crate::metrics::Direction;

/// How long a peer gets to answer our connection.close.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// Most client requests (basic.get, queue.declare without nowait) a connection may have
/// waiting for the upstream's answer: past it the session reads no more client frames until
/// answers come back, so a client that sends requests without reading the answers holds a
/// bounded list in the proxy.
pub(super) const MAX_PENDING_ANSWERS: usize = 4096;

/// Frames and bytes read from one side (part of the [`MessageCounts`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Tally {
    frames: u64,
    bytes: u64,
}

/// Traffic and messages counted while the frames of one turn of the connection loop are
/// handled, added to the shared metrics in one go before the loop waits again
/// ([`ClientSession::report_counts`]): each update of a shared counter is an atomic
/// instruction, several per message otherwise.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct MessageCounts {
    pub(super) read_from_client: Tally,
    pub(super) read_from_upstream: Tally,
    pub(super) published: u64,
    pub(super) delivered: u64,
    pub(super) acked: u64,
    /// Change of the deliveries kept unsettled, and of their bytes.
    pub(super) kept: i64,
    pub(super) kept_bytes: i64,
}

/// State of one side of the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Open,
    /// Upstream only: the client is gone; waiting for the proxy's own publishes to settle.
    Draining {
        deadline: Instant,
    },
    /// A connection.close was sent to this side (by the proxy or forwarded); its close-ok is
    /// awaited. `forward_ok`: the close-ok belongs to the other peer's close and is passed on.
    Closing {
        deadline: Instant,
        forward_ok: bool,
    },
    Closed,
}

/// The connection's state, owned by its task.
pub(super) struct ClientSession {
    pub(super) shared: Arc<ProxyShared>,
    pub(super) peer: SocketAddr,
    pub(super) client_out: Outbox,
    pub(super) upstream_out: Outbox,
    pub(super) client_side: Side,
    pub(super) upstream_side: Side,
    /// True once connection.open-ok went to the client.
    pub(super) running: bool,
    pub(super) handshake_deadline: Instant,
    pub(super) vhost: String,
    pub(super) upstream_tune: Option<connection::Tune>,
    pub(super) negotiated: Option<Negotiated>,
    /// A frame size limit for the readers to pick up.
    pub(super) new_frame_max: Option<u32>,
    pub(super) frame_max: usize,
    pub(super) heartbeat: Option<Duration>,
    pub(super) last_client_rx: Instant,
    pub(super) last_upstream_rx: Instant,
    pub(super) last_upstream_tx: Instant,
    pub(super) channels: ChannelMap<ClientChannel>,
    pub(super) next_channel_id: u64,
    /// Channels the proxy closed upstream: close-oks still to swallow.
    pub(super) upstream_drain: ChannelMap<u32>,
    /// Bytes charged against `proxy.max_inflight_bytes`: kept deliveries, and the dead letters
    /// being published or held.
    pub(super) inflight_bytes: usize,
    pub(super) inflight_count: usize,
    /// The part of `inflight_bytes` charged to dead letters being published or held.
    pub(super) dead_letter_bytes: usize,
    /// Since when the confirms of the proxy's publishes cannot come: upstream reads paused
    /// with both sides open ([`Self::upstream_paused`]), or RabbitMQ holding the connection
    /// blocked (`upstream_blocked`). Their deadlines wait meanwhile.
    pub(super) upstream_paused_since: Option<Instant>,
    /// RabbitMQ holds the upstream connection blocked (connection.blocked: a memory or disk
    /// alarm, after a publish on it) and reads nothing from it until connection.unblocked.
    pub(super) upstream_blocked: bool,
    /// Whether the client asked for connection.blocked itself (the proxy always asks the
    /// upstream for it, and keeps it from a client that did not).
    pub(super) client_wants_blocked: bool,
    /// When the proxy last sent the client a heartbeat of its own (see
    /// [`Self::next_client_beat`]).
    pub(super) last_client_beat: Instant,
    /// Client channels with upstream content in progress.
    pub(super) incoming_in_progress: usize,
    pub(super) publisher: Option<Publisher>,
    /// The channel on which declares are checked with the upstream (open only during a check).
    pub(super) check: Option<CheckChannel>,
    /// A queue.declare waiting for the check's verdict (client reads pause meanwhile).
    pub(super) pending_check: Option<PendingCheck>,
    /// Whether the client's user may write the capture exchange (for its own queues).
    pub(super) capture_write: super::capture_write::CaptureWrite,
    /// The declare of an own queue waiting for the capture-write probe (client reads pause
    /// meanwhile).
    pub(super) held_for_write_probe: Option<WireFrame>,
    /// A basic.consume or basic.get waiting for its queue's arguments to be read back (client
    /// reads pause meanwhile).
    pub(super) pending_read: Option<PendingRead>,
    /// The status of this vhost's service connection (known once the connection is open;
    /// `None` when the vhost has none).
    pub(super) capture_status: Option<watch::Receiver<Status>>,
    /// How this session reaches the vhost's service connections: the declare connection for
    /// the declares, the service connection for the dead letters it publishes for it (`None`
    /// when the vhost has no service connection).
    pub(super) service: Option<ServiceHandle>,
    /// Where the service connection reports how the dead letters it published for this
    /// session ended (one entry per operation handed to it; see `intercept`).
    pub(super) service_outcomes: (OutcomeSender, mpsc::UnboundedReceiver<(OpId, Outcome)>),
    /// The answer to the declare the declare connection makes now, and until when it is
    /// waited for (client reads pause meanwhile).
    pub(super) service_answer: Option<oneshot::Receiver<CheckAnswer>>,
    pub(super) service_deadline: Option<Instant>,
    /// The management API's listing of the queue of `pending_read`, asked when the reply
    /// texts could not finish the read-back (client reads pause meanwhile).
    pub(super) listing_answer: Option<oneshot::Receiver<ArgumentsListing>>,
    /// A queue.declare naming the capture exchange, waiting for the capture objects to exist
    /// (client reads pause meanwhile).
    pub(super) held_for_capture: Option<HeldDeclare>,
    /// A client's channel.open for a channel number the proxy closed upstream whose close-ok
    /// has not come back yet (client reads pause meanwhile; see `forward`).
    pub(super) held_channel_open: Option<WireFrame>,
    pub(super) ops: HashMap<OpId, Op>,
    pub(super) next_op: OpId,
    /// The settings of the queues this session's deliveries came from.
    pub(super) view_cache: ViewCache,
    /// Operations whose publish was refused, waiting for their retry ([`super::retry`]).
    pub(super) held: RetrySchedule<Op>,
    /// The client's basic.gets and queue.declares (not nowait) whose answer has not come back
    /// from the upstream, on all channels; client reads pause at [`MAX_PENDING_ANSWERS`].
    pub(super) pending_answers: usize,
    /// The client's connection.close, held until the proxy's own work is settled, or until
    /// `parked_connection_until`.
    pub(super) parked_connection_close: Option<Bytes>,
    pub(super) parked_connection_until: Option<Instant>,
    /// The earliest time a parked close (the connection's, or a channel's) stops waiting for
    /// the proxy's publishes: they are abandoned then and the close goes on
    /// ([`Self::parked_closes_due`]).
    pub(super) parked_close_deadline: Option<Instant>,
    pub(super) shutdown_seen: bool,
    pub(super) counts: MessageCounts,
    /// Whether the client published on this connection before this turn (`counts` has this
    /// turn's publishes). A connection that never did has its dead letters published by the
    /// vhost's service connection (see `intercept`).
    pub(super) client_published: bool,
    /// A requeue counted against a delivery limit was refused to both the client's user and
    /// the service user (403): this connection's requeues go back natively, uncounted.
    pub(super) requeues_refused: bool,
    /// Whether a delivery of this session was ever given a consumer timeout. Until one is,
    /// no channel has a deadline, and the turns skip looking through the channels for one.
    pub(super) timed_deliveries: bool,
    /// The shared settings' revision as read in the turn at `now` ([`Self::turn_revision`]).
    pub(super) revision: Option<(Instant, SettingsRevision)>,
    /// The time of the current turn of the connection loop (read once per turn).
    pub(super) now: Instant,
    /// What consumer-timeout deadlines are counted from (milliseconds since it).
    pub(super) ack_epoch: Instant,
}

impl ClientSession {
    /// The state of a connection whose client sent the protocol header at `now` and whose
    /// upstream was reached; the handshake must be done by `handshake_deadline`.
    pub(super) fn new(
        shared: Arc<ProxyShared>,
        peer: SocketAddr,
        now: Instant,
        handshake_deadline: Instant,
    ) -> Self {
        let metrics = shared.metrics.clone();
        let client_out = Outbox::new(shared.outbox_bytes, Direction::ClientOut, metrics.clone());
        let upstream_out = Outbox::new(shared.outbox_bytes, Direction::UpstreamOut, metrics);
        let backoff = shared.retry_backoff;
        ClientSession {
            shared,
            peer,
            client_out,
            upstream_out,
            client_side: Side::Open,
            upstream_side: Side::Open,
            running: false,
            handshake_deadline,
            vhost: String::from("/"),
            upstream_tune: None,
            negotiated: None,
            new_frame_max: None,
            frame_max: crate::amqp::codec::FRAME_MIN_SIZE as usize,
            heartbeat: None,
            last_client_rx: now,
            last_upstream_rx: now,
            last_upstream_tx: now,
            channels: ChannelMap::default(),
            next_channel_id: 1,
            upstream_drain: ChannelMap::default(),
            inflight_bytes: 0,
            inflight_count: 0,
            dead_letter_bytes: 0,
            upstream_paused_since: None,
            upstream_blocked: false,
            client_wants_blocked: true,
            last_client_beat: now,
            incoming_in_progress: 0,
            publisher: None,
            check: None,
            pending_check: None,
            capture_write: Default::default(),
            held_for_write_probe: None,
            pending_read: None,
            capture_status: None,
            service: None,
            service_outcomes: mpsc::unbounded_channel(),
            service_answer: None,
            service_deadline: None,
            listing_answer: None,
            held_for_capture: None,
            held_channel_open: None,
            ops: HashMap::new(),
            next_op: 1,
            view_cache: ViewCache::default(),
            held: RetrySchedule::new(backoff),
            pending_answers: 0,
            parked_connection_close: None,
            parked_connection_until: None,
            parked_close_deadline: None,
            shutdown_seen: false,
            counts: MessageCounts::default(),
            client_published: false,
            requeues_refused: false,
            timed_deliveries: false,
            revision: None,
            ack_epoch: now,
            now,
        }
    }

    /// Whether both sides are closed: the connection is over.
    pub(super) fn is_done(&self) -> bool {
        self.client_side == Side::Closed && self.upstream_side == Side::Closed
    }

    /// Queues bytes for the client: dropped once the client side is closed, and once the
    /// proxy has sent it connection.close but for the connection's own methods (channel 0).
    /// The client discards everything else then, and the upstream is still read while the
    /// proxy's work drains, so its deliveries would otherwise pile up here unbounded for a
    /// client that may not read any more.
    pub(super) fn send_client(&mut self, bytes: Bytes) {
        match self.client_side {
            Side::Closed => {}
            Side::Closing { .. } if !is_connection_method(&bytes) => {}
            _ => {
                self.client_out.send(bytes);
            }
        }
    }

    /// Queues bytes for the upstream.
    pub(super) fn send_upstream(&mut self, bytes: Bytes) {
        if self.upstream_side != Side::Closed {
            self.last_upstream_tx = self.now;
            self.upstream_out.send(bytes);
        }
    }

    /// Queues a run of frames read from the client for the upstream, as they are: the first
    /// `len` bytes of `unread`, which are taken from it ([`super::passthrough`]).
    pub(super) fn send_upstream_run(&mut self, unread: &mut BytesMut, len: usize, frames: u64) {
        if self.upstream_side != Side::Closed {
            self.last_upstream_tx = self.now;
            self.upstream_out.send_run(unread, len, frames);
        } else {
            unread.advance(len);
        }
    }

    /// Queues a run of frames read from the upstream for the client, as they are (taken
    /// from `unread` as [`Self::send_upstream_run`] does).
    pub(super) fn send_client_run(&mut self, unread: &mut BytesMut, len: usize, frames: u64) {
        if self.client_side != Side::Closed {
            self.client_out.send_run(unread, len, frames);
        } else {
            unread.advance(len);
        }
    }

    /// Sends (or holds back while the client's content is in progress) a frame the proxy
    /// writes upstream on a client channel.
    pub(super) fn inject_upstream(&mut self, channel: u16, bytes: Bytes) {
        match self.channels.get_mut(&channel) {
            Some(ch) if !ch.upstream_idle() => ch.deferred_upstream.push(bytes),
            _ => self.send_upstream(bytes),
        }
    }

    /// Sends (or holds back while upstream content is in progress) a frame the proxy writes
    /// to the client on a client channel.
    pub(super) fn inject_client(&mut self, channel: u16, bytes: Bytes) {
        match self.channels.get_mut(&channel) {
            Some(ch) if !ch.client_idle() => ch.deferred_client.push(bytes),
            _ => self.send_client(bytes),
        }
    }

    pub(super) fn wants_client_frames(&self) -> bool {
        match self.client_side {
            Side::Closed => false,
            Side::Closing { .. } => true,
            Side::Open | Side::Draining { .. } => {
                !self.awaits_upstream_answer()
                    && (self.upstream_side != Side::Open
                        || (!self.upstream_out.is_full()
                            && self.pending_answers < MAX_PENDING_ANSWERS))
            }
        }
    }

    /// Whether client reads wait for an answer from the upstream (a declare check's, a
    /// read-back's, or the close-ok that frees a channel number the client is reopening).
    pub(super) fn awaits_upstream_answer(&self) -> bool {
        self.pending_check.is_some()
            || self.held_for_write_probe.is_some()
            || self.pending_read.is_some()
            || self.held_channel_open.is_some()
            || self.held_for_capture.is_some()
            || self.service_answer.is_some()
    }

    pub(super) fn wants_upstream_frames(&self) -> bool {
        if self.upstream_side == Side::Closed {
            return false;
        }
        if self.client_side != Side::Open {
            return true;
        }
        !self.client_out.is_full() && self.inflight_room()
    }

    /// Whether the kept deliveries leave room for reading more from the upstream.
    pub(super) fn inflight_room(&self) -> bool {
        // The client's unsettled deliveries pause reads at the bound: finish the content in
        // progress, then wait until settlements free room. The dead letters being published
        // or held count towards the bound only for what is kept of new deliveries (their
        // content is not kept past it, see `content_room`), never to pause: a client holding
        // nothing would wait for a full dead-letter queue to drain, without the answers and
        // heartbeats behind the deliveries. No pause either while client reads wait for an
        // upstream answer, or are paused for too many of them: the client cannot settle
        // anything then. Nor while the proxy's dead-letter publishes await their confirms on
        // this socket: only those confirms free them. What the upstream delivers then is
        // kept as its tag only, 128 bytes a delivery, until the kept deliveries reach twice
        // the bound (tens of thousands of deliveries); there reads stop until the client
        // settles some, and the confirms' deadlines wait with them (`upstream_paused`).
        let bound = self.shared.max_inflight_bytes;
        let deliveries = self.inflight_bytes.saturating_sub(self.dead_letter_bytes);
        deliveries < bound
            || self.incoming_in_progress > 0
            || self.awaits_upstream_answer()
            || self.pending_answers >= MAX_PENDING_ANSWERS
            || (deliveries < bound.saturating_mul(2) && self.awaits_confirms())
    }

    /// Whether reads from the upstream are paused while both sides are open (the client's
    /// outbox is full, or its unsettled deliveries fill the bound): the confirms of the
    /// proxy's publishes may then be waiting unread in the socket, so their deadlines do not
    /// run meanwhile (a confirm counted as missing would publish the dead letter again).
    pub(super) fn upstream_paused(&self) -> bool {
        self.client_side == Side::Open
            && self.upstream_side == Side::Open
            && !self.wants_upstream_frames()
    }

    /// When the proxy owes the client a heartbeat: the upstream's heartbeats reach the client
    /// only through reads, so while they are paused the proxy sends its own every half
    /// interval (the client would otherwise drop a connection RabbitMQ keeps alive). Not while
    /// bytes wait for the client: those reach it first, or it is not reading at all.
    fn next_client_beat(&self) -> Option<Instant> {
        let interval = self.heartbeat?;
        let since = self.upstream_paused_since?;
        (self.client_side == Side::Open && !self.client_out.has_work())
            .then(|| since.max(self.last_client_beat) + interval / 2)
    }

    /// Keeps the confirm deadlines still while upstream reads are paused or RabbitMQ holds
    /// the connection blocked: called each turn, it notes when a pause begins and, when it
    /// ends, moves the deadlines on by its length.
    fn track_upstream_pause(&mut self) {
        let paused = self.upstream_paused() || self.upstream_blocked;
        match (paused, self.upstream_paused_since) {
            (true, None) => self.upstream_paused_since = Some(self.now),
            (false, Some(since)) => {
                self.upstream_paused_since = None;
                if let Some(publisher) = self.publisher.as_mut() {
                    publisher.postpone(self.now.saturating_duration_since(since));
                }
            }
            _ => {}
        }
    }

    /// Whether publishes of the proxy's channel on this connection await their confirms.
    pub(super) fn awaits_confirms(&self) -> bool {
        self.publisher
            .as_ref()
            .is_some_and(|publisher| publisher.unconfirmed() > 0)
    }

    pub(super) fn next_deadline(&mut self) -> Option<Instant> {
        self.track_upstream_pause();
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        if !self.running {
            consider(Some(self.handshake_deadline));
        }
        for side in [self.client_side, self.upstream_side] {
            match side {
                Side::Draining { deadline } | Side::Closing { deadline, .. } => {
                    consider(Some(deadline))
                }
                _ => {}
            }
        }
        if self.upstream_paused_since.is_none()
            && let Some(publisher) = self.publisher.as_mut()
        {
            consider(publisher.next_deadline());
        }
        consider(self.held_for_capture.as_ref().map(|held| held.deadline));
        consider(self.parked_close_deadline);
        consider(self.service_deadline);
        consider(self.held.next_deadline());
        consider(self.next_consumer_timeout());
        consider(self.next_client_beat());
        if let Some(interval) = self.heartbeat {
            if self.client_side == Side::Open {
                consider(Some(self.last_client_rx + interval * 2));
            }
            if self.upstream_side != Side::Closed {
                consider(Some(self.last_upstream_rx + interval * 2));
            }
            if self.client_side != Side::Open
                && matches!(self.upstream_side, Side::Open | Side::Draining { .. })
            {
                consider(Some(self.last_upstream_tx + interval / 2));
            }
        }
        next
    }

    /// A frame read from the client at `now` (`None`: the client closed its socket; `Err`: a
    /// read failed or the bytes are not a frame).
    pub(super) fn client_read(
        &mut self,
        frame: Option<Result<WireFrame, FrameError>>,
        now: Instant,
    ) {
        self.now = now;
        match frame {
            Some(Ok(frame)) => {
                self.client_frames_read(1, frame.raw.len());
                self.on_client_frame(frame);
            }
            Some(Err(FrameError::Io(err))) => {
                tracing::debug!(peer = %self.peer, %err, "client connection failed");
                self.client_lost();
            }
            Some(Err(err)) => {
                tracing::info!(peer = %self.peer, %err, "malformed frame from client");
                self.close_client(reply::FRAME_ERROR, &format!("FRAME_ERROR - {err}"), 0, 0);
                // The byte stream cannot be followed any more: nothing else is read from the
                // client (the writer still delivers the close before the socket goes).
                self.client_side = Side::Closed;
            }
            None => self.client_lost(),
        }
    }

    /// A frame read from the upstream at `now` (as [`Self::client_read`]).
    pub(super) fn upstream_read(
        &mut self,
        frame: Option<Result<WireFrame, FrameError>>,
        now: Instant,
    ) {
        self.now = now;
        match frame {
            Some(Ok(frame)) => {
                self.upstream_frames_read(1, frame.raw.len());
                self.on_upstream_frame(frame);
            }
            Some(Err(err)) => {
                tracing::warn!(peer = %self.peer, %err, "upstream connection failed");
                self.upstream_lost("upstream connection lost");
            }
            None => self.upstream_lost("upstream connection closed"),
        }
    }

    /// Counts frames read from the client now (for heartbeats and the traffic metrics).
    pub(super) fn client_frames_read(&mut self, frames: u64, bytes: usize) {
        self.last_client_rx = self.now;
        self.counts.read_from_client.frames += frames;
        self.counts.read_from_client.bytes += bytes as u64;
    }

    /// Counts frames read from the upstream now.
    pub(super) fn upstream_frames_read(&mut self, frames: u64, bytes: usize) {
        self.last_upstream_rx = self.now;
        self.counts.read_from_upstream.frames += frames;
        self.counts.read_from_upstream.bytes += bytes as u64;
    }

    /// The shared settings' revision, read once per turn of the connection loop (per `now`)
    /// rather than once per delivery: reading it takes the policy set's lock. A decision
    /// cached under it is still taken again the turn after the settings change.
    pub(super) fn turn_revision(&mut self) -> SettingsRevision {
        match self.revision {
            Some((at, revision)) if at == self.now => revision,
            _ => {
                let revision = self.shared.settings_revision();
                self.revision = Some((self.now, revision));
                revision
            }
        }
    }

    /// Adds what this turn counted to the shared metrics: the frames and bytes read, the
    /// messages, the kept deliveries and the bytes queued in both outboxes. Called before the
    /// loop waits, and at the end.
    pub(super) fn report_counts(&mut self) {
        let counts = std::mem::take(&mut self.counts);
        let metrics = &self.shared.metrics;
        let (client, upstream) = (counts.read_from_client, counts.read_from_upstream);
        metrics.traffic(Direction::ClientIn, client.frames, client.bytes);
        metrics.traffic(Direction::UpstreamIn, upstream.frames, upstream.bytes);
        if counts.published > 0 {
            metrics.published(counts.published);
            self.client_published = true;
        }
        if counts.delivered > 0 {
            metrics.delivered(counts.delivered);
        }
        if counts.acked > 0 {
            metrics.acked(counts.acked);
        }
        if counts.kept != 0 || counts.kept_bytes != 0 {
            metrics.add_inflight(counts.kept, counts.kept_bytes);
        }
        self.client_out.report_gauge();
        self.upstream_out.report_gauge();
    }

    /// Notices writer failures (a peer gone while we only write to it).
    pub(super) fn check_writers(&mut self) {
        if self.client_out.has_failed() && self.client_side != Side::Closed {
            self.client_lost();
        }
        if self.upstream_out.has_failed() && self.upstream_side != Side::Closed {
            self.upstream_lost("upstream connection lost");
        }
    }

    /// The time is `now`: deadlines that passed (heartbeats, confirms, retries, consumer
    /// timeouts, closes, the handshake) take effect.
    pub(super) fn on_timer(&mut self, now: Instant) {
        self.now = now;
        if !self.running && now >= self.handshake_deadline {
            tracing::info!(peer = %self.peer, "handshake did not complete in time");
            self.client_side = Side::Closed;
            self.upstream_side = Side::Closed;
            return;
        }
        self.capture_wait_expired(now);
        self.service_wait_expired(now);
        self.parked_closes_due(now);
        if self.upstream_paused_since.is_none()
            && let Some(publisher) = self.publisher.as_mut()
        {
            let expired = publisher.expire(now);
            if let Some(write) = expired.write {
                self.send_upstream(write);
            }
            if let Some(cause) = expired.reopened {
                self.shared.metrics.publisher_channel_reopened(cause);
            }
            for settled in expired.settled {
                self.complete_op(settled.op, settled.outcome);
            }
        }
        self.retry_due(now);
        self.consumer_timeouts_due(now);
        if self.next_client_beat().is_some_and(|at| now >= at) {
            let mut beat = bytes::BytesMut::new();
            put_heartbeat(&mut beat);
            self.send_client(beat.freeze());
            self.last_client_beat = now;
        }
        if let Some(interval) = self.heartbeat {
            if self.client_side == Side::Open && now >= self.last_client_rx + interval * 2 {
                tracing::info!(peer = %self.peer, "client missed heartbeats");
                self.client_lost();
            }
            if self.upstream_side != Side::Closed && now >= self.last_upstream_rx + interval * 2 {
                self.upstream_lost("upstream missed heartbeats");
            }
            if self.client_side != Side::Open
                && matches!(self.upstream_side, Side::Open | Side::Draining { .. })
                && now >= self.last_upstream_tx + interval / 2
            {
                let mut beat = bytes::BytesMut::new();
                put_heartbeat(&mut beat);
                self.send_upstream(beat.freeze());
            }
        }
        if let Side::Draining { deadline } = self.upstream_side
            && now >= deadline
        {
            self.close_upstream_now();
        }
        for side in [&mut self.client_side, &mut self.upstream_side] {
            if let Side::Closing { deadline, .. } = *side
                && now >= deadline
            {
                *side = Side::Closed;
            }
        }
    }

    pub(super) fn on_shutdown(&mut self) {
        self.shutdown_seen = true;
        if self.client_side == Side::Open {
            self.close_client(
                reply::CONNECTION_FORCED,
                "CONNECTION_FORCED - dlx-proxy is shutting down",
                0,
                0,
            );
        }
    }

    /// Closes the client side with a connection.close of the proxy's own; the upstream is
    /// closed once the proxy's work is settled.
    pub(super) fn close_client(&mut self, code: u16, text: &str, class_id: u16, method_id: u16) {
        if self.client_side == Side::Open {
            let text = ShortString::try_new(reply::truncate_str(text, 255))
                .unwrap_or_else(|_| ShortString::from("CONNECTION_FORCED"));
            let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: code,
                reply_text: text,
                class_id,
                method_id,
            }));
            self.client_out.send(method_frame(0, close));
            self.client_side = Side::Closing {
                deadline: self.now + CLOSE_GRACE,
                forward_ok: false,
            };
        }
        self.drain_upstream();
    }

    /// The client is gone: nothing more is sent to it; the upstream is closed after the
    /// proxy's work is settled (its unacked deliveries then go back to their queues).
    fn client_lost(&mut self) {
        if self.client_side == Side::Closed {
            return;
        }
        self.client_side = Side::Closed;
        self.drain_upstream();
    }

    /// Starts closing the upstream once no proxy publish is unsettled. The client's unsettled
    /// deliveries of queues whose delivery limit the proxy counts are counted first
    /// ([`ClientSession::count_returns`]).
    fn drain_upstream(&mut self) {
        if self.upstream_side == Side::Open {
            let channels: Vec<u16> = self.channels.keys().collect();
            for channel in channels {
                self.count_returns(channel);
            }
            let deadline = self.now + self.shared.confirm_timeout + Duration::from_secs(1);
            self.upstream_side = Side::Draining { deadline };
        }
        self.maybe_finish_draining();
    }

    /// Called whenever an operation ends: a drained upstream is closed, a parked close is sent.
    pub(super) fn maybe_finish_draining(&mut self) {
        if !self.ops.is_empty() {
            return;
        }
        if matches!(self.upstream_side, Side::Draining { .. }) {
            self.close_upstream_now();
        }
        if let Some(close) = self.parked_connection_close.take() {
            self.forward_client_connection_close(close);
            self.refresh_parked_deadline();
        }
    }

    fn close_upstream_now(&mut self) {
        if matches!(self.upstream_side, Side::Open | Side::Draining { .. }) {
            let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: reply::REPLY_SUCCESS,
                reply_text: ShortString::from("client connection closed"),
                class_id: 0,
                method_id: 0,
            }));
            self.send_upstream(method_frame(0, close));
            self.upstream_side = Side::Closing {
                deadline: self.now + Duration::from_secs(2),
                forward_ok: false,
            };
            self.fail_all_ops();
        }
    }

    /// The upstream is gone: the client gets 320 CONNECTION_FORCED (during the handshake, a
    /// closed socket, as the upstream gave).
    pub(super) fn upstream_lost(&mut self, reason: &str) {
        if self.upstream_side == Side::Closed {
            return;
        }
        let was_closing = matches!(self.upstream_side, Side::Closing { .. });
        let client_awaits_close_ok = matches!(
            self.upstream_side,
            Side::Closing {
                forward_ok: true,
                ..
            }
        );
        self.upstream_side = Side::Closed;
        self.fail_all_ops();
        if self.running && !was_closing {
            // The node may be down: have the reachability check look.
            self.shared.upstream.report_lost();
        }
        if client_awaits_close_ok && self.client_side != Side::Closed {
            // The client asked to close and the upstream went away first: confirm it ourselves.
            self.client_out.send(method_frame(
                0,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
            ));
            self.client_side = Side::Closed;
            return;
        }
        if self.client_side == Side::Open && !self.running {
            // Refused during the handshake without a connection.close (RabbitMQ does that for
            // an unknown mechanism, or a failed login without `authentication_failure_close`):
            // the client sees the same, its socket closed.
            tracing::info!(peer = %self.peer, reason, "upstream ended the handshake");
            self.client_side = Side::Closed;
            return;
        }
        if self.client_side == Side::Open && !was_closing {
            tracing::warn!(peer = %self.peer, reason, "closing client connection");
            self.client_out.send(method_frame(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                    reply_code: reply::CONNECTION_FORCED,
                    reply_text: ShortString::try_new(format!("CONNECTION_FORCED - {reason}"))
                        .unwrap_or_else(|_| ShortString::from("CONNECTION_FORCED")),
                    class_id: 0,
                    method_id: 0,
                })),
            ));
            self.client_side = Side::Closing {
                deadline: self.now + CLOSE_GRACE,
                forward_ok: false,
            };
        } else if self.client_side == Side::Open {
            self.client_side = Side::Closed;
        }
    }

    /// Every operation ends without settling its original (the connection is going away, so
    /// the upstream requeues the originals itself).
    fn fail_all_ops(&mut self) {
        self.abandon_all_ops();
    }

    /// Until when a close parked now waits for the proxy's publishes:
    /// `proxy.confirm_timeout_secs`. They can take longer: while RabbitMQ blocks the
    /// connection that publishes them (a resource alarm) their confirm deadlines stand still,
    /// and one the service connection publishes has none here.
    pub(super) fn close_wait_deadline(&self) -> Instant {
        self.now + self.shared.confirm_timeout
    }

    /// Recomputes the earliest deadline of the parked closes (call when one is parked or
    /// goes on).
    pub(super) fn refresh_parked_deadline(&mut self) {
        let channels = self
            .channels
            .values()
            .filter(|ch| ch.parked_close.is_some())
            .filter_map(|ch| ch.parked_until);
        let connection = self
            .parked_connection_close
            .as_ref()
            .and(self.parked_connection_until);
        self.parked_close_deadline = channels.chain(connection).min();
    }

    /// Parked closes whose deadline passed: the publishes they wait for are abandoned (the
    /// close requeues their originals upstream; one that still lands is a duplicate, never a
    /// loss), and the closes go on. Not while RabbitMQ blocks this connection: it would read
    /// the close no sooner than the confirms, so they are waited for a while longer.
    fn parked_closes_due(&mut self, now: Instant) {
        if self.parked_close_deadline.is_none_or(|at| now < at) {
            return;
        }
        if self.upstream_blocked {
            self.parked_close_deadline = Some(now + self.shared.confirm_timeout);
            return;
        }
        let whole_connection = self.parked_connection_close.is_some()
            && self.parked_connection_until.is_some_and(|at| at <= now);
        let due: Vec<(u16, u64)> = self
            .channels
            .iter()
            .filter(|(_, ch)| {
                ch.parked_close.is_some() && ch.parked_until.is_some_and(|at| at <= now)
            })
            .map(|(number, ch)| (number, ch.id))
            .collect();
        let stuck: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, op)| {
                whole_connection
                    || matches!(op.origin, Origin::Client { channel, channel_id, .. }
                        if due.contains(&(channel, channel_id)))
            })
            .map(|(id, _)| *id)
            .collect();
        if !stuck.is_empty() {
            tracing::warn!(
                peer = %self.peer,
                publishes = stuck.len(),
                "a close waited past proxy.confirm_timeout_secs for the proxy's publishes; \
                 they are abandoned and their originals requeued"
            );
        }
        for op in stuck {
            self.abandon_op(op);
        }
        self.maybe_finish_draining();
        self.refresh_parked_deadline();
        if self.parked_close_deadline.is_some_and(|at| at <= now) {
            // Nothing left to abandon for it (cannot happen): never a deadline in the past.
            self.parked_close_deadline = Some(now + self.shared.confirm_timeout);
        }
    }

    /// Releases everything the connection still holds (gauges).
    pub(super) fn finish(&mut self) {
        if std::mem::take(&mut self.upstream_blocked) {
            self.shared
                .metrics
                .add_upstream_connection_blocked(crate::metrics::BLOCKED_CLIENT, -1);
        }
        self.let_go_held(|_| true);
        let channels: Vec<u16> = self.channels.keys().collect();
        for channel in channels {
            self.remove_channel(channel);
        }
        self.report_counts();
    }
}

/// Whether `frame` (whole frames' bytes) starts with a method frame on channel 0.
fn is_connection_method(frame: &[u8]) -> bool {
    matches!(frame, [kind, 0, 0, ..] if *kind == crate::amqp::codec::FRAME_METHOD)
}

#[cfg(test)]
pub(super) mod tests;
