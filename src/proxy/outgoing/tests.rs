//! Unit tests of [`crate::proxy::outgoing`].

use super::*;
use crate::amqp::content::decode_properties;
use crate::deadletter::{DeadLetterOptions, DeadLetterTarget, DeathEvent, X_DEATH, dead_letter};

fn headers_of(raw: &[u8]) -> std::collections::BTreeMap<ShortString, AMQPValue> {
    decode_properties(raw)
        .unwrap()
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default()
}

fn with_cc(keys: &[&str]) -> BasicProperties {
    let mut t = FieldTable::default();
    let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    t.insert(ShortString::from(HEADER_CC), long_strings(&keys));
    BasicProperties::default().with_headers(t)
}

fn die(
    props: &BasicProperties,
    queue: &str,
    reason: DeadLetterReason,
    keys: &[String],
    dlx: &str,
    dlrk: Option<&str>,
) -> DeadLetteredMessage {
    dead_letter(
        props,
        &DeathEvent {
            queue,
            reason,
            exchange: "",
            routing_keys: keys,
            now_secs: 1,
            trust_existing_history: true,
        },
        &DeadLetterTarget {
            exchange: dlx,
            routing_key: dlrk,
        },
        &DeadLetterOptions::default(),
    )
    .unwrap()
}

#[test]
fn extra_keys_travel_in_bcc_and_cc_stays_as_rewritten() {
    let props = with_cc(&["cc1"]);
    let keys = vec!["q".to_string(), "cc1".to_string(), "bcc1".to_string()];
    let message = die(&props, "q", DeadLetterReason::Rejected, &keys, "dlx", None);
    let publish = dead_letter_publish(&message, &keys, Bytes::from_static(b"x"));
    assert_eq!(publish.routing_key, "q");
    assert_eq!(publish.exchange, "dlx");
    let headers = headers_of(&publish.raw_properties);
    assert_eq!(
        headers.get(HEADER_CC),
        Some(&long_strings(&["cc1".to_string()]))
    );
    assert_eq!(
        headers.get(HEADER_BCC),
        Some(&long_strings(&["bcc1".to_string()]))
    );
    assert!(headers.contains_key(X_DEATH));
}

#[test]
fn kept_bcc_keys_route_but_stay_out_of_x_death() {
    let mut t = FieldTable::default();
    t.insert(
        ShortString::from(HEADER_CC),
        long_strings(&["cc1".to_string()]),
    );
    t.insert(
        ShortString::from(PRIVATE_BCC_HEADER),
        long_strings(&["bcc1".to_string()]),
    );
    let props = BasicProperties::default().with_headers(t);
    let keys = delivery_routing_keys("q", &props);
    assert_eq!(keys, vec!["q", "cc1", "bcc1"]);
    let message = die(&props, "q", DeadLetterReason::Rejected, &keys, "dlx", None);
    let entry = &crate::deadletter::x_death_entries(&message.properties)[0];
    assert_eq!(entry.routing_keys, vec!["q", "cc1"]);
    let publish = dead_letter_publish(&message, &keys, Bytes::new());
    let headers = headers_of(&publish.raw_properties);
    let bcc = long_strings(&["bcc1".to_string()]);
    assert_eq!(headers.get(HEADER_BCC), Some(&bcc));
    // Kept again for a further hop.
    assert_eq!(headers.get(PRIVATE_BCC_HEADER), Some(&bcc));
    // With a dead-letter routing key the message is routed with that key alone.
    let message = die(
        &props,
        "q",
        DeadLetterReason::Rejected,
        &keys,
        "dlx",
        Some("dlq"),
    );
    let publish = dead_letter_publish(&message, &message.routing_keys, Bytes::new());
    let headers = headers_of(&publish.raw_properties);
    assert!(!headers.contains_key(HEADER_BCC));
    assert!(!headers.contains_key(PRIVATE_BCC_HEADER));
    // A requeue reaches its queue only.
    let requeue = requeue_publish(&props, "q", 1, Bytes::new());
    assert!(!headers_of(&requeue.raw_properties).contains_key(PRIVATE_BCC_HEADER));
}

#[test]
fn a_dead_letter_routing_key_publishes_plainly() {
    let props = with_cc(&["cc1"]);
    let keys = delivery_routing_keys("q", &props);
    let message = die(
        &props,
        "q",
        DeadLetterReason::Rejected,
        &keys,
        "dlx",
        Some("dlq"),
    );
    let publish = dead_letter_publish(&message, &message.routing_keys, Bytes::new());
    assert_eq!(publish.routing_key, "dlq");
    let headers = headers_of(&publish.raw_properties);
    assert!(!headers.contains_key(HEADER_CC));
    assert!(!headers.contains_key(HEADER_BCC));
}

#[test]
fn default_exchange_cycles_are_dropped_per_key() {
    let keys = vec!["q".to_string(), "other".to_string()];
    let props = with_cc(&["other"]);
    let message = die(&props, "q", DeadLetterReason::Expired, &keys, "", None);
    let before = props.clone();
    let kept = keys_after_cycle_rule(DeadLetterReason::Expired, &message, &before, "q");
    assert_eq!(kept, vec!["other".to_string()]);
    let publish = dead_letter_publish(&message, &kept, Bytes::new());
    assert_eq!(publish.routing_key, "other");
    // A rejection never drops.
    let message = die(&props, "q", DeadLetterReason::Rejected, &keys, "", None);
    assert_eq!(
        keys_after_cycle_rule(DeadLetterReason::Rejected, &message, &before, "q").len(),
        2
    );
}

#[test]
fn other_exchanges_drop_a_message_that_came_back_automatically() {
    let keys = vec!["q".to_string()];
    let expire_in_q =
        |props: &BasicProperties| die(props, "q", DeadLetterReason::Expired, &keys, "fan", None);
    let first = expire_in_q(&BasicProperties::default());
    // First death: kept (the proxy cannot see that "fan" routes back to q).
    assert_eq!(
        keys_after_cycle_rule(
            DeadLetterReason::Expired,
            &first,
            &BasicProperties::default(),
            "q"
        ),
        keys
    );
    // It expired in q again after "fan" routed the proxy's dead letter back: the history
    // before this death already shows q, no rejection.
    let published = dead_letter_publish(&first, &keys, Bytes::new());
    let routed_back = decode_properties(&published.raw_properties).unwrap();
    let second = expire_in_q(&routed_back);
    assert!(
        keys_after_cycle_rule(DeadLetterReason::Expired, &second, &routed_back, "q").is_empty()
    );
    // The same history on a message a client republished into q (the proxy's mark is gone):
    // RabbitMQ judges the target, which the republish did not make a loop. Kept.
    let republished = expire_in_q(&first.properties);
    assert_eq!(
        keys_after_cycle_rule(
            DeadLetterReason::Expired,
            &republished,
            &first.properties,
            "q"
        ),
        keys
    );
}

#[test]
fn requeues_carry_the_delivery_count_and_no_cc() {
    let props = with_cc(&["cc1"]);
    assert_eq!(delivery_count(&props), 0);
    let publish = requeue_publish(&props, "q", 2, Bytes::from_static(b"b"));
    assert_eq!(publish.exchange, "");
    assert_eq!(publish.routing_key, "q");
    let decoded = decode_properties(&publish.raw_properties).unwrap();
    assert_eq!(delivery_count(&decoded), 2);
    assert!(!headers_of(&publish.raw_properties).contains_key(HEADER_CC));
}
