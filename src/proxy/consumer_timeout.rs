//! Consumer timeouts in proxy mode: the proxy enforces `limits.consumer_timeout`,
//! `x-consumer-timeout` and the policy key `consumer-timeout` itself (the upstream may enforce
//! none, or a different one), with the same observable result as the embedded broker.
//!
//! Each kept delivery with a timeout has a deadline in its channel's
//! [`ChannelDeliveries`](super::inflight::ChannelDeliveries) (pure, milliseconds since the
//! session's `ack_epoch`); the session timer wakes at the earliest one. A channel past a
//! deadline is closed towards the client with RabbitMQ's 406
//! ([`crate::broker::ack_timeout::timeout_error`]) and closed upstream as if the client had
//! closed it: [`ClientSession::count_returns`] first republishes, with their count plus one, the
//! kept deliveries of classic queues whose delivery limit the proxy counts (or dead-letters
//! them past the limit), the fleet-safe way a client's channel close is counted; the upstream
//! close then requeues the rest (quorum queues count that return themselves). The upstream's
//! close-ok is not shown to the client, and the client's close-ok is not sent upstream.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, channel};
use amq_protocol::types::ShortString;

use super::channels::ChannelPhase;
use super::client_session::{ClientSession, Side};
use super::forward::channel_close_ok;
use super::wire::{WireFrame, method_frame};
use crate::amqp::codec::FRAME_METHOD;
use crate::amqp::reply;
use crate::broker::ack_timeout::timeout_error;

/// How long a consumer timeout that fell due while the client was sending a message's
/// content on the channel waits for that content to end; then the whole connection closes
/// (a channel.close cannot be sent upstream in the middle of a content).
pub(super) const MID_CONTENT_GRACE: Duration = Duration::from_secs(30);

const CHANNEL_OPEN: (u16, u16) = (20, 10);
const CHANNEL_CLOSE: (u16, u16) = (20, 40);
const CHANNEL_CLOSE_OK: (u16, u16) = (20, 41);

impl ClientSession {
    /// The session's clock for consumer timeouts (milliseconds since `ack_epoch`) at this
    /// turn, to be read, only if needed, where a channel is borrowed.
    pub(super) fn ack_clock(&self) -> impl FnOnce() -> u64 + use<> {
        let (now, epoch) = (self.now, self.ack_epoch);
        move || now.saturating_duration_since(epoch).as_millis() as u64
    }

    /// When the earliest consumer timeout of an open channel comes.
    pub(super) fn next_consumer_timeout(&self) -> Option<Instant> {
        if !self.timed_deliveries {
            return None;
        }
        let grace = MID_CONTENT_GRACE.as_millis() as u64;
        // Once the connection is closing, an unfinished publish no longer counts down.
        let open = self.client_side == Side::Open;
        self.channels
            .values()
            .filter(|ch| ch.phase == ChannelPhase::Open)
            .filter_map(|ch| {
                let due = ch.deliveries.next_deadline()?;
                if ch.upstream_idle() {
                    Some(due)
                } else {
                    open.then(|| due.saturating_add(grace))
                }
            })
            .min()
            .map(|at| self.ack_epoch + Duration::from_millis(at))
    }

    /// Closes every open channel with a delivery unsettled past its consumer timeout. A
    /// channel on which the client is sending a message's content waits until the content
    /// has ended: the channel's close cannot be sent upstream in the middle of it, and the
    /// client's remaining body frames would otherwise be dropped, leaving the close unsent
    /// and the client's next method taken for a protocol error (505). A content that has
    /// not ended [`MID_CONTENT_GRACE`] after the timeout closes the whole connection, so a
    /// client cannot hold its deliveries past their timeout by never finishing a publish.
    pub(super) fn consumer_timeouts_due(&mut self, now: Instant) {
        if !self.timed_deliveries {
            return;
        }
        let at = now.saturating_duration_since(self.ack_epoch).as_millis() as u64;
        let grace = MID_CONTENT_GRACE.as_millis() as u64;
        let open = self.client_side == Side::Open;
        let mut stalled = None;
        let due: Vec<(u16, u64, u64)> = self
            .channels
            .iter()
            .filter(|(_, ch)| ch.phase == ChannelPhase::Open)
            .filter_map(|(n, ch)| {
                if ch.upstream_idle() {
                    let (tag, timeout) = ch.deliveries.overdue(at)?;
                    return Some((n, tag, timeout));
                }
                if open
                    && let Some((tag, timeout)) = ch.deliveries.overdue(at.saturating_sub(grace))
                {
                    stalled = Some((n, tag, timeout));
                }
                None
            })
            .collect();
        if let Some((channel, tag, timeout)) = stalled {
            let queue = self
                .channels
                .get(&channel)
                .and_then(|ch| ch.deliveries.get(tag));
            if let Some(queue) = queue.and_then(|d| d.queue.clone()) {
                self.shared.metrics.consumer_timed_out(&self.vhost, &queue);
            }
            let err = timeout_error(channel, timeout);
            tracing::info!(peer = %self.peer, channel, timeout, "consumer timeout during an unfinished publish: closing the connection");
            self.close_client(
                reply::CONNECTION_FORCED,
                &format!(
                    "CONNECTION_FORCED - {} (a publish on the channel was still unfinished)",
                    err.short_text()
                        .trim_start_matches("PRECONDITION_FAILED - ")
                ),
                0,
                0,
            );
            return;
        }
        for (channel, tag, timeout) in due {
            self.consumer_timed_out(channel, tag, timeout);
        }
    }

