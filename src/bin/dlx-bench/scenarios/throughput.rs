//! `throughput`: producers publish to one queue while consumers ack; end-to-end msg/s,
//! publish-to-consume latency and a check that every message arrived exactly once.

use anyhow::Result;
use tokio::sync::watch;

use super::{Watch, describe, message_total, name, publish_all, rate, secs_between};
use crate::Common;
use crate::client::{self, Progress, QueueArgs};
use crate::report::Report;

pub async fn run(c: &Common) -> Result<Report> {
    let mut report = Report::new("throughput", &c.label);
    let confirms = c.confirms_on();
    describe(&mut report, c, confirms);
    let queue = name("tp");
    let setup = client::connect(&c.url, "setup").await?;
    client::fresh_queue(&setup, &queue, &QueueArgs::of_type(c.queue_type)).await?;

    let progress = Progress::new();
    let (stop, stop_rx) = watch::channel(false);
    let consumers = super::start_acking_consumers(c, &queue, &progress, &stop_rx).await?;

    let watch = Watch::start(c.pid);
    let published = publish_all(c, &queue, message_total(c, 200_000), confirms).await?;
    let expected = published.total();
    let all_arrived = progress.wait_for(expected, c.idle()).await;
    let last = progress
        .last_nanos
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut seen = client::stop_consumers(&stop, consumers).await?;
    watch.cpu_into(&mut report, expected);

    published.add_to(&mut report, confirms);
    let verdict = seen.ids.verdict(&published.per_producer());
    let secs = secs_between(published.started_nanos(), last);
    report.set("received", seen.ids.received);
    report.set("elapsed_secs", secs);
    report.set("rate_msg_s", rate(verdict.distinct, secs));
    let lat = seen.latencies.summary();
    report.set("latency_p50_us", lat.p50_us);
    report.set("latency_p99_us", lat.p99_us);
    report.set("latency_max_us", lat.max_us);
    super::verdict_into(&mut report, &verdict, "consumed");
    if !all_arrived {
        report.note(format!(
            "stopped waiting after {:.0}s without a delivery",
            c.idle_timeout
        ));
    }
    if seen.settle_errors > 0 {
        report.fail(format!("{} acks failed", seen.settle_errors));
    }
    client::delete_queue(&setup, &queue).await;
    client::close(&setup).await;
    Ok(report)
}
