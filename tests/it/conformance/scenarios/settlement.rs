//! Consumer settlement: reject, nack (single, multiple, requeue), basic.get, auto-ack, and
//! what channel and connection close do to unacked deliveries.

use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions};
use serde_json::{Value, json};

use super::{Ch, Ctx, Msg, Outcome, get_and_reject, ls, none, reject, scenarios, standard, table};
use crate::conformance::ctx::nth;

scenarios! {
    reject_requeue_false: "basic.consume + basic.reject(requeue=false) dead-letters once with reason 'rejected'",
    nack_requeue_false_single: "basic.nack(multiple=false, requeue=false) dead-letters only that delivery",
    nack_multiple_requeue_false: "basic.nack(multiple=true, requeue=false) over 3 unacked deliveries dead-letters all 3",
    nack_requeue_true_not_dead_lettered: "basic.nack(requeue=true) requeues (redelivered=true), nothing dead-lettered; a later reject does",
    basic_get_reject: "basic.get + reject(requeue=false); published via default exchange -> x-death exchange ''",
    auto_ack_consumer_never_dead_letters: "auto-ack consumer: nothing dead-lettered; rejecting the auto-acked tag -> 406 unknown delivery tag",
    no_dlx_reject_discards: "reject(requeue=false) on a queue without DLX simply discards the message",
    channel_close_requeues_unacked: "closing a channel with unacked deliveries requeues them (redelivered=true), no dead-lettering",
    connection_close_requeues_unacked: "closing the consumer's connection with unacked deliveries requeues them, no dead-lettering",
}

fn bodies(ds: &[Msg]) -> Value {
    ds.iter()
        .map(|d| json!(String::from_utf8_lossy(&d.data)))
        .collect()
}

async fn qos(ch: &Ch, prefetch: u16) -> Outcome {
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    Ok(())
}

async fn reject_requeue_false(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    let props = BasicProperties::default().with_headers(table(&[("app", ls("h1"))]));
    let p = t.publish_with(&ch, &s.x, "rk", b"m1", props).await;
    t.set("publish", p);
    let cch = t.plain_channel().await?;
    qos(&cch, 1).await?;
    let ds = t.consume(&cch, &s.src, 1, false).await?;
    let delivered = ds.iter().map(|d| t.msg(d)).collect::<Result<Vec<_>, _>>()?;
    t.set("delivered", delivered);
    for d in &ds {
        reject(&cch, d.delivery_tag).await?;
    }
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record("source_after", &ch, &s.src, 0).await?;
    Ok(())
}

async fn nack_requeue_false_single(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    let cch = t.plain_channel().await?;
    qos(&cch, 2).await?;
    let ds = t.consume(&cch, &s.src, 2, false).await?;
    t.set("delivered", bodies(&ds));
    let second = nth(&ds, 1, "deliveries")?.delivery_tag;
    cch.basic_nack(
        second,
        BasicNackOptions {
            multiple: false,
            requeue: false,
        },
    )
    .await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    let first = nth(&ds, 0, "deliveries")?.delivery_tag;
    cch.basic_ack(first, BasicAckOptions::default()).await?;
    t.record("source_after", &ch, &s.src, 0).await?;
    Ok(())
}

async fn nack_multiple_requeue_false(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2", "m3"]).await;
    let cch = t.plain_channel().await?;
    qos(&cch, 3).await?;
    let ds = t.consume(&cch, &s.src, 3, false).await?;
    let tags: Vec<u64> = ds.iter().map(|d| d.delivery_tag).collect();
    t.set("delivery_tags", tags);
    let last = nth(&ds, ds.len().wrapping_sub(1), "deliveries")?.delivery_tag;
    cch.basic_nack(
        last,
        BasicNackOptions {
            multiple: true,
            requeue: false,
        },
    )
    .await?;
    t.record("dead_lettered", &ch, &s.dlq, 3).await?;
    t.record("source_after", &ch, &s.src, 0).await?;
    Ok(())
}

