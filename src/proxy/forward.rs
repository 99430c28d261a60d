//! Frame dispatch in both directions: the handshake, channel lifecycles, consumer and get
//! bookkeeping, content tracking and delivery keeping. Frames are forwarded as the bytes that
//! arrived; only the few the proxy must understand are decoded (by their class and method ids
//! first, so most frames cost a 4-byte look). The methods whose meaning the proxy changes are
//! handed to [`super::intercept`].

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic, channel, connection, queue};
use bytes::Bytes;

use super::channels::{
    ChannelPhase, ClientChannel, IncomingContent, KeepBuilder, OutgoingContent, Source,
};
use super::client_session::{ClientSession, Side};
use super::handshake::{LoginCheck, asking_for_blocked, check_login, negotiate, tune_for_client};
use super::inflight::Verb;
use super::probe::CheckChannel;
use super::publisher::Publisher;
use super::wire::{WireFrame, header_frame, method_frame};
use crate::admission::is_loopback;
use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_METHOD, FRAME_MIN_SIZE, FRAME_OVERHEAD, decode_method,
    decode_method_within, is_known_method,
};
use crate::amqp::peek;
use crate::amqp::reply;
use crate::metrics::BLOCKED_CLIENT;

/// How long the client gets to answer the proxy's closes.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

// Class and method ids the dispatch looks at.
const CONNECTION_START_OK: (u16, u16) = (10, 11);
const CONNECTION_BLOCKED: (u16, u16) = (10, 60);
const CONNECTION_UNBLOCKED: (u16, u16) = (10, 61);
const CONNECTION_TUNE: (u16, u16) = (10, 30);
const CONNECTION_TUNE_OK: (u16, u16) = (10, 31);
const CONNECTION_OPEN: (u16, u16) = (10, 40);
const CONNECTION_OPEN_OK: (u16, u16) = (10, 41);
const CONNECTION_CLOSE: (u16, u16) = (10, 50);
const CONNECTION_CLOSE_OK: (u16, u16) = (10, 51);
const CHANNEL_OPEN: (u16, u16) = (20, 10);
const CHANNEL_CLOSE: (u16, u16) = (20, 40);
const CHANNEL_CLOSE_OK: (u16, u16) = (20, 41);
const QUEUE_DECLARE: (u16, u16) = (50, 10);
const QUEUE_DECLARE_OK: (u16, u16) = (50, 11);
const QUEUE_DELETE: (u16, u16) = (50, 40);
const BASIC_CONSUME: (u16, u16) = (60, 20);
const BASIC_CONSUME_OK: (u16, u16) = (60, 21);
const BASIC_CANCEL: (u16, u16) = (60, 30);
const BASIC_CANCEL_OK: (u16, u16) = (60, 31);
pub(super) const BASIC_PUBLISH: (u16, u16) = (60, 40);
const BASIC_RETURN: (u16, u16) = (60, 50);
pub(super) const BASIC_DELIVER: (u16, u16) = (60, 60);
const BASIC_GET: (u16, u16) = (60, 70);
const BASIC_GET_OK: (u16, u16) = (60, 71);
const BASIC_GET_EMPTY: (u16, u16) = (60, 72);
pub(super) const BASIC_ACK: (u16, u16) = (60, 80);
const BASIC_REJECT: (u16, u16) = (60, 90);
const BASIC_RECOVER_ASYNC: (u16, u16) = (60, 100);
const BASIC_RECOVER: (u16, u16) = (60, 110);
pub(super) const BASIC_NACK: (u16, u16) = (60, 120);
const TX_SELECT: (u16, u16) = (90, 10);

/// Which of its channel's sources a delivery came from.
enum DeliveredBy<'a> {
    /// The consumer with this tag (basic.deliver).
    Consumer(&'a str),
    /// The oldest basic.get waiting for its answer (basic.get-ok).
    Get,
}

