//! The dead-letter publisher: the proxy's own channel on the client's upstream connection, in
//! confirm mode, used for dead-letter publishes and delivery-limit republishes.
//!
//! A pure state machine: [`Publisher::publish`] returns the frames to write and remembers the
//! confirm sequence number; [`Publisher::on_frame`] reads the upstream's replies on this
//! channel and reports settled publishes:
//! - `basic.ack` → [`Outcome::Confirmed`], or [`Outcome::Unroutable`] when a `basic.return`
//!   (every publish is `mandatory`) came first. Returns carry no sequence number; RabbitMQ
//!   sends them in publish order before the ack, so a return belongs to the oldest
//!   unconfirmed, not yet returned publish with the same exchange, routing key and content
//!   (properties, `BCC` aside since the broker strips it, and body). Only when no publish has
//!   those properties (the broker re-encoded them) does one with the same exchange, routing
//!   key and body take it; a return of none of them (its publish timed out) marks nothing. The exchange and key alone would not do: an older
//!   publish with the same ones may be routable where this one is not (its `CC` header, the
//!   headers a headers exchange matches, a binding made between the two);
//! - `basic.nack` → [`Outcome::Failed`] ([`NACKED`]);
//! - `channel.close` (a publish to a missing exchange closes the channel with 404, to a
//!   forbidden one with 403) → the publishes to the exchange named in the reply text are
//!   [`Outcome::ExchangeMissing`] (404) or [`Outcome::AccessRefused`] (403), the
//!   other unconfirmed ones [`Outcome::Failed`] (the broker discarded them, or their confirm is
//!   lost); the channel is reopened in confirm mode right away;
//! - no confirm within `proxy.confirm_timeout_secs` → [`Outcome::TimedOut`].
//!
//! A channel that only nacks is recycled. RabbitMQ 3.10's quorum-queue client can be left
//! pointing at a dead leader after a node loss and then nacks every publish on that channel
//! for as long as it lives; a fresh channel asks the queue's members again. After
//! [`RECYCLE_AFTER_NACKS`] nacks in a row with no ack between, the publisher stops sending,
//! waits for the publishes in flight to settle (or time out), closes the channel itself and
//! reopens it in confirm mode on `close-ok`. Publishes asked for meanwhile are kept, in
//! order, and sent right after the reopen (counted in [`Publisher::unconfirmed`]). A DLQ that
//! refuses with `reject-publish` also nacks in a row; its dead letters are held and retried
//! with backoff by the caller, so recycling then costs one channel round trip per few retries.
//!
//! What the session does with each outcome (settle, drop, or hold and retry) is in
//! `super::intercept` and [`super::retry`].

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, basic, channel, confirm};
use amq_protocol::types::{FieldTable, ShortString};
use bytes::{Bytes, BytesMut};

use super::bcc::without_hop_header;
use super::wire::{WireFrame, content_body_size, method_frame};
use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_METHOD, FRAME_OVERHEAD, SHORT_STRING_MAX, decode_method,
    put_basic_publish,
};
use crate::amqp::content::{decode_properties, header_map, put_content};
use crate::amqp::reply::{ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED};
use crate::deadletter::HEADER_BCC;

/// The cause of [`Outcome::Failed`] for a basic.nack.
pub const NACKED: &str = "nack";
/// The cause of [`Outcome::Failed`] for a message no publish can carry (a name that is not a
/// short string, properties that do not fit in one frame): it ends the publish (dropped,
/// counted), since a retry would fail again.
pub const UNPUBLISHABLE: &str = "unpublishable";
/// Why [`Publisher::publish`] refuses a message whose content header frame, properties
/// rewritten by the dead-lettering included, is over the connection's frame_max: the header
/// cannot be split, and RabbitMQ answers an oversized frame by closing the connection (501).
pub const PROPERTIES_TOO_LARGE: &str = "properties larger than the frame size";
/// Why publishes failed when the upstream refused a dead letter's `user_id` (406: it names
/// another user than the publishing one, which has no `impersonator` tag).
pub const USER_ID_REFUSED: &str = "user_id_refused";

/// Nacks in a row (no ack between) after which the channel is closed and opened again.
pub const RECYCLE_AFTER_NACKS: u32 = 3;
/// Why the publisher channel was opened again: the upstream closed it.
pub const REOPEN_CLOSED: &str = "closed";
/// ... it only nacked, and the publisher recycled it.
pub const REOPEN_NACKS: &str = "nacks";

/// Identifies the operation a publish belongs to (chosen by the caller).
pub type OpId = u64;

