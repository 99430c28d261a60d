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

/// A publisher on channel 5 with `ops` published to "dlx" with key "k" at `now`.
fn published(ops: impl IntoIterator<Item = OpId>, now: Instant) -> Publisher {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    for op in ops {
        p.publish(op, &message("dlx", "k"), now).unwrap();
    }
    p
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
    let now = Instant::now();
    let mut p = published(10..13, now);
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
fn a_multiple_ack_settles_what_is_left_below_it_across_single_acks() {
    let now = Instant::now();
    let mut p = published(1..=5, now);
    let step = p.on_frame(&ack(5, 3, false));
    assert_eq!(
        step.settled.iter().map(|s| s.op).collect::<Vec<_>>(),
        vec![3]
    );
    let step = p.on_frame(&ack(5, 4, true));
    assert_eq!(
        step.settled.iter().map(|s| s.op).collect::<Vec<_>>(),
        vec![1, 2, 4],
        "in publish order, without the one already settled"
    );
    assert_eq!(p.unconfirmed(), 1);
    let step = p.on_frame(&ack(5, 9, true));
    assert_eq!(
        step.settled.iter().map(|s| s.op).collect::<Vec<_>>(),
        vec![5]
    );
    assert_eq!(p.unconfirmed(), 0);
}

#[test]
fn returns_mark_the_matching_publish_unroutable() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("dlx", "a"), now).unwrap();
    p.publish(2, &message("dlx", "b"), now).unwrap();
    return_of(&mut p, "b", &[0, 0], b"body");
    assert_second_of_two_returned(&mut p);
}

/// Acks publishes 1 and 2 at once: 1 confirmed, 2 returned before.
fn assert_second_of_two_returned(p: &mut Publisher) {
    let step = p.on_frame(&ack(5, 2, true));
    let outcomes: Vec<(OpId, Outcome)> = step
        .settled
        .into_iter()
        .map(|s| (s.op, s.outcome))
        .collect();
    assert_eq!(
        outcomes,
        vec![(1, Outcome::Confirmed), (2, Outcome::Unroutable)]
    );
}

/// Returns `properties` and `body` as the upstream's basic.return of ("dlx", `key`).
fn return_of(p: &mut Publisher, key: &str, properties: &[u8], body: &[u8]) {
    p.on_frame(&frame(method_frame(
        5,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: ShortString::from("dlx"),
            routing_key: ShortString::from(key),
        })),
    )));
    let mut content = BytesMut::new();
    // Small frames: the body comes back in several.
    put_content(&mut content, 5, properties, body, 16);
    let mut codec = WireCodec::new(4096);
    while let Some(f) = codec.decode(&mut content).unwrap() {
        p.on_frame(&f);
    }
}

/// Two publishes with the same exchange, key and body size: the older one routable (still
/// waiting for its confirm), the newer one returned. The return goes to the publish with its
/// content, `BCC` aside (the broker strips it), not to the older one.
#[test]
fn a_return_marks_the_publish_with_its_content() {
    use crate::amqp::content::encode_properties;
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    let with_headers = |entries: &[(&str, &str)]| {
        let mut headers = FieldTable::default();
        for (k, v) in entries {
            headers.insert(
                ShortString::from(*k),
                amq_protocol::types::AMQPValue::LongString((*v).into()),
            );
        }
        encode_properties(&amq_protocol::protocol::BasicProperties::default().with_headers(headers))
    };
    let older = OutgoingMessage {
        raw_properties: with_headers(&[("x-first-death-queue", "q1")]),
        body: Bytes::from_static(b"the same size, one"),
        ..message("dlx", "k")
    };
    let newer = OutgoingMessage {
        raw_properties: with_headers(&[("x-first-death-queue", "q2"), ("BCC", "x")]),
        body: Bytes::from_static(b"the same size, two"),
        ..message("dlx", "k")
    };
    p.publish(1, &older, now).unwrap();
    p.publish(2, &newer, now).unwrap();
    return_of(
        &mut p,
        "k",
        &with_headers(&[("x-first-death-queue", "q2")]),
        b"the same size, two",
    );
    assert_second_of_two_returned(&mut p);
}

/// A return of a body no unconfirmed publish has (its own publish timed out and is gone)
/// marks none of them, even one with the same exchange, key and body size.
#[test]
fn a_return_of_no_unconfirmed_publish_marks_none() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    p.publish(1, &message("dlx", "k"), Instant::now()).unwrap();
    return_of(&mut p, "k", &[0, 0], b"xxxx");
    let step = p.on_frame(&ack(5, 1, false));
    assert_eq!(
        step.settled,
        vec![Settled {
            op: 1,
            outcome: Outcome::Confirmed
        }]
    );
}

