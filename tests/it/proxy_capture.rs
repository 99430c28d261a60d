//! Proxy mode, TTL and length limits: messages that expire or overflow in the upstream come
//! back through the proxy's capture queue and reach the real dead-letter exchange with the
//! x-death RabbitMQ writes for the original queue, and no trace of the capture hop.

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{Channel, ExchangeKind};
use proxy_support::*;

async fn publish(ch: &Channel, queue: &str, payload: &str, props: AMQPProperties) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        payload.as_bytes(),
        props,
    )
    .await
    .unwrap();
}

fn strings(values: &[&str]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        values.iter().map(|v| ls(v)).collect::<Vec<_>>(),
    ))
}

/// Q with the given extra arguments dead-lettering to a direct DLX with DLRK = DLQ.
async fn topology(ch: &Channel, extra: &[(&str, AMQPValue)]) -> (String, String, String) {
    let q = unique("q");
    let dlx = unique("dlx");
    let dlq = unique("dlq");
    declare_dlx(ch, &dlx, &dlq).await;
    let mut args = vec![
        ("x-dead-letter-exchange", ls(&dlx)),
        ("x-dead-letter-routing-key", ls(&dlq)),
    ];
    args.extend(extra.iter().cloned());
    declare(ch, &q, table(&args)).await;
    (q, dlx, dlq)
}

fn no_capture_trace(d: &lapin::message::Delivery, capture: &str) {
    let text = format!("{:?}", d.properties);
    assert!(!text.contains(capture), "capture hop visible: {text}");
    assert!(!text.contains("dlx-proxy"), "proxy trace visible: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_ttl_expiry_is_dead_lettered_as_rabbitmq_would() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = topology(&ch, &[("x-message-ttl", AMQPValue::LongInt(1))]).await;
    let props = AMQPProperties::default()
        .with_message_id("id-1".into())
        .with_headers(table(&[("app", ls("v"))]));
    publish(&ch, &q, "p1", props).await;
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "p1");
    assert_eq!(dead.exchange.as_str(), dlx);
    assert_eq!(dead.routing_key.as_str(), dlq);
    assert_eq!(
        dead.properties.message_id().as_ref().map(|m| m.as_str()),
        Some("id-1")
    );
    assert_eq!(header(&dead, "app"), Some(&ls("v")));
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1);
    let entry = &deaths[0];
    assert_eq!(field(entry, "reason"), &ls("expired"));
    assert_eq!(field(entry, "queue"), &ls(&q));
    assert_eq!(field(entry, "exchange"), &ls(""));
    assert_eq!(field(entry, "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(field(entry, "routing-keys"), &strings(&[&q]));
    assert!(matches!(field(entry, "time"), AMQPValue::Timestamp(_)));
    assert!(entry.inner().get("original-expiration").is_none());
    assert_eq!(header(&dead, "x-first-death-reason"), Some(&ls("expired")));
    assert_eq!(header(&dead, "x-first-death-queue"), Some(&ls(&q)));
    assert_eq!(header(&dead, "x-first-death-exchange"), Some(&ls("")));
    no_capture_trace(&dead, &proxy.capture);
    consume_empty(&ch, &q).await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &q), ("reason", "expired"), ("vhost", "/")],
            1.0,
        )
        .await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_ttl_keeps_the_original_expiration() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch, &[]).await;
    publish(
        &ch,
        &q,
        "p1",
        AMQPProperties::default().with_expiration("1".into()),
    )
    .await;
    publish(&ch, &q, "msg2", AMQPProperties::default()).await;
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "p1");
    assert!(dead.properties.expiration().is_none());
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1);
    assert_eq!(field(&deaths[0], "reason"), &ls("expired"));
    assert_eq!(field(&deaths[0], "original-expiration"), &ls("1"));
    no_capture_trace(&dead, &proxy.capture);
    let kept = get(&ch, &q).await;
    assert_eq!(payload(&kept), "msg2");
    proxy.stop().await;
}