/// A message to publish.
#[derive(Clone, Debug)]
pub struct OutgoingMessage {
    pub exchange: String,
    pub routing_key: String,
    /// Encoded property section.
    pub raw_properties: Bytes,
    pub body: Bytes,
}

/// How a publish ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Confirmed,
    /// Confirmed after a basic.return: no queue was bound for its keys.
    Unroutable,
    /// The exchange does not exist (channel closed with 404).
    ExchangeMissing,
    /// The client's user may not publish to the exchange (channel closed with 403).
    AccessRefused,
    /// Nacked by the broker, or lost with the channel.
    Failed(&'static str),
    TimedOut,
}

/// One settled publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settled {
    pub op: OpId,
    pub outcome: Outcome,
}

#[derive(Debug)]
struct Record {
    op: OpId,
    exchange: String,
    routing_key: String,
    /// The content as published (shared with the caller's copy, not copied).
    raw_properties: Bytes,
    body: Bytes,
    returned: bool,
    deadline: Instant,
}

#[derive(Debug)]
struct ReturnedContent {
    exchange: String,
    routing_key: String,
    /// Body size from the content header, once it arrived.
    size: Option<u64>,
    remaining: u64,
    /// The returned property section.
    properties: Bytes,
    /// The returned body so far, hashed (a return is matched by content without keeping it).
    body_hash: std::collections::hash_map::DefaultHasher,
}

/// A body's hash as [`ReturnedContent::body_hash`] computes it, frame by frame.
fn body_hash(body: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    hasher.write(body);
    hasher.finish()
}

