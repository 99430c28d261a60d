//! The bookkeeping of one redrive pass in proxy mode ([`super`] moves its bytes): frames from
//! the upstream in, frames to write out and progress reports, no socket and the time passed
//! in, so it is unit-tested directly. What it does is [`super`]'s module comment: deliveries
//! on [`CONSUME_CHANNEL`] decided by the plan, moves published through a [`Publisher`] on
//! [`PUBLISH_CHANNEL`] and acked after their confirm, what stays given back at the end, a new
//! consumer when one's window is full of messages that stay.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, basic, channel, connection};
use amq_protocol::types::{FieldTable, ShortString};
use bytes::{Bytes, BytesMut};

use super::{CONSUME_CHANNEL, PUBLISH_CHANNEL, Pass, Progress, WINDOW};
use crate::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, decode_method};
use crate::amqp::content::{BodyCollector, encode_properties_from, parse_content_header};
use crate::proxy::bcc::without_private_headers;
use crate::proxy::publisher::{NACKED, Outcome, OutgoingMessage, PROPERTIES_TOO_LARGE, Publisher};
use crate::proxy::wire::{WireFrame, content_body_size, method_frame};
use crate::redrive::bucket::TokenBucket;
use crate::redrive::plan::{Decision, stamp};

/// How long a pass waits for a delivery, with room in its window, before it takes the queue
/// for empty of ready messages.
pub const IDLE: Duration = Duration::from_secs(3);

/// A message on its way in (a delivery's method, header and body frames).
struct Incoming {
    tag: u64,
    consumer_tag: String,
    header: Option<Bytes>,
    body: Option<BodyCollector>,
}

/// A message decided to move, waiting for a token.
struct Pending {
    tag: u64,
    /// The consumer it was delivered to.
    consumer: u64,
    message: OutgoingMessage,
}

/// The bookkeeping of a running pass.
pub(super) struct PassState {
    pub(super) publisher: Publisher,
    /// The target and consumer of each publish in flight, by dead-letter delivery tag.
    inflight: HashMap<u64, (String, u64)>,
    pending: VecDeque<Pending>,
    incoming: Option<Incoming>,
    /// Messages looked at.
    seen: u64,
    /// Moves still allowed (in flight and waiting ones taken off).
    left: u64,
    /// The current consumer's number and the deliveries it holds that stay.
    consumer: u64,
    kept_here: u16,
    consuming: bool,
    /// The highest delivery tag that is not acked (the end's nack covers it and all before).
    left_behind: u64,
    pub(super) cancelled: bool,
    /// When the last delivery came (or the consumer started), and whether the queue ran out
    /// of ready messages before the pass's count (others consumed some).
    last_delivery: Option<Instant>,
    ran_out: bool,
    /// Frames to write.
    pub(super) out: BytesMut,
    queue: String,
    total: u64,
}

fn consumer_tag(n: u64) -> String {
    format!("dlx-proxy-redrive-{n}")
}

