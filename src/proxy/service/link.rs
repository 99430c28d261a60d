//! The work of one open service connection, as a pure state machine: the capture consumer on
//! channel 1 ([`CaptureConsumer`]) and the dead-letter publisher on channel 2 ([`Publisher`],
//! confirms on). Frames and `now` in, frames out; the task around it ([`super::task`]) only
//! moves bytes.
//!
//! Each captured message is read back into the death its original queue saw
//! ([`death::from_capture`]), decided with the queue's settings ([`death::plan`]) and published
//! to its dead-letter exchange; the capture delivery is acked only once that publish is
//! confirmed. A publish that is nacked, times out or is lost with the publisher channel gives
//! the delivery back to the capture queue after [`super::super::capture::RETRY_DELAY`]:
//! at-least-once, never lost. When the connection ends, the upstream requeues every capture
//! delivery not acked yet.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use crate::metrics::{
    CAPTURED_DEAD_LETTERED, CAPTURED_DISCARDED, CAPTURED_DROPPED, CAPTURED_RETRIED,
};
use crate::proxy::ProxyShared;
use crate::proxy::capture::{CaptureConsumer, CapturedMessage};
use crate::proxy::death::{self, Plan};
use crate::proxy::ops::{Op, Origin, Purpose, Settlement};
use crate::proxy::publisher::{OpId, Outcome, Publisher, Settled};
use crate::proxy::wire::WireFrame;

/// The capture consumer's channel on a service connection.
pub const CAPTURE_CHANNEL: u16 = 1;
/// The dead-letter publisher's channel on a service connection.
pub const PUBLISHER_CHANNEL: u16 = 2;

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
    next_op: OpId,
    cancel_confirmed: bool,
}

impl CaptureLink {
    pub fn new(shared: &ProxyShared, vhost: &str, frame_max: u32) -> Self {
        CaptureLink {
            vhost: vhost.to_string(),
            consumer: CaptureConsumer::new(CAPTURE_CHANNEL, &shared.capture_name),
            publisher: Publisher::new(
                PUBLISHER_CHANNEL,
                frame_max as usize,
                shared.confirm_timeout,
            ),
            ops: HashMap::new(),
            next_op: 1,
            cancel_confirmed: false,
        }
    }

    /// The publisher channel (confirm mode), then the capture objects and the consumer.
    pub fn start_frames(&self) -> Bytes {
        let mut out = BytesMut::new();
        out.extend_from_slice(&self.publisher.open_frames());
        out.extend_from_slice(&self.consumer.start_frames());
        out.freeze()
    }

    /// Dead-letter publishes not yet settled.
    pub fn unsettled(&self) -> usize {
        self.ops.len()
    }

    /// Whether the consumer runs.
    pub fn is_consuming(&self) -> bool {
        self.consumer.is_consuming()
    }

    /// Stops the consumer (shutdown); what it holds is still settled.
    pub fn stop(&mut self) -> Option<Bytes> {
        self.consumer.cancel_frame()
    }

    /// Stopped and settled: the connection may close.
    pub fn is_drained(&self) -> bool {
        self.ops.is_empty() && (self.cancel_confirmed || !self.consumer.is_on())
    }

