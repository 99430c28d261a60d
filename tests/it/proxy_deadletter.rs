//! Proxy mode, rejections: basic.reject / basic.nack with requeue=false are dead-lettered by
//! the proxy (publisher confirms, then the original is acked), with RabbitMQ's headers, even
//! when the upstream queue has no dead-letter settings of its own.

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{Channel, ExchangeKind};
use proxy_support::*;

async fn publish(ch: &Channel, queue: &str, payloads: &[&str]) {
    for p in payloads {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            p.as_bytes(),
            AMQPProperties::default(),
        )
        .await
        .unwrap();
    }
}

/// The reference topology: a direct DLX, Q dead-lettering to it with DLRK = DLQ, DLQ bound.
async fn topology(ch: &Channel) -> (String, String, String) {
    let q = unique("q");
    let dlx = unique("dlx");
    let dlq = unique("dlq");
    declare_dlx(ch, &dlx, &dlq).await;
    declare(
        ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
        ]),
    )
    .await;
    (q, dlx, dlq)
}

fn strings(values: &[&str]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        values.iter().map(|v| ls(v)).collect::<Vec<_>>(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_dead_letters_with_exact_headers() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = topology(&ch).await;
    publish(&ch, &q, &["p1", "p2", "p3"]).await;
    wait_count(&ch, &q, 3).await;
    let d1 = get(&ch, &q).await;
    let d2 = get(&ch, &q).await;
    let d3 = get(&ch, &q).await;
    d3.acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: false,
        })
        .await
        .unwrap();
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "p3");
    // Delivered from the DLQ: exchange = the DLX, routing key = the DLRK.
    assert_eq!(dead.exchange.as_str(), dlx);
    assert_eq!(dead.routing_key.as_str(), dlq);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1);
    let entry = &deaths[0];
    assert_eq!(field(entry, "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(field(entry, "reason"), &ls("rejected"));
    assert_eq!(field(entry, "queue"), &ls(&q));
    assert_eq!(field(entry, "exchange"), &ls(""));
    assert_eq!(field(entry, "routing-keys"), &strings(&[&q]));
    match field(entry, "time") {
        AMQPValue::Timestamp(t) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            assert!(
                t.abs_diff(now) < 30,
                "time {t} is not in seconds near {now}"
            );
        }
        other => panic!("time is not a timestamp: {other:?}"),
    }
    assert!(entry.inner().get("original-expiration").is_none());
    assert_eq!(header(&dead, "x-first-death-reason"), Some(&ls("rejected")));
    assert_eq!(header(&dead, "x-first-death-queue"), Some(&ls(&q)));
    assert_eq!(header(&dead, "x-first-death-exchange"), Some(&ls("")));
    dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    consume_empty(&ch, &dlq).await;

    // Then the other two, one at a time, arrive in that order; the source is empty.
    d1.acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: false,
        })
        .await
        .unwrap();
    d2.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert_eq!(payload(&get(&ch, &dlq).await), "p1");
    assert_eq!(payload(&get(&ch, &dlq).await), "p2");
    consume_empty(&ch, &q).await;
    wait_upstream_empty(&q).await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &q), ("reason", "rejected"), ("vhost", "/")],
            3.0,
        )
        .await;
    // The connection kept the settings of the one queue it rejected from, and gives them
    // back when it closes.
    assert_eq!(proxy.counter("session_queue_settings", &[]), 1.0);
    conn.close(200, "done".into()).await.unwrap();
    proxy.wait_gauge("session_queue_settings", &[], 0.0).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multiple_nack_dead_letters_in_tag_order_and_keeps_other_settlements_apart() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch).await;
    publish(&ch, &q, &["p1", "p2", "p3", "p4", "p5"]).await;
    wait_count(&ch, &q, 5).await;
    let mut ds = Vec::new();
    for _ in 0..5 {
        ds.push(get(&ch, &q).await);
    }
    ds[2]
        .acker
        .nack(BasicNackOptions {
            multiple: true,
            requeue: false,
        })
        .await
        .unwrap();
    // An ack for everything up to p5 right away: p1..p3 are the proxy's to settle, so only
    // p4 and p5 are acked upstream (no double settlement, no channel error).
    ds[4]
        .acker
        .ack(BasicAckOptions { multiple: true })
        .await
        .unwrap();
    for expected in ["p1", "p2", "p3"] {
        let d = get(&ch, &dlq).await;
        assert_eq!(payload(&d), expected);
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    consume_empty(&ch, &dlq).await;
    wait_upstream_empty(&q).await;
    // The channel is still fine.
    publish(&ch, &q, &["after"]).await;
    assert_eq!(payload(&get(&ch, &q).await), "after");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_target_from_a_toml_policy_on_a_queue_without_arguments() {
    let dlx = unique("pdlx");
    let dlq = unique("pdlq");
    let q = unique("plain");
    let proxy = TestProxy::start(vec![policy(
        "dlx",
        &format!("^{q}$"),
        serde_json::json!({"dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
    )])
    .await;
    // The queue is created straight on RabbitMQ, with no arguments at all.
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    declare(&uch, &q, FieldTable::default()).await;
    declare_dlx(&uch, &dlx, &dlq).await;

    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    // The application declares its queue at start-up as usual: the queue exists upstream
    // without the proxy's arguments, so the proxy declares it passively (no 406).
    declare(&ch, &q, FieldTable::default()).await;
    publish(&ch, &q, &["m"]).await;
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let d = next(&mut rx).await;
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&uch, &dlq).await;
    assert_eq!(payload(&dead), "m");
    assert_eq!(field(&x_death(&dead)[0], "queue"), &ls(&q));
    wait_count(&uch, &q, 0).await;

    // A queue declared through the proxy without arguments gets the policy too, and its
    // upstream queue has no dead-letter exchange of its own beyond the capture exchange.
    let q2 = format!("{q}-2");
    let proxy2 = TestProxy::start(vec![policy(
        "dlx",
        &format!("^{q2}$"),
        serde_json::json!({"dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
    )])
    .await;
    let conn2 = proxy2.connect().await;
    let ch2 = conn2.create_channel().await.unwrap();
    declare(&ch2, &q2, FieldTable::default()).await;
    publish(&ch2, &q2, &["m2"]).await;
    let d = get(&ch2, &q2).await;
    d.acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: false,
        })
        .await
        .unwrap();
    assert_eq!(payload(&get(&uch, &dlq).await), "m2");
    proxy.stop().await;
    proxy2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cc_keys_route_once_and_the_cc_header_is_kept_without_a_routing_key() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("cc-src");
    let dlx = unique("cc-dlx");
    let both = unique("cc-both");
    let only_cc = unique("cc-only");
    let cc_key = unique("cc-key");
    exchange(&ch, &dlx, ExchangeKind::Direct).await;
    for (queue, keys) in [
        (&both, vec![q.clone(), cc_key.clone()]),
        (&only_cc, vec![cc_key.clone()]),
    ] {
        declare(&ch, queue, FieldTable::default()).await;
        for key in keys {
            bind(&ch, queue, &dlx, &key).await;
        }
    }
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls(&dlx))])).await;
    let props = AMQPProperties::default().with_headers(table(&[
        ("CC", strings(&[&cc_key])),
        ("BCC", strings(&[&unique("invisible")])),
    ]));
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"m",
        props,
    )
    .await
    .unwrap();
    let d = get(&ch, &q).await;
    assert!(header(&d, "BCC").is_none(), "BCC is never visible");
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    for queue in [&both, &only_cc] {
        let dead = get(&ch, queue).await;
        assert_eq!(payload(&dead), "m");
        // Routed with the original key: the first key is the delivery's routing key.
        assert_eq!(dead.exchange.as_str(), dlx);
        assert_eq!(dead.routing_key.as_str(), q);
        assert_eq!(header(&dead, "CC"), Some(&strings(&[&cc_key])));
        assert!(header(&dead, "BCC").is_none());
        let deaths = x_death(&dead);
        assert_eq!(field(&deaths[0], "routing-keys"), &strings(&[&q, &cc_key]));
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
        // Exactly one copy, also in the queue bound by both keys.
        tokio::time::sleep(Duration::from_millis(200)).await;
        consume_empty(&ch, queue).await;
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_routing_key_removes_the_cc_header() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch).await;
    let cc = unique("cc");
    let props =
        AMQPProperties::default().with_headers(table(&[("CC", strings(&[&cc])), ("aa", ls("x"))]));
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"m",
        props,
    )
    .await
    .unwrap();
    let d = get(&ch, &q).await;
    d.acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: false,
        })
        .await
        .unwrap();
    let dead = get(&ch, &dlq).await;
    assert!(header(&dead, "CC").is_none());
    assert_eq!(header(&dead, "aa"), Some(&ls("x")));
    assert_eq!(
        field(&x_death(&dead)[0], "routing-keys"),
        &strings(&[&q, &cc])
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_exchange_drops_and_counts_then_recovers() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("nodlx-src");
    let dlx = unique("nodlx");
    let dlq = unique("nodlx-q");
    declare_dead_lettering(&ch, &q, &dlx, &dlq).await;
    declare(&ch, &dlq, FieldTable::default()).await;
    publish(&ch, &q, &["lost"]).await;
    let d = get(&ch, &q).await;
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "no_dlx"), ("queue", &q), ("vhost", "/")],
            1.0,
        )
        .await;
    wait_upstream_empty(&q).await;
    consume_empty(&ch, &dlq).await;

    // Declared later, the exchange is used from then on (the name is resolved each time).
    declare_dlx(&ch, &dlx, &dlq).await;
    publish(&ch, &q, &["kept"]).await;
    let d = get(&ch, &q).await;
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert_eq!(payload(&get(&ch, &dlq).await), "kept");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_dead_letter_is_dropped_and_counted() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("unroutable-src");
    let dlx = unique("unroutable-dlx");
    exchange(&ch, &dlx, ExchangeKind::Direct).await;
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls(&dlx))])).await;
    publish(&ch, &q, &["nowhere"]).await;
    let d = get(&ch, &q).await;
    d.acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: false,
        })
        .await
        .unwrap();
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "unroutable"), ("queue", &q), ("vhost", "/")],
            1.0,
        )
        .await;
    wait_upstream_empty(&q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_never_form_a_dropping_cycle_and_counts_grow() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("self");
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls(""))])).await;
    publish(&ch, &q, &["loop"]).await;
    for round in 1..=3i64 {
        let d = get(&ch, &q).await;
        assert_eq!(payload(&d), "loop");
        if round > 1 {
            let deaths = x_death(&d);
            assert_eq!(deaths.len(), 1);
            assert_eq!(
                field(&deaths[0], "count"),
                &AMQPValue::LongLongInt(round - 1)
            );
        }
        d.acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: false,
            })
            .await
            .unwrap();
    }
    let d = get(&ch, &q).await;
    assert_eq!(field(&x_death(&d)[0], "count"), &AMQPValue::LongLongInt(3));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hops_keep_the_history_newest_first() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q1 = unique("hop1");
    let q2 = unique("hop2");
    let q3 = unique("hop3");
    let d1 = unique("hop-dlx");
    let k2 = unique("k2");
    exchange(&ch, &d1, ExchangeKind::Direct).await;
    declare_dead_lettering(&ch, &q1, &d1, &k2).await;
    declare(
        &ch,
        &q2,
        table(&[
            ("x-dead-letter-exchange", ls("")),
            ("x-dead-letter-routing-key", ls(&q3)),
        ]),
    )
    .await;
    declare(&ch, &q3, FieldTable::default()).await;
    bind(&ch, &q2, &d1, &k2).await;
    publish(&ch, &q1, &["m"]).await;
    get(&ch, &q1)
        .await
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    get(&ch, &q2)
        .await
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&ch, &q3).await;
    assert_eq!(dead.exchange.as_str(), "");
    assert_eq!(dead.routing_key.as_str(), q3);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 2);
    assert_eq!(field(&deaths[0], "queue"), &ls(&q2));
    assert_eq!(field(&deaths[0], "exchange"), &ls(&d1));
    assert_eq!(field(&deaths[0], "routing-keys"), &strings(&[&k2]));
    assert_eq!(field(&deaths[1], "queue"), &ls(&q1));
    assert_eq!(field(&deaths[1], "exchange"), &ls(""));
    assert_eq!(field(&deaths[1], "routing-keys"), &strings(&[&q1]));
    assert_eq!(header(&dead, "x-first-death-queue"), Some(&ls(&q1)));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_rejections_from_a_consumer_arrive_in_order() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch).await;
    let payloads: Vec<String> = (1..=100).map(|i| i.to_string()).collect();
    let refs: Vec<&str> = payloads.iter().map(String::as_str).collect();
    publish(&ch, &q, &refs).await;
    wait_count(&ch, &q, 100).await;
    let cch = conn.create_channel().await.unwrap();
    let mut rx = consume(&cch, &q, BasicConsumeOptions::default()).await;
    for _ in 0..100 {
        let d = next(&mut rx).await;
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    let uch = upstream_connection().await.create_channel().await.unwrap();
    wait_count(&uch, &dlq, 100).await;
    for expected in &payloads {
        let d = get(&uch, &dlq).await;
        assert_eq!(&payload(&d), expected);
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    wait_count(&uch, &q, 0).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_channel_right_after_a_reject_loses_and_duplicates_nothing() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = topology(&ch).await;
    publish(&ch, &q, &["a", "b"]).await;
    wait_count(&ch, &q, 2).await;
    let cch = conn.create_channel().await.unwrap();
    let a = get(&cch, &q).await;
    let b = get(&cch, &q).await;
    a.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    // b is left unacked: the close gives it back to the queue.
    cch.close(200, "bye".into()).await.unwrap();
    drop(b);
    let uch = upstream_connection().await.create_channel().await.unwrap();
    wait_count(&uch, &dlq, 1).await;
    wait_count(&uch, &q, 1).await;
    assert_eq!(payload(&get(&uch, &dlq).await), "a");
    assert_eq!(payload(&get(&uch, &q).await), "b");
    // Declaring with equal arguments again works (the upstream arguments are stable).
    declare_dead_lettering(&ch, &q, &dlx, &dlq).await;
    proxy.stop().await;
}

/// Publishes a message whose properties fit one frame of 131072 bytes as published, and no
/// longer once the x-death entry and the x-first-death-* headers are added.
async fn publish_big_headers(ch: &Channel, queue: &str) {
    let mut headers = FieldTable::default();
    headers.insert("pad".into(), ls(&"p".repeat(130_900)));
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"big-headers",
        AMQPProperties::default().with_headers(headers),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_whose_headers_outgrow_the_frame_size_is_dropped_and_counted() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch).await;
    publish_big_headers(&ch, &q).await;
    wait_count(&ch, &q, 1).await;
    let d = get(&ch, &q).await;
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "unpublishable"), ("queue", &q), ("vhost", "/")],
            1.0,
        )
        .await;
    wait_upstream_empty(&q).await;
    // The client's connection was not closed under it, and the next message goes through.
    publish(&ch, &q, &["small"]).await;
    let d = get(&ch, &q).await;
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert_eq!(payload(&get(&ch, &dlq).await), "small");
    assert_eq!(message_count(&ch, &dlq).await, 0);
    assert!(conn.status().connected());
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_message_whose_headers_outgrow_the_frame_size_is_dropped_and_counted() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q");
    let dlx = unique("dlx");
    let dlq = unique("dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
            ("x-message-ttl", AMQPValue::LongInt(50)),
        ]),
    )
    .await;
    publish_big_headers(&ch, &q).await;
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "unpublishable"), ("queue", &q), ("vhost", "/")],
            1.0,
        )
        .await;
    // The capture path goes on: the next expiry is dead-lettered.
    publish(&ch, &q, &["small"]).await;
    wait_count(&ch, &dlq, 1).await;
    assert_eq!(payload(&get(&ch, &dlq).await), "small");
    proxy.stop().await;
}
