//! The redrive jobs of one instance, pure (the caller passes `now`): what a job was asked
//! ([`RedriveRequest`], the admin API's JSON body and the CLI's flags), what it has done
//! ([`JobStatus`]), and the table of jobs ([`JobTable`]).
//!
//! One job at a time per (vhost, dead-letter queue): starting another while one runs is a
//! conflict naming the running job. The table is bounded: at most [`MAX_JOBS`] jobs, finished
//! ones kept [`KEEP_FINISHED`] for their status and dropped oldest first to make room; a table
//! full of running jobs refuses a new one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::plan::{Plan, parse_filter};

/// Jobs kept at most (running and finished).
pub const MAX_JOBS: usize = 64;
/// How long a finished job's status stays readable.
pub const KEEP_FINISHED: Duration = Duration::from_secs(3600);
/// The highest rate limit accepted, messages per second.
pub const MAX_RATE: f64 = 1_000_000.0;
/// The lowest rate limit accepted, messages per second (one message every 1000 s): a job's
/// wait for its next token stays a time a timer can take.
pub const MIN_RATE: f64 = 0.001;

/// Whether `rate` (messages per second) is a rate limit a job can keep.
pub fn rate_in_range(rate: f64) -> bool {
    (MIN_RATE..=MAX_RATE).contains(&rate)
}

/// `POST /api/redrive`'s body and the CLI's flags.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// The dead-letter queue.
    pub from: String,
    /// The queue every message goes to; none: each to its newest x-death queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Messages moved per second at most; none: as fast as it goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Messages moved at most in this job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
    /// `reason=A|B` filters ([`parse_filter`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filter: Vec<String>,
    /// Count what would move, move nothing.
    #[serde(default)]
    pub dry_run: bool,
}

fn default_vhost() -> String {
    "/".to_string()
}

impl RedriveRequest {
    /// The plan of the request, or what is wrong with it.
    pub fn plan(&self) -> Result<Plan, String> {
        if self.from.is_empty() {
            return Err("from: the dead-letter queue to redrive is required".into());
        }
        if self.to.as_deref() == Some("") {
            return Err("to: an empty queue name".into());
        }
        if let Some(rate) = self.rate
            && !rate_in_range(rate)
        {
            return Err(format!(
                "rate: {rate} is not in [{MIN_RATE}, {MAX_RATE}] messages per second"
            ));
        }
        if self.max == Some(0) {
            return Err("max: must be at least 1".into());
        }
        Ok(Plan {
            to: self.to.clone(),
            reasons: parse_filter(&self.filter)?,
        })
    }
}

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Running,
    Done,
    Cancelled,
    Failed,
}

/// What a job has done so far (`GET /api/redrive/{id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub id: u64,
    pub request: RedriveRequest,
    pub state: JobState,
    /// Messages in the dead-letter queue when the job started (the progress bar's length).
    pub total: u64,
    pub examined: u64,
    /// Messages moved (dry-run: that would move).
    pub moved: u64,
    /// Left out by the filter.
    pub skipped: u64,
    /// Could not be moved (they stay in the dead-letter queue).
    pub failed: u64,
    /// Moved per target queue.
    pub by_target: BTreeMap<String, u64>,
    /// Failed per cause (`no_queue`, `target_full`, `no_source`, `same_queue`,
    /// `undecodable`; proxy mode also `timed_out`, `publish_failed`).
    pub failed_by_cause: BTreeMap<String, u64>,
    /// Messages moved per second since the start (to the end, once finished).
    pub rate: f64,
    pub elapsed_secs: f64,
    /// Why the job failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The job this one resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumes: Option<u64>,
}

impl JobStatus {
    fn new(id: u64, request: RedriveRequest, total: u64) -> JobStatus {
        JobStatus {
            id,
            request,
            state: JobState::Running,
            total,
            examined: 0,
            moved: 0,
            skipped: 0,
            failed: 0,
            by_target: BTreeMap::new(),
            failed_by_cause: BTreeMap::new(),
            rate: 0.0,
            elapsed_secs: 0.0,
            error: None,
            resumes: None,
        }
    }