    /// The earliest deadline (confirm timeouts, delayed requeues).
    pub fn next_deadline(&mut self) -> Option<Instant> {
        match (
            self.publisher.next_deadline(),
            self.consumer.next_deadline(),
        ) {
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
                    self.complete(shared, settled, now, &mut step);
                }
            }
            _ => {}
        }
        step
    }

    /// Confirm timeouts and due requeues.
    pub fn on_timer(&mut self, shared: &ProxyShared, now: Instant) -> LinkStep {
        let mut step = LinkStep::default();
        for settled in self.publisher.expire(now) {
            self.complete(shared, settled, now, &mut step);
        }
        step.send(self.consumer.due_retries(now));
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
                metrics.captured(&self.vhost, CAPTURED_DROPPED);
                step.send(self.consumer.ack(origin.0, origin.1));
                return;
            }
        };
        let arguments = shared.queues.lookup(&self.vhost, &death.queue).or(tagged);
        let view = shared.queue_view(&self.vhost, &death.queue, arguments.as_ref());
        let queue: Arc<str> = death.queue.clone();
        let purpose = Purpose::DeadLetter(death.reason);
        match death::plan(death, &view, &shared.dead_letter_options) {
            Plan::Discard => {
                metrics.captured(&self.vhost, CAPTURED_DISCARDED);
                step.send(self.consumer.ack(origin.0, origin.1));
            }
            Plan::Drop(cause) => {
                metrics.dropped(&self.vhost, &queue, cause);
                metrics.captured(&self.vhost, CAPTURED_DROPPED);
                step.send(self.consumer.ack(origin.0, origin.1));
            }
            Plan::Publish(publish) => {
                let op = self.next_op;
                self.next_op += 1;
                match self.publisher.publish(op, &publish, now) {
                    Ok(bytes) => {
                        step.write.extend_from_slice(&bytes);
                        self.ops.insert(
                            op,
                            Op {
                                origin: Origin::Capture {
                                    tag: origin.0,
                                    epoch: origin.1,
                                },
                                purpose,
                                queue,
                                started: now,
                            },
                        );
                    }
                    Err(why) => {
                        tracing::warn!(
                            queue = &*queue,
                            why,
                            "cannot publish; the message is requeued"
                        );
                        metrics.dead_letter_publish_failed("invalid");
                        metrics.captured(&self.vhost, CAPTURED_RETRIED);
                        self.consumer.retry_later(origin.0, origin.1, now);
                    }
                }
            }
        }
    }

    /// A dead-letter publish ended: ack the capture delivery, or give it back later.
    fn complete(
        &mut self,
        shared: &ProxyShared,
        settled: Settled,
        now: Instant,
        step: &mut LinkStep,
    ) {
        let Some(op) = self.ops.remove(&settled.op) else {
            return;
        };
        let Origin::Capture { tag, epoch } = op.origin else {
            return;
        };
        let metrics = &shared.metrics;
        let outcome = match settled.outcome {
            Outcome::Confirmed => CAPTURED_DEAD_LETTERED,
            Outcome::Unroutable | Outcome::ExchangeMissing => CAPTURED_DROPPED,
            Outcome::Failed(_) | Outcome::TimedOut => CAPTURED_RETRIED,
        };
        metrics.captured(&self.vhost, outcome);
        match death::settle(metrics, &self.vhost, &op, &settled.outcome) {
            Settlement::Ack => step.send(self.consumer.ack(tag, epoch)),
            Settlement::Requeue => self.consumer.retry_later(tag, epoch, now),
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
    use crate::proxy::capture::RETRY_DELAY;
    use crate::proxy::declare::CaptureTag;
    use crate::proxy::wire::{WireCodec, method_frame};
    use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, channel, queue};
    use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
    use std::sync::RwLock;
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

    #[test]
    fn a_nacked_dead_letter_gives_the_capture_delivery_back_later() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        feed(&mut link, &shared, &captured(3, "q"), now);
        let step = link.on_frame(
            &shared,
            &one(
                PUBLISHER_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 1,
                    multiple: false,
                    requeue: false,
                })),
            ),
            now,
        );
        assert!(step.write.is_empty(), "nothing acked");
        assert!(counter(&shared, CAPTURED_RETRIED));
        assert_eq!(link.next_deadline(), Some(now + RETRY_DELAY));
        assert!(link.on_timer(&shared, now).write.is_empty());
        let step = link.on_timer(&shared, now + RETRY_DELAY);
        assert_eq!(
            methods(&step.write),
            vec![(
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 3,
                    multiple: false,
                    requeue: true
                }))
            )]
        );
    }

    #[test]
    fn losing_the_consumer_is_reported() {
        let shared = shared();
        let mut link = CaptureLink::new(&shared, "/", 4096);
        let now = Instant::now();
        let step = link.on_frame(
            &shared,
            &one(
                CAPTURE_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: "dlx-proxy-capture".into(),
                    nowait: true,
                })),
            ),
            now,
        );
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
