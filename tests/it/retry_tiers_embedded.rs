//! Retry tiers (`x-retry-delays`, policy `retry-delays`) in embedded mode, with lapin: each
//! rejection with requeue=false is held for its tier's delay and comes back to the same queue
//! (exchange "", the queue's name as routing key, `x-retry-count` as a long, x-death counting
//! every rejection), the tiers used up dead-letter with the whole history, a shorter delay given
//! later overtakes a longer one, a delivery limit still applies, the metrics over HTTP, the
//! 406 for an invalid argument, and held messages across a SIGKILL of the real binary.

use crate::common;
use crate::storage_restart::{Node, count, publish_confirmed};

use std::time::{Duration, Instant};

use common::dl::*;
use common::dl_policy;
use common::*;
use serde_json::json;

/// `x-retry-delays` as clients send it: an array of longs.
fn delays(ms: &[i32]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        ms.iter().map(|d| int(*d)).collect::<Vec<_>>(),
    ))
}

/// The `x-retry-count` of a delivery: absent, or a long (LongLongInt).
fn retry_count(d: &Delivery) -> Option<i64> {
    header(d, "x-retry-count").map(|v| match v {
        AMQPValue::LongLongInt(n) => *n,
        other => panic!("x-retry-count must be LongLongInt, got {other:?}"),
    })
}

/// An embedded broker with its admin listener on a free port.
async fn broker_with_admin() -> (TestBroker, std::net::SocketAddr) {
    let mut config = test_config();
    config.listen.admin = "127.0.0.1:0".into();
    let broker = start_with(config).await;
    let admin = broker.service.admin_addr.expect("admin listener");
    (broker, admin)
}

/// The series of a retry metric of queue `queue` in vhost "/" (labels in name order).
fn retry_series(name: &str, queue: &str, tier: Option<&str>) -> String {
    match tier {
        Some(tier) => series(name, &[("queue", queue), ("tier", tier), ("vhost", "/")]),
        None => series(name, &[("queue", queue), ("vhost", "/")]),
    }
}

/// Delays [200, 600]: the first rejection comes back after 200 ms, the second after 600 ms,
/// each with `x-retry-count` and x-death counting the rejections; the third dead-letters to
/// the DLX with the whole history. Held messages are not in the queue's message count; the
/// metrics show them and count each tier and the exhaustion.
#[tokio::test]
async fn embedded_each_rejection_waits_for_its_tier_then_the_last_dead_letters() {
    let (b, admin) = broker_with_admin().await;
    let (_c, ch) = b.channel().await;
    let q = "work";
    declare_dlx(&ch, "dlx", "dlq").await;
    let args = table(&[
        ("x-retry-delays", delays(&[200, 600])),
        ("x-dead-letter-exchange", ls("dlx")),
        ("x-dead-letter-routing-key", ls("dlq")),
    ]);
    declare(&ch, q, args).await;
    exchange(&ch, "orders", ExchangeKind::Direct).await;
    bind(&ch, q, "orders", "new").await;
    publish_to(&ch, "orders", "new", b"m", BasicProperties::default()).await;
    let mut c = consumer(&ch, q, "c").await;

    let d = next(&mut c).await;
    assert_eq!(retry_count(&d), None, "no x-retry-count before any retry");
    let rejected = Instant::now();
    reject(&ch, d.delivery_tag, false).await;
    assert_eq!(count(&ch, q).await, 0, "held: not a queue message");
    let held = retry_series("dlx_proxy_retry_held_messages", q, None);
    wait_metric(admin, &held, 1.0).await;

    let d = next(&mut c).await;
    let waited = rejected.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_millis(600),
        "first tier: back after {waited:?}"
    );
    assert_eq!(payload(&d), "m");
    assert_eq!(retry_count(&d), Some(1));
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str(), d.redelivered),
        ("", q, false)
    );
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(deaths[0].qrc(), (q, "rejected", 1));
    assert_eq!(
        (deaths[0].exchange.as_str(), deaths[0].routing_keys.clone()),
        ("orders", vec!["new".to_string()])
    );
    assert_first_death(&d, "rejected", q, "orders");

    let rejected = Instant::now();
    reject(&ch, d.delivery_tag, false).await;
    no_delivery(&mut c, 450).await;
    let d = next(&mut c).await;
    let waited = rejected.elapsed();
    assert!(
        waited >= Duration::from_millis(600) && waited < Duration::from_millis(1_100),
        "second tier: back after {waited:?}"
    );
    assert_eq!(retry_count(&d), Some(2));
    assert_eq!(x_death(&d)[0].qrc(), (q, "rejected", 2));

    // Tiers used up: dead-lettered as usual, with the whole history.
    reject(&ch, d.delivery_tag, false).await;
    no_delivery(&mut c, 700).await;
    let dead = get_one(&ch, "dlq").await;
    assert_eq!(payload(&dead), "m");
    assert_eq!(retry_count(&dead), Some(2));
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(deaths[0].qrc(), (q, "rejected", 3));
    assert_first_death(&dead, "rejected", q, "orders");

    let text = scrape(admin).await;
    for (tier, value) in [("1", 1.0), ("2", 1.0)] {
        let name = retry_series("dlx_proxy_retries_total", q, Some(tier));
        assert_eq!(metric_value(&text, &name), Some(value), "{name}\n{text}");
    }
    let exhausted = retry_series("dlx_proxy_retry_exhausted_total", q, None);
    assert_eq!(metric_value(&text, &exhausted), Some(1.0), "{text}");
    assert_eq!(metric_value(&text, &held), Some(0.0), "{text}");
    assert_eq!(b.dead_lettered(q, "rejected"), 1);
}

