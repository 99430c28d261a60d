//! The headers a dead-lettered message carries: `x-death` (values and AMQP field types),
//! `x-first-death-*`, `x-last-death-*` (compat 4), client-supplied histories, and the
//! `x-death-total` / `max_hops` options. RabbitMQ's cases H1–H8 (reference §1.8; H8 with a
//! classic queue instead of a stream) and the 3.10.8 probes E1, E3, E6 and E7.

use crate::common;

use common::dl::*;
use common::*;
use dlx_proxy::config::Config;

fn config(compat: &str) -> Config {
    let mut cfg = test_config();
    cfg.dead_letter.compat = compat.into();
    cfg
}

/// H1: exactly one entry with every field and its type.
#[tokio::test]
async fn dead_letter_headers() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1"]).await;
    get_and_nack(&ch, "q", "p1").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    // Raw shape, field by field (x_death() checks the same strictly).
    let Some(AMQPValue::FieldArray(arr)) = header(&d, "x-death") else {
        panic!("x-death must be a FieldArray");
    };
    assert_eq!(arr.as_slice().len(), 1);
    let AMQPValue::FieldTable(entry) = &arr.as_slice()[0] else {
        panic!("x-death entries are FieldTables");
    };
    let f = entry.inner();
    assert_eq!(f.get("queue"), Some(&ls("q")));
    assert_eq!(f.get("reason"), Some(&ls("rejected")));
    assert_eq!(f.get("exchange"), Some(&ls("")));
    assert_eq!(f.get("count"), Some(&AMQPValue::LongLongInt(1)));
    assert_eq!(f.get("routing-keys"), Some(&ls_array(&["q"])));
    assert!(matches!(f.get("time"), Some(AMQPValue::Timestamp(_))));
    assert!(f.get("original-expiration").is_none());
    assert_eq!(f.len(), 6);
    let deaths = x_death(&d);
    assert_eq!(deaths[0].qrc(), ("q", "rejected", 1));
    assert_first_death(&d, "rejected", "q", "");
    // compat 3: no x-last-death-*.
    assert!(header(&d, "x-last-death-reason").is_none());
}

/// H2 and E3: a repeated {queue, reason} keeps one entry; count 2; time, exchange and keys
/// keep their first values.
#[tokio::test]
async fn dead_letter_headers_cycle() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[])).await;
    publish(&ch, "q", &["p"]).await;
    get_and_nack(&ch, "q", "p").await;
    let d = get_one(&ch, "q").await;
    let first = x_death(&d);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].qrc(), ("q", "rejected", 1));
    assert_eq!(d.exchange.as_str(), "");
    assert_eq!(d.routing_key.as_str(), "q");
    nack(&ch, d.delivery_tag, false, false).await;
    let d = get_one(&ch, "q").await;
    let second = x_death(&d);
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].qrc(), ("q", "rejected", 2));
    assert_eq!(second[0].time, first[0].time);
    assert_eq!(second[0].exchange, first[0].exchange);
    assert_eq!(second[0].routing_keys, first[0].routing_keys);
}

/// H3: one entry per event, newest first.
#[tokio::test]
async fn dead_letter_headers_should_be_appended_for_each_event() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", dead_letter_to("dlx1", &[])).await;
    declare(&ch, "dlx1", dead_letter_to("dlx2", &[])).await;
    declare(&ch, "dlx2", FieldTable::default()).await;
    publish(&ch, "q", &["m"]).await;
    get_and_nack(&ch, "q", "m").await;
    b.wait_counts("dlx1", 1, 0).await;
    let d = get_one(&ch, "dlx1").await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].queue, "q");
    nack(&ch, d.delivery_tag, false, false).await;
    b.wait_counts("dlx2", 1, 0).await;
    let d = get_one(&ch, "dlx2").await;
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        [("dlx1", "rejected", 1), ("q", "rejected", 1)]
    );
    assert_eq!(deaths[0].routing_keys, ["dlx1"]);
    assert_eq!(deaths[1].routing_keys, ["q"]);
}

