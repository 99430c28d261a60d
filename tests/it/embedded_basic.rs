//! Embedded broker through lapin: declare, publish, consume, get, settle, QoS, confirms,
//! returns, requeue on close, recover, cancel, exclusive/auto-delete/expiring queues.

use crate::common;

use std::time::Duration;

use common::dl::{amqp_code, consumer, exchange};
use common::*;
use futures_util::StreamExt;
use lapin::Confirmation;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};

async fn publish(ch: &lapin::Channel, exchange: &str, key: &str, body: &[u8]) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirm");
}

async fn get_body(ch: &lapin::Channel, q: &str) -> Option<(Vec<u8>, u64, bool)> {
    ch.basic_get(q.into(), BasicGetOptions { no_ack: false })
        .await
        .expect("get")
        .map(|m| {
            (
                m.delivery.data.clone(),
                m.delivery.delivery_tag,
                m.delivery.redelivered,
            )
        })
}

/// The next `n` messages of `q` (basic.get, left unacked): body as text and redelivered flag.
async fn bodies_and_redelivered(ch: &lapin::Channel, q: &str, n: usize) -> Vec<(String, bool)> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let (body, _, redelivered) = get_body(ch, q).await.expect("a message");
        got.push((String::from_utf8(body).expect("text body"), redelivered));
    }
    got
}

async fn declare(ch: &lapin::Channel, q: &str) {
    common::dl::declare(ch, q, FieldTable::default()).await;
}

async fn next(consumer: &mut lapin::Consumer) -> Delivery {
    tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .expect("delivery in time")
        .expect("stream open")
        .expect("delivery ok")
}

#[tokio::test]
async fn publish_consume_ack_round_trip() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("basic");
    declare(&ch, &q).await;
    for i in 0..10 {
        publish(&ch, "", &q, format!("m{i}").as_bytes()).await;
    }
    let mut consumer = consumer(&ch, &q, "c1").await;
    for i in 0..10 {
        let d = next(&mut consumer).await;
        assert_eq!(d.data, format!("m{i}").as_bytes());
        assert_eq!(d.routing_key.as_str(), q);
        assert_eq!(d.exchange.as_str(), "");
        assert!(!d.redelivered);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let info = crate::common::dl::passive_declare(&ch, q.as_str())
        .await
        .unwrap();
    assert_eq!(info.message_count(), 0);
    assert_eq!(info.consumer_count(), 1);
    b.service.shutdown().await;
}

#[tokio::test]
async fn basic_get_reports_remaining_and_empty() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("get");
    declare(&ch, &q).await;
    publish(&ch, "", &q, b"a").await;
    publish(&ch, "", &q, b"b").await;
    let m = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.delivery.data, b"a");
    assert_eq!(m.message_count, 1);
    let m = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.message_count, 0);
    assert!(
        ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn nack_requeue_preserves_order_and_marks_redelivered() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("requeue");
    declare(&ch, &q).await;
    for m in [b"1", b"2", b"3"] {
        publish(&ch, "", &q, m).await;
    }
    let (_, _t1, _) = get_body(&ch, &q).await.unwrap();
    let (_, t2, _) = get_body(&ch, &q).await.unwrap();
    ch.basic_nack(
        t2,
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        bodies_and_redelivered(&ch, &q, 3).await,
        [("1".into(), true), ("2".into(), true), ("3".into(), false)]
    );
}

#[tokio::test]
async fn reject_without_requeue_discards_on_queue_without_dlx() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("discard");
    declare(&ch, &q).await;
    publish(&ch, "", &q, b"x").await;
    let (_, t, _) = get_body(&ch, &q).await.unwrap();
    ch.basic_reject(t, BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert!(get_body(&ch, &q).await.is_none());
}

#[tokio::test]
async fn prefetch_limits_unacked_deliveries() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("qos");
    declare(&ch, &q).await;
    for i in 0..5 {
        publish(&ch, "", &q, format!("{i}").as_bytes()).await;
    }
    ch.basic_qos(2, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut consumer = consumer(&ch, &q, "").await;
    let d1 = next(&mut consumer).await;
    let _d2 = next(&mut consumer).await;
    // A third delivery must not arrive while two are unacked.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), consumer.next())
            .await
            .is_err()
    );
    d1.ack(BasicAckOptions::default()).await.unwrap();
    let d3 = next(&mut consumer).await;
    assert_eq!(d3.data, b"2");
}

