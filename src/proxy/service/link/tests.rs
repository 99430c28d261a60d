//! Unit tests of [`crate::proxy::service::link`].

use super::*;
use crate::amqp::content::{decode_properties, encode_properties, put_content};
use crate::proxy::declare::CaptureTag;
use crate::proxy::test_support::{frames, methods, shared};
use crate::proxy::wire::method_frame;
use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, channel, queue};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use std::time::Duration;

fn one(channel: u16, method: AMQPClass) -> WireFrame {
    frames(&method_frame(channel, method)).pop().unwrap()
}

/// A capture delivery of a message that expired in `queue`, tagged with its DLX and DLRK.
fn captured(tag: u64, queue: &str) -> Vec<WireFrame> {
    let routing_key = CaptureTag {
        dead_letter_exchange: Some("dlx".into()),
        dead_letter_routing_key: Some("dlq".into()),
        delivery_limit: None,
        retry_delays: None,
    }
    .encode()
    .unwrap();
    captured_with_key(tag, queue, &routing_key)
}

/// A capture delivery of a message that expired in `queue` (published with key `queue`),
/// routed into the capture exchange with `routing_key`.
fn captured_with_key(tag: u64, queue: &str, routing_key: &str) -> Vec<WireFrame> {
    let mut entry = FieldTable::default();
    entry.insert("count".into(), AMQPValue::LongLongInt(1));
    entry.insert("queue".into(), AMQPValue::LongString(queue.into()));
    entry.insert("reason".into(), AMQPValue::LongString("expired".into()));
    entry.insert("exchange".into(), AMQPValue::LongString("".into()));
    entry.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    entry.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
            LongString::from(queue),
        )])),
    );
    let mut headers = FieldTable::default();
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
    );
    let props = encode_properties(&BasicProperties::default().with_headers(headers));
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&method_frame(
        CAPTURE_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "dlx-proxy-capture".into(),
            delivery_tag: tag,
            redelivered: false,
            exchange: "cap".into(),
            routing_key: ShortString::try_new(routing_key).unwrap(),
        })),
    ));
    put_content(&mut wire, CAPTURE_CHANNEL, &props, b"body", 4096);
    frames(&wire)
}

fn feed(
    link: &mut CaptureLink,
    shared: &ProxyShared,
    wire: &[WireFrame],
    now: Instant,
) -> LinkStep {
    let mut all = LinkStep::default();
    for frame in wire {
        let step = link.on_frame(shared, frame, now);
        all.write.extend_from_slice(&step.write);
        all.declared |= step.declared;
        all.consuming |= step.consuming;
        all.lost = all.lost.or(step.lost);
    }
    all
}

fn counter(shared: &ProxyShared, outcome: &str) -> bool {
    shared.metrics.encode().contains(&format!(
        "dlx_proxy_captured_total{{outcome=\"{outcome}\",vhost=\"/\"}} 1"
    ))
}

#[test]
fn declares_a_quorum_queue_and_reports_readiness() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let setup = methods(&link.start_frames());
    let declare = setup.iter().find_map(|(_, m)| match m {
        AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => Some(d.clone()),
        _ => None,
    });
    let declare = declare.expect("queue.declare");
    assert!(declare.durable);
    assert_eq!(
        declare.arguments.inner().get("x-queue-type"),
        Some(&AMQPValue::LongString("quorum".into()))
    );
    assert!(
        setup
            .iter()
            .any(|(ch, m)| *ch == PUBLISHER_CHANNEL && matches!(m, AMQPClass::Confirm(_)))
    );
    let now = Instant::now();
    let step = link.on_frame(
        &shared,
        &one(
            CAPTURE_CHANNEL,
            AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
        ),
        now,
    );
    assert!(step.declared && !step.consuming);
    let step = link.on_frame(
        &shared,
        &one(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: "dlx-proxy-capture".into(),
            })),
        ),
        now,
    );
    assert!(step.consuming);
    assert!(link.is_consuming());
}

