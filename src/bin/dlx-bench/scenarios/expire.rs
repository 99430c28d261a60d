//! `expire-bulk`: fill a queue that has a queue TTL (x-message-ttl) and no consumer with many
//! messages, then watch them expire (dropped, or dead-lettered into a DLQ with --into-dlq).
//! Reports how long the queue took to empty after its messages came due and the broker's RSS
//! before the fill, at the peak and after the drain.

use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::watch;

use super::{Watch, describe, message_total, name, publish_all, rate};
use crate::Common;
use crate::client::{self, ConsumeSpec, Progress, QueueArgs, Settle, now_nanos};
use crate::report::Report;

const POLL: Duration = Duration::from_millis(50);

pub async fn run(c: &Common, ttl_ms: u32, into_dlq: bool, drain_timeout: f64) -> Result<Report> {
    let scenario = if into_dlq {
        "expire-bulk-dlq"
    } else {
        "expire-bulk"
    };
    let mut report = Report::new(scenario, &c.label);
    // The fill always uses confirms: the queue must really hold the messages.
    describe(&mut report, c, true);
    report.set("ttl_ms", ttl_ms);
    let queue = name("exp");
    let dlx = name("dlx");
    let dlq = name("dlq");
    let setup = client::connect(&c.url, "setup").await?;
    let mut args = QueueArgs {
        message_ttl_ms: Some(ttl_ms),
        ..QueueArgs::default()
    };
    if into_dlq {
        client::fanout_with_queue(&setup, &dlx, &dlq).await?;
        args.dead_letter_exchange = Some(dlx.clone());
    }
    client::fresh_queue(&setup, &queue, &args).await?;
    let ch = setup.create_channel().await?;

    tokio::time::sleep(Duration::from_secs(1)).await;
    let watch = Watch::start(c.pid);
    if let Some(rss) = watch.rss_mib() {
        report.set("rss_before_mib", rss);
    }
    let published = publish_all(c, &queue, message_total(c, 1_000_000), true).await?;
    let total = published.total();
    let filled_at = Instant::now();
    let depth_after_fill = client::queue_depth(&ch, &queue).await?;
    report.set("published", total);
    report.set(
        "fill_secs",
        super::secs_between(published.started_nanos(), published.finished_nanos()),
    );
    report.set("depth_after_fill", depth_after_fill);
    if let Some(rss) = watch.rss_mib() {
        report.set("rss_peak_mib", rss);
    }
    if published.nacked() > 0 {
        report.fail(format!("{} publishes were nacked", published.nacked()));
    }

    // The first message comes due ttl after the fill started, the last ttl after it ended.
    let ttl = Duration::from_millis(u64::from(ttl_ms));
    let elapsed_since_start = Duration::from_nanos(now_nanos() - published.started_nanos());
    let first_due = filled_at + ttl.saturating_sub(elapsed_since_start);
    let last_due = filled_at + ttl.saturating_sub(filled_at.elapsed());
    let give_up = last_due + Duration::from_secs_f64(drain_timeout.max(1.0));
    let mut peak = depth_after_fill;
    let emptied_at = loop {
        let depth = client::queue_depth(&ch, &queue).await?;
        peak = peak.max(depth);
        if depth == 0 {
            break Some(Instant::now());
        }
        if Instant::now() >= give_up {
            report.fail(format!(
                "{depth} messages still queued {drain_timeout:.0}s after the last came due"
            ));
            break None;
        }
        tokio::time::sleep(POLL).await;
    };
    report.set("peak_depth", peak);
    if peak < total {
        report.note(format!(
            "messages began to expire before the fill ended (peak {peak} < {total}): raise --ttl-ms"
        ));
    }
    if let Some(emptied) = emptied_at {
        let lag = emptied.saturating_duration_since(last_due).as_secs_f64();
        let window = emptied.saturating_duration_since(first_due).as_secs_f64();
        report.set("empty_after_last_due_secs", lag);
        report.set("expiry_window_secs", window);
        report.set("expiry_rate_msg_s", rate(total, window));
    }
    watch.cpu_into(&mut report, total);
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(rss) = watch.rss_mib() {
        report.set("rss_after_mib", rss);
    }

    if into_dlq {
        // Every expired message must be in the DLQ, once.
        let progress = Progress::new();
        let (stop, stop_rx) = watch::channel(false);
        let spec = ConsumeSpec {
            url: c.url.clone(),
            name: "dlq consumer".into(),
            queue: dlq.clone(),
            prefetch: c.prefetch,
            settle: Settle::Ack,
            ack_every: c.ack_every.max(50),
            record: true,
            events: None,
        };
        let consumer = super::start_consumer(c, spec, progress.clone(), stop_rx).await?;
        progress.wait_for(total, c.idle()).await;
        let seen = client::stop_consumers(&stop, vec![consumer]).await?;
        let verdict = seen.ids.verdict(&published.per_producer());
        super::verdict_into(&mut report, &verdict, "dead-lettered");
    }
    client::delete_queue(&setup, &queue).await;
    if into_dlq {
        client::delete_queue(&setup, &dlq).await;
        client::delete_exchange(&setup, &dlx).await;
    }
    client::close(&setup).await;
    Ok(report)
}
