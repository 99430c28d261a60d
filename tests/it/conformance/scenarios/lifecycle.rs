//! Queue lifecycle: queue.delete and queue.purge never dead-letter.

use lapin::options::{QueueDeleteOptions, QueuePurgeOptions};

use super::{Ctx, Outcome, none, scenarios, standard};

scenarios! {
    queue_delete_no_dead_letter: "queue.delete with ready messages does NOT dead-letter them",
    queue_purge_no_dead_letter: "queue.purge does NOT dead-letter",
}

async fn queue_delete_no_dead_letter(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    let n = ch
        .queue_delete(s.src.as_str().into(), QueueDeleteOptions::default())
        .await?;
    t.set("delete_message_count", n);
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    Ok(())
}

async fn queue_purge_no_dead_letter(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2"]).await;
    let n = ch
        .queue_purge(s.src.as_str().into(), QueuePurgeOptions::default())
        .await?;
    t.set("purge_message_count", n);
    t.record("dead_lettered", &ch, &s.dlq, 0).await?;
    Ok(())
}
