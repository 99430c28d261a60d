//! Dead-lettering on expiry: queue TTL (`x-message-ttl`) and per-message TTL (`expiration`),
//! after RabbitMQ's cases T1–T4 (reference §1.3), the per-message TTL semantics (head-only
//! expiry, the lower of the two TTLs, TTL 0) and `quorum_queue_SUITE`'s TTL cases, on classic
//! queues unless the case is about quorum queues.

use crate::common;

use std::time::{Duration, Instant};

use common::dl::*;
use common::*;

fn expiring(ms: &str) -> BasicProperties {
    BasicProperties::default().with_expiration(ms.into())
}

/// T1: queue TTL 1 ms dead-letters the message.
#[tokio::test]
async fn dead_letter_ttl() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(1))]).await;
    publish(&ch, "q", &["p1"]).await;
    b.wait_counts("dlq", 1, 0).await;
    consume_empty(&ch, "q").await;
    consume(&ch, "dlq", &["p1"]).await;
    assert_eq!(b.dead_lettered("q", "expired"), 1);
}

/// T2: reason `expired`, one entry, no `original-expiration` for a queue TTL.
#[tokio::test]
async fn dead_letter_headers_reason_expired() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(1))]).await;
    publish(&ch, "q", &["p1"]).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), ("q", "expired", 1));
    assert_eq!(deaths[0].exchange, "");
    assert_eq!(deaths[0].routing_keys, ["q"]);
    assert_eq!(deaths[0].original_expiration, None);
    assert_first_death(&d, "expired", "q", "");
    assert_eq!(d.exchange.as_str(), dlx);
    assert_eq!(d.routing_key.as_str(), "dlq");
    assert_eq!(d.properties.expiration(), &None);
}

/// T3: per-message TTL: `original-expiration` = the property (longstr), `expiration` removed.
#[tokio::test]
async fn dead_letter_headers_reason_expired_per_message() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish_to(&ch, "", "q", b"p1", expiring("1")).await;
    publish(&ch, "q", &["msg2"]).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p1");
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].reason, "expired");
    assert_eq!(deaths[0].original_expiration.as_deref(), Some("1"));
    assert_eq!(d.properties.expiration(), &None);
    // msg2 has no TTL and stays.
    consume(&ch, "q", &["msg2"]).await;
}

/// T4: a TTL self-loop through the default exchange drops both messages as cycles.
#[tokio::test]
async fn dead_letter_routing_key_cycle_ttl() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[("x-message-ttl", int(1))])).await;
    publish(&ch, "q", &["p1", "p2"]).await;
    b.wait_counts("q", 0, 0).await;
    consume_empty(&ch, "q").await;
    b.wait_dead_lettered("q", "expired", 2).await;
    assert_eq!(b.dropped("q", "cycle"), 2);
}

