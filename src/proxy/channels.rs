//! What the proxy tracks for each client channel: its lifecycle, where its deliveries come
//! from (consumers and pending gets), content in progress in both directions, kept
//! deliveries, and frames the proxy must hold back until a content sequence is complete.
//!
//! AMQP content (method, header, bodies) must not be interleaved with other frames on the same
//! channel, so a frame the proxy injects on a client channel (a deferred ack upstream, a
//! channel.close to the client) waits in `deferred_*` while content is in progress there.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::inflight::{ChannelDeliveries, KeptDelivery, KeptMessage};
use super::wire::content_body_size;
use crate::amqp::codec::{FRAME_BODY, FRAME_HEADER};

/// Where a channel is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelPhase {
    Open,
    /// The client sent channel.close; forwarded (or parked until the proxy's own work on
    /// the channel is settled); waiting for the upstream's close-ok.
    ClosingByClient,
    /// The upstream sent channel.close (forwarded); waiting for the client's close-ok.
    ClosingByUpstream,
    /// The proxy closed the channel on both sides (a refused declare); waiting for the
    /// client's close-ok (the upstream's is swallowed separately).
    ClosedByProxy,
}

/// Where deliveries of one consumer come from.
#[derive(Clone, Debug)]
pub struct Source {
    pub queue: Arc<str>,
    pub no_ack: bool,
    /// Whether deliveries keep their content ([`super::ProxyShared::may_take_over`]), and the
    /// settings that answer came from.
    pub(crate) keeps_content: Option<(super::SettingsRevision, bool)>,
    /// The consumer timeout of its deliveries, and the settings that answer came from.
    pub(crate) timeout: Option<(super::SettingsRevision, Option<u64>)>,
    /// The client cancelled it with `nowait`: it is kept only for deliveries already on the
    /// way ([`ClientChannel::cancel_consumer_nowait`]).
    pub(crate) cancelled: bool,
}

impl Source {
    pub fn new(queue: Arc<str>, no_ack: bool) -> Self {
        Source {
            queue,
            no_ack,
            keeps_content: None,
            timeout: None,
            cancelled: false,
        }
    }

    /// Whether this source's deliveries keep their content; asked of the shared settings once
    /// per [`super::SettingsRevision`].
    pub(crate) fn keeps_content(
        &mut self,
        revision: super::SettingsRevision,
        shared: &super::ProxyShared,
        vhost: &str,
    ) -> bool {
        match self.keeps_content {
            Some((seen, answer)) if seen == revision => answer,
            _ => {
                let answer = shared.may_take_over(vhost, &self.queue);
                self.keeps_content = Some((revision, answer));
                answer
            }
        }
    }

    /// How a delivery from this source is kept, or `None` when it is not: a no-ack source's
    /// deliveries never are, nor any while `keeping` is false (the session keeps none, or the
    /// channel is not open). Asks [`Self::keeps_content`] only where the session may take
    /// deliveries over (`takes_over`). Without `content_room` (the connection's kept bytes are
    /// at `proxy.max_inflight_bytes`) a delivery whose content would be kept is kept as its tag
    /// only, and the decision says so (`content_skipped`).
    pub(crate) fn keep_decision(
        &mut self,
        keeping: bool,
        takes_over: bool,
        content_room: bool,
        revision: super::SettingsRevision,
        shared: &super::ProxyShared,
        vhost: &str,
    ) -> Option<KeepDecision> {
        if self.no_ack || !keeping {
            return None;
        }
        let wants_content = takes_over && self.keeps_content(revision, shared, vhost);
        let with_content = wants_content && content_room;
        let timeout = self.consumer_timeout(revision, shared, vhost);
        // A tag-only delivery without a timeout needs no queue (and no shared count).
        let queue = (with_content || timeout.is_some()).then(|| self.queue.clone());
        Some(KeepDecision {
            with_content,
            content_skipped: wants_content && !content_room,
            queue,
            timeout,
        })
    }

    /// The consumer timeout (ms) of this source's deliveries; asked of the shared settings
    /// once per [`super::SettingsRevision`].
    pub(crate) fn consumer_timeout(
        &mut self,
        revision: super::SettingsRevision,
        shared: &super::ProxyShared,
        vhost: &str,
    ) -> Option<u64> {
        match self.timeout {
            Some((seen, answer)) if seen == revision => answer,
            _ => {
                let answer = shared.consumer_timeout(vhost, &self.queue);
                self.timeout = Some((revision, answer));
                answer
            }
        }
    }
}