    /// Adds a batch's counts.
    pub fn add(&mut self, examined: u64, moved: &[String], skipped: u64, failed: &[&str]) {
        self.examined += examined;
        self.moved += moved.len() as u64;
        self.skipped += skipped;
        self.failed += failed.len() as u64;
        for target in moved {
            *self.by_target.entry(target.clone()).or_default() += 1;
        }
        for cause in failed {
            *self.failed_by_cause.entry(cause.to_string()).or_default() += 1;
        }
    }
}

/// Why a job could not start.
#[derive(Debug, PartialEq, Eq)]
pub enum StartRefusal {
    /// A job runs on this queue (its id).
    Busy(u64),
    /// [`MAX_JOBS`] jobs are running.
    Full,
}

struct Entry {
    status: JobStatus,
    started: Instant,
    finished: Option<Instant>,
    cancel: CancellationToken,
}

/// Every job of the instance, by id.
#[derive(Default)]
pub struct JobTable {
    jobs: BTreeMap<u64, Entry>,
    next_id: u64,
}

impl JobTable {
    /// Registers a running job; its cancel token is the job's.
    pub fn start(
        &mut self,
        request: RedriveRequest,
        total: u64,
        now: Instant,
    ) -> Result<(u64, CancellationToken), StartRefusal> {
        self.jobs.retain(|_, e| {
            e.finished
                .is_none_or(|at| now.saturating_duration_since(at) < KEEP_FINISHED)
        });
        if let Some(id) = self.running_on(&request.vhost, &request.from) {
            return Err(StartRefusal::Busy(id));
        }
        while self.jobs.len() >= MAX_JOBS {
            let oldest = self
                .jobs
                .iter()
                .filter_map(|(id, e)| e.finished.map(|at| (at, *id)))
                .min();
            match oldest {
                Some((_, id)) => self.jobs.remove(&id),
                None => return Err(StartRefusal::Full),
            };
        }
        self.next_id += 1;
        let id = self.next_id;
        let cancel = CancellationToken::new();
        self.jobs.insert(
            id,
            Entry {
                status: JobStatus::new(id, request, total),
                started: now,
                finished: None,
                cancel: cancel.clone(),
            },
        );
        Ok((id, cancel))
    }

    /// Changes a job's status (its counts).
    pub fn update(&mut self, id: u64, change: impl FnOnce(&mut JobStatus)) {
        if let Some(e) = self.jobs.get_mut(&id) {
            change(&mut e.status);
        }
    }

    /// Marks a running job finished in `state`.
    pub fn finish(&mut self, id: u64, state: JobState, error: Option<String>, now: Instant) {
        if let Some(e) = self.jobs.get_mut(&id)
            && e.status.state == JobState::Running
        {
            e.status.state = state;
            e.status.error = error;
            e.finished = Some(now);
        }
    }

    /// A job's status as of `now`.
    pub fn status(&self, id: u64, now: Instant) -> Option<JobStatus> {
        self.jobs.get(&id).map(|e| snapshot(e, now))
    }

    /// Every job's status, oldest first.
    pub fn list(&self, now: Instant) -> Vec<JobStatus> {
        self.jobs.values().map(|e| snapshot(e, now)).collect()
    }

    /// Asks a running job to stop (it finishes as cancelled after its current batch); the
    /// status, or none for an unknown id.
    pub fn cancel(&mut self, id: u64, now: Instant) -> Option<JobStatus> {
        let e = self.jobs.get(&id)?;
        e.cancel.cancel();
        Some(snapshot(e, now))
    }

    /// The job running on `queue` of `vhost`, if one is.
    pub fn running_on(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.jobs
            .iter()
            .find(|(_, e)| {
                e.status.state == JobState::Running
                    && e.status.request.vhost == vhost
                    && e.status.request.from == queue
            })
            .map(|(id, _)| *id)
    }

    /// Running jobs.
    pub fn running(&self) -> usize {
        self.jobs
            .values()
            .filter(|e| e.status.state == JobState::Running)
            .count()
    }
}

