//! The work of one open service connection, as a pure state machine: the capture consumer on
//! channel 1 ([`CaptureConsumer`]) and the dead-letter publisher on channel 2 ([`Publisher`],
//! confirms on). Frames and `now` in, frames out; the task around it ([`super::task`]) only
//! moves bytes.
//!
//! Each captured message is read back into the death its original queue saw
//! ([`death::from_capture`]), decided with the queue's settings ([`death::plan`]) and published
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
//! The same publisher channel publishes, for client sessions of the vhost, the dead letters
//! their client's user may not publish ([`PublishRequest`]: a 403 on the session's own
//! channel; RabbitMQ dead-letters as the broker, without permission checks). Each outcome goes
//! back to the session, which settles its client's original only on a confirm and otherwise
//! holds and retries it as before; at most [`FORWARD_LIMIT`] are in flight, and a connection
//! that ends fails the rest back to their sessions.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use crate::metrics::{
    CAPTURED_DEAD_LETTERED, CAPTURED_DISCARDED, CAPTURED_DROPPED, CAPTURED_KEPT, CAPTURED_RETRIED,
};
use crate::proxy::ProxyShared;
use crate::proxy::capture::{CaptureConsumer, CapturedMessage};
use crate::proxy::death::{self, Plan};
use crate::proxy::ops::{Op, Origin, Purpose, Settlement};
use crate::proxy::publisher::{OpId, Outcome, OutgoingMessage, Publisher, Settled};
use crate::proxy::retry::{RetryReason, RetrySchedule};
use crate::proxy::wire::WireFrame;

/// The capture consumer's channel on a service connection.
pub const CAPTURE_CHANNEL: u16 = 1;
/// The dead-letter publisher's channel on a service connection.
pub const PUBLISHER_CHANNEL: u16 = 2;

