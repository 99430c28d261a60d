//! Dead-lettering by rejection (basic.reject / basic.nack with requeue=false), after RabbitMQ's
//! `dead_lettering_SUITE` cases R1–R10 (reference §1.2), on classic queues, plus what the DLQ's
//! consumer receives (exchange, routing key, order) and the `rejected` counter.

use crate::common;

use common::dl::*;
use common::dl_policy;
use common::*;
use serde_json::json;

/// R1: nack one at a time; each lands in the DLQ in nack order.
#[tokio::test]
async fn dead_letter_nack() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2", "p3"]).await;
    nack(&ch, tags[2], false, false).await;
    b.wait_counts("dlq", 1, 0).await;
    consume_empty(&ch, "q").await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p3");
    assert_eq!(d.exchange.as_str(), dlx);
    assert_eq!(d.routing_key.as_str(), "dlq");
    assert!(!d.redelivered);
    consume_empty(&ch, "dlq").await;
    nack(&ch, tags[0], false, false).await;
    nack(&ch, tags[1], false, false).await;
    consume_empty(&ch, "q").await;
    b.wait_counts("dlq", 2, 1).await;
    consume(&ch, "dlq", &["p1", "p2"]).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 3);
}

/// R2: nack(multiple) dead-letters every covered delivery in delivery-tag order.
#[tokio::test]
async fn dead_letter_multiple_nack() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2", "p3"]).await;
    nack(&ch, tags[2], true, false).await;
    b.wait_counts("dlq", 3, 0).await;
    consume(&ch, "dlq", &["p1", "p2", "p3"]).await;
    consume_empty(&ch, "q").await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 3);
}

/// R3: nack(requeue=true) puts the message back; nothing is dead-lettered.
#[tokio::test]
async fn dead_letter_nack_requeue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2", "p3"]).await;
    nack(&ch, tags[2], false, true).await;
    b.wait_counts("q", 1, 2).await;
    let d = get_one(&ch, "q").await;
    assert_eq!(payload(&d), "p3");
    assert!(d.redelivered);
    consume_empty(&ch, "q").await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 0);
}

/// R4: nack(multiple, requeue) returns all three to the head in their original order.
#[tokio::test]
async fn dead_letter_nack_requeue_multiple() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2", "p3"]).await;
    nack(&ch, tags[2], true, true).await;
    b.wait_counts("q", 3, 0).await;
    consume(&ch, "q", &["p1", "p2", "p3"]).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 0);
}

/// R5: basic.reject(requeue=false) dead-letters one message; the rest stay.
#[tokio::test]
async fn dead_letter_reject() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1"]).await;
    reject(&ch, tags[0], false).await;
    b.wait_counts("dlq", 1, 0).await;
    consume(&ch, "dlq", &["p1"]).await;
    consume_empty(&ch, "dlq").await;
    consume(&ch, "q", &["p2", "p3"]).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 1);
}

/// R6: 100 deliveries rejected one by one from a consumer arrive in the DLQ in order.
#[tokio::test]
async fn dead_letter_reject_many() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    let payloads: Vec<String> = (1..=100).map(|i| i.to_string()).collect();
    let refs: Vec<&str> = payloads.iter().map(String::as_str).collect();
    publish(&ch, "q", &refs).await;
    b.wait_counts("q", 100, 0).await;
    let mut c = consumer(&ch, "q", "ctag").await;
    for p in &refs {
        let d = next(&mut c).await;
        assert_eq!(payload(&d), *p);
        reject(&ch, d.delivery_tag, false).await;
    }
    ch.basic_cancel("ctag".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    b.wait_counts("dlq", 100, 0).await;
    consume(&ch, "dlq", &refs).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 100);
}

/// R7: reject(requeue=true) under a delivery-limit policy of 50 keeps the order.
#[tokio::test]
async fn dead_letter_reject_requeue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    b.set_policy(dl_policy::exact(
        "limit",
        "q",
        json!({"delivery-limit": 50}),
    ));
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 3, 0).await;
    let tags = consume(&ch, "q", &["p1"]).await;
    reject(&ch, tags[0], true).await;
    b.wait_counts("q", 3, 0).await;
    consume(&ch, "q", &["p1", "p2", "p3"]).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 0);
}

/// R8 (issue #4940): a message requeued once can then be dead-lettered.
#[tokio::test]
async fn dead_letter_reject_requeue_reject_norequeue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p"]).await;
    let t = consume(&ch, "q", &["p"]).await[0];
    b.wait_counts("q", 0, 1).await;
    reject(&ch, t, true).await;
    b.wait_counts("q", 1, 0).await;
    get_and_reject(&ch, "q", "p").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p");
    // The redelivered flag is the source queue's business: the dead-lettered copy is new.
    assert!(!d.redelivered);
    consume_empty(&ch, "q").await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 1);
}

/// R9: dead-letter order is delivery-tag order, not publish order (P3, P1, P2).
#[tokio::test]
async fn dead_letter_nack_requeue_nack_norequeue_basic_get() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    b.set_policy(dl_policy::exact(
        "limit",
        "q",
        json!({"delivery-limit": 50}),
    ));
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    let tags = consume(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 0, 3).await;
    nack(&ch, tags[1], true, true).await;
    b.wait_counts("q", 2, 1).await;
    let tags = consume(&ch, "q", &["p1", "p2"]).await;
    nack(&ch, tags[1], true, false).await;
    b.wait_counts("dlq", 3, 0).await;
    consume(&ch, "dlq", &["p3", "p1", "p2"]).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 3);
}