/// A queue.declare waiting for its declare-ok.
#[derive(Clone, Debug, Default)]
pub struct PendingDeclare {
    /// What the declare-ok confirms about the queue (None: nothing, e.g. a passive declare).
    pub record: Option<super::registry::VerifiedQueue>,
}

/// Content (method + header + bodies) arriving from the upstream on a client channel.
#[derive(Debug)]
pub struct IncomingContent {
    /// Set when the delivery is kept.
    pub keep: Option<KeepBuilder>,
    /// Body bytes still expected (None until the header arrived).
    pub remaining: Option<u64>,
}

/// How one delivery is kept (`Source::keep_decision`).
#[derive(Debug)]
pub struct KeepDecision {
    /// With its content (the proxy may take it over), or as its tag only.
    pub with_content: bool,
    /// Kept as its tag only for want of room, where its content would have been kept: a
    /// negative settlement of it goes upstream as the client sent it.
    pub content_skipped: bool,
    /// Its queue, where the kept delivery needs it (see [`KeptDelivery::queue`]).
    pub queue: Option<Arc<str>>,
    /// Its consumer timeout (ms), if it has one.
    pub timeout: Option<u64>,
}

/// A kept delivery being assembled.
#[derive(Debug)]
pub struct KeepBuilder {
    pub delivery_tag: u64,
    /// Its queue, where the kept delivery needs it (see [`KeptDelivery::queue`]).
    pub queue: Option<Arc<str>>,
    pub redelivered: bool,
    /// Its consumer timeout (ms), if it has one.
    pub timeout: Option<u64>,
    /// The message being copied (its exchange, routing key and properties) when the delivery
    /// keeps its content; else only the tag and queue are kept.
    pub message: Option<Box<KeptMessage>>,
    /// The body as its frames arrive (with `message` only).
    pub body: BytesMut,
}

impl KeepBuilder {
    /// A delivery to keep; `content` (its exchange and routing key) when its properties and
    /// body are kept too; `queue` where the kept delivery needs it ([`KeptDelivery::queue`]).
    pub fn new(
        delivery_tag: u64,
        queue: Option<Arc<str>>,
        content: Option<(&str, &str)>,
        redelivered: bool,
    ) -> Self {
        KeepBuilder {
            delivery_tag,
            queue,
            redelivered,
            timeout: None,
            message: content.map(|(exchange, routing_key)| {
                Box::new(KeptMessage {
                    exchange: exchange.to_string(),
                    routing_key: routing_key.to_string(),
                    ..KeptMessage::default()
                })
            }),
            body: BytesMut::new(),
        }
    }

    /// A delivery to keep as `decision` says; `content` is its exchange and routing key.
    pub fn decided(
        delivery_tag: u64,
        decision: KeepDecision,
        content: (&str, &str),
        redelivered: bool,
    ) -> Self {
        let content = decision.with_content.then_some(content);
        let mut keep = KeepBuilder::new(delivery_tag, decision.queue, content, redelivered);
        keep.timeout = decision.timeout;
        keep
    }

    /// The kept delivery.
    pub fn finish(self) -> (u64, KeptDelivery) {
        let body = self.body;
        let message = self.message.map(|mut message| {
            message.body = body.freeze();
            message
        });
        (
            self.delivery_tag,
            KeptDelivery {
                queue: self.queue,
                redelivered: self.redelivered,
                deadline: None,
                message,
            },
        )
    }
}

/// Client → upstream content in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutgoingContent {
    AwaitingHeader,
    Body { remaining: u64 },
}

