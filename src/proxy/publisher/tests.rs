//! Unit tests of [`crate::proxy::publisher`].

use super::*;
use crate::amqp::codec::put_raw_frame;
use crate::proxy::wire::WireCodec;
use tokio_util::codec::Decoder;

fn frame(bytes: Bytes) -> WireFrame {
    let mut buf = BytesMut::from(&bytes[..]);
    WireCodec::new(1 << 20).decode(&mut buf).unwrap().unwrap()
}

fn message(exchange: &str, key: &str) -> OutgoingMessage {
    OutgoingMessage {
        exchange: exchange.into(),
        routing_key: key.into(),
        raw_properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from_static(b"body"),
    }
}

fn ack(ch: u16, tag: u64, multiple: bool) -> WireFrame {
    frame(method_frame(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        })),
    ))
}

#[test]
fn acks_settle_in_sequence_and_multiple() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    for op in 10..13 {
        p.publish(op, &message("dlx", "k"), now).unwrap();
    }
    let step = p.on_frame(&ack(5, 2, true));
    assert_eq!(
        step.settled.iter().map(|s| s.op).collect::<Vec<_>>(),
        vec![10, 11]
    );
    let step = p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 3,
            multiple: false,
            requeue: false,
        })),
    )));
    assert_eq!(step.settled[0].outcome, Outcome::Failed("nack"));
    assert_eq!(p.unconfirmed(), 0);
}

#[test]
fn returns_mark_the_matching_publish_unroutable() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("dlx", "a"), now).unwrap();
    p.publish(2, &message("dlx", "b"), now).unwrap();
    p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: ShortString::from("dlx"),
            routing_key: ShortString::from("b"),
        })),
    )));
    let mut content = BytesMut::new();
    put_content(&mut content, 5, &[0, 0], b"body", 4096);
    let mut codec = WireCodec::new(4096);
    while let Some(f) = codec.decode(&mut content).unwrap() {
        p.on_frame(&f);
    }
    let step = p.on_frame(&ack(5, 2, true));
    assert_eq!(
        step.settled,
        vec![
            Settled {
                op: 1,
                outcome: Outcome::Confirmed
            },
            Settled {
                op: 2,
                outcome: Outcome::Unroutable
            }
        ]
    );
}

#[test]
fn a_missing_exchange_fails_its_publishes_and_reopens() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("gone", "a"), now).unwrap();
    p.publish(2, &message("dlx", "b"), now).unwrap();
    let step = p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 404,
            reply_text: ShortString::from("NOT_FOUND - no exchange 'gone' in vhost '/'"),
            class_id: 60,
            method_id: 40,
        })),
    )));
    assert_eq!(step.settled[0].outcome, Outcome::ExchangeMissing);
    assert_eq!(step.settled[1].outcome, Outcome::Failed("channel closed"));
    let write = step.write.unwrap();
    let mut buf = BytesMut::from(&write[..]);
    let mut codec = WireCodec::new(4096);
    let ids: Vec<_> = std::iter::from_fn(|| codec.decode(&mut buf).unwrap())
        .map(|f| f.method_ids())
        .collect();
    assert_eq!(ids, vec![(20, 41), (20, 10), (85, 10)]);
    // Sequence numbers restart with the new channel.
    p.publish(3, &message("dlx", "c"), now).unwrap();
    assert_eq!(p.on_frame(&ack(5, 1, false)).settled[0].op, 3);
}

#[test]
fn a_refused_user_id_fails_every_publish_in_flight_under_its_own_cause() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("dlx", "a"), now).unwrap();
    p.publish(2, &message("dlx", "b"), now).unwrap();
    let step = p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 406,
            reply_text: ShortString::from(
                "PRECONDITION_FAILED - user_id property set to 'app' but authenticated \
                 user was 'dlx-proxy'",
            ),
            class_id: 60,
            method_id: 40,
        })),
    )));
    let outcomes: Vec<_> = step.settled.iter().map(|s| s.outcome.clone()).collect();
    assert_eq!(outcomes, vec![Outcome::Failed(USER_ID_REFUSED); 2]);
    assert!(step.write.is_some(), "the channel is opened again");
}

#[test]
fn a_refused_exchange_is_reported_apart_from_a_missing_one() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("locked", "a"), now).unwrap();
    p.publish(2, &message("dlx", "b"), now).unwrap();
    let step = p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 403,
            reply_text: ShortString::from(
                "ACCESS_REFUSED - access to exchange 'locked' in vhost '/' refused for user 'u'",
            ),
            class_id: 60,
            method_id: 40,
        })),
    )));
    assert_eq!(step.settled[0].outcome, Outcome::AccessRefused);
    assert_eq!(step.settled[1].outcome, Outcome::Failed("channel closed"));
    assert!(step.write.is_some());
}

#[test]
fn confirms_time_out() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("dlx", "a"), now).unwrap();
    assert_eq!(p.next_deadline(), Some(now + Duration::from_secs(5)));
    assert!(p.expire(now).is_empty());
    let expired = p.expire(now + Duration::from_secs(5));
    assert_eq!(expired[0].outcome, Outcome::TimedOut);
    assert!(p.on_frame(&ack(5, 1, false)).settled.is_empty());
    assert_eq!(p.next_deadline(), None);
}

#[test]
fn big_bodies_are_split_by_frame_max() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let mut m = message("dlx", "a");
    m.body = Bytes::from(vec![0u8; 10_000]);
    let bytes = p.publish(1, &m, Instant::now()).unwrap();
    let mut buf = BytesMut::from(&bytes[..]);
    let mut codec = WireCodec::new(4096);
    let count = std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).count();
    assert_eq!(count, 5);
    let mut heartbeat = BytesMut::new();
    put_raw_frame(&mut heartbeat, 8, 0, b"");
}

#[test]
fn missing_exchange_names_are_read_from_the_reply() {
    assert_eq!(
        missing_exchange("NOT_FOUND - no exchange 'a'b' in vhost '/'").as_deref(),
        Some("a'b")
    );
    assert_eq!(missing_exchange("NOT_FOUND - no queue 'q'"), None);
    assert_eq!(
        missing_exchange(
            "ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'u'"
        )
        .as_deref(),
        Some("x")
    );
}