/// Delays by policy [100, 1500]: message A, on its second tier (1500 ms), is overtaken by B
/// rejected after it into the first tier (100 ms): no head-of-line blocking.
#[tokio::test]
async fn embedded_a_shorter_delay_rejected_later_comes_back_first() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = "mixed";
    b.set_policy(dl_policy::exact(
        "tiers",
        q,
        json!({"retry-delays": [100, 1500]}),
    ));
    declare(&ch, q, FieldTable::default()).await;
    publish(&ch, q, &["a", "b"]).await;
    let mut c = consumer(&ch, q, "c").await;
    let a = next(&mut c).await;
    let bee = next(&mut c).await;
    assert_eq!((payload(&a), payload(&bee)), ("a".into(), "b".into()));
    reject(&ch, a.delivery_tag, false).await;
    let a = next(&mut c).await;
    assert_eq!((payload(&a), retry_count(&a)), ("a".into(), Some(1)));
    let a_rejected = Instant::now();
    reject(&ch, a.delivery_tag, false).await;
    let b_rejected = Instant::now();
    reject(&ch, bee.delivery_tag, false).await;

    let first = next(&mut c).await;
    assert_eq!(
        (payload(&first), retry_count(&first)),
        ("b".into(), Some(1))
    );
    assert!(
        b_rejected.elapsed() < Duration::from_millis(1_000),
        "b waited behind a: {:?}",
        b_rejected.elapsed()
    );
    let second = next(&mut c).await;
    assert_eq!(
        (payload(&second), retry_count(&second)),
        ("a".into(), Some(2))
    );
    assert!(a_rejected.elapsed() >= Duration::from_millis(1_500));
}