/// A proxy with the policy `ttl` for queue `q`: a TTL of 10 ms and `dlx` / `dlq` as its
/// dead-letter target.
async fn with_ttl_policy(q: &str, dlx: &str, dlq: &str) -> TestProxy {
    TestProxy::start(vec![policy(
        "ttl",
        &format!("^{q}$"),
        serde_json::json!({"message-ttl": 10, "dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
    )])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_and_target_from_a_toml_policy() {
    let q = unique("pttl");
    let dlx = unique("pttl-dlx");
    let dlq = unique("pttl-dlq");
    let proxy = with_ttl_policy(&q, &dlx, &dlq).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare_dlx(&ch, &dlx, &dlq).await;
    // The client's own TTL is higher: the lower one (the policy's) applies.
    declare(
        &ch,
        &q,
        table(&[("x-message-ttl", AMQPValue::LongInt(600_000))]),
    )
    .await;
    publish(&ch, &q, "p", AMQPProperties::default()).await;
    let dead = get(&ch, &dlq).await;
    assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("expired"));
    assert_eq!(field(&x_death(&dead)[0], "queue"), &ls(&q));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_length_drop_head_dead_letters_the_oldest_as_maxlen() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(&ch, &[("x-max-length", AMQPValue::LongInt(1))]).await;
    for p in ["p1", "p2", "p3"] {
        publish(&ch, &q, p, AMQPProperties::default()).await;
    }
    wait_count(&ch, &q, 1).await;
    for expected in ["p1", "p2"] {
        let dead = get(&ch, &dlq).await;
        assert_eq!(payload(&dead), expected);
        assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("maxlen"));
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(payload(&get(&ch, &q).await), "p3");
    consume_empty(&ch, &q).await;
    consume_empty(&ch, &dlq).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_publish_dlx_nacks_and_dead_letters_the_new_messages() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, _dlx, dlq) = topology(
        &ch,
        &[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", ls("reject-publish-dlx")),
        ],
    )
    .await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut acks = Vec::new();
    for p in ["p1", "p2", "p3"] {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                p.as_bytes(),
                AMQPProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        acks.push(confirm.is_ack());
    }
    assert_eq!(acks, vec![true, false, false]);
    for expected in ["p2", "p3"] {
        let dead = get(&ch, &dlq).await;
        assert_eq!(payload(&dead), expected);
        assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("maxlen"));
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(payload(&get(&ch, &q).await), "p1");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_self_loops_are_dropped_as_cycles() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ttl-loop");
    declare(
        &ch,
        &q,
        table(&[
            ("x-message-ttl", AMQPValue::LongInt(1)),
            ("x-dead-letter-exchange", ls("")),
        ]),
    )
    .await;
    publish(&ch, &q, "p1", AMQPProperties::default()).await;
    publish(&ch, &q, "p2", AMQPProperties::default()).await;
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "cycle"), ("queue", &q), ("vhost", "/")],
            2.0,
        )
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    consume_empty(&ch, &q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_with_cc_routes_every_key_and_records_them() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("cc-ttl");
    let dlx = unique("cc-ttl-dlx");
    let cc = unique("cc-ttl-key");
    let by_src = unique("by-src");
    let by_cc = unique("by-cc");
    exchange(&ch, &dlx, ExchangeKind::Direct).await;
    for (queue, key) in [(&by_src, &q), (&by_cc, &cc)] {
        declare(&ch, queue, FieldTable::default()).await;
        bind(&ch, queue, &dlx, key).await;
    }
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls(&dlx))])).await;
    let props = AMQPProperties::default()
        .with_expiration("20".into())
        .with_headers(table(&[("CC", strings(&[&cc]))]));
    publish(&ch, &q, "m", props).await;
    for queue in [&by_src, &by_cc] {
        let dead = get(&ch, queue).await;
        assert_eq!(dead.routing_key.as_str(), q);
        assert_eq!(header(&dead, "CC"), Some(&strings(&[&cc])));
        let deaths = x_death(&dead);
        assert_eq!(field(&deaths[0], "routing-keys"), &strings(&[&q, &cc]));
        assert_eq!(field(&deaths[0], "original-expiration"), &ls("20"));
        no_capture_trace(&dead, &proxy.capture);
    }
    proxy.stop().await;
}

