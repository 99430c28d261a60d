//! Quorum queues: delivery limit, reject, TTLs, max-length, reject-publish-dlx, declare
//! arguments and the at-least-once strategy.

use lapin::BasicProperties;
use lapin::options::BasicNackOptions;
use serde_json::{Value, json};
use tokio::time::{Duration, Instant};

use super::declare::declare_cases;
use super::{Ch, Ctx, Outcome, get_and_reject, int, ls, none, scenarios, standard_with, table};

scenarios! {
    quorum_delivery_limit: "quorum queue x-delivery-limit=2 with repeated nack(requeue=true): dead-lettered with reason delivery_limit",
    quorum_reject: "quorum queue reject(requeue=false) dead-letters with reason 'rejected' (same x-death shape)",
    quorum_message_ttl: "quorum queue x-message-ttl and per-message expiration dead-letter with reason 'expired'",
    quorum_max_length: "quorum queue x-max-length=1 (drop-head) dead-letters the head with reason 'maxlen'",
    quorum_overflow_reject_publish_dlx: "quorum queue declared with x-overflow=reject-publish-dlx (accepted by 3.10): observe nack/dead-lettering",
    quorum_declare_arguments: "quorum queue DLX-related argument validation (reject-publish-dlx, at-least-once, bad delivery-limit)",
    quorum_at_least_once: "quorum queue x-dead-letter-strategy=at-least-once (+reject-publish): rejected message still dead-lettered",
}

/// The standard topology with a quorum source queue.
async fn quorum_std(
    t: &mut Ctx,
    ch: &Ch,
    args: amq_protocol::types::FieldTable,
) -> Result<super::Std, super::Failure> {
    standard_with(t, ch, args, &["rk"], "rk", true).await
}

async fn quorum_delivery_limit(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = quorum_std(t, &ch, table(&[("x-delivery-limit", int(2))])).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    let mut deliveries = Vec::new();
    let mut dead = Vec::new();
    let end = Instant::now() + Duration::from_secs(6);
    while Instant::now() < end && deliveries.len() < 8 {
        if let Some(m) = t.get(&ch, &s.src, false).await? {
            let d = t.msg(&m)?;
            deliveries.push(json!({
                "redelivered": d["redelivered"],
                "headers": d["headers"],
                "header_types": d["header_types"],
            }));
            ch.basic_nack(
                m.delivery_tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )
            .await?;
            continue;
        }
        if let Value::Array(found) = t.collect_quiet(&ch, &s.dlq, 0, 0.0).await? {
            dead = found;
        }
        if !dead.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    t.set("deliveries", deliveries);
    let expect = usize::from(dead.is_empty());
    if let Value::Array(more) = t.collect_quiet(&ch, &s.dlq, expect, 0.2).await? {
        dead.extend(more);
    }
    t.set("dead_lettered", dead);
    t.record_quiet("source_after", &ch, &s.src, 0, 0.1).await?;
    Ok(())
}

async fn quorum_reject(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = quorum_std(t, &ch, none()).await?;
    let props = BasicProperties::default().with_headers(table(&[("h", ls("v"))]));
    let p = t.publish_with(&ch, &s.x, "rk", b"m1", props).await;
    t.set("publish", p);
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn quorum_message_ttl(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = quorum_std(t, &ch, table(&[("x-message-ttl", int(100))])).await?;
    let expiring = BasicProperties::default().with_expiration("50".into());
    let p = vec![
        t.publish(&ch, &s.x, "rk", "q-ttl").await,
        t.publish_with(&ch, &s.x, "rk", b"m-ttl", expiring).await,
    ];
    t.set("publish", p);
    t.record("dead_lettered", &ch, &s.dlq, 2).await?;
    Ok(())
}

async fn quorum_max_length(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = quorum_std(t, &ch, table(&[("x-max-length", int(1))])).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}

async fn quorum_overflow_reject_publish_dlx(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish-dlx")),
    ]);
    let s = quorum_std(t, &ch, args).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2", "m3"]).await;
    t.record_quiet("dead_lettered", &ch, &s.dlq, 0, 0.4).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}

async fn quorum_declare_arguments(t: &mut Ctx) -> Outcome {
    let dlx = t.n("dlx");
    let dlx = || ("x-dead-letter-exchange", ls(&dlx));
    let cases = vec![
        (
            "x-overflow=reject-publish-dlx",
            table(&[("x-overflow", ls("reject-publish-dlx")), dlx()]),
        ),
        (
            "at-least-once + reject-publish",
            table(&[
                ("x-dead-letter-strategy", ls("at-least-once")),
                ("x-overflow", ls("reject-publish")),
                dlx(),
            ]),
        ),
        (
            "at-least-once + drop-head",
            table(&[("x-dead-letter-strategy", ls("at-least-once")), dlx()]),
        ),
        (
            "x-dead-letter-strategy='bogus'",
            table(&[("x-dead-letter-strategy", ls("bogus")), dlx()]),
        ),
        (
            "x-delivery-limit='2' (string)",
            table(&[("x-delivery-limit", ls("2"))]),
        ),
        (
            "x-delivery-limit=-1",
            table(&[("x-delivery-limit", int(-1))]),
        ),
    ];
    let v = declare_cases(t, cases, true).await;
    t.set("results", v);
    Ok(())
}

async fn quorum_at_least_once(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-dead-letter-strategy", ls("at-least-once")),
        ("x-overflow", ls("reject-publish")),
    ]);
    let s = quorum_std(t, &ch, args).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}
