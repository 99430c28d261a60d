//! Consumer timeouts (`limits.consumer_timeout`, `x-consumer-timeout`, policy
//! `consumer-timeout`): a consumer that holds a delivery past the timeout gets RabbitMQ's
//! channel.close 406 with its exact text, the delivery is requeued (redelivered to the next
//! consumer) and counted as a delivery attempt, so a queue with `x-delivery-limit`
//! dead-letters a message whose consumers keep hanging (reason `delivery_limit`). Embedded
//! mode and proxy mode (where the proxy enforces it itself).

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::common;
use crate::proxy_support::{TestProxy, delete_upstream, policy};

use common::dl::*;
use common::dl_policy;
use common::*;
use serde_json::json;

/// RabbitMQ's close text (rabbit_channel) for `channel` and `timeout`.
fn timeout_text(channel: u16, timeout: u64) -> String {
    format!(
        "PRECONDITION_FAILED - delivery acknowledgement on channel {channel} timed out. \
         Timeout value used: {timeout} ms. This timeout value can be configured, see \
         consumers doc guide to learn more"
    )
}

/// Consumes `queue` on a fresh channel of `conn`, takes one delivery and never acks it;
/// returns the delivery, the error the channel closed with, and how long after the delivery
/// that came.
async fn hang(conn: &lapin::Connection, queue: &str) -> (Delivery, u16, lapin::Error, Duration) {
    let ch = conn.create_channel().await.expect("channel");
    let mut c = consumer(&ch, queue, "hanging").await;
    let d = next(&mut c).await;
    let delivered = Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(15), c.next())
        .await
        .expect("the channel is closed in time");
    let err = match end {
        Some(Err(e)) => e,
        other => panic!(
            "expected the channel to close, got {:?}",
            other.map(|r| r.is_ok())
        ),
    };
    (d, ch.id(), err, delivered.elapsed())
}

/// The hanging consumer is closed with the text of `timeout`, not before it.
async fn assert_timed_out(conn: &lapin::Connection, queue: &str, timeout: u64) -> Delivery {
    let (d, channel, err, after) = hang(conn, queue).await;
    assert_eq!(amqp_code(&err), Some(406), "{err}");
    assert_eq!(amqp_text(&err), timeout_text(channel, timeout));
    assert!(
        after + Duration::from_millis(50) >= Duration::from_millis(timeout),
        "closed after {after:?}, before the {timeout} ms timeout"
    );
    assert!(
        after < Duration::from_millis(timeout) + Duration::from_secs(10),
        "closed only after {after:?}"
    );
    d
}

async fn redelivered_to_the_next_consumer(conn: &lapin::Connection, queue: &str) {
    let d = assert_timed_out(conn, queue, 800).await;
    assert!(!d.redelivered);
    let ch = conn.create_channel().await.expect("channel");
    let mut c = consumer(&ch, queue, "next").await;
    let again = next(&mut c).await;
    assert!(
        again.redelivered,
        "the requeued delivery is marked redelivered"
    );
    assert_eq!(payload(&again), "m");
    ack(&ch, again.delivery_tag, false).await;
}

#[tokio::test]
async fn embedded_a_hanging_consumer_is_closed_and_the_message_redelivered() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "q", table(&[("x-consumer-timeout", int(800))])).await;
    publish(&ch, "q", &["m"]).await;
    redelivered_to_the_next_consumer(&conn, "q").await;
    // The connection and its other channels live on.
    declare(&ch, "q2", FieldTable::default()).await;
}

#[tokio::test]
async fn embedded_the_lowest_of_config_argument_and_policy_wins() {
    let mut config = test_config();
    config.limits.consumer_timeout = 700;
    config.policies = vec![
        dl_policy::exact("short", "by-policy", json!({"consumer-timeout": 500})),
        dl_policy::exact("long", "by-argument", json!({"consumer-timeout": 5000})),
    ];
    let b = start_with(config).await;
    let (conn, ch) = b.channel().await;
    for (queue, argument) in [
        ("by-config", 3000),
        ("by-policy", 3000),
        ("by-argument", 600),
    ] {
        declare(&ch, queue, table(&[("x-consumer-timeout", int(argument))])).await;
        publish(&ch, queue, &["m"]).await;
    }
    declare(&ch, "plain", FieldTable::default()).await;
    publish(&ch, "plain", &["m"]).await;
    assert_timed_out(&conn, "by-config", 700).await;
    assert_timed_out(&conn, "by-policy", 500).await;
    assert_timed_out(&conn, "by-argument", 600).await;
    assert_timed_out(&conn, "plain", 700).await;
}

