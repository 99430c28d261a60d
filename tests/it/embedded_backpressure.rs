//! The embedded broker under a consumer that stops reading its socket: deliveries wait in the
//! connection's write queue up to `limits.connection_outbox_bytes` (one delivery more at
//! most), the rest stays in the queue, and the `outbox_bytes` gauge shows what waits; once
//! the consumer reads and acks again, every message arrives once, in order, and the gauge is
//! back to 0. A client that sends requests without reading their answers is held the same
//! way: the broker stops reading it at twice the budget, and its consumer timeouts still fire
//! while it waits.

use crate::common;
use crate::proxy_support::message_count;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic};
use common::dl::{self, BasicProperties};
use common::{RawClient, encode_method, metric_value, wait_until};
use dlx_proxy::amqp::codec::decode_method;
use futures_util::StreamExt;
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

/// A client that sends requests without reading the answers: `basic.get` and
/// `basic.reject(requeue)` of one large message, hundreds of times in one write. Its
/// connection's write queue stops at twice the budget (plus one answer), because the broker
/// stops reading the client's frames until the answers are read; then every answer arrives,
/// in order, and the message is still in its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answers_cannot_grow_its_write_queue() {
    const GET_SIZE: usize = 64 * 1024;
    const ROUNDS: u64 = 400;
    let mut config = common::test_config();
    config.limits.connection_outbox_bytes = OUTBOX;
    let broker = common::start_with(config).await;
    let outbox_bytes =
        || metric_value(&broker.metrics_text(), "dlx_proxy_outbox_bytes").unwrap_or(-1.0);

    let (_conn, ch) = broker.channel().await;
    let q = common::unique("unread-answers");
    dl::declare(&ch, &q, FieldTable::default()).await;
    dl::confirm_select(&ch).await;
    let message = vec![7u8; GET_SIZE];
    dl::publish_to(&ch, "", &q, &message, BasicProperties::default()).await;

    // 400 answers of 64 KiB: 26 MB, far more than the budget and the sockets' buffers.
    let mut client =
        RawClient::connect_with_receive_buffer(broker.addr, "unread-answers", 32 * 1024).await;
    client.open_channel(1).await;
    let mut requests = Vec::new();
    for tag in 1..=ROUNDS {
        requests.extend(encode_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: q.as_str().into(),
                no_ack: false,
            })),
        ));
        requests.extend(encode_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag: tag,
                requeue: true,
            })),
        ));
    }
    client.send_raw(&requests).await;

    wait_until(
        "the client's write queue to fill",
        Duration::from_secs(30),
        async || outbox_bytes() >= OUTBOX as f64,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stalled = outbox_bytes();
    let bound = 2 * OUTBOX + GET_SIZE + DELIVERY_OVERHEAD;
    assert!(
        stalled <= bound as f64,
        "outbox_bytes while the client reads nothing: {stalled} (bound {bound})"
    );

    // The client reads: every answer arrives, in order, each with the whole message.
    for tag in 1..=ROUNDS {
        let payload = client.expect_method(60, 71).await;
        match decode_method(&payload) {
            Some(AMQPClass::Basic(basic::AMQPMethod::GetOk(get_ok))) => {
                assert_eq!(get_ok.delivery_tag, tag);
                assert_eq!(get_ok.redelivered, tag > 1, "answer {tag}");
            }
            other => panic!("expected basic.get-ok, got {other:?}"),
        }
        let (_, body) = client.next_content().await;
        assert_eq!(body, message, "answer {tag}");
    }
    wait_until(
        "the write queue to empty",
        Duration::from_secs(10),
        async || outbox_bytes() == 0.0,
    )
    .await;
    assert_eq!(
        message_count(&ch, &q).await,
        1,
        "the message is still queued"
    );
}

/// A consumer that stops reading while its connection's write queue holds more than twice the
/// budget (one delivery larger than that): its reader waits for the writer before it reads
/// another frame, and the consumer timeout still closes its channel meanwhile, so the message
/// goes back to the queue and to the next consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_timeout_fires_while_the_connection_waits_for_its_writer() {
    // More than twice the budget even after the kernel's socket buffers took their part.
    const BIG: usize = 16 * 1024 * 1024;
    let mut config = common::test_config();
    config.limits.connection_outbox_bytes = OUTBOX;
    config.limits.consumer_timeout = 1000;
    let broker = common::start_with(config).await;
    let outbox_bytes =
        || metric_value(&broker.metrics_text(), "dlx_proxy_outbox_bytes").unwrap_or(-1.0);
    let (_conn, ch) = broker.channel().await;
    let q = common::unique("timeout-stalled");
    dl::declare(&ch, &q, FieldTable::default()).await;
    dl::confirm_select(&ch).await;
    let message = vec![3u8; BIG];
    dl::publish_to(&ch, "", &q, &message, BasicProperties::default()).await;

    let mut stalled =
        RawClient::connect_with_receive_buffer(broker.addr, "stalled", 32 * 1024).await;
    stalled.open_channel(1).await;
    stalled.consume(1, &q, false).await;
    wait_until(
        "the delivery to fill the write queue past twice the budget",
        Duration::from_secs(10),
        async || outbox_bytes() >= (2 * OUTBOX) as f64,
    )
    .await;
    // A frame from the client makes its reader look at the write queue, and wait for room.
    stalled.send_raw(&[8, 0, 0, 0, 0, 0, 0, 0xCE]).await;

    let mut next = dl::consumer(&ch, &q, "next").await;
    let delivery = tokio::time::timeout(Duration::from_secs(10), next.next())
        .await
        .expect("the message back from the timed-out consumer in time")
        .expect("consumer open")
        .expect("delivery");
    assert!(delivery.redelivered);
    assert_eq!(delivery.data, message);
}

