//! Delivery limits (`x-delivery-limit`, policy `delivery-limit`, `dead_letter.default_delivery_limit`)
//! on classic queues (our extension) and quorum queues: `x-delivery-count` on redeliveries, reason
//! `delivery_limit` after limit + 1 deliveries, returns by nack, channel close, connection close
//! and recover all counting. After `quorum_queue_SUITE`'s subscribe_redelivery_limit cases, the
//! fifo_dlx `delivery_limit` case and the 3.10.8 probes E13 and E14.

use crate::common;

use common::dl::*;
use common::dl_policy;
use common::*;
use serde_json::json;

fn limited(limit: i32, quorum: bool, extra: &[(&str, AMQPValue)]) -> FieldTable {
    let mut args = vec![("x-delivery-limit", int(limit))];
    if quorum {
        args.push(("x-queue-type", ls("quorum")));
    }
    args.extend(extra.iter().cloned());
    table(&args)
}

fn delivery_count(d: &Delivery) -> Option<i64> {
    header(d, "x-delivery-count").map(|v| match v {
        AMQPValue::LongLongInt(n) => *n,
        other => panic!("x-delivery-count must be LongLongInt, got {other:?}"),
    })
}

async fn redelivery_limit(quorum: bool) {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_durable(&ch, "q", limited(1, quorum, &[])).await;
    publish(&ch, "q", &["m"]).await;
    let mut c = consumer(&ch, "q", "c").await;
    let d = next(&mut c).await;
    assert!(!d.redelivered);
    assert_eq!(delivery_count(&d), None, "absent on the first delivery");
    nack(&ch, d.delivery_tag, false, true).await;
    let d = next(&mut c).await;
    assert!(d.redelivered);
    assert_eq!(delivery_count(&d), Some(1));
    nack(&ch, d.delivery_tag, false, true).await;
    no_delivery(&mut c, 150).await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "delivery_limit"), 1);
}

/// subscribe_redelivery_limit (quorum): limit 1 → two deliveries, then dropped (no DLX).
#[tokio::test]
async fn subscribe_redelivery_limit() {
    redelivery_limit(true).await;
}

/// The same on a classic queue (our extension; RabbitMQ refuses the argument there).
#[tokio::test]
async fn subscribe_redelivery_limit_classic() {
    redelivery_limit(false).await;
}

/// subscribe_redelivery_limit_with_dead_letter: limit 1, DLX "" with a quorum DLQ.
#[tokio::test]
async fn subscribe_redelivery_limit_with_dead_letter() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_durable(&ch, "dlq", table(&[("x-queue-type", ls("quorum"))])).await;
    declare_durable(
        &ch,
        "q",
        limited(
            1,
            true,
            &[
                ("x-dead-letter-exchange", ls("")),
                ("x-dead-letter-routing-key", ls("dlq")),
            ],
        ),
    )
    .await;
    publish(&ch, "q", &["m"]).await;
    let mut c = consumer(&ch, "q", "c").await;
    for _ in 0..2 {
        let d = next(&mut c).await;
        nack(&ch, d.delivery_tag, false, true).await;
    }
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), ("q", "delivery_limit", 1));
    assert_eq!(deaths[0].routing_keys, ["q"]);
    assert_first_death(&d, "delivery_limit", "q", "");
    // basic.get from a quorum queue shows the DLQ's own count (0), not the source's.
    assert_eq!(delivery_count(&d), Some(0));
}

/// Classic queue, limit 2: three deliveries, then dead-lettered as `delivery_limit`; the
/// DLQ copy carries no x-delivery-count of the source.
#[tokio::test]
async fn classic_delivery_limit_dead_letters_after_limit_plus_one_deliveries() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(2))]).await;
    publish(&ch, "q", &["m"]).await;
    let mut c = consumer(&ch, "q", "c").await;
    let mut counts = Vec::new();
    for _ in 0..3 {
        let d = next(&mut c).await;
        counts.push(delivery_count(&d));
        nack(&ch, d.delivery_tag, false, true).await;
    }
    assert_eq!(counts, [None, Some(1), Some(2)]);
    no_delivery(&mut c, 100).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(d.exchange.as_str(), dlx);
    assert_eq!(d.routing_key.as_str(), "dlq");
    assert_eq!(delivery_count(&d), None, "the DLQ has no limit");
    let deaths = x_death(&d);
    assert_eq!(deaths[0].qrc(), ("q", "delivery_limit", 1));
    assert_first_death(&d, "delivery_limit", "q", "");
    assert_eq!(b.dead_lettered("q", "delivery_limit"), 1);
}

/// E13 (quorum): limit 0 / 1 / 2 with nack(requeue) → 1 / 2 / 3 deliveries; basic.get shows
/// x-delivery-count 0, 1, 2.
#[tokio::test]
async fn quorum_delivery_limit_deliveries_and_counts_via_get() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "dlq", FieldTable::default()).await;
    for limit in 0..=2 {
        let q = format!("q{limit}");
        declare_durable(
            &ch,
            &q,
            limited(
                limit,
                true,
                &[
                    ("x-dead-letter-exchange", ls("")),
                    ("x-dead-letter-routing-key", ls("dlq")),
                ],
            ),
        )
        .await;
        publish(&ch, &q, &["m"]).await;
        let mut seen = Vec::new();
        while let Some(d) = get(&ch, &q).await {
            seen.push(delivery_count(&d));
            nack(&ch, d.delivery_tag, false, true).await;
        }
        let expected: Vec<Option<i64>> = (0..=i64::from(limit)).map(Some).collect();
        assert_eq!(seen, expected, "limit {limit}");
        let d = get_one(&ch, "dlq").await;
        assert_eq!(x_death(&d)[0].qrc(), (q.as_str(), "delivery_limit", 1));
    }
}

