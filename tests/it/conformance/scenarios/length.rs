//! Length limits: drop-head by count and by body bytes, max-length 0, reject-publish and
//! reject-publish-dlx.

use lapin::BasicProperties;

use super::{Ctx, Outcome, int, ls, scenarios, standard, table};

scenarios! {
    max_length_drop_head: "x-max-length=2 (drop-head): oldest message dead-lettered with reason 'maxlen'",
    max_length_bytes: "x-max-length-bytes=10 counts body bytes only; head dropped with reason 'maxlen'",
    max_length_zero: "x-max-length=0 (drop-head): every published message is dead-lettered as 'maxlen'",
    overflow_reject_publish: "x-overflow=reject-publish: publisher gets basic.nack, nothing dead-lettered",
    overflow_reject_publish_dlx: "x-overflow=reject-publish-dlx: publisher gets basic.nack AND message dead-lettered as 'maxlen'",
}

async fn max_length_drop_head(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length", int(2))])).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2", "m3"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record("source_after", &ch, &s.src, 2).await?;
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
    t.record_quiet("dead_lettered_at_10_bytes", &ch, &s.dlq, 0, 0.3)
        .await?;
    let p = t.publish(&ch, &s.x, "rk", "d").await;
    t.set("publish_over", p);
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record("source_after", &ch, &s.src, 3).await?;
    Ok(())
}

async fn max_length_zero(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length", int(0))])).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 2).await?;
    t.record_quiet("source_after", &ch, &s.src, 0, 0.1).await?;
    Ok(())
}

async fn overflow_reject_publish(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish")),
    ]);
    let s = standard(t, &ch, args).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}

async fn overflow_reject_publish_dlx(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-max-length", int(1)),
        ("x-overflow", ls("reject-publish-dlx")),
    ]);
    let s = standard(t, &ch, args).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}
