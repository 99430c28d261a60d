//! The memory high watermark of the embedded broker (`limits.memory_high_watermark`): a
//! connection that publishes while used memory is above the watermark is blocked
//! (`connection.blocked` "low on memory" when it announced the capability, and its socket is
//! not read), consumers keep draining, and once memory is back below the watermark the
//! publisher gets `connection.unblocked` and its held publishes go through. A publish begun
//! before the alarm blocks its connection at its next body frame. The broker runs
//! as a child process so that its resident memory is its own, not this test binary's.

use crate::common;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic, confirm, connection};
use amq_protocol::types::FieldTable;
use common::dl::{self, BasicAckOptions, BasicQosOptions};
use common::{
    RawClient, ServiceProcess, TempDir, capabilities, encode_publish, free_addresses, metric_value,
    process_config, scrape, series, wait_metric,
};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");
const WATERMARK: u64 = 48 << 20;
/// Body size of the messages that fill the broker's memory: small enough that glibc keeps
/// their memory once they are freed unless the monitor hands it back (`malloc_trim`); without
/// that the resident size stays above the watermark and the publisher is never unblocked.
const BIG: usize = 32 << 10;
/// Body size of the publishes sent while blocked.
const SMALL: usize = 1024;

/// A body whose first four bytes number it.
fn body(index: u32, size: usize) -> Vec<u8> {
    let mut body = vec![b'x'; size];
    body[..4].copy_from_slice(&index.to_be_bytes());
    body
}

fn index_of(body: &[u8]) -> u32 {
    u32::from_be_bytes([body[0], body[1], body[2], body[3]])
}

/// A raw client with channel 1 open in confirm mode.
pub(crate) async fn confirming_publisher(
    addr: std::net::SocketAddr,
    properties: FieldTable,
) -> RawClient {
    let mut client = RawClient::connect_with_properties(addr, properties).await;
    client.open_channel(1).await;
    client
        .send_method(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )
        .await;
    client.expect_method(85, 11).await;
    client
}

/// The next method must be the confirm of `tag` on channel 1.
pub(crate) fn assert_ack(method: Option<(u16, AMQPClass)>, tag: u64) {
    match method {
        Some((1, AMQPClass::Basic(basic::AMQPMethod::Ack(ack)))) => {
            assert_eq!(ack.delivery_tag, tag, "confirm order");
        }
        other => panic!("expected basic.ack {tag}, got {other:?}"),
    }
}

