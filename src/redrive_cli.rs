//! The client side of `dlx-proxy redrive`: starts a redrive job through the admin API
//! (`POST /api/redrive`, or `POST /api/redrive/{id}/resume`), follows its status
//! (`GET /api/redrive/{id}`) until it ends, and prints the summary; Ctrl-C cancels the job
//! (`DELETE /api/redrive/{id}`) and waits for it to stop. On a terminal the progress is an
//! indicatif bar; otherwise one plain line per second ([`progress_line`]).
//!
//! The address and token come from [`crate::policy_cli::AdminClient`]. The pure pieces,
//! [`parse_rate`], [`progress_line`] and [`summary_text`], are tested directly.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::policy_cli::AdminClient;
use crate::redrive::jobs::{JobState, JobStatus, RedriveRequest};

/// How often the status is read.
const POLL: Duration = Duration::from_millis(200);
/// How often a plain progress line is printed (not on a terminal).
const LINE_EVERY: Duration = Duration::from_secs(1);

/// `--rate`: `N` or `N/s` messages per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let number = text.trim().strip_suffix("/s").unwrap_or(text.trim());
    match number.parse::<f64>() {
        Ok(rate) if crate::redrive::jobs::rate_in_range(rate) => Ok(rate),
        _ => Err(format!(
            "rate {text:?}: expected messages per second from {} to {}, e.g. 100 or 100/s",
            crate::redrive::jobs::MIN_RATE,
            crate::redrive::jobs::MAX_RATE
        )),
    }
}

/// How a job is followed.
pub struct Follow {
    /// Show the indicatif bar (stderr is a terminal).
    pub bar: bool,
    /// Print nothing while it runs (`--format json`).
    pub quiet: bool,
}

impl Follow {
    /// A bar when stderr is a terminal, else lines; nothing when `quiet`.
    pub fn detect(quiet: bool) -> Follow {
        Follow {
            bar: !quiet && std::io::stderr().is_terminal(),
            quiet,
        }
    }
}

fn parse_status(path: &str, text: &str) -> Result<JobStatus, String> {
    serde_json::from_str(text).map_err(|e| format!("{path}: unexpected answer: {e}"))
}

/// `POST /api/redrive`.
pub fn start(client: &AdminClient, request: &RedriveRequest) -> Result<JobStatus, String> {
    let body = serde_json::to_string(request).map_err(|e| e.to_string())?;
    let text = client.call("POST", "/api/redrive", Some(&body))?;
    parse_status("POST /api/redrive", &text)
}

/// `POST /api/redrive/{id}/resume`.
pub fn resume(client: &AdminClient, id: u64) -> Result<JobStatus, String> {
    let path = format!("/api/redrive/{id}/resume");
    let text = client.call("POST", &path, None)?;
    parse_status(&path, &text)
}

/// `GET /api/redrive/{id}`.
pub fn status(client: &AdminClient, id: u64) -> Result<JobStatus, String> {
    let path = format!("/api/redrive/{id}");
    let text = client.call("GET", &path, None)?;
    parse_status(&path, &text)
}

/// `DELETE /api/redrive/{id}`.
pub fn cancel(client: &AdminClient, id: u64) -> Result<JobStatus, String> {
    let path = format!("/api/redrive/{id}");
    let text = client.call("DELETE", &path, None)?;
    parse_status(&path, &text)
}

/// Follows job `status.id` until it is no longer running (cancelling it on Ctrl-C); its
/// final status.
pub fn follow(client: AdminClient, first: JobStatus, how: Follow) -> Result<JobStatus, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(follow_async(Arc::new(client), first, how))
}