/// RabbitMQ's own test dead_letter_reject_expire_expire, which 3.10.8 fails (its x-death
/// reversal makes it see a false cycle): b (reject) → a2 (TTL) → a3 (TTL) → b, twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_expire_expire_loops_keep_the_history_in_order() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let b = unique("b");
    let a2 = unique("a2");
    let a3 = unique("a3");
    declare(
        &ch,
        &b,
        table(&[
            ("x-dead-letter-exchange", ls("")),
            ("x-dead-letter-routing-key", ls(&a2)),
        ]),
    )
    .await;
    declare(
        &ch,
        &a2,
        table(&[
            ("x-dead-letter-exchange", ls("")),
            ("x-dead-letter-routing-key", ls(&a3)),
            ("x-message-ttl", AMQPValue::LongInt(5)),
        ]),
    )
    .await;
    declare(
        &ch,
        &a3,
        table(&[
            ("x-dead-letter-exchange", ls("")),
            ("x-dead-letter-routing-key", ls(&b)),
            ("x-message-ttl", AMQPValue::LongInt(5)),
        ]),
    )
    .await;
    publish(&ch, &b, "loop", AMQPProperties::default()).await;
    for round in 1..=2i64 {
        let d = get(&ch, &b).await;
        if round == 2 {
            let deaths = x_death(&d);
            let order: Vec<(&AMQPValue, &AMQPValue)> = deaths
                .iter()
                .map(|e| (field(e, "queue"), field(e, "reason")))
                .collect();
            assert_eq!(
                order,
                vec![
                    (&ls(&a3), &ls("expired")),
                    (&ls(&a2), &ls("expired")),
                    (&ls(&b), &ls("rejected")),
                ]
            );
        }
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    let d = get(&ch, &b).await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 3);
    for entry in &deaths {
        assert_eq!(field(entry, "count"), &AMQPValue::LongLongInt(2));
    }
    assert_eq!(field(&deaths[0], "queue"), &ls(&a3));
    assert_eq!(field(&deaths[1], "queue"), &ls(&a2));
    assert_eq!(field(&deaths[2], "queue"), &ls(&b));
    assert_eq!(header(&d, "x-first-death-queue"), Some(&ls(&b)));
    assert_eq!(header(&d, "x-first-death-reason"), Some(&ls("rejected")));
    proxy.stop().await;
}

/// With a DLX other than the default exchange the proxy cannot see the targets: a TTL loop
/// through a fanout is caught when the message comes back (one lap later than RabbitMQ), and
/// the other target gets exactly one copy, as with RabbitMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_loops_through_other_exchanges_are_dropped_when_they_come_back() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let fan = unique("fan");
    let looping = unique("looping");
    let other = unique("other");
    exchange(&ch, &fan, ExchangeKind::Fanout).await;
    declare(
        &ch,
        &looping,
        table(&[
            ("x-message-ttl", AMQPValue::LongInt(20)),
            ("x-dead-letter-exchange", ls(&fan)),
        ]),
    )
    .await;
    declare(&ch, &other, FieldTable::default()).await;
    for queue in [&looping, &other] {
        bind(&ch, queue, &fan, "").await;
    }
    publish(&ch, &looping, "m", AMQPProperties::default()).await;
    proxy
        .wait_counter(
            "dead_letter_dropped_total",
            &[("cause", "cycle"), ("queue", &looping), ("vhost", "/")],
            1.0,
        )
        .await;
    let first = get(&ch, &other).await;
    assert_eq!(field(&x_death(&first)[0], "queue"), &ls(&looping));
    tokio::time::sleep(Duration::from_millis(300)).await;
    consume_empty(&ch, &other).await;
    consume_empty(&ch, &looping).await;
    proxy.stop().await;
}