/// One client channel.
#[derive(Debug)]
pub struct ClientChannel {
    /// Unique per opening, so late work for a closed channel is recognised.
    pub id: u64,
    pub phase: ChannelPhase,
    pub consumers: HashMap<String, Source>,
    /// Tags of consumers the client cancelled with `nowait` (no cancel-ok comes to remove
    /// them), oldest first; see [`Self::cancel_consumer_nowait`].
    cancelled: VecDeque<String>,
    /// basic.consume sent (not nowait), consume-ok not yet seen.
    pub pending_consumes: VecDeque<Source>,
    /// basic.get sent, get-ok / get-empty not yet seen.
    pub pending_gets: VecDeque<Source>,
    pub pending_declares: VecDeque<PendingDeclare>,
    /// The queue most recently declared on this channel (what "" means in consume/get).
    pub last_queue: Option<Arc<str>>,
    pub incoming: Option<IncomingContent>,
    pub outgoing: Option<OutgoingContent>,
    pub deliveries: ChannelDeliveries,
    /// Proxy work (dead-letter, requeue) not yet settled for this channel.
    pub ops: usize,
    /// Frames for the upstream held until the client's content sequence ends.
    pub deferred_upstream: Vec<Bytes>,
    /// Frames for the client held until the upstream's content sequence ends.
    pub deferred_client: Vec<Bytes>,
    /// The client's channel.close, held until `ops` reaches 0 or `parked_until` passes.
    pub parked_close: Option<Bytes>,
    /// When a parked close stops waiting (`proxy.confirm_timeout_secs` after it was parked).
    pub parked_until: Option<std::time::Instant>,
    /// The proxy closed this channel towards the client (a consumer timeout) and closes it
    /// upstream as if the client had: `(client's close-ok seen, upstream's close-ok seen)`;
    /// the channel is gone once both are.
    pub closed_for_client: Option<(bool, bool)>,
    /// A channel.close of the client's crossing the proxy's close was answered: later ones
    /// are not (each would queue another close-ok for a client that may not read).
    pub crossing_close_answered: bool,
    /// tx.select was used: injected acks would join the client's transaction.
    pub transactional: bool,
    /// Consumers the proxy named (nowait consumes without a tag), for the next name.
    named_consumers: u64,
}

impl ClientChannel {
    pub fn new(id: u64) -> Self {
        ClientChannel {
            id,
            phase: ChannelPhase::Open,
            consumers: HashMap::new(),
            cancelled: VecDeque::new(),
            pending_consumes: VecDeque::new(),
            pending_gets: VecDeque::new(),
            pending_declares: VecDeque::new(),
            last_queue: None,
            incoming: None,
            outgoing: None,
            deliveries: ChannelDeliveries::default(),
            ops: 0,
            deferred_upstream: Vec::new(),
            deferred_client: Vec::new(),
            parked_close: None,
            parked_until: None,
            closed_for_client: None,
            crossing_close_answered: false,
            transactional: false,
            named_consumers: 0,
        }
    }

    /// A consumer tag for a `nowait` basic.consume that has none. The upstream would make one
    /// up and, with no consume-ok, tell nobody: the deliveries would carry a tag the proxy
    /// does not know (kept untracked: no dead-lettering by the proxy, no consumer timeout,
    /// requeues not counted). The proxy names the consumer instead, as RabbitMQ names its own
    /// (`amq.ctag-...`); the client, which learns no tag either way, sees it on deliveries.
    pub fn name_consumer(&mut self) -> String {
        loop {
            self.named_consumers += 1;
            let name = format!("amq.ctag-dlx-proxy-{}-{}", self.id, self.named_consumers);
            // A client may have chosen that name itself.
            if !self.consumers.contains_key(&name) {
                return name;
            }
        }
    }

    /// The queue a consume or get names ("" = the last declared one).
    pub fn resolve_queue(&self, named: &str) -> Arc<str> {
        if named.is_empty()
            && let Some(last) = &self.last_queue
        {
            return last.clone();
        }
        Arc::from(named)
    }

    /// Whether frames may be injected upstream now (no client content in progress).
    pub fn upstream_idle(&self) -> bool {
        self.outgoing.is_none()
    }

    /// Whether frames may be injected to the client now (no upstream content in progress).
    pub fn client_idle(&self) -> bool {
        self.incoming.is_none()
    }

    /// A basic.publish from the client: its content follows.
    pub fn publish_started(&mut self) {
        self.outgoing = Some(OutgoingContent::AwaitingHeader);
    }

    /// The content header of a publish as it goes upstream, when it is not the header the
    /// client sent: a publish's BCC keys are kept for dead-lettering (see `bcc`), within
    /// `max_payload` (the frame size less its overhead). `None` for other frames and for
    /// headers forwarded as they are.
    pub fn publish_header_rewrite(
        &self,
        kind: u8,
        payload: &[u8],
        max_payload: usize,
    ) -> Option<Bytes> {
        if kind != FRAME_HEADER || self.outgoing != Some(OutgoingContent::AwaitingHeader) {
            return None;
        }
        super::bcc::publish_header(payload, max_payload)
    }