pub(super) fn channel_close_ok(channel: u16) -> Bytes {
    method_frame(
        channel,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
}

impl ClientSession {
    // ------------------------------------------------------------------------------------
    // Client → upstream
    // ------------------------------------------------------------------------------------

    pub(super) fn on_client_frame(&mut self, frame: WireFrame) {
        match self.client_side {
            Side::Closed => return,
            Side::Closing { forward_ok, .. } => {
                self.client_frame_while_closing(frame, forward_ok);
                return;
            }
            Side::Open | Side::Draining { .. } => {}
        }
        if !self.running {
            self.client_handshake_frame(frame);
            return;
        }
        if frame.kind == FRAME_METHOD {
            let (class_id, method_id) = frame.method_ids();
            if !is_known_method(class_id, method_id) {
                // RabbitMQ drops the connection without a word; the proxy says why.
                self.close_client(
                    reply::NOT_IMPLEMENTED,
                    &format!(
                        "NOT_IMPLEMENTED - unknown method class {class_id} method {method_id}"
                    ),
                    class_id,
                    method_id,
                );
                return;
            }
        }
        if frame.channel == 0 {
            self.client_connection_frame(frame);
            return;
        }
        if let Some(max) = self.negotiated.map(|n| n.client_channel_max)
            && frame.channel > max
        {
            self.above_channel_max(&frame, max);
            return;
        }
        if frame.kind == FRAME_METHOD
            && let Some(content) = self.channels.get(&frame.channel).and_then(|c| c.outgoing)
        {
            // A method where the content of a publish was due: RabbitMQ's 505. (Content frames
            // out of order go upstream, which answers the same.)
            let expected = match content {
                OutgoingContent::AwaitingHeader => {
                    "expected content header for class 60, got non content header frame instead"
                }
                OutgoingContent::Body { .. } => {
                    "expected content body, got non content body frame instead"
                }
            };
            let (class_id, method_id) = BASIC_PUBLISH;
            self.close_client(
                reply::UNEXPECTED_FRAME,
                &format!("UNEXPECTED_FRAME - {expected}"),
                class_id,
                method_id,
            );
            return;
        }
        let phase = self.channels.get(&frame.channel).map(|c| c.phase);
        match phase {
            Some(ChannelPhase::ClosedByProxy) => {
                self.client_frame_on_proxy_closed_channel(frame);
                return;
            }
            Some(ChannelPhase::ClosingByClient) => {
                // After its channel.close the client only waits for close-ok (or, on a
                // channel the proxy closed for a consumer timeout, answers it).
                self.client_frame_on_timed_out_channel(frame);
                return;
            }
            _ => {}
        }
        match frame.kind {
            FRAME_METHOD => self.client_method(frame),
            FRAME_HEADER | FRAME_BODY => self.client_content(frame),
            _ => self.send_upstream(frame.raw),
        }
    }

    /// A frame on a channel number above the negotiated channel_max (the numbers above it are
    /// the proxy's own upstream). A channel.open gets RabbitMQ's 530 for one channel too many;
    /// anything else RabbitMQ's 504 for a channel that was never opened.
    fn above_channel_max(&mut self, frame: &WireFrame, max: u16) {
        let (class_id, method_id) = if frame.kind == FRAME_METHOD {
            frame.method_ids()
        } else {
            (0, 0)
        };
        if (class_id, method_id) == CHANNEL_OPEN {
            let opened = self.channels.len();
            let text = if opened >= usize::from(max) {
                format!(
                    "NOT_ALLOWED - number of channels opened ({opened}) has reached the \
                     negotiated channel_max ({max})"
                )
            } else {
                // RabbitMQ counts channels, not numbers; the proxy needs the numbers above.
                format!(
                    "NOT_ALLOWED - channel number {} is above the negotiated channel_max ({max})",
                    frame.channel
                )
            };
            self.close_client(reply::NOT_ALLOWED, &text, 0, 0);
        } else {
            self.close_client(
                reply::CHANNEL_ERROR,
                "CHANNEL_ERROR - expected 'channel.open'",
                class_id,
                method_id,
            );
        }
    }

    fn client_frame_while_closing(&mut self, frame: WireFrame, forward_ok: bool) {
        if frame.channel != 0 || frame.kind != FRAME_METHOD {
            return;
        }
        match frame.method_ids() {
            CONNECTION_CLOSE_OK => {
                if forward_ok {
                    self.send_upstream(frame.raw);
                    self.upstream_side = Side::Closed;
                }
                self.client_side = Side::Closed;
            }
            CONNECTION_CLOSE => {
                // Both sides closed at once: answer and finish.
                self.client_out.send(method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                ));
                self.client_side = Side::Closed;
            }
            _ => {}
        }
    }

    fn client_handshake_frame(&mut self, frame: WireFrame) {
        if frame.channel != 0 || frame.kind != FRAME_METHOD {
            self.send_upstream(frame.raw);
            return;
        }
        match frame.method_ids() {
            CONNECTION_TUNE_OK => {
                let Some(AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok))) =
                    decode_method(frame.payload())
                else {
                    self.close_client(reply::SYNTAX_ERROR, "SYNTAX_ERROR - bad tune-ok", 10, 31);
                    return;
                };
                let Some(upstream_tune) = self.upstream_tune.clone() else {
                    self.close_client(
                        reply::COMMAND_INVALID,
                        "COMMAND_INVALID - tune-ok before tune",
                        10,
                        31,
                    );
                    return;
                };
                let (to_upstream, agreed) = match negotiate(
                    &upstream_tune,
                    &tune_ok,
                    self.shared.channel_max,
                    self.shared.handshake_frame_max,
                ) {
                    Ok(negotiated) => negotiated,
                    Err(refused) => {
                        // RabbitMQ ends a connection that fails the negotiation without a
                        // connection.close; so does the proxy.
                        tracing::warn!(peer = %self.peer, text = %refused.text, "tune-ok refused");
                        self.upstream_side = Side::Closed;
                        self.client_side = Side::Closed;
                        return;
                    }
                };
                self.negotiated = Some(agreed);
                self.frame_max = agreed.frame_max as usize;
                self.new_frame_max = Some(agreed.frame_max);
                self.heartbeat = (agreed.heartbeat > 0)
                    .then(|| Duration::from_secs(u64::from(agreed.heartbeat)));
                let now = self.now;
                self.last_client_rx = now;
                self.last_upstream_rx = now;
                self.send_upstream(method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::TuneOk(to_upstream)),
                ));
            }
            CONNECTION_START_OK => {
                if let Some(AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok))) =
                    decode_method(frame.payload())
                    && let LoginCheck::Refuse { user, close } = check_login(
                        &start_ok,
                        is_loopback(self.peer.ip()),
                        &self.shared.loopback_users,
                    )
                {
                    self.refuse_login(&user, close);
                    return;
                }
                if let Some(AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok))) =
                    decode_method(frame.payload())
                    && let Some(asked) = asking_for_blocked(&start_ok)
                {
                    let asked = method_frame(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::StartOk(asked)),
                    );
                    // Not past the frame size every peer accepts before tune, unless the
                    // client's own start-ok was already larger.
                    if asked.len() <= frame.raw.len().max(FRAME_MIN_SIZE as usize) {
                        self.client_wants_blocked = false;
                        self.send_upstream(asked);
                        return;
                    }
                }
                self.send_upstream(frame.raw);
            }
            CONNECTION_OPEN => {
                if let Some(AMQPClass::Connection(connection::AMQPMethod::Open(open))) =
                    decode_method(frame.payload())
                {
                    self.vhost = open.virtual_host.as_str().to_string();
                }
                self.send_upstream(frame.raw);
            }
            CONNECTION_CLOSE => self.forward_client_connection_close(frame.raw),
            _ => self.send_upstream(frame.raw),
        }
    }

    fn client_connection_frame(&mut self, frame: WireFrame) {
        if frame.kind == FRAME_METHOD && frame.method_ids() == CONNECTION_CLOSE {
            // Deliveries the client leaves unsettled count against delivery limits.
            let channels: Vec<u16> = self.channels.keys().collect();
            for channel in channels {
                self.count_returns(channel);
            }
            if self.ops.is_empty() {
                self.forward_client_connection_close(frame.raw);
            } else {
                self.parked_connection_close = Some(frame.raw);
                self.parked_connection_until = Some(self.close_wait_deadline());
                self.refresh_parked_deadline();
            }
            return;
        }
        self.send_upstream(frame.raw);
    }

    /// Passes the client's connection.close on; the upstream's close-ok ends the connection.
    pub(super) fn forward_client_connection_close(&mut self, raw: Bytes) {
        self.send_upstream(raw);
        let deadline = self.now + CLOSE_GRACE;
        self.upstream_side = Side::Closing {
            deadline,
            forward_ok: true,
        };
        self.client_side = Side::Closing {
            deadline,
            forward_ok: false,
        };
    }

    fn client_frame_on_proxy_closed_channel(&mut self, frame: WireFrame) {
        if frame.kind != FRAME_METHOD {
            return;
        }
        match frame.method_ids() {
            CHANNEL_CLOSE_OK => self.remove_channel(frame.channel),
            CHANNEL_CLOSE => {
                self.send_client(channel_close_ok(frame.channel));
                self.remove_channel(frame.channel);
            }
            _ => {}
        }
    }

    fn client_content(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let max_payload = self.frame_max.saturating_sub(FRAME_OVERHEAD);
        let (rewritten, finished) = match self.channels.get_mut(&channel) {
            Some(ch) => (
                ch.publish_header_rewrite(frame.kind, frame.payload(), max_payload),
                ch.outgoing_seen(frame.kind, frame.payload()),
            ),
            None => (None, false),
        };
        match rewritten {
            Some(payload) => self.send_upstream(header_frame(channel, &payload)),
            None => self.send_upstream(frame.raw),
        }
        if finished {
            self.flush_deferred_upstream(channel);
            self.consumer_timeout_after_content(channel);
        }
    }

    /// Sends what was held back while the client's content was in progress.
    pub(super) fn flush_deferred_upstream(&mut self, channel: u16) {
        let deferred = match self.channels.get_mut(&channel) {
            Some(ch) if ch.upstream_idle() => std::mem::take(&mut ch.deferred_upstream),
            _ => return,
        };
        for bytes in deferred {
            self.send_upstream(bytes);
        }
    }

    fn client_method(&mut self, frame: WireFrame) {
        if matches!(frame.method_ids(), BASIC_CONSUME | BASIC_GET) {
            // A queue this instance has not verified is read back from the upstream first.
            // Bounded like every client method with a table; a frame that does not decode is
            // refused by the dispatch below.
            let queue = match decode_method_within(frame.payload(), self.shared.max_table_depth) {
                Ok(AMQPClass::Basic(basic::AMQPMethod::Consume(m))) => Some(m.queue),
                Ok(AMQPClass::Basic(basic::AMQPMethod::Get(m))) => Some(m.queue),
                _ => None,
            };
            let queue = queue.and_then(|q| {
                let ch = self.channels.get(&frame.channel)?;
                ch.is_open().then(|| ch.resolve_queue(q.as_str()))
            });
            if let Some(queue) = queue {
                match self.read_back(frame, queue) {
                    Some(frame) => self.client_method_now(frame),
                    None => return,
                }
                return;
            }
        }
        self.client_method_now(frame);
    }

    /// A basic.publish on `channel`: its content follows.
    pub(super) fn publish_started(&mut self, channel: u16) {
        if let Some(ch) = self.channels.get_mut(&channel) {
            ch.publish_started();
        }
        self.counts.published += 1;
    }

    /// Dispatches a client method (after any read-back it needed).
    pub(super) fn client_method_now(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let ids = frame.method_ids();
        match ids {
            BASIC_PUBLISH => {
                self.publish_started(channel);
                self.send_upstream(frame.raw);
            }
            BASIC_ACK | BASIC_REJECT | BASIC_NACK => {
                // Read in place (every delivery is settled so): what does not read is
                // malformed (amq-protocol refuses the same, see `peek`).
                let settle = match peek::settle(frame.payload()) {
                    Some(peek::Settle::Ack {
                        delivery_tag,
                        multiple,
                    }) => Some((Verb::Ack, delivery_tag, multiple)),
                    Some(peek::Settle::Reject {
                        delivery_tag,
                        requeue,
                    }) => Some((Verb::Reject { requeue }, delivery_tag, false)),
                    Some(peek::Settle::Nack {
                        delivery_tag,
                        multiple,
                        requeue,
                    }) => Some((Verb::Nack { requeue }, delivery_tag, multiple)),
                    None => None,
                };
                match settle {
                    Some((verb, tag, multiple)) => self.client_settle(frame, verb, tag, multiple),
                    None => self.syntax_error(ids),
                }
            }
            CHANNEL_OPEN => {
                if self.upstream_drain.contains_key(&channel) {
                    // The proxy closed this channel number upstream (a refused declare) and
                    // the close-ok is still on its way. RabbitMQ forgets a channel only when
                    // it has answered the close, so an open sent now would reach the closing
                    // channel and end the connection (504 "second 'channel.open' seen"). The
                    // open waits for the close-ok, and client reads pause until then, so
                    // nothing the client sends on that channel overtakes it.
                    self.held_channel_open = Some(frame);
                    return;
                }
                self.open_client_channel(frame);
            }
            CHANNEL_CLOSE => self.client_channel_close(frame),
            CHANNEL_CLOSE_OK => {
                // Answers the upstream's channel.close.
                self.send_upstream(frame.raw);
                self.remove_channel(channel);
            }
            QUEUE_DECLARE => self.client_queue_declare(frame),
            QUEUE_DELETE => {
                if let Some(AMQPClass::Queue(queue::AMQPMethod::Delete(delete))) =
                    decode_method(frame.payload())
                {
                    let name = match self.channels.get(&channel) {
                        Some(ch) => ch.resolve_queue(delete.queue.as_str()),
                        None => Arc::from(delete.queue.as_str()),
                    };
                    self.shared.queues.forget(&self.vhost, &name);
                }
                self.send_upstream(frame.raw);
            }
            BASIC_CONSUME => {
                let Some(method) = self.decode_client_method(&frame) else {
                    return;
                };
                let mut renamed = None;
                match method {
                    AMQPClass::Basic(basic::AMQPMethod::Consume(mut consume)) => {
                        let max = self.shared.max_consumers_per_channel;
                        if let Some(ch) = self.channels.get_mut(&channel) {
                            if consume.nowait && consume.consumer_tag.as_str().is_empty() {
                                consume.consumer_tag = ch.name_consumer().into();
                                renamed = Some(method_frame(
                                    channel,
                                    AMQPClass::Basic(basic::AMQPMethod::Consume(consume.clone())),
                                ));
                            }
                            let tag = consume.consumer_tag.as_str();
                            // As RabbitMQ: a tag in use is the upstream's to refuse; a new
                            // consumer past the limit closes the connection.
                            let in_use = !tag.is_empty()
                                && ch.consumers.get(tag).is_some_and(|s| !s.cancelled);
                            if !in_use && ch.consumers_started_or_asked() >= max {
                                self.close_client(
                                    reply::NOT_ALLOWED,
                                    &format!(
                                        "NOT_ALLOWED - reached maximum ({max}) of consumers per \
                                         channel"
                                    ),
                                    ids.0,
                                    ids.1,
                                );
                                return;
                            }
                            let source = Source::new(
                                ch.resolve_queue(consume.queue.as_str()),
                                consume.no_ack,
                            );
                            if consume.nowait {
                                let added = ch.add_consumer(tag.to_string(), source);
                                self.shared.metrics.consumers_changed(added);
                            } else {
                                ch.pending_consumes.push_back(source);
                            }
                        }
                    }
                    _ => {
                        self.syntax_error(ids);
                        return;
                    }
                }
                self.send_upstream(renamed.unwrap_or(frame.raw));
            }
            BASIC_GET => {
                match decode_method(frame.payload()) {
                    Some(AMQPClass::Basic(basic::AMQPMethod::Get(get))) => {
                        if let Some(ch) = self.channels.get_mut(&channel) {
                            let source =
                                Source::new(ch.resolve_queue(get.queue.as_str()), get.no_ack);
                            ch.pending_gets.push_back(source);
                            self.pending_answers += 1;
                        }
                    }
                    _ => {
                        self.syntax_error(ids);
                        return;
                    }
                }
                self.send_upstream(frame.raw);
            }
            BASIC_RECOVER | BASIC_RECOVER_ASYNC => {
                // Every unacked delivery of the channel goes back: forget them, and let the
                // proxy's pending work on them settle nothing.
                self.let_go_held_of_channel(channel);
                if let Some(ch) = self.channels.get_mut(&channel) {
                    let (count, bytes) = ch.deliveries.clear();
                    ch.id = {
                        let id = self.next_channel_id;
                        self.next_channel_id += 1;
                        id
                    };
                    let outstanding = ch.ops;
                    ch.ops = 0;
                    self.release_inflight(count, bytes);
                    if outstanding > 0 {
                        tracing::debug!(
                            channel,
                            outstanding,
                            "basic.recover with dead-letters in flight"
                        );
                    }
                }
                self.send_upstream(frame.raw);
            }
            BASIC_CANCEL => {
                let Some(method) = self.decode_client_method(&frame) else {
                    return;
                };
                if let AMQPClass::Basic(basic::AMQPMethod::Cancel(cancel)) = method
                    && cancel.nowait
                    && let Some(ch) = self.channels.get_mut(&channel)
                {
                    // No cancel-ok will come to forget it.
                    let max = self.shared.max_consumers_per_channel;
                    let ended = ch.cancel_consumer_nowait(cancel.consumer_tag.as_str(), max);
                    self.shared.metrics.consumers_changed(ended);
                }
                self.send_upstream(frame.raw);
            }
            TX_SELECT => {
                if let Some(ch) = self.channels.get_mut(&channel) {
                    ch.transactional = true;
                }
                self.send_upstream(frame.raw);
            }
            _ => self.send_upstream(frame.raw),
        }
    }

    /// The channel number is free upstream again: a client's reopen held meanwhile may go.
    pub(super) fn release_held_open(&mut self, channel: u16) {
        if self
            .held_channel_open
            .as_ref()
            .is_some_and(|open| open.channel == channel)
            && let Some(open) = self.held_channel_open.take()
        {
            self.open_client_channel(open);
        }
    }

    /// A client's channel.open: a fresh channel state, and the open goes upstream.
    fn open_client_channel(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let id = self.next_channel_id;
        self.next_channel_id += 1;
        self.let_go_held_of_channel(channel);
        if let Some(old) = self.channels.insert(channel, ClientChannel::new(id)) {
            self.release_channel_state(old);
        } else {
            self.shared.metrics.channel_opened();
        }
        self.send_upstream(frame.raw);
    }

    /// A loopback-only user from another address: the start-ok (with its credentials) never
    /// reaches the upstream, which is simply disconnected; the client gets RabbitMQ's 403 when
    /// it asked for one, else a closed socket.
    fn refuse_login(&mut self, user: &str, close: Option<reply::AmqpError>) {
        tracing::warn!(
            peer = %self.peer,
            user,
            "login refused: user may only connect from a loopback address (proxy.loopback_users)"
        );
        self.shared
            .metrics
            .connection_refused(crate::metrics::REFUSED_LOOPBACK_ONLY);
        self.upstream_side = Side::Closed;
        match close {
            Some(err) => self.close_client(err.code, &err.text, 0, 0),
            None => self.client_side = Side::Closed,
        }
    }

    /// Decodes a client method whose arguments carry a field table, under
    /// `limits.max_table_depth`; a method that does not decode closes the client connection
    /// (501 for tables nested too deep, 502 otherwise) and gives `None`. The upstream
    /// connection is then closed cleanly once the proxy's own work is settled.
    pub(super) fn decode_client_method(&mut self, frame: &WireFrame) -> Option<AMQPClass> {
        match decode_method_within(frame.payload(), self.shared.max_table_depth) {
            Ok(method) => Some(method),
            Err(err) => {
                let (class_id, method_id) = frame.method_ids();
                let err = err.to_amqp_error(class_id, method_id);
                tracing::warn!(peer = %self.peer, text = %err.text, "client method refused");
                self.close_client(err.code, &err.text, class_id, method_id);
                None
            }
        }
    }

    fn syntax_error(&mut self, (class_id, method_id): (u16, u16)) {
        self.close_client(
            reply::SYNTAX_ERROR,
            "SYNTAX_ERROR - method frame does not parse",
            class_id,
            method_id,
        );
    }

    fn client_channel_close(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let Some(ch) = self.channels.get_mut(&channel) else {
            self.send_upstream(frame.raw);
            return;
        };
        match ch.phase {
            ChannelPhase::ClosingByUpstream => {
                // Both closed at once: the client gets its close-ok here and still answers the
                // upstream's close itself.
                self.send_client(channel_close_ok(channel));
            }
            _ => {
                ch.phase = ChannelPhase::ClosingByClient;
                // Deliveries the client leaves unsettled count against delivery limits.
                self.count_returns(channel);
                // Held dead letters are let go: closing the channel upstream requeues their
                // originals. Publishes awaiting their confirm are waited for.
                self.let_go_held_of_channel(channel);
                let busy = self.channels.get(&channel).is_some_and(|ch| ch.ops > 0);
                let until = self.close_wait_deadline();
                match self.channels.get_mut(&channel) {
                    Some(ch) if busy => {
                        ch.parked_close = Some(frame.raw);
                        ch.parked_until = Some(until);
                        self.refresh_parked_deadline();
                    }
                    _ => self.forward_channel_close(channel, frame.raw),
                }
            }
        }
    }

    /// Sends the client's channel.close upstream; its deliveries go back to their queues.
    pub(super) fn forward_channel_close(&mut self, channel: u16, raw: Bytes) {
        if let Some(ch) = self.channels.get_mut(&channel) {
            let (count, bytes) = ch.deliveries.clear();
            self.release_inflight(count, bytes);
        }
        self.inject_upstream(channel, raw);
    }

    // ------------------------------------------------------------------------------------
    // Upstream → client
    // ------------------------------------------------------------------------------------

    pub(super) fn on_upstream_frame(&mut self, frame: WireFrame) {
        if let Some(agreed) = self.negotiated {
            if Some(frame.channel) == agreed.publisher_channel && frame.channel != 0 {
                self.publisher_frame(frame);
                return;
            }
            if Some(frame.channel) == agreed.probe_channel && frame.channel != 0 {
                self.check_frame(frame);
                return;
            }
        }
        match self.upstream_side {
            Side::Closed => return,
            Side::Closing { forward_ok, .. } => {
                if frame.channel == 0
                    && frame.kind == FRAME_METHOD
                    && frame.method_ids() == CONNECTION_CLOSE_OK
                {
                    if forward_ok {
                        self.send_client(frame.raw);
                        self.client_side = Side::Closed;
                    }
                    self.upstream_side = Side::Closed;
                } else if frame.channel == 0
                    && frame.kind == FRAME_METHOD
                    && frame.method_ids() == CONNECTION_CLOSE
                {
                    self.send_upstream(method_frame(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    ));
                    self.upstream_side = Side::Closed;
                }
                return;
            }
            Side::Open | Side::Draining { .. } => {}
        }
        if frame.channel == 0 {
            self.upstream_connection_frame(frame);
            return;
        }
        if self.upstream_drain.contains_key(&frame.channel) {
            self.upstream_frame_on_drained_channel(frame);
            return;
        }
        if self.upstream_frame_on_timed_out_channel(&frame) {
            return;
        }
        match frame.kind {
            FRAME_METHOD => self.upstream_method(frame),
            FRAME_HEADER | FRAME_BODY => self.upstream_content(frame),
            _ => self.send_client(frame.raw),
        }
    }

    fn upstream_connection_frame(&mut self, frame: WireFrame) {
        if frame.kind != FRAME_METHOD {
            self.send_client(frame.raw);
            return;
        }
        match frame.method_ids() {
            CONNECTION_TUNE if !self.running => {
                let Some(AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) =
                    decode_method(frame.payload())
                else {
                    self.upstream_lost("upstream sent a malformed connection.tune");
                    return;
                };
                let offered = tune_for_client(
                    &tune,
                    self.shared.channel_max,
                    self.shared.handshake_frame_max,
                );
                self.upstream_tune = Some(tune);
                self.send_client(method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Tune(offered)),
                ));
            }
            CONNECTION_OPEN_OK if !self.running => {
                self.send_client(frame.raw);
                self.running = true;
                self.start_proxy_channels();
            }
            CONNECTION_CLOSE => {
                // Forwarded as is (e.g. 320 from the broker, 403 on a failed login); the
                // client's close-ok goes back upstream.
                let reply_code = frame
                    .payload()
                    .get(4..6)
                    .map(|code| u16::from_be_bytes([code[0], code[1]]));
                if reply_code == Some(reply::CONNECTION_FORCED) {
                    // A node shutting down closes its connections so: have the
                    // reachability check look.
                    self.shared.upstream.report_lost();
                }
                self.send_client(frame.raw);
                let deadline = self.now + CLOSE_GRACE;
                self.client_side = Side::Closing {
                    deadline,
                    forward_ok: true,
                };
                self.upstream_side = Side::Closing {
                    deadline,
                    forward_ok: false,
                };
                self.abandon_all_ops();
            }
            CONNECTION_BLOCKED | CONNECTION_UNBLOCKED => {
                // The confirms of the proxy's publishes cannot come while blocked: their
                // deadlines wait (`track_upstream_pause`), or each timeout would publish the
                // dead letter again behind the first.
                let blocked = frame.method_ids() == CONNECTION_BLOCKED;
                if blocked != self.upstream_blocked {
                    self.upstream_blocked = blocked;
                    self.shared.metrics.add_upstream_connection_blocked(
                        BLOCKED_CLIENT,
                        if blocked { 1 } else { -1 },
                    );
                }
                if self.client_wants_blocked {
                    self.send_client(frame.raw);
                }
            }
            _ => self.send_client(frame.raw),
        }
    }

    /// Opens the proxy's channels once the connection is open.
    fn start_proxy_channels(&mut self) {
        let Some(agreed) = self.negotiated else {
            return;
        };
        if self.shared.delegate_to_upstream {
            return;
        }
        if let Some(channel) = agreed.probe_channel {
            // Opened for each declare check only.
            self.check = Some(CheckChannel::new(channel));
        }
        if let Some(channel) = agreed.publisher_channel {
            let publisher = Publisher::new(channel, self.frame_max, self.shared.confirm_timeout);
            self.send_upstream(publisher.open_frames());
            self.publisher = Some(publisher);
            // The vhost's service connection owns the capture objects (started now if this
            // is the first client of the vhost).
            self.capture_status = self.shared.services.ensure(&self.vhost);
            self.service = self.shared.services.handle(&self.vhost);
        } else {
            tracing::warn!(
                peer = %self.peer,
                "upstream offers too few channels: dead-lettering left to the upstream"
            );
        }
    }

    fn publisher_frame(&mut self, frame: WireFrame) {
        let Some(publisher) = self.publisher.as_mut() else {
            return;
        };
        let step = publisher.on_frame(&frame);
        if let Some(write) = step.write {
            self.send_upstream(write);
        }
        if let Some(cause) = step.reopened {
            self.shared.metrics.publisher_channel_reopened(cause);
        }
        for settled in step.settled {
            self.complete_op(settled.op, settled.outcome);
        }
    }

    fn check_frame(&mut self, frame: WireFrame) {
        let Some(check) = self.check.as_mut() else {
            return;
        };
        let step = check.on_frame(&frame);
        if let Some(write) = step.write {
            self.send_upstream(write);
        }
        if let Some(answer) = step.answer {
            self.on_check_channel_answer(answer);
        }
    }

    fn upstream_frame_on_drained_channel(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        if frame.kind == FRAME_METHOD {
            match frame.method_ids() {
                CHANNEL_CLOSE_OK | CHANNEL_CLOSE => {
                    if frame.method_ids() == CHANNEL_CLOSE {
                        self.send_upstream(channel_close_ok(channel));
                    }
                    if let Some(left) = self.upstream_drain.get_mut(&channel) {
                        *left = left.saturating_sub(1);
                        if *left == 0 {
                            self.upstream_drain.remove(&channel);
                            self.release_held_open(channel);
                        }
                    }
                }
                _ => {}
            }
            return;
        }
        // The rest of a delivery the client already started receiving is still passed on so
        // its frame sequence is complete before the proxy's channel.close.
        let in_progress = self
            .channels
            .get(&channel)
            .is_some_and(|ch| ch.phase == ChannelPhase::ClosedByProxy && ch.incoming.is_some());
        if in_progress && (frame.kind == FRAME_HEADER || frame.kind == FRAME_BODY) {
            self.upstream_content(frame);
        }
    }

    fn upstream_method(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let ids = frame.method_ids();
        match ids {
            BASIC_DELIVER => {
                // Read in place: one per message, forwarded as it came.
                let Some(deliver) = peek::deliver(frame.payload()) else {
                    self.send_client(frame.raw);
                    return;
                };
                self.deliver_started(channel, &deliver, false);
                self.send_client(frame.raw);
            }
            BASIC_GET_OK => {
                let Some(get_ok) = peek::get_ok(frame.payload()) else {
                    self.send_client(frame.raw);
                    return;
                };
                self.delivery_started(
                    channel,
                    DeliveredBy::Get,
                    get_ok.delivery_tag,
                    get_ok.redelivered,
                    (get_ok.exchange, get_ok.routing_key),
                    false,
                );
                self.send_client(frame.raw);
            }
            BASIC_RETURN => {
                self.start_incoming(channel, None);
                self.send_client(frame.raw);
            }
            BASIC_GET_EMPTY => {
                if let Some(ch) = self.channels.get_mut(&channel)
                    && ch.pending_gets.pop_front().is_some()
                {
                    self.pending_answers = self.pending_answers.saturating_sub(1);
                }
                self.send_client(frame.raw);
            }
            BASIC_CONSUME_OK => {
                if let Some(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok))) =
                    decode_method(frame.payload())
                    && let Some(ch) = self.channels.get_mut(&channel)
                    && let Some(source) = ch.pending_consumes.pop_front()
                {
                    let added = ch.add_consumer(ok.consumer_tag.as_str().to_string(), source);
                    self.shared.metrics.consumers_changed(added);
                }
                self.send_client(frame.raw);
            }
            BASIC_CANCEL | BASIC_CANCEL_OK => {
                let tag = match decode_method(frame.payload()) {
                    Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(c))) => {
                        Some(c.consumer_tag.as_str().to_string())
                    }
                    Some(AMQPClass::Basic(basic::AMQPMethod::CancelOk(c))) => {
                        Some(c.consumer_tag.as_str().to_string())
                    }
                    _ => None,
                };
                if let Some(tag) = tag
                    && let Some(ch) = self.channels.get_mut(&channel)
                {
                    let removed = ch.remove_consumer(&tag);
                    self.shared.metrics.consumers_changed(removed);
                }
                self.send_client(frame.raw);
            }
            QUEUE_DECLARE_OK => {
                self.upstream_declare_ok(&frame);
                self.send_client(frame.raw);
            }
            CHANNEL_CLOSE => self.upstream_channel_close(frame),
            CHANNEL_CLOSE_OK => {
                self.send_client(frame.raw);
                self.remove_channel(channel);
            }
            _ => self.send_client(frame.raw),
        }
    }

    /// The upstream closes a client channel: its deliveries go back to their queues and the
    /// proxy's work on it settles nothing.
    fn upstream_channel_close(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let closing_by_client = self
            .channels
            .get(&channel)
            .is_some_and(|ch| ch.phase == ChannelPhase::ClosingByClient);
        if closing_by_client {
            // Both sides closed at once. The upstream gets its close-ok; if the client's close
            // was still held back, the client gets its close-ok from the proxy; otherwise the
            // upstream answers the client's close itself.
            self.send_upstream(channel_close_ok(channel));
            let parked = self
                .channels
                .get_mut(&channel)
                .and_then(|ch| ch.parked_close.take());
            if parked.is_some() {
                self.send_client(channel_close_ok(channel));
                self.remove_channel(channel);
                self.refresh_parked_deadline();
            }
            return;
        }
        self.let_go_held_of_channel(channel);
        if let Some(ch) = self.channels.get_mut(&channel) {
            ch.phase = ChannelPhase::ClosingByUpstream;
            ch.ops = 0;
            let (count, bytes) = ch.deliveries.clear();
            self.release_inflight(count, bytes);
        }
        self.inject_client(channel, frame.raw);
    }

    /// Whether deliveries are tracked (as tags, for settlement planning, the inflight bound
    /// and the ack count) while the client must still settle them.
    fn keeps_deliveries(&self) -> bool {
        self.client_side == Side::Open
    }

    /// Whether the proxy dead-letters at all, so deliveries of queues that can dead-letter
    /// keep their content (not when the upstream dead-letters on its own).
    fn takes_over_settlements(&self) -> bool {
        self.publisher.is_some()
    }

    /// Whether a delivery arriving now may be kept with its content: the connection's kept
    /// bytes are below `proxy.max_inflight_bytes`. At the bound the upstream is read only
    /// where it must be (see [`ClientSession::inflight_room`]), and what it delivers then is
    /// kept as its tag only, so the kept bytes stop growing but for 128 bytes a delivery.
    fn content_room(&self) -> bool {
        self.inflight_bytes < self.shared.max_inflight_bytes
    }

    /// A basic.deliver on `channel`: its content follows (see [`Self::delivery_started`],
    /// which says what `only_for_client` and the answer mean).
    pub(super) fn deliver_started(
        &mut self,
        channel: u16,
        deliver: &peek::Deliver<'_>,
        only_for_client: bool,
    ) -> bool {
        self.delivery_started(
            channel,
            DeliveredBy::Consumer(deliver.consumer_tag),
            deliver.delivery_tag,
            deliver.redelivered,
            (deliver.exchange, deliver.routing_key),
            only_for_client,
        )
    }

    /// A delivery (basic.deliver or basic.get-ok) on `channel`: its content follows. It is
    /// kept while the client must settle it: with its content (`exchange` and routing key,
    /// then the properties and body as they arrive) when the proxy dead-letters for this
    /// session and the queue may dead-letter, else as its tag; with the source's consumer
    /// timeout. With `only_for_client`, a channel the proxy closed towards the client is
    /// left as it is and `false` returned (as for an unknown channel): the forwarding fast
    /// path hands such a delivery to the frame-by-frame path. One channel lookup in all.
    fn delivery_started(
        &mut self,
        channel: u16,
        by: DeliveredBy<'_>,
        delivery_tag: u64,
        redelivered: bool,
        content: (&str, &str),
        only_for_client: bool,
    ) -> bool {
        let keeps = self.keeps_deliveries();
        let takes_over = self.takes_over_settlements();
        let room = self.content_room();
        let revision = self.turn_revision();
        let Some(ch) = self.channels.get_mut(&channel) else {
            self.counts.delivered += 1;
            return !only_for_client;
        };
        if only_for_client && ch.closed_for_client.is_some() {
            return false;
        }
        self.counts.delivered += 1;
        let open = ch.is_open();
        let mut got;
        let source = match by {
            DeliveredBy::Consumer(tag) => ch.consumer_mut(tag),
            DeliveredBy::Get => {
                got = ch.pending_gets.pop_front();
                if got.is_some() {
                    self.pending_answers = self.pending_answers.saturating_sub(1);
                }
                got.as_mut()
            }
        };
        let keep = source
            .and_then(|source| {
                source.keep_decision(
                    open && keeps,
                    takes_over,
                    room,
                    revision,
                    &self.shared,
                    &self.vhost,
                )
            })
            .map(|decision| {
                if decision.content_skipped {
                    self.shared.metrics.delivery_kept_tag_only();
                }
                KeepBuilder::decided(delivery_tag, decision, content, redelivered)
            });
        if ch.incoming.is_none() {
            self.incoming_in_progress += 1;
        }
        ch.incoming = Some(IncomingContent {
            keep,
            remaining: None,
        });
        true
    }

    /// A basic.deliver whose whole content (`header`, the payload of its content header, and
    /// the body frames behind it) lies in the read buffer: handled in one go, as
    /// [`Self::deliver_started`] and the content frames would handle it one by one, for the
    /// forwarding fast path ([`super::passthrough`]). `false`, with nothing changed, where it
    /// cannot be: an unknown channel or one closed towards the client, a content already in
    /// progress or frames held back, a header the client must not see as it is, and a
    /// delivery whose content the proxy keeps (those go frame by frame).
    pub(super) fn deliver_whole(
        &mut self,
        channel: u16,
        deliver: &peek::Deliver<'_>,
        header: &[u8],
    ) -> bool {
        let keeps = self.keeps_deliveries();
        let takes_over = self.takes_over_settlements();
        let room = self.content_room();
        let revision = self.turn_revision();
        let clock = self.ack_clock();
        let Some(ch) = self.channels.get_mut(&channel) else {
            return false;
        };
        if ch.closed_for_client.is_some() || ch.incoming.is_some() || !ch.deferred_client.is_empty()
        {
            return false;
        }
        let keeping = ch.is_open() && keeps;
        let decision = ch.consumer_mut(deliver.consumer_tag).and_then(|source| {
            source.keep_decision(
                keeping,
                takes_over,
                room,
                revision,
                &self.shared,
                &self.vhost,
            )
        });
        // The header scan comes last: a delivery kept with its content goes frame by frame,
        // where the header is looked at anyway.
        if decision.as_ref().is_some_and(|d| d.with_content)
            || super::bcc::delivered_header(header).is_some()
        {
            return false;
        }
        self.counts.delivered += 1;
        if decision.as_ref().is_some_and(|d| d.content_skipped) {
            self.shared.metrics.delivery_kept_tag_only();
        }
        let kept = decision.map(|decision| {
            ch.keep_without_content(deliver.delivery_tag, deliver.redelivered, decision, clock)
        });
        self.delivery_kept(kept);
        true
    }

    fn start_incoming(&mut self, channel: u16, keep: Option<KeepBuilder>) {
        if let Some(ch) = self.channels.get_mut(&channel) {
            if ch.incoming.is_none() {
                self.incoming_in_progress += 1;
            }
            ch.incoming = Some(IncomingContent {
                keep,
                remaining: None,
            });
        }
    }

    fn upstream_content(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let limit = self.shared.max_inflight_bytes;
        let (stripped, finished) = match self.channels.get_mut(&channel) {
            Some(ch) => {
                if ch.keeps_no_content_past(frame.kind, frame.payload(), limit) {
                    self.shared.metrics.delivery_kept_tag_only();
                }
                (
                    ch.delivered_header_rewrite(frame.kind, frame.payload()),
                    ch.incoming_seen(frame.kind, frame.payload()),
                )
            }
            None => (None, None),
        };
        match stripped {
            Some(payload) => self.send_client(header_frame(channel, &payload)),
            None => self.send_client(frame.raw),
        }
        if let Some(completed) = finished {
            self.incoming_finished(channel, completed);
        }
    }

    /// A delivery's content ended on `channel` (its last frame is queued for the client):
    /// the delivery is kept, and frames deferred meanwhile go to the client.
    pub(super) fn incoming_finished(&mut self, channel: u16, completed: Option<KeepBuilder>) {
        let clock = self.ack_clock();
        let Some(ch) = self.channels.get_mut(&channel) else {
            self.content_ended(None);
            return;
        };
        let deferred = std::mem::take(&mut ch.deferred_client);
        let kept = completed.map(|builder| ch.keep_finished(builder, clock));
        self.content_ended(kept);
        for bytes in deferred {
            self.send_client(bytes);
        }
    }

    // ------------------------------------------------------------------------------------
    // Channel bookkeeping
    // ------------------------------------------------------------------------------------

    /// A delivery's content ended; `kept` is what [`ClientChannel::keep_finished`] returned
    /// when the delivery was kept (its charge, whether it has a consumer timeout).
    pub(super) fn content_ended(&mut self, kept: Option<(usize, bool)>) {
        self.incoming_in_progress = self.incoming_in_progress.saturating_sub(1);
        self.delivery_kept(kept);
    }

    /// Accounts for a delivery kept (`kept` as in [`Self::content_ended`]).
    fn delivery_kept(&mut self, kept: Option<(usize, bool)>) {
        let Some((charge, timed)) = kept else {
            return;
        };
        self.timed_deliveries |= timed;
        self.charge_inflight(charge);
    }

    /// Charges one kept message (a delivery, or a dead letter's publish) to the inflight
    /// accounting.
    pub(super) fn charge_inflight(&mut self, bytes: usize) {
        self.inflight_bytes += bytes;
        self.inflight_count += 1;
        self.counts.kept += 1;
        self.counts.kept_bytes += bytes as i64;
    }

    /// Releases kept deliveries from the inflight accounting.
    pub(super) fn release_inflight(&mut self, count: usize, bytes: usize) {
        self.inflight_count = self.inflight_count.saturating_sub(count);
        self.inflight_bytes = self.inflight_bytes.saturating_sub(bytes);
        self.counts.kept -= count as i64;
        self.counts.kept_bytes -= bytes as i64;
    }

    fn release_channel_state(&mut self, mut old: ClientChannel) {
        self.shared
            .metrics
            .consumers_ended(old.active_consumers() as u64);
        let (count, bytes) = old.deliveries.clear();
        self.release_inflight(count, bytes);
        self.pending_answers = self
            .pending_answers
            .saturating_sub(old.pending_gets.len() + old.pending_declares.len());
        if old.incoming.is_some() {
            self.incoming_in_progress = self.incoming_in_progress.saturating_sub(1);
        }
    }

    /// Forgets a channel entirely.
    pub(super) fn remove_channel(&mut self, channel: u16) {
        self.let_go_held_of_channel(channel);
        if let Some(old) = self.channels.remove(&channel) {
            self.release_channel_state(old);
            self.shared.metrics.channels_closed(1);
        }
    }

    /// Closes a client channel on both sides with the proxy's own reply (a refused declare).
    pub(super) fn close_channel_by_proxy(
        &mut self,
        channel: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        let text = amq_protocol::types::ShortString::try_new(reply::truncate_str(text, 255))
            .unwrap_or_else(|_| amq_protocol::types::ShortString::from("PRECONDITION_FAILED"));
        let close = method_frame(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: code,
                reply_text: text,
                class_id,
                method_id,
            })),
        );
        self.let_go_held_of_channel(channel);
        if let Some(ch) = self.channels.get_mut(&channel) {
            ch.phase = ChannelPhase::ClosedByProxy;
            ch.ops = 0;
            ch.parked_close = None;
            let (count, bytes) = ch.deliveries.clear();
            self.release_inflight(count, bytes);
        }
        match self.upstream_drain.get_mut(&channel) {
            Some(closes) => *closes += 1,
            None => {
                self.upstream_drain.insert(channel, 1);
            }
        }
        self.inject_upstream(channel, close.clone());
        self.inject_client(channel, close);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_ids_match_the_protocol() {
        let ids = |m: AMQPClass| (m.get_amqp_class_id(), m.get_amqp_method_id());
        assert_eq!(
            ids(AMQPClass::Basic(basic::AMQPMethod::Nack(
                basic::Nack::default()
            ))),
            BASIC_NACK
        );
        assert_eq!(
            ids(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
                queue::DeclareOk::default()
            ))),
            QUEUE_DECLARE_OK
        );
        assert_eq!(
            ids(AMQPClass::Connection(connection::AMQPMethod::TuneOk(
                connection::TuneOk::default()
            ))),
            CONNECTION_TUNE_OK
        );
        assert_eq!(
            ids(AMQPClass::Channel(channel::AMQPMethod::CloseOk(
                channel::CloseOk {}
            ))),
            CHANNEL_CLOSE_OK
        );
    }
}