/// E4 done right: a chain c0 → c1 → c2 → c3 gives [c2, c1, c0] (3.10.8 gives [c2, c0, c1]).
#[tokio::test]
async fn x_death_order_with_three_entries_is_newest_first() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "c0", dead_letter_to("c1", &[])).await;
    declare(&ch, "c1", dead_letter_to("c2", &[])).await;
    declare(&ch, "c2", dead_letter_to("c3", &[])).await;
    declare(&ch, "c3", FieldTable::default()).await;
    publish(&ch, "c0", &["m"]).await;
    for q in ["c0", "c1", "c2"] {
        b.wait_counts(q, 1, 0).await;
        let d = get_one(&ch, q).await;
        reject(&ch, d.delivery_tag, false).await;
    }
    b.wait_counts("c3", 1, 0).await;
    let d = get_one(&ch, "c3").await;
    let queues: Vec<String> = x_death(&d).into_iter().map(|e| e.queue).collect();
    assert_eq!(queues, ["c2", "c1", "c0"]);
    assert_first_death(&d, "rejected", "c0", "");
}

async fn republish_scenario(b: &TestBroker) -> Delivery {
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", dead_letter_to("dlx", &[])).await;
    declare(&ch, "dlx", FieldTable::default()).await;
    publish(&ch, "q", &["m"]).await;
    get_and_nack(&ch, "q", "m").await;
    b.wait_counts("dlx", 1, 0).await;
    let d = get_one(&ch, "dlx").await;
    assert_eq!(x_death(&d)[0].qrc(), ("q", "rejected", 1));
    let headers1 = d.properties.headers().clone().expect("headers");
    ack(&ch, d.delivery_tag, false).await;
    ch.queue_delete("q".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    declare(
        &ch,
        "q",
        dead_letter_to("dlx", &[("x-message-ttl", int(1))]),
    )
    .await;
    publish_headers(&ch, "q", "m", headers1).await;
    b.wait_counts("dlx", 1, 0).await;
    get_one(&ch, "dlx").await
}

/// H4a / E6 (3.x semantics, our default): a client's x-death is continued.
#[tokio::test]
async fn dead_letter_headers_should_be_appended_for_republish() {
    let b = start().await;
    let d = republish_scenario(&b).await;
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        [("q", "expired", 1), ("q", "rejected", 1)]
    );
    assert_first_death(&d, "rejected", "q", "");
}

/// H4b (`dead_letter.compat = "4"`): a client's x-death is ignored and overwritten.
#[tokio::test]
async fn dead_letter_headers_should_not_be_appended_for_republish() {
    let b = start_with(config("4")).await;
    let d = republish_scenario(&b).await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), ("q", "expired", 1));
    assert_first_death(&d, "expired", "q", "");
    assert_eq!(header_str(&d, "x-last-death-reason"), "expired");
}

/// H5: republishing the whole received message continues its entry: count 2, same time.
#[tokio::test]
async fn x_death_header_from_amqpl_client() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(0))]).await;
    publish(&ch, "q", &["m"]).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = ch
        .basic_get("dlq".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap()
        .delivery;
    let first = x_death(&d);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].count, 1);
    assert!(first[0].time.abs_diff(now_secs()) <= 10);
    publish_to(&ch, "", "q", &d.data, d.properties.clone()).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let second = x_death(&d);
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].qrc(), ("q", "expired", 2));
    assert_eq!(second[0].time, first[0].time);
}

/// H6: x-first-death-* are set once and never changed.
#[tokio::test]
async fn dead_letter_headers_first_death() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    // Make DLQ dead-letter back to Q.
    ch.queue_delete("dlq".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    declare(&ch, "dlq", dead_letter_to("q", &[])).await;
    bind(&ch, "dlq", &dlx, "dlq").await;
    publish(&ch, "q", &["m"]).await;
    get_and_nack(&ch, "q", "m").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_first_death(&d, "rejected", "q", "");
    nack(&ch, d.delivery_tag, false, false).await;
    b.wait_counts("q", 1, 0).await;
    let d = get_one(&ch, "q").await;
    assert_first_death(&d, "rejected", "q", "");
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        [("dlq", "rejected", 1), ("q", "rejected", 1)]
    );
    assert_eq!(x_death(&d)[0].exchange, dlx);
}

