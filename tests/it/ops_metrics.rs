//! The admin HTTP endpoints of a running embedded broker, scraped over TCP: exact metric values
//! after a dead-letter scenario (rejections, expiries, overflow, a missing DLX, a cycle), the
//! queue-label cap folding extra queues into `_other`, connection and channel gauges, and
//! `/healthz` / `/readyz`.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::dl::{bind, exchange};
use common::{RawClient, TestBroker, http, metric_value, scrape, start_with, test_config, unique};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

/// An embedded broker with the admin listener on a free port.
async fn broker_with_admin(max_queue_labels: usize) -> (TestBroker, SocketAddr) {
    let mut config = test_config();
    config.listen.admin = "127.0.0.1:0".into();
    config.metrics.max_queue_labels = max_queue_labels;
    let broker = start_with(config).await;
    let admin = broker.service.admin_addr.expect("admin listener");
    (broker, admin)
}

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in pairs {
        table.insert((*key).into(), value.clone());
    }
    table
}

fn dlx_arg(exchange: &str) -> (&'static str, AMQPValue) {
    (
        "x-dead-letter-exchange",
        AMQPValue::LongString(exchange.into()),
    )
}

async fn declare(ch: &Channel, queue: &str, arguments: FieldTable) {
    ch.queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
        .await
        .unwrap();
}

/// A fanout exchange `dlx` bound to a queue `dlq`.
async fn declare_dead_letter_target(ch: &Channel, dlx: &str, dlq: &str) {
    exchange(ch, dlx, ExchangeKind::Fanout).await;
    declare(ch, dlq, FieldTable::default()).await;
    bind(ch, dlq, dlx, "").await;
}

