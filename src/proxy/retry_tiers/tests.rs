//! Unit tests of [`crate::proxy::retry_tiers`].

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, BasicProperties, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::Bytes;

use super::*;
use crate::amqp::codec::decode_method;
use crate::amqp::content::decode_properties;
use crate::deadletter::retry::X_RETRY_COUNT;
use crate::deadletter::{HEADER_CC, x_death_entries};
use crate::proxy::bcc::PRIVATE_BCC_HEADER;
use crate::proxy::wire::WireCodec;
use tokio_util::codec::Decoder;

const CAPTURE: &str = "dlx-proxy.capture";

fn rejected(props: BasicProperties) -> Death {
    Death {
        queue: Arc::from("work"),
        reason: DeadLetterReason::Rejected,
        raw_before: encode_properties(&props),
        before: props,
        exchange: "orders".into(),
        routing_keys: vec!["new".into()],
        time: 1_700_000_000,
        body: Bytes::from_static(b"job"),
    }
}

fn header(props: &BasicProperties, name: &str) -> Option<AMQPValue> {
    props.headers().as_ref()?.inner().get(name).cloned()
}

fn hold(plan: RetryPlan) -> (u64, u64, OutgoingMessage) {
    match plan {
        RetryPlan::Hold {
            tier,
            delay_ms,
            message,
        } => (tier, delay_ms, message),
        other => panic!("not held: {other:?}"),
    }
}

#[test]
fn delay_queues_are_named_after_the_capture_name_and_the_delay() {
    assert_eq!(
        delay_queue_name(CAPTURE, 300).as_deref(),
        Some("dlx-proxy.capture.retry.300")
    );
    assert!(is_delay_queue(CAPTURE, "dlx-proxy.capture.retry.300"));
    assert!(!is_delay_queue(CAPTURE, "dlx-proxy.capture.retry."));
    assert!(!is_delay_queue(CAPTURE, "dlx-proxy.capture.retry.3x"));
    assert!(!is_delay_queue(CAPTURE, "dlx-proxy.capture"));
    assert!(!is_delay_queue(CAPTURE, "work"));
    assert_eq!(delay_queue_name(&"c".repeat(250), 300), None);
}

#[test]
fn the_delay_queue_is_a_quorum_queue_that_expires_into_the_capture_exchange() {
    let bytes = delay_queue_declare(2, CAPTURE, 900).unwrap();
    let mut buf = bytes::BytesMut::from(&bytes[..]);
    let frame = WireCodec::new(1 << 20).decode(&mut buf).unwrap().unwrap();
    assert_eq!(frame.channel, 2);
    let Some(AMQPClass::Queue(queue::AMQPMethod::Declare(declare))) =
        decode_method(frame.payload())
    else {
        panic!("not a queue.declare");
    };
    assert_eq!(declare.queue.as_str(), "dlx-proxy.capture.retry.900");
    assert!(declare.durable && declare.nowait && !declare.passive);
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    let mut expected = FieldTable::default();
    expected.insert(ShortString::from("x-queue-type"), text("quorum"));
    expected.insert(
        ShortString::from("x-message-ttl"),
        AMQPValue::LongLongInt(900),
    );
    expected.insert(ShortString::from("x-dead-letter-exchange"), text(CAPTURE));
    expected.insert(
        ShortString::from("x-dead-letter-strategy"),
        text("at-least-once"),
    );
    expected.insert(ShortString::from("x-overflow"), text("reject-publish"));
    assert_eq!(declare.arguments, expected);
}

