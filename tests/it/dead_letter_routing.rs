//! How dead-lettered messages are routed: missing or unroutable dead-letter exchanges, the
//! dead-letter routing key versus the original keys, CC and BCC, after RabbitMQ's cases X1–X7
//! (reference §1.5) and the 3.10.8 probes E2 and E8, plus alternate exchanges and
//! exchange-to-exchange bindings behind a DLX.
#![allow(non_snake_case)] // test names keep the upstream spelling (CC, BCC)

use crate::common;

use common::dl::*;
use common::*;
use dlx_proxy::config::Config;

fn with_cc_bcc(cc: &[&str], bcc: &[&str]) -> BasicProperties {
    let mut h = Vec::new();
    if !cc.is_empty() {
        h.push(("CC", ls_array(cc)));
    }
    if !bcc.is_empty() {
        h.push(("BCC", ls_array(bcc)));
    }
    BasicProperties::default().with_headers(table(&h))
}

/// X1: a DLX that does not exist drops the message silently (counted `no_dlx`); once the
/// exchange exists, the next one is delivered.
#[tokio::test]
async fn dead_letter_missing_exchange() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "q",
        table(&[
            ("x-max-length", int(1)),
            ("x-dead-letter-exchange", ls("dlx-exchange-2")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    declare(&ch, "dlq", FieldTable::default()).await;
    publish(&ch, "q", &["p1"]).await;
    get_and_reject(&ch, "q", "p1").await;
    b.wait_counts("q", 0, 0).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dropped("q", "no_dlx"), 1);
    exchange(&ch, "dlx-exchange-2", ExchangeKind::Direct).await;
    bind(&ch, "dlq", "dlx-exchange-2", "dlq").await;
    publish(&ch, "q", &["p2"]).await;
    get_and_reject(&ch, "q", "p2").await;
    b.wait_counts("dlq", 1, 0).await;
    consume(&ch, "dlq", &["p2"]).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 2);
    assert_eq!(b.dropped("q", "no_dlx"), 1);
}

/// X2: without a DLRK the original routing key is used; unbound → dropped (`unroutable`);
/// bound with the original key → delivered with that routing key.
#[tokio::test]
async fn dead_letter_routing_key() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "dlx", ExchangeKind::Direct).await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    declare(&ch, "dlq", FieldTable::default()).await;
    publish(&ch, "q", &["p1"]).await;
    get_and_nack(&ch, "q", "p1").await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dropped("q", "unroutable"), 1);
    bind(&ch, "dlq", "dlx", "q").await;
    publish(&ch, "q", &["p2"]).await;
    get_and_nack(&ch, "q", "p2").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p2");
    assert_eq!(d.exchange.as_str(), "dlx");
    assert_eq!(d.routing_key.as_str(), "q");
    assert_eq!(b.dead_lettered("q", "rejected"), 2);
}

/// X3: without a DLRK the CC keys route too; a message without a matching key is unroutable.
#[tokio::test]
async fn dead_letter_routing_key_header_CC() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    publish(&ch, "q", &["p1"]).await;
    publish_to(&ch, "", "q", b"p2", with_cc_bcc(&["dlq"], &[])).await;
    b.wait_counts("q", 2, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2"]).await;
    // The CC copy went to the queue named dlq through the default exchange.
    consume(&ch, "dlq", &["p2"]).await;
    nack(&ch, tags[1], true, false).await;
    b.wait_counts("dlq", 1, 1).await;
    consume_empty(&ch, "q").await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p2");
    assert_eq!(d.routing_key.as_str(), "q");
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dropped("q", "unroutable"), 1);
}

/// X4: the BCC keys route the dead-lettered copy too, though the header is never visible.
#[tokio::test]
async fn dead_letter_routing_key_header_BCC() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    publish(&ch, "q", &["p1"]).await;
    publish_to(&ch, "", "q", b"p2", with_cc_bcc(&[], &["dlq"])).await;
    b.wait_counts("q", 2, 0).await;
    let tags = consume(&ch, "q", &["p1", "p2"]).await;
    let bcc_copy = get_one(&ch, "dlq").await;
    assert_eq!(payload(&bcc_copy), "p2");
    assert!(header(&bcc_copy, "BCC").is_none());
    nack(&ch, tags[1], true, false).await;
    b.wait_counts("dlq", 1, 1).await;
    consume_empty(&ch, "q").await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p2");
    assert!(header(&d, "BCC").is_none());
    let deaths = x_death(&d);
    assert_eq!(deaths[0].routing_keys, ["q"], "BCC never in routing-keys");
    consume_empty(&ch, "dlq").await;
}

/// X5: without a DLRK the CC header is kept on the dead-lettered copy.
#[tokio::test]
async fn dead_letter_headers_CC() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    publish_to(&ch, "", "q", b"p1", with_cc_bcc(&["dlq"], &[])).await;
    let from_q = get_one(&ch, "q").await;
    let from_dlq = get_one(&ch, "dlq").await;
    assert!(header(&from_q, "x-death").is_none());
    assert!(header(&from_dlq, "x-death").is_none());
    nack(&ch, from_q.delivery_tag, false, false).await;
    b.wait_counts("dlq", 1, 1).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(header(&d, "CC"), Some(&ls_array(&["dlq"])));
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].routing_keys, ["q", "dlq"]);
    assert_eq!(d.routing_key.as_str(), "q");
    ack(&ch, d.delivery_tag, true).await;
    b.wait_counts("dlq", 0, 0).await;
}

