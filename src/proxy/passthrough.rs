//! The forwarding fast path: the frames a client session forwards unchanged (publishes and
//! their content from the client, deliveries and their content from the upstream, the
//! client's acks and the upstream's confirms) are handled where they lie in the read buffer.
//! Each gets the bookkeeping [`super::forward`] gives it (the content in progress, the kept
//! deliveries, the metrics), and a whole run of them is taken from the read buffer in one go
//! and queued for the opposite side: cut from it as it is, sharing the read buffer's
//! allocation, when it is long, copied into the outbox's gathering buffer when it is short
//! ([`super::outbox::Outbox::send_run`]), instead of each frame being cut out and queued on
//! its own. A publish or a delivery whose whole content lies behind it in the buffer (a
//! message of a few small frames, as most are) is handled in one step, with one channel
//! lookup and without the content-in-progress state the frames would go through one by one;
//! a delivery whose content the proxy keeps goes frame by frame.
//!
//! The first frame that needs anything else ends the run: the connection task
//! ([`super::session_task`]) hands it to [`ClientSession::client_read`] or
//! [`ClientSession::upstream_read`] as before, then starts the next run. A run also ends at a
//! frame that is incomplete or does not check out (the frame reader reports it then), at a
//! frame too large to copy (the outbox queues it as it is), and where the opposite outbox or
//! the kept deliveries reach their bounds (the checks made before any frame is read). Whether a frame is handled here or one by one, the peer gets the same
//! bytes and the session ends in the same state; the tests below compare the two.

use bytes::{Buf, BytesMut};

use super::bcc;
use super::client_session::{ClientSession, Side};
use super::forward::{BASIC_ACK, BASIC_DELIVER, BASIC_NACK, BASIC_PUBLISH};
use super::inflight::Verb;
use super::intercept::ClientSettlement;
use super::outbox::GATHER_FRAME_MAX;
use super::wire::content_body_size;
use crate::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, FRAME_OVERHEAD, frame_at};
use crate::amqp::{codec::method_ids, peek};

/// Most body frames of a message handled in one go ([`whole_content`]); a message in more
/// goes frame by frame.
const WHOLE_BODY_FRAMES: u64 = 4;

/// What a run does with the client frame at hand.
enum ClientFrame {
    /// Not for the fast path: the run ends before it.
    Stop,
    /// Bookkept; forwarded as it is, with the frames of its content that were handled with it:
    /// `len` bytes in `frames` frames in all.
    Forward { len: usize, frames: u64 },
    /// An ack, planned: forwarded as it is when the plan says so, and the plan finished.
    Settle(ClientSettlement),
}

impl ClientFrame {
    /// `frame` bookkept and forwarded on its own.
    fn alone(frame: &RunFrame<'_>) -> Self {
        ClientFrame::Forward {
            len: frame.len,
            frames: 1,
        }
    }
}

/// One frame of a run: its type, channel and payload, and its length in the buffer.
struct RunFrame<'a> {
    kind: u8,
    channel: u16,
    payload: &'a [u8],
    len: usize,
}

/// The complete, well-formed frame at the start of `unread`, if there is one and it is small
/// enough to copy (a larger one goes on its own: the outbox queues it without a copy).
fn next_frame(unread: &[u8], max_frame: usize) -> Option<RunFrame<'_>> {
    let header = frame_at(unread, max_frame).ok()??;
    let len = header.size + FRAME_OVERHEAD;
    if len >= GATHER_FRAME_MAX {
        return None;
    }
    Some(RunFrame {
        kind: header.kind,
        channel: header.channel,
        payload: unread.get(7..len - 1)?,
        len,
    })
}

/// The whole content of a publish or a delivery on `channel`, when it lies at the start of
/// `rest` (what follows the method frame): its content header, then body frames that add up
/// to the size the header gives, all complete, small enough to copy, with no other frame
/// between them, and at most `max_frames` of them (and [`WHOLE_BODY_FRAMES`] body frames).
/// Returns the header's payload and the bytes and frames the content takes; `None` when any
/// of that does not hold (the frames then go one by one).
fn whole_content(
    rest: &[u8],
    channel: u16,
    max_frame: usize,
    max_frames: u64,
) -> Option<(&[u8], usize, u64)> {
    let header = next_frame(rest, max_frame)?;
    if max_frames == 0 || header.kind != FRAME_HEADER || header.channel != channel {
        return None;
    }
    let mut remaining = content_body_size(header.payload)?;
    let (mut len, mut frames) = (header.len, 1);
    while remaining > 0 {
        if frames > WHOLE_BODY_FRAMES || frames >= max_frames {
            return None;
        }
        let body = next_frame(rest.get(len..)?, max_frame)?;
        let size = body.payload.len() as u64;
        if body.kind != FRAME_BODY || body.channel != channel || size > remaining {
            return None;
        }
        remaining -= size;
        len += body.len;
        frames += 1;
    }
    Some((header.payload, len, frames))
}

