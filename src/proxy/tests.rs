//! Unit tests of [`crate::proxy`]: the requeue decisions of [`QueueView`].

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use bytes::Bytes;

use super::*;
use crate::amqp::content::encode_properties;

/// The view of a queue of `queue_type` with `x-delivery-limit` 2.
fn limited(queue_type: QueueType) -> QueueView {
    let arguments = QueueArguments {
        delivery_limit: Some(2),
        queue_type,
        ..QueueArguments::default()
    };
    test_support::shared().queue_view("/", "q", &arguments)
}

fn delivery(redelivered: bool, raw_properties: Bytes) -> inflight::KeptDelivery {
    inflight::KeptDelivery {
        queue: Some(Arc::from("q")),
        redelivered,
        deadline: None,
        message: Some(Box::new(inflight::KeptMessage {
            exchange: String::new(),
            routing_key: "q".to_string(),
            raw_properties,
            body: Bytes::from_static(b"m"),
        })),
    }
}

fn counted(count: AMQPValue) -> Bytes {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from(X_DELIVERY_COUNT), count);
    encode_properties(&BasicProperties::default().with_headers(headers))
}

#[test]
fn a_quorum_requeue_is_taken_over_once_rabbitmq_would_dead_letter_it() {
    let view = limited(QueueType::Quorum);
    assert_eq!(view.returns_counted_by, ReturnCounter::QuorumQueue);
    // Returned never or once before: this return is within the limit of 2.
    for count in [0, 1] {
        let d = delivery(true, counted(AMQPValue::LongLongInt(count)));
        assert!(!view.takes_over_requeue(&d), "count {count}");
    }
    // Returned twice before, in any integer type RabbitMQ or a publisher writes: this third
    // return is past it.
    for count in [
        AMQPValue::LongLongInt(2),
        AMQPValue::LongInt(2),
        AMQPValue::ShortUInt(5),
    ] {
        let d = delivery(true, counted(count.clone()));
        assert!(view.takes_over_requeue(&d), "{count:?}");
    }
    // A first delivery was never returned, whatever its header says.
    let d = delivery(false, counted(AMQPValue::LongLongInt(9)));
    assert!(!view.takes_over_requeue(&d));
    // No count, a count that is not an integer, or headers that do not scan: RabbitMQ decides.
    let plain = encode_properties(&BasicProperties::default());
    assert!(!view.takes_over_requeue(&delivery(true, plain)));
    let text = counted(AMQPValue::LongString("9".into()));
    assert!(!view.takes_over_requeue(&delivery(true, text)));
    let mut broken = counted(AMQPValue::LongLongInt(9)).to_vec();
    broken.truncate(broken.len() - 3);
    assert!(!view.takes_over_requeue(&delivery(true, Bytes::from(broken))));
}

#[test]
fn classic_requeues_under_a_limit_are_always_the_proxys() {
    let view = limited(QueueType::Classic);
    assert_eq!(view.returns_counted_by, ReturnCounter::Proxy);
    let plain = encode_properties(&BasicProperties::default());
    assert!(view.takes_over_requeue(&delivery(false, plain)));
    let unlimited = test_support::shared().queue_view("/", "q", &QueueArguments::default());
    assert_eq!(unlimited.returns_counted_by, ReturnCounter::Nobody);
    let plain = encode_properties(&BasicProperties::default());
    assert!(!unlimited.takes_over_requeue(&delivery(true, plain)));
}