#[test]
fn an_untagged_capture_follows_what_this_instance_verified_only_while_it_is_fresh() {
    let shared = shared();
    shared
        .queues
        .record("/", "q", crate::proxy::test_support::with_dlx("old"));
    let mut link = CaptureLink::new(&shared, "/", 4096);
    // Fresh: the verified target.
    let now = Instant::now();
    let step = feed(&mut link, &shared, &captured_with_key(7, "q", "q"), now);
    let sent = methods(&step.write);
    assert!(
        matches!(
            sent.as_slice(),
            [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                if p.exchange.as_str() == "old"
        ),
        "{sent:?}"
    );
    // Past the maximum age (the queue may have been declared anew through another
    // instance): no longer trusted; without a policy there is no target, as in RabbitMQ.
    let later = now + Duration::from_secs(61);
    let step = feed(&mut link, &shared, &captured_with_key(8, "q", "q"), later);
    let sent = methods(&step.write);
    assert!(
        !sent
            .iter()
            .any(|(_, m)| matches!(m, AMQPClass::Basic(basic::AMQPMethod::Publish(_)))),
        "{sent:?}"
    );
}

#[test]
fn an_upstream_queues_own_dead_letter_routing_key_is_kept_under_a_policys_exchange() {
    let shared = shared();
    let policy = crate::config::PolicyConfig {
        name: "dlx".into(),
        pattern: "^legacy$".into(),
        definition: [(
            "dead-letter-exchange".to_string(),
            serde_json::Value::from("policy-dlx"),
        )]
        .into_iter()
        .collect(),
        ..crate::config::PolicyConfig::default()
    };
    shared.policies.write().unwrap().set(&policy).unwrap();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    // Captured with the queue's own x-dead-letter-routing-key, not its publish key.
    let wire = captured_with_key(7, "legacy", "legacy.dead");
    let step = feed(&mut link, &shared, &wire, Instant::now());
    let sent = methods(&step.write);
    assert!(
        matches!(
            sent.as_slice(),
            [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                if p.exchange.as_str() == "policy-dlx" && p.routing_key.as_str() == "legacy.dead"
        ),
        "{sent:?}"
    );
    // Captured with its publish key (no key of its own): that key, as before.
    let step = feed(
        &mut link,
        &shared,
        &captured_with_key(8, "legacy", "legacy"),
        Instant::now(),
    );
    let sent = methods(&step.write);
    assert!(
        matches!(
            sent.as_slice(),
            [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                if p.exchange.as_str() == "policy-dlx" && p.routing_key.as_str() == "legacy"
        ),
        "{sent:?}"
    );
}

#[test]
fn a_captured_message_is_acked_only_after_its_dead_letter_is_confirmed() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    let step = feed(&mut link, &shared, &captured(7, "q"), now);
    let sent = methods(&step.write);
    let [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(publish)))] =
        sent.as_slice()
    else {
        panic!("expected one publish on the publisher channel: {sent:?}");
    };
    assert_eq!(publish.exchange.as_str(), "dlx");
    assert_eq!(publish.routing_key.as_str(), "dlq");
    // The dead letter carries the x-death of the original queue, not of the capture hop.
    let header = frames(&step.write)
        .into_iter()
        .find(|f| f.kind == crate::amqp::codec::FRAME_HEADER)
        .unwrap();
    let props = decode_properties(&header.payload()[12..]).unwrap();
    let deaths = crate::deadletter::x_death_entries(&props);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].queue, "q");
    assert_eq!(deaths[0].reason, "expired");
    assert_eq!(link.unsettled(), 1);
    // Confirmed: the capture delivery is acked.
    let step = link.on_frame(
        &shared,
        &one(
            PUBLISHER_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: false,
            })),
        ),
        now,
    );
    assert_eq!(
        methods(&step.write),
        vec![(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 7,
                multiple: false
            }))
        )]
    );
    assert_eq!(link.unsettled(), 0);
    assert!(counter(&shared, CAPTURED_DEAD_LETTERED));
}

fn gauge(shared: &ProxyShared, line: &str) -> bool {
    shared.metrics.encode().lines().any(|l| l == line)
}

/// The upstream's basic.cancel of the capture consumer.
fn cancel() -> WireFrame {
    one(
        CAPTURE_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "dlx-proxy-capture".into(),
            nowait: true,
        })),
    )
}

fn confirm(kind: &str, delivery_tag: u64) -> WireFrame {
    let method = if kind == "ack" {
        basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple: false,
        })
    } else {
        basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag,
            multiple: false,
            requeue: false,
        })
    };
    one(PUBLISHER_CHANNEL, AMQPClass::Basic(method))
}