/// Dead-letter publishes of client sessions in flight on one service connection, at most.
pub const FORWARD_LIMIT: usize = 1024;
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
    /// Publishes made for client sessions, by this connection's operation id.
    forwarded: HashMap<OpId, (OpId, OutcomeSender)>,
    /// `dlx_proxy_capture_unacked{vhost}`.
    unacked: prometheus::IntGauge,
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
            unacked: shared.metrics.capture_unacked(vhost),
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
                self.forwarded.insert(id, (request.op, request.reply));
                Some(bytes)
            }
            Err(why) => {
                let _ = request.reply.send((request.op, Outcome::Failed(why)));
                None
            }
        }
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
        self.let_go_held(shared);
        // The sessions hold theirs and try again.
        for (_, (op, reply)) in self.forwarded.drain() {
            let _ = reply.send((op, Outcome::Failed(FORWARD_LOST)));
        }
        self.unacked.set(0);
    }

    fn let_go_held(&mut self, shared: &ProxyShared) {
        let gone = self.held.take_where(|_| true).len();
        shared.metrics.add_held_dead_letters(-(gone as i64));
    }

    /// The earliest deadline (confirm timeouts, held retries).
    pub fn next_deadline(&mut self) -> Option<Instant> {
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
        for settled in self.publisher.expire(now) {
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
        // The tag is the queue's own record of its dead-letter arguments (the upstream's
        // truth); without one (none given, or too long for a tag) the cached ones or the policy.
        let arguments = tagged
            .or_else(|| shared.queues.proxied(&self.vhost, &death.queue))
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
                step.write.extend_from_slice(&bytes);
                self.ops.insert(id, op);
            }
            Err(why) => {
                death::drop_unpublishable(&shared.metrics, &self.vhost, &op.queue, why);
                shared.metrics.captured(&self.vhost, CAPTURED_DROPPED);
                self.release(shared, &op);
                self.consumer.ack(tag, epoch);
            }
        }
    }

    /// A dead-letter publish ended: ack the capture delivery, or hold it for a retry.
    fn complete(&mut self, shared: &ProxyShared, settled: Settled, now: Instant) {
        if let Some((op, reply)) = self.forwarded.remove(&settled.op) {
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
        if let Some(reason) = RetryReason::of(&settled.outcome) {
            self.refused(shared, op, &settled.outcome, reason, now);
            return;
        }
        self.release(shared, &op);
        let metrics = &shared.metrics;
        let outcome = match (&settled.outcome, op.purpose) {
            (Outcome::Confirmed, Purpose::KeepDeadLetter) => CAPTURED_KEPT,
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
        if op.held_charge == 0 {
            op.held_charge = op.charge();
            metrics.add_held_dead_letters(1);
        }
        let attempt = op.note_refusal(reason);
        self.held.schedule(now, attempt, rand::random::<f64>(), op);
    }

    /// Ends an operation's hold (the held gauge).
    fn release(&self, shared: &ProxyShared, op: &Op) {
        if op.held_charge > 0 {
            shared.metrics.add_held_dead_letters(-1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::content::{decode_properties, encode_properties, put_content};
    use crate::config::{Config, Mode};
    use crate::metrics::Metrics;
    use crate::policy::PolicySet;
    use crate::proxy::declare::CaptureTag;
    use crate::proxy::wire::{WireCodec, method_frame};
    use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, channel, queue};
    use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
    use std::sync::RwLock;
    use std::time::Duration;
    use tokio_util::codec::Decoder;

    fn shared() -> Arc<ProxyShared> {
        let mut config = Config {
            mode: Mode::Proxy,
            ..Config::default()
        };
        config.upstream.url = "amqp://127.0.0.1:1".into();
        ProxyShared::new(
            &config,
            Arc::new(RwLock::new(PolicySet::from_configs(&[]).unwrap())),
            Metrics::new(10),
        )
        .unwrap()
    }

    fn frames(bytes: &[u8]) -> Vec<WireFrame> {
        let mut buf = BytesMut::from(bytes);
        let mut codec = WireCodec::new(1 << 20);
        std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).collect()
    }

    fn methods(bytes: &[u8]) -> Vec<(u16, AMQPClass)> {
        frames(bytes)
            .into_iter()
            .filter(|f| f.kind == crate::amqp::codec::FRAME_METHOD)
            .map(|f| {
                (
                    f.channel,
                    crate::amqp::codec::decode_method(&f.payload).unwrap(),
                )
            })
            .collect()
    }

    fn one(channel: u16, method: AMQPClass) -> WireFrame {
        frames(&method_frame(channel, method)).pop().unwrap()
    }

    /// A capture delivery of a message that expired in `queue`, tagged with its DLX and DLRK.
    fn captured(tag: u64, queue: &str) -> Vec<WireFrame> {
        let mut entry = FieldTable::default();
        entry.insert("count".into(), AMQPValue::LongLongInt(1));
        entry.insert("queue".into(), AMQPValue::LongString(queue.into()));
        entry.insert("reason".into(), AMQPValue::LongString("expired".into()));
        entry.insert("exchange".into(), AMQPValue::LongString("".into()));
        entry.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        entry.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                LongString::from(queue),
            )])),
        );
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
        );
        let props = encode_properties(&BasicProperties::default().with_headers(headers));
        let routing_key = CaptureTag {
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: Some("dlq".into()),
            delivery_limit: None,
        }
        .encode()
        .unwrap();
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&method_frame(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "dlx-proxy-capture".into(),
                delivery_tag: tag,
                redelivered: false,
                exchange: "cap".into(),
                routing_key: ShortString::try_new(routing_key).unwrap(),
            })),
        ));
        put_content(&mut wire, CAPTURE_CHANNEL, &props, b"body", 4096);
        frames(&wire)
    }

    fn feed(
        link: &mut CaptureLink,
        shared: &ProxyShared,
        wire: &[WireFrame],
        now: Instant,
    ) -> LinkStep {
        let mut all = LinkStep::default();
        for frame in wire {
            let step = link.on_frame(shared, frame, now);
            all.write.extend_from_slice(&step.write);
            all.declared |= step.declared;
            all.consuming |= step.consuming;
            all.lost = all.lost.or(step.lost);
        }
        all
    }

    fn counter(shared: &ProxyShared, outcome: &str) -> bool {
        shared.metrics.encode().contains(&format!(
            "dlx_proxy_captured_total{{outcome=\"{outcome}\",vhost=\"/\"}} 1"
        ))
    }

    #[test]
    fn declares_a_quorum_queue_and_reports_readiness() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let setup = methods(&link.start_frames());
        let declare = setup.iter().find_map(|(_, m)| match m {
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => Some(d.clone()),
            _ => None,
        });
        let declare = declare.expect("queue.declare");
        assert!(declare.durable);
        assert_eq!(
            declare.arguments.inner().get("x-queue-type"),
            Some(&AMQPValue::LongString("quorum".into()))
        );
        assert!(
            setup
                .iter()
                .any(|(ch, m)| *ch == PUBLISHER_CHANNEL && matches!(m, AMQPClass::Confirm(_)))
        );
        let now = Instant::now();
        let step = link.on_frame(
            &shared,
            &one(
                CAPTURE_CHANNEL,
                AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            ),
            now,
        );
        assert!(step.declared && !step.consuming);
        let step = link.on_frame(
            &shared,
            &one(
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: "dlx-proxy-capture".into(),
                })),
            ),
            now,
        );
        assert!(step.consuming);
        assert!(link.is_consuming());
    }

    #[test]
    fn a_captured_message_is_acked_only_after_its_dead_letter_is_confirmed() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        let step = feed(&mut link, &shared, &captured(7, "q"), now);
        let sent = methods(&step.write);
        let [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(publish)))] =
            sent.as_slice()
        else {
            panic!("expected one publish on the publisher channel: {sent:?}");
        };
        assert_eq!(publish.exchange.as_str(), "dlx");
        assert_eq!(publish.routing_key.as_str(), "dlq");
        // The dead letter carries the x-death of the original queue, not of the capture hop.
        let header = frames(&step.write)
            .into_iter()
            .find(|f| f.kind == crate::amqp::codec::FRAME_HEADER)
            .unwrap();
        let props = decode_properties(&header.payload[12..]).unwrap();
        let deaths = crate::deadletter::x_death_entries(&props);
        assert_eq!(deaths.len(), 1);
        assert_eq!(deaths[0].queue, "q");
        assert_eq!(deaths[0].reason, "expired");
        assert_eq!(link.unsettled(), 1);
        // Confirmed: the capture delivery is acked.
        let step = link.on_frame(
            &shared,
            &one(
                PUBLISHER_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 1,
                    multiple: false,
                })),
            ),
            now,
        );
        assert_eq!(
            methods(&step.write),
            vec![(
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 7,
                    multiple: false
                }))
            )]
        );
        assert_eq!(link.unsettled(), 0);
        assert!(counter(&shared, CAPTURED_DEAD_LETTERED));
    }

    fn gauge(shared: &ProxyShared, line: &str) -> bool {
        shared.metrics.encode().lines().any(|l| l == line)
    }

    /// The upstream's basic.cancel of the capture consumer.
    fn cancel() -> WireFrame {
        one(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: "dlx-proxy-capture".into(),
                nowait: true,
            })),
        )
    }

    fn confirm(kind: &str, delivery_tag: u64) -> WireFrame {
        let method = if kind == "ack" {
            basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag,
                multiple: false,
            })
        } else {
            basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag,
                multiple: false,
                requeue: false,
            })
        };
        one(PUBLISHER_CHANNEL, AMQPClass::Basic(method))
    }

    #[test]
    fn a_nacked_dead_letter_is_held_and_published_again_after_the_backoff() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        feed(&mut link, &shared, &captured(3, "q"), now);
        // Refused twice: held each time, never given back to the capture queue (no nack,
        // no ack on the capture channel), retried after the doubling backoff.
        let mut at = now;
        for (seq, nominal_ms) in [(1u64, 100u64), (2, 200)] {
            let step = link.on_frame(&shared, &confirm("nack", seq), at);
            assert!(
                step.write.is_empty(),
                "nothing settled: {:?}",
                methods(&step.write)
            );
            assert_eq!(link.held(), 1);
            assert!(gauge(&shared, "dlx_proxy_dead_letters_held 1"));
            let due = link.next_deadline().unwrap();
            let wait = due - at;
            assert!(
                wait >= Duration::from_millis(nominal_ms / 2)
                    && wait <= Duration::from_millis(nominal_ms),
                "{wait:?}"
            );
            assert!(link.on_timer(&shared, at).write.is_empty());
            let step = link.on_timer(&shared, due);
            let sent = methods(&step.write);
            assert!(
                matches!(
                    sent.as_slice(),
                    [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                        if p.exchange.as_str() == "dlx"
                ),
                "{sent:?}"
            );
            assert_eq!(link.held(), 0);
            at = due;
        }
        assert!(gauge(
            &shared,
            "dlx_proxy_dead_letter_retries_total{reason=\"nacked\"} 2"
        ));
        // The third publish is confirmed: the capture delivery is acked, nothing held.
        let step = link.on_frame(&shared, &confirm("ack", 3), at);
        assert_eq!(
            methods(&step.write),
            vec![(
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 3,
                    multiple: false
                }))
            )]
        );
        assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
        assert_eq!(link.unsettled(), 0);
        assert!(counter(&shared, CAPTURED_DEAD_LETTERED));
    }

    fn basic_ack(delivery_tag: u64, multiple: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        }))
    }

    #[test]
    fn confirmed_runs_are_acked_with_one_multiple_ack_and_a_held_one_waits() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        for tag in 1..=4 {
            feed(&mut link, &shared, &captured(tag, "q"), now);
        }
        assert!(gauge(&shared, "dlx_proxy_capture_unacked{vhost=\"/\"} 4"));
        // Publishes 1..3 confirmed at once: one ack covers capture deliveries 1..3.
        let step = link.on_frame(&shared, &one(PUBLISHER_CHANNEL, basic_ack(3, true)), now);
        assert_eq!(
            methods(&step.write),
            vec![(CAPTURE_CHANNEL, basic_ack(3, true))]
        );
        assert!(gauge(&shared, "dlx_proxy_capture_unacked{vhost=\"/\"} 1"));
        // Two more: the first one's publish is refused (held), the second confirmed; its ack
        // waits behind the held one.
        feed(&mut link, &shared, &captured(5, "q"), now);
        link.on_frame(&shared, &confirm("nack", 4), now);
        let step = link.on_frame(&shared, &confirm("ack", 5), now);
        assert!(step.write.is_empty(), "{:?}", methods(&step.write));
        assert_eq!(link.held(), 1);
        // Shutdown: the consumer is cancelled and the waiting one acked on its own; the held
        // one stays unacked (the upstream requeues it with the connection).
        let out = link.stop(&shared).expect("cancel");
        let sent = methods(&out);
        assert!(matches!(
            sent[0],
            (
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(_))
            )
        ));
        assert_eq!(sent[1..], [(CAPTURE_CHANNEL, basic_ack(5, false))]);
    }

    #[test]
    fn a_held_dead_letter_is_let_go_with_its_consumer() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        feed(&mut link, &shared, &captured(3, "q"), now);
        link.on_frame(&shared, &confirm("nack", 1), now);
        assert_eq!(link.held(), 1);
        // The upstream cancels the consumer: the delivery went back to the capture queue, so
        // the retry is not published.
        let lost = link.on_frame(&shared, &cancel(), now);
        assert!(lost.lost.is_some());
        let later = now + Duration::from_secs(60);
        assert!(link.on_timer(&shared, later).write.is_empty());
        assert_eq!(link.held(), 0);
        assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
        // And what a connection holds when it ends is let go too.
        let mut link = CaptureLink::new(&shared, "/", 4096);
        feed(&mut link, &shared, &captured(4, "q"), now);
        link.on_frame(&shared, &confirm("nack", 1), now);
        assert!(gauge(&shared, "dlx_proxy_dead_letters_held 1"));
        link.end(&shared);
        assert_eq!(link.held(), 0);
        assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
    }

    #[test]
    fn a_sessions_dead_letter_is_published_and_its_outcome_sent_back() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        let (reply, mut outcomes) = mpsc::unbounded_channel();
        let message = OutgoingMessage {
            exchange: "dlx".into(),
            routing_key: "k".into(),
            raw_properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"x"),
        };
        let request = |op| PublishRequest {
            op,
            message: message.clone(),
            reply: reply.clone(),
        };
        let sent = methods(&link.publish_for(request(41), now).unwrap());
        assert!(matches!(
            sent.as_slice(),
            [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                if p.exchange.as_str() == "dlx"
        ));
        assert!(!link.is_drained(), "a forwarded publish is waited for");
        link.publish_for(request(42), now).unwrap();
        // Confirmed: the session hears it; nothing is acked on the capture channel.
        let step = link.on_frame(&shared, &confirm("ack", 1), now);
        assert!(step.write.is_empty());
        assert_eq!(outcomes.try_recv().unwrap(), (41, Outcome::Confirmed));
        // The connection ends: the other one fails back to its session, to be retried.
        link.end(&shared);
        assert_eq!(
            outcomes.try_recv().unwrap(),
            (42, Outcome::Failed(FORWARD_LOST))
        );
        assert_eq!(link.unsettled(), 0);
    }

    #[test]
    fn losing_the_consumer_is_reported() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        let step = link.on_frame(&shared, &cancel(), now);
        assert_eq!(
            step.lost.as_deref(),
            Some("capture consumer cancelled by the upstream")
        );
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let step = link.on_frame(
            &shared,
            &one(
                CAPTURE_CHANNEL,
                AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                    reply_code: 406,
                    reply_text: "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'".into(),
                    class_id: 50,
                    method_id: 10,
                })),
            ),
            now,
        );
        assert!(step.lost.unwrap().contains("406 PRECONDITION_FAILED"));
        // The close is answered.
        assert!(matches!(
            methods(&step.write)[0].1,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
        ));
    }

    #[test]
    fn a_message_without_a_death_record_is_dropped_and_counted() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&method_frame(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "dlx-proxy-capture".into(),
                delivery_tag: 1,
                redelivered: false,
                exchange: "cap".into(),
                routing_key: "".into(),
            })),
        ));
        put_content(&mut wire, CAPTURE_CHANNEL, &[0, 0], b"x", 4096);
        let step = feed(&mut link, &shared, &frames(&wire), Instant::now());
        assert!(matches!(
            methods(&step.write)[0].1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(_))
        ));
        assert!(counter(&shared, CAPTURED_DROPPED));
    }
}
