//! The work of one open service connection, as a pure state machine: the capture consumer on
//! channel 1 ([`CaptureConsumer`]) and the dead-letter publisher on channel 2 ([`Publisher`],
//! confirms on). Frames and `now` in, frames out; the task around it (`super::task`) only
//! moves bytes.
//!
//! Each captured message is read back into the death its original queue saw
//! (`death::from_capture`), decided with the queue's settings (`death::plan`) and published
//! to its dead-letter exchange; the capture delivery is acked only once that publish is
//! confirmed. A publish the upstream refuses (nacked: a DLQ full with `reject-publish`; no
//! confirm in time; lost with the publisher channel; 403) is *held*, as on client connections
//! ([`crate::proxy::retry`]): the capture delivery stays unacked, so the capture queue does not
//! deliver it again, and the same publish is retried after the backoff of
//! `proxy.retry_initial_ms` .. `proxy.retry_max_ms` until it is confirmed
//! (`dead_letters_held`, `dead_letter_retries_total{reason}`). At most `proxy.capture_prefetch`
//! deliveries are unacked (`dlx_proxy_capture_unacked{vhost}`), so that bounds what is in
//! flight and held. Publishes are pipelined (no wait for one confirm before the next publish);
//! the acks of settled deliveries are sent once per frame or timer, contiguous runs as one
//! `multiple` ack ([`crate::proxy::ack_batch`]). At-least-once, never lost: when the
//! connection ends, the upstream requeues every capture delivery not acked yet, and what was
//! held is let go.
//!
//! Retry tiers ([`retry_tiers`]): a captured message that waited out its delay in a delay
//! queue is published back into its queue (`captured_total{outcome="returned"}`), and a
//! rejection the upstream dead-lettered on a queue with tiers is published to the delay queue
//! of its tier (`held`); a publish to a delay queue is preceded, once per connection and
//! delay, by that queue's `nowait` declare on the publisher channel. Both are acked only once
//! confirmed, as dead letters are.
//!
//! The same publisher channel publishes, for client sessions of the vhost, the dead letters
//! their client's user may not publish ([`PublishRequest`]: a 403 on the session's own
//! channel; RabbitMQ dead-letters as the broker, without permission checks), and the
//! sessions' rejections held for a retry tier (always published by the service identity).
//! Each outcome goes back to the session, which settles its client's original only on a
//! confirm and otherwise holds and retries it as before; at most [`FORWARD_LIMIT`] are in flight, and a connection
//! that ends fails the rest back to their sessions.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use crate::metrics::{
    BLOCKED_SERVICE, CAPTURED_DEAD_LETTERED, CAPTURED_DISCARDED, CAPTURED_DROPPED, CAPTURED_HELD,
    CAPTURED_KEPT, CAPTURED_RETRIED, CAPTURED_RETURNED,
};
use crate::proxy::ProxyShared;
use crate::proxy::capture::{CaptureConsumer, CapturedMessage};
use crate::proxy::death::{self, Plan};
use crate::proxy::ops::{Op, Origin, Purpose, Settlement};
use crate::proxy::publisher::{
    NACKED, OpId, Outcome, OutgoingMessage, Publisher, Settled, UNPUBLISHABLE,
};
use crate::proxy::registry::VerifiedQueue;
use crate::proxy::retry::{RetryReason, RetrySchedule};
use crate::proxy::retry_tiers::{self, RetryPlan};
use crate::proxy::wire::WireFrame;
use crate::rabbit::args::{Overflow, QueueArguments};

/// The capture consumer's channel on a service connection.
pub const CAPTURE_CHANNEL: u16 = 1;
/// The dead-letter publisher's channel on a service connection.
pub const PUBLISHER_CHANNEL: u16 = 2;

/// Dead-letter publishes of client sessions in flight on one service connection, at most.
pub const FORWARD_LIMIT: usize = 1024;
/// Delay queues one service connection remembers having declared, at most.
pub const DECLARED_DELAYS: usize = 1024;
/// Why a forwarded publish failed when its service connection ended.
pub const FORWARD_LOST: &str = "service connection lost";

