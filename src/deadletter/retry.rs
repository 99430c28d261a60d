//! Retry tiers (`x-retry-delays` / policy `retry-delays`): what becomes of a message rejected
//! or nacked with requeue=false on a queue that has them. Pure: both modes call
//! [`retry_after_rejection`] and only move the result (embedded mode holds it in the broker,
//! proxy mode on the upstream) until its delay has passed, then put it back in its queue.
//!
//! The rules, as the hand-built pattern of TTL "wait" queues records them:
//! - the n-th rejection (n = the message's `x-retry-count` + 1) waits `delays[n - 1]` ms while
//!   tiers remain; after the last tier the next rejection dead-letters as usual;
//! - the returned message carries `x-retry-count` = n (AMQP `long`, 1-based) and the x-death
//!   entry {queue, reason `rejected`} counted once more (first-death headers on the first),
//!   so its history reads as if it had been dead-lettered each time;
//! - like every dead letter it loses `expiration` (kept as the entry's
//!   `original-expiration`), `BCC` and `x-delivery-count`; it loses `CC` too, whatever the
//!   `compat` setting (it goes back to its one queue: in proxy mode by a publish through the
//!   default exchange, which would copy it into every queue `CC` names).

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};

use super::{
    DeadLetterDrop, DeadLetterOptions, DeadLetterReason, DeadLetterTarget, DeathEvent, HEADER_CC,
    dead_letter,
};
use crate::amqp::content::header_map;
use crate::rabbit::args::amqp_integer;

/// How many times a message has been sent round its retry tiers (1-based, AMQP `long`).
pub const X_RETRY_COUNT: &str = "x-retry-count";

/// A rejected message to hold for `delay_ms` and then put back into its queue.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryMessage {
    /// The tier it enters, 1-based (the value of its new `x-retry-count`).
    pub tier: u64,
    /// How long it is held, in milliseconds.
    pub delay_ms: u64,
    /// Its properties once back in the queue.
    pub properties: BasicProperties,
}

/// The `x-retry-count` a message carries (0 without one, or when a client wrote something
/// that is not a non-negative integer).
pub fn retry_count(props: &BasicProperties) -> u64 {
    props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(X_RETRY_COUNT))
        .and_then(amqp_integer)
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(0)
}

/// The delay for a message that has been retried `retries` times, or `None` when its tiers
/// are used up (the rejection then dead-letters).
pub fn next_delay(delays: &[u64], retries: u64) -> Option<u64> {
    usize::try_from(retries)
        .ok()
        .and_then(|i| delays.get(i))
        .copied()
}