impl PassState {
    /// A pass over `total` messages of `queue`; its first frames (the publisher channel, the
    /// prefetch, the first consumer) wait in `out`.
    pub(super) fn new(
        queue: &str,
        total: u64,
        pass: &Pass,
        publisher: Publisher,
    ) -> Result<PassState, String> {
        let mut state = PassState {
            publisher,
            inflight: HashMap::new(),
            pending: VecDeque::new(),
            incoming: None,
            seen: 0,
            left: pass.max.unwrap_or(u64::MAX),
            consumer: 0,
            kept_here: 0,
            consuming: false,
            left_behind: 0,
            last_delivery: None,
            ran_out: false,
            cancelled: false,
            out: BytesMut::new(),
            queue: queue.to_string(),
            total,
        };
        if !pass.dry_run {
            state.out.extend_from_slice(&state.publisher.open_frames());
        }
        state.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: WINDOW,
                global: false,
            })),
        ));
        if total > 0 {
            state.consume()?;
        }
        Ok(state)
    }

    /// When the pass gives up waiting for deliveries: the window has room (nothing waits or is
    /// in flight) and none came for [`IDLE`], so the queue has no ready message left for it
    /// (another consumer took some of those it counted at the start).
    pub(super) fn idle_until(&self) -> Option<Instant> {
        let idle = self.consuming && self.pending.is_empty() && self.inflight.is_empty();
        self.last_delivery.filter(|_| idle).map(|at| at + IDLE)
    }

    /// Messages decided to move wait for a token.
    pub(super) fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Consumer upkeep and the publishes `bucket` allows at `now`; true once the pass is over
    /// (nothing more to read, nothing waiting, nothing in flight).
    pub(super) fn step(
        &mut self,
        mut bucket: Option<&mut TokenBucket>,
        now: Instant,
        report: &mut impl FnMut(Progress),
    ) -> Result<bool, String> {
        if let Some(at) = self.idle_until()
            && now >= at
        {
            self.ran_out = true;
        }
        let reading_done =
            self.seen >= self.total || self.left == 0 || self.cancelled || self.ran_out;
        if reading_done && self.consuming {
            self.cancel_consumer();
        }
        if !reading_done && !self.consuming {
            // Failed publishes gave back some of the max: carry on reading.
            self.consume()?;
        }
        if self.cancelled {
            for p in std::mem::take(&mut self.pending) {
                self.left_behind = self.left_behind.max(p.tag);
            }
        }
        while let Some(p) = self.pending.front() {
            if let Some(b) = bucket.as_deref_mut()
                && b.take(1, now) == 0
            {
                break;
            }
            let (tag, consumer) = (p.tag, p.consumer);
            match self.publisher.publish(tag, &p.message, now) {
                Ok(bytes) => {
                    self.out.extend_from_slice(&bytes);
                    self.inflight
                        .insert(tag, (p.message.routing_key.clone(), consumer));
                    self.pending.pop_front();
                }
                Err(why) => {
                    // A name longer than a short string (no such queue can exist), or
                    // properties that no longer fit one frame with the redrive count.
                    let cause = if why == PROPERTIES_TOO_LARGE {
                        "unpublishable"
                    } else {
                        "no_queue"
                    };
                    self.pending.pop_front();
                    self.left = self.left.saturating_add(1);
                    report(Progress {
                        failed: vec![cause],
                        ..Progress::default()
                    });
                    self.keep(tag, consumer)?;
                }
            }
        }
        Ok(reading_done && self.pending.is_empty() && self.publisher.unconfirmed() == 0)
    }

    /// Publishes whose confirm did not come by `now` fail (`timed_out`).
    pub(super) fn expire(
        &mut self,
        now: Instant,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        let expired = self.publisher.expire(now);
        if let Some(bytes) = expired.write {
            self.out.extend_from_slice(&bytes);
        }
        for settled in expired.settled {
            self.settle(settled.op, &settled.outcome, report)?;
        }
        Ok(())
    }

    /// The end: one `basic.nack multiple requeue` gives back every delivery not acked.
    pub(super) fn give_back(&mut self) {
        if self.left_behind > 0 {
            self.out.extend_from_slice(&method_frame(
                CONSUME_CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: self.left_behind,
                    multiple: true,
                    requeue: true,
                })),
            ));
            self.left_behind = 0;
        }
    }

    /// Starts the next consumer (with a window of its own) and cancels the current one.
    fn consume(&mut self) -> Result<(), String> {
        if self.consuming {
            self.cancel_consumer();
        }
        self.consumer += 1;
        self.kept_here = 0;
        self.consuming = true;
        self.last_delivery = Some(Instant::now());
        let queue = ShortString::try_new(self.queue.clone()).map_err(|_| "queue name too long")?;
        self.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue,
                consumer_tag: ShortString::from(consumer_tag(self.consumer)),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ));
        Ok(())
    }

    fn cancel_consumer(&mut self) {
        self.consuming = false;
        self.out.extend_from_slice(&method_frame(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: ShortString::from(consumer_tag(self.consumer)),
                nowait: false,
            })),
        ));
    }

    pub(super) fn on_frame(
        &mut self,
        frame: &WireFrame,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        match frame.channel {
            0 => {
                if frame.kind == FRAME_METHOD
                    && let Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) =
                        decode_method(frame.payload())
                {
                    return Err(format!(
                        "the upstream closed the connection: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    ));
                }
            }
            PUBLISH_CHANNEL => {
                let step = self.publisher.on_frame(frame);
                if let Some(bytes) = step.write {
                    self.out.extend_from_slice(&bytes);
                }
                for settled in step.settled {
                    self.settle(settled.op, &settled.outcome, report)?;
                }
            }
            CONSUME_CHANNEL => self.on_consume_frame(frame, pass, report)?,
            _ => {}
        }
        Ok(())
    }

    fn on_consume_frame(
        &mut self,
        frame: &WireFrame,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        match frame.kind {
            FRAME_METHOD => match decode_method(frame.payload()) {
                Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    self.last_delivery = Some(Instant::now());
                    self.incoming = Some(Incoming {
                        tag: d.delivery_tag,
                        consumer_tag: d.consumer_tag.as_str().to_string(),
                        header: None,
                        body: None,
                    });
                }
                Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    return Err(format!(
                        "the upstream cancelled the consumer of {:?} (queue deleted?)",
                        self.queue
                    ));
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    return Err(format!(
                        "the upstream closed the consuming channel: {} {}",
                        close.reply_code,
                        close.reply_text.as_str()
                    ));
                }
                _ => {}
            },
            FRAME_HEADER => {
                if let Some(incoming) = &mut self.incoming {
                    let size = content_body_size(frame.payload()).unwrap_or(0);
                    incoming.header = Some(frame.payload_bytes());
                    incoming.body = Some(BodyCollector::new(size));
                }
            }
            FRAME_BODY => {
                if let Some(body) = self.incoming.as_mut().and_then(|i| i.body.as_mut()) {
                    body.push(frame.payload_bytes())
                        .map_err(|e| format!("upstream delivery: {e}"))?;
                }
            }
            _ => {}
        }
        let complete = self
            .incoming
            .as_ref()
            .is_some_and(|i| i.body.as_ref().is_some_and(BodyCollector::is_complete));
        if complete && let Some(incoming) = self.incoming.take() {
            self.on_message(incoming, pass, report)?;
        }
        Ok(())
    }

    /// The number of the consumer a delivery came to (0: not one of the pass's).
    fn consumer_of(&self, tag: &str) -> u64 {
        tag.strip_prefix("dlx-proxy-redrive-")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// A delivery of `consumer` stays in the queue: the end's nack gives it back. When the
    /// current consumer's window is all such deliveries, a new consumer carries on.
    fn keep(&mut self, tag: u64, consumer: u64) -> Result<(), String> {
        self.left_behind = self.left_behind.max(tag);
        if consumer == self.consumer && self.consuming {
            self.kept_here = self.kept_here.saturating_add(1);
            if self.kept_here >= WINDOW
                && self.seen < self.total
                && self.left > 0
                && !self.cancelled
            {
                self.consume()?;
            }
        }
        Ok(())
    }

    fn on_message(
        &mut self,
        incoming: Incoming,
        pass: &Pass,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        let Incoming {
            tag,
            consumer_tag,
            header,
            body,
        } = incoming;
        if self.seen >= self.total || self.left == 0 || self.cancelled {
            // After the pass's end: it goes back untouched.
            self.left_behind = self.left_behind.max(tag);
            return Ok(());
        }
        self.seen += 1;
        let consumer = self.consumer_of(&consumer_tag);
        let mut progress = Progress {
            examined: 1,
            ..Progress::default()
        };
        let header = header.map(|h| parse_content_header(&h));
        match header {
            Some(Ok(header)) => match pass.plan.decide(&header.properties, &self.queue) {
                Decision::Skip => {
                    progress.skipped = 1;
                    self.keep(tag, consumer)?;
                }
                Decision::Fail(cause) => {
                    progress.failed.push(cause);
                    self.keep(tag, consumer)?;
                }
                Decision::Move(target) if pass.dry_run => {
                    progress.moved.push(target);
                    self.left = self.left.saturating_sub(1);
                    self.keep(tag, consumer)?;
                }
                Decision::Move(target) => {
                    self.left = self.left.saturating_sub(1);
                    // A republish: not the proxy's dead letter any more (a later automatic
                    // death is judged as a client's message's would be).
                    let properties = encode_properties_from(
                        &stamp(&without_private_headers(&header.properties)),
                        &header.raw_properties,
                    );
                    self.pending.push_back(Pending {
                        tag,
                        consumer,
                        message: OutgoingMessage {
                            exchange: String::new(),
                            routing_key: target,
                            raw_properties: properties,
                            body: body.map(BodyCollector::finish).unwrap_or_default(),
                        },
                    });
                }
            },
            _ => {
                progress.failed.push("undecodable");
                self.keep(tag, consumer)?;
            }
        }
        report(progress);
        Ok(())
    }

    /// A publish settled: ack its dead-letter delivery, or leave it there.
    fn settle(
        &mut self,
        tag: u64,
        outcome: &Outcome,
        report: &mut impl FnMut(Progress),
    ) -> Result<(), String> {
        let Some((target, consumer)) = self.inflight.remove(&tag) else {
            return Ok(());
        };
        let cause = match outcome {
            Outcome::Confirmed => {
                self.out.extend_from_slice(&method_frame(
                    CONSUME_CHANNEL,
                    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: tag,
                        multiple: false,
                    })),
                ));
                report(Progress {
                    moved: vec![target],
                    ..Progress::default()
                });
                return Ok(());
            }
            Outcome::Unroutable | Outcome::ExchangeMissing => "no_queue",
            Outcome::Failed(NACKED) => "target_full",
            Outcome::TimedOut => "timed_out",
            Outcome::AccessRefused | Outcome::Failed(_) => "publish_failed",
        };
        self.left = self.left.saturating_add(1);
        report(Progress {
            failed: vec![cause],
            ..Progress::default()
        });
        self.keep(tag, consumer)
    }
}

#[cfg(test)]
mod tests;