/// H7: x-first-death-* route through a headers DLX with all-with-x / any-with-x bindings.
#[tokio::test]
async fn dead_letter_headers_first_death_route() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "hdlx", ExchangeKind::Headers).await;
    for q in ["q1", "q2"] {
        declare(&ch, q, table(&[("x-dead-letter-exchange", ls("hdlx"))])).await;
    }
    declare(&ch, "expired_q", FieldTable::default()).await;
    declare(&ch, "rejected_q", FieldTable::default()).await;
    bind_with(
        &ch,
        "expired_q",
        "hdlx",
        "",
        table(&[
            ("x-match", ls("all-with-x")),
            ("x-first-death-reason", ls("expired")),
            ("x-first-death-queue", ls("q1")),
        ]),
    )
    .await;
    bind_with(
        &ch,
        "rejected_q",
        "hdlx",
        "",
        table(&[
            ("x-match", ls("any-with-x")),
            ("x-first-death-reason", ls("rejected")),
        ]),
    )
    .await;
    let zero = BasicProperties::default().with_expiration("0".into());
    publish_to(&ch, "", "q1", b"p1", zero.clone()).await;
    b.wait_counts("expired_q", 1, 0).await;
    consume_empty(&ch, "q1").await;
    consume(&ch, "expired_q", &["p1"]).await;
    publish_to(&ch, "", "q2", b"p2", zero).await;
    b.wait_counts("q2", 0, 0).await;
    b.stays_counts("expired_q", 0, 1, 50).await;
    assert_eq!(b.dropped("q2", "unroutable"), 1);
    publish(&ch, "q2", &["p3"]).await;
    b.wait_counts("q2", 1, 0).await;
    get_and_reject(&ch, "q2", "p3").await;
    b.wait_counts("rejected_q", 1, 0).await;
    consume(&ch, "rejected_q", &["p3"]).await;
}

/// H8 (`stream` upstream, with a classic Q3) under compat 4: first and last death headers,
/// recency order, routing keys of each death, original-expiration on the per-message death.
#[tokio::test]
async fn stream() {
    let b = start_with(config("4")).await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q1", dead_letter_to("q2", &[])).await;
    declare(
        &ch,
        "q2",
        dead_letter_to("q3", &[("x-message-ttl", int(20))]),
    )
    .await;
    declare(&ch, "q3", FieldTable::default()).await;
    let props = BasicProperties::default()
        .with_expiration("0".into())
        .with_headers(table(&[
            ("CC", ls_array(&["cc 1", "cc 2"])),
            ("BCC", ls_array(&["bcc 1", "bcc 2"])),
        ]));
    publish_to(&ch, "", "q1", b"m", props).await;
    b.wait_counts("q3", 1, 0).await;
    let d = get_one(&ch, "q3").await;
    assert_first_death(&d, "expired", "q1", "");
    assert_eq!(header_str(&d, "x-last-death-reason"), "expired");
    assert_eq!(header_str(&d, "x-last-death-queue"), "q2");
    assert_eq!(header_str(&d, "x-last-death-exchange"), "");
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 2);
    let (death2, death1) = (&deaths[0], &deaths[1]);
    assert_eq!(death1.qrc(), ("q1", "expired", 1));
    assert_eq!(death1.exchange, "");
    assert_eq!(death1.routing_keys, ["q1", "cc 1", "cc 2"]);
    assert_eq!(death1.original_expiration.as_deref(), Some("0"));
    assert_eq!(death2.qrc(), ("q2", "expired", 1));
    assert_eq!(death2.exchange, "");
    // death2.routing_keys: see stream_second_death_routing_keys_compat_4.
    assert_eq!(death2.routing_keys[0], "q2");
    assert_eq!(death2.original_expiration, None);
    assert!(death2.time >= death1.time);
    assert_eq!(header(&d, "CC"), Some(&ls_array(&["cc 1", "cc 2"])));
    assert!(header(&d, "BCC").is_none());
}