/// What a rejection with requeue=false does on a queue with retry tiers `delays`: `Some`
/// when the message is held for a retry, `None` when it dead-letters as usual (tiers used up,
/// or the history already exceeds `dead_letter.max_hops`, where the dead-letter path drops it
/// and counts why). `event.reason` must be [`DeadLetterReason::Rejected`].
pub fn retry_after_rejection(
    props: &BasicProperties,
    delays: &[u64],
    event: &DeathEvent,
    opts: &DeadLetterOptions,
) -> Option<RetryMessage> {
    debug_assert_eq!(event.reason, DeadLetterReason::Rejected);
    let retries = retry_count(props);
    let delay_ms = next_delay(delays, retries)?;
    // The message goes back to its own queue: the history is written as for a dead letter
    // whose routing key is the queue's name.
    let target = DeadLetterTarget {
        exchange: "",
        routing_key: Some(event.queue),
    };
    let rewritten = match dead_letter(props, event, &target, opts) {
        Ok(rewritten) => rewritten,
        Err(DeadLetterDrop::HopLimit) => return None,
    };
    let tier = retries.saturating_add(1);
    let mut headers = header_map(&rewritten.properties);
    headers.insert(
        ShortString::from(X_RETRY_COUNT),
        AMQPValue::LongLongInt(i64::try_from(tier).unwrap_or(i64::MAX)),
    );
    headers.remove(HEADER_CC);
    Some(RetryMessage {
        tier,
        delay_ms,
        properties: rewritten.properties.with_headers(FieldTable::from(headers)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadletter::{X_DEATH, XDeathEntry, x_death_entries};

    fn event<'a>(queue: &'a str, keys: &'a [String]) -> DeathEvent<'a> {
        DeathEvent {
            queue,
            reason: DeadLetterReason::Rejected,
            exchange: "orders",
            routing_keys: keys,
            now_secs: 1_700_000_000,
            trust_existing_history: true,
        }
    }

    fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
        props.headers().as_ref().and_then(|h| h.inner().get(name))
    }

    /// `CC` goes whatever the compat setting (`compat = "4"` keeps it on a dead letter with
    /// a routing key, which a retry's return to its queue is).
    #[test]
    fn a_retry_carries_no_cc() {
        let keys = vec!["new".to_string()];
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from(HEADER_CC),
            AMQPValue::FieldArray(vec![AMQPValue::LongString("elsewhere".into())].into()),
        );
        let props = BasicProperties::default().with_headers(headers);
        for compat in [crate::deadletter::Compat::V3, crate::deadletter::Compat::V4] {
            let opts = DeadLetterOptions {
                compat,
                ..DeadLetterOptions::default()
            };
            let retry = retry_after_rejection(&props, &[100], &event("work", &keys), &opts)
                .expect("a tier");
            assert_eq!(header(&retry.properties, HEADER_CC), None, "{compat:?}");
        }
    }

    #[test]
    fn each_rejection_takes_the_next_tier_until_they_are_used_up() {
        let delays = [1000, 10_000, 60_000];
        let keys = vec!["new".to_string()];
        let opts = DeadLetterOptions::default();
        let mut props = BasicProperties::default().with_expiration("5000".into());
        for (n, delay) in delays.iter().enumerate() {
            let retry = retry_after_rejection(&props, &delays, &event("work", &keys), &opts)
                .expect("tiers remain");
            let tier = n as u64 + 1;
            assert_eq!((retry.tier, retry.delay_ms), (tier, *delay));
            assert_eq!(
                header(&retry.properties, X_RETRY_COUNT),
                Some(&AMQPValue::LongLongInt(tier as i64))
            );
            let deaths = x_death_entries(&retry.properties);
            assert_eq!(deaths.len(), 1);
            assert_eq!(
                (deaths[0].queue.as_str(), deaths[0].reason.as_str()),
                ("work", "rejected")
            );
            assert_eq!(deaths[0].count, tier as i64);
            assert_eq!(deaths[0].routing_keys, vec!["new".to_string()]);
            assert!(retry.properties.expiration().is_none());
            props = retry.properties;
        }
        assert_eq!(
            retry_after_rejection(&props, &delays, &event("work", &keys), &opts),
            None
        );
    }

    #[test]
    fn the_first_retry_sets_the_first_death_headers_and_keeps_the_original_expiration() {
        let keys = vec!["k".to_string()];
        let props = BasicProperties::default().with_expiration("5000".into());
        let retry = retry_after_rejection(
            &props,
            &[10],
            &event("work", &keys),
            &DeadLetterOptions::default(),
        )
        .expect("one tier");
        let entry: Vec<XDeathEntry> = x_death_entries(&retry.properties);
        assert_eq!(entry[0].original_expiration.as_deref(), Some("5000"));
        assert!(header(&retry.properties, X_DEATH).is_some());
        assert_eq!(
            header(&retry.properties, "x-first-death-queue"),
            Some(&AMQPValue::LongString("work".into()))
        );
        assert_eq!(
            header(&retry.properties, "x-first-death-reason"),
            Some(&AMQPValue::LongString("rejected".into()))
        );
    }

    #[test]
    fn a_count_written_by_a_client_is_read_when_it_is_an_integer() {
        let with = |value: AMQPValue| {
            let mut headers = FieldTable::default();
            headers.insert(X_RETRY_COUNT.into(), value);
            BasicProperties::default().with_headers(headers)
        };
        assert_eq!(retry_count(&with(AMQPValue::LongInt(2))), 2);
        assert_eq!(retry_count(&with(AMQPValue::LongInt(-2))), 0);
        assert_eq!(retry_count(&with(AMQPValue::LongString("2".into()))), 0);
        assert_eq!(retry_count(&BasicProperties::default()), 0);
        assert_eq!(next_delay(&[5, 6], 1), Some(6));
        assert_eq!(next_delay(&[5, 6], 2), None);
        assert_eq!(next_delay(&[5, 6], u64::MAX), None);
    }

    #[test]
    fn the_hop_limit_still_applies() {
        let keys = vec!["k".to_string()];
        let opts = DeadLetterOptions {
            max_hops: Some(1),
            ..DeadLetterOptions::default()
        };
        let first = retry_after_rejection(
            &BasicProperties::default(),
            &[1, 1],
            &event("q", &keys),
            &opts,
        )
        .expect("first death is within the limit");
        assert_eq!(
            retry_after_rejection(&first.properties, &[1, 1], &event("q", &keys), &opts),
            None
        );
    }
}
