//! The disk alarm of the real binary: with free space below `storage.disk_free_limit`, a
//! connection that publishes gets `connection.blocked` ("low on disk") and nothing it sends is
//! read; lowering the limit by a config reload clears the alarm, the publisher gets
//! `connection.unblocked` and its held publish is confirmed. The gauges say the same over
//! HTTP. A limit relative to memory ("100x") is resolved into bytes and raises the alarm too.

use crate::common;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, connection};
use common::dl::FieldTable;
use common::{capabilities, metric_value, scrape, wait_metric};

use crate::embedded_memory::{assert_ack, confirming_publisher};
use crate::storage_restart::Node;

/// More than any disk has.
const HUGE: &str = "disk_free_limit = \"1000000TB\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_are_blocked_while_free_space_is_below_the_limit_and_resume_on_reload() {
    let node = Node::start_with("storage-disk", HUGE).await;
    let text = wait_metric(node.admin, "dlx_proxy_disk_alarm", 1.0).await;
    assert_eq!(
        metric_value(&text, "dlx_proxy_disk_free_limit_bytes"),
        Some(1e18)
    );
    let free = metric_value(&text, "dlx_proxy_disk_free_bytes").expect("free bytes");
    assert!(free > 0.0 && free < 1e18, "{free}");
    let (_conn, ch) = node.channel().await;
    common::dl::declare(&ch, "disk", FieldTable::default()).await;

    let mut publisher =
        confirming_publisher(node.amqp, capabilities(&["connection.blocked"])).await;
    publisher.publish(1, "", "disk", b"held").await;
    match publisher.method_within(Duration::from_secs(5)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)))) => {
            assert_eq!(blocked.reason.as_str(), "low on disk");
        }
        other => panic!("expected connection.blocked, got {other:?}"),
    }
    assert!(
        publisher
            .method_within(Duration::from_millis(500))
            .await
            .is_none(),
        "the blocked publisher got a method"
    );
    let text = scrape(node.admin).await;
    assert_eq!(
        metric_value(&text, "dlx_proxy_blocked_connections"),
        Some(1.0)
    );
    // Other connections are served meanwhile; the held publish was not read.
    assert_eq!(crate::storage_restart::count(&ch, "disk").await, 0);

    node.configure("disk_free_limit = 0\n");
    match publisher.method_within(Duration::from_secs(15)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)))) => {}
        other => panic!("expected connection.unblocked, got {other:?}"),
    }
    assert_ack(publisher.method_within(Duration::from_secs(5)).await, 1);
    assert_eq!(crate::storage_restart::count(&ch, "disk").await, 1);
    let text = wait_metric(node.admin, "dlx_proxy_disk_alarm", 0.0).await;
    assert_eq!(
        metric_value(&text, "dlx_proxy_disk_free_limit_bytes"),
        Some(0.0)
    );
    assert_eq!(
        metric_value(&text, "dlx_proxy_blocked_connections"),
        Some(0.0)
    );
    assert!(node.logs().contains("disk alarm raised"), "{}", node.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_relative_to_memory_is_resolved_in_bytes_and_raises_the_alarm() {
    // 100 times the memory: more free space than this machine's disk has.
    let node = Node::start_with("storage-disk-relative", "disk_free_limit = \"100x\"\n").await;
    let text = wait_metric(node.admin, "dlx_proxy_disk_alarm", 1.0).await;
    let memory = dlx_proxy::memory::system::MemorySources::default()
        .limit()
        .map(|(bytes, _)| bytes)
        .expect("memory limit");
    assert_eq!(
        metric_value(&text, "dlx_proxy_disk_free_limit_bytes"),
        Some((memory as f64 * 100.0) as u64 as f64)
    );
    let mut publisher =
        confirming_publisher(node.amqp, capabilities(&["connection.blocked"])).await;
    let (_conn, ch) = node.channel().await;
    common::dl::declare(&ch, "relative", FieldTable::default()).await;
    publisher.publish(1, "", "relative", b"held").await;
    match publisher.method_within(Duration::from_secs(5)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)))) => {
            assert_eq!(blocked.reason.as_str(), "low on disk");
        }
        other => panic!("expected connection.blocked, got {other:?}"),
    }
    // A tiny multiple clears it on reload.
    node.configure("disk_free_limit = \"0.000001x\"\n");
    match publisher.method_within(Duration::from_secs(15)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)))) => {}
        other => panic!("expected connection.unblocked, got {other:?}"),
    }
    assert_ack(publisher.method_within(Duration::from_secs(5)).await, 1);
    let text = wait_metric(node.admin, "dlx_proxy_disk_alarm", 0.0).await;
    assert_eq!(
        metric_value(&text, "dlx_proxy_disk_free_limit_bytes"),
        Some(((memory as f64 * 0.000001) as u64).max(1) as f64)
    );
}