    /// Follows a content frame of the client's publish; `true` when it ended the content
    /// (frames deferred meanwhile may go then).
    pub fn outgoing_seen(&mut self, kind: u8, payload: &[u8]) -> bool {
        let left = match (kind, self.outgoing) {
            (FRAME_HEADER, Some(OutgoingContent::AwaitingHeader)) => {
                content_body_size(payload).unwrap_or(0)
            }
            (FRAME_BODY, Some(OutgoingContent::Body { remaining })) => {
                remaining.saturating_sub(payload.len() as u64)
            }
            // Out of sequence: the upstream will refuse it; stop tracking.
            _ => return self.outgoing.take().is_some(),
        };
        self.outgoing = (left > 0).then_some(OutgoingContent::Body { remaining: left });
        left == 0
    }

    /// The content header of a delivery as it goes to the client, when it is not the header
    /// the upstream sent: clients never see the proxy's private header (the kept copy has
    /// it). `None` for other frames and for headers forwarded as they are.
    pub fn delivered_header_rewrite(&self, kind: u8, payload: &[u8]) -> Option<Bytes> {
        if kind != FRAME_HEADER || self.incoming.is_none() {
            return None;
        }
        super::bcc::delivered_header(payload)
    }

    /// At the content header of a delivery kept with its content: a body announced larger
    /// than `limit` (`proxy.max_inflight_bytes`) is not copied, and the delivery is kept as
    /// its tag only, as past the bound. A delivery starts with its content only below the
    /// bound, so the kept bytes stay under twice the bound whatever the size of one message
    /// (RabbitMQ accepts messages of hundreds of MiB). Returns whether it dropped the content
    /// (call before [`Self::incoming_seen`]).
    pub fn keeps_no_content_past(&mut self, kind: u8, payload: &[u8], limit: usize) -> bool {
        if kind != FRAME_HEADER {
            return false;
        }
        let Some(keep) = self
            .incoming
            .as_mut()
            .and_then(|incoming| incoming.keep.as_mut())
            .filter(|keep| keep.message.is_some())
        else {
            return false;
        };
        let announced = content_body_size(payload).unwrap_or(0);
        if announced <= limit as u64 {
            return false;
        }
        keep.message = None;
        true
    }

    /// Follows a content frame of a delivery (and keeps its content when the delivery is
    /// kept with it). `Some` when it ended the content, with the delivery to keep if any.
    pub fn incoming_seen(&mut self, kind: u8, payload: &[u8]) -> Option<Option<KeepBuilder>> {
        let incoming = self.incoming.as_mut()?;
        let mut finished = false;
        if kind == FRAME_HEADER {
            let size = content_body_size(payload).unwrap_or(0);
            incoming.remaining = Some(size);
            if let Some(keep) = incoming.keep.as_mut()
                && let Some(message) = keep.message.as_mut()
            {
                message.raw_properties =
                    Bytes::copy_from_slice(payload.get(12..).unwrap_or_default());
                keep.body.reserve(size.min(16 * 1024 * 1024) as usize);
            }
            finished = size == 0;
        } else if let Some(remaining) = incoming.remaining.as_mut() {
            *remaining = remaining.saturating_sub(payload.len() as u64);
            if let Some(keep) = incoming.keep.as_mut().filter(|k| k.message.is_some()) {
                keep.body.extend_from_slice(payload);
            }
            finished = *remaining == 0;
        }
        finished.then(|| self.incoming.take().and_then(|i| i.keep))
    }

    /// Keeps a delivery whose content ended. `clock` gives the session's milliseconds for
    /// its consumer timeout, read only when it has one. Returns the bytes charged and
    /// whether it has a timeout.
    pub fn keep_finished(
        &mut self,
        builder: KeepBuilder,
        clock: impl FnOnce() -> u64,
    ) -> (usize, bool) {
        let timeout = builder.timeout;
        let (tag, delivery) = builder.finish();
        self.keep_delivery(tag, delivery, timeout, clock)
    }

    /// Keeps a delivery whose content the proxy does not keep (its tag, and its queue where
    /// `decision` gives one), as [`Self::keep_finished`] keeps an assembled one, with no
    /// builder: the forwarding fast path keeps most deliveries this way.
    pub fn keep_without_content(
        &mut self,
        tag: u64,
        redelivered: bool,
        decision: KeepDecision,
        clock: impl FnOnce() -> u64,
    ) -> (usize, bool) {
        let delivery = KeptDelivery {
            queue: decision.queue,
            redelivered,
            deadline: None,
            message: None,
        };
        self.keep_delivery(tag, delivery, decision.timeout, clock)
    }