#[tokio::test]
async fn a_consumer_tag_used_again_does_not_inherit_the_cancelled_consumers_acks() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("qos-reuse");
    declare(&ch, &q).await;
    for i in 0..3 {
        publish(&ch, "", &q, format!("{i}").as_bytes()).await;
    }
    ch.basic_qos(1, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut first = consumer(&ch, &q, "w").await;
    let d0 = next(&mut first).await;
    ch.basic_cancel("w".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    // The tag is free again; its new consumer gets one delivery (prefetch 1).
    let mut second = consumer(&ch, &q, "w").await;
    let d1 = next(&mut second).await;
    assert_eq!(d1.data, b"1");
    // Acking the cancelled consumer's delivery frees nothing of the new one's prefetch.
    d0.ack(BasicAckOptions::default()).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), second.next())
            .await
            .is_err(),
        "a second delivery while one is unacked at prefetch 1"
    );
    d1.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(next(&mut second).await.data, b"2");
}

#[tokio::test]
async fn an_ack_on_one_queue_frees_the_channel_prefetch_for_consumers_of_another() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let (qa, qb) = (unique("gqos-a"), unique("gqos-b"));
    declare(&ch, &qa).await;
    declare(&ch, &qb).await;
    ch.basic_qos(1, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut on_a = consumer(&ch, &qa, "a").await;
    let mut on_b = consumer(&ch, &qb, "b").await;
    publish(&ch, "", &qa, b"a1").await;
    let a1 = next(&mut on_a).await;
    publish(&ch, "", &qb, b"b1").await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), on_b.next())
            .await
            .is_err(),
        "delivered past the channel's prefetch of 1"
    );
    // The ack on A makes room on the channel: B's consumer gets its message.
    a1.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(next(&mut on_b).await.data, b"b1");
}

#[tokio::test]
async fn a_connection_closing_gives_its_deliveries_back_to_the_queue_not_to_itself() {
    let b = start().await;
    let (_c, observer) = b.channel().await;
    let q = unique("close-back");
    declare(&observer, &q).await;
    // Three rounds: channels close in no set order, and the delivery went wrong only when its
    // channel closed before one of the connection's other consumers.
    for round in 0..3 {
        let conn = b.connect().await;
        let holder = conn.create_channel().await.unwrap();
        holder
            .basic_qos(1, BasicQosOptions { global: false })
            .await
            .unwrap();
        let mut held = consumer(&holder, &q, "holder").await;
        publish(&observer, "", &q, format!("m{round}").as_bytes()).await;
        let _m = next(&mut held).await;
        // Eight no-ack consumers of the same queue on other channels of the connection.
        let mut others = Vec::new();
        for i in 0..8 {
            let ch = conn.create_channel().await.unwrap();
            let c = ch
                .basic_consume(
                    q.as_str().into(),
                    format!("other-{i}").as_str().into(),
                    BasicConsumeOptions {
                        no_ack: true,
                        ..BasicConsumeOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            others.push((ch, c));
        }
        conn.close(200, "bye".into()).await.unwrap();
        // The unacked message is back in the queue, not delivered (and lost) on the way out.
        let back = crate::proxy_support::message_count(&observer, &q).await;
        assert_eq!(back, 1, "round {round}");
        let (body, _, redelivered) = get_body(&observer, &q).await.expect("the message");
        assert_eq!(body, format!("m{round}").as_bytes());
        assert!(redelivered);
        observer
            .basic_ack(
                lapin::types::DeliveryTag::default(),
                BasicAckOptions { multiple: true },
            )
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn global_prefetch_is_shared_by_the_channel() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q1 = unique("gqos");
    let q2 = unique("gqos");
    declare(&ch, &q1).await;
    declare(&ch, &q2).await;
    for q in [&q1, &q2] {
        for _ in 0..3 {
            publish(&ch, "", q, b"m").await;
        }
    }
    ch.basic_qos(2, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut c1 = consumer(&ch, &q1, "").await;
    let mut c2 = consumer(&ch, &q2, "").await;
    let _a = next(&mut c1).await;
    let _b = next(&mut c1).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c2.next())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn publisher_confirms_ack_and_mandatory_return() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("confirm");
    declare(&ch, &q).await;
    let c = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"x",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(c, Confirmation::Ack(None)));
    let c = ch
        .basic_publish(
            "".into(),
            "no-such-queue-anywhere".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"lost",
            BasicProperties::default().with_message_id("m-1".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    match c {
        Confirmation::Ack(Some(ret)) => {
            assert_eq!(ret.reply_code, 312);
            assert_eq!(ret.reply_text.as_str(), "NO_ROUTE");
            assert_eq!(ret.delivery.data, b"lost");
            assert_eq!(
                ret.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.as_str()),
                Some("m-1")
            );
        }
        other => panic!("expected an ack with a returned message, got {other:?}"),
    }
}

#[tokio::test]
async fn unacked_messages_requeue_on_channel_close_in_order() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = unique("close");
    declare(&ch, &q).await;
    for m in [b"1", b"2", b"3"] {
        publish(&ch, "", &q, m).await;
    }
    let ch2 = c.create_channel().await.unwrap();
    get_body(&ch2, &q).await.unwrap();
    get_body(&ch2, &q).await.unwrap();
    ch2.close(200, "bye".into()).await.unwrap();
    assert_eq!(
        bodies_and_redelivered(&ch, &q, 3).await,
        [("1".into(), true), ("2".into(), true), ("3".into(), false)]
    );
}

#[tokio::test]
async fn unacked_messages_requeue_on_connection_loss() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("loss");
    declare(&ch, &q).await;
    publish(&ch, "", &q, b"1").await;
    {
        let (c2, ch2) = b.channel().await;
        get_body(&ch2, &q).await.unwrap();
        c2.close(200, "bye".into()).await.unwrap();
    }
    assert!(eventually(|| true).await);
    let (body, _, redelivered) = get_body(&ch, &q).await.expect("requeued");
    assert_eq!(body, b"1");
    assert!(redelivered);
}

#[tokio::test]
async fn recover_requeues_unacked() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("recover");
    declare(&ch, &q).await;
    publish(&ch, "", &q, b"1").await;
    get_body(&ch, &q).await.unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    let (body, _, redelivered) = get_body(&ch, &q).await.unwrap();
    assert_eq!((body.as_slice(), redelivered), (&b"1"[..], true));
}

