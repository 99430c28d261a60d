//! TTL deadlines across restarts of the real binary: messages whose queue or per-message TTL
//! ran out while the broker was down are dead-lettered at start (reason `expired`, x-death of
//! their queue) or dropped when the queue has no dead-letter exchange, and the others expire
//! when they were due, counted from their publish, not from the restart; a SIGKILL during an
//! expiry storm leaves every message exactly once in the source or its dead-letter queue.

use crate::common;

use std::time::{Duration, Instant};

use common::dl::{
    FieldTable, confirm_select, declare_durable, get_one, int, ls, payload, table, x_death,
};

use crate::storage_restart::{Node, count, persistent, publish_confirmed};

/// Declares durable `dlq` and durable `queue` with `args` plus dead-lettering to `dlq`.
async fn ttl_queue_to_dlq(ch: &common::dl::Channel, queue: &str, ttl: Option<i32>) {
    declare_durable(ch, "dlq", FieldTable::default()).await;
    let mut args = vec![
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls("dlq")),
    ];
    if let Some(ttl) = ttl {
        args.push(("x-message-ttl", int(ttl)));
    }
    declare_durable(ch, queue, table(&args)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_that_expired_while_stopped_are_dead_lettered_or_dropped_at_start() {
    let mut node = Node::start("storage-ttl-down").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    ttl_queue_to_dlq(&ch, "ttl", Some(1_000)).await;
    ttl_queue_to_dlq(&ch, "per-message", None).await;
    declare_durable(&ch, "ttl-no-dlx", table(&[("x-message-ttl", int(1_000))])).await;
    publish_confirmed(
        &ch,
        "ttl",
        (0..3).map(|i| (format!("q-{i}"), persistent(i))),
    )
    .await;
    publish_confirmed(
        &ch,
        "ttl-no-dlx",
        (0..3).map(|i| (format!("n-{i}"), persistent(i))),
    )
    .await;
    // Per-message TTL: one short, one far off behind it.
    publish_confirmed(
        &ch,
        "per-message",
        [
            ("m-short", persistent(0).with_expiration("1000".into())),
            ("m-long", persistent(1).with_expiration("600000".into())),
        ]
        .into_iter()
        .map(|(b, p)| (b.to_string(), p)),
    )
    .await;
    drop(conn);
    node.stop().await;
    // Down for longer than the TTLs.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, "ttl").await, 0, "{}", node.logs());
    assert_eq!(
        count(&ch, "ttl-no-dlx").await,
        0,
        "dropped: no dead-letter exchange"
    );
    assert_eq!(count(&ch, "per-message").await, 1);
    assert_eq!(payload(&get_one(&ch, "per-message").await), "m-long");
    assert_eq!(count(&ch, "dlq").await, 4);
    for want in ["q-0", "q-1", "q-2"] {
        let d = get_one(&ch, "dlq").await;
        assert_eq!(payload(&d), want);
        let deaths = x_death(&d);
        assert_eq!(deaths.len(), 1);
        assert_eq!(deaths[0].qrc(), ("ttl", "expired", 1));
        assert_eq!(deaths[0].exchange, "");
        assert_eq!(deaths[0].routing_keys, vec!["ttl".to_string()]);
        assert_eq!(deaths[0].original_expiration, None);
        common::dl::assert_first_death(&d, "expired", "ttl", "");
    }
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "m-short");
    let deaths = x_death(&d);
    assert_eq!(deaths[0].qrc(), ("per-message", "expired", 1));
    assert_eq!(deaths[0].original_expiration.as_deref(), Some("1000"));
    assert_eq!(
        d.properties.expiration(),
        &None,
        "the expiration is removed from a dead letter"
    );
    let text = common::scrape(node.admin).await;
    assert_eq!(
        common::metric_value(
            &text,
            &common::series(
                "dlx_proxy_dead_lettered_total",
                &[("queue", "ttl"), ("reason", "expired"), ("vhost", "/")]
            )
        ),
        Some(3.0),
        "{text}"
    );
    let dropped = common::series(
        "dlx_proxy_dead_lettered_total",
        &[
            ("queue", "ttl-no-dlx"),
            ("reason", "expired"),
            ("vhost", "/"),
        ],
    );
    assert_eq!(common::metric_value(&text, &dropped), Some(3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sigkill_messages_expire_when_due_counted_from_their_publish() {
    let mut node = Node::start("storage-ttl-kill").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    // Long enough for a restart on a loaded machine; the 3 s the node stays down keep the two
    // readings apart (counted from the restart, nothing would be due before TTL + 3 s).
    const TTL_MS: i32 = 8_000;
    ttl_queue_to_dlq(&ch, "ttl", Some(TTL_MS)).await;
    let published = Instant::now();
    publish_confirmed(
        &ch,
        "ttl",
        (0..20).map(|i| (format!("k-{i}"), persistent(i))),
    )
    .await;
    node.kill().await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert!(
        published.elapsed() < Duration::from_millis(TTL_MS as u64 - 1_000),
        "the restart took too long for this test"
    );
    assert_eq!(count(&ch, "ttl").await, 20, "not due yet: {}", node.logs());
    assert_eq!(count(&ch, "dlq").await, 0);
    // Due 8 s after the publish; counted from the restart they would stay ≥ 3 s longer.
    let deadline = published + Duration::from_millis(TTL_MS as u64 + 2_000);
    while count(&ch, "dlq").await < 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(&ch, "dlq").await, 20, "expired on time");
    assert_eq!(count(&ch, "ttl").await, 0);
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "k-0");
    assert_eq!(x_death(&d)[0].qrc(), ("ttl", "expired", 1));
    // The deaths were written: nothing comes back into the source after another kill.
    node.kill().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, "ttl").await, 0);
    assert_eq!(count(&ch, "dlq").await, 20, "the unacked get is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_during_an_expiry_storm_loses_and_doubles_nothing() {
    let mut node = Node::start("storage-ttl-storm").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    ttl_queue_to_dlq(&ch, "storm", Some(500)).await;
    const N: usize = 3_000;
    publish_confirmed(
        &ch,
        "storm",
        (0..N).map(|i| (format!("s-{i}"), persistent(i))),
    )
    .await;
    // Kill while the storm is under way: some dead letters made, not all.
    let until = Instant::now() + Duration::from_secs(10);
    while count(&ch, "dlq").await == 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    node.kill().await;
    drop(conn);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    // What is left in the source expired while the broker was down or expires now.
    let until = Instant::now() + Duration::from_secs(5);
    while count(&ch, "storm").await > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(&ch, "storm").await, 0, "{}", node.logs());
    let mut bodies = Vec::new();
    while let Some(d) = common::dl::get(&ch, "dlq").await {
        assert_eq!(x_death(&d)[0].qrc(), ("storm", "expired", 1));
        bodies.push(payload(&d));
    }
    assert_eq!(bodies.len(), N, "every message once in the DLQ, none twice");
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), N);
}