/// Where a session hears how its forwarded publishes ended: its operation id and the outcome.
pub type OutcomeSender = mpsc::UnboundedSender<(OpId, Outcome)>;

/// A dead letter a client session has the service connection publish.
#[derive(Debug)]
pub struct PublishRequest {
    /// The session's operation.
    pub op: OpId,
    pub message: OutgoingMessage,
    /// A message for the delay queue of this retry delay, which is declared first.
    pub delay_ms: Option<u64>,
    pub reply: OutcomeSender,
}

/// What the connection must do after a frame or a timer.
#[derive(Debug, Default)]
pub struct LinkStep {
    /// Bytes to write to the upstream.
    pub write: BytesMut,
    /// The capture exchange, queue and binding exist now.
    pub declared: bool,
    /// The consumer started.
    pub consuming: bool,
    /// The consumer is gone: the connection must be opened again (why).
    pub lost: Option<String>,
}

impl LinkStep {
    fn send(&mut self, bytes: Option<Bytes>) {
        if let Some(bytes) = bytes {
            self.write.extend_from_slice(&bytes);
        }
    }
}

/// The channels of one service connection.
#[derive(Debug)]
pub struct CaptureLink {
    vhost: String,
    consumer: CaptureConsumer,
    publisher: Publisher,
    ops: HashMap<OpId, Op>,
    /// Refused publishes waiting for their retry.
    held: RetrySchedule<Op>,
    next_op: OpId,
    cancel_confirmed: bool,
    /// Publishes made for client sessions, by this connection's operation id (with the
    /// retry delay of a message for a delay queue).
    forwarded: HashMap<OpId, (OpId, OutcomeSender, Option<u64>)>,
    /// The retry delays whose delay queue this connection declared (at most
    /// [`DECLARED_DELAYS`]; past that, each publish declares its queue again).
    declared_delays: HashSet<u64>,
    capture_name: String,
    /// `dlx_proxy_capture_unacked{vhost}`.
    unacked: prometheus::IntGauge,
    /// Since when RabbitMQ holds the connection blocked (a resource alarm): it reads nothing
    /// from it, so no confirm can come and no deadline runs.
    blocked_since: Option<Instant>,
}

impl CaptureLink {
    pub fn new(shared: &ProxyShared, vhost: &str, frame_max: u32) -> Self {
        CaptureLink {
            vhost: vhost.to_string(),
            consumer: CaptureConsumer::new(
                CAPTURE_CHANNEL,
                &shared.capture_name,
                shared.capture_prefetch,
            ),
            publisher: Publisher::new(
                PUBLISHER_CHANNEL,
                frame_max as usize,
                shared.confirm_timeout,
            ),
            ops: HashMap::new(),
            held: RetrySchedule::new(shared.retry_backoff),
            next_op: 1,
            cancel_confirmed: false,
            forwarded: HashMap::new(),
            declared_delays: HashSet::new(),
            capture_name: shared.capture_name.clone(),
            unacked: shared.metrics.capture_unacked(vhost),
            blocked_since: None,
        }
    }

    /// The publisher channel (confirm mode), then the capture objects and the consumer.
    pub fn start_frames(&self) -> Bytes {
        let mut out = BytesMut::new();
        out.extend_from_slice(&self.publisher.open_frames());
        out.extend_from_slice(&self.consumer.start_frames());
        out.freeze()
    }

    /// Dead-letter publishes not yet settled (in flight or held).
    pub fn unsettled(&self) -> usize {
        self.ops.len() + self.held.len() + self.forwarded.len()
    }

    /// Whether another session's publish may start ([`FORWARD_LIMIT`]).
    pub fn takes_forwarded(&self) -> bool {
        self.forwarded.len() < FORWARD_LIMIT
    }

