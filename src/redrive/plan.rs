//! What a redrive does with one message, pure: whether the filter lets it through, which queue
//! it goes to, and the properties it is published with.
//!
//! - Filter: `--filter reason=expired|rejected` matches the reason of the message's newest
//!   x-death entry (the death that put it in this queue); a message without x-death matches no
//!   filter. No filter: every message.
//! - Target: `--to QUEUE`, else the queue of the newest x-death entry (each message back to
//!   its own source, the SQS model). A message without x-death and no `--to` cannot be
//!   redriven (`no_source`, it stays); neither can one whose target is the queue it is in
//!   (`same_queue`: that would loop).
//! - Properties: unchanged but for the header `x-redriven-count` (AMQP long-long `l`, the
//!   type of x-death's `count`), one more than before, and `x-retry-count` removed (a queue
//!   with retry tiers gives the message its tiers again). The x-death history stays, so
//!   cycle detection and hop limits still see the message's past.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};

use crate::amqp::content::header_map;
use crate::deadletter::retry::X_RETRY_COUNT;
use crate::deadletter::{DeadLetterReason, x_death_entries};
use crate::rabbit::args::amqp_integer;

/// The header a redriven message carries: how many times it was redriven.
pub const X_REDRIVEN_COUNT: &str = "x-redriven-count";

/// Where the messages of a pass go and which ones.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// `--to`: every message to this queue; none: each to its newest x-death queue.
    pub to: Option<String>,
    /// Newest death reasons to move; empty: all.
    pub reasons: Vec<DeadLetterReason>,
}

/// What happens to one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Left out by the filter: it stays where it is.
    Skip,
    /// Cannot be moved (the cause, a metric label); it stays where it is.
    Fail(&'static str),
    /// Goes to this queue.
    Move(String),
}

impl Plan {
    /// The decision for a message with `props` in queue `from`.
    pub fn decide(&self, props: &BasicProperties, from: &str) -> Decision {
        let newest = x_death_entries(props).into_iter().next();
        if !self.reasons.is_empty() {
            let reason = newest
                .as_ref()
                .and_then(|entry| entry.reason.parse::<DeadLetterReason>().ok());
            if !reason.is_some_and(|r| self.reasons.contains(&r)) {
                return Decision::Skip;
            }
        }
        let target = match (&self.to, newest) {
            (Some(to), _) => to.clone(),
            (None, Some(entry)) => entry.queue,
            (None, None) => return Decision::Fail("no_source"),
        };
        if target == from {
            return Decision::Fail("same_queue");
        }
        Decision::Move(target)
    }
}

/// Parses `--filter` values: `reason=A|B` or `reason=A,B` (several flags add up).
pub fn parse_filter(values: &[String]) -> Result<Vec<DeadLetterReason>, String> {
    let mut reasons = Vec::new();
    for value in values {
        let Some(list) = value.strip_prefix("reason=") else {
            return Err(format!(
                "filter {value:?}: expected reason=expired|rejected|maxlen|delivery_limit"
            ));
        };
        for name in list.split(['|', ',']).filter(|n| !n.is_empty()) {
            let reason = name.parse::<DeadLetterReason>().map_err(|_| {
                format!("filter reason {name:?}: one of expired, rejected, maxlen, delivery_limit")
            })?;
            if !reasons.contains(&reason) {
                reasons.push(reason);
            }
        }
    }
    Ok(reasons)
}

/// The redrive count a message carries (0 without the header or with a non-integer one).
pub fn redriven_count(props: &BasicProperties) -> i64 {
    props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(X_REDRIVEN_COUNT))
        .and_then(amqp_integer)
        .unwrap_or(0)
}

/// `props` with `x-redriven-count` one higher and no `x-retry-count` (a redriven message
/// starts its queue's retry tiers again, as a new message would: it was moved back to be
/// processed again), everything else kept.
pub fn stamp(props: &BasicProperties) -> BasicProperties {
    let count = redriven_count(props).saturating_add(1);
    let mut headers = header_map(props);
    headers.remove(X_RETRY_COUNT);
    headers.insert(
        ShortString::from(X_REDRIVEN_COUNT),
        AMQPValue::LongLongInt(count),
    );
    props.clone().with_headers(FieldTable::from(headers))
}

