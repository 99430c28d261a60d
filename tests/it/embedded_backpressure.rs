//! The embedded broker under a consumer that stops reading its socket: deliveries wait in the
//! connection's write queue up to `limits.connection_outbox_bytes` (one delivery more at
//! most), the rest stays in the queue, and the `outbox_bytes` gauge shows what waits; once
//! the consumer reads and acks again, every message arrives once, in order, and the gauge is
//! back to 0.

use crate::common;
use crate::proxy_support::message_count;

use std::time::Duration;

use common::dl::{self, BasicProperties};
use common::{RawClient, metric_value, wait_until};
use lapin::types::FieldTable;

/// The connection's write-queue budget in this test.
const OUTBOX: usize = 256 * 1024;
/// Message body size, and how many: 8 MiB, more than the write queue and the sockets' kernel
/// buffers hold together.
const SIZE: usize = 16 * 1024;
const COUNT: u32 = 512;
/// A delivery's frames besides its body (method, header, frame overheads), at most.
const DELIVERY_OVERHEAD: usize = 1024;

fn body(seq: u32) -> Vec<u8> {
    let mut body = vec![(seq % 251) as u8; SIZE];
    body[..4].copy_from_slice(&seq.to_be_bytes());
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_fills_its_write_queue_to_the_budget_and_the_gauge_shows_it() {
    let mut config = common::test_config();
    config.limits.connection_outbox_bytes = OUTBOX;
    let broker = common::start_with(config).await;
    let outbox_bytes =
        || metric_value(&broker.metrics_text(), "dlx_proxy_outbox_bytes").unwrap_or(-1.0);
    assert_eq!(outbox_bytes(), 0.0);

    let (_conn, ch) = broker.channel().await;
    let q = common::unique("stalled-embedded");
    dl::declare(&ch, &q, FieldTable::default()).await;
    dl::confirm_select(&ch).await;

    // A consumer with manual acks and no prefetch limit, on a socket with a small receive
    // buffer, that does not read while everything is published.
    let mut consumer = RawClient::connect_with_receive_buffer(broker.addr, &q, 32 * 1024).await;
    consumer.open_channel(1).await;
    consumer.consume(1, &q, false).await;
    for seq in 0..COUNT {
        dl::publish_to(&ch, "", &q, &body(seq), BasicProperties::default()).await;
    }

    // The dispatcher stops once the write queue holds its budget.
    wait_until(
        "the consumer's write queue to fill",
        Duration::from_secs(30),
        async || outbox_bytes() >= OUTBOX as f64,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stalled = outbox_bytes();
    assert!(
        stalled >= OUTBOX as f64 && stalled <= (OUTBOX + SIZE + DELIVERY_OVERHEAD) as f64,
        "outbox_bytes at the stall: {stalled} (budget {OUTBOX})"
    );
    let ready = message_count(&ch, &q).await;
    assert!(
        ready > COUNT / 4,
        "most messages wait in the queue, not in the broker's buffers: {ready} of {COUNT}"
    );

    // The consumer reads and acks again: everything arrives once, in order.
    for expected in 0..COUNT {
        let delivery = consumer.next_delivery().await;
        assert_eq!(delivery.body, body(expected), "message {expected}");
        consumer.ack(1, delivery.delivery_tag, false).await;
    }
    wait_until(
        "the write queue to empty",
        Duration::from_secs(10),
        async || outbox_bytes() == 0.0,
    )
    .await;
}