/// Expiry is computed at enqueue from the lower of queue TTL and per-message TTL.
#[tokio::test]
async fn per_message_ttl_lower_of_queue_and_message_ttl() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    // Queue TTL 10 s, message TTL 30 ms: the message's wins.
    declare_dead_letter_queues(&ch, "q1", "dlq", &[("x-message-ttl", int(10_000))]).await;
    let t0 = Instant::now();
    publish_to(&ch, "", "q1", b"short-msg", expiring("30")).await;
    b.wait_counts("dlq", 1, 0).await;
    assert!(t0.elapsed() < Duration::from_secs(3));
    let d = get_one(&ch, "dlq").await;
    assert_eq!(x_death(&d)[0].original_expiration.as_deref(), Some("30"));
    // Queue TTL 30 ms, message TTL 10 s: the queue's wins; original-expiration still records
    // the property.
    declare(
        &ch,
        "q2",
        table(&[
            ("x-message-ttl", int(30)),
            ("x-dead-letter-exchange", ls("q1_dlx_exchange")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    let t0 = Instant::now();
    publish_to(&ch, "", "q2", b"short-queue", expiring("10000")).await;
    b.wait_counts("dlq", 1, 1).await;
    assert!(t0.elapsed() < Duration::from_secs(3));
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "short-queue");
    let deaths = x_death(&d);
    assert_eq!(deaths[0].qrc(), ("q2", "expired", 1));
    assert_eq!(deaths[0].original_expiration.as_deref(), Some("10000"));
}

/// Only the head expires: a 10 ms message behind a 100 s one stays queued.
#[tokio::test]
async fn per_message_ttl_only_head_expires() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish_to(&ch, "", "q", b"long", expiring("100000")).await;
    publish_to(&ch, "", "q", b"short", expiring("10")).await;
    b.stays_counts("q", 2, 0, 150).await;
    b.wait_counts("dlq", 0, 0).await;
    // Once the head is gone, the expired message behind it dies at the next look.
    let t = consume(&ch, "q", &["long"]).await[0];
    ack(&ch, t, false).await;
    b.wait_counts("dlq", 1, 0).await;
    consume(&ch, "dlq", &["short"]).await;
}

/// per_message_ttl_mixed_expiry: m1 without TTL, m2 with 100 ms; after 200 ms a consumer gets
/// m1 and never m2.
#[tokio::test]
async fn per_message_ttl_mixed_expiry() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["m1"]).await;
    publish_to(&ch, "", "q", b"m2", expiring("100")).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut c = consumer(&ch, "q", "c").await;
    let d = next(&mut c).await;
    assert_eq!(payload(&d), "m1");
    ack(&ch, d.delivery_tag, false).await;
    no_delivery(&mut c, 200).await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "expired"), 1);
}

/// per_message_ttl_expiration_too_high: above ten years → channel error 406 with RabbitMQ's
/// text.
#[tokio::test]
async fn per_message_ttl_expiration_too_high() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    declare(&ch, "q", FieldTable::default()).await;
    let err = publish_refused(&ch, "", "q", expiring("315360000001")).await;
    assert_eq!(amqp_code(&err), Some(406));
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - invalid expiration '315360000001': {value_too_big,315360000001}"
    );
    // Ten years exactly is accepted.
    let (_c2, ch2) = b.channel().await;
    publish_to(&ch2, "", "q", b"ok", expiring("315360000000")).await;
    b.wait_counts("q", 1, 0).await;
}

/// `x-message-ttl = 0` with a DLX dead-letters at once when no consumer can take the message.
#[tokio::test]
async fn ttl_zero_dead_letters_immediately_without_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(0))]).await;
    publish(&ch, "q", &["p"]).await;
    // Synchronously: the next method on the connection already sees it in the DLQ.
    consume(&ch, "dlq", &["p"]).await;
    assert_eq!(b.queue_counts("q"), Some((0, 0)));
}

/// TTL 0 and a consumer waiting: the message is delivered, not expired.
#[tokio::test]
async fn ttl_zero_delivered_to_waiting_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(0))]).await;
    let mut c = consumer(&ch, "q", "c").await;
    let (_c2, ch2) = b.channel().await;
    publish(&ch2, "q", &["p"]).await;
    let d = next(&mut c).await;
    assert_eq!(payload(&d), "p");
    assert!(header(&d, "x-death").is_none());
    ack(&ch, d.delivery_tag, false).await;
    b.wait_counts("dlq", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "expired"), 0);
}

/// TTL 0 without a DLX: discarded on arrival, counted as expired, no drop cause.
#[tokio::test]
async fn ttl_zero_without_dlx_discards() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", table(&[("x-message-ttl", int(0))])).await;
    publish(&ch, "q", &["p"]).await;
    consume_empty(&ch, "q").await;
    assert_eq!(b.dead_lettered("q", "expired"), 1);
    assert_eq!(b.dropped("q", "no_dlx"), 0);
}