/// The broker closes a connection (here a protocol error) while its no-ack consumer has a
/// backlog in the write queue: nothing is delivered behind the connection.close, which the
/// client must discard, so every message not received before the close is still in the
/// queue. (The consumers were removed only after the close-ok wait: the writer's drain
/// dispatched more deliveries behind the close, and those no-ack messages were lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_delivered_behind_a_connection_close_the_broker_sends() {
    const SMALL: usize = 64 * 1024;
    const MESSAGES: u32 = COUNT;
    let mut config = common::test_config();
    config.limits.connection_outbox_bytes = SMALL;
    let broker = common::start_with(config).await;
    let (_conn, ch) = broker.channel().await;
    let q = common::unique("closed-behind");
    dl::declare(&ch, &q, FieldTable::default()).await;
    dl::confirm_select(&ch).await;
    for seq in 0..MESSAGES {
        dl::publish_to(&ch, "", &q, &body(seq), BasicProperties::default()).await;
    }
    let mut consumer = RawClient::connect_with_receive_buffer(broker.addr, &q, 32 * 1024).await;
    consumer.open_channel(1).await;
    consumer.consume(1, &q, true).await;
    let outbox_bytes =
        || metric_value(&broker.metrics_text(), "dlx_proxy_outbox_bytes").unwrap_or(-1.0);
    wait_until(
        "the consumer's write queue to fill",
        Duration::from_secs(30),
        async || outbox_bytes() >= SMALL as f64,
    )
    .await;
    // A heartbeat with a payload: the broker closes the connection with 501.
    consumer
        .send_raw(&[8, 0, 0, 0, 0, 0, 4, 0xDE, 0xAD, 0xBE, 0xEF, 0xCE])
        .await;
    let (mut before, mut after, mut closed) = (0u32, 0u32, false);
    while let Some(frame) = consumer.read_frame().await {
        if frame.kind != dlx_proxy::amqp::codec::FRAME_METHOD {
            continue;
        }
        match frame.method_ids() {
            (60, 60) if closed => after += 1,
            (60, 60) => before += 1,
            (10, 50) => {
                closed = true;
                consumer.send_close_ok().await;
            }
            _ => {}
        }
        // Read slowly, so the writer drains a little at a time.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(closed, "no connection.close");
    assert_eq!(after, 0, "deliveries behind the close");
    assert_eq!(message_count(&ch, &q).await + before, MESSAGES);
}

/// A consumer that hangs with its socket open while the broker holds more than twice the
/// write-queue budget for it (one large message): the broker reads nothing from it then, not
/// even its heartbeats, yet still drops it after two heartbeat intervals without a read, so
/// its unacked delivery goes back to the queue. (It waited for room for ever.) Its writer,
/// blocked on the socket, is stopped after the grace period, so what it held is released:
/// the write queue's bytes leave the `outbox_bytes` gauge. (It stayed in its write for as long
/// as the peer's kernel kept the connection, with the message's copy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_consumer_behind_a_full_write_queue_is_dropped_after_its_heartbeats() {
    const SMALL: usize = 64 * 1024;
    let mut config = common::test_config();
    config.limits.connection_outbox_bytes = SMALL;
    config.limits.heartbeat_secs = 1;
    let broker = common::start_with(config).await;
    let (_conn, ch) = broker.channel().await;
    let q = common::unique("hung");
    dl::declare(&ch, &q, FieldTable::default()).await;
    dl::confirm_select(&ch).await;
    let big = vec![7u8; 8 * 1024 * 1024];
    dl::publish_to(&ch, "", &q, &big, BasicProperties::default()).await;
    let mut consumer =
        RawClient::connect_with_receive_buffer_and_heartbeat(broker.addr, &q, 32 * 1024, 1).await;
    consumer.open_channel(1).await;
    consumer.consume(1, &q, false).await;
    // The consumer now reads and sends nothing; the delivery is unacked meanwhile.
    wait_until(
        "the delivery to be out",
        Duration::from_secs(10),
        async || message_count(&ch, &q).await == 0,
    )
    .await;
    wait_until(
        "the hung consumer's delivery back in the queue",
        Duration::from_secs(10),
        async || message_count(&ch, &q).await == 1,
    )
    .await;
    wait_until(
        "the hung consumer's writer to let go of its write queue",
        Duration::from_secs(15),
        async || {
            let text = broker.metrics_text();
            common::metric_value(&text, "dlx_proxy_outbox_bytes") == Some(0.0)
        },
    )
    .await;
    drop(consumer);
}
