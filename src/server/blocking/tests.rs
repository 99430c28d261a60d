//! Unit tests of [`crate::server::blocking`].

use super::*;
use amq_protocol::types::ShortString;
use bytes::Bytes;

fn properties(capability: Option<AMQPValue>) -> FieldTable {
    let mut capabilities = FieldTable::default();
    if let Some(value) = capability {
        capabilities.insert(ShortString::from("connection.blocked"), value);
    }
    let mut properties = FieldTable::default();
    properties.insert(
        ShortString::from("capabilities"),
        AMQPValue::FieldTable(capabilities),
    );
    properties
}

fn method(channel: u16, class_id: u16, method_id: u16) -> RawFrame {
    let mut payload = Vec::new();
    payload.extend_from_slice(&class_id.to_be_bytes());
    payload.extend_from_slice(&method_id.to_be_bytes());
    payload.extend_from_slice(&[0; 8]);
    RawFrame {
        kind: FRAME_METHOD,
        channel,
        payload: payload.into(),
    }
}

#[test]
fn only_a_publish_or_its_content_while_the_alarm_is_raised_blocks() {
    let alarm = watch::Sender::new(false);
    let disk = watch::Sender::new(false);
    let throttle = Throttle::new(alarm.subscribe(), disk.subscribe(), true);
    let publish = method(1, 60, 40);
    let content = |kind| RawFrame {
        kind,
        channel: 1,
        payload: Bytes::from_static(b"part of a body"),
    };
    let (header, body) = (
        content(crate::amqp::codec::FRAME_HEADER),
        content(crate::amqp::codec::FRAME_BODY),
    );
    assert!(!throttle.must_block(&publish), "alarm cleared");
    assert!(!throttle.must_block(&body), "alarm cleared");
    alarm.send_replace(true);
    assert!(throttle.must_block(&publish));
    assert!(throttle.must_block(&header), "a publish's content header");
    assert!(throttle.must_block(&body), "a publish's body");
    assert!(!throttle.must_block(&method(1, 60, 80)), "basic.ack");
    assert!(!throttle.must_block(&method(1, 50, 10)), "queue.declare");
    assert!(!throttle.must_block(&method(0, 60, 40)), "channel 0");
    let heartbeat = RawFrame {
        kind: crate::amqp::codec::FRAME_HEARTBEAT,
        channel: 0,
        payload: Bytes::new(),
    };
    assert!(!throttle.must_block(&heartbeat), "a heartbeat");
}

/// The methods written to `write_queue` (all on channel 0).
fn sent_methods(write_queue: &WriteQueue) -> Vec<AMQPClass> {
    let bytes = write_queue.try_batch();
    let mut frames = Vec::new();
    let mut at = 0;
    while at + 7 <= bytes.len() {
        let size = u32::from_be_bytes([bytes[at + 3], bytes[at + 4], bytes[at + 5], bytes[at + 6]]);
        let payload = &bytes[at + 7..at + 7 + size as usize];
        assert_eq!(u16::from_be_bytes([bytes[at + 1], bytes[at + 2]]), 0);
        frames.push(crate::amqp::codec::decode_method(payload).expect("a method"));
        at += size as usize + 8;
    }
    frames
}

#[tokio::test]
async fn the_disk_alarm_blocks_too_and_both_must_clear() {
    let memory = watch::Sender::new(false);
    let disk = watch::Sender::new(true);
    let metrics = Metrics::new(10);
    let write_queue = WriteQueue::new(1 << 20);
    let trigger = crate::shutdown::ShutdownTrigger::new();
    let mut shutdown = trigger.subscribe();
    let mut throttle = Throttle::new(memory.subscribe(), disk.subscribe(), true);
    assert!(throttle.must_block(&method(1, 60, 40)), "disk alone blocks");
    memory.send_replace(true);
    let wait = throttle.wait_until_clear(&write_queue, &metrics, &mut shutdown);
    tokio::pin!(wait);
    let short = std::time::Duration::from_millis(50);
    assert!(tokio::time::timeout(short, &mut wait).await.is_err());
    disk.send_replace(false);
    assert!(
        tokio::time::timeout(short, &mut wait).await.is_err(),
        "memory still raised"
    );
    memory.send_replace(false);
    assert!(wait.await);
    match sent_methods(&write_queue).as_slice() {
        [
            AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)),
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)),
        ] => assert_eq!(blocked.reason.as_str(), "low on memory & low on disk"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn blocked_until_the_alarm_clears_with_notifications() {
    let alarm = watch::Sender::new(true);
    let metrics = Metrics::new(10);
    let write_queue = WriteQueue::new(1 << 20);
    let trigger = crate::shutdown::ShutdownTrigger::new();
    let mut shutdown = trigger.subscribe();
    let disk = watch::Sender::new(false);
    let mut throttle = Throttle::new(alarm.subscribe(), disk.subscribe(), true);
    let wait = throttle.wait_until_clear(&write_queue, &metrics, &mut shutdown);
    tokio::pin!(wait);
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), &mut wait)
            .await
            .is_err(),
        "held while raised"
    );
    assert!(metrics.encode().contains("dlx_proxy_blocked_connections 1"));
    alarm.send_replace(false);
    assert!(wait.await);
    let text = metrics.encode();
    assert!(text.contains("dlx_proxy_blocked_connections 0"), "{text}");
    assert!(
        text.contains("dlx_proxy_connection_blocks_total 1"),
        "{text}"
    );
    // connection.blocked("low on memory") then connection.unblocked, on channel 0.
    match sent_methods(&write_queue).as_slice() {
        [
            AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)),
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)),
        ] => assert_eq!(blocked.reason.as_str(), LOW_ON_MEMORY),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn shutdown_ends_a_block_and_no_notification_without_the_capability() {
    let alarm = watch::Sender::new(true);
    let metrics = Metrics::new(10);
    let write_queue = WriteQueue::new(1 << 20);
    let trigger = crate::shutdown::ShutdownTrigger::new();
    let mut shutdown = trigger.subscribe();
    let disk = watch::Sender::new(false);
    let mut throttle = Throttle::new(alarm.subscribe(), disk.subscribe(), false);
    trigger.trigger();
    assert!(
        !throttle
            .wait_until_clear(&write_queue, &metrics, &mut shutdown)
            .await
    );
    assert!(write_queue.try_batch().is_empty());
    assert!(metrics.encode().contains("dlx_proxy_blocked_connections 0"));
}

#[test]
fn only_a_true_capability_asks_for_notifications() {
    assert!(wants_blocked_notifications(&properties(Some(
        AMQPValue::Boolean(true)
    ))));
    assert!(!wants_blocked_notifications(&properties(Some(
        AMQPValue::Boolean(false)
    ))));
    assert!(!wants_blocked_notifications(&properties(Some(
        AMQPValue::LongString("true".into())
    ))));
    assert!(!wants_blocked_notifications(&properties(None)));
    assert!(!wants_blocked_notifications(&FieldTable::default()));
    let mut flat = FieldTable::default();
    flat.insert(
        ShortString::from("connection.blocked"),
        AMQPValue::Boolean(true),
    );
    assert!(!wants_blocked_notifications(&flat), "not in capabilities");
}