#[test]
fn a_rejection_waits_in_the_queue_of_its_tier_and_comes_back_without_the_private_header() {
    let opts = DeadLetterOptions::default();
    let delays = [300, 900];
    let (tier, delay, message) = hold(plan_rejection(
        &rejected(BasicProperties::default()),
        Some(&delays),
        &opts,
        CAPTURE,
    ));
    assert_eq!((tier, delay), (1, 300));
    assert_eq!(
        (message.exchange.as_str(), message.routing_key.as_str()),
        ("", "dlx-proxy.capture.retry.300")
    );
    assert_eq!(&message.body[..], b"job");
    let waiting = decode_properties(&message.raw_properties).unwrap();
    assert_eq!(
        header(&waiting, RETRY_QUEUE_HEADER),
        Some(AMQPValue::LongString("work".into()))
    );
    assert_eq!(
        header(&waiting, X_RETRY_COUNT),
        Some(AMQPValue::LongLongInt(1))
    );

    // Read back from the capture queue (the delay queue's entry already removed).
    let back = Death {
        queue: Arc::from("dlx-proxy.capture.retry.300"),
        reason: DeadLetterReason::Expired,
        raw_before: message.raw_properties.clone(),
        before: waiting,
        exchange: String::new(),
        routing_keys: vec!["dlx-proxy.capture.retry.300".into()],
        time: 1_700_000_001,
        body: message.body.clone(),
    };
    let (target, returned) = returning(&back, CAPTURE).unwrap().unwrap();
    assert_eq!(target, "work");
    assert_eq!(
        (returned.exchange.as_str(), returned.routing_key.as_str()),
        ("", "work")
    );
    let props = decode_properties(&returned.raw_properties).unwrap();
    assert_eq!(header(&props, RETRY_QUEUE_HEADER), None);
    let deaths = x_death_entries(&props);
    assert_eq!(deaths.len(), 1);
    assert_eq!(
        (
            deaths[0].queue.as_str(),
            deaths[0].reason.as_str(),
            deaths[0].count
        ),
        ("work", "rejected", 1)
    );

    // The second rejection takes the second tier, the third is past the last one.
    let (tier, delay, message) = hold(plan_rejection(
        &rejected(props),
        Some(&delays),
        &opts,
        CAPTURE,
    ));
    assert_eq!((tier, delay), (2, 900));
    assert_eq!(message.routing_key, "dlx-proxy.capture.retry.900");
    let waiting = decode_properties(&message.raw_properties).unwrap();
    let waiting = with_header(&waiting, RETRY_QUEUE_HEADER, None);
    assert!(matches!(
        plan_rejection(&rejected(waiting), Some(&delays), &opts, CAPTURE),
        RetryPlan::Exhausted
    ));
}

/// A rejected message with `CC` (kept by the rewrite when the queue has no dead-letter routing
/// key, and under `compat = "4"` with one) waits and comes back without it: the hold and the
/// return go through the default exchange, which would copy it into every queue `CC` names.
/// Its kept BCC keys go too (it comes back routed by its queue's name, as in embedded mode).
#[test]
fn a_held_retry_routes_to_its_delay_queue_and_back_only() {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(HEADER_CC),
        AMQPValue::FieldArray(vec![AMQPValue::LongString("elsewhere".into())].into()),
    );
    headers.insert(
        ShortString::from(PRIVATE_BCC_HEADER),
        AMQPValue::FieldArray(vec![AMQPValue::LongString("audit".into())].into()),
    );
    let props = BasicProperties::default().with_headers(headers);
    let (_, _, message) = hold(plan_rejection(
        &rejected(props),
        Some(&[300]),
        &DeadLetterOptions::default(),
        CAPTURE,
    ));
    let waiting = decode_properties(&message.raw_properties).unwrap();
    assert_eq!(header(&waiting, HEADER_CC), None);
    assert_eq!(
        header(&waiting, PRIVATE_BCC_HEADER),
        None,
        "back, it is routed by its queue's name only"
    );
    let mut back = rejected(waiting.clone());
    back.queue = Arc::from("dlx-proxy.capture.retry.300");
    back.reason = DeadLetterReason::Expired;
    // As if the delay queue's publisher had added CC again.
    back.before = with_header(
        &waiting,
        HEADER_CC,
        Some(AMQPValue::FieldArray(
            vec![AMQPValue::LongString("elsewhere".into())].into(),
        )),
    );
    let (_, returned) = returning(&back, CAPTURE).unwrap().unwrap();
    let props = decode_properties(&returned.raw_properties).unwrap();
    assert_eq!(header(&props, HEADER_CC), None);
}

#[test]
fn no_tiers_other_reasons_and_user_ids_die_as_usual() {
    let opts = DeadLetterOptions::default();
    let plain = rejected(BasicProperties::default());
    assert!(matches!(
        plan_rejection(&plain, None, &opts, CAPTURE),
        RetryPlan::NotRetried
    ));
    assert!(matches!(
        plan_rejection(&plain, Some(&[]), &opts, CAPTURE),
        RetryPlan::NotRetried
    ));
    let mut expired = rejected(BasicProperties::default());
    expired.reason = DeadLetterReason::Expired;
    assert!(matches!(
        plan_rejection(&expired, Some(&[5]), &opts, CAPTURE),
        RetryPlan::NotRetried
    ));
    let with_user = rejected(BasicProperties::default().with_user_id("alice".into()));
    assert!(matches!(
        plan_rejection(&with_user, Some(&[5]), &opts, CAPTURE),
        RetryPlan::NotRetried
    ));
}

#[test]
fn only_delay_queue_deaths_return_and_they_must_name_their_queue() {
    let mut other = rejected(BasicProperties::default());
    other.reason = DeadLetterReason::Expired;
    assert!(returning(&other, CAPTURE).is_none());
    other.queue = Arc::from("dlx-proxy.capture.retry.5");
    assert!(matches!(
        returning(&other, CAPTURE),
        Some(Err(NoRetryTarget))
    ));
}
