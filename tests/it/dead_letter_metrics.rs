//! The dead-letter metrics, exact values: `dlx_proxy_dead_lettered_total{vhost,queue,reason}`
//! (RabbitMQ's `metric_*` cases, reference §1.9, with no DLX: counted like RabbitMQ's strategy
//! `disabled`), `dlx_proxy_dead_letter_dropped_total{vhost,queue,cause}` for every cause, the
//! queue depth gauge and the two histograms.

use crate::common;

use common::dl::*;
use common::*;
use dlx_proxy::config::UserConfig;

const N: usize = 1000;

async fn wait_metric(b: &TestBroker, queue: &str, reason: &str, value: u64) {
    b.wait_dead_lettered(queue, reason, value).await;
}

#[tokio::test]
async fn metric_maxlen() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "q",
        table(&[("x-max-length", int(1)), ("x-overflow", ls("drop-head"))]),
    )
    .await;
    for i in 0..N {
        publish(&ch, "q", &[&i.to_string()]).await;
    }
    wait_metric(&b, "q", "maxlen", (N - 1) as u64).await;
    let text = b.metrics_text();
    assert_eq!(
        metric_value(
            &text,
            "dlx_proxy_dead_lettered_total{queue=\"q\",reason=\"maxlen\",vhost=\"/\"}"
        ),
        Some(999.0)
    );
}

#[tokio::test]
async fn metric_rejected() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await;
    for i in 0..N {
        publish(&ch, "q", &[&i.to_string()]).await;
    }
    let mut c = consumer(&ch, "q", "c").await;
    for _ in 0..N {
        let d = next(&mut c).await;
        reject(&ch, d.delivery_tag, false).await;
    }
    wait_metric(&b, "q", "rejected", N as u64).await;
}

#[tokio::test]
async fn metric_expired_queue_msg_ttl() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", table(&[("x-message-ttl", int(0))])).await;
    for i in 0..N {
        publish(&ch, "q", &[&i.to_string()]).await;
    }
    wait_metric(&b, "q", "expired", N as u64).await;
}

#[tokio::test]
async fn metric_expired_per_msg_msg_ttl() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await;
    for i in 0..N {
        publish_to(
            &ch,
            "",
            "q",
            i.to_string().as_bytes(),
            BasicProperties::default().with_expiration("0".into()),
        )
        .await;
    }
    wait_metric(&b, "q", "expired", N as u64).await;
}

/// Each reason has its own series; a series that never happened is absent (reads 0).
#[tokio::test]
async fn dead_lettered_total_by_reason() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(
        &ch,
        "q",
        "dlq",
        &[("x-max-length", int(2)), ("x-delivery-limit", int(0))],
    )
    .await;
    // maxlen: 3 publishes into a 2-message queue.
    publish(&ch, "q", &["a", "b", "c"]).await;
    // rejected: b.
    get_and_reject(&ch, "q", "b").await;
    // delivery_limit: c requeued once with limit 0.
    let t = consume(&ch, "q", &["c"]).await[0];
    nack(&ch, t, false, true).await;
    // expired: a per-message TTL of 0.
    publish_to(
        &ch,
        "",
        "q",
        b"d",
        BasicProperties::default().with_expiration("0".into()),
    )
    .await;
    b.wait_counts("dlq", 4, 0).await;
    for reason in ["maxlen", "rejected", "delivery_limit", "expired"] {
        assert_eq!(b.dead_lettered("q", reason), 1, "{reason}");
    }
    let text = b.metrics_text();
    assert!(
        text.contains(
            "dlx_proxy_dead_lettered_total{queue=\"q\",reason=\"rejected\",vhost=\"/\"} 1"
        ),
        "{text}"
    );
    assert_eq!(b.dead_lettered("dlq", "rejected"), 0);
    assert!(!text.contains("queue=\"dlq\",reason="), "no series for dlq");
}