/// A dead letter whose properties fit one frame only without the proxy's mark goes out
/// without it; one too large even then is refused.
#[test]
fn the_dead_letter_mark_gives_way_to_the_frame_size() {
    use crate::amqp::content::encode_properties;
    use crate::proxy::bcc::PRIVATE_HOP_HEADER;
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(PRIVATE_HOP_HEADER),
        amq_protocol::types::AMQPValue::Boolean(true),
    );
    let marked = OutgoingMessage {
        raw_properties: encode_properties(
            &amq_protocol::protocol::BasicProperties::default().with_headers(headers),
        ),
        ..message("dlx", "k")
    };
    let frame_max = 12 + marked.raw_properties.len() + 8 - 1;
    let mut p = Publisher::new(5, frame_max, Duration::from_secs(5));
    let bytes = p.publish(1, &marked, Instant::now()).expect("published");
    let mut buf = BytesMut::from(&bytes[..]);
    let mut codec = WireCodec::new(1 << 20);
    let header = std::iter::from_fn(|| codec.decode(&mut buf).unwrap())
        .find(|f| f.kind == crate::amqp::codec::FRAME_HEADER)
        .expect("a content header");
    let props = crate::amqp::content::decode_properties(&header.payload()[12..]).unwrap();
    assert!(
        !props
            .headers()
            .as_ref()
            .is_some_and(|h| h.inner().contains_key(PRIVATE_HOP_HEADER))
    );
    let mut tiny = Publisher::new(5, 20, Duration::from_secs(5));
    assert_eq!(
        tiny.publish(2, &marked, Instant::now()),
        Err(PROPERTIES_TOO_LARGE)
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
    assert!(p.expire(now).settled.is_empty());
    let expired = p.expire(now + Duration::from_secs(5));
    assert_eq!(expired.settled[0].outcome, Outcome::TimedOut);
    assert!(p.on_frame(&ack(5, 1, false)).settled.is_empty());
    assert_eq!(p.next_deadline(), None);
}

#[test]
fn postponed_deadlines_move_by_the_pause() {
    let now = Instant::now();
    let mut p = published([1, 2], now);
    p.postpone(Duration::from_secs(3));
    assert_eq!(p.next_deadline(), Some(now + Duration::from_secs(8)));
    assert!(p.expire(now + Duration::from_secs(5)).settled.is_empty());
    // A confirm read after the pause settles its publish as usual.
    assert_eq!(
        p.on_frame(&ack(5, 1, false)).settled[0].outcome,
        Outcome::Confirmed
    );
    let expired = p.expire(now + Duration::from_secs(8));
    assert_eq!(expired.settled.len(), 1);
    assert_eq!(expired.settled[0].outcome, Outcome::TimedOut);
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
fn properties_that_do_not_fit_one_frame_are_refused_before_anything_is_sent() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let mut m = message("dlx", "a");
    // Header frame: 7 + 12 + properties + 1 bytes, at most frame_max.
    m.raw_properties = Bytes::from(vec![0u8; 4096 - 20]);
    let bytes = p.publish(1, &m, Instant::now()).unwrap();
    let mut buf = BytesMut::from(&bytes[..]);
    let mut codec = WireCodec::new(4096);
    assert_eq!(
        std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).count(),
        3
    );
    m.raw_properties = Bytes::from(vec![0u8; 4096 - 19]);
    assert_eq!(p.publish(2, &m, Instant::now()), Err(PROPERTIES_TOO_LARGE));
    assert_eq!(p.unconfirmed(), 1, "nothing recorded for the refused one");
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

fn nack(ch: u16, tag: u64) -> WireFrame {
    frame(method_frame(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue: false,
        })),
    ))
}

/// The methods in `bytes`, in order, with their channel.
fn methods(bytes: &Bytes) -> Vec<(u16, AMQPClass)> {
    let mut buf = BytesMut::from(&bytes[..]);
    let mut codec = WireCodec::new(1 << 20);
    let mut out = Vec::new();
    while let Some(f) = codec.decode(&mut buf).unwrap() {
        if f.kind == FRAME_METHOD {
            out.push((f.channel, decode_method(f.payload()).unwrap()));
        }
    }
    out
}

/// The upstream closes the channel with 541.
fn internal_error_close(ch: u16) -> WireFrame {
    frame(method_frame(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 541,
            reply_text: "INTERNAL_ERROR".into(),
            class_id: 0,
            method_id: 0,
        })),
    ))
}

fn close_ok(ch: u16) -> WireFrame {
    frame(method_frame(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ))
}