    /// Publishes a session's dead letter; its outcome goes back to the session.
    pub fn publish_for(&mut self, request: PublishRequest, now: Instant) -> Option<Bytes> {
        let id = self.next_op;
        self.next_op += 1;
        match self.publisher.publish(id, &request.message, now) {
            Ok(bytes) => {
                self.forwarded
                    .insert(id, (request.op, request.reply, request.delay_ms));
                Some(self.with_delay_queue(request.delay_ms, bytes))
            }
            Err(why) => {
                // The session drops it when told (a retry would fail the same way).
                tracing::warn!(vhost = %self.vhost, why, "cannot publish a session's dead letter");
                let _ = request
                    .reply
                    .send((request.op, Outcome::Failed(UNPUBLISHABLE)));
                None
            }
        }
    }

    /// `publish` preceded by the declare of the delay queue of `delay_ms` (nowait, on the
    /// same channel, so it is in place when the publish is routed) unless this connection
    /// declared it already.
    fn with_delay_queue(&mut self, delay_ms: Option<u64>, publish: Bytes) -> Bytes {
        let Some(delay_ms) = delay_ms else {
            return publish;
        };
        if self.declared_delays.contains(&delay_ms) {
            return publish;
        }
        let Some(declare) =
            retry_tiers::delay_queue_declare(PUBLISHER_CHANNEL, &self.capture_name, delay_ms)
        else {
            return publish;
        };
        if self.declared_delays.len() < DECLARED_DELAYS {
            self.declared_delays.insert(delay_ms);
        }
        let mut out = BytesMut::from(&declare[..]);
        out.extend_from_slice(&publish);
        out.freeze()
    }

    /// Refused dead-letter publishes waiting for their retry.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Whether the consumer runs.
    pub fn is_consuming(&self) -> bool {
        self.consumer.is_consuming()
    }

    /// Stops the consumer (shutdown); what is in flight is still settled, what is held is let
    /// go (the upstream requeues it when the connection closes).
    pub fn stop(&mut self, shared: &ProxyShared) -> Option<Bytes> {
        self.let_go_held(shared);
        let cancel = self.consumer.cancel_frame()?;
        // Cancelling: settled deliveries waiting behind a held one are acked now, so that
        // they are not delivered again after the close.
        let mut out = BytesMut::from(&cancel[..]);
        if let Some(acks) = self.consumer.take_acks() {
            out.extend_from_slice(&acks);
        }
        Some(out.freeze())
    }

    /// Stopped and settled: the connection may close.
    pub fn is_drained(&self) -> bool {
        self.ops.is_empty()
            && self.forwarded.is_empty()
            && (self.cancel_confirmed || !self.consumer.is_on())
    }

    /// The connection is gone: the held publishes are let go (their capture deliveries go
    /// back to the capture queue with the connection).
    pub fn end(&mut self, shared: &ProxyShared) {
        if self.blocked_since.take().is_some() {
            shared
                .metrics
                .add_upstream_connection_blocked(BLOCKED_SERVICE, -1);
        }
        self.let_go_held(shared);
        // The sessions hold theirs and try again.
        for (_, (op, reply, _)) in self.forwarded.drain() {
            let _ = reply.send((op, Outcome::Failed(FORWARD_LOST)));
        }
        self.unacked.set(0);
    }

    fn let_go_held(&mut self, shared: &ProxyShared) {
        let gone = self.held.take_where(|_| true).len();
        shared.metrics.add_held_dead_letters(-(gone as i64));
    }

    /// RabbitMQ blocked the connection (connection.blocked: a memory or disk alarm, after
    /// a publish of this connection). It reads nothing more from it until it unblocks it, so
    /// the confirm deadlines and the held retries wait: a timeout now would publish the same
    /// dead letter again behind the first, which RabbitMQ reads and routes too in the end.
    pub fn blocked(&mut self, shared: &ProxyShared, now: Instant) {
        if self.blocked_since.is_none() {
            self.blocked_since = Some(now);
            shared
                .metrics
                .add_upstream_connection_blocked(BLOCKED_SERVICE, 1);
        }
    }

    /// RabbitMQ unblocked the connection: the confirm deadlines move on by the time it was
    /// blocked.
    pub fn unblocked(&mut self, shared: &ProxyShared, now: Instant) {
        if let Some(since) = self.blocked_since.take() {
            self.publisher
                .postpone(now.saturating_duration_since(since));
            shared
                .metrics
                .add_upstream_connection_blocked(BLOCKED_SERVICE, -1);
        }
    }