/// A queue nobody touches still expires its head on time: the broker's timer does it (the
/// DLQ's consumer receives it pushed, with no method sent on the source queue).
#[tokio::test]
async fn expiry_without_consumers_runs_on_a_timer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(50))]).await;
    let mut c = consumer(&ch, "dlq", "c").await;
    let t0 = Instant::now();
    publish(&ch, "q", &["a", "b"]).await;
    let d1 = next(&mut c).await;
    let d2 = next(&mut c).await;
    let waited = t0.elapsed();
    assert_eq!((payload(&d1), payload(&d2)), ("a".into(), "b".into()));
    assert!(waited >= Duration::from_millis(45), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    // A per-message TTL at the head is timed the same way.
    publish_to(&ch, "", "q", b"c", expiring("20")).await;
    assert_eq!(payload(&next(&mut c).await), "c");
}

/// A message whose TTL ran out while unacked dies as `expired` when it is requeued.
#[tokio::test]
async fn expired_while_unacked_dies_on_requeue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(50))]).await;
    publish(&ch, "q", &["p"]).await;
    let t = consume(&ch, "q", &["p"]).await[0];
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.wait_counts("dlq", 0, 0).await;
    nack(&ch, t, false, true).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(x_death(&d)[0].qrc(), ("q", "expired", 1));
    b.wait_counts("q", 0, 0).await;
}

/// The dead-lettered copy has no `expiration`, so it never expires again in the DLQ (#18).
#[tokio::test]
async fn dead_lettered_copy_does_not_expire_again() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish_to(&ch, "", "q", b"p", expiring("10")).await;
    b.wait_counts("dlq", 1, 0).await;
    b.stays_counts("dlq", 1, 0, 100).await;
}

/// Expired messages leave in head order, with each entry's own original-expiration.
#[tokio::test]
async fn expiry_order_is_head_order() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(30))]).await;
    for (body, exp) in [("a", Some("20")), ("b", None), ("c", Some("25"))] {
        let props = match exp {
            Some(e) => expiring(e),
            None => BasicProperties::default(),
        };
        publish_to(&ch, "", "q", body.as_bytes(), props).await;
    }
    b.wait_counts("dlq", 3, 0).await;
    let mut exps = Vec::new();
    for p in ["a", "b", "c"] {
        let d = get_one(&ch, "dlq").await;
        assert_eq!(payload(&d), p);
        exps.push(x_death(&d)[0].original_expiration.clone());
    }
    assert_eq!(exps, [Some("20".into()), None, Some("25".into())]);
}

/// What the publisher sees for a message that expires at once: a mandatory publish was routed,
/// so it is acked and never returned; the DLQ gets it.
#[tokio::test]
async fn mandatory_publish_to_expiring_queue_is_acked_without_return() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(0))]).await;
    let c = ch
        .basic_publish(
            "".into(),
            "q".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"m",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    consume(&ch, "dlq", &["m"]).await;
}

/// Each queue computes its own expiry: a fanout copy expires in the queue with a TTL and
/// stays in the one without.
#[tokio::test]
async fn ttl_is_per_queue_for_a_routed_copy() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "fan", ExchangeKind::Fanout).await;
    declare_dead_letter_queues(&ch, "short", "dlq", &[("x-message-ttl", int(20))]).await;
    declare(&ch, "keep", FieldTable::default()).await;
    bind(&ch, "short", "fan", "").await;
    bind(&ch, "keep", "fan", "").await;
    publish_to(&ch, "fan", "", b"m", BasicProperties::default()).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let deaths = x_death(&d);
    assert_eq!(deaths[0].qrc(), ("short", "expired", 1));
    assert_eq!(deaths[0].exchange, "fan");
    assert_eq!(deaths[0].routing_keys, [""]);
    b.wait_counts("keep", 1, 0).await;
}

/// A consumer blocked by its prefetch does not stop the head from expiring on time.
#[tokio::test]
async fn expiry_with_a_blocked_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(50))]).await;
    ch.basic_qos(1, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut c = consumer(&ch, "q", "c").await;
    let (_c2, ch2) = b.channel().await;
    publish(&ch2, "q", &["held", "expires"]).await;
    assert_eq!(payload(&next(&mut c).await), "held");
    b.wait_counts("dlq", 1, 0).await;
    consume(&ch2, "dlq", &["expires"]).await;
    no_delivery(&mut c, 50).await;
}
