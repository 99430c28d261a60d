//! Overflow without a dead-letter exchange: the nine cases of RabbitMQ's
//! `queue_length_limits_SUITE` (reference §1.10, group max_length_classic), plus the two that
//! also run on quorum queues.

use crate::common;

use common::dl::*;
use common::*;

fn bytes_payload(c: char) -> String {
    c.to_string().repeat(80)
}

/// A broker, and a channel on which the durable queue "q" is declared with these arguments.
async fn limited_queue(args: &[(&str, AMQPValue)]) -> (TestBroker, lapin::Connection, Channel) {
    let broker = start().await;
    let (conn, ch) = broker.channel().await;
    declare_durable(&ch, "q", table(args)).await;
    (broker, conn, ch)
}

async fn publish_one(ch: &Channel, q: &str, p: &str) -> Confirmation {
    publish_to(ch, "", q, p.as_bytes(), BasicProperties::default()).await
}

/// "drops head": publish 1, get 1; publish 1,2 → get 2; publish 1,2,3 → get 3.
async fn check_max_length_drops_head(ch: &Channel, q: &str, p: [&str; 3]) {
    confirm_select(ch).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0]]).await;
    consume(ch, q, &[p[0]]).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0], p[1]]).await;
    consume(ch, q, &[p[1]]).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0], p[1], p[2]]).await;
    consume(ch, q, &[p[2]]).await;
    consume_empty(ch, q).await;
}

/// "drops publish": publish 1, get 1; publish 1,2 → get 1; publish 1,2,3 → get 1.
async fn check_max_length_drops_publish(ch: &Channel, q: &str, p: [&str; 3]) {
    confirm_select(ch).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0]]).await;
    consume(ch, q, &[p[0]]).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0], p[1]]).await;
    consume(ch, q, &[p[0]]).await;
    consume_empty(ch, q).await;
    publish(ch, q, &[p[0], p[1], p[2]]).await;
    consume(ch, q, &[p[0]]).await;
    consume_empty(ch, q).await;
}

/// "rejects": ack, nack, nack; get 1; publish 2 → ack; get 2.
async fn check_max_length_rejects(ch: &Channel, q: &str, p: [&str; 3]) {
    confirm_select(ch).await;
    let c = publish_one(ch, q, p[0]).await;
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    let c = publish_one(ch, q, p[1]).await;
    assert!(matches!(c, Confirmation::Nack(_)), "{c:?}");
    let c = publish_one(ch, q, p[2]).await;
    assert!(matches!(c, Confirmation::Nack(_)), "{c:?}");
    consume(ch, q, &[p[0]]).await;
    let c = publish_one(ch, q, p[1]).await;
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    consume(ch, q, &[p[1]]).await;
}

/// "requeue": the limit counts ready messages only, and a requeue is never refused.
async fn check_max_length_requeue(ch: &Channel, q: &str, p: [&str; 2]) {
    confirm_select(ch).await;
    let c = publish_one(ch, q, p[0]).await;
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    let t = consume(ch, q, &[p[0]]).await[0];
    let c = publish_one(ch, q, p[1]).await;
    assert!(matches!(c, Confirmation::Ack(None)), "{c:?}");
    nack(ch, t, false, true).await;
    consume(ch, q, &[p[0], p[1]]).await;
    consume_empty(ch, q).await;
}

#[tokio::test]
async fn max_length_default() {
    let (_broker, _conn, ch) = limited_queue(&[("x-max-length", int(1))]).await;
    check_max_length_drops_head(&ch, "q", ["1", "2", "3"]).await;
}

#[tokio::test]
async fn max_length_drop_head() {
    let (_broker, _conn, ch) =
        limited_queue(&[("x-max-length", int(1)), ("x-overflow", ls("drop-head"))]).await;
    check_max_length_drops_head(&ch, "q", ["1", "2", "3"]).await;
}

#[tokio::test]
async fn max_length_bytes_default() {
    let (_broker, _conn, ch) = limited_queue(&[("x-max-length-bytes", int(100))]).await;
    let p = [bytes_payload('1'), bytes_payload('2'), bytes_payload('3')];
    check_max_length_drops_head(&ch, "q", [&p[0], &p[1], &p[2]]).await;
}

#[tokio::test]
async fn max_length_bytes_drop_head() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length-bytes", int(100)),
        ("x-overflow", ls("drop-head")),
    ])
    .await;
    let p = [bytes_payload('1'), bytes_payload('2'), bytes_payload('3')];
    check_max_length_drops_head(&ch, "q", [&p[0], &p[1], &p[2]]).await;
}

#[tokio::test]
async fn max_length_reject_confirm() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish")),
    ])
    .await;
    check_max_length_drops_publish(&ch, "q", ["1", "2", "3"]).await;
    check_max_length_rejects(&ch, "q", ["1", "2", "3"]).await;
}

#[tokio::test]
async fn max_length_bytes_reject_confirm() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length-bytes", int(100)),
        ("x-overflow", ls("reject-publish")),
    ])
    .await;
    let p = [bytes_payload('1'), bytes_payload('2'), bytes_payload('3')];
    check_max_length_drops_publish(&ch, "q", [&p[0], &p[1], &p[2]]).await;
    check_max_length_rejects(&ch, "q", [&p[0], &p[1], &p[2]]).await;
}

#[tokio::test]
async fn max_length_drop_publish() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish")),
    ])
    .await;
    check_max_length_drops_publish(&ch, "q", ["1", "2", "3"]).await;
}

#[tokio::test]
async fn max_length_drop_publish_requeue() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish")),
    ])
    .await;
    check_max_length_requeue(&ch, "q", ["1", "2"]).await;
}

#[tokio::test]
async fn max_length_bytes_drop_publish() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-max-length-bytes", int(100)),
        ("x-overflow", ls("reject-publish")),
    ])
    .await;
    let p = [bytes_payload('1'), bytes_payload('2'), bytes_payload('3')];
    check_max_length_drops_publish(&ch, "q", [&p[0], &p[1], &p[2]]).await;
}

/// Group max_length_quorum: max_length_default on a quorum queue.
#[tokio::test]
async fn max_length_default_quorum() {
    let (_broker, _conn, ch) =
        limited_queue(&[("x-queue-type", ls("quorum")), ("x-max-length", int(1))]).await;
    check_max_length_drops_head(&ch, "q", ["1", "2", "3"]).await;
}

/// Group max_length_quorum: max_length_bytes_default on a quorum queue.
#[tokio::test]
async fn max_length_bytes_default_quorum() {
    let (_broker, _conn, ch) = limited_queue(&[
        ("x-queue-type", ls("quorum")),
        ("x-max-length-bytes", int(100)),
    ])
    .await;
    let p = [bytes_payload('1'), bytes_payload('2'), bytes_payload('3')];
    check_max_length_drops_head(&ch, "q", [&p[0], &p[1], &p[2]]).await;
}
