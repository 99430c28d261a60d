//! The capture consumer: how messages that die inside the upstream (TTL, length limits,
//! rejections the proxy did not intercept) come back to the proxy.
//!
//! Every queue declared through the proxy dead-letters upstream into the capture exchange (a
//! durable fanout) bound to the capture queue (a durable quorum queue, replicated across the
//! cluster), which the proxy declares and consumes on its own service connection of the vhost,
//! with its own user ([`super::service`]). [`CaptureConsumer`] is that channel's state machine:
//! it reports when the capture objects exist (bind-ok), when it consumes (consume-ok), and
//! when the upstream takes the consumer away (channel.close, basic.cancel of a queue that was
//! deleted or whose leader moved), so the service connection reconnects. A captured message carries the
//! x-death entry the upstream wrote for the original queue and reason; [`reconstruct`] undoes
//! exactly what the upstream did to the headers, so the proxy can dead-letter the message as
//! if the original queue had done it, with no trace of the capture hop.
//!
//! What the upstream (RabbitMQ 3.10, `rabbit_dead_letter:update_x_death_header`) does, and how
//! it is undone:
//! - no x-death before: it adds `x-first-death-{reason,queue,exchange}` and
//!   `x-death = [E]` with `count = 1`. Undo: remove both.
//! - x-death with entries `H` and no entry for (queue, reason): with 2+ entries it reverses
//!   them (`group_by_queue_and_reason`) and prepends `E`: `[E | reverse(H)]`. Undo:
//!   `reverse(rest)` (reversing one entry changes nothing, so the rule holds for any length).
//! - an entry for (queue, reason) already there: it is moved to the front with `count + 1`
//!   and the rest is reversed as above. Undo: `[E with count - 1 | reverse(rest)]`. Where the
//!   old entry stood is lost, and does not matter: dead-lettering it again for the same
//!   (queue, reason) moves it to the front anyway.
//! - `expiration` is removed and kept as `original-expiration` in a new `E`. Undo: restore it.
//! - with a dead-letter routing key on the upstream queue (a capture tag) 3.10 deletes the
//!   `CC` header. Undo: `CC` is `E.routing-keys` after the first (publish key first, then CC).
//!
//! BCC keys are not in x-death (RabbitMQ leaves them out too); the proxy's private header
//! still carries them (see [`super::bcc`]). Not recoverable: a `CC` header on a message that
//! died twice for the same (queue, reason) under a capture tag.

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{AMQPClass, basic, channel, exchange, queue};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::{Bytes, BytesMut};
use std::fmt::Write as _;

use super::ack_batch::AckBatch;
use super::wire::{WireFrame, content_body_size, method_frame};
use crate::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, decode_method};
use crate::rabbit::args::amqp_integer;

/// Default name of the capture exchange and queue.
pub const DEFAULT_CAPTURE_NAME: &str = "dlx-proxy.capture";

/// Deliveries the capture consumer holds unacknowledged by default (`proxy.capture_prefetch`).
pub const CAPTURE_PREFETCH: u16 = 1000;

/// Consumer tag of the capture consumer.
const CAPTURE_CONSUMER_TAG: &str = "dlx-proxy-capture";

/// The death the upstream recorded, read from the newest x-death entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedDeath {
    pub queue: String,
    pub reason: String,
    pub exchange: String,
    pub routing_keys: Vec<String>,
    /// Seconds since the epoch.
    pub time: u64,
    /// The entry's count after the upstream incremented it.
    pub count: i64,
}

