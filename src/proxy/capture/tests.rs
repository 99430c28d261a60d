//! Unit tests of [`crate::proxy::capture`].

use super::*;
use crate::amqp::codec::put_raw_frame;
use crate::amqp::content::put_content;
use crate::proxy::wire::WireCodec;
use tokio_util::codec::Decoder;

fn entry(queue: &str, reason: &str, count: i64, keys: &[&str]) -> AMQPValue {
    let mut t = FieldTable::default();
    t.insert("count".into(), AMQPValue::LongLongInt(count));
    t.insert("queue".into(), long_text(queue));
    t.insert("reason".into(), long_text(reason));
    t.insert("exchange".into(), long_text(""));
    t.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    t.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(
            keys.iter().map(|k| long_text(k)).collect::<Vec<_>>(),
        )),
    );
    AMQPValue::FieldTable(t)
}

fn props_with(headers: &[(&str, AMQPValue)]) -> AMQPProperties {
    let mut t = FieldTable::default();
    for (k, v) in headers {
        t.insert(ShortString::from(*k), v.clone());
    }
    AMQPProperties::default().with_headers(t)
}

fn deaths(list: Vec<AMQPValue>) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(list))
}

#[test]
fn first_death_is_undone_completely() {
    let mut e = entry("q", "expired", 1, &["q", "cc1"]);
    if let AMQPValue::FieldTable(t) = &mut e {
        t.insert("original-expiration".into(), long_text("50"));
    }
    let props = props_with(&[
        ("x-death", deaths(vec![e])),
        ("x-first-death-queue", long_text("q")),
        ("x-first-death-reason", long_text("expired")),
        ("x-first-death-exchange", long_text("")),
        ("app", long_text("kept")),
    ]);
    let (before, death) = reconstruct(&props, true).unwrap();
    assert_eq!(death.queue, "q");
    assert_eq!(death.reason, "expired");
    assert_eq!(death.routing_keys, vec!["q", "cc1"]);
    assert_eq!(death.time, 1_700_000_000);
    assert_eq!(before.expiration().as_ref().map(|e| e.as_str()), Some("50"));
    let headers = before.headers().as_ref().unwrap().inner();
    assert!(headers.get("x-death").is_none());
    assert!(headers.get("x-first-death-queue").is_none());
    assert_eq!(headers.get("app"), Some(&long_text("kept")));
    assert_eq!(headers.get("CC"), Some(&deaths(vec![long_text("cc1")])));
}

#[test]
fn the_reversal_of_older_entries_is_undone() {
    // Before: [b, a] (newest first); the upstream wrote [c, reverse([b, a])] = [c, a, b].
    let props = props_with(&[
        (
            "x-death",
            deaths(vec![
                entry("c", "expired", 1, &["c"]),
                entry("a", "rejected", 1, &["a"]),
                entry("b", "rejected", 1, &["b"]),
            ]),
        ),
        ("x-first-death-queue", long_text("a")),
    ]);
    let (before, death) = reconstruct(&props, false).unwrap();
    assert_eq!(death.queue, "c");
    let headers = before.headers().as_ref().unwrap().inner();
    assert_eq!(
        headers.get("x-death"),
        Some(&deaths(vec![
            entry("b", "rejected", 1, &["b"]),
            entry("a", "rejected", 1, &["a"])
        ]))
    );
    assert_eq!(headers.get("x-first-death-queue"), Some(&long_text("a")));
    assert!(headers.get("CC").is_none());
    assert!(before.expiration().is_none());
}

#[test]
fn a_repeated_death_gets_its_count_back() {
    let props = props_with(&[(
        "x-death",
        deaths(vec![
            entry("q", "expired", 3, &["q"]),
            entry("p", "rejected", 1, &["p"]),
        ]),
    )]);
    let (before, death) = reconstruct(&props, false).unwrap();
    assert_eq!(death.count, 3);
    let headers = before.headers().as_ref().unwrap().inner();
    assert_eq!(
        headers.get("x-death"),
        Some(&deaths(vec![
            entry("q", "expired", 2, &["q"]),
            entry("p", "rejected", 1, &["p"])
        ]))
    );
}

#[test]
fn messages_without_x_death_are_refused() {
    assert_eq!(
        reconstruct(&AMQPProperties::default(), false).unwrap_err(),
        CaptureError::NoXDeath
    );
    let props = props_with(&[("x-death", deaths(vec![]))]);
    assert_eq!(
        reconstruct(&props, false).unwrap_err(),
        CaptureError::NoXDeath
    );
}

fn frames(bytes: &[u8]) -> Vec<WireFrame> {
    let mut buf = BytesMut::from(bytes);
    let mut codec = WireCodec::new(4096);
    let mut out = Vec::new();
    while let Some(f) = codec.decode(&mut buf).unwrap() {
        out.push(f);
    }
    out
}

#[test]
fn consumer_assembles_deliveries_and_acks_by_epoch() {
    let mut consumer = CaptureConsumer::new(9, DEFAULT_CAPTURE_NAME, 250);
    let setup = frames(&consumer.start_frames());
    assert_eq!(setup.len(), 6);
    assert!(setup.iter().all(|f| f.channel == 9));
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&method_frame(
        9,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: ShortString::from(CAPTURE_CONSUMER_TAG),
            delivery_tag: 4,
            redelivered: false,
            exchange: ShortString::from(DEFAULT_CAPTURE_NAME),
            routing_key: ShortString::from("rk"),
        })),
    ));
    put_content(&mut wire, 9, &[0, 0], &[1u8; 5000], 4096);
    put_raw_frame(&mut wire, 8, 0, b"");
    let mut got = None;
    for frame in frames(&wire) {
        if frame.channel == 9 {
            let step = consumer.on_frame(&frame);
            if step.message.is_some() {
                got = step.message;
            }
        }
    }
    let message = got.unwrap();
    assert_eq!(message.delivery_tag, 4);
    assert_eq!(message.body.len(), 5000);
    assert_eq!(consumer.outstanding(), 1);
    // The prefetch is the configured one.
    let qos = setup.iter().find(|f| f.method_ids() == (60, 10)).unwrap();
    assert!(matches!(
        decode_method(qos.payload()),
        Some(AMQPClass::Basic(basic::AMQPMethod::Qos(q))) if q.prefetch_count == 250
    ));
    assert!(!consumer.ack(4, message.epoch + 1), "an old epoch");
    assert!(consumer.take_acks().is_none());
    assert!(consumer.ack(4, message.epoch));
    assert!(!consumer.ack(4, message.epoch), "settled once");
    let ack = frames(&consumer.take_acks().unwrap());
    assert_eq!(ack[0].method_ids(), (60, 80));
    assert_eq!(consumer.outstanding(), 0);
    assert!(consumer.take_acks().is_none());
    // A delivery that is requeued is nacked at once.
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&method_frame(
        9,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: ShortString::from(CAPTURE_CONSUMER_TAG),
            delivery_tag: 5,
            redelivered: false,
            exchange: ShortString::from(DEFAULT_CAPTURE_NAME),
            routing_key: ShortString::from("rk"),
        })),
    ));
    put_content(&mut wire, 9, &[0, 0], b"x", 4096);
    for frame in frames(&wire) {
        consumer.on_frame(&frame);
    }
    assert!(consumer.requeue(5, message.epoch + 1).is_none());
    let nack = frames(&consumer.requeue(5, message.epoch).unwrap());
    assert_eq!(nack[0].method_ids(), (60, 120));
    assert!(consumer.requeue(5, message.epoch).is_none(), "once");
    assert_eq!(consumer.outstanding(), 0);
}