#[tokio::test]
async fn multiple_ack_settles_everything_up_to_the_tag() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("multi");
    declare(&ch, &q).await;
    for _ in 0..3 {
        publish(&ch, "", &q, b"m").await;
    }
    let mut last = 0;
    for _ in 0..3 {
        last = get_body(&ch, &q).await.unwrap().1;
    }
    ch.basic_ack(last, BasicAckOptions { multiple: true })
        .await
        .unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    assert!(get_body(&ch, &q).await.is_none(), "all three were settled");
}

#[tokio::test]
async fn deleting_a_queue_cancels_its_consumers() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("cancelnotify");
    declare(&ch, &q).await;
    let mut consumer = consumer(&ch, &q, "").await;
    let (_c2, ch2) = b.channel().await;
    ch2.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .expect("stream ends");
    assert!(end.is_none(), "consumer stream closed by basic.cancel");
}

#[tokio::test]
async fn cancel_stops_deliveries_and_auto_delete_removes_queue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("autodel");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let consumer = consumer(&ch, &q, "t1").await;
    assert_eq!(consumer.tag().as_str(), "t1");
    ch.basic_cancel("t1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let err = crate::common::dl::passive_declare(&ch, q.as_str())
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(404));
}

#[tokio::test]
async fn server_named_and_exclusive_queues() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let name = q.name().as_str().to_string();
    assert!(name.starts_with("amq.gen-"), "{name}");
    let (_c2, ch2) = b.channel().await;
    let err = ch2
        .basic_consume(
            name.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(405));
    drop(_c);
}

#[tokio::test]
async fn exclusive_queue_is_deleted_with_its_connection() {
    let b = start().await;
    let name;
    {
        let (c, ch) = b.channel().await;
        let q = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        name = q.name().as_str().to_string();
        c.close(200, "bye".into()).await.unwrap();
    }
    let (_c, ch) = b.channel().await;
    let mut gone = false;
    for _ in 0..50 {
        match crate::common::dl::passive_declare(&ch, name.as_str()).await {
            Err(e) => {
                assert_eq!(amqp_code(&e), Some(404));
                gone = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(gone);
}

#[tokio::test]
async fn queue_with_x_expires_is_deleted_when_unused() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = unique("expires");
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(100));
    ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let ch = c.create_channel().await.unwrap();
    let err = crate::common::dl::passive_declare(&ch, q.as_str())
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(404));
}