async fn follow_async(
    client: Arc<AdminClient>,
    first: JobStatus,
    how: Follow,
) -> Result<JobStatus, String> {
    let id = first.id;
    let bar = how.bar.then(|| {
        let bar = ProgressBar::new(bar_length(&first));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} examined  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let mut last_line = Instant::now();
    let mut current = first;
    let mut cancelling = false;
    let mut interrupt = std::pin::pin!(tokio::signal::ctrl_c());
    while current.state == JobState::Running {
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            _ = &mut interrupt, if !cancelling => {
                cancelling = true;
                if !how.quiet {
                    eprintln!("cancelling redrive job {id} (it stops after its current batch)");
                }
                let c = client.clone();
                blocking(move || cancel(&c, id)).await?;
            }
        }
        let c = client.clone();
        current = blocking(move || status(&c, id)).await?;
        if let Some(bar) = &bar {
            bar.set_length(bar_length(&current));
            bar.set_position(current.examined);
            bar.set_message(format!(
                "moved {} skipped {} failed {} ({:.0} msg/s)",
                current.moved, current.skipped, current.failed, current.rate
            ));
        } else if !how.quiet && last_line.elapsed() >= LINE_EVERY {
            last_line = Instant::now();
            eprintln!("{}", progress_line(&current));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(current)
}

async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|e| format!("admin API call failed: {e}"))?
}

/// What the bar counts to: the queue's length at the start.
fn bar_length(status: &JobStatus) -> u64 {
    status.total.max(status.examined)
}

/// The plain progress line (not on a terminal).
pub fn progress_line(s: &JobStatus) -> String {
    format!(
        "redrive job {}: examined {}/{}, moved {}, skipped {}, failed {}, {:.1} msg/s",
        s.id, s.examined, s.total, s.moved, s.skipped, s.failed, s.rate
    )
}

/// The summary printed at the end.
pub fn summary_text(s: &JobStatus) -> String {
    let state = match s.state {
        JobState::Running => "running",
        JobState::Done => "done",
        JobState::Cancelled => "cancelled",
        JobState::Failed => "failed",
    };
    let dry = if s.request.dry_run {
        " (dry run: nothing moved)"
    } else {
        ""
    };
    let mut out = format!(
        "redrive job {} from {:?} in vhost {:?}: {state} in {:.1}s{dry}\n",
        s.id, s.request.from, s.request.vhost, s.elapsed_secs
    );
    if let Some(error) = &s.error {
        out.push_str(&format!("error: {error}\n"));
    }
    let verb = if s.request.dry_run {
        "would move"
    } else {
        "moved"
    };
    out.push_str(&format!(
        "{verb} {}, skipped by filter {}, failed {}, examined {} ({:.1} msg/s)\n",
        s.moved, s.skipped, s.failed, s.examined, s.rate
    ));
    for (title, counts) in [
        ("by target queue", &s.by_target),
        ("failed by cause", &s.failed_by_cause),
    ] {
        if counts.is_empty() {
            continue;
        }
        out.push_str(title);
        out.push_str(":\n");
        for (key, n) in counts {
            out.push_str(&format!("  {key}\t{n}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_with_or_without_per_second() {
        assert_eq!(parse_rate("100"), Ok(100.0));
        assert_eq!(parse_rate("2.5/s"), Ok(2.5));
        assert_eq!(parse_rate("0.001/s"), Ok(0.001));
        for bad in [
            "0", "-1", "fast", "10/m", "inf", "1e-20", "0.0009", "2000000",
        ] {
            assert!(
                parse_rate(bad).unwrap_err().contains("messages per second"),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_summary_names_every_count() {
        let status: JobStatus = serde_json::from_value(serde_json::json!({
            "id": 7,
            "request": {"vhost": "/", "from": "dlq", "dry_run": false},
            "state": "done",
            "total": 10, "examined": 10, "moved": 6, "skipped": 3, "failed": 1,
            "by_target": {"work": 4, "other": 2},
            "failed_by_cause": {"no_queue": 1},
            "rate": 12.0, "elapsed_secs": 0.5
        }))
        .unwrap();
        assert_eq!(
            summary_text(&status),
            "redrive job 7 from \"dlq\" in vhost \"/\": done in 0.5s\n\
             moved 6, skipped by filter 3, failed 1, examined 10 (12.0 msg/s)\n\
             by target queue:\n  other\t2\n  work\t4\n\
             failed by cause:\n  no_queue\t1\n"
        );
        assert_eq!(
            progress_line(&status),
            "redrive job 7: examined 10/10, moved 6, skipped 3, failed 1, 12.0 msg/s"
        );
        let mut dry = status;
        dry.request.dry_run = true;
        assert!(summary_text(&dry).contains("(dry run: nothing moved)\nwould move 6,"));
    }
}
