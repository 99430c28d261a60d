//! Retry tiers in proxy mode (`x-retry-delays` / policy `retry-delays`): where a rejected
//! message waits out its delay, and how it comes back. Pure: names, frames and messages; the
//! client session (`super::intercept`) and the service connection ([`super::service`]) move
//! them.
//!
//! A message waits on the upstream, in a proxy-owned durable **quorum** queue per delay and
//! vhost, `<capture name>.retry.<ms>` (`dlx-proxy.capture.retry.1000`), declared by the vhost's
//! service connection with `x-message-ttl = <ms>`, the capture exchange as dead-letter
//! exchange and `at-least-once` dead-lettering (with `reject-publish`, which it requires).
//! All its messages have the same TTL, so it expires them in the order they came: no
//! head-of-line blocking, and across delays each message comes back at its own deadline.
//! When the TTL passes, RabbitMQ dead-letters the message into the capture queue, where the
//! service connection of any instance reads it back ([`super::capture::reconstruct`] removes
//! the delay queue's own x-death entry), and publishes it, confirmed, into its queue through
//! the default exchange before acking the capture delivery. The queue's name travels with the
//! message in the private header [`RETRY_QUEUE_HEADER`], removed on the way back.

use amq_protocol::protocol::{AMQPClass, BasicProperties, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::Bytes;

use super::death::Death;
use super::outgoing::headers_for_one_queue;
use super::publisher::OutgoingMessage;
use super::wire::method_frame;
use crate::amqp::content::{encode_properties, header_map, keep_opaque_headers};
use crate::deadletter::retry::{next_delay, retry_after_rejection, retry_count};
use crate::deadletter::{DeadLetterOptions, DeadLetterReason};
use crate::rabbit::args::{
    ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_STRATEGY, ARG_MESSAGE_TTL, ARG_OVERFLOW,
    ARG_QUEUE_TYPE,
};

/// The private header naming the queue a waiting message goes back to.
pub const RETRY_QUEUE_HEADER: &str = "x-dlx-proxy-retry-queue";

/// The delay queue for `delay_ms` (`None` if the name would not fit a short string).
pub fn delay_queue_name(capture_name: &str, delay_ms: u64) -> Option<String> {
    let name = format!("{capture_name}.retry.{delay_ms}");
    (name.len() <= 255).then_some(name)
}

/// Whether `queue` is one of the delay queues of this capture name.
pub fn is_delay_queue(capture_name: &str, queue: &str) -> bool {
    queue
        .strip_prefix(capture_name)
        .and_then(|rest| rest.strip_prefix(".retry."))
        .is_some_and(|ms| !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit()))
}

/// The declare of the delay queue for `delay_ms` (`nowait`: it goes on the publisher channel
/// right before the publish that needs it, and the channel executes them in order). Its
/// arguments are a function of the delay alone, so every instance declares the same queue.
pub fn delay_queue_declare(channel: u16, capture_name: &str, delay_ms: u64) -> Option<Bytes> {
    let name = ShortString::try_new(delay_queue_name(capture_name, delay_ms)?).ok()?;
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    let mut arguments = FieldTable::default();
    arguments.insert(ARG_QUEUE_TYPE.into(), text("quorum"));
    arguments.insert(
        ARG_MESSAGE_TTL.into(),
        AMQPValue::LongLongInt(i64::try_from(delay_ms).unwrap_or(i64::MAX)),
    );
    arguments.insert(ARG_DEAD_LETTER_EXCHANGE.into(), text(capture_name));
    arguments.insert(ARG_DEAD_LETTER_STRATEGY.into(), text("at-least-once"));
    arguments.insert(ARG_OVERFLOW.into(), text("reject-publish"));
    Some(method_frame(
        channel,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name,
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: true,
            arguments,
        })),
    ))
}

