//! `queue.declare` x-arguments (`rabbit::args`): validation, the 406 reply texts, the
//! redeclare equivalence check, and the per-message `expiration` parser.
//!
//! Checks: no panic; accepted arguments respect RabbitMQ's bounds (TTL and expiry at most
//! ten years, `x-expires` at least 1, a routing key only with an exchange, a strategy only on
//! quorum queues); a refusal is 406 with a reply text that fits a shortstr once cut; a table
//! is equivalent to itself (NaN aside); `parse_expiration` agrees with a plain reading of
//! RabbitMQ's rule (optional sign, ASCII digits, at most ten years, no negative value).
#![no_main]

use amq_protocol::types::FieldTable;
use arbitrary::Arbitrary;
use dlx_proxy::broker::delivery::short;
use dlx_proxy::rabbit::args::{
    CLASSIC_EQUIVALENCE_ARGUMENTS, MAX_EXPIRY_MS, QUORUM_EQUIVALENCE_ARGUMENTS, QueueType,
    check_equivalent, parse_expiration, parse_queue_arguments,
};
use dlx_proxy_fuzz::{Key, Text, Value, has_nan, table};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    existing: Vec<(Key, Value)>,
    requested: Vec<(Key, Value)>,
    queue: Text,
    expiration: Text,
}

fn check_arguments(args: &FieldTable, queue: &str) {
    match parse_queue_arguments(args) {
        Ok(parsed) => {
            assert!(parsed.message_ttl.is_none_or(|v| v <= MAX_EXPIRY_MS));
            assert!(
                parsed
                    .expires
                    .is_none_or(|v| (1..=MAX_EXPIRY_MS).contains(&v))
            );
            assert!(
                parsed.dead_letter_routing_key.is_none() || parsed.dead_letter_exchange.is_some()
            );
            assert!(
                parsed.dead_letter_strategy.is_none() || parsed.queue_type == QueueType::Quorum
            );
        }
        Err(err) => {
            assert_eq!(err.reply_code(), 406);
            let text = err.reply_text(queue, "/");
            assert!(text.starts_with("PRECONDITION_FAILED - "));
            let _ = short(&text);
        }
    }
}

/// RabbitMQ's rule for `expiration`, read plainly: `Some(ms)` when accepted.
fn expected_expiration(text: &str) -> Option<u64> {
    let (negative, digits) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let significant = digits.trim_start_matches('0');
    if significant.len() > 12 {
        return None;
    }
    let value: u64 = if significant.is_empty() {
        0
    } else {
        significant.parse().ok()?
    };
    (value <= MAX_EXPIRY_MS && !(negative && value != 0)).then_some(value)
}

fuzz_target!(|input: Input| {
    let existing = table(&input.existing);
    let requested = table(&input.requested);
    let queue = input.queue.get();
    check_arguments(&existing, &queue);
    check_arguments(&requested, &queue);

    let nan = CLASSIC_EQUIVALENCE_ARGUMENTS
        .iter()
        .chain(QUORUM_EQUIVALENCE_ARGUMENTS.iter())
        .any(|k| existing.inner().get(*k).is_some_and(has_nan));
    if !nan {
        assert_eq!(check_equivalent(&existing, &existing, &queue, "/"), Ok(()));
    }
    if let Err(text) = check_equivalent(&existing, &requested, &queue, "/") {
        assert!(text.starts_with("inequivalent arg '"));
    }

    let expiration = input.expiration.get();
    assert_eq!(
        parse_expiration(&expiration).ok(),
        expected_expiration(&expiration),
        "expiration {expiration:?}"
    );
});
