//! Proxy mode, delivery limits: a requeue on a queue with a delivery limit comes back with an
//! incremented `x-delivery-count`; past the limit the message is dead-lettered with reason
//! `delivery_limit` (classic queues emulated by the proxy; quorum queues counted upstream, the
//! return past the limit dead-lettered by the proxy in one hop).

use crate::proxy_support;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
    BasicRejectOptions, QueueDeclareOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldTable};
use proxy_support::*;

async fn publish_one(ch: &lapin::Channel, queue: &str, payload: &str) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        payload.as_bytes(),
        AMQPProperties::default(),
    )
    .await
    .unwrap();
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        multiple: false,
        requeue: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_queue_delivery_limit_counts_requeues_then_dead_letters() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("limit");
    let dlx = unique("limit-dlx");
    let dlq = unique("limit-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-delivery-limit", AMQPValue::LongInt(1)),
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
        ]),
    )
    .await;
    publish_one(&ch, &q, "m").await;
    let first = get(&ch, &q).await;
    assert!(header(&first, "x-delivery-count").is_none());
    first.acker.nack(requeue()).await.unwrap();
    let second = get(&ch, &q).await;
    assert_eq!(payload(&second), "m");
    assert_eq!(
        header(&second, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    second
        .acker
        .reject(BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "m");
    assert!(header(&dead, "x-delivery-count").is_none());
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1);
    assert_eq!(field(&deaths[0], "reason"), &ls("delivery_limit"));
    assert_eq!(field(&deaths[0], "queue"), &ls(&q));
    assert_eq!(
        header(&dead, "x-first-death-reason"),
        Some(&ls("delivery_limit"))
    );
    consume_empty(&ch, &q).await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &q), ("reason", "delivery_limit"), ("vhost", "/")],
            1.0,
        )
        .await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_limit_of_zero_allows_one_delivery_to_a_consumer() {
    let q = unique("limit0");
    let dlx = unique("limit0-dlx");
    let dlq = unique("limit0-dlq");
    let proxy = TestProxy::start(vec![policy(
        "limit",
        &format!("^{q}$"),
        serde_json::json!({"delivery-limit": 0, "dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
    )])
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare_dlx(&ch, &dlx, &dlq).await;
    declare(&ch, &q, FieldTable::default()).await;
    publish_one(&ch, &q, "once").await;
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let d = next(&mut rx).await;
    d.acker.nack(requeue()).await.unwrap();
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "once");
    assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("delivery_limit"));
    dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(300), rx.recv())
            .await
            .is_err(),
        "no second delivery"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_limit_without_a_dead_letter_exchange_the_message_is_dropped() {
    let proxy = TestProxy::start_with(vec![], |config| {
        config.dead_letter.default_delivery_limit = 2;
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("limit-nodlx");
    declare(&ch, &q, FieldTable::default()).await;
    publish_one(&ch, &q, "m").await;
    for count in 0..=2i64 {
        let d = get(&ch, &q).await;
        if count > 0 {
            assert_eq!(
                header(&d, "x-delivery-count"),
                Some(&AMQPValue::LongLongInt(count))
            );
        }
        d.acker.nack(requeue()).await.unwrap();
    }
    wait_upstream_empty(&q).await;
    proxy.stop().await;
}

/// A durable quorum queue with `x-delivery-limit` 1 and a dead-letter exchange, declared
/// through `proxy`, and its DLQ; returns (queue, dlx, dlq).
async fn quorum_limited(ch: &lapin::Channel, tag: &str) -> (String, String, String) {
    let q = unique(&format!("{tag}-limit"));
    let dlx = unique(&format!("{tag}-dlx"));
    let dlq = unique(&format!("{tag}-dlq"));
    declare_dlx(ch, &dlx, &dlq).await;
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        table(&[
            ("x-queue-type", ls("quorum")),
            ("x-delivery-limit", AMQPValue::LongInt(1)),
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
        ]),
    )
    .await
    .unwrap();
    (q, dlx, dlq)
}

/// The dead letter of "qm" from `q`: one x-death entry, reason `delivery_limit`, counted by
/// the proxy without passing through the capture queue.
async fn dead_lettered_in_one_hop(
    proxy: &TestProxy,
    ch: &lapin::Channel,
    q: &str,
    dlx: &str,
    dlq: &str,
) {
    let dead = get(ch, dlq).await;
    assert_eq!(payload(&dead), "qm");
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(field(&deaths[0], "reason"), &ls("delivery_limit"));
    assert_eq!(field(&deaths[0], "queue"), &ls(q));
    assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(dead.exchange.as_str(), dlx);
    let headers = dead.properties.headers().clone().unwrap_or_default();
    assert_eq!(headers.inner().get("x-delivery-count"), None);
    proxy.wait_dead_lettered(q, "delivery_limit", 1.0).await;
    let captured = [("outcome", "dead_lettered"), ("vhost", "/")];
    assert_eq!(proxy.counter("captured_total", &captured), 0.0);
    consume_empty(ch, q).await;
    ch.queue_delete(q.into(), Default::default()).await.unwrap();
}

/// RabbitMQ counts a quorum queue's returns (`x-delivery-count`); the requeue it would
/// dead-letter on return is dead-lettered by the proxy itself, exactly as RabbitMQ would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_count_upstream_and_the_requeue_past_the_limit_dies_in_one_hop() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = quorum_limited(&ch, "quorum").await;
    publish_one(&ch, &q, "qm").await;
    for _ in 0..2 {
        let d = get(&ch, &q).await;
        d.acker.nack(requeue()).await.unwrap();
    }
    dead_lettered_in_one_hop(&proxy, &ch, &q, &dlx, &dlq).await;
    proxy.stop().await;
}

/// A consumer that closes its channel holding a quorum delivery that RabbitMQ would
/// dead-letter on that return: the proxy dead-letters it before the channel closes upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_delivery_past_the_limit_left_on_a_closed_channel_dies_in_one_hop() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = quorum_limited(&ch, "quorum-close").await;
    publish_one(&ch, &q, "qm").await;
    let first = get(&ch, &q).await;
    first.acker.nack(requeue()).await.unwrap();
    let holder = conn.create_channel().await.unwrap();
    let second = get(&holder, &q).await;
    assert!(second.redelivered);
    holder.close(200, "bye".into()).await.unwrap();
    dead_lettered_in_one_hop(&proxy, &ch, &q, &dlx, &dlq).await;
    proxy.stop().await;
}