    fn keep_delivery(
        &mut self,
        tag: u64,
        delivery: KeptDelivery,
        timeout: Option<u64>,
        clock: impl FnOnce() -> u64,
    ) -> (usize, bool) {
        let charge = self.deliveries.keep(tag, delivery);
        if let Some(timeout) = timeout {
            self.deliveries.time(tag, clock(), timeout);
        }
        (charge, timeout.is_some())
    }

    /// Consumers of this channel that are not cancelled.
    pub fn active_consumers(&self) -> usize {
        self.consumers.len() - self.cancelled_consumers()
    }

    fn cancelled_consumers(&self) -> usize {
        self.consumers.values().filter(|s| s.cancelled).count()
    }

    /// Consumers started and asked for (basic.consume sent, consume-ok not yet seen): what
    /// `limits.max_consumers_per_channel` bounds.
    pub fn consumers_started_or_asked(&self) -> usize {
        self.active_consumers() + self.pending_consumes.len()
    }

    /// Records a started consumer; returns the change in [`Self::active_consumers`] (0 when
    /// it replaces an active consumer of the same tag, which the upstream refuses anyway).
    pub fn add_consumer(&mut self, tag: String, source: Source) -> i64 {
        match self.consumers.insert(tag, source) {
            Some(old) if !old.cancelled => 0,
            _ => 1,
        }
    }

    /// Forgets the consumer `tag` (cancel-ok, or the upstream cancelled it); returns the
    /// change in [`Self::active_consumers`].
    pub fn remove_consumer(&mut self, tag: &str) -> i64 {
        match self.consumers.remove(tag) {
            Some(old) if !old.cancelled => -1,
            _ => 0,
        }
    }

    /// The client cancelled consumer `tag` with `nowait`. Its source stays for deliveries the
    /// upstream sent before it saw the cancel, but no longer counts as a consumer; once more
    /// than `keep_at_most` cancelled sources are kept, the oldest go. Returns the change in
    /// [`Self::active_consumers`].
    pub fn cancel_consumer_nowait(&mut self, tag: &str, keep_at_most: usize) -> i64 {
        let Some(source) = self.consumers.get_mut(tag) else {
            return 0;
        };
        if source.cancelled {
            return 0;
        }
        source.cancelled = true;
        self.cancelled.push_back(tag.to_string());
        while self.cancelled.len() > keep_at_most {
            let Some(oldest) = self.cancelled.pop_front() else {
                break;
            };
            // The tag may have been reused by a consumer started since.
            if self.consumers.get(&oldest).is_some_and(|s| s.cancelled) {
                self.consumers.remove(&oldest);
            }
        }
        -1
    }

    /// The consumer with this tag. A channel with one consumer (the usual case) compares
    /// the tag instead of hashing it, once per delivery.
    pub fn consumer_mut(&mut self, tag: &str) -> Option<&mut Source> {
        if self.consumers.len() == 1 {
            return self
                .consumers
                .iter_mut()
                .next()
                .and_then(|(known, source)| (known.as_str() == tag).then_some(source));
        }
        self.consumers.get_mut(tag)
    }