#[tokio::test]
async fn purge_and_delete_report_counts() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("purge");
    declare(&ch, &q).await;
    for _ in 0..3 {
        publish(&ch, "", &q, b"m").await;
    }
    assert_eq!(
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())
            .await
            .unwrap(),
        3
    );
    publish(&ch, "", &q, b"m").await;
    assert_eq!(
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn delete_if_empty_and_if_unused_refuse_with_406() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = unique("ifempty");
    declare(&ch, &q).await;
    publish(&ch, "", &q, b"m").await;
    let err = ch
        .queue_delete(
            q.as_str().into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    let ch = c.create_channel().await.unwrap();
    let _consumer = consumer(&ch, &q, "").await;
    let ch2 = c.create_channel().await.unwrap();
    let err = ch2
        .queue_delete(
            q.as_str().into(),
            QueueDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
}

#[tokio::test]
async fn channel_flow_pauses_deliveries() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("flow");
    declare(&ch, &q).await;
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(
        !ch.channel_flow(ChannelFlowOptions { active: false })
            .await
            .unwrap()
    );
    let (_c2, ch2) = b.channel().await;
    publish(&ch2, "", &q, b"held").await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), consumer.next())
            .await
            .is_err()
    );
    assert!(
        ch.channel_flow(ChannelFlowOptions { active: true })
            .await
            .unwrap()
    );
    assert_eq!(next(&mut consumer).await.data, b"held");
}

#[tokio::test]
async fn large_message_is_split_and_joined_at_frame_max() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("large");
    declare(&ch, &q).await;
    let body: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    publish(&ch, "", &q, &body).await;
    let (got, _, _) = get_body(&ch, &q).await.unwrap();
    assert_eq!(got.len(), body.len());
    assert!(got == body);
}

#[tokio::test]
async fn message_over_max_size_is_refused_with_406() {
    let mut cfg = test_config();
    cfg.limits.max_message_size = 1000;
    let b = start_with(cfg).await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("toolarge");
    declare(&ch, &q).await;
    let res = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            &[0u8; 2000],
            BasicProperties::default(),
        )
        .await;
    let err = match res {
        Ok(confirm) => confirm.await.unwrap_err(),
        Err(e) => e,
    };
    assert_eq!(amqp_code(&err), Some(406));
}

#[tokio::test]
async fn exchange_declare_and_delete() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let x = unique("x");
    exchange(&ch, &x, ExchangeKind::Topic).await;
    // Same declaration again is fine; a different type is 406.
    exchange(&ch, &x, ExchangeKind::Topic).await;
    let err = ch
        .exchange_declare(
            x.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    let ch = c.create_channel().await.unwrap();
    ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let err = ch
        .exchange_declare(
            x.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(404));
}

/// Starts consumer `tag` on `queue` with `x-priority` `priority`.
async fn consumer_with_priority(
    ch: &lapin::Channel,
    queue: &str,
    tag: &str,
    priority: AMQPValue,
) -> lapin::Result<lapin::Consumer> {
    ch.basic_consume(
        queue.into(),
        tag.into(),
        BasicConsumeOptions::default(),
        common::dl::table(&[("x-priority", priority)]),
    )
    .await
}

/// Consumer priorities (`x-priority`): the higher priority consumer gets every message while
/// it has capacity; a lower one only while it is blocked by its prefetch, and not once it has
/// room again. A value that is not an integer is RabbitMQ's 406.
#[tokio::test]
async fn a_higher_priority_consumer_gets_messages_first() {
    use common::dl::{ack, next, no_delivery, payload};
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = unique("prio");
    common::dl::declare(&ch, &q, FieldTable::default()).await;
    let low_ch = c.create_channel().await.unwrap();
    let mut low = consumer_with_priority(&low_ch, &q, "low", AMQPValue::LongInt(0))
        .await
        .unwrap();
    let high_ch = c.create_channel().await.unwrap();
    high_ch
        .basic_qos(2, BasicQosOptions::default())
        .await
        .unwrap();
    let mut high = consumer_with_priority(&high_ch, &q, "high", AMQPValue::ShortShortInt(5))
        .await
        .unwrap();
    common::dl::publish(&ch, &q, &["m0", "m1"]).await;
    let h0 = next(&mut high).await;
    let h1 = next(&mut high).await;
    assert_eq!((payload(&h0), payload(&h1)), ("m0".into(), "m1".into()));
    no_delivery(&mut low, 200).await;
    // The high one is at its prefetch: the low one gets the next.
    common::dl::publish(&ch, &q, &["m2"]).await;
    assert_eq!(payload(&next(&mut low).await), "m2");
    // With room again, the high one gets them all.
    ack(&high_ch, h0.delivery_tag, false).await;
    ack(&high_ch, h1.delivery_tag, false).await;
    common::dl::publish(&ch, &q, &["m3", "m4"]).await;
    assert_eq!(payload(&next(&mut high).await), "m3");
    assert_eq!(payload(&next(&mut high).await), "m4");
    no_delivery(&mut low, 200).await;

    let bad_ch = c.create_channel().await.unwrap();
    let err = consumer_with_priority(&bad_ch, &q, "bad", AMQPValue::LongString("5".into()))
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    assert_eq!(
        common::dl::amqp_text(&err),
        format!(
            "PRECONDITION_FAILED - invalid arg 'x-priority' for queue '{q}' in vhost '/': \"expected integer, got longstr\""
        )
    );
}