/// H8's routing-keys of the second death under compat 4: RabbitMQ 4.x records the keys the
/// message was routed with, `[q2]` (the DLRK); the kept CC header is not among them.
#[tokio::test]
async fn stream_second_death_routing_keys_compat_4() {
    let b = start_with(config("4")).await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q1", dead_letter_to("q2", &[])).await;
    declare(
        &ch,
        "q2",
        dead_letter_to("q3", &[("x-message-ttl", int(1))]),
    )
    .await;
    declare(&ch, "q3", FieldTable::default()).await;
    let props = BasicProperties::default()
        .with_expiration("0".into())
        .with_headers(table(&[("CC", ls_array(&["cc 1", "cc 2"]))]));
    publish_to(&ch, "", "q1", b"m", props).await;
    b.wait_counts("q3", 1, 0).await;
    let d = get_one(&ch, "q3").await;
    let deaths = x_death(&d);
    assert_eq!(deaths[1].routing_keys, ["q1", "cc 1", "cc 2"]);
    assert_eq!(deaths[0].routing_keys, ["q2"]);
}

/// compat 4 x-last-death-* follow every death while x-first-death-* stay.
#[tokio::test]
async fn last_death_headers_follow_each_death_in_compat_4() {
    let b = start_with(config("4")).await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    ch.queue_delete("dlq".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    declare(
        &ch,
        "dlq",
        dead_letter_to("last", &[("x-message-ttl", int(1))]),
    )
    .await;
    bind(&ch, "dlq", &dlx, "dlq").await;
    declare(&ch, "last", FieldTable::default()).await;
    publish(&ch, "q", &["m"]).await;
    get_and_reject(&ch, "q", "m").await;
    b.wait_counts("last", 1, 0).await;
    let d = get_one(&ch, "last").await;
    assert_first_death(&d, "rejected", "q", "");
    assert_eq!(header_str(&d, "x-last-death-reason"), "expired");
    assert_eq!(header_str(&d, "x-last-death-queue"), "dlq");
    assert_eq!(header_str(&d, "x-last-death-exchange"), dlx);
}

/// E1: headers come out sorted, CC removed with a DLRK (compat 3), other properties kept,
/// expiration absent; deliver fields name the DLX and DLRK.
#[tokio::test]
async fn dead_lettered_properties_and_header_layout() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let dlx = declare_dead_letter_queues(&ch, "src", "dlq", &[]).await;
    let props = BasicProperties::default()
        .with_headers(table(&[
            ("zz", int(1)),
            ("aa", ls("x")),
            ("CC", ls_array(&["k"])),
        ]))
        .with_message_id("id-1".into())
        .with_priority(3)
        .with_timestamp(12345)
        .with_content_type("text/plain".into())
        .with_correlation_id("corr".into())
        .with_reply_to("replies".into())
        .with_delivery_mode(2)
        .with_app_id("app".into())
        .with_type("kind".into())
        .with_user_id("guest".into())
        .with_content_encoding("identity".into());
    publish_to(&ch, "", "src", b"body", props.clone()).await;
    get_and_nack(&ch, "src", "body").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(d.exchange.as_str(), dlx);
    assert_eq!(d.routing_key.as_str(), "dlq");
    assert!(!d.redelivered);
    assert_eq!(
        header_names(&d),
        [
            "aa",
            "x-death",
            "x-first-death-exchange",
            "x-first-death-queue",
            "x-first-death-reason",
            "zz"
        ]
    );
    assert_eq!(header(&d, "aa"), Some(&ls("x")));
    assert_eq!(header(&d, "zz"), Some(&int(1)));
    assert_eq!(x_death(&d)[0].routing_keys, ["src", "k"]);
    let p = &d.properties;
    assert_eq!(p.message_id(), props.message_id());
    assert_eq!(p.priority(), &Some(3));
    assert_eq!(p.timestamp(), &Some(12345));
    assert_eq!(p.content_type(), props.content_type());
    assert_eq!(p.content_encoding(), props.content_encoding());
    assert_eq!(p.correlation_id(), props.correlation_id());
    assert_eq!(p.reply_to(), props.reply_to());
    assert_eq!(p.delivery_mode(), &Some(2));
    assert_eq!(p.app_id(), props.app_id());
    assert_eq!(p.kind(), props.kind());
    assert_eq!(p.user_id(), props.user_id());
    assert_eq!(p.expiration(), &None);
    assert_eq!(d.data, b"body");
}