async fn nack_requeue_true_not_dead_lettered(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    let cch = t.plain_channel().await?;
    qos(&cch, 1).await?;
    let ds = t.consume(&cch, &s.src, 1, false).await?;
    let redelivered: Vec<bool> = ds.iter().map(|d| d.redelivered).collect();
    t.set("first_delivery_redelivered", redelivered);
    let first = nth(&ds, 0, "deliveries")?.delivery_tag;
    cch.basic_nack(
        first,
        BasicNackOptions {
            multiple: false,
            requeue: true,
        },
    )
    .await?;
    t.record("dead_lettered_after_requeue", &ch, &s.dlq, 0)
        .await?;
    let g = t.get1(&cch, &s.src).await?;
    let v = t.msg_or_null(g.as_ref())?;
    t.set("redelivery", v);
    if let Some(d) = &g {
        reject(&cch, d.delivery_tag).await?;
    }
    t.record("dead_lettered_after_reject", &ch, &s.dlq, 1)
        .await?;
    Ok(())
}

async fn basic_get_reject(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let dlx = t.exchange(&ch, "dlx", lapin::ExchangeKind::Direct).await?;
    let dlq = t.queue(&ch, "dlq", none()).await?;
    let src = t
        .queue(&ch, "src", table(&[("x-dead-letter-exchange", ls(&dlx))]))
        .await?;
    t.bind(&ch, &dlq, &dlx, &src).await?;
    t.record_publish(&ch, "", &src, "m1").await;
    let g = t.get1(&ch, &src).await?;
    let v = t.msg_or_null(g.as_ref())?;
    t.set("got", v);
    if let Some(d) = &g {
        reject(&ch, d.delivery_tag).await?;
    }
    t.record("dead_lettered", &ch, &dlq, 1).await?;
    Ok(())
}

async fn auto_ack_consumer_never_dead_letters(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    let cch = t.plain_channel().await?;
    let ds = t.consume(&cch, &s.src, 1, true).await?;
    t.set("delivered", bodies(&ds));
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    t.record("source_after", &ch, &s.src, 0).await?;
    if let Some(d) = ds.first() {
        let tag = d.delivery_tag;
        let main = t.main_conn().await?;
        let mut events = Box::pin(t.connection(main).events_listener());
        let result = async {
            cch.basic_reject(tag, BasicRejectOptions { requeue: false })
                .await?;
            // A round trip, so that an asynchronous channel.close surfaces.
            cch.basic_qos(0, BasicQosOptions::default()).await
        }
        .await;
        let result = match result {
            Ok(()) => Ok(()),
            Err(e) => Err(crate::common::dl::broker_close(&mut events, e).await.into()),
        };
        let v = t.outcome(result);
        t.set("reject_auto_acked_tag", v);
    }
    t.record_quiet("dead_lettered_after_bad_reject", &ch, &s.dlq, 0, 0.2)
        .await?;
    Ok(())
}

async fn no_dlx_reject_discards(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let src = t.queue(&ch, "src", none()).await?;
    t.record_publish(&ch, "", &src, "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("source_after", &ch, &src, 0).await?;
    Ok(())
}

async fn channel_close_requeues_unacked(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    let cch = t.plain_channel().await?;
    qos(&cch, 2).await?;
    let (got, _consumer) = t.consume_open(&cch, &s.src, 2, false).await?;
    t.set("delivered", bodies(&got));
    cch.close(200, "done".into()).await?;
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    t.record("source_after", &ch, &s.src, 2).await?;
    Ok(())
}

async fn connection_close_requeues_unacked(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    let c2 = t.connect().await?;
    let cch = t.channel_on(c2, false).await?;
    let (got, _consumer) = t.consume_open(&cch, &s.src, 1, false).await?;
    t.set("delivered", bodies(&got));
    t.connection(c2).close(200, "done".into()).await?;
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}
