//! `memory`: queue K messages (--messages, default 1,000,000; 100 bytes by default) in one
//! queue with no consumer and report the broker's RSS growth per queued message (needs --pid).
//! With `--persistent`, a durable queue of persistent messages (paged out past
//! `storage.paging_budget` in embedded mode); with `--keep`, the queue stays for a restart.

use std::time::Duration;

use anyhow::Result;

use super::{Watch, describe, message_total, name, publish_all};
use crate::Common;
use crate::client::{self, QueueArgs};
use crate::report::Report;

pub async fn run(c: &Common, settle_seconds: f64, keep: bool) -> Result<Report> {
    let mut report = Report::new("memory", &c.label);
    describe(&mut report, c, true);
    let settle = Duration::from_secs_f64(settle_seconds.max(0.0));
    let queue = name("mem");
    let setup = client::connect(&c.url, "setup").await?;
    let args = QueueArgs {
        durable: c.persistent,
        ..QueueArgs::default()
    };
    client::fresh_queue(&setup, &queue, &args).await?;
    let ch = setup.create_channel().await?;
    tokio::time::sleep(settle).await;
    let watch = Watch::start(c.pid);
    let before = watch.broker();
    let published = publish_all(c, &queue, message_total(c, 1_000_000), true).await?;
    published.add_to(&mut report, true);
    let total = published.total();
    tokio::time::sleep(settle).await;
    let depth = client::queue_depth(&ch, &queue).await?;
    report.set("queued", depth);
    if depth != total {
        report.fail(format!("{depth} messages queued, {total} published"));
    }
    let after = watch.broker();
    match (before, after) {
        (Some(b), Some(a)) => {
            report.set("rss_before_mib", b.rss_mib());
            report.set("rss_queued_mib", a.rss_mib());
            if depth > 0 {
                let per = (a.rss_kib as f64 - b.rss_kib as f64) * 1024.0 / depth as f64;
                report.set("rss_bytes_per_msg", per);
                report.set("overhead_bytes_per_msg", per - c.size as f64);
            }
        }
        _ => report.note("no --pid: broker memory not measured"),
    }
    if keep {
        report.note(format!("queue {queue} kept with its messages"));
    } else {
        client::delete_queue(&setup, &queue).await;
        tokio::time::sleep(settle).await;
        if let Some(s) = watch.broker() {
            report.set("rss_after_delete_mib", s.rss_mib());
        }
    }
    client::close(&setup).await;
    Ok(report)
}