/// Publishes `count` messages to `queue` through the default exchange (confirmed).
async fn publish(ch: &Channel, queue: &str, count: usize) {
    for i in 0..count {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{queue}-{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }
}

/// basic.get one message (no_ack = false); returns its delivery tag.
async fn get(ch: &Channel, queue: &str) -> u64 {
    ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{queue} is empty"))
        .delivery
        .delivery_tag
}

async fn reject(ch: &Channel, tag: u64) {
    ch.basic_reject(tag, BasicRejectOptions { requeue: false })
        .await
        .unwrap();
}

/// `name{labels}` with the labels in the exposition format's (sorted) order.
fn dead_lettered(queue: &str, reason: &str) -> String {
    format!(r#"dlx_proxy_dead_lettered_total{{queue="{queue}",reason="{reason}",vhost="/"}}"#)
}

fn dropped(queue: &str, cause: &str) -> String {
    format!(r#"dlx_proxy_dead_letter_dropped_total{{cause="{cause}",queue="{queue}",vhost="/"}}"#)
}

fn depth(queue: &str) -> String {
    format!(r#"dlx_proxy_queue_messages{{queue="{queue}",vhost="/"}}"#)
}

fn assert_values(text: &str, expected: &[(&str, f64)]) {
    let mut wrong = Vec::new();
    for (series, value) in expected {
        let got = metric_value(text, series);
        if got != Some(*value) {
            wrong.push(format!("{series}: expected {value}, got {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}\n\n{text}", wrong.join("\n"));
}

#[tokio::test]
async fn a_dead_letter_scenario_has_exact_metric_values() {
    let (broker, admin) = broker_with_admin(500).await;
    let (conn, ch) = broker.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let dlx = unique("m.dlx");
    let dlq = unique("m.dlq");
    declare_dead_letter_target(&ch, &dlx, &dlq).await;
    let rejected = unique("m.rejected");
    let expiring = unique("m.expiring");
    let capped = unique("m.capped");
    let no_dlx = unique("m.nodlx");
    let cycling = unique("m.cycling");
    declare(&ch, &rejected, args(&[dlx_arg(&dlx)])).await;
    declare(
        &ch,
        &expiring,
        args(&[dlx_arg(&dlx), ("x-message-ttl", AMQPValue::LongInt(20))]),
    )
    .await;
    declare(
        &ch,
        &capped,
        args(&[dlx_arg(&dlx), ("x-max-length", AMQPValue::LongInt(1))]),
    )
    .await;
    declare(&ch, &no_dlx, args(&[dlx_arg(&unique("m.missing"))])).await;
    // Dead-letters to itself through the default exchange: an expiry cycle, dropped.
    declare(
        &ch,
        &cycling,
        args(&[dlx_arg(""), ("x-message-ttl", AMQPValue::LongInt(20))]),
    )
    .await;

    // 5 published, 5 fetched, 2 acked, 3 rejected to the DLX.
    publish(&ch, &rejected, 5).await;
    let mut tags = Vec::new();
    for _ in 0..5 {
        tags.push(get(&ch, &rejected).await);
    }
    for tag in &tags[..2] {
        ch.basic_ack(*tag, BasicAckOptions::default())
            .await
            .unwrap();
    }
    for tag in &tags[2..] {
        reject(&ch, *tag).await;
    }
    // 2 expire into the DLX; 3 published over a max-length of 1: 2 overflow into the DLX.
    publish(&ch, &expiring, 2).await;
    publish(&ch, &capped, 3).await;
    // 1 rejected towards an exchange that does not exist: dropped as no_dlx.
    publish(&ch, &no_dlx, 1).await;
    let tag = get(&ch, &no_dlx).await;
    reject(&ch, tag).await;
    // 2 expire and would return to their own queue: dropped as cycles.
    publish(&ch, &cycling, 2).await;

    // Wait for the expiries, then check every series.
    common::wait_metric(admin, &depth(&dlq), 7.0).await;
    common::wait_metric(admin, &dropped(&cycling, "cycle"), 2.0).await;
    let text = scrape(admin).await;
    assert_values(
        &text,
        &[
            (&dead_lettered(&rejected, "rejected"), 3.0),
            (&dead_lettered(&expiring, "expired"), 2.0),
            (&dead_lettered(&capped, "maxlen"), 2.0),
            // Deaths count by reason whether or not the message reached a DLX (RabbitMQ
            // counts them the same way); the drops are counted by cause besides.
            (&dead_lettered(&no_dlx, "rejected"), 1.0),
            (&dead_lettered(&cycling, "expired"), 2.0),
            (&dropped(&no_dlx, "no_dlx"), 1.0),
            (&dropped(&cycling, "cycle"), 2.0),
            ("dlx_proxy_messages_published_total", 13.0),
            ("dlx_proxy_messages_delivered_total", 6.0),
            ("dlx_proxy_messages_acked_total", 2.0),
            ("dlx_proxy_connections", 1.0),
            ("dlx_proxy_connections_opened_total", 1.0),
            ("dlx_proxy_channels", 1.0),
            (&depth(&dlq), 7.0),
            (&depth(&capped), 1.0),
            (&depth(&rejected), 0.0),
            (&depth(&expiring), 0.0),
            (&depth(&cycling), 0.0),
            // Every death is aged; only the 7 that reached the DLQ have a latency.
            ("dlx_proxy_message_age_at_dead_letter_seconds_count", 10.0),
            ("dlx_proxy_dead_letter_latency_seconds_count", 7.0),
            ("dlx_proxy_metric_labels_folded_total", 0.0),
        ],
    );
    for (series, cause) in [
        (&rejected, "no_dlx"),
        (&expiring, "cycle"),
        (&capped, "unroutable"),
    ] {
        assert_eq!(metric_value(&text, &dropped(series, cause)), None, "{text}");
    }

    // Consume the DLQ: 7 more deliveries and acks.
    let mut consumer = ch
        .basic_consume(
            dlq.as_str().into(),
            "dlq-reader".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..7 {
        let delivery = tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .expect("a dead-lettered message")
            .unwrap()
            .unwrap();
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let text = common::wait_metric(admin, "dlx_proxy_messages_acked_total", 9.0).await;
    assert_values(
        &text,
        &[
            ("dlx_proxy_messages_delivered_total", 13.0),
            (&depth(&dlq), 0.0),
            ("dlx_proxy_messages_published_total", 13.0),
        ],
    );

    // Closing the channel, then the connection, brings the gauges back to zero.
    ch.close(200, "done".into()).await.unwrap();
    common::wait_metric(admin, "dlx_proxy_channels", 0.0).await;
    conn.close(200, "bye".into()).await.unwrap();
    let text = common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
    assert_values(&text, &[("dlx_proxy_connections_opened_total", 1.0)]);
}

#[tokio::test]
async fn queues_beyond_max_queue_labels_fold_into_other() {
    let (broker, admin) = broker_with_admin(2).await;
    let (_conn, ch) = broker.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let dlx = unique("cap.dlx");
    let dlq = unique("cap.dlq");
    declare_dead_letter_target(&ch, &dlx, &dlq).await;
    let queues: Vec<String> = (0..4).map(|i| unique(&format!("cap{i}"))).collect();
    for q in &queues {
        declare(&ch, q, args(&[dlx_arg(&dlx)])).await;
    }
    // The first two queues to get a series keep their labels.
    for q in &queues {
        publish(&ch, q, 1).await;
    }
    for q in &queues {
        let tag = get(&ch, q).await;
        reject(&ch, tag).await;
    }
    let text = common::wait_metric(
        admin,
        &dead_lettered(dlx_proxy::metrics::OTHER_QUEUE, "rejected"),
        2.0,
    )
    .await;
    assert_values(
        &text,
        &[
            (&dead_lettered(&queues[0], "rejected"), 1.0),
            (&dead_lettered(&queues[1], "rejected"), 1.0),
            (&dead_lettered("_other", "rejected"), 2.0),
            (&depth(&queues[0]), 0.0),
            (&depth(&queues[1]), 0.0),
        ],
    );
    for q in [&queues[2], &queues[3], &dlq] {
        assert!(
            !text.contains(&format!("queue=\"{q}\"")),
            "{q} has its own series beyond the cap:\n{text}"
        );
    }
    assert!(
        !text.contains(r#"dlx_proxy_queue_messages{queue="_other""#),
        "a depth gauge shared by folded queues is meaningless:\n{text}"
    );
    assert!(metric_value(&text, "dlx_proxy_metric_labels_folded_total").unwrap() >= 2.0);

    // Deleting a labelled queue frees its slot for the next queue that needs one.
    ch.queue_delete(queues[0].as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let late = unique("cap.late");
    declare(&ch, &late, args(&[dlx_arg(&dlx)])).await;
    publish(&ch, &late, 1).await;
    let tag = get(&ch, &late).await;
    reject(&ch, tag).await;
    let text = common::wait_metric(admin, &dead_lettered(&late, "rejected"), 1.0).await;
    assert!(
        !text.contains(&format!("queue=\"{}\"", queues[0])),
        "the deleted queue's series remain:\n{text}"
    );
    assert_eq!(
        metric_value(&text, &dead_lettered("_other", "rejected")),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test]
async fn build_info_and_process_metrics_over_http() {
    let (_broker, admin) = broker_with_admin(500).await;
    let text = scrape(admin).await;
    let build = format!(
        "dlx_proxy_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(metric_value(&text, &build), Some(1.0), "{text}");
    // The test process is the service here: its resident memory and descriptors are real.
    let rss = metric_value(&text, "dlx_proxy_process_resident_memory_bytes").expect("RSS");
    assert!(
        rss > 1_000_000.0,
        "dlx_proxy_process_resident_memory_bytes = {rss}"
    );
    let fds = metric_value(&text, "dlx_proxy_process_open_fds").expect("open fds");
    assert!(fds >= 3.0, "dlx_proxy_process_open_fds = {fds}");
}

#[tokio::test]
async fn health_and_readiness_over_http() {
    let (broker, admin) = broker_with_admin(500).await;
    assert_eq!(http(admin, "GET", "/healthz").await, (200, "ok".into()));
    assert_eq!(http(admin, "GET", "/readyz").await, (200, "ready".into()));
    // Readiness is a switch the service flips (off while draining).
    broker.service.readiness.set_ready(false);
    assert_eq!(
        http(admin, "GET", "/readyz").await,
        (503, "not ready".into())
    );
    assert_eq!(http(admin, "GET", "/healthz").await.0, 200);
    broker.service.readiness.set_ready(true);
    assert_eq!(http(admin, "GET", "/readyz").await.0, 200);
    let (status, _) = http(admin, "GET", "/no-such-page").await;
    assert_eq!(status, 404);
    // The scrape itself is well formed: every sample line parses as `name{labels} value`.
    let text = scrape(admin).await;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        assert!(line.starts_with("dlx_proxy_"), "unprefixed metric {line:?}");
    }
}

#[tokio::test]
async fn connection_and_channel_gauges_follow_clients() {
    let (broker, admin) = broker_with_admin(500).await;
    let (conn_a, ch_a) = broker.channel().await;
    let (conn_b, ch_b) = broker.channel().await;
    let ch_b2 = conn_b.create_channel().await.unwrap();
    let text = common::wait_metric(admin, "dlx_proxy_channels", 3.0).await;
    assert_values(
        &text,
        &[
            ("dlx_proxy_connections", 2.0),
            ("dlx_proxy_connections_opened_total", 2.0),
        ],
    );
    ch_b.close(200, "done".into()).await.unwrap();
    common::wait_metric(admin, "dlx_proxy_channels", 2.0).await;
    for ch in [ch_a, ch_b2] {
        ch.close(200, "done".into()).await.unwrap();
    }
    common::wait_metric(admin, "dlx_proxy_channels", 0.0).await;
    conn_a.close(200, "bye".into()).await.unwrap();
    common::wait_metric(admin, "dlx_proxy_connections", 1.0).await;
    conn_b.close(200, "bye".into()).await.unwrap();
    let text = common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
    assert_values(&text, &[("dlx_proxy_connections_opened_total", 2.0)]);
}

#[tokio::test]
async fn the_connection_gauge_recovers_when_a_client_vanishes() {
    let (broker, admin) = broker_with_admin(500).await;
    let raw = open_raw_channel(broker.addr).await;
    common::wait_metric(admin, "dlx_proxy_connections", 1.0).await;
    drop(raw);
    common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
}

/// A raw client with channel 1 open.
async fn open_raw_channel(addr: SocketAddr) -> RawClient {
    let mut raw = RawClient::connect(addr).await;
    raw.open_channel(1).await;
    raw
}

/// Channels still open when their connection ends (connection.close without channel.close,
/// as lapin does, or a vanished client) must leave the channel gauge too.
#[tokio::test]
async fn channels_of_ended_connections_leave_the_channel_gauge() {
    let (broker, admin) = broker_with_admin(500).await;
    let (conn, _ch) = broker.channel().await;
    let _second = conn.create_channel().await.unwrap();
    common::wait_metric(admin, "dlx_proxy_channels", 2.0).await;
    conn.close(200, "bye".into()).await.unwrap();
    common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
    common::wait_metric(admin, "dlx_proxy_channels", 0.0).await;

    let raw = open_raw_channel(broker.addr).await;
    common::wait_metric(admin, "dlx_proxy_channels", 1.0).await;
    drop(raw);
    common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
    common::wait_metric(admin, "dlx_proxy_channels", 0.0).await;
}

/// frames_total and bytes_total count both directions of client traffic.
#[tokio::test]
async fn client_traffic_is_counted_in_both_directions() {
    let (broker, admin) = broker_with_admin(500).await;
    let (conn, ch) = broker.channel().await;
    let q = unique("traffic");
    declare(&ch, &q, FieldTable::default()).await;
    conn.close(200, "bye".into()).await.unwrap();
    let text = common::wait_metric(admin, "dlx_proxy_connections", 0.0).await;
    for series in [
        r#"dlx_proxy_frames_total{direction="client_in"}"#,
        r#"dlx_proxy_bytes_total{direction="client_in"}"#,
        r#"dlx_proxy_frames_total{direction="client_out"}"#,
        r#"dlx_proxy_bytes_total{direction="client_out"}"#,
    ] {
        assert!(
            metric_value(&text, series).unwrap_or(0.0) > 0.0,
            "{series} not counted:\n{text}"
        );
    }
}

/// The embedded broker's unacknowledged deliveries show in the inflight gauges.
#[tokio::test]
async fn unacked_deliveries_show_in_the_inflight_gauges() {
    let (broker, admin) = broker_with_admin(500).await;
    let (_conn, ch) = broker.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("inflight");
    declare(&ch, &q, FieldTable::default()).await;
    publish(&ch, &q, 2).await;
    let first = get(&ch, &q).await;
    let _second = get(&ch, &q).await;
    let body_bytes = 2.0 * format!("{q}-0").len() as f64;
    let text = common::wait_metric(admin, "dlx_proxy_inflight_deliveries", 2.0).await;
    assert_values(&text, &[("dlx_proxy_inflight_bytes", body_bytes)]);
    ch.basic_ack(first, BasicAckOptions::default())
        .await
        .unwrap();
    common::wait_metric(admin, "dlx_proxy_inflight_deliveries", 1.0).await;
    ch.close(200, "done".into()).await.unwrap();
    let text = common::wait_metric(admin, "dlx_proxy_inflight_deliveries", 0.0).await;
    assert_values(&text, &[("dlx_proxy_inflight_bytes", 0.0)]);
}