/// Why a captured message cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CaptureError {
    #[error("captured message has no x-death array")]
    NoXDeath,
    #[error("newest x-death entry lacks {0}")]
    MissingField(&'static str),
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn long_text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Reads the newest entry and rebuilds the properties the message had before the upstream
/// dead-lettered it. `upstream_had_routing_key` says whether the upstream queue had a
/// dead-letter routing key (then 3.10 deleted the CC header).
pub fn reconstruct(
    props: &AMQPProperties,
    upstream_had_routing_key: bool,
) -> Result<(AMQPProperties, CapturedDeath), CaptureError> {
    let headers = props.headers().as_ref().ok_or(CaptureError::NoXDeath)?;
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        return Err(CaptureError::NoXDeath);
    };
    let entries = deaths.as_slice();
    let Some(AMQPValue::FieldTable(newest)) = entries.first() else {
        return Err(CaptureError::NoXDeath);
    };
    let field = |name: &'static str| newest.inner().get(name);
    let queue = field("queue")
        .and_then(text)
        .ok_or(CaptureError::MissingField("queue"))?;
    let reason = field("reason")
        .and_then(text)
        .ok_or(CaptureError::MissingField("reason"))?;
    let exchange = field("exchange").and_then(text).unwrap_or_default();
    let routing_keys: Vec<String> = match field("routing-keys") {
        Some(AMQPValue::FieldArray(keys)) => keys.as_slice().iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    let time = match field("time") {
        Some(AMQPValue::Timestamp(t)) => *t,
        Some(other) => amqp_integer(other)
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0),
        None => 0,
    };
    let count = field("count").and_then(amqp_integer).unwrap_or(1);
    let rest = &entries[1..];

    let mut map = headers.inner().clone();
    let mut restored: Vec<AMQPValue> = Vec::with_capacity(entries.len());
    if count > 1 {
        let mut older = newest.inner().clone();
        older.insert(
            ShortString::from("count"),
            AMQPValue::LongLongInt(count - 1),
        );
        restored.push(AMQPValue::FieldTable(FieldTable::from(older)));
    }
    restored.extend(rest.iter().rev().cloned());
    if restored.is_empty() {
        map.remove("x-death");
        map.remove("x-first-death-reason");
        map.remove("x-first-death-queue");
        map.remove("x-first-death-exchange");
    } else {
        map.insert(
            ShortString::from("x-death"),
            AMQPValue::FieldArray(FieldArray::from(restored)),
        );
    }
    if upstream_had_routing_key && count <= 1 && routing_keys.len() > 1 {
        let cc: Vec<AMQPValue> = routing_keys[1..].iter().map(|k| long_text(k)).collect();
        map.insert(
            ShortString::from("CC"),
            AMQPValue::FieldArray(FieldArray::from(cc)),
        );
    }
    let mut before = props.clone().with_headers(FieldTable::from(map));
    if count <= 1
        && let Some(expiration) = field("original-expiration").and_then(text)
        && let Ok(expiration) = ShortString::try_new(expiration)
    {
        before = before.with_expiration(expiration);
    }
    Ok((
        before,
        CapturedDeath {
            queue,
            reason,
            exchange,
            routing_keys,
            time,
            count,
        },
    ))
}

/// A message taken from the capture queue.
#[derive(Clone, Debug)]
pub struct CapturedMessage {
    pub delivery_tag: u64,
    /// The consumer's channel epoch (acks for an older epoch are void).
    pub epoch: u64,
    pub routing_key: String,
    pub raw_properties: Bytes,
    pub body: Bytes,
}

#[derive(Debug)]
struct Incoming {
    delivery_tag: u64,
    routing_key: String,
    raw_properties: Option<Bytes>,
    body: BytesMut,
    remaining: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConsumerState {
    Starting,
    Consuming,
    /// The proxy cancelled the consumer (shutdown); held deliveries may still be settled.
    Cancelling,
    /// The channel is gone (closed by the upstream) or the consumer was cancelled by it.
    Off,
}

/// What the connection must do after a capture-channel frame.
#[derive(Debug, Default)]
pub struct CaptureStep {
    /// Frames to write upstream (on the capture channel).
    pub write: Option<Bytes>,
    /// A complete captured message.
    pub message: Option<CapturedMessage>,
    /// The capture exchange, queue and binding exist (queue.bind-ok).
    pub declared: bool,
    /// The consumer started (basic.consume-ok).
    pub consuming: bool,
    /// The proxy's own basic.cancel was confirmed.
    pub cancelled: bool,
    /// The upstream took the consumer away: why (the connection must be opened again).
    pub lost: Option<String>,
}

/// The capture consumer on the proxy's capture channel.
#[derive(Debug)]
pub struct CaptureConsumer {
    channel: u16,
    name: String,
    state: ConsumerState,
    epoch: u64,
    incoming: Option<Incoming>,
    prefetch: u16,
    /// Capture deliveries taken and not acked yet, and the acks due ([`AckBatch`]).
    acks: AckBatch,
}

impl CaptureConsumer {
    /// A consumer taking up to `prefetch` deliveries unacked.
    pub fn new(channel: u16, name: &str, prefetch: u16) -> Self {
        let prefetch = prefetch.max(1);
        CaptureConsumer {
            channel,
            name: name.to_string(),
            state: ConsumerState::Starting,
            epoch: 1,
            incoming: None,
            prefetch,
            // A held delivery keeps at most a quarter of the window waiting behind it.
            acks: AckBatch::new(usize::from(prefetch / 4).max(1)),
        }
    }