fn gauge(text: &str, name: &str) -> f64 {
    metric_value(text, name).unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

#[tokio::test]
async fn publishers_are_blocked_above_the_watermark_and_resume_after_a_consumer_drains() {
    let dir = TempDir::new("memory");
    let (amqp, admin) = free_addresses();
    let config = format!(
        "{}\n[limits]\nmemory_high_watermark = \"48MiB\"\nmemory_check_interval_ms = 50\n",
        process_config(amqp, admin, 1)
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, config).expect("write config");
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    let text = wait_metric(
        admin,
        "dlx_proxy_memory_high_watermark_bytes",
        WATERMARK as f64,
    )
    .await;
    assert_eq!(gauge(&text, "dlx_proxy_memory_alarm"), 0.0);
    let used = gauge(&text, "dlx_proxy_memory_used_bytes");
    assert!(used > 0.0 && used < WATERMARK as f64, "idle RSS {used}");
    assert!(gauge(&text, "dlx_proxy_memory_limit_bytes") > WATERMARK as f64);
    assert_eq!(gauge(&text, "dlx_proxy_blocked_connections"), 0.0);

    let uri = format!("amqp://guest:guest@{amqp}/%2f");
    let setup = lapin::Connection::connect(&uri, Default::default())
        .await
        .expect("connect");
    let setup_ch = setup.create_channel().await.expect("channel");
    let queue = common::unique("watermark");
    dl::declare(&setup_ch, &queue, FieldTable::default()).await;
    let depth = series(
        "dlx_proxy_queue_messages",
        &[("queue", &queue), ("vhost", "/")],
    );

    // Connections that will not publish while the alarm is raised.
    let mut bystander =
        RawClient::connect_with_properties(amqp, capabilities(&["connection.blocked"])).await;
    bystander.open_channel(1).await;
    let mut quiet = confirming_publisher(amqp, FieldTable::default()).await;
    // A publisher that began a publish before the alarm (its method and content header, 2
    // body bytes announced) and sends its body frames while the alarm is raised.
    let streamed_queue = common::unique("watermark-streamed");
    dl::declare(&setup_ch, &streamed_queue, FieldTable::default()).await;
    let mut streamer = confirming_publisher(amqp, capabilities(&["connection.blocked"])).await;
    let whole = encode_publish(1, "", &streamed_queue, Default::default(), b"xy");
    let body_frame_len = 7 + 2 + 1;
    streamer
        .send_raw(&whole[..whole.len() - body_frame_len])
        .await;
    let body_frame = |byte: u8| [3, 0, 1, 0, 0, 0, 1, byte, 0xCE];

    // Fill memory until the publisher is blocked: every publish is confirmed until then.
    let mut publisher = confirming_publisher(amqp, capabilities(&["connection.blocked"])).await;
    let mut stored = 0u32;
    loop {
        assert!(
            stored < 4000,
            "no connection.blocked after {stored} messages"
        );
        publisher.publish(1, "", &queue, &body(stored, BIG)).await;
        match publisher.method_within(Duration::from_secs(10)).await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)))) => {
                assert_eq!(blocked.reason.as_str(), "low on memory");
                break;
            }
            other => assert_ack(other, u64::from(stored) + 1),
        }
        stored += 1;
    }
    // `stored` messages are queued; publish number `stored` waits unread in the socket.
    let mut held: Vec<u32> = vec![stored];
    for extra in 1..=3 {
        publisher
            .publish(1, "", &queue, &body(stored + extra, SMALL))
            .await;
        held.push(stored + extra);
    }
    let text = scrape(admin).await;
    assert_eq!(gauge(&text, "dlx_proxy_memory_alarm"), 1.0);
    assert!(gauge(&text, "dlx_proxy_memory_used_bytes") > WATERMARK as f64 * 0.95);
    assert_eq!(gauge(&text, "dlx_proxy_blocked_connections"), 1.0);
    assert_eq!(gauge(&text, "dlx_proxy_connection_blocks_total"), 1.0);

    // A publisher without the capability is blocked too, without a notification.
    quiet.publish(1, "", &queue, &body(10_000, SMALL)).await;
    assert!(
        quiet
            .method_within(Duration::from_millis(500))
            .await
            .is_none(),
        "a client without the capability got a method while blocked"
    );
    held.push(10_000);

    // While blocked: nothing confirmed, nothing more queued or counted as published.
    assert!(
        publisher
            .method_within(Duration::from_millis(700))
            .await
            .is_none(),
        "the blocked publisher got a method"
    );
    let text = scrape(admin).await;
    assert_eq!(gauge(&text, &depth), f64::from(stored));
    assert_eq!(
        gauge(&text, "dlx_proxy_messages_published_total"),
        f64::from(stored)
    );
    assert_eq!(gauge(&text, "dlx_proxy_blocked_connections"), 2.0);
    // A body frame of the publish begun before the alarm blocks its connection too.
    streamer.send_raw(&body_frame(b'x')).await;
    match streamer.method_within(Duration::from_secs(5)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)))) => {
            assert_eq!(blocked.reason.as_str(), "low on memory");
        }
        other => panic!("expected connection.blocked for the body frame, got {other:?}"),
    }
    wait_metric(admin, "dlx_proxy_blocked_connections", 3.0).await;
    // A connection that did not publish is served and not notified.
    bystander
        .send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: 5,
                global: false,
            })),
        )
        .await;
    match bystander.method_within(Duration::from_secs(5)).await {
        Some((1, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))) => {}
        other => panic!("expected basic.qos-ok, got {other:?}"),
    }
    assert!(
        bystander
            .method_within(Duration::from_millis(200))
            .await
            .is_none()
    );

    // A consumer on its own connection drains the queue while the alarm is raised.
    let consumer_conn = lapin::Connection::connect(&uri, Default::default())
        .await
        .expect("connect");
    let ch = consumer_conn.create_channel().await.expect("channel");
    ch.basic_qos(8, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = dl::consumer(&ch, &queue, "drain").await;
    let mut seen = Vec::new();
    for _ in 0..stored {
        let delivery = dl::next(&mut consumer).await;
        assert_eq!(delivery.data.len(), BIG);
        seen.push(index_of(&delivery.data));
        delivery.ack(BasicAckOptions::default()).await.expect("ack");
    }

    // Memory falls below the watermark: the publisher is told and its publishes go through.
    match publisher.method_within(Duration::from_secs(15)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)))) => {}
        other => panic!("expected connection.unblocked, got {other:?}"),
    }
    for tag in 1..=4 {
        assert_ack(
            publisher.method_within(Duration::from_secs(5)).await,
            u64::from(stored) + tag,
        );
    }
    assert_ack(quiet.method_within(Duration::from_secs(5)).await, 1);
    match streamer.method_within(Duration::from_secs(5)).await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)))) => {}
        other => panic!("expected connection.unblocked for the streamer, got {other:?}"),
    }
    streamer.send_raw(&body_frame(b'y')).await;
    assert_ack(streamer.method_within(Duration::from_secs(5)).await, 1);
    let streamed = dl::get_one(&setup_ch, &streamed_queue).await;
    assert_eq!(streamed.data, b"xy", "the streamed message, whole");
    for _ in 0..held.len() {
        let delivery = dl::next(&mut consumer).await;
        let index = index_of(&delivery.data);
        let size = if index == stored { BIG } else { SMALL };
        assert_eq!(delivery.data.len(), size, "message {index}");
        seen.push(index);
        delivery.ack(BasicAckOptions::default()).await.expect("ack");
    }
    dl::no_delivery(&mut consumer, 300).await;
    seen.sort_unstable();
    let mut expected: Vec<u32> = (0..stored).chain(held).collect();
    expected.sort_unstable();
    assert_eq!(seen, expected, "every message exactly once");

    let total = f64::from(stored) + 6.0;
    let text = wait_metric(admin, "dlx_proxy_messages_published_total", total).await;
    assert_eq!(gauge(&text, "dlx_proxy_memory_alarm"), 0.0);
    // The alarm cleared below 95 % of the watermark; the held messages taken since may have
    // grown the resident size again, but not back over the watermark.
    let used = gauge(&text, "dlx_proxy_memory_used_bytes");
    assert!(used < WATERMARK as f64, "used {used} after the drain");
    assert_eq!(gauge(&text, "dlx_proxy_blocked_connections"), 0.0);
    assert_eq!(gauge(&text, "dlx_proxy_connection_blocks_total"), 3.0);
    assert!(gauge(&text, "dlx_proxy_memory_releases_total") >= 1.0);
    assert!(
        bystander
            .method_within(Duration::from_millis(100))
            .await
            .is_none()
    );
    drop(process);
}