#[test]
fn a_channel_that_only_nacks_is_closed_once_drained_and_reopened_with_what_waited() {
    let now = Instant::now();
    let mut p = published(1..=4, now);
    // Two nacks, an ack (the run starts again), then three nacks in a row.
    assert!(p.on_frame(&nack(5, 1)).write.is_none());
    assert!(p.on_frame(&nack(5, 2)).write.is_none());
    p.on_frame(&ack(5, 3, false));
    assert!(p.on_frame(&nack(5, 4)).write.is_none());
    p.publish(5, &message("dlx", "k"), now).unwrap();
    p.publish(6, &message("dlx", "k"), now).unwrap();
    p.on_frame(&nack(5, 5));
    let step = p.on_frame(&nack(5, 6));
    // Recycling: the third nack in a row, and nothing else in flight: the channel is closed.
    assert_eq!(step.settled[0].outcome, Outcome::Failed(NACKED));
    assert_eq!(step.reopened, Some(REOPEN_NACKS));
    let sent = methods(&step.write.unwrap());
    assert!(matches!(
        &sent[..],
        [(5, AMQPClass::Channel(channel::AMQPMethod::Close(c)))] if c.reply_code == 200
    ));
    // Publishes asked for while closing wait, and count as unconfirmed.
    assert!(p.publish(7, &message("dlx", "a"), now).unwrap().is_empty());
    assert!(p.publish(8, &message("dlx", "b"), now).unwrap().is_empty());
    assert_eq!(p.unconfirmed(), 2);
    // close-ok: open, confirm.select, then the two publishes numbered from 1 again.
    let step = p.on_frame(&close_ok(5));
    assert_eq!(step.reopened, None, "counted once, when the close was sent");
    let sent = methods(&step.write.unwrap());
    assert!(matches!(
        sent[0].1,
        AMQPClass::Channel(channel::AMQPMethod::Open(_))
    ));
    assert!(matches!(
        sent[1].1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(_))
    ));
    let keys: Vec<String> = sent[2..]
        .iter()
        .map(|(_, m)| match m {
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => p.routing_key.to_string(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(keys, ["a", "b"]);
    let step = p.on_frame(&ack(5, 2, true));
    let settled: Vec<_> = step
        .settled
        .iter()
        .map(|s| (s.op, s.outcome.clone()))
        .collect();
    assert_eq!(settled, [(7, Outcome::Confirmed), (8, Outcome::Confirmed)]);
    assert_eq!(p.unconfirmed(), 0);
}

#[test]
fn a_recycling_channel_waits_for_publishes_in_flight_and_sends_nothing_new() {
    let now = Instant::now();
    let mut p = published(1..=4, now);
    for tag in 1..=3 {
        assert!(
            p.on_frame(&nack(5, tag)).write.is_none(),
            "4 is still in flight"
        );
    }
    // New publishes wait; the one in flight is not failed by the recycle.
    assert!(p.publish(9, &message("dlx", "k"), now).unwrap().is_empty());
    assert_eq!(p.unconfirmed(), 2);
    // Its confirm times out: that drains the channel, and the timer closes it.
    assert_eq!(p.next_deadline(), Some(now + Duration::from_secs(5)));
    let step = p.expire(now + Duration::from_secs(5));
    let ops: Vec<_> = step
        .settled
        .iter()
        .map(|s| (s.op, s.outcome.clone()))
        .collect();
    assert_eq!(ops, [(4, Outcome::TimedOut), (9, Outcome::TimedOut)]);
    assert_eq!(step.reopened, Some(REOPEN_NACKS));
    assert!(matches!(
        &methods(&step.write.unwrap())[..],
        [(5, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
}

#[test]
fn a_close_from_the_upstream_while_recycling_is_answered_and_the_reopen_waits_for_close_ok() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    for op in 1..=3 {
        p.publish(op, &message("dlx", "k"), now).unwrap();
        p.on_frame(&nack(5, op));
    }
    p.publish(4, &message("dlx", "k"), now).unwrap();
    let step = p.on_frame(&internal_error_close(5));
    assert!(step.settled.is_empty());
    assert!(matches!(
        &methods(&step.write.unwrap())[..],
        [(5, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))]
    ));
    let step = p.on_frame(&close_ok(5));
    let sent = methods(&step.write.unwrap());
    assert_eq!(sent.len(), 3, "open, select, the waiting publish: {sent:?}");
}

#[test]
fn a_channel_closed_by_the_upstream_is_reopened_and_counted_as_closed() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    p.publish(1, &message("dlx", "k"), now).unwrap();
    let step = p.on_frame(&internal_error_close(5));
    assert_eq!(step.reopened, Some(REOPEN_CLOSED));
    assert_eq!(step.settled[0].outcome, Outcome::Failed("channel closed"));
    let sent = methods(&step.write.unwrap());
    assert!(matches!(
        sent[0].1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
    ));
    assert!(matches!(
        sent[1].1,
        AMQPClass::Channel(channel::AMQPMethod::Open(_))
    ));
}

#[test]
fn names_longer_than_a_short_string_are_refused_before_anything_is_sent() {
    let mut p = Publisher::new(5, 4096, Duration::from_secs(5));
    let now = Instant::now();
    let longest = "k".repeat(255);
    assert_eq!(
        p.publish(1, &message("dlx", &"k".repeat(256)), now),
        Err("routing key too long")
    );
    assert_eq!(
        p.publish(2, &message(&"x".repeat(256), "k"), now),
        Err("exchange name too long")
    );
    assert_eq!(p.unconfirmed(), 0);
    let sent = p.publish(3, &message("dlx", &longest), now).unwrap();
    let publish = frame(sent.slice(..));
    match decode_method(publish.payload()) {
        Some(AMQPClass::Basic(basic::AMQPMethod::Publish(publish))) => {
            assert_eq!(publish.routing_key.as_str(), longest);
            assert!(publish.mandatory);
        }
        other => panic!("expected basic.publish, got {other:?}"),
    }
    assert_eq!(p.unconfirmed(), 1);
}