    /// The client's content on `channel` just ended: a consumer timeout that fell due
    /// meanwhile fires now, before the client's next frame (a client publishing back to back
    /// may never leave the channel idle at the end of a turn).
    pub(super) fn consumer_timeout_after_content(&mut self, channel: u16) {
        if !self.timed_deliveries {
            return;
        }
        let at = self.ack_clock()();
        let due = self
            .channels
            .get(&channel)
            .filter(|ch| ch.phase == ChannelPhase::Open && ch.upstream_idle())
            .and_then(|ch| ch.deliveries.overdue(at));
        if let Some((tag, timeout)) = due {
            self.consumer_timed_out(channel, tag, timeout);
        }
    }

    fn consumer_timed_out(&mut self, channel: u16, tag: u64, timeout: u64) {
        let Some(ch) = self.channels.get_mut(&channel) else {
            return;
        };
        if let Some(queue) = ch.deliveries.get(tag).and_then(|d| d.queue.clone()) {
            self.shared.metrics.consumer_timed_out(&self.vhost, &queue);
        }
        tracing::info!(peer = %self.peer, channel, timeout, "consumer timeout: closing the channel");
        let err = timeout_error(channel, timeout);
        let close = |code: u16, text: &str| {
            method_frame(
                channel,
                AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                    reply_code: code,
                    reply_text: ShortString::from(text),
                    class_id: 0,
                    method_id: 0,
                })),
            )
        };
        self.inject_client(channel, close(err.code, err.short_text()));
        // Kept deliveries of limited classic queues are republished with their count (while
        // the channel is still open), then the channel closes upstream like a client close.
        self.count_returns(channel);
        self.let_go_held_of_channel(channel);
        let upstream_close = close(200, "consumer timeout");
        let until = self.close_wait_deadline();
        let Some(ch) = self.channels.get_mut(&channel) else {
            return;
        };
        ch.phase = ChannelPhase::ClosingByClient;
        ch.closed_for_client = Some((false, false));
        if ch.ops > 0 {
            ch.parked_close = Some(upstream_close);
            ch.parked_until = Some(until);
            self.refresh_parked_deadline();
        } else {
            self.forward_channel_close(channel, upstream_close);
        }
    }

    /// A client frame on a channel that is closing by the client's or the proxy's close.
    /// Only one the proxy closed for a consumer timeout expects anything: the client's
    /// close-ok (kept from the upstream), a close crossing the proxy's (answered here, once), and a
    /// reopen after the close-ok (held until the upstream's close-ok frees the number).
    pub(super) fn client_frame_on_timed_out_channel(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let Some(ch) = self.channels.get_mut(&channel) else {
            return;
        };
        let Some((client_ok, upstream_ok)) = ch.closed_for_client else {
            return;
        };
        if frame.kind != FRAME_METHOD {
            return;
        }
        match frame.method_ids() {
            CHANNEL_CLOSE_OK => {
                ch.closed_for_client = Some((true, upstream_ok));
                if upstream_ok {
                    self.remove_channel(channel);
                }
            }
            CHANNEL_CLOSE if !client_ok && !ch.crossing_close_answered => {
                ch.crossing_close_answered = true;
                self.send_client(channel_close_ok(channel));
            }
            CHANNEL_OPEN if client_ok => self.held_channel_open = Some(frame),
            _ => {}
        }
    }

    /// An upstream frame on a channel the proxy closed for a consumer timeout: none reaches
    /// the client, which was told the channel is closed (a delivery still on its way is
    /// requeued by the upstream's close; a close crossing the proxy's is answered here),
    /// except the content of a delivery already started.
    /// The upstream's close-ok completes the close. True when the channel is such a one.
    pub(super) fn upstream_frame_on_timed_out_channel(&mut self, frame: &WireFrame) -> bool {
        let channel = frame.channel;
        let Some(ch) = self.channels.get_mut(&channel) else {
            return false;
        };
        let Some((client_ok, _)) = ch.closed_for_client else {
            return false;
        };
        if frame.kind != FRAME_METHOD {
            // The rest of a delivery the client already started receiving is passed on, so
            // its frame sequence is complete before the proxy's close (deferred until then).
            return ch.incoming.is_none();
        }
        match frame.method_ids() {
            CHANNEL_CLOSE => {
                self.send_upstream(channel_close_ok(channel));
                // The proxy's own close, parked behind its publishes, must not follow.
                if let Some(ch) = self.channels.get_mut(&channel)
                    && ch.parked_close.take().is_some()
                {
                    self.refresh_parked_deadline();
                }
                self.upstream_closed(channel, client_ok);
            }
            CHANNEL_CLOSE_OK => self.upstream_closed(channel, client_ok),
            _ => {}
        }
        true
    }

    /// The upstream side of a timed-out channel is closed; the channel is gone once the
    /// client's close-ok came too, and a reopen held meanwhile goes on.
    fn upstream_closed(&mut self, channel: u16, client_ok: bool) {
        if let Some(ch) = self.channels.get_mut(&channel) {
            ch.closed_for_client = Some((client_ok, true));
        }
        if client_ok {
            self.remove_channel(channel);
            self.release_held_open(channel);
        }
    }
}
