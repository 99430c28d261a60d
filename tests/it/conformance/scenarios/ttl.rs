//! Expiry: queue TTL, per-message TTL (the lower one wins), zero TTLs, and the expiration
//! property of a rejected message.

use lapin::BasicProperties;
use serde_json::Value;

use super::{Ch, Ctx, Outcome, int, none, reject, scenarios, standard, table};

scenarios! {
    queue_ttl_expiry: "x-message-ttl expiry dead-letters with reason 'expired', no original-expiration",
    per_message_ttl_expiry: "expiration property expiry: x-death original-expiration recorded, expiration removed",
    per_message_ttl_shorter_than_queue_ttl: "message expiration 100ms on a queue with x-message-ttl 10s: the minimum (100ms) wins",
    per_message_ttl_longer_than_queue_ttl: "queue TTL 100ms < message expiration 60s: queue TTL wins, original-expiration still recorded",
    expiration_zero_no_consumer: "expiration '0' with no consumer: dead-lettered immediately as 'expired', original-expiration '0'",
    queue_ttl_zero_no_consumer: "x-message-ttl=0 with no consumer: dead-lettered immediately as 'expired'",
    reject_with_expiration_property: "rejected message that carried an expiration: expiration removed, x-death original-expiration set",
}

/// Publishes m1 with an `expiration` of `ms` and records the outcome as `publish`.
async fn publish_expiring(t: &mut Ctx, ch: &Ch, x: &str, ms: &str) {
    let props = BasicProperties::default().with_expiration(ms.into());
    let p = t.publish_with(ch, x, "rk", b"m1", props).await;
    t.set("publish", p);
}

async fn queue_ttl_expiry(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-message-ttl", int(100))])).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record_quiet("source_after", &ch, &s.src, 0, 0.1).await?;
    Ok(())
}

async fn per_message_ttl_expiry(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    publish_expiring(t, &ch, &s.x, "100").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record_quiet("source_after", &ch, &s.src, 0, 0.1).await?;
    Ok(())
}

async fn per_message_ttl_shorter_than_queue_ttl(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-message-ttl", int(10000))])).await?;
    publish_expiring(t, &ch, &s.x, "100").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn per_message_ttl_longer_than_queue_ttl(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-message-ttl", int(100))])).await?;
    publish_expiring(t, &ch, &s.x, "60000").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn expiration_zero_no_consumer(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    publish_expiring(t, &ch, &s.x, "0").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record_quiet("source_after", &ch, &s.src, 0, 0.1).await?;
    Ok(())
}

async fn queue_ttl_zero_no_consumer(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-message-ttl", int(0))])).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn reject_with_expiration_property(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    publish_expiring(t, &ch, &s.x, "60000").await;
    let g = t.get1(&ch, &s.src).await?;
    let expiration = g
        .as_ref()
        .and_then(|d| d.properties.expiration().as_ref())
        .map(|e| Value::String(e.to_string()))
        .unwrap_or(Value::Null);
    t.set("got_expiration", expiration);
    if let Some(d) = &g {
        reject(&ch, d.delivery_tag).await?;
    }
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}