#[test]
fn a_nacked_dead_letter_is_held_and_published_again_after_the_backoff() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    feed(&mut link, &shared, &captured(3, "q"), now);
    // Refused twice: held each time, never given back to the capture queue (no nack,
    // no ack on the capture channel), retried after the doubling backoff.
    let mut at = now;
    for (seq, nominal_ms) in [(1u64, 100u64), (2, 200)] {
        let step = link.on_frame(&shared, &confirm("nack", seq), at);
        assert!(
            step.write.is_empty(),
            "nothing settled: {:?}",
            methods(&step.write)
        );
        assert_eq!(link.held(), 1);
        assert!(gauge(&shared, "dlx_proxy_dead_letters_held 1"));
        let due = link.next_deadline().unwrap();
        let wait = due - at;
        assert!(
            wait >= Duration::from_millis(nominal_ms / 2)
                && wait <= Duration::from_millis(nominal_ms),
            "{wait:?}"
        );
        assert!(link.on_timer(&shared, at).write.is_empty());
        let step = link.on_timer(&shared, due);
        let sent = methods(&step.write);
        assert!(
            matches!(
                sent.as_slice(),
                [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
                    if p.exchange.as_str() == "dlx"
            ),
            "{sent:?}"
        );
        assert_eq!(link.held(), 0);
        at = due;
    }
    assert!(gauge(
        &shared,
        "dlx_proxy_dead_letter_retries_total{reason=\"nacked\"} 2"
    ));
    // The third publish is confirmed: the capture delivery is acked, nothing held.
    let step = link.on_frame(&shared, &confirm("ack", 3), at);
    assert_eq!(
        methods(&step.write),
        vec![(
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 3,
                multiple: false
            }))
        )]
    );
    assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
    assert_eq!(link.unsettled(), 0);
    assert!(counter(&shared, CAPTURED_DEAD_LETTERED));
}

fn basic_ack(delivery_tag: u64, multiple: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
        delivery_tag,
        multiple,
    }))
}

#[test]
fn confirmed_runs_are_acked_with_one_multiple_ack_and_a_held_one_waits() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    for tag in 1..=4 {
        feed(&mut link, &shared, &captured(tag, "q"), now);
    }
    assert!(gauge(&shared, "dlx_proxy_capture_unacked{vhost=\"/\"} 4"));
    // Publishes 1..3 confirmed at once: one ack covers capture deliveries 1..3.
    let step = link.on_frame(&shared, &one(PUBLISHER_CHANNEL, basic_ack(3, true)), now);
    assert_eq!(
        methods(&step.write),
        vec![(CAPTURE_CHANNEL, basic_ack(3, true))]
    );
    assert!(gauge(&shared, "dlx_proxy_capture_unacked{vhost=\"/\"} 1"));
    // Two more: the first one's publish is refused (held), the second confirmed; its ack
    // waits behind the held one.
    feed(&mut link, &shared, &captured(5, "q"), now);
    link.on_frame(&shared, &confirm("nack", 4), now);
    let step = link.on_frame(&shared, &confirm("ack", 5), now);
    assert!(step.write.is_empty(), "{:?}", methods(&step.write));
    assert_eq!(link.held(), 1);
    // Shutdown: the consumer is cancelled and the waiting one acked on its own; the held
    // one stays unacked (the upstream requeues it with the connection).
    let out = link.stop(&shared).expect("cancel");
    let sent = methods(&out);
    assert!(matches!(
        sent[0],
        (
            CAPTURE_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(_))
        )
    ));
    assert_eq!(sent[1..], [(CAPTURE_CHANNEL, basic_ack(5, false))]);
}

#[test]
fn a_held_dead_letter_is_let_go_with_its_consumer() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    feed(&mut link, &shared, &captured(3, "q"), now);
    link.on_frame(&shared, &confirm("nack", 1), now);
    assert_eq!(link.held(), 1);
    // The upstream cancels the consumer: the delivery went back to the capture queue, so
    // the retry is not published.
    let lost = link.on_frame(&shared, &cancel(), now);
    assert!(lost.lost.is_some());
    let later = now + Duration::from_secs(60);
    assert!(link.on_timer(&shared, later).write.is_empty());
    assert_eq!(link.held(), 0);
    assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
    // And what a connection holds when it ends is let go too.
    let mut link = CaptureLink::new(&shared, "/", 4096);
    feed(&mut link, &shared, &captured(4, "q"), now);
    link.on_frame(&shared, &confirm("nack", 1), now);
    assert!(gauge(&shared, "dlx_proxy_dead_letters_held 1"));
    link.end(&shared);
    assert_eq!(link.held(), 0);
    assert!(gauge(&shared, "dlx_proxy_dead_letters_held 0"));
}