    pub fn is_open(&self) -> bool {
        self.phase == ChannelPhase::Open
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::inflight::KEPT_OVERHEAD;

    #[test]
    fn a_name_the_proxy_gives_a_consumer_is_not_one_the_client_uses() {
        let mut ch = ClientChannel::new(3);
        ch.add_consumer(
            "amq.ctag-dlx-proxy-3-1".into(),
            Source::new("q".into(), false),
        );
        assert_eq!(ch.name_consumer(), "amq.ctag-dlx-proxy-3-2");
        assert_eq!(ch.name_consumer(), "amq.ctag-dlx-proxy-3-3");
    }

    #[test]
    fn consumers_are_found_by_tag_with_one_or_several() {
        let mut ch = ClientChannel::new(1);
        assert!(ch.consumer_mut("a").is_none());
        ch.consumers
            .insert("a".into(), Source::new(Arc::from("qa"), false));
        assert_eq!(&*ch.consumer_mut("a").unwrap().queue, "qa");
        assert!(ch.consumer_mut("b").is_none(), "one consumer, another tag");
        ch.consumers
            .insert("b".into(), Source::new(Arc::from("qb"), true));
        assert_eq!(&*ch.consumer_mut("b").unwrap().queue, "qb");
        assert_eq!(&*ch.consumer_mut("a").unwrap().queue, "qa");
        assert!(ch.consumer_mut("c").is_none());
    }

    #[test]
    fn consumers_count_until_cancelled_and_cancelled_ones_are_bounded() {
        let source = || Source::new(Arc::from("q"), false);
        let mut ch = ClientChannel::new(1);
        assert_eq!(ch.add_consumer("a".into(), source()), 1);
        assert_eq!(ch.add_consumer("b".into(), source()), 1);
        // The same tag again replaces an active consumer: no new one.
        assert_eq!(ch.add_consumer("b".into(), source()), 0);
        ch.pending_consumes.push_back(source());
        assert_eq!(ch.consumers_started_or_asked(), 3);

        // A nowait cancel stops counting at once; the source stays for deliveries on the way.
        assert_eq!(ch.cancel_consumer_nowait("a", 2), -1);
        assert_eq!(ch.cancel_consumer_nowait("a", 2), 0, "cancelled once");
        assert_eq!(ch.cancel_consumer_nowait("zz", 2), 0, "unknown tag");
        assert_eq!(ch.active_consumers(), 1);
        assert_eq!(ch.consumers_started_or_asked(), 2);
        assert_eq!(&*ch.consumer_mut("a").unwrap().queue, "q");
        // A cancel-ok for it later changes nothing more; for an active one it ends it.
        assert_eq!(ch.remove_consumer("a"), 0);
        assert_eq!(ch.remove_consumer("b"), -1);
        assert_eq!(ch.remove_consumer("b"), 0);
        assert_eq!(ch.active_consumers(), 0);

        // At most `keep_at_most` cancelled sources stay, the oldest go first.
        for tag in ["c", "d", "e"] {
            assert_eq!(ch.add_consumer(tag.into(), source()), 1);
        }
        for tag in ["c", "d", "e"] {
            assert_eq!(ch.cancel_consumer_nowait(tag, 2), -1);
        }
        assert!(
            !ch.consumers.contains_key("c"),
            "the oldest cancelled one went"
        );
        assert!(ch.consumers.contains_key("d") && ch.consumers.contains_key("e"));
        // A tag reused by a new consumer is active again and never dropped as cancelled.
        assert_eq!(ch.add_consumer("d".into(), source()), 1);
        assert_eq!(ch.add_consumer("f".into(), source()), 1);
        assert_eq!(ch.cancel_consumer_nowait("f", 1), -1);
        assert!(ch.consumers.get("d").is_some_and(|s| !s.cancelled));
        assert!(
            !ch.consumers.contains_key("e"),
            "older than the one cancelled kept"
        );
        assert!(ch.consumers.get("f").is_some_and(|s| s.cancelled));
        assert_eq!(ch.active_consumers(), 1);
    }

    /// A content header payload: class 60, weight 0, body size, then `properties`.
    fn content_header(size: u64, properties: &[u8]) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 0];
        payload.extend_from_slice(&size.to_be_bytes());
        payload.extend_from_slice(properties);
        payload
    }

    #[test]
    fn a_publish_is_followed_to_the_end_of_its_content() {
        let mut ch = ClientChannel::new(1);
        ch.publish_started();
        assert!(!ch.upstream_idle());
        let header = content_header(10, &[0, 0]);
        assert_eq!(ch.publish_header_rewrite(FRAME_HEADER, &header, 1000), None);
        assert!(!ch.outgoing_seen(FRAME_HEADER, &header));
        assert!(!ch.outgoing_seen(FRAME_BODY, b"1234"));
        assert!(
            ch.outgoing_seen(FRAME_BODY, b"567890"),
            "the last body frame"
        );
        assert!(ch.upstream_idle());
        // A body with no publish before it stops nothing and ends nothing.
        assert!(!ch.outgoing_seen(FRAME_BODY, b"x"));
        ch.publish_started();
        assert!(ch.outgoing_seen(FRAME_HEADER, &content_header(0, &[0, 0])));
    }

    #[test]
    fn a_delivery_kept_with_its_content_collects_properties_and_body() {
        let mut ch = ClientChannel::new(1);
        let header = content_header(5, &[0, 0]);
        assert!(
            ch.incoming_seen(FRAME_HEADER, &header).is_none(),
            "none started"
        );
        ch.incoming = Some(IncomingContent {
            keep: Some(KeepBuilder::new(
                3,
                Some(Arc::from("q")),
                Some(("ex", "rk")),
                false,
            )),
            remaining: None,
        });
        assert_eq!(ch.delivered_header_rewrite(FRAME_HEADER, &header), None);
        assert!(ch.incoming_seen(FRAME_HEADER, &header).is_none());
        assert!(ch.incoming_seen(FRAME_BODY, b"ab").is_none());
        let builder = ch.incoming_seen(FRAME_BODY, b"cde").unwrap().unwrap();
        assert!(ch.client_idle());
        let (tag, kept) = builder.finish();
        assert_eq!(tag, 3);
        let message = kept.message.unwrap();
        assert_eq!(&message.body[..], b"abcde");
        assert_eq!(&message.raw_properties[..], &[0, 0]);
    }

    #[test]
    fn a_body_larger_than_the_bound_is_not_copied() {
        let mut ch = ClientChannel::new(1);
        let keeping = || IncomingContent {
            keep: Some(KeepBuilder::new(
                3,
                Some(Arc::from("q")),
                Some(("ex", "rk")),
                false,
            )),
            remaining: None,
        };
        // Within the bound: kept whole.
        ch.incoming = Some(keeping());
        let header = content_header(5, &[0, 0]);
        assert!(!ch.keeps_no_content_past(FRAME_HEADER, &header, 5));
        assert!(ch.incoming_seen(FRAME_HEADER, &header).is_none());
        let builder = ch.incoming_seen(FRAME_BODY, b"abcde").unwrap().unwrap();
        assert!(builder.finish().1.message.is_some());
        // Larger: the tag only, the body forwarded but not copied.
        ch.incoming = Some(keeping());
        let header = content_header(6, &[0, 0]);
        assert!(
            !ch.keeps_no_content_past(FRAME_BODY, b"abcdef", 5),
            "headers only"
        );
        assert!(ch.keeps_no_content_past(FRAME_HEADER, &header, 5));
        assert!(ch.incoming_seen(FRAME_HEADER, &header).is_none());
        let builder = ch.incoming_seen(FRAME_BODY, b"abcdef").unwrap().unwrap();
        assert!(builder.body.is_empty());
        let (tag, kept) = builder.finish();
        assert_eq!(tag, 3);
        assert!(kept.message.is_none());
        // Already a tag only: nothing to drop.
        ch.incoming = Some(IncomingContent {
            keep: Some(KeepBuilder::new(4, None, None, false)),
            remaining: None,
        });
        assert!(!ch.keeps_no_content_past(FRAME_HEADER, &header, 0));
    }

    #[test]
    fn empty_queue_names_mean_the_last_declared_queue() {
        let mut ch = ClientChannel::new(1);
        assert_eq!(&*ch.resolve_queue(""), "");
        ch.last_queue = Some(Arc::from("amq.gen-1"));
        assert_eq!(&*ch.resolve_queue(""), "amq.gen-1");
        assert_eq!(&*ch.resolve_queue("q"), "q");
        assert!(ch.upstream_idle() && ch.client_idle() && ch.is_open());
    }

    #[test]
    fn a_finished_delivery_keeps_what_it_was_built_with() {
        let queue = Some(Arc::from("orders"));
        let mut builder = KeepBuilder::new(9, queue, Some(("ex", "rk")), true);
        builder.body.extend_from_slice(b"payload");
        let (tag, kept) = builder.finish();
        assert_eq!(tag, 9);
        assert_eq!(kept.queue.as_deref(), Some("orders"));
        assert!(kept.redelivered && kept.with_content());
        assert_eq!(kept.deadline, None);
        let message = kept.message.as_deref().unwrap();
        assert_eq!(
            (message.exchange.as_str(), message.routing_key.as_str()),
            ("ex", "rk")
        );
        assert_eq!(&message.body[..], b"payload");
        assert_eq!(kept.charge(), 2 + 2 + 7 + KEPT_OVERHEAD);
        // Kept as a tag only: no message, only the overhead is charged.
        let (_, tag_only) = KeepBuilder::new(10, None, None, false).finish();
        assert!(!tag_only.with_content() && tag_only.raw_properties().is_empty());
        assert_eq!(tag_only.queue, None);
        assert_eq!(tag_only.charge(), KEPT_OVERHEAD);
    }
}