fn snapshot(e: &Entry, now: Instant) -> JobStatus {
    let mut status = e.status.clone();
    let elapsed = e
        .finished
        .unwrap_or(now)
        .saturating_duration_since(e.started);
    status.elapsed_secs = elapsed.as_secs_f64();
    status.rate = if elapsed.is_zero() {
        0.0
    } else {
        status.moved as f64 / elapsed.as_secs_f64()
    };
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(from: &str) -> RedriveRequest {
        RedriveRequest {
            vhost: "/".into(),
            from: from.into(),
            ..RedriveRequest::default()
        }
    }

    #[test]
    fn one_job_per_queue_and_a_bounded_table() {
        let now = Instant::now();
        let mut table = JobTable::default();
        let (first, _) = table.start(request("dlq"), 5, now).unwrap();
        assert_eq!(
            table.start(request("dlq"), 5, now).unwrap_err(),
            StartRefusal::Busy(first)
        );
        table.finish(first, JobState::Done, None, now);
        let (second, _) = table.start(request("dlq"), 5, now).unwrap();
        assert_ne!(first, second);
        for n in 2..MAX_JOBS {
            table.start(request(&format!("q{n}")), 0, now).unwrap();
        }
        // Full: the finished job makes room; then only running jobs are left.
        table.start(request("more"), 0, now).unwrap();
        assert!(table.status(first, now).is_none());
        assert_eq!(table.running(), MAX_JOBS);
        assert_eq!(
            table.start(request("again"), 0, now).unwrap_err(),
            StartRefusal::Full
        );
    }

    #[test]
    fn finished_jobs_are_kept_for_a_while() {
        let now = Instant::now();
        let mut table = JobTable::default();
        let (id, cancel) = table.start(request("dlq"), 10, now).unwrap();
        table.update(id, |s| {
            s.add(4, &["a".into(), "a".into(), "b".into()], 1, &["no_queue"])
        });
        let later = now + Duration::from_secs(2);
        assert!(table.cancel(id, later).is_some());
        assert!(cancel.is_cancelled());
        table.finish(id, JobState::Cancelled, None, later);
        let status = table.status(id, later + Duration::from_secs(10)).unwrap();
        assert_eq!(status.state, JobState::Cancelled);
        assert_eq!(
            (status.moved, status.skipped, status.failed, status.examined),
            (3, 1, 1, 4)
        );
        assert_eq!(status.by_target["a"], 2);
        assert_eq!(status.failed_by_cause["no_queue"], 1);
        assert_eq!(status.elapsed_secs, 2.0, "counted to the end");
        assert_eq!(status.rate, 1.5);
        // A finish after the first does not change it.
        table.finish(id, JobState::Done, None, later);
        assert_eq!(table.status(id, later).unwrap().state, JobState::Cancelled);
        table
            .start(request("other"), 0, later + KEEP_FINISHED)
            .unwrap();
        assert!(table.status(id, later + KEEP_FINISHED).is_none());
        assert!(table.cancel(id, later).is_none());
    }

    #[test]
    fn requests_are_checked() {
        let ok = RedriveRequest {
            rate: Some(10.0),
            filter: vec!["reason=expired".into()],
            ..request("dlq")
        };
        assert!(ok.plan().is_ok());
        for (bad, says) in [
            (request(""), "from:"),
            (
                RedriveRequest {
                    rate: Some(0.0),
                    ..request("d")
                },
                "rate: 0",
            ),
            (
                RedriveRequest {
                    rate: Some(1e-20),
                    ..request("d")
                },
                "rate: 0.00000000000000000001 is not in [0.001, 1000000]",
            ),
            (
                RedriveRequest {
                    rate: Some(f64::NAN),
                    ..request("d")
                },
                "rate: NaN",
            ),
            (
                RedriveRequest {
                    max: Some(0),
                    ..request("d")
                },
                "max:",
            ),
            (
                RedriveRequest {
                    to: Some(String::new()),
                    ..request("d")
                },
                "to:",
            ),
            (
                RedriveRequest {
                    filter: vec!["x".into()],
                    ..request("d")
                },
                "filter",
            ),
        ] {
            let error = bad.plan().unwrap_err();
            assert!(error.starts_with(says), "{error}");
        }
        let parsed: RedriveRequest = serde_json::from_str(r#"{"from": "dlq"}"#).unwrap();
        assert_eq!(parsed, request("dlq"));
        assert!(serde_json::from_str::<RedriveRequest>(r#"{"from": "d", "bogus": 1}"#).is_err());
    }
}