impl ClientSession {
    /// Handles the run of pass-through frames at the start of `unread` (bytes read from the
    /// client; frames up to `max_frame` bytes), at most `max_frames` of them. The run is taken
    /// from the front of `unread` and queued for the upstream as it is (a long run shares the
    /// read buffer's allocation, [`super::outbox::Outbox::send_run`]). Returns how many bytes
    /// it took.
    pub(super) fn client_run(
        &mut self,
        unread: &mut BytesMut,
        max_frame: usize,
        max_frames: u64,
    ) -> usize {
        let running = self.running
            && self.client_side == Side::Open
            && self.upstream_side == Side::Open
            && !self.awaits_upstream_answer();
        let Some(channel_max) = self.negotiated.map(|n| n.client_channel_max) else {
            return 0;
        };
        if !running {
            return 0;
        }
        // Bytes taken in all, and the bytes at the front of `unread` in the run not yet queued.
        let mut taken = 0;
        let mut pending = 0;
        let mut frames = 0;
        let mut run_frames = 0;
        while frames < max_frames && !self.upstream_out.is_full_with(pending) {
            let Some(frame) = next_frame(&unread[pending..], max_frame) else {
                break;
            };
            if frame.channel == 0 || frame.channel > channel_max {
                break;
            }
            let (channel, len) = (frame.channel, frame.len);
            let rest = &unread[pending + len..];
            match self.client_frame_in_run(&frame, rest, max_frame, max_frames - frames - 1) {
                ClientFrame::Stop => break,
                ClientFrame::Forward { len, frames: n } => {
                    pending += len;
                    frames += n;
                    run_frames += n;
                }
                ClientFrame::Settle(settlement) => {
                    let forward = settlement.plan.forward_original;
                    let only_forwards = settlement.only_forwards();
                    if forward {
                        pending += len;
                        run_frames += 1;
                    }
                    if !only_forwards {
                        // What the plan sends goes after the run so far (and the ack).
                        taken += pending;
                        self.queue_client_run(unread, pending, run_frames);
                        pending = 0;
                        run_frames = 0;
                        if !forward {
                            unread.advance(len);
                            taken += len;
                        }
                        self.finish_client_settlement(channel, settlement);
                    }
                    frames += 1;
                }
            }
        }
        taken += pending;
        self.queue_client_run(unread, pending, run_frames);
        if frames > 0 {
            self.client_frames_read(frames, taken);
        }
        taken
    }

    /// Takes the first `len` bytes (`frames` frames of a run) from `unread` and queues them
    /// for the upstream; nothing when the run is empty.
    fn queue_client_run(&mut self, unread: &mut BytesMut, len: usize, frames: u64) {
        if len > 0 {
            self.send_upstream_run(unread, len, frames);
        }
    }

    /// The bookkeeping of one client frame in a run, or [`ClientFrame::Stop`] (with nothing
    /// changed) when it is not one the fast path handles. A publish whose whole content is in
    /// `rest` (the bytes after it, at most `room` frames of them) is handled with its content.
    fn client_frame_in_run(
        &mut self,
        frame: &RunFrame<'_>,
        rest: &[u8],
        max_frame: usize,
        room: u64,
    ) -> ClientFrame {
        let max_payload = self.frame_max.saturating_sub(FRAME_OVERHEAD);
        let Some(ch) = self.channels.get_mut(&frame.channel) else {
            return ClientFrame::Stop;
        };
        if !ch.is_open() || ch.closed_for_client.is_some() {
            return ClientFrame::Stop;
        }
        match frame.kind {
            FRAME_METHOD => {
                if ch.outgoing.is_some() {
                    return ClientFrame::Stop;
                }
                match method_ids(frame.payload) {
                    BASIC_PUBLISH => {
                        self.counts.published += 1;
                        // Handled whole, the content leaves no state behind: as the frames
                        // one by one would (`publish_started`, then `outgoing_seen`).
                        if let Some((header, content_len, content_frames)) =
                            whole_content(rest, frame.channel, max_frame, room)
                            && ch.deferred_upstream.is_empty()
                            && bcc::publish_header(header, max_payload).is_none()
                        {
                            return ClientFrame::Forward {
                                len: frame.len + content_len,
                                frames: 1 + content_frames,
                            };
                        }
                        // The channel is at hand: no second lookup (see `publish_started`).
                        ch.publish_started();
                        ClientFrame::alone(frame)
                    }
                    BASIC_ACK => match peek::settle(frame.payload) {
                        // An ack of one kept delivery (the usual one) settles it upstream as it
                        // is: no plan to make (an ack is never taken over).
                        Some(peek::Settle::Ack {
                            delivery_tag,
                            multiple: false,
                        }) if let Some(charge) = ch.deliveries.take_acked(delivery_tag) => {
                            self.release_inflight(1, charge);
                            self.counts.acked += 1;
                            ClientFrame::alone(frame)
                        }
                        Some(peek::Settle::Ack {
                            delivery_tag,
                            multiple,
                        }) => self
                            .plan_client_settlement(
                                frame.channel,
                                Verb::Ack,
                                delivery_tag,
                                multiple,
                            )
                            .map_or(ClientFrame::Stop, ClientFrame::Settle),
                        _ => ClientFrame::Stop,
                    },
                    _ => ClientFrame::Stop,
                }
            }
            FRAME_HEADER | FRAME_BODY => {
                if ch.outgoing.is_none()
                    || !ch.deferred_upstream.is_empty()
                    || ch
                        .publish_header_rewrite(frame.kind, frame.payload, max_payload)
                        .is_some()
                {
                    return ClientFrame::Stop;
                }
                // Nothing was deferred, so a finished content has nothing to flush.
                ch.outgoing_seen(frame.kind, frame.payload);
                ClientFrame::alone(frame)
            }
            _ => ClientFrame::Stop,
        }
    }

