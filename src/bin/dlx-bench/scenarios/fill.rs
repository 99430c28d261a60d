//! `fill` and `drain`: the two halves of a recovery measurement. `fill` publishes --messages
//! messages (with confirms) into a queue of --queue-type and leaves them there; the broker is
//! then restarted (scripts/bench-storage.sh times that); `drain` consumes the queue and checks
//! that every message `fill` published came back exactly once, then deletes the queue.

use anyhow::Result;
use tokio::sync::watch;

use super::{Watch, describe, message_total, publish_all, rate, secs_between};
use crate::Common;
use crate::client::{self, Progress, QueueArgs, now_nanos};
use crate::report::Report;

pub async fn fill(c: &Common, queue: &str) -> Result<Report> {
    let mut report = Report::new("fill", &c.label);
    describe(&mut report, c, true);
    let setup = client::connect(&c.url, "setup").await?;
    client::declare_queue(&setup, queue, &QueueArgs::of_type(c.queue_type)).await?;
    let ch = setup.create_channel().await?;
    let before = client::queue_depth(&ch, queue).await?;
    let watch = Watch::start(c.pid);
    let published = publish_all(c, queue, message_total(c, 1_000_000), true).await?;
    watch.cpu_into(&mut report, published.total());
    published.add_to(&mut report, true);
    let depth = client::queue_depth(&ch, queue).await?;
    report.set("queued", depth);
    if depth != before + published.total() {
        report.fail(format!(
            "{depth} messages queued, {before} before and {} published",
            published.total()
        ));
    }
    client::close(&setup).await;
    Ok(report)
}

pub async fn drain(c: &Common, queue: &str) -> Result<Report> {
    let mut report = Report::new("drain", &c.label);
    describe(&mut report, c, true);
    let started = now_nanos();
    let setup = client::connect(&c.url, "setup").await?;
    let ch = setup.create_channel().await?;
    let depth = client::queue_depth(&ch, queue).await?;
    report.set("queued", depth);
    let total = message_total(c, 1_000_000).unwrap_or(depth);
    let p = u64::from(c.producers);
    let per_producer: Vec<u64> = (0..p)
        .map(|i| total / p + u64::from(i < total % p))
        .collect();

    let progress = Progress::new();
    let (stop, stop_rx) = watch::channel(false);
    let consumers = super::start_acking_consumers(c, queue, &progress, &stop_rx).await?;
    let all_arrived = progress.wait_for(total, c.idle()).await;
    let last = progress
        .last_nanos
        .load(std::sync::atomic::Ordering::Relaxed);
    let seen = client::stop_consumers(&stop, consumers).await?;
    let verdict = seen.ids.verdict(&per_producer);
    let secs = secs_between(started, last);
    report.set("received", seen.ids.received);
    report.set("elapsed_secs", secs);
    report.set("rate_msg_s", rate(verdict.distinct, secs));
    super::verdict_into(&mut report, &verdict, "recovered");
    if !all_arrived {
        report.note(format!(
            "stopped waiting after {:.0}s without a delivery",
            c.idle_timeout
        ));
    }
    client::delete_queue(&setup, queue).await;
    client::close(&setup).await;
    Ok(report)
}