async fn cc_with_routing_key(compat: &str) -> Delivery {
    let mut cfg: Config = test_config();
    cfg.dead_letter.compat = compat.into();
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "dlx", ExchangeKind::Direct).await;
    declare(
        &ch,
        "q",
        table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    declare(&ch, "dlq", FieldTable::default()).await;
    bind(&ch, "dlq", "dlx", "dlq").await;
    publish_to(&ch, "", "q", b"p1", with_cc_bcc(&["dlq"], &[])).await;
    let from_q = get_one(&ch, "q").await;
    let from_dlq = get_one(&ch, "dlq").await;
    assert!(header(&from_q, "x-death").is_none());
    assert!(header(&from_dlq, "x-death").is_none());
    nack(&ch, from_q.delivery_tag, false, false).await;
    b.wait_counts("dlq", 1, 1).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(d.routing_key.as_str(), "dlq");
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    // The death records the keys the message had: publish key, then CC.
    assert_eq!(deaths[0].routing_keys, ["q", "dlq"]);
    d
}

/// X6 (3.10 behaviour, our default): a DLRK removes the CC header.
#[tokio::test]
async fn dead_letter_headers_CC_with_routing_key() {
    let d = cc_with_routing_key("3").await;
    assert!(header(&d, "CC").is_none());
}

/// X6 with `dead_letter.compat = "4"`: the CC header is kept.
#[tokio::test]
async fn dead_letter_headers_CC_with_routing_key_compat_4() {
    let d = cc_with_routing_key("4").await;
    assert_eq!(header(&d, "CC"), Some(&ls_array(&["dlq"])));
}

/// X7: BCC is removed; routing-keys hold the publish key and the CC keys, never BCC.
#[tokio::test]
async fn dead_letter_headers_BCC() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    publish_to(
        &ch,
        "",
        "q",
        b"p1",
        with_cc_bcc(&["cc 1", "cc 2"], &["dlq", "bcc 2"]),
    )
    .await;
    let from_q = get_one(&ch, "q").await;
    let from_dlq = get_one(&ch, "dlq").await;
    for d in [&from_q, &from_dlq] {
        assert!(header(d, "x-death").is_none());
        assert!(header(d, "BCC").is_none());
        assert_eq!(header(d, "CC"), Some(&ls_array(&["cc 1", "cc 2"])));
    }
    nack(&ch, from_q.delivery_tag, false, false).await;
    b.wait_counts("dlq", 1, 1).await;
    let d = get_one(&ch, "dlq").await;
    assert!(header(&d, "BCC").is_none());
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    let mut keys = deaths[0].routing_keys.clone();
    keys.sort();
    assert_eq!(keys, ["cc 1", "cc 2", "q"]);
    assert_eq!(deaths[0].routing_keys[0], "q", "publish key first");
}

/// E2: per-message TTL, DLX without DLRK, CC and BCC: every key routes a copy; the entry has
/// original-expiration and routing-keys [src, cc]; the delivery's routing key is the original.
#[tokio::test]
async fn ttl_with_cc_and_bcc_routes_to_every_original_key() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "dlx", ExchangeKind::Direct).await;
    declare(&ch, "src", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    for (q, key) in [
        ("bound-src", "src"),
        ("bound-cc", "cc1key"),
        ("bound-bcc", "bcckey"),
    ] {
        declare(&ch, q, FieldTable::default()).await;
        bind(&ch, q, "dlx", key).await;
    }
    publish_to(
        &ch,
        "",
        "src",
        b"m",
        with_cc_bcc(&["cc1key"], &["bcckey"]).with_expiration("50".into()),
    )
    .await;
    for q in ["bound-src", "bound-cc", "bound-bcc"] {
        b.wait_counts(q, 1, 0).await;
        let d = get_one(&ch, q).await;
        assert_eq!(d.exchange.as_str(), "dlx");
        assert_eq!(d.routing_key.as_str(), "src");
        assert_eq!(
            header_names(&d),
            [
                "CC",
                "x-death",
                "x-first-death-exchange",
                "x-first-death-queue",
                "x-first-death-reason"
            ]
        );
        let deaths = x_death(&d);
        assert_eq!(deaths[0].original_expiration.as_deref(), Some("50"));
        assert_eq!(deaths[0].routing_keys, ["src", "cc1key"]);
        assert_eq!(d.properties.expiration(), &None);
    }
}