    pub fn channel(&self) -> u16 {
        self.channel
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn is_on(&self) -> bool {
        self.state != ConsumerState::Off
    }

    /// Whether a delivery of `epoch` is still held unacked by this consumer (so it can be
    /// settled later).
    pub fn holds(&self, epoch: u64) -> bool {
        self.is_on() && self.epoch == epoch
    }

    /// Whether the consumer is running (consume-ok seen, not cancelled).
    pub fn is_consuming(&self) -> bool {
        self.state == ConsumerState::Consuming
    }

    /// basic.cancel of the consumer (shutdown): no more deliveries; those held are still
    /// settled on the channel.
    pub fn cancel_frame(&mut self) -> Option<Bytes> {
        if self.state == ConsumerState::Off {
            return None;
        }
        self.state = ConsumerState::Cancelling;
        Some(method_frame(
            self.channel,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: ShortString::from(CAPTURE_CONSUMER_TAG),
                nowait: false,
            })),
        ))
    }

    /// Capture deliveries taken and not acked yet (at most the prefetch).
    pub fn outstanding(&self) -> usize {
        self.acks.outstanding()
    }

    /// Opens the channel, declares exchange and queue (a durable quorum queue) and the
    /// binding, and starts consuming (all pipelined; replies are read by
    /// [`CaptureConsumer::on_frame`]).
    pub fn start_frames(&self) -> Bytes {
        let Ok(name) = ShortString::try_new(self.name.clone()) else {
            return Bytes::new();
        };
        let ch = self.channel;
        let mut out = BytesMut::new();
        let mut put = |method: AMQPClass| out.extend_from_slice(&method_frame(ch, method));
        put(AMQPClass::Channel(channel::AMQPMethod::Open(
            channel::Open {},
        )));
        put(AMQPClass::Exchange(exchange::AMQPMethod::Declare(
            exchange::Declare {
                exchange: name.clone(),
                kind: ShortString::from("fanout"),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )));
        let mut quorum = FieldTable::default();
        quorum.insert(
            ShortString::from("x-queue-type"),
            AMQPValue::LongString(LongString::from("quorum")),
        );
        put(AMQPClass::Queue(queue::AMQPMethod::Declare(
            queue::Declare {
                queue: name.clone(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: quorum,
            },
        )));
        put(AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: name.clone(),
            exchange: name.clone(),
            routing_key: ShortString::from(""),
            nowait: false,
            arguments: FieldTable::default(),
        })));
        put(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: self.prefetch,
            global: false,
        })));
        put(AMQPClass::Basic(basic::AMQPMethod::Consume(
            basic::Consume {
                queue: name,
                consumer_tag: ShortString::from(CAPTURE_CONSUMER_TAG),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )));
        out.freeze()
    }

    /// Handles one upstream frame on the capture channel.
    pub fn on_frame(&mut self, frame: &WireFrame) -> CaptureStep {
        let mut step = CaptureStep::default();
        match frame.kind {
            FRAME_METHOD => match decode_method(frame.payload()) {
                Some(AMQPClass::Queue(queue::AMQPMethod::BindOk(_))) => {
                    step.declared = true;
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))
                    if self.state == ConsumerState::Starting =>
                {
                    self.state = ConsumerState::Consuming;
                    step.consuming = true;
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::CancelOk(_))) => {
                    step.cancelled = true;
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    self.incoming = Some(Incoming {
                        delivery_tag: d.delivery_tag,
                        routing_key: d.routing_key.as_str().to_string(),
                        raw_properties: None,
                        body: BytesMut::new(),
                        remaining: 0,
                    });
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    let mut why = String::new();
                    let _ = write!(
                        why,
                        "capture channel closed by the upstream: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    );
                    self.turn_off();
                    step.lost = Some(why);
                    step.write = Some(method_frame(
                        self.channel,
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                    ));
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    // The capture queue was deleted, or its leader moved (quorum queues cancel
                    // their consumers then): the deliveries held go back when the connection
                    // ends, and the connection is opened again to subscribe anew.
                    self.turn_off();
                    step.lost = Some("capture consumer cancelled by the upstream".into());
                }
                _ => {}
            },
            FRAME_HEADER => {
                if let Some(incoming) = self.incoming.as_mut() {
                    let size = content_body_size(frame.payload()).unwrap_or(0);
                    incoming.raw_properties = Some(Bytes::copy_from_slice(
                        frame.payload().get(12..).unwrap_or_default(),
                    ));
                    incoming.remaining = size;
                    incoming.body.reserve(size.min(16 * 1024 * 1024) as usize);
                    if size == 0 {
                        step.message = self.finish();
                    }
                }
            }
            FRAME_BODY => {
                if let Some(incoming) = self.incoming.as_mut() {
                    incoming.body.extend_from_slice(frame.payload());
                    incoming.remaining = incoming
                        .remaining
                        .saturating_sub(frame.payload().len() as u64);
                    if incoming.remaining == 0 {
                        step.message = self.finish();
                    }
                }
            }
            _ => {}
        }
        step
    }

    fn turn_off(&mut self) {
        self.state = ConsumerState::Off;
        self.incoming = None;
        self.acks.clear();
        self.epoch += 1;
    }

    fn finish(&mut self) -> Option<CapturedMessage> {
        let incoming = self.incoming.take()?;
        self.acks.delivered(incoming.delivery_tag);
        Some(CapturedMessage {
            delivery_tag: incoming.delivery_tag,
            epoch: self.epoch,
            routing_key: incoming.routing_key,
            raw_properties: incoming
                .raw_properties
                .unwrap_or_else(|| Bytes::from_static(&[0, 0])),
            body: incoming.body.freeze(),
        })
    }

    /// A capture delivery is settled (its dead letter confirmed, or dropped): it is acked by
    /// the next [`CaptureConsumer::take_acks`], with the run it completes. `false` if its epoch
    /// is gone (the upstream requeued it with the channel) or it was settled already.
    pub fn ack(&mut self, delivery_tag: u64, epoch: u64) -> bool {
        epoch == self.epoch && self.state != ConsumerState::Off && self.acks.settled(delivery_tag)
    }

    /// The acks due (see [`AckBatch`]): settled runs as `multiple=true` acks; once the
    /// consumer is cancelled (shutdown), also every settled delivery waiting behind a held
    /// one, each on its own, so that it is not delivered again after the close.
    pub fn take_acks(&mut self) -> Option<Bytes> {
        if self.state == ConsumerState::Off {
            return None;
        }
        let mut acks = self.acks.take();
        if self.state == ConsumerState::Cancelling {
            acks.extend(self.acks.take_each());
        }
        if acks.is_empty() {
            return None;
        }
        let mut out = BytesMut::new();
        for ack in acks {
            out.extend_from_slice(&method_frame(
                self.channel,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: ack.delivery_tag,
                    multiple: ack.multiple,
                })),
            ));
        }
        Some(out.freeze())
    }

    /// The requeue (basic.nack) for a capture delivery, if its epoch is current. A refused
    /// dead-letter publish does not come here: the delivery stays unacked while the proxy
    /// holds and retries it ([`super::retry`]).
    pub fn requeue(&mut self, delivery_tag: u64, epoch: u64) -> Option<Bytes> {
        if epoch != self.epoch
            || self.state == ConsumerState::Off
            || !self.acks.forget(delivery_tag)
        {
            return None;
        }
        Some(method_frame(
            self.channel,
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag,
                multiple: false,
                requeue: true,
            })),
        ))
    }
}

#[cfg(test)]
mod tests;