/// E7: an x-death that is not an array is replaced by one fresh entry; no x-first-death-*.
#[tokio::test]
async fn x_death_of_wrong_type_is_reset() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish_headers(&ch, "q", "m", table(&[("x-death", ls("garbage"))])).await;
    get_and_nack(&ch, "q", "m").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), ("q", "rejected", 1));
    assert!(header(&d, "x-first-death-reason").is_none());
    assert!(header(&d, "x-first-death-queue").is_none());
}

/// A client's history with an entry for the same {queue, reason} is continued (count + 1,
/// moved to the front, the client's x-first-death-* kept).
#[tokio::test]
async fn client_history_entry_is_incremented_and_moved_to_front() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    let entry = |q: &str, reason: &str, count: i64| {
        AMQPValue::FieldTable(table(&[
            ("count", AMQPValue::LongLongInt(count)),
            ("reason", ls(reason)),
            ("queue", ls(q)),
            ("time", AMQPValue::Timestamp(now_secs() - 5)),
            ("exchange", ls("")),
            ("routing-keys", ls_array(&[q])),
        ]))
    };
    let history = AMQPValue::FieldArray(FieldArray::from(vec![
        entry("other", "expired", 1),
        entry("q", "rejected", 4),
        entry("third", "maxlen", 2),
    ]));
    publish_headers(
        &ch,
        "q",
        "m",
        table(&[
            ("x-death", history),
            ("x-first-death-reason", ls("maxlen")),
            ("x-first-death-queue", ls("third")),
            ("x-first-death-exchange", ls("")),
        ]),
    )
    .await;
    get_and_nack(&ch, "q", "m").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        [
            ("q", "rejected", 5),
            ("other", "expired", 1),
            ("third", "maxlen", 2)
        ]
    );
    assert_eq!(
        deaths[0].time,
        now_secs() - 5,
        "time of the first death kept"
    );
    assert_first_death(&d, "maxlen", "third", "");
}

/// `dead_letter.x_death_total = true`: an int64 `x-death-total` counts every death.
#[tokio::test]
async fn x_death_total_counts_every_death() {
    let mut cfg = test_config();
    cfg.dead_letter.x_death_total = true;
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", dead_letter_to("r", &[])).await;
    declare(&ch, "r", dead_letter_to("q", &[])).await;
    publish(&ch, "q", &["m"]).await;
    for (deaths_so_far, q) in (0i64..).zip(["q", "r", "q", "r"]) {
        b.wait_counts(q, 1, 0).await;
        let d = get_one(&ch, q).await;
        if deaths_so_far == 0 {
            assert!(header(&d, "x-death-total").is_none());
        } else {
            assert_eq!(
                header(&d, "x-death-total"),
                Some(&AMQPValue::LongLongInt(deaths_so_far))
            );
        }
        reject(&ch, d.delivery_tag, false).await;
    }
    let d = get_one(&ch, "q").await;
    assert_eq!(
        header(&d, "x-death-total"),
        Some(&AMQPValue::LongLongInt(4))
    );
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        [("r", "rejected", 2), ("q", "rejected", 2)]
    );
}

/// Off by default: no x-death-total.
#[tokio::test]
async fn x_death_total_is_off_by_default() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[])).await;
    publish(&ch, "q", &["m"]).await;
    get_and_reject(&ch, "q", "m").await;
    let d = get_one(&ch, "q").await;
    assert!(header(&d, "x-death-total").is_none());
}

/// `dead_letter.max_hops = 2`: the third death drops the message (cause `hop_limit`), even
/// in a loop that rejections keep alive.
#[tokio::test]
async fn max_hops_drops_after_the_limit() {
    let mut cfg = test_config();
    cfg.dead_letter.max_hops = 2;
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[])).await;
    publish(&ch, "q", &["m"]).await;
    for hop in 1..=2i64 {
        get_and_reject(&ch, "q", "m").await;
        b.wait_counts("q", 1, 0).await;
        let d = get_one(&ch, "q").await;
        assert_eq!(x_death(&d)[0].count, hop);
        nack(&ch, d.delivery_tag, false, true).await;
    }
    get_and_reject(&ch, "q", "m").await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dropped("q", "hop_limit"), 1);
    assert_eq!(b.dead_lettered("q", "rejected"), 3);
}