/// Every drop cause, counted against the source queue: no_dlx, unroutable, cycle, hop_limit.
#[tokio::test]
async fn dropped_total_by_cause() {
    let mut cfg = test_config();
    cfg.dead_letter.max_hops = 1;
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    // no_dlx: the exchange does not exist.
    declare(
        &ch,
        "nodlx",
        table(&[("x-dead-letter-exchange", ls("missing"))]),
    )
    .await;
    // unroutable: the DLX exists but has no binding for the key.
    exchange(&ch, "dlx", ExchangeKind::Direct).await;
    declare(
        &ch,
        "unroutable",
        table(&[("x-dead-letter-exchange", ls("dlx"))]),
    )
    .await;
    // cycle: an expiring self-loop.
    declare(&ch, "cycle", self_loop(&[("x-message-ttl", int(0))])).await;
    // hop_limit: a rejecting self-loop with max_hops = 1.
    declare(&ch, "hops", self_loop(&[])).await;
    for q in ["nodlx", "unroutable"] {
        for _ in 0..2 {
            publish(&ch, q, &["m"]).await;
            let t = consume(&ch, q, &["m"]).await[0];
            reject(&ch, t, false).await;
        }
    }
    publish(&ch, "cycle", &["m1", "m2", "m3"]).await;
    publish(&ch, "hops", &["m"]).await;
    get_and_reject(&ch, "hops", "m").await;
    get_and_reject(&ch, "hops", "m").await;
    b.wait_counts("hops", 0, 0).await;
    let text = b.metrics_text();
    for (q, cause, n) in [
        ("nodlx", "no_dlx", 2.0),
        ("unroutable", "unroutable", 2.0),
        ("cycle", "cycle", 3.0),
        ("hops", "hop_limit", 1.0),
    ] {
        assert_eq!(
            metric_value(
                &text,
                &format!(
                    "dlx_proxy_dead_letter_dropped_total{{cause=\"{cause}\",queue=\"{q}\",vhost=\"/\"}}"
                )
            ),
            Some(n),
            "{q} {cause}\n{text}"
        );
    }
    // Drops are still counted as dead-lettered under their reason (as RabbitMQ does).
    assert_eq!(b.dead_lettered("cycle", "expired"), 3);
    assert_eq!(b.dead_lettered("hops", "rejected"), 2);
    assert_eq!(b.dead_lettered("nodlx", "rejected"), 2);
    // No other cause moved.
    assert_eq!(b.dropped("nodlx", "unroutable"), 0);
    assert_eq!(b.dropped("unroutable", "no_dlx"), 0);
}

/// The vhost label names the source queue's vhost.
#[tokio::test]
async fn metrics_carry_the_vhost() {
    let mut cfg = test_config();
    cfg.vhosts.push("tenant".into());
    cfg.users = vec![UserConfig {
        permissions: vec![
            dlx_proxy::config::PermissionConfig::default(),
            dlx_proxy::config::PermissionConfig {
                vhost: "tenant".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    }];
    let b = start_with(cfg).await;
    let conn = lapin::Connection::connect(
        &b.uri_as("guest", "guest", "tenant"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["m"]).await;
    get_and_reject(&ch, "q", "m").await;
    let ok = eventually(|| {
        metric_value(
            &b.metrics_text(),
            "dlx_proxy_dead_lettered_total{queue=\"q\",reason=\"rejected\",vhost=\"tenant\"}",
        ) == Some(1.0)
    })
    .await;
    assert!(ok, "{}", b.metrics_text());
    assert_eq!(b.dead_lettered("q", "rejected"), 0, "nothing in vhost /");
}

/// The depth gauge follows dead-lettering; the histograms count each dead-lettering.
#[tokio::test]
async fn depth_gauge_and_histograms() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(20))]).await;
    publish(&ch, "q", &["a", "b"]).await;
    b.wait_counts("dlq", 2, 0).await;
    let text = b.metrics_text();
    assert_eq!(
        metric_value(&text, "dlx_proxy_queue_messages{queue=\"dlq\",vhost=\"/\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "dlx_proxy_queue_messages{queue=\"q\",vhost=\"/\"}"),
        Some(0.0)
    );
    assert_eq!(
        metric_value(&text, "dlx_proxy_message_age_at_dead_letter_seconds_count"),
        Some(2.0)
    );
    assert_eq!(
        metric_value(&text, "dlx_proxy_dead_letter_latency_seconds_count"),
        Some(2.0)
    );
    // A dropped message is aged but has no delivery latency.
    declare(&ch, "plain", FieldTable::default()).await;
    publish(&ch, "plain", &["x"]).await;
    get_and_reject(&ch, "plain", "x").await;
    let ok = eventually(|| {
        metric_value(
            &b.metrics_text(),
            "dlx_proxy_message_age_at_dead_letter_seconds_count",
        ) == Some(3.0)
    })
    .await;
    assert!(ok);
    assert_eq!(
        metric_value(
            &b.metrics_text(),
            "dlx_proxy_dead_letter_latency_seconds_count"
        ),
        Some(2.0)
    );
}