#[tokio::test]
async fn embedded_no_timeout_by_default_and_acks_in_time_keep_the_channel() {
    let b = start().await;
    let (_conn, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await;
    declare(&ch, "t", table(&[("x-consumer-timeout", int(600))])).await;
    publish(&ch, "q", &["m"]).await;
    publish(&ch, "t", &["1", "2"]).await;
    let mut c = consumer(&ch, "q", "c").await;
    let _held = next(&mut c).await;
    // One delivery at a time: each is acked 300 ms after it arrives, within the 600 ms.
    ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut t = consumer(&ch, "t", "t").await;
    for _ in 0..2 {
        let d = next(&mut t).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        ack(&ch, d.delivery_tag, false).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(ch.status().connected(), "no timeout closed the channel");
}

#[tokio::test]
async fn embedded_an_invalid_argument_is_refused() {
    let b = start().await;
    let (_conn, ch) = b.channel().await;
    let err = try_declare(&ch, "q", table(&[("x-consumer-timeout", int(-1))]))
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - invalid arg 'x-consumer-timeout' for queue 'q' in vhost '/': \
         {value_negative,-1}"
    );
}

/// x-delivery-limit = 2 and consumers that all hang: deliveries 1, 2 and 3 time out; the
/// third return is past the limit and the message is dead-lettered (delivery_limit).
async fn hanging_consumers_reach_the_delivery_limit(
    conn: &lapin::Connection,
    queue: &str,
    dlq: &str,
) {
    for _ in 0..3 {
        assert_timed_out(conn, queue, 400).await;
    }
    let ch = conn.create_channel().await.expect("channel");
    let mut c = consumer(&ch, dlq, "dlq").await;
    let d = next(&mut c).await;
    assert_eq!(payload(&d), "m");
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![(queue, "delivery_limit", 1)]
    );
}

#[tokio::test]
async fn embedded_hanging_consumers_dead_letter_at_the_delivery_limit() {
    let mut config = test_config();
    config.listen.admin = "127.0.0.1:0".into();
    let b = start_with(config).await;
    let admin = b.service.admin_addr.expect("admin listener");
    let (conn, ch) = b.channel().await;
    declare_dead_letter_queues(
        &ch,
        "q",
        "dlq",
        &[
            ("x-delivery-limit", int(2)),
            ("x-consumer-timeout", int(400)),
        ],
    )
    .await;
    publish(&ch, "q", &["m"]).await;
    hanging_consumers_reach_the_delivery_limit(&conn, "q", "dlq").await;
    wait_metric(
        admin,
        &series(
            "dlx_proxy_consumer_timeouts_total",
            &[("queue", "q"), ("vhost", "/")],
        ),
        3.0,
    )
    .await;
    wait_metric(
        admin,
        &series(
            "dlx_proxy_dead_lettered_total",
            &[("queue", "q"), ("reason", "delivery_limit"), ("vhost", "/")],
        ),
        1.0,
    )
    .await;
}

// ------------------------------------------------------------------------------------------
// Proxy mode: the proxy enforces the timeout itself (RabbitMQ 3.10's own is 30 minutes)
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_a_hanging_consumer_is_closed_and_the_message_redelivered() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ct");
    declare(&ch, &q, table(&[("x-consumer-timeout", int(800))])).await;
    publish(&ch, &q, &["m"]).await;
    redelivered_to_the_next_consumer(&conn, &q).await;
    // The connection lives on, and the timed-out channel's number can be opened again.
    let again = conn.create_channel().await.unwrap();
    declare(&again, &format!("{q}-2"), FieldTable::default()).await;
    delete_upstream(&again, &[&q, &format!("{q}-2")], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_the_lowest_of_config_argument_and_policy_wins() {
    let by_policy = unique("ct-policy");
    let by_argument = unique("ct-argument");
    let by_config = unique("ct-config");
    let policies = vec![
        policy(
            "ct-short",
            &format!("^{by_policy}$"),
            json!({"consumer-timeout": 500}),
        ),
        policy(
            "ct-long",
            &format!("^{by_argument}$"),
            json!({"consumer-timeout": 5000}),
        ),
    ];
    let proxy = TestProxy::start_with(policies, |c| c.limits.consumer_timeout = 700).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for (queue, argument) in [(&by_config, 3000), (&by_policy, 3000), (&by_argument, 600)] {
        declare(&ch, queue, table(&[("x-consumer-timeout", int(argument))])).await;
        publish(&ch, queue, &["m"]).await;
    }
    assert_timed_out(&conn, &by_config, 700).await;
    assert_timed_out(&conn, &by_policy, 500).await;
    assert_timed_out(&conn, &by_argument, 600).await;
    delete_upstream(&ch, &[&by_config, &by_policy, &by_argument], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_hanging_consumers_dead_letter_at_the_delivery_limit() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ct-limit");
    let dlq = unique("ct-limit-dlq");
    let dlx = declare_dead_letter_queues(
        &ch,
        &q,
        &dlq,
        &[
            ("x-delivery-limit", int(2)),
            ("x-consumer-timeout", int(400)),
        ],
    )
    .await;
    publish(&ch, &q, &["m"]).await;
    hanging_consumers_reach_the_delivery_limit(&conn, &q, &dlq).await;
    proxy
        .wait_counter(
            "consumer_timeouts_total",
            &[("queue", &q), ("vhost", "/")],
            3.0,
        )
        .await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &q), ("reason", "delivery_limit"), ("vhost", "/")],
            1.0,
        )
        .await;
    delete_upstream(&ch, &[&q, &dlq], &[&dlx]).await;
}