/// A delivery limit still applies: requeues count toward it, a retried message comes back
/// with its count started again (a new arrival: `x-delivery-count` 0), and a requeue past the
/// limit dead-letters with reason `delivery_limit`, the retry's history kept.
#[tokio::test]
async fn embedded_a_delivery_limit_still_applies() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = "limited";
    declare(&ch, "dlq", FieldTable::default()).await;
    let args = dead_letter_to(
        "dlq",
        &[
            ("x-retry-delays", delays(&[50])),
            ("x-delivery-limit", int(1)),
        ],
    );
    declare(&ch, q, args).await;
    publish(&ch, q, &["m"]).await;
    let d = get_one(&ch, q).await;
    nack(&ch, d.delivery_tag, false, true).await;
    let d = get_one(&ch, q).await;
    assert!(d.redelivered);
    assert_eq!(
        header(&d, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    reject(&ch, d.delivery_tag, false).await;
    b.wait_counts(q, 1, 0).await;
    let d = get_one(&ch, q).await;
    assert!(!d.redelivered);
    assert_eq!(retry_count(&d), Some(1));
    // Started again: basic.get on a queue with a delivery limit always carries the count.
    assert_eq!(
        header(&d, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(0))
    );
    nack(&ch, d.delivery_tag, false, true).await;
    let d = get_one(&ch, q).await;
    assert_eq!(
        header(&d, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    nack(&ch, d.delivery_tag, false, true).await;
    b.wait_dead_lettered(q, "delivery_limit", 1).await;
    consume_empty(&ch, q).await;
    let dead = get_one(&ch, "dlq").await;
    let history: Vec<(String, String, i64)> = x_death(&dead)
        .into_iter()
        .map(|d| (d.queue, d.reason, d.count))
        .collect();
    assert_eq!(
        history,
        vec![
            (q.to_string(), "delivery_limit".to_string(), 1),
            (q.to_string(), "rejected".to_string(), 1)
        ]
    );
    assert_eq!(retry_count(&dead), Some(1));
}

/// An invalid `x-retry-delays` is refused with 406 and RabbitMQ's wording.
#[tokio::test]
async fn embedded_invalid_retry_delays_are_refused_with_406() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let err = try_declare(&ch, "q", table(&[("x-retry-delays", ls("1000"))]))
        .await
        .expect_err("a string is not a list of delays");
    assert_eq!(amqp_code(&err), Some(406));
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': \
         {unacceptable_type,longstr}"
    );
}

#[tokio::test]
async fn embedded_a_redeclare_with_other_tiers_is_refused_with_406() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    try_declare(
        &ch,
        "tiers",
        table(&[("x-retry-delays", delays(&[300, 600]))]),
    )
    .await
    .expect("first declare");
    // The same tiers, in another integer width, are the same.
    let same =
        AMQPValue::FieldArray(vec![AMQPValue::LongInt(300), AMQPValue::ShortInt(600)].into());
    try_declare(&ch, "tiers", table(&[("x-retry-delays", same)]))
        .await
        .expect("an equivalent redeclare");
    let err = try_declare(&ch, "tiers", table(&[("x-retry-delays", delays(&[300]))]))
        .await
        .expect_err("other tiers");
    assert_eq!(amqp_code(&err), Some(406));
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - inequivalent arg 'x-retry-delays' for queue 'tiers' in vhost \
         '/': received '[{long,300}]' but current is '[{long,300},{long,600}]'"
    );
    let ch = conn.create_channel().await.expect("channel");
    let err = try_declare(&ch, "tiers", table(&[]))
        .await
        .expect_err("no tiers");
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - inequivalent arg 'x-retry-delays' for queue 'tiers' in vhost \
         '/': received none but current is '[{long,300},{long,600}]'"
    );
}

/// Persistent messages held in a durable queue's retry hold survive a SIGKILL: after the
/// restart they are still held (not in the queue, counted by the held gauge) until their
/// original due time, then all come back with their `x-retry-count`.
#[tokio::test]
async fn embedded_held_messages_come_back_after_a_sigkill() {
    let mut node = Node::start("retry-kill").await;
    let (conn, ch) = node.channel().await;
    let q = "held";
    declare_durable(&ch, q, table(&[("x-retry-delays", delays(&[4_000]))])).await;
    declare_durable(&ch, "barrier", FieldTable::default()).await;
    confirm_select(&ch).await;
    let props = BasicProperties::default().with_delivery_mode(2);
    publish_confirmed(&ch, q, (0..3).map(|i| (format!("m{i}"), props.clone()))).await;
    let mut tags = Vec::new();
    for i in 0..3 {
        let d = get_one(&ch, q).await;
        assert_eq!(payload(&d), format!("m{i}"));
        tags.push(d.delivery_tag);
    }
    let rejected = Instant::now();
    for tag in tags {
        reject(&ch, tag, false).await;
    }
    // The storage thread writes in order: once this publish is confirmed, the held records
    // before it are written too.
    publish_confirmed(&ch, "barrier", std::iter::once(("x".to_string(), props))).await;
    let held = retry_series("dlx_proxy_retry_held_messages", q, None);
    wait_metric(node.admin, &held, 3.0).await;
    drop(conn);
    node.kill().await;
    node.up().await;
    assert!(
        rejected.elapsed() < Duration::from_millis(3_500),
        "the restart took too long for this test: {:?}",
        rejected.elapsed()
    );

    let (_conn, ch) = node.channel().await;
    let text = wait_metric(node.admin, &held, 3.0).await;
    assert_eq!(metric_value(&text, &held), Some(3.0), "{}", node.logs());
    assert_eq!(count(&ch, q).await, 0, "still held after the restart");
    let mut c = consumer(&ch, q, "c").await;
    let mut back = Vec::new();
    for _ in 0..3 {
        let d = next(&mut c).await;
        assert!(
            rejected.elapsed() >= Duration::from_millis(3_900),
            "returned before its due time: {:?}",
            rejected.elapsed()
        );
        assert_eq!(retry_count(&d), Some(1));
        assert_eq!(x_death(&d)[0].qrc(), (q, "rejected", 1));
        assert!(!d.redelivered);
        back.push(payload(&d));
    }
    back.sort();
    assert_eq!(back, vec!["m0", "m1", "m2"]);
    wait_metric(node.admin, &held, 0.0).await;
    node.stop().await;
}