/// fifo_dlx `delivery_limit`: limit 0, get without ack, close the channel → the return
/// exceeds the limit and the message is dead-lettered.
#[tokio::test]
async fn delivery_limit_counts_requeue_by_channel_close() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(0))]).await;
    publish(&ch, "q", &["m"]).await;
    let ch2 = c.create_channel().await.unwrap();
    get_one(&ch2, "q").await;
    b.wait_counts("q", 0, 1).await;
    ch2.close(200, "bye".into()).await.unwrap();
    b.wait_counts("dlq", 1, 0).await;
    b.wait_counts("q", 0, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(x_death(&d)[0].qrc(), ("q", "delivery_limit", 1));
    assert_eq!(b.dead_lettered("q", "delivery_limit"), 1);
}

/// A lost connection returns its deliveries and counts them too.
#[tokio::test]
async fn delivery_limit_counts_requeue_by_connection_close() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(1))]).await;
    publish(&ch, "q", &["m"]).await;
    for round in 1..=2 {
        let (c2, ch2) = b.channel().await;
        get_one(&ch2, "q").await;
        c2.close(200, "bye".into()).await.unwrap();
        if round == 1 {
            b.wait_counts("q", 1, 0).await;
        }
    }
    b.wait_counts("dlq", 1, 0).await;
    b.wait_counts("q", 0, 0).await;
}

/// basic.recover returns deliveries and counts them.
#[tokio::test]
async fn delivery_limit_counts_requeue_by_recover() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(0))]).await;
    publish(&ch, "q", &["m"]).await;
    get_one(&ch, "q").await;
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    b.wait_counts("dlq", 1, 0).await;
}

/// Rejecting without requeue is `rejected`, never `delivery_limit`.
#[tokio::test]
async fn reject_without_requeue_is_not_a_delivery_limit_death() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(0))]).await;
    publish(&ch, "q", &["m"]).await;
    get_and_reject(&ch, "q", "m").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(x_death(&d)[0].reason, "rejected");
}

/// `dead_letter.default_delivery_limit` applies to queues without a limit of their own; an
/// argument or policy that is lower wins.
#[tokio::test]
async fn default_delivery_limit_applies_to_every_queue() {
    let mut cfg = test_config();
    cfg.dead_letter.default_delivery_limit = 2;
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    declare(
        &ch,
        "q1",
        table(&[
            ("x-delivery-limit", int(0)),
            ("x-dead-letter-exchange", ls("q_dlx_exchange")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    for (q, deliveries) in [("q", 3), ("q1", 1)] {
        publish(&ch, q, &["m"]).await;
        let mut n = 0;
        while let Some(d) = get(&ch, q).await {
            n += 1;
            nack(&ch, d.delivery_tag, false, true).await;
        }
        assert_eq!(n, deliveries, "{q}");
        let d = get_one(&ch, "dlq").await;
        assert_eq!(x_death(&d)[0].qrc(), (q, "delivery_limit", 1));
    }
}

/// Policy `delivery-limit` on a queue declared without one; min(argument, policy) otherwise.
#[tokio::test]
async fn delivery_limit_from_policy() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-delivery-limit", int(5))]).await;
    b.set_policy(dl_policy::exact("limit", "q", json!({"delivery-limit": 1})));
    publish(&ch, "q", &["m"]).await;
    let mut n = 0;
    while let Some(d) = get(&ch, "q").await {
        n += 1;
        nack(&ch, d.delivery_tag, false, true).await;
    }
    assert_eq!(n, 2);
    b.wait_counts("dlq", 1, 0).await;
}

/// A classic queue without a limit counts nothing: no x-delivery-count, requeues forever.
#[tokio::test]
async fn no_limit_no_delivery_count() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["m"]).await;
    for _ in 0..25 {
        let d = get_one(&ch, "q").await;
        assert_eq!(delivery_count(&d), None);
        nack(&ch, d.delivery_tag, false, true).await;
    }
    consume_empty(&ch, "dlq").await;
}

/// E14: requeue goes back to the original position: classic → A, B; quorum with a delivery
/// limit → A, B. (3.10.8 puts a quorum queue's requeue at the tail when it has no limit; we
/// keep the position there too.)
#[tokio::test]
async fn requeue_position() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "classic", FieldTable::default()).await;
    declare_durable(&ch, "quorum-limited", limited(50, true, &[])).await;
    declare_durable(&ch, "quorum", table(&[("x-queue-type", ls("quorum"))])).await;
    for q in ["classic", "quorum-limited", "quorum"] {
        publish(&ch, q, &["A", "B"]).await;
        let t = consume(&ch, q, &["A"]).await[0];
        nack(&ch, t, false, true).await;
        consume(&ch, q, &["A", "B"]).await;
    }
}