/// A queue named after `tag` with `x-single-active-consumer`.
async fn single_active_consumer_queue(ch: &lapin::Channel, tag: &str) -> String {
    let q = unique(tag);
    common::dl::declare(
        ch,
        &q,
        common::dl::table(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await;
    q
}

/// The active consumer's channel closes with deliveries unacked and more waiting: its
/// successor gets the returned ones first, then the rest, in order (as RabbitMQ requeues
/// before it delivers).
#[tokio::test]
async fn a_single_active_consumers_successor_gets_returned_messages_first() {
    use common::dl::{next, no_delivery, payload};
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = single_active_consumer_queue(&ch, "sac-order").await;
    let active = c.create_channel().await.unwrap();
    active
        .basic_qos(3, BasicQosOptions::default())
        .await
        .unwrap();
    let mut first = consumer(&active, &q, "first").await;
    let next_ch = c.create_channel().await.unwrap();
    let mut second = consumer(&next_ch, &q, "second").await;
    common::dl::publish(&ch, &q, &["m0", "m1", "m2", "m3", "m4"]).await;
    for i in 0..3 {
        assert_eq!(payload(&next(&mut first).await), format!("m{i}"));
    }
    no_delivery(&mut second, 200).await;
    active.close(200, "bye".into()).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..5 {
        let d = next(&mut second).await;
        got.push((payload(&d), d.redelivered));
    }
    let expected: Vec<(String, bool)> = (0..5).map(|i| (format!("m{i}"), i < 3)).collect();
    assert_eq!(got, expected);
}

/// `x-single-active-consumer`: only the first registered consumer gets messages while it is
/// there; cancelled, the next one takes over. A value that is not a bool is RabbitMQ's 406.
#[tokio::test]
async fn a_single_active_consumer_queue_delivers_to_one_consumer_at_a_time() {
    use common::dl::{ack, next, no_delivery, payload, table, try_declare};
    let b = start().await;
    let (c, ch) = b.channel().await;
    let q = single_active_consumer_queue(&ch, "sac").await;
    let ch_b = c.create_channel().await.unwrap();
    let mut first = consumer(&ch, &q, "first").await;
    let mut second = consumer(&ch_b, &q, "second").await;
    common::dl::publish(&ch, &q, &["m0", "m1", "m2", "m3"]).await;
    for i in 0..4 {
        let d = next(&mut first).await;
        assert_eq!(payload(&d), format!("m{i}"));
        ack(&ch, d.delivery_tag, false).await;
    }
    no_delivery(&mut second, 200).await;
    // Waiting messages go to the next consumer as soon as the active one is cancelled.
    common::dl::publish(&ch, &q, &["m4"]).await;
    let held = next(&mut first).await;
    assert_eq!(payload(&held), "m4");
    ch.basic_qos(1, BasicQosOptions { global: true })
        .await
        .unwrap();
    common::dl::publish(&ch, &q, &["m5"]).await;
    no_delivery(&mut second, 200).await;
    ch.basic_cancel("first".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let d = next(&mut second).await;
    assert_eq!(payload(&d), "m5");
    ack(&ch_b, d.delivery_tag, false).await;
    ack(&ch, held.delivery_tag, false).await;

    let err = try_declare(
        &ch,
        &unique("sac-bad"),
        table(&[(
            "x-single-active-consumer",
            AMQPValue::LongString("true".into()),
        )]),
    )
    .await
    .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    assert!(
        common::dl::amqp_text(&err).ends_with(": {unacceptable_type,longstr}"),
        "{}",
        common::dl::amqp_text(&err)
    );
}
