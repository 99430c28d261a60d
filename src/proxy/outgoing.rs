//! The messages the proxy publishes on its own channel, built from the pure dead-letter rules.
//!
//! **Routing several keys once.** RabbitMQ routes a dead-lettered message through the DLX with
//! the *set* of its keys (publish key, CC and BCC), and a queue bound by several of them gets
//! one copy. The proxy publishes once: routing key = the first key, and the upstream adds the
//! keys of the message's own `CC` header; any further key travels in a `BCC` header, which the
//! upstream routes by and strips, so consumers see exactly the headers the rewrite produced.
//! Those keys are the message's BCC keys (see [`super::bcc`]); they are kept in the proxy's
//! private header again so a further dead-lettering routes with them too.
//! The `CC` header is limited to keys the message is actually routed with (keys dropped by the
//! cycle rule, and under `compat = "4"` the CC keys of a message sent to a dead-letter routing
//! key, would otherwise be routed again by the upstream).
//!
//! **Cycles.** The proxy cannot see which queues a DLX routes to. With the default exchange the
//! target queue is the routing key, so [`is_cycle`] is applied per key exactly as RabbitMQ
//! does. For any other exchange the proxy applies the rule to the source queue on the history
//! *before* this death, for a message that reached this queue by the proxy's own
//! dead-lettering (it carries [`PRIVATE_HOP_HEADER`], which every dead letter the proxy
//! publishes gets): one that died automatically in this queue before, with no rejection
//! since, came back through an automatic loop and is dropped. Such a loop therefore runs once
//! more than in RabbitMQ (which drops it before the first republish). A message a client
//! published (or republished with its history, the usual retry pattern) is not judged by its
//! source queue: RabbitMQ judges the target, which a client's republish does not make a loop.
//!
//! **Delivery limits.** A requeue on a queue with a delivery limit is a republish to the
//! queue's tail through the default exchange with `x-delivery-count` incremented (int64, as
//! RabbitMQ's quorum queues write it); `CC`/`BCC` (and the kept BCC keys) are removed so the
//! copy reaches only that queue.

use std::collections::BTreeMap;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::Bytes;

use super::bcc::{PRIVATE_BCC_HEADER, PRIVATE_HOP_HEADER, dead_lettered_by_proxy, kept_bcc_keys};
use super::publisher::OutgoingMessage;
use crate::amqp::content::{encode_properties, header_map};
use crate::deadletter::{
    CycleQueues, DeadLetterReason, DeadLetteredMessage, HEADER_BCC, HEADER_CC, X_DELIVERY_COUNT,
    is_cycle,
};
use crate::rabbit::args::amqp_integer;

/// The longstr keys of a `CC` header, in header order.
pub fn cc_keys(props: &BasicProperties) -> Vec<String> {
    crate::deadletter::routing_key_list(
        props
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(HEADER_CC)),
    )
}

/// The keys a delivered message was routed with: the delivery's routing key, its `CC`
/// header, then the BCC keys the proxy kept at publish (the broker strips `BCC`).
pub fn delivery_routing_keys(routing_key: &str, props: &BasicProperties) -> Vec<String> {
    let mut keys = vec![routing_key.to_string()];
    keys.extend(cc_keys(props));
    keys.extend(kept_bcc_keys(props));
    keys
}

/// The keys that survive the cycle rule (empty: the message is dropped as a cycle).
/// `before` is the message as it was before this death; `source_queue` the queue it died in.
pub fn keys_after_cycle_rule(
    reason: DeadLetterReason,
    message: &DeadLetteredMessage,
    before: &BasicProperties,
    source_queue: &str,
) -> Vec<String> {
    if reason == DeadLetterReason::Rejected {
        return dedup(&message.routing_keys);
    }
    if message.exchange.is_empty() {
        let cycles = CycleQueues::of(reason, &message.properties);
        dedup(&message.routing_keys)
            .into_iter()
            .filter(|queue| !cycles.contains(queue))
            .collect()
    } else if dead_lettered_by_proxy(before) && is_cycle(reason, before, source_queue) {
        Vec::new()
    } else {
        dedup(&message.routing_keys)
    }
}

/// `keys` without repeats, in first-seen order (in time linear in the keys: a `CC` header may
/// hold thousands).
fn dedup(keys: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    let mut out: Vec<String> = Vec::with_capacity(keys.len());
    for key in keys {
        if seen.insert(key.as_str()) {
            out.push(key.clone());
        }
    }
    out
}