#[test]
fn a_sessions_dead_letter_is_published_and_its_outcome_sent_back() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    let (reply, mut outcomes) = mpsc::unbounded_channel();
    let message = OutgoingMessage {
        exchange: "dlx".into(),
        routing_key: "k".into(),
        raw_properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from_static(b"x"),
    };
    let request = |op| PublishRequest {
        op,
        message: message.clone(),
        delay_ms: None,
        reply: reply.clone(),
    };
    let sent = methods(&link.publish_for(request(41), now).unwrap());
    assert!(matches!(
        sent.as_slice(),
        [(PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p)))]
            if p.exchange.as_str() == "dlx"
    ));
    assert!(!link.is_drained(), "a forwarded publish is waited for");
    link.publish_for(request(42), now).unwrap();
    // Confirmed: the session hears it; nothing is acked on the capture channel.
    let step = link.on_frame(&shared, &confirm("ack", 1), now);
    assert!(step.write.is_empty());
    assert_eq!(outcomes.try_recv().unwrap(), (41, Outcome::Confirmed));
    // The connection ends: the other one fails back to its session, to be retried.
    link.end(&shared);
    assert_eq!(
        outcomes.try_recv().unwrap(),
        (42, Outcome::Failed(FORWARD_LOST))
    );
    assert_eq!(link.unsettled(), 0);
}

#[test]
fn losing_the_consumer_is_reported() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    let step = link.on_frame(&shared, &cancel(), now);
    assert_eq!(
        step.lost.as_deref(),
        Some("capture consumer cancelled by the upstream")
    );
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let step = link.on_frame(
        &shared,
        &one(
            CAPTURE_CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 406,
                reply_text: "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'".into(),
                class_id: 50,
                method_id: 10,
            })),
        ),
        now,
    );
    assert!(step.lost.unwrap().contains("406 PRECONDITION_FAILED"));
    // The close is answered.
    assert!(matches!(
        methods(&step.write)[0].1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
    ));
}

#[test]
fn a_message_without_a_death_record_is_dropped_and_counted() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&method_frame(
        CAPTURE_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "dlx-proxy-capture".into(),
            delivery_tag: 1,
            redelivered: false,
            exchange: "cap".into(),
            routing_key: "".into(),
        })),
    ));
    put_content(&mut wire, CAPTURE_CHANNEL, &[0, 0], b"x", 4096);
    let step = feed(&mut link, &shared, &frames(&wire), Instant::now());
    assert!(matches!(
        methods(&step.write)[0].1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(_))
    ));
    assert!(counter(&shared, CAPTURED_DROPPED));
}

#[test]
fn a_message_for_a_delay_queue_declares_it_once_per_connection_first() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 131_072);
    let now = Instant::now();
    let (reply, _outcomes) = mpsc::unbounded_channel();
    let request = |op, delay_ms| PublishRequest {
        op,
        message: OutgoingMessage {
            exchange: String::new(),
            routing_key: "dlx-proxy.capture.retry.300".into(),
            raw_properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"x"),
        },
        delay_ms,
        reply: reply.clone(),
    };
    let sent = methods(&link.publish_for(request(1, Some(300)), now).unwrap());
    assert!(matches!(
        sent.as_slice(),
        [
            (PUBLISHER_CHANNEL, AMQPClass::Queue(queue::AMQPMethod::Declare(d))),
            (PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(_))),
        ] if d.queue.as_str() == "dlx-proxy.capture.retry.300" && d.nowait
    ));
    // Declared on this connection: the next message for that delay goes straight out.
    let sent = methods(&link.publish_for(request(2, Some(300)), now).unwrap());
    assert!(matches!(
        sent.as_slice(),
        [(
            PUBLISHER_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(_))
        )]
    ));
    // A message routed nowhere (the queue was deleted): the next one declares it again.
    link.forget_missing_delay_queue(Some(300), &Outcome::Unroutable);
    let sent = methods(&link.publish_for(request(3, Some(300)), now).unwrap());
    assert_eq!(sent.len(), 2);
}