/// Properties whose `x-death` holds one entry per (queue, reason), newest first: the dead
/// letters the unit tests of a redrive (both modes) start from.
#[cfg(test)]
pub(crate) fn dead_letter_properties(deaths: &[(&str, &str)]) -> BasicProperties {
    let entries: Vec<AMQPValue> = deaths
        .iter()
        .map(|(queue, reason)| {
            AMQPValue::FieldTable(
                crate::deadletter::XDeathEntry {
                    queue: queue.to_string(),
                    reason: reason.to_string(),
                    time: 1,
                    exchange: String::new(),
                    routing_keys: vec![queue.to_string()],
                    count: 1,
                    original_expiration: None,
                }
                .to_field_table(),
            )
        })
        .collect();
    let mut headers = amq_protocol::types::FieldTable::default();
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(amq_protocol::types::FieldArray::from(entries)),
    );
    BasicProperties::default().with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_message_goes_back_to_its_newest_source() {
        let plan = Plan::default();
        let props = dead_letter_properties(&[("retry", "expired"), ("work", "rejected")]);
        assert_eq!(plan.decide(&props, "dlq"), Decision::Move("retry".into()));
        let to = Plan {
            to: Some("other".into()),
            ..Plan::default()
        };
        assert_eq!(to.decide(&props, "dlq"), Decision::Move("other".into()));
        assert_eq!(
            plan.decide(&BasicProperties::default(), "dlq"),
            Decision::Fail("no_source")
        );
        assert_eq!(
            to.decide(&BasicProperties::default(), "dlq"),
            Decision::Move("other".into())
        );
        assert_eq!(
            plan.decide(&dead_letter_properties(&[("dlq", "expired")]), "dlq"),
            Decision::Fail("same_queue")
        );
    }

    #[test]
    fn the_filter_reads_the_newest_reason() {
        let plan = Plan {
            to: None,
            reasons: parse_filter(&["reason=expired|maxlen".into()]).unwrap(),
        };
        assert_eq!(
            plan.decide(
                &dead_letter_properties(&[("a", "expired"), ("b", "rejected")]),
                "dlq"
            ),
            Decision::Move("a".into())
        );
        assert_eq!(
            plan.decide(
                &dead_letter_properties(&[("b", "rejected"), ("a", "expired")]),
                "dlq"
            ),
            Decision::Skip
        );
        assert_eq!(
            plan.decide(&BasicProperties::default(), "dlq"),
            Decision::Skip
        );
    }

    #[test]
    fn filters_parse_or_name_the_problem() {
        assert_eq!(
            parse_filter(&[
                "reason=rejected,delivery_limit".into(),
                "reason=rejected".into()
            ]),
            Ok(vec![
                DeadLetterReason::Rejected,
                DeadLetterReason::DeliveryLimit
            ])
        );
        assert_eq!(parse_filter(&[]), Ok(vec![]));
        let error = parse_filter(&["queue=x".into()]).unwrap_err();
        assert!(error.contains("expected reason="), "{error}");
        let error = parse_filter(&["reason=old".into()]).unwrap_err();
        assert!(error.contains("\"old\""), "{error}");
    }

    #[test]
    fn stamping_counts_up_and_keeps_the_history() {
        let props = dead_letter_properties(&[("work", "rejected")]);
        let once = stamp(&props);
        let headers = once.headers().clone().unwrap();
        assert_eq!(
            headers.inner().get(X_REDRIVEN_COUNT),
            Some(&AMQPValue::LongLongInt(1))
        );
        assert_eq!(
            headers.inner().get("x-death"),
            props.headers().as_ref().unwrap().inner().get("x-death")
        );
        assert_eq!(redriven_count(&stamp(&once)), 2);
        // The retry tiers start again: the tier count goes.
        let mut tiered = props.headers().clone().unwrap();
        tiered.insert(X_RETRY_COUNT.into(), AMQPValue::LongInt(3));
        let redriven = stamp(&props.clone().with_headers(tiered));
        let headers = redriven.headers().clone().unwrap();
        assert_eq!(headers.inner().get(X_RETRY_COUNT), None);
        assert_eq!(
            headers.inner().get("x-death"),
            props.headers().as_ref().unwrap().inner().get("x-death")
        );
        // A client-set value of another integer type is read and replaced by a long-long.
        let mut h = amq_protocol::types::FieldTable::default();
        h.insert(X_REDRIVEN_COUNT.into(), AMQPValue::ShortInt(4));
        let props = BasicProperties::default().with_headers(h);
        assert_eq!(
            stamp(&props)
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .get(X_REDRIVEN_COUNT),
            Some(&AMQPValue::LongLongInt(5))
        );
    }
}