    /// Handles the run of pass-through frames at the start of `unread` (bytes read from the
    /// upstream), as [`Self::client_run`] does for the client's.
    pub(super) fn upstream_run(
        &mut self,
        unread: &mut BytesMut,
        max_frame: usize,
        max_frames: u64,
    ) -> usize {
        let Some(agreed) = self.negotiated else {
            return 0;
        };
        if !self.running || self.client_side != Side::Open || self.upstream_side != Side::Open {
            return 0;
        }
        let mut taken = 0;
        let mut frames = 0;
        while frames < max_frames && !self.client_out.is_full_with(taken) && self.inflight_room() {
            let Some(frame) = next_frame(&unread[taken..], max_frame) else {
                break;
            };
            if frame.channel == 0
                || Some(frame.channel) == agreed.publisher_channel
                || Some(frame.channel) == agreed.probe_channel
                || self.upstream_drain.contains_key(&frame.channel)
            {
                break;
            }
            let rest = &unread[taken + frame.len..];
            let room = max_frames - frames - 1;
            let Some((len, n)) = self.upstream_frame_in_run(&frame, rest, max_frame, room) else {
                break;
            };
            taken += len;
            frames += n;
        }
        if frames > 0 {
            self.send_client_run(unread, taken, frames);
            self.upstream_frames_read(frames, taken);
        }
        taken
    }

    /// The bookkeeping of one upstream frame in a run: the bytes and frames it took (a
    /// delivery whose whole content is in `rest`, at most `room` frames of it, is handled
    /// with its content), or `None` (with nothing changed) when it is not one the fast path
    /// handles. One channel lookup per frame.
    fn upstream_frame_in_run(
        &mut self,
        frame: &RunFrame<'_>,
        rest: &[u8],
        max_frame: usize,
        room: u64,
    ) -> Option<(usize, u64)> {
        // The frame bookkept and forwarded on its own.
        let alone = (frame.len, 1);
        match frame.kind {
            FRAME_METHOD => match method_ids(frame.payload) {
                BASIC_DELIVER => {
                    let deliver = peek::deliver(frame.payload)?;
                    if let Some((header, content_len, content_frames)) =
                        whole_content(rest, frame.channel, max_frame, room)
                        && self.deliver_whole(frame.channel, &deliver, header)
                    {
                        return Some((frame.len + content_len, 1 + content_frames));
                    }
                    self.deliver_started(frame.channel, &deliver, true)
                        .then_some(alone)
                }
                // Publisher confirms of the client's channel: forwarded as they are.
                BASIC_ACK | BASIC_NACK => self
                    .channels
                    .get(&frame.channel)
                    .is_some_and(|ch| ch.closed_for_client.is_none())
                    .then_some(alone),
                _ => None,
            },
            FRAME_HEADER | FRAME_BODY => {
                let clock = self.ack_clock();
                let limit = self.shared.max_inflight_bytes;
                let ch = self.channels.get_mut(&frame.channel)?;
                if ch.closed_for_client.is_some()
                    || ch.incoming.is_none()
                    || !ch.deferred_client.is_empty()
                    || ch
                        .delivered_header_rewrite(frame.kind, frame.payload)
                        .is_some()
                {
                    return None;
                }
                if ch.keeps_no_content_past(frame.kind, frame.payload, limit) {
                    self.shared.metrics.delivery_kept_tag_only();
                }
                if let Some(completed) = ch.incoming_seen(frame.kind, frame.payload) {
                    // Nothing was deferred: only the delivery is kept (`incoming_finished`
                    // without a second lookup).
                    let kept = completed.map(|builder| ch.keep_finished(builder, clock));
                    self.content_ended(kept);
                }
                Some(alone)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
#[path = "passthrough/tests.rs"]
mod tests;