    /// Whether RabbitMQ holds the connection blocked.
    pub fn is_blocked(&self) -> bool {
        self.blocked_since.is_some()
    }

    /// The earliest deadline (confirm timeouts, held retries); none while blocked.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        if self.is_blocked() {
            return None;
        }
        match (self.publisher.next_deadline(), self.held.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Handles one upstream frame on channel 1 or 2 (others are ignored).
    pub fn on_frame(&mut self, shared: &ProxyShared, frame: &WireFrame, now: Instant) -> LinkStep {
        let mut step = LinkStep::default();
        match frame.channel {
            CAPTURE_CHANNEL => {
                let got = self.consumer.on_frame(frame);
                step.send(got.write);
                step.declared = got.declared;
                step.consuming = got.consuming;
                self.cancel_confirmed |= got.cancelled;
                if let Some(lost) = got.lost {
                    step.lost = Some(lost);
                    return step;
                }
                if let Some(message) = got.message {
                    self.on_captured(shared, message, now, &mut step);
                }
            }
            PUBLISHER_CHANNEL => {
                let got = self.publisher.on_frame(frame);
                step.send(got.write);
                if let Some(cause) = got.reopened {
                    shared.metrics.publisher_channel_reopened(cause);
                }
                for settled in got.settled {
                    self.complete(shared, settled, now);
                }
            }
            _ => {}
        }
        // What this frame settled (a multiple confirm settles a run) goes out as few acks.
        step.send(self.consumer.take_acks());
        self.unacked.set(self.consumer.outstanding() as i64);
        step
    }

    /// Confirm timeouts and held publishes whose backoff is over.
    pub fn on_timer(&mut self, shared: &ProxyShared, now: Instant) -> LinkStep {
        let mut step = LinkStep::default();
        if self.is_blocked() {
            return step;
        }
        let expired = self.publisher.expire(now);
        step.send(expired.write);
        if let Some(cause) = expired.reopened {
            shared.metrics.publisher_channel_reopened(cause);
        }
        for settled in expired.settled {
            self.complete(shared, settled, now);
        }
        for op in self.held.take_due(now) {
            self.start_op(shared, op, now, &mut step);
        }
        step.send(self.consumer.take_acks());
        self.unacked.set(self.consumer.outstanding() as i64);
        step
    }

    /// A message died upstream (TTL, length limit, a rejection the proxy did not see):
    /// dead-letter it as its original queue would have.
    fn on_captured(
        &mut self,
        shared: &ProxyShared,
        message: CapturedMessage,
        now: Instant,
        step: &mut LinkStep,
    ) {
        let metrics = &shared.metrics;
        let origin = (message.delivery_tag, message.epoch);
        let (death, tagged) = match death::from_capture(&message) {
            Ok(found) => found,
            Err(why) => {
                tracing::warn!(vhost = %self.vhost, %why, "captured message dropped");
                metrics.dropped(&self.vhost, &shared.capture_name, why.cause());
                metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.consumer.ack(origin.0, origin.1);
                return;
            }
        };
        // A message whose retry delay passed goes back to its queue.
        match retry_tiers::returning(&death, &self.capture_name) {
            Some(Ok((target, publish))) => {
                let origin = Origin::Capture {
                    tag: origin.0,
                    epoch: origin.1,
                };
                let op = Op::new(origin, Purpose::RetryReturn, target.into(), publish, now);
                self.start_op(shared, op, now, step);
                return;
            }
            Some(Err(_)) => {
                tracing::warn!(vhost = %self.vhost, queue = &*death.queue, "message from a delay queue names no queue to go back to; dropped");
                metrics.dropped(&self.vhost, &death.queue, "no_retry_target");
                metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.consumer.ack(origin.0, origin.1);
                return;
            }
            None => {}
        }
        // The tag is the queue's own record of its dead-letter arguments (the upstream's
        // truth); without one (none given) what this instance verified, while younger than
        // `proxy.verified_queue_max_age_secs` (the queue may have been declared anew through
        // another instance since), or the policy.
        let arguments = tagged
            .or_else(
                || match shared.queues.lookup_fresh(&self.vhost, &death.queue, now) {
                    Some(VerifiedQueue::Proxied(arguments)) => Some(arguments),
                    _ => None,
                },
            )
            .unwrap_or_default();
        let view = shared.queue_view(&self.vhost, &death.queue, &arguments);
        let queue: Arc<str> = death.queue.clone();
        if let Some(publish) = death::kept_in_queue(&death, shared.keep_dead_letters) {
            let origin = Origin::Capture {
                tag: origin.0,
                epoch: origin.1,
            };
            let op = Op::new(origin, Purpose::KeepDeadLetter, queue, publish, now);
            self.start_op(shared, op, now, step);
            return;
        }
        // A rejection the upstream dead-lettered (the proxy did not see it) on a queue with
        // retry tiers waits for its delay as one the proxy intercepted.
        match retry_tiers::plan_rejection(
            &death,
            view.settings.retry_delays.as_deref(),
            &shared.dead_letter_options,
            &self.capture_name,
        ) {
            RetryPlan::Hold {
                tier,
                delay_ms,
                message,
            } => {
                let origin = Origin::Capture {
                    tag: origin.0,
                    epoch: origin.1,
                };
                let purpose = Purpose::RetryHold { tier, delay_ms };
                let op = Op::new(origin, purpose, queue, message, now);
                self.start_op(shared, op, now, step);
                return;
            }
            RetryPlan::Exhausted => metrics.retry_exhausted(&self.vhost, &queue),
            RetryPlan::NotRetried => {}
        }
        let purpose = Purpose::DeadLetter(death.reason);
        match death::plan(death, &view, &shared.dead_letter_options) {
            Plan::Discard => {
                metrics.captured(&self.vhost, CAPTURED_DISCARDED);
                self.consumer.ack(origin.0, origin.1);
            }
            Plan::Drop(cause) => {
                metrics.dropped(&self.vhost, &queue, cause);
                metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.consumer.ack(origin.0, origin.1);
            }
            Plan::Publish(publish) => {
                let origin = Origin::Capture {
                    tag: origin.0,
                    epoch: origin.1,
                };
                let op = Op::new(origin, purpose, queue, publish, now);
                self.start_op(shared, op, now, step);
            }
        }
    }

    /// Publishes an operation's message (first time or retry) and tracks it until its
    /// confirm. A retry whose capture delivery is gone (the consumer was lost) is let go.
    fn start_op(&mut self, shared: &ProxyShared, op: Op, now: Instant, step: &mut LinkStep) {
        let Origin::Capture { tag, epoch } = op.origin else {
            return;
        };
        if op.refusals > 0 && !self.consumer.holds(epoch) {
            self.release(shared, &op);
            return;
        }
        let id = self.next_op;
        self.next_op += 1;
        match self.publisher.publish(id, &op.message, now) {
            Ok(bytes) => {
                let delay_ms = match op.purpose {
                    Purpose::RetryHold { delay_ms, .. } => Some(delay_ms),
                    _ => None,
                };
                let bytes = self.with_delay_queue(delay_ms, bytes);
                step.write.extend_from_slice(&bytes);
                self.ops.insert(id, op);
            }
            Err(why) => {
                death::drop_unpublishable(&shared.metrics, &self.vhost, &op.queue, why);
                if op.purpose == Purpose::RetryReturn {
                    shared.metrics.add_retry_held(&self.vhost, &op.queue, -1);
                }
                shared.metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.release(shared, &op);
                self.consumer.ack(tag, epoch);
            }
        }
    }

    /// A dead-letter publish ended: ack the capture delivery, or hold it for a retry.
    fn complete(&mut self, shared: &ProxyShared, settled: Settled, now: Instant) {
        if let Some((op, reply, delay_ms)) = self.forwarded.remove(&settled.op) {
            self.forget_missing_delay_queue(delay_ms, &settled.outcome);
            // The session may be gone: its client's original went back to its queue then.
            let _ = reply.send((op, settled.outcome));
            return;
        }
        let Some(op) = self.ops.remove(&settled.op) else {
            return;
        };
        let Origin::Capture { tag, epoch } = op.origin else {
            return;
        };
        if let Purpose::RetryHold { delay_ms, .. } = op.purpose {
            self.forget_missing_delay_queue(Some(delay_ms), &settled.outcome);
        }
        if op.purpose == Purpose::RetryReturn
            && matches!(settled.outcome, Outcome::Failed(cause) if cause == NACKED)
        {
            let arguments = match shared.queues.lookup(&self.vhost, &op.queue) {
                Some(VerifiedQueue::Proxied(a) | VerifiedQueue::UpstreamOwned(a)) => a,
                _ => QueueArguments::default(),
            };
            let settings = shared
                .queue_view(&self.vhost, &op.queue, &arguments)
                .settings;
            // Only a queue with a length limit refuses for being full.
            let limited = settings.max_length.is_some() || settings.max_length_bytes.is_some();
            let overflow = if limited {
                settings.overflow
            } else {
                Overflow::DropHead
            };
            if let Some(Settlement::Ack) =
                death::refused_return_ends(&shared.metrics, &self.vhost, &op, overflow)
            {
                self.release(shared, &op);
                shared.metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.consumer.ack(tag, epoch);
                return;
            }
        }
        if let Some(reason) = death::retry_reason(&op, &settled.outcome) {
            self.refused(shared, op, &settled.outcome, reason, now);
            return;
        }
        self.release(shared, &op);
        let metrics = &shared.metrics;
        let outcome = match (&settled.outcome, op.purpose) {
            (Outcome::Confirmed, Purpose::KeepDeadLetter) => CAPTURED_KEPT,
            (Outcome::Confirmed, Purpose::RetryHold { .. }) => CAPTURED_HELD,
            (Outcome::Confirmed, Purpose::RetryReturn) => CAPTURED_RETURNED,
            (Outcome::Confirmed, _) => CAPTURED_DEAD_LETTERED,
            _ => CAPTURED_DROPPED,
        };
        metrics.captured(&self.vhost, outcome);
        if let Some(Settlement::Ack) = death::settle(metrics, &self.vhost, &op, &settled.outcome) {
            self.consumer.ack(tag, epoch);
        }
    }

    /// The upstream refused a dead-letter publish: the capture delivery stays unacked and the
    /// publish is retried after the backoff (counted, the first refusal in the held gauge).
    fn refused(
        &mut self,
        shared: &ProxyShared,
        mut op: Op,
        outcome: &Outcome,
        reason: RetryReason,
        now: Instant,
    ) {
        let metrics = &shared.metrics;
        metrics.dead_letter_publish_failed(reason.failure_cause(outcome));
        let Origin::Capture { epoch, .. } = op.origin else {
            return;
        };
        if !self.consumer.holds(epoch) {
            // The capture delivery went back with the consumer: nothing to hold.
            self.release(shared, &op);
            return;
        }
        metrics.dead_letter_retry(reason.as_str());
        metrics.captured(&self.vhost, CAPTURED_RETRIED);
        if !op.is_held() {
            metrics.add_held_dead_letters(1);
        }
        let attempt = op.note_refusal(reason);
        self.held.schedule(now, attempt, rand::random::<f64>(), op);
    }

    /// A message for a delay queue routed nowhere: the queue was deleted since this connection
    /// declared it, so the next publish for that delay declares it again.
    fn forget_missing_delay_queue(&mut self, delay_ms: Option<u64>, outcome: &Outcome) {
        if let Some(delay_ms) = delay_ms
            && matches!(outcome, Outcome::Unroutable | Outcome::ExchangeMissing)
        {
            self.declared_delays.remove(&delay_ms);
        }
    }

    /// Ends an operation's hold (the held gauge).
    fn release(&self, shared: &ProxyShared, op: &Op) {
        if op.is_held() {
            shared.metrics.add_held_dead_letters(-1);
        }
    }
}

#[cfg(test)]
mod tests;
