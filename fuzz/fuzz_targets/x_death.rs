//! The dead-letter rewrite (`deadletter::dead_letter`) and the cycle rule (`is_cycle`) on
//! messages whose headers, `x-death` history included, come from clients.
//!
//! Checks: no panic; the rewritten message has no `expiration`, `BCC` or
//! `x-delivery-count`; `x-death` is an array whose first element is the {queue, reason}
//! entry of this death, with its count one above what the history held (1 when new); the
//! routing keys are `[DLRK]` or the original keys; a hop-limit drop only happens with a
//! limit; the properties survive the wire; `is_cycle` says a second non-`rejected` death on
//! the same queue is a cycle; and a second death increments the count again.
#![no_main]

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::AMQPValue;
use arbitrary::Arbitrary;
use dlx_proxy::deadletter::{
    Compat, DeadLetterOptions, DeadLetterReason, DeadLetterTarget, DeathEvent, HEADER_BCC, X_DEATH,
    X_DELIVERY_COUNT, dead_letter, is_cycle, x_death_entries,
};
use dlx_proxy::rabbit::args::amqp_integer;
use dlx_proxy_fuzz::{Properties, Text, assert_properties_round_trip};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    properties: Properties,
    queue: Text,
    reason: u8,
    exchange: Text,
    routing_keys: Vec<Text>,
    now_secs: u64,
    trust_existing_history: bool,
    dlx: Text,
    dlrk: Option<Text>,
    v4: bool,
    x_death_total: bool,
    max_hops: Option<u32>,
    other_queues: Vec<Text>,
}

/// The count of the first x-death element, which must be a table for `queue` and `reason`.
fn front_count(props: &BasicProperties, queue: &str, reason: DeadLetterReason) -> i64 {
    let headers = props.headers().as_ref().expect("headers are set");
    let Some(AMQPValue::FieldArray(history)) = headers.inner().get(X_DEATH) else {
        panic!("x-death is not an array");
    };
    let Some(AMQPValue::FieldTable(front)) = history.as_slice().first() else {
        panic!("the first x-death element is not a table");
    };
    let text = |name: &str| match front.inner().get(name) {
        Some(AMQPValue::LongString(s)) => s.as_bytes().to_vec(),
        other => panic!("x-death {name} is {other:?}"),
    };
    assert_eq!(text("queue"), queue.as_bytes());
    assert_eq!(text("reason"), reason.as_str().as_bytes());
    match front.inner().get("count") {
        Some(AMQPValue::LongLongInt(n)) => *n,
        other => panic!("x-death count is {other:?}"),
    }
}

/// The count the history holds for {queue, reason} before this death, as the rewrite reads
/// it: the first matching table, a missing or non-integer count reading as the number of
/// duplicates (missing) or 1.
fn previous_count(props: &BasicProperties, queue: &str, reason: DeadLetterReason) -> Option<i64> {
    let headers = props.headers().as_ref()?;
    let Some(AMQPValue::FieldArray(history)) = headers.inner().get(X_DEATH) else {
        return None;
    };
    let is_entry = |v: &AMQPValue| match v {
        AMQPValue::FieldTable(t) => {
            t.inner().get("queue") == Some(&AMQPValue::LongString(queue.into()))
                && t.inner().get("reason") == Some(&AMQPValue::LongString(reason.as_str().into()))
        }
        _ => false,
    };
    let entries = history.as_slice();
    let first = entries.iter().find(|v| is_entry(v))?;
    let AMQPValue::FieldTable(t) = first else {
        return None;
    };
    Some(match t.inner().get("count") {
        None => entries.iter().filter(|v| is_entry(v)).count() as i64,
        Some(v) => amqp_integer(v).unwrap_or(1),
    })
}

fuzz_target!(|input: Input| {
    let props = input.properties.to_amqp();
    let reason = DeadLetterReason::all()[input.reason as usize % 4];
    let queue = input.queue.get();
    let exchange = input.exchange.get();
    let routing_keys: Vec<String> = input.routing_keys.iter().map(Text::get).collect();
    let event = DeathEvent {
        queue: &queue,
        reason,
        exchange: &exchange,
        routing_keys: &routing_keys,
        now_secs: input.now_secs,
        trust_existing_history: input.trust_existing_history,
    };
    let dlx = input.dlx.get();
    let dlrk = input.dlrk.as_ref().map(Text::get);
    let target = DeadLetterTarget {
        exchange: &dlx,
        routing_key: dlrk.as_deref(),
    };
    let opts = DeadLetterOptions {
        compat: if input.v4 { Compat::V4 } else { Compat::V3 },
        x_death_total: input.x_death_total,
        max_hops: input.max_hops,
    };
    let keeps_history = opts.compat == Compat::V3 || input.trust_existing_history;

    let message = match dead_letter(&props, &event, &target, &opts) {
        Ok(message) => message,
        Err(_) => {
            assert!(opts.max_hops.is_some(), "dropped without a hop limit");
            return;
        }
    };
    let out = &message.properties;
    assert!(out.expiration().is_none());
    let headers = out.headers().as_ref().expect("headers are set");
    assert!(!headers.contains_key(HEADER_BCC));
    assert!(!headers.contains_key(X_DELIVERY_COUNT));
    let expected_count = match previous_count(&props, &queue, reason) {
        Some(n) if keeps_history => n.saturating_add(1),
        _ => 1,
    };
    assert_eq!(front_count(out, &queue, reason), expected_count);
    assert_eq!(message.exchange, dlx);
    match &dlrk {
        Some(key) => assert_eq!(message.routing_keys, vec![key.clone()]),
        None => assert_eq!(message.routing_keys, routing_keys),
    }
    assert_properties_round_trip(out);
    assert!(!x_death_entries(out).is_empty());

    assert_eq!(
        is_cycle(reason, out, &queue),
        reason != DeadLetterReason::Rejected
    );
    for other in &input.other_queues {
        let _ = is_cycle(reason, out, &other.get());
    }

    let again = DeathEvent {
        trust_existing_history: true,
        ..event
    };
    let no_limit = DeadLetterOptions {
        max_hops: None,
        ..opts
    };
    let second = dead_letter(out, &again, &target, &no_limit).expect("no hop limit");
    assert_eq!(
        front_count(&second.properties, &queue, reason),
        expected_count.saturating_add(1)
    );
});