/// E8: two hops through a named DLX then the default exchange; each entry records the
/// exchange and keys the message had before that death.
#[tokio::test]
async fn two_hops_record_exchange_and_keys_per_death() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "p4_d1", ExchangeKind::Direct).await;
    declare(
        &ch,
        "q1",
        table(&[
            ("x-dead-letter-exchange", ls("p4_d1")),
            ("x-dead-letter-routing-key", ls("k2")),
        ]),
    )
    .await;
    declare(&ch, "q2", dead_letter_to("q3", &[])).await;
    bind(&ch, "q2", "p4_d1", "k2").await;
    declare(&ch, "q3", FieldTable::default()).await;
    publish(&ch, "q1", &["m"]).await;
    get_and_reject(&ch, "q1", "m").await;
    let d = get_one(&ch, "q2").await;
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str()),
        ("p4_d1", "k2")
    );
    reject(&ch, d.delivery_tag, false).await;
    b.wait_counts("q3", 1, 0).await;
    let d = get_one(&ch, "q3").await;
    assert_eq!((d.exchange.as_str(), d.routing_key.as_str()), ("", "q3"));
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 2);
    assert_eq!(deaths[0].qrc(), ("q2", "rejected", 1));
    assert_eq!(deaths[0].exchange, "p4_d1");
    assert_eq!(deaths[0].routing_keys, ["k2"]);
    assert_eq!(deaths[1].qrc(), ("q1", "rejected", 1));
    assert_eq!(deaths[1].exchange, "");
    assert_eq!(deaths[1].routing_keys, ["q1"]);
    assert_first_death(&d, "rejected", "q1", "");
}

/// The DLX routes like any exchange: exchange-to-exchange bindings are followed, and an
/// alternate exchange takes what the DLX cannot route.
#[tokio::test]
async fn dlx_exchange_bindings_and_alternate_exchange_apply() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "ae", ExchangeKind::Fanout).await;
    ch.exchange_declare(
        "dlx".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        table(&[("alternate-exchange", ls("ae"))]),
    )
    .await
    .unwrap();
    exchange(&ch, "inner", ExchangeKind::Topic).await;
    ch.exchange_bind(
        "inner".into(),
        "dlx".into(),
        "via-e2e".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    declare(&ch, "e2e-target", FieldTable::default()).await;
    bind(&ch, "e2e-target", "inner", "#").await;
    declare(&ch, "ae-target", FieldTable::default()).await;
    bind(&ch, "ae-target", "ae", "").await;
    for (q, dlrk) in [("qa", "via-e2e"), ("qb", "nowhere")] {
        declare(
            &ch,
            q,
            table(&[
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-routing-key", ls(dlrk)),
            ]),
        )
        .await;
        publish(&ch, q, &[q]).await;
        let t = consume(&ch, q, &[q]).await[0];
        reject(&ch, t, false).await;
    }
    b.wait_counts("e2e-target", 1, 0).await;
    b.wait_counts("ae-target", 1, 0).await;
    let d = get_one(&ch, "e2e-target").await;
    assert_eq!((payload(&d).as_str(), d.exchange.as_str()), ("qa", "dlx"));
    let d = get_one(&ch, "ae-target").await;
    assert_eq!(
        (payload(&d).as_str(), d.routing_key.as_str()),
        ("qb", "nowhere")
    );
    assert_eq!(b.dropped("qb", "unroutable"), 0);
}

/// The default exchange as DLX with a key that names no queue: dropped, counted `unroutable`.
#[tokio::test]
async fn default_exchange_dlx_to_missing_queue_is_unroutable() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", dead_letter_to("no-such-queue", &[])).await;
    publish(&ch, "q", &["p"]).await;
    get_and_reject(&ch, "q", "p").await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dropped("q", "unroutable"), 1);
    assert_eq!(b.dead_lettered("q", "rejected"), 1);
}

/// A DLX deleted after the queue was declared: dropped as `no_dlx` (resolved at each death).
#[tokio::test]
async fn dlx_deleted_later_drops_as_no_dlx() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    ch.exchange_delete("q_dlx_exchange".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    publish(&ch, "q", &["p"]).await;
    get_and_reject(&ch, "q", "p").await;
    b.wait_counts("q", 0, 0).await;
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dropped("q", "no_dlx"), 1);
}

/// A topic DLX sees the original routing keys (publish key and CC) when no DLRK is set.
#[tokio::test]
async fn topic_dlx_routes_on_original_keys() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "orders", ExchangeKind::Topic).await;
    exchange(&ch, "dlx", ExchangeKind::Topic).await;
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    bind(&ch, "q", "orders", "order.#").await;
    declare(&ch, "eu", FieldTable::default()).await;
    bind(&ch, "eu", "dlx", "order.eu.*").await;
    declare(&ch, "audit", FieldTable::default()).await;
    bind(&ch, "audit", "dlx", "audit.#").await;
    publish_to(
        &ch,
        "orders",
        "order.eu.created",
        b"o",
        with_cc_bcc(&["audit.orders"], &[]),
    )
    .await;
    get_and_reject(&ch, "q", "o").await;
    for q in ["eu", "audit"] {
        b.wait_counts(q, 1, 0).await;
        let d = get_one(&ch, q).await;
        assert_eq!(d.routing_key.as_str(), "order.eu.created");
        let deaths = x_death(&d);
        assert_eq!(deaths[0].exchange, "orders");
        assert_eq!(deaths[0].routing_keys, ["order.eu.created", "audit.orders"]);
    }
}