#[test]
fn a_publisher_channel_that_only_nacks_is_recycled_and_the_held_dead_letter_lands_on_the_new_one() {
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let now = Instant::now();
    feed(&mut link, &shared, &captured(3, "q"), now);
    let mut at = now;
    let mut last = LinkStep::default();
    for seq in 1..=3u64 {
        last = link.on_frame(&shared, &confirm("nack", seq), at);
        at = link.next_deadline().unwrap();
        if seq < 3 {
            link.on_timer(&shared, at);
        }
    }
    // The third nack in a row, nothing else in flight: the channel is closed.
    assert!(matches!(
        methods(&last.write).as_slice(),
        [(
            PUBLISHER_CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Close(_))
        )]
    ));
    assert!(gauge(
        &shared,
        "dlx_proxy_publisher_channel_reopens_total{cause=\"nacks\"} 1"
    ));
    // The retry comes due while the channel closes: it waits for the new channel.
    assert!(link.on_timer(&shared, at).write.is_empty());
    assert_eq!(link.held(), 0);
    let step = link.on_frame(
        &shared,
        &one(
            PUBLISHER_CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        ),
        at,
    );
    let sent = methods(&step.write);
    assert!(
        matches!(
            sent.as_slice(),
            [
                (PUBLISHER_CHANNEL, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
                (PUBLISHER_CHANNEL, AMQPClass::Confirm(_)),
                (PUBLISHER_CHANNEL, AMQPClass::Basic(basic::AMQPMethod::Publish(p))),
            ] if p.exchange.as_str() == "dlx"
        ),
        "{sent:?}"
    );
    // Confirmed as publish 1 of the new channel: the capture delivery is acked.
    let step = link.on_frame(&shared, &confirm("ack", 1), at);
    assert_eq!(
        methods(&step.write),
        vec![(CAPTURE_CHANNEL, basic_ack(3, false))]
    );
}

#[test]
fn while_rabbitmq_blocks_the_connection_no_confirm_times_out() {
    // RabbitMQ reads nothing from a blocked connection (a resource alarm): a confirm deadline
    // passing then would publish the same dead letter again behind the first.
    let shared = shared();
    let mut link = CaptureLink::new(&shared, "/", 4096);
    let start = Instant::now();
    let (reply, mut outcomes) = mpsc::unbounded_channel();
    let request = PublishRequest {
        op: 7,
        message: OutgoingMessage {
            exchange: "dlx".into(),
            routing_key: "k".into(),
            raw_properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"x"),
        },
        delay_ms: None,
        reply,
    };
    link.publish_for(request, start).unwrap();
    let deadline = link.next_deadline().expect("a confirm deadline");
    let blocked_at = start + Duration::from_millis(100);
    link.blocked(&shared, blocked_at);
    assert!(gauge(
        &shared,
        r#"dlx_proxy_upstream_connections_blocked{connection="service"} 1"#
    ));
    assert_eq!(link.next_deadline(), None);
    let long_after = deadline + Duration::from_secs(600);
    let step = link.on_timer(&shared, long_after);
    assert!(step.write.is_empty(), "nothing published again");
    assert!(outcomes.try_recv().is_err(), "no timeout reported");
    // Unblocked: the deadline moved on by the time blocked.
    link.unblocked(&shared, long_after);
    assert!(gauge(
        &shared,
        r#"dlx_proxy_upstream_connections_blocked{connection="service"} 0"#
    ));
    assert_eq!(
        link.next_deadline(),
        Some(deadline + (long_after - blocked_at))
    );
    link.on_frame(&shared, &confirm("ack", 1), long_after);
    assert_eq!(outcomes.try_recv().unwrap(), (7, Outcome::Confirmed));
    // A connection that ends blocked leaves the gauge as it found it.
    link.blocked(&shared, long_after);
    link.blocked(&shared, long_after);
    assert!(gauge(
        &shared,
        r#"dlx_proxy_upstream_connections_blocked{connection="service"} 1"#
    ));
    link.end(&shared);
    assert!(gauge(
        &shared,
        r#"dlx_proxy_upstream_connections_blocked{connection="service"} 0"#
    ));
}
