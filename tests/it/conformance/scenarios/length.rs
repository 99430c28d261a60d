//! Length limits: drop-head by count and by body bytes, max-length 0, reject-publish and
//! reject-publish-dlx.

use lapin::BasicProperties;
use serde_json::Value;

use super::{Ch, Ctx, Outcome, int, ls, scenarios, standard, table};

scenarios! {
    max_length_drop_head: "x-max-length=2 (drop-head): oldest message dead-lettered with reason 'maxlen'",
    max_length_bytes: "x-max-length-bytes=10 counts body bytes only; head dropped with reason 'maxlen'",
    max_length_zero: "x-max-length=0 (drop-head): every published message is dead-lettered as 'maxlen'",
    overflow_reject_publish: "x-overflow=reject-publish: publisher gets basic.nack, nothing dead-lettered",
    overflow_reject_publish_dlx: "x-overflow=reject-publish-dlx: publisher gets basic.nack AND message dead-lettered as 'maxlen'",
}

/// Publishes each body to exchange `x` with key `rk`; the list of confirms.
pub async fn publish_all(t: &mut Ctx, ch: &Ch, x: &str, bodies: &[&str]) -> Value {
    let mut out = Vec::new();
    for b in bodies {
        out.push(t.publish(ch, x, "rk", b).await);
    }
    Value::Array(out)
}

async fn max_length_drop_head(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length", int(2))])).await?;
    let p = publish_all(t, &ch, &s.x, &["m1", "m2", "m3"]).await;
    t.set("publish", p);
    let v = t.collect(&ch, &s.dlq, 1).await?;
    t.set("dead_lettered", v);
    let v = t.collect(&ch, &s.src, 2).await?;
    t.set("source_after", v);
    Ok(())
}

async fn max_length_bytes(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length-bytes", int(10))])).await?;
    let padded = BasicProperties::default().with_headers(table(&[("pad", ls(&"p".repeat(1000)))]));
    let p = vec![
        t.publish_with(&ch, &s.x, "rk", b"aaaa", padded).await,
        t.publish(&ch, &s.x, "rk", "bbbb").await,
        t.publish(&ch, &s.x, "rk", "cc").await,
    ];
    t.set("publish", p);
    let v = t.collect_quiet(&ch, &s.dlq, 0, 0.3).await?;
    t.set("dead_lettered_at_10_bytes", v);
    let p = t.publish(&ch, &s.x, "rk", "d").await;
    t.set("publish_over", p);
    let v = t.collect(&ch, &s.dlq, 1).await?;
    t.set("dead_lettered", v);
    let v = t.collect(&ch, &s.src, 3).await?;
    t.set("source_after", v);
    Ok(())
}

async fn max_length_zero(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length", int(0))])).await?;
    let p = publish_all(t, &ch, &s.x, &["m1", "m2"]).await;
    t.set("publish", p);
    let v = t.collect(&ch, &s.dlq, 2).await?;
    t.set("dead_lettered", v);
    let v = t.collect_quiet(&ch, &s.src, 0, 0.1).await?;
    t.set("source_after", v);
    Ok(())
}

async fn overflow_reject_publish(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish")),
    ]);
    let s = standard(t, &ch, args).await?;
    let p = publish_all(t, &ch, &s.x, &["m1", "m2"]).await;
    t.set("publish", p);
    let v = t.collect(&ch, &s.dlq, 0).await?;
    t.set("dead_lettered", v);
    let v = t.collect(&ch, &s.src, 1).await?;
    t.set("source_after", v);
    Ok(())
}

async fn overflow_reject_publish_dlx(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish-dlx")),
    ]);
    let s = standard(t, &ch, args).await?;
    let p = publish_all(t, &ch, &s.x, &["m1", "m2"]).await;
    t.set("publish", p);
    let v = t.collect(&ch, &s.dlq, 1).await?;
    t.set("dead_lettered", v);
    let v = t.collect(&ch, &s.src, 1).await?;
    t.set("source_after", v);
    Ok(())
}