fn long_strings(keys: &[String]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        keys.iter()
            .map(|k| AMQPValue::LongString(LongString::from(k.as_str())))
            .collect::<Vec<_>>(),
    ))
}

/// The single publish that routes `message` with exactly `keys` (non-empty).
pub fn dead_letter_publish(
    message: &DeadLetteredMessage,
    keys: &[String],
    body: Bytes,
) -> OutgoingMessage {
    let routing_key = keys.first().cloned().unwrap_or_default();
    let current = message.properties.headers().as_ref().map(|h| h.inner());
    let has = |name: &str| current.is_some_and(|h| h.contains_key(name));
    let cc = cc_keys(&message.properties);
    let routed: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
    let in_cc: std::collections::HashSet<&str> = cc.iter().map(String::as_str).collect();
    // CC keys the publish does not route with are dropped from the header.
    let kept_cc: Option<Vec<String>> = has(HEADER_CC)
        .then(|| {
            cc.iter()
                .filter(|k| routed.contains(k.as_str()))
                .cloned()
                .collect()
        })
        .filter(|kept: &Vec<String>| kept.len() != cc.len());
    let extra: Vec<String> = keys
        .iter()
        .skip(1)
        .filter(|k| **k != routing_key && !in_cc.contains(k.as_str()))
        .cloned()
        .collect();
    let raw_properties = {
        let mut headers = current.cloned().unwrap_or_default();
        headers.insert(
            ShortString::from(PRIVATE_HOP_HEADER),
            AMQPValue::Boolean(true),
        );
        match kept_cc {
            Some(kept) if kept.is_empty() => {
                headers.remove(HEADER_CC);
            }
            Some(kept) => {
                headers.insert(ShortString::from(HEADER_CC), long_strings(&kept));
            }
            None => {}
        }
        if extra.is_empty() {
            headers.remove(PRIVATE_BCC_HEADER);
        } else {
            headers.insert(ShortString::from(HEADER_BCC), long_strings(&extra));
            headers.insert(ShortString::from(PRIVATE_BCC_HEADER), long_strings(&extra));
        }
        encode_properties(
            &message
                .properties
                .clone()
                .with_headers(FieldTable::from(headers)),
        )
    };
    OutgoingMessage {
        exchange: message.exchange.clone(),
        routing_key,
        raw_properties,
        body,
    }
}

/// The delivery count a message carries (0 when absent).
pub fn delivery_count(props: &BasicProperties) -> i64 {
    props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(X_DELIVERY_COUNT))
        .and_then(amqp_integer)
        .unwrap_or(0)
        .max(0)
}

/// The republish of a requeued message to the tail of `queue` with `x-delivery-count = count`.
pub fn requeue_publish(
    props: &BasicProperties,
    queue: &str,
    count: i64,
    body: Bytes,
) -> OutgoingMessage {
    back_to_queue(props, queue, Some(count), body)
}

/// The headers of a message published straight into one queue through the default exchange:
/// without `CC` and `BCC` (the broker would route copies to the queues they name) and the kept
/// BCC keys (it is routed by that queue's name only, so a later dead letter is too).
pub fn headers_for_one_queue(props: &BasicProperties) -> BTreeMap<ShortString, AMQPValue> {
    let mut headers = header_map(props);
    headers.remove(HEADER_CC);
    headers.remove(HEADER_BCC);
    headers.remove(PRIVATE_BCC_HEADER);
    headers
}

/// A message published straight back into `queue` through the default exchange
/// ([`headers_for_one_queue`]) and, when given, with `x-delivery-count` set: a delivery-limit
/// requeue, or an expired dead letter kept in its queue (`dead_letter.ttl_on_dead_letters =
/// false`, no count).
pub fn back_to_queue(
    props: &BasicProperties,
    queue: &str,
    count: Option<i64>,
    body: Bytes,
) -> OutgoingMessage {
    let mut headers = headers_for_one_queue(props);
    if let Some(count) = count {
        headers.insert(
            ShortString::from(X_DELIVERY_COUNT),
            AMQPValue::LongLongInt(count),
        );
    }
    let properties = props.clone().with_headers(FieldTable::from(headers));
    OutgoingMessage {
        exchange: String::new(),
        routing_key: queue.to_string(),
        raw_properties: encode_properties(&properties),
        body,
    }
}

#[cfg(test)]
mod tests;