/// R10: the same with consumers on Q and DLQ on one channel; a final multiple ack settles the
/// DLQ deliveries too.
#[tokio::test]
async fn dead_letter_nack_requeue_nack_norequeue_basic_consume() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    b.set_policy(dl_policy::exact(
        "limit",
        "q",
        json!({"delivery-limit": 50}),
    ));
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["m1", "m2", "m3"]).await;
    let mut cq = consumer(&ch, "q", "ctag1").await;
    let mut cdlq = consumer(&ch, "dlq", "ctag2").await;
    let d1 = next(&mut cq).await;
    let d2 = next(&mut cq).await;
    let d3 = next(&mut cq).await;
    assert_eq!(
        [payload(&d1), payload(&d2), payload(&d3)],
        ["m1", "m2", "m3"]
    );
    nack(&ch, d2.delivery_tag, true, true).await;
    let d4 = next(&mut cq).await;
    let d5 = next(&mut cq).await;
    assert_eq!((payload(&d4), payload(&d5)), ("m1".into(), "m2".into()));
    assert!(d4.redelivered && d5.redelivered);
    nack(&ch, d5.delivery_tag, true, false).await;
    let got: Vec<String> = [
        next(&mut cdlq).await,
        next(&mut cdlq).await,
        next(&mut cdlq).await,
    ]
    .iter()
    .map(|d| {
        assert_eq!(d.routing_key.as_str(), "dlq");
        payload(d)
    })
    .collect();
    assert_eq!(got, ["m3", "m1", "m2"]);
    b.wait_counts("dlq", 0, 3).await;
    let last = d5.delivery_tag + 3;
    ack(&ch, last, true).await;
    b.wait_counts("q", 0, 0).await;
    b.wait_counts("dlq", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 3);
}

/// at_most_once_dead_letter_order_rejected: nack(delivery_tag=0, multiple) covers every
/// outstanding delivery, dead-lettered in order.
#[tokio::test]
async fn at_most_once_dead_letter_order_rejected() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["m1", "m2"]).await;
    consume(&ch, "q", &["m1", "m2"]).await;
    nack(&ch, 0, true, false).await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "dlq", &["m1", "m2"]).await;
    b.wait_counts("q", 0, 0).await;
}

/// Rejecting on a queue without a dead-letter exchange discards: counted as dead-lettered
/// (RabbitMQ counts it under strategy `disabled`), no drop counted, nothing routed.
#[tokio::test]
async fn reject_without_dlx_discards_and_counts() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["p"]).await;
    get_and_reject(&ch, "q", "p").await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 1);
    for cause in ["no_dlx", "unroutable", "cycle", "hop_limit"] {
        assert_eq!(b.dropped("q", cause), 0, "{cause}");
    }
}

/// Settling a delivery from a queue that was deleted (and re-created) meanwhile never
/// dead-letters into the new queue's DLX.
#[tokio::test]
async fn reject_after_queue_deleted_does_not_dead_letter() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p"]).await;
    let t = consume(&ch, "q", &["p"]).await[0];
    let (_c2, ch2) = b.channel().await;
    ch2.queue_delete("q".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    declare(
        &ch2,
        "q",
        table(&[
            ("x-dead-letter-exchange", ls("q_dlx_exchange")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    reject(&ch, t, false).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "rejected"), 0);
}

/// What the publisher sees: a publish to a queue with a DLX is confirmed as usual; a
/// dead-lettering later never produces a basic.return or a nack for it.
#[tokio::test]
async fn publisher_sees_ack_and_no_return_for_later_dead_letter() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    let c = ch
        .basic_publish(
            "".into(),
            "q".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"p",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    get_and_reject(&ch, "q", "p").await;
    b.wait_counts("dlq", 1, 0).await;
    // A second publish is still simply acked (no stray return/nack was queued on the channel).
    let c = publish_to(&ch, "", "q", b"p2", BasicProperties::default()).await;
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
}

/// A requeue (nack requeue=true, basic.recover) releases each delivery once: the queue's
/// unacked count and the consumer's prefetch window stay exact.
#[tokio::test]
async fn requeue_releases_unacked_counts_once() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["m1", "m2", "m3", "m4"]).await;
    ch.basic_qos(2, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut c = consumer(&ch, "q", "c").await;
    let d1 = next(&mut c).await;
    let _d2 = next(&mut c).await;
    b.wait_counts("q", 2, 2).await;
    nack(&ch, d1.delivery_tag, false, true).await;
    let again = next(&mut c).await;
    assert_eq!(payload(&again), "m1");
    // Prefetch 2 with m2 and m1 out: nothing more may arrive.
    no_delivery(&mut c, 150).await;
    b.wait_counts("q", 2, 2).await;
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    let r1 = next(&mut c).await;
    let r2 = next(&mut c).await;
    assert_eq!((payload(&r1), payload(&r2)), ("m1".into(), "m2".into()));
    no_delivery(&mut c, 150).await;
    b.wait_counts("q", 2, 2).await;
}
