//! `idle-connections --count N`: open N connections with one channel each, hold them idle and
//! read the broker's RSS (needs --pid). With --count 0 it reports the idle broker's RSS.

use std::time::Duration;

use anyhow::Result;
use futures_util::StreamExt;
use futures_util::stream;

use super::Watch;
use crate::Common;
use crate::client;
use crate::report::Report;

/// Connections opened at once.
const OPEN_CONCURRENCY: usize = 16;
/// Time one connection (with its channel) may take to open.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

pub async fn run(c: &Common, count: u32, hold_seconds: f64, frame_max: u32) -> Result<Report> {
    let mut report = Report::new("idle-connections", &c.label);
    report.set("connections", count);
    let url = with_frame_max(&c.url, frame_max);
    report.set("client_url", url.as_str());
    let watch = Watch::start(c.pid);
    let before = watch.broker();
    if let Some(s) = before {
        report.set("rss_before_mib", s.rss_mib());
        report.set("threads_before", s.threads);
    } else {
        report.note("no --pid: broker memory not measured");
    }
    let started = std::time::Instant::now();
    let opened: Vec<_> = stream::iter(0..count)
        .map(|i| {
            let url = url.clone();
            async move {
                let name = format!("idle {i}");
                let open = client::open_channel(&url, &name);
                match tokio::time::timeout(OPEN_TIMEOUT, open).await {
                    Ok(r) => r,
                    Err(_) => Err(anyhow::anyhow!(
                        "no answer within {OPEN_TIMEOUT:?} (is the broker out of file descriptors?)"
                    )),
                }
            }
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    let mut held = Vec::new();
    let mut failed = 0u32;
    for r in opened {
        match r {
            Ok(pair) => held.push(pair),
            Err(e) => {
                if failed == 0 {
                    report.note(format!("first failure: {e:#}"));
                }
                failed += 1;
            }
        }
    }
    report.set("open_secs", started.elapsed().as_secs_f64());
    report.set("opened", held.len() as u64);
    if failed > 0 {
        report.fail(format!("{failed} of {count} connections failed to open"));
    }
    tokio::time::sleep(Duration::from_secs_f64(hold_seconds.max(0.0))).await;
    if let (Some(b), Some(s)) = (before, watch.broker()) {
        report.set("rss_with_connections_mib", s.rss_mib());
        report.set("threads_with_connections", s.threads);
        if count > 0 {
            let per = (s.rss_kib as f64 - b.rss_kib as f64) / f64::from(count);
            report.set("rss_per_connection_kib", per);
        }
    }
    let closed: Vec<bool> = stream::iter(held)
        .map(|(conn, _ch)| async move { client::close(&conn).await })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    let unclosed = closed.iter().filter(|ok| !**ok).count();
    if unclosed > 0 {
        report.note(format!(
            "{unclosed} connections did not close cleanly (client side)"
        ));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    if let Some(s) = watch.broker() {
        report.set("rss_after_close_mib", s.rss_mib());
    }
    Ok(report)
}

/// The URL with `frame_max` added to its query, unless it already sets one.
fn with_frame_max(url: &str, frame_max: u32) -> String {
    if url.contains("frame_max=") {
        url.to_string()
    } else if url.contains('?') {
        format!("{url}&frame_max={frame_max}")
    } else {
        format!("{url}?frame_max={frame_max}")
    }
}

#[cfg(test)]
mod tests {
    use super::with_frame_max;

    #[test]
    fn frame_max_is_added_once() {
        assert_eq!(
            with_frame_max("amqp://h:1/%2f", 8192),
            "amqp://h:1/%2f?frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h:1/%2f?heartbeat=5", 8192),
            "amqp://h:1/%2f?heartbeat=5&frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h:1/%2f?frame_max=4096", 8192),
            "amqp://h:1/%2f?frame_max=4096"
        );
    }
}