/// What a rejection (requeue=false) does on a queue with retry tiers.
#[derive(Debug)]
pub(crate) enum RetryPlan {
    /// No tiers, or a message the proxy does not retry: it dies as usual.
    NotRetried,
    /// Its tiers are used up: it dies as usual, counted in `retry_exhausted_total`.
    Exhausted,
    /// It waits in its delay queue: `message` goes there.
    Hold {
        tier: u64,
        delay_ms: u64,
        message: OutgoingMessage,
    },
}

/// The plan for a rejected message with the queue's tiers `delays`. A message carrying a
/// `user_id` is not retried (the service identity publishes the waiting message, and RabbitMQ
/// refuses it another user's id): it dies as usual.
pub(crate) fn plan_rejection(
    death: &Death,
    delays: Option<&[u64]>,
    options: &DeadLetterOptions,
    capture_name: &str,
) -> RetryPlan {
    let Some(delays) = delays.filter(|d| !d.is_empty()) else {
        return RetryPlan::NotRetried;
    };
    if death.reason != DeadLetterReason::Rejected || death.before.user_id().is_some() {
        return RetryPlan::NotRetried;
    }
    let Some(retry) = retry_after_rejection(&death.before, delays, &death.event(), options) else {
        return match next_delay(delays, retry_count(&death.before)) {
            None => RetryPlan::Exhausted,
            // The hop limit: the dead-letter path drops and counts it.
            Some(_) => RetryPlan::NotRetried,
        };
    };
    let Some(delay_queue) = delay_queue_name(capture_name, retry.delay_ms) else {
        return RetryPlan::NotRetried;
    };
    let properties = with_header(
        &without_routing_headers(&retry.properties),
        RETRY_QUEUE_HEADER,
        Some(AMQPValue::LongString(LongString::from(&*death.queue))),
    );
    RetryPlan::Hold {
        tier: retry.tier,
        delay_ms: retry.delay_ms,
        message: OutgoingMessage {
            exchange: String::new(),
            routing_key: delay_queue,
            raw_properties: keep_opaque_headers(encode_properties(&properties), &death.raw_before),
            body: death.body.clone(),
        },
    }
}

/// Why a message from a delay queue cannot go back (it is dropped and counted).
#[derive(Debug, PartialEq, Eq)]
pub struct NoRetryTarget;

/// A captured message that died in a delay queue goes back to the queue its private header
/// names, with the properties it had while it waited (its delay queue's x-death entry is
/// already gone from `death.before`) minus that header. `None` for other captured messages.
pub(crate) fn returning(
    death: &Death,
    capture_name: &str,
) -> Option<Result<(String, OutgoingMessage), NoRetryTarget>> {
    if !is_delay_queue(capture_name, &death.queue) {
        return None;
    }
    let target = death
        .before
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(RETRY_QUEUE_HEADER))
        .and_then(|v| match v {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            _ => None,
        })
        .filter(|q| !q.is_empty() && q.len() <= 255)
        .map(str::to_string);
    let Some(target) = target else {
        return Some(Err(NoRetryTarget));
    };
    let properties = with_header(
        &without_routing_headers(&death.before),
        RETRY_QUEUE_HEADER,
        None,
    );
    let message = OutgoingMessage {
        exchange: String::new(),
        routing_key: target.clone(),
        raw_properties: keep_opaque_headers(encode_properties(&properties), &death.raw_before),
        body: death.body.clone(),
    };
    Some(Ok((target, message)))
}

/// `props` as the hold and the return publish them: to one queue through the default
/// exchange ([`headers_for_one_queue`]; it comes back routed by its queue's name only, as in
/// embedded mode).
fn without_routing_headers(props: &BasicProperties) -> BasicProperties {
    props
        .clone()
        .with_headers(FieldTable::from(headers_for_one_queue(props)))
}

/// `props` with header `name` set to `value` (or removed).
fn with_header(props: &BasicProperties, name: &str, value: Option<AMQPValue>) -> BasicProperties {
    let mut headers = header_map(props);
    match value {
        Some(value) => {
            headers.insert(ShortString::from(name), value);
        }
        None => {
            headers.remove(name);
        }
    }
    props.clone().with_headers(FieldTable::from(headers))
}

#[cfg(test)]
mod tests;