/// Whether a returned property section is the one published, `BCC` aside (the broker strips
/// it at publish).
fn same_properties(published: &[u8], returned: &[u8]) -> bool {
    if published == returned {
        return true;
    }
    let without_bcc = |raw: &[u8]| {
        decode_properties(raw).ok().map(|props| {
            let mut headers = header_map(&props);
            headers.remove(HEADER_BCC);
            props.with_headers(FieldTable::from(headers))
        })
    };
    match (without_bcc(published), without_bcc(returned)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// What a frame on the publisher channel asks of the session.
#[derive(Debug, Default)]
pub struct PublisherStep {
    pub settled: Vec<Settled>,
    pub write: Option<Bytes>,
    /// The channel is being opened again, and why ([`REOPEN_CLOSED`], [`REOPEN_NACKS`]).
    pub reopened: Option<&'static str>,
}

impl PublisherStep {
    fn send(&mut self, bytes: Bytes) {
        self.write = Some(match self.write.take() {
            None => bytes,
            Some(first) => {
                let mut both = BytesMut::with_capacity(first.len() + bytes.len());
                both.extend_from_slice(&first);
                both.extend_from_slice(&bytes);
                both.freeze()
            }
        });
    }
}

/// Where the channel is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChannelState {
    Open,
    /// Recycling: nothing new is sent until the publishes in flight have settled.
    Draining,
    /// `channel.close` sent; waiting for `close-ok` to open it again.
    Closing,
}

/// A publish asked for while the channel is being recycled.
#[derive(Debug)]
struct Waiting {
    op: OpId,
    /// Its names were checked when the publish was asked for.
    message: OutgoingMessage,
    deadline: Instant,
}

/// The publisher channel.
#[derive(Debug)]
pub struct Publisher {
    channel: u16,
    frame_max: usize,
    confirm_timeout: Duration,
    next_seq: u64,
    unconfirmed: BTreeMap<u64, Record>,
    deadlines: VecDeque<(Instant, u64, u64)>,
    epoch: u64,
    returned: Option<ReturnedContent>,
    state: ChannelState,
    nacks_in_a_row: u32,
    waiting: VecDeque<Waiting>,
}

impl Publisher {
    pub fn new(channel: u16, frame_max: usize, confirm_timeout: Duration) -> Self {
        Publisher {
            channel,
            frame_max,
            confirm_timeout,
            next_seq: 1,
            unconfirmed: BTreeMap::new(),
            deadlines: VecDeque::new(),
            epoch: 1,
            returned: None,
            state: ChannelState::Open,
            nacks_in_a_row: 0,
            waiting: VecDeque::new(),
        }
    }

    pub fn channel(&self) -> u16 {
        self.channel
    }

    /// Publishes not settled yet: in flight, or waiting for a recycled channel.
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed.len() + self.waiting.len()
    }

    /// channel.open + confirm.select.
    pub fn open_frames(&self) -> Bytes {
        let mut out = BytesMut::new();
        out.extend_from_slice(&method_frame(
            self.channel,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        out.extend_from_slice(&method_frame(
            self.channel,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        ));
        out.freeze()
    }

    /// Encodes a publish (mandatory, confirm-tracked). `Err` if a name is not a short string
    /// or the properties do not fit in one frame ([`PROPERTIES_TOO_LARGE`]).
    /// While the channel is recycled the publish is kept and the bytes are empty; it goes
    /// out with the reopen.
    pub fn publish(
        &mut self,
        op: OpId,
        message: &OutgoingMessage,
        now: Instant,
    ) -> Result<Bytes, &'static str> {
        if message.exchange.len() > SHORT_STRING_MAX {
            return Err("exchange name too long");
        }
        if message.routing_key.len() > SHORT_STRING_MAX {
            return Err("routing key too long");
        }
        // The content header frame: class, weight and body size (12 bytes) and the properties.
        let fits = |properties: &[u8]| {
            self.frame_max == 0 || 12 + properties.len() + FRAME_OVERHEAD <= self.frame_max
        };
        let smaller;
        let message = if fits(&message.raw_properties) {
            message
        } else {
            // The proxy's mark of its dead letters gives way first: without it the message
            // only misses the cycle rule's check one lap later (the hop limit still applies).
            let Some(properties) = without_hop_header(&message.raw_properties).filter(|p| fits(p))
            else {
                return Err(PROPERTIES_TOO_LARGE);
            };
            smaller = OutgoingMessage {
                raw_properties: properties,
                ..message.clone()
            };
            &smaller
        };
        let deadline = now + self.confirm_timeout;
        if self.state != ChannelState::Open {
            self.waiting.push_back(Waiting {
                op,
                message: message.clone(),
                deadline,
            });
            return Ok(Bytes::new());
        }
        Ok(self.encode(op, message, deadline))
    }

    fn encode(&mut self, op: OpId, message: &OutgoingMessage, deadline: Instant) -> Bytes {
        // The three frames' overheads and fixed fields fit in 64 bytes (a body over one frame
        // makes put_content reserve the rest).
        let names = message.exchange.len() + message.routing_key.len();
        let mut out =
            BytesMut::with_capacity(message.body.len() + message.raw_properties.len() + names + 64);
        put_basic_publish(
            &mut out,
            self.channel,
            &message.exchange,
            &message.routing_key,
            true,
        );
        put_content(
            &mut out,
            self.channel,
            &message.raw_properties,
            &message.body,
            self.frame_max,
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unconfirmed.insert(
            seq,
            Record {
                op,
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
                raw_properties: message.raw_properties.clone(),
                body: message.body.clone(),
                returned: false,
                deadline,
            },
        );
        self.deadlines.push_back((deadline, seq, self.epoch));
        out.freeze()
    }

    /// The publishes kept while the channel was recycled, encoded on the reopened channel.
    fn send_waiting(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        while let Some(w) = self.waiting.pop_front() {
            out.extend_from_slice(&self.encode(w.op, &w.message, w.deadline));
        }
        out.freeze()
    }

    /// A fresh epoch: confirm numbering starts again at 1, late confirms are ignored.
    fn new_epoch(&mut self) {
        self.next_seq = 1;
        self.epoch += 1;
        self.deadlines.clear();
        self.returned = None;
        self.nacks_in_a_row = 0;
    }

    /// Closes a recycling channel once nothing is in flight on it.
    fn close_when_drained(&mut self, step: &mut PublisherStep) {
        if self.state != ChannelState::Draining || !self.unconfirmed.is_empty() {
            return;
        }
        self.state = ChannelState::Closing;
        self.new_epoch();
        step.send(method_frame(
            self.channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: ShortString::from("reopening after repeated nacks"),
                class_id: 0,
                method_id: 0,
            })),
        ));
        step.reopened = Some(REOPEN_NACKS);
        tracing::warn!(
            channel = self.channel,
            nacks = RECYCLE_AFTER_NACKS,
            "dead-letter publisher channel only nacks: closing it and opening a new one"
        );
    }

    /// Handles one upstream frame on the publisher channel.
    pub fn on_frame(&mut self, frame: &WireFrame) -> PublisherStep {
        let mut step = PublisherStep::default();
        match frame.kind {
            FRAME_METHOD => match decode_method(frame.payload()) {
                Some(AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) => {
                    self.nacks_in_a_row = 0;
                    self.take_confirmed(ack.delivery_tag, ack.multiple, |record| {
                        let outcome = if record.returned {
                            Outcome::Unroutable
                        } else {
                            Outcome::Confirmed
                        };
                        step.settled.push(Settled {
                            op: record.op,
                            outcome,
                        });
                    });
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Nack(nack))) => {
                    let settled = self.take_confirmed(nack.delivery_tag, nack.multiple, |record| {
                        step.settled.push(Settled {
                            op: record.op,
                            outcome: Outcome::Failed(NACKED),
                        });
                    });
                    if settled > 0 {
                        self.nacks_in_a_row = self.nacks_in_a_row.saturating_add(1);
                    }
                    if self.nacks_in_a_row >= RECYCLE_AFTER_NACKS
                        && self.state == ChannelState::Open
                    {
                        self.state = ChannelState::Draining;
                    }
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Return(ret))) => {
                    self.returned = Some(ReturnedContent {
                        exchange: ret.exchange.as_str().to_string(),
                        routing_key: ret.routing_key.as_str().to_string(),
                        size: None,
                        remaining: 0,
                        properties: Bytes::new(),
                        body_hash: std::collections::hash_map::DefaultHasher::new(),
                    });
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    let close_ok = method_frame(
                        self.channel,
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                    );
                    if self.state == ChannelState::Closing {
                        // Both sides closed at once: answer, and reopen on the close-ok of
                        // ours (nothing was in flight).
                        step.send(close_ok);
                    } else {
                        step.settled =
                            self.fail_on_close(close.reply_code, close.reply_text.as_str());
                        step.send(close_ok);
                        self.reopen(&mut step, REOPEN_CLOSED);
                    }
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
                    if self.state == ChannelState::Closing =>
                {
                    self.reopen(&mut step, REOPEN_NACKS);
                    // Counted when the close was sent.
                    step.reopened = None;
                }
                _ => {}
            },
            FRAME_HEADER => {
                let size = content_body_size(frame.payload()).unwrap_or(0);
                if let Some(returned) = self.returned.as_mut() {
                    returned.size = Some(size);
                    returned.remaining = size;
                    returned.properties =
                        Bytes::copy_from_slice(frame.payload().get(12..).unwrap_or_default());
                    if size == 0 {
                        self.finish_return();
                    }
                }
            }
            FRAME_BODY => {
                if let Some(returned) = self.returned.as_mut()
                    && returned.size.is_some()
                {
                    std::hash::Hasher::write(&mut returned.body_hash, frame.payload());
                    returned.remaining = returned
                        .remaining
                        .saturating_sub(frame.payload().len() as u64);
                    if returned.remaining == 0 {
                        self.finish_return();
                    }
                }
            }
            _ => {}
        }
        self.close_when_drained(&mut step);
        step
    }

    /// Opens the channel again in confirm mode and sends what waited for it.
    fn reopen(&mut self, step: &mut PublisherStep, cause: &'static str) {
        self.state = ChannelState::Open;
        step.send(self.open_frames());
        let waiting = self.send_waiting();
        if !waiting.is_empty() {
            step.send(waiting);
        }
        step.reopened = Some(cause);
    }

    fn finish_return(&mut self) {
        let Some(returned) = self.returned.take() else {
            return;
        };
        let returned_hash = std::hash::Hasher::finish(&returned.body_hash);
        // The broker returns the body as published; only the properties may come back
        // encoded otherwise.
        let candidate = |r: &Record| {
            !r.returned
                && r.exchange == returned.exchange
                && r.routing_key == returned.routing_key
                && returned.size == Some(r.body.len() as u64)
                && body_hash(&r.body) == returned_hash
        };
        let same_content = self
            .unconfirmed
            .values()
            .position(|r| candidate(r) && same_properties(&r.raw_properties, &returned.properties));
        let at = same_content.or_else(|| self.unconfirmed.values().position(candidate));
        if let Some(record) = at.and_then(|at| self.unconfirmed.values_mut().nth(at)) {
            record.returned = true;
        }
    }

    /// Hands each publish `seq` confirms (or nacks) to `settle`, in publish order; how many.
    fn take_confirmed(
        &mut self,
        seq: u64,
        multiple: bool,
        mut settle: impl FnMut(Record),
    ) -> usize {
        if multiple {
            // Taken from the front one by one: `split_off` would allocate a new tree for the
            // publishes still unconfirmed at every multiple confirm.
            let mut count = 0;
            while let Some(first) = self.unconfirmed.first_entry() {
                if *first.key() > seq {
                    break;
                }
                settle(first.remove());
                count += 1;
            }
            count
        } else {
            self.unconfirmed.remove(&seq).map(settle).map_or(0, |()| 1)
        }
    }

    fn fail_on_close(&mut self, code: u16, text: &str) -> Vec<Settled> {
        // 404: the exchange does not exist (the message is dropped, as RabbitMQ does); 403:
        // the client's user may not publish to it (the message is held and retried).
        let blamed = if code == ACCESS_REFUSED {
            Outcome::AccessRefused
        } else {
            Outcome::ExchangeMissing
        };
        let unusable = code == NOT_FOUND || code == ACCESS_REFUSED;
        let missing = if unusable {
            missing_exchange(text)
        } else {
            None
        };
        let user_id_refused = code == PRECONDITION_FAILED && text.contains("user_id");
        let lost = if user_id_refused {
            USER_ID_REFUSED
        } else {
            "channel closed"
        };
        let records = std::mem::take(&mut self.unconfirmed);
        let mut settled = Vec::with_capacity(records.len());
        let mut blamed_first = false;
        for (_, record) in records {
            let outcome = match &missing {
                // RabbitMQ names the default exchange `amq.default` in its texts.
                Some(name)
                    if *name == record.exchange
                        || (name == "amq.default" && record.exchange.is_empty()) =>
                {
                    blamed.clone()
                }
                None if unusable && !blamed_first => {
                    blamed_first = true;
                    blamed.clone()
                }
                _ => Outcome::Failed(lost),
            };
            settled.push(Settled {
                op: record.op,
                outcome,
            });
        }
        if code == ACCESS_REFUSED {
            tracing::warn!(
                code,
                text,
                "dead-letter exchange refused to the client's user"
            );
        } else if user_id_refused {
            tracing::warn!(
                code,
                text,
                "a dead letter's user_id is not the publishing user's: RabbitMQ accepts that \
                 only from a user with the impersonator tag (give it to the proxy's service \
                 user); the dead letters are held and retried"
            );
        } else if code != NOT_FOUND {
            tracing::warn!(
                code,
                text,
                "dead-letter publisher channel closed by the upstream"
            );
        }
        self.new_epoch();
        settled
    }

    /// Moves every confirm deadline `by` later: the upstream was not read for that long (the
    /// session paused its reads), so a confirm may have been waiting unread.
    pub fn postpone(&mut self, by: Duration) {
        if by.is_zero() {
            return;
        }
        for record in self.unconfirmed.values_mut() {
            record.deadline += by;
        }
        for (at, _, _) in self.deadlines.iter_mut() {
            *at += by;
        }
        for waiting in self.waiting.iter_mut() {
            waiting.deadline += by;
        }
    }

    /// The earliest confirm deadline.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        let waiting = self.waiting.front().map(|w| w.deadline);
        while let Some(&(at, seq, epoch)) = self.deadlines.front() {
            let live =
                epoch == self.epoch && self.unconfirmed.get(&seq).is_some_and(|r| r.deadline == at);
            if live {
                return Some(waiting.map_or(at, |w| w.min(at)));
            }
            self.deadlines.pop_front();
        }
        waiting
    }

    /// Publishes whose confirm did not come in time (their late confirms are ignored), and
    /// kept ones whose deadline passed while the channel was recycled. A recycling channel
    /// left with nothing in flight is closed.
    pub fn expire(&mut self, now: Instant) -> PublisherStep {
        let mut step = PublisherStep::default();
        while let Some(&(at, seq, epoch)) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            if epoch != self.epoch {
                continue;
            }
            if let Some(record) = self.unconfirmed.remove(&seq) {
                step.settled.push(Settled {
                    op: record.op,
                    outcome: Outcome::TimedOut,
                });
            }
        }
        while self.waiting.front().is_some_and(|w| w.deadline <= now) {
            if let Some(w) = self.waiting.pop_front() {
                step.settled.push(Settled {
                    op: w.op,
                    outcome: Outcome::TimedOut,
                });
            }
        }
        self.close_when_drained(&mut step);
        step
    }

    /// Every unconfirmed publish, failed (the connection is going away).
    pub fn fail_all(&mut self) -> Vec<Settled> {
        let records = std::mem::take(&mut self.unconfirmed);
        self.deadlines.clear();
        let waiting = std::mem::take(&mut self.waiting);
        records
            .into_values()
            .map(|r| r.op)
            .chain(waiting.into_iter().map(|w| w.op))
            .map(|op| Settled {
                op,
                outcome: Outcome::Failed("connection closed"),
            })
            .collect()
    }
}

/// The exchange named in RabbitMQ's `NOT_FOUND - no exchange 'X' in vhost 'V'` or
/// `ACCESS_REFUSED - access to exchange 'X' in vhost 'V' refused for user 'U'`.
pub fn missing_exchange(text: &str) -> Option<String> {
    let rest = text
        .split_once("no exchange '")
        .or_else(|| text.split_once("access to exchange '"))?
        .1;
    let end = rest.rfind("' in vhost '")?;
    Some(rest[..end].to_string())
}

#[cfg(test)]
mod tests;