/// The usual retry pattern through a dead-letter exchange other than the default one: a
/// wait queue with a TTL dead-letters into the work queue; the consumer takes the message,
/// acks it and republishes it, history and all, into the wait queue. RabbitMQ delivers it to
/// the work queue every time (the work queue, its target, is not in the history); the proxy,
/// which judges the wait queue instead, must not take the republish for a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_republished_into_a_wait_queue_is_no_cycle() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let retry = unique("retry-x");
    let wait = unique("wait");
    let work = unique("work");
    declare_dlx(&ch, &retry, &work).await;
    declare(
        &ch,
        &wait,
        table(&[
            ("x-message-ttl", AMQPValue::LongInt(20)),
            ("x-dead-letter-exchange", ls(&retry)),
            ("x-dead-letter-routing-key", ls(&work)),
        ]),
    )
    .await;
    publish(&ch, &wait, "m", AMQPProperties::default()).await;
    for round in 1..=3i64 {
        let d = get(&ch, &work).await;
        assert_eq!(payload(&d), "m", "round {round}");
        assert_eq!(
            field(&x_death(&d)[0], "count"),
            &AMQPValue::LongLongInt(round)
        );
        no_capture_trace(&d, "capture");
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
        publish(&ch, &wait, "m", d.properties.clone()).await;
    }
    let d = get(&ch, &work).await;
    assert_eq!(payload(&d), "m");
    assert_eq!(
        proxy.counter(
            "dead_letter_dropped_total",
            &[("cause", "cycle"), ("queue", &wait), ("vhost", "/")]
        ),
        0.0
    );
    proxy.stop().await;
}

/// A publisher cannot choose where its message is dead-lettered: a queue without a
/// dead-letter routing key of its own (here its target comes from a policy) reaches the
/// capture queue with the key the message was published with, and a capture tag there,
/// naming another exchange, is the publisher's, not the queue's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_tag_chosen_by_the_publisher_is_not_followed() {
    let q = unique("forged");
    let (dlx, dlq) = (unique("forged-policy-dlx"), unique("forged-policy-dlq"));
    let (chosen_x, chosen_q) = (unique("chosen-x"), unique("chosen-q"));
    let proxy = with_ttl_policy(&q, &dlx, &dlq).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_dlx(&ch, &chosen_x, &chosen_q).await;
    let fanout = unique("forged-fanout");
    exchange(&ch, &fanout, ExchangeKind::Fanout).await;
    declare(&ch, &q, FieldTable::default()).await;
    bind(&ch, &q, &fanout, "").await;
    let forged = dlx_proxy::proxy::declare::CaptureTag {
        dead_letter_exchange: Some(chosen_x.clone()),
        dead_letter_routing_key: Some(chosen_q.clone()),
        delivery_limit: None,
        retry_delays: None,
    }
    .encode()
    .expect("a short tag");
    ch.basic_publish(
        fanout.as_str().into(),
        forged.as_str().into(),
        BasicPublishOptions::default(),
        b"m",
        AMQPProperties::default(),
    )
    .await
    .unwrap();
    let dead = get(&ch, &dlq).await;
    assert_eq!(dead.routing_key.as_str(), dlq);
    let deaths = x_death(&dead);
    assert_eq!(field(&deaths[0], "reason"), &ls("expired"));
    assert_eq!(field(&deaths[0], "routing-keys"), &strings(&[&forged]));
    proxy.wait_dead_lettered(&q, "expired", 1.0).await;
    consume_empty(&ch, &chosen_q).await;
    proxy.stop().await;
}
