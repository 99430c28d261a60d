//! Dead-letter queue redrive: moving the messages of a dead-letter queue back to the queues
//! they died in (or to one named queue), as a job the admin API starts, reports on and cancels
//! (`POST /api/redrive`, `GET`/`DELETE /api/redrive/{id}`, `POST /api/redrive/{id}/resume`;
//! [`crate::admin`]) and `dlx-proxy redrive` drives ([`crate::redrive_cli`]). docs/redrive.md
//! has the semantics.
//!
//! - [`plan`] (pure): the filter, the target of each message, the `x-redriven-count` stamp;
//! - [`bucket`] (pure): the rate limit;
//! - [`jobs`] (pure): the request, the job status, the bounded job table;
//! - this file: [`Redriver`], which checks a request, registers the job and runs it: in
//!   embedded mode batches of [`crate::broker::Broker::redrive_batch`] (each one move under the
//!   broker lock, crash-atomic with storage) paced by the bucket, until the pass is over, the
//!   `max` is reached, or the job is cancelled. Proxy mode has no redrive yet (501).

pub mod bucket;
pub mod jobs;
pub mod plan;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::broker::methods::{BatchLimits, RedriveCursor};
use crate::metrics::Metrics;
use bucket::TokenBucket;
use jobs::{JobState, JobStatus, JobTable, RedriveRequest, StartRefusal};
use plan::Plan;

/// Messages a batch moves at most (one broker lock hold).
pub const BATCH_MOVES: u64 = 256;
/// Messages a batch looks at most (skipped ones included).
pub const BATCH_EXAMINE: usize = 1024;

/// Why a request was refused, with the admin API's status.
#[derive(Debug, PartialEq, Eq)]
pub enum RedriveError {
    /// 400: the request is wrong (the message says which field).
    BadRequest(String),
    /// 404: no such job, vhost or queue.
    NotFound(String),
    /// 409: a job runs on that queue, or a resume of a running job.
    Conflict(String),
    /// 503: the job table is full of running jobs.
    Full(String),
    /// 501: not possible in this mode.
    Unavailable(String),
}

impl std::fmt::Display for RedriveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedriveError::BadRequest(m)
            | RedriveError::NotFound(m)
            | RedriveError::Conflict(m)
            | RedriveError::Full(m)
            | RedriveError::Unavailable(m) => f.write_str(m),
        }
    }
}

/// Where redrives move messages.
#[derive(Clone)]
pub enum Backend {
    /// Embedded mode: inside the broker.
    Broker(Arc<Broker>),
    /// Proxy mode: not implemented.
    Unavailable,
}

const PROXY_UNAVAILABLE: &str = "redrive is not available in proxy mode yet: \
                                 shovel the messages with a client (docs/redrive.md)";

/// The instance's redrive jobs (cheap to clone).
#[derive(Clone)]
pub struct Redriver {
    inner: Arc<Inner>,
}

struct Inner {
    table: Mutex<JobTable>,
    backend: Backend,
    metrics: Arc<Metrics>,
}

impl Redriver {
    pub fn new(backend: Backend, metrics: Arc<Metrics>) -> Redriver {
        Redriver {
            inner: Arc::new(Inner {
                table: Mutex::new(JobTable::default()),
                backend,
                metrics,
            }),
        }
    }

    fn table(&self) -> MutexGuard<'_, JobTable> {
        // A panic while holding the lock leaves the table consistent: keep using it.
        self.inner.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks `request`, registers the job and starts it (in the current tokio runtime).
    pub fn start(&self, request: RedriveRequest) -> Result<JobStatus, RedriveError> {
        self.start_resuming(request, None)
    }

    fn start_resuming(
        &self,
        request: RedriveRequest,
        resumes: Option<u64>,
    ) -> Result<JobStatus, RedriveError> {
        let plan = request.plan().map_err(RedriveError::BadRequest)?;
        let Backend::Broker(broker) = &self.inner.backend else {
            return Err(RedriveError::Unavailable(PROXY_UNAVAILABLE.into()));
        };
        let (end, total) = broker
            .redrive_start(&request.vhost, &request.from)
            .map_err(RedriveError::NotFound)?;
        let now = Instant::now();
        let mut table = self.table();
        let (id, cancel) =
            table
                .start(request.clone(), total, now)
                .map_err(|refusal| match refusal {
                    StartRefusal::Busy(id) => RedriveError::Conflict(format!(
                        "redrive job {id} is running on queue {:?} in vhost {:?}",
                        request.from, request.vhost
                    )),
                    StartRefusal::Full => RedriveError::Full(format!(
                        "{} redrive jobs are running; cancel one or wait",
                        jobs::MAX_JOBS
                    )),
                })?;
        table.update(id, |s| s.resumes = resumes);
        self.inner.metrics.set_redrive_jobs(table.running());
        let status = table.status(id, now);
        drop(table);
        tracing::info!(id, vhost = %request.vhost, from = %request.from, to = ?request.to,
                       dry_run = request.dry_run, resumes, "redrive job started");
        let job = EmbeddedJob {
            redriver: self.clone(),
            broker: broker.clone(),
            id,
            plan,
            request,
            end,
            cancel,
        };
        tokio::spawn(job.run());
        status.ok_or_else(|| RedriveError::NotFound(format!("no redrive job {id}")))
    }

    /// A job's status.
    pub fn status(&self, id: u64) -> Option<JobStatus> {
        self.table().status(id, Instant::now())
    }

    /// Every job kept, oldest first.
    pub fn list(&self) -> Vec<JobStatus> {
        self.table().list(Instant::now())
    }

    /// Asks a job to stop after its current batch; its status (still `running` until then).
    pub fn cancel(&self, id: u64) -> Option<JobStatus> {
        self.table().cancel(id, Instant::now())
    }

    /// A new job with the request of job `id`, for what it left: the same queue from its head
    /// again (moved messages are gone from it), `max` less what `id` moved.
    pub fn resume(&self, id: u64) -> Result<JobStatus, RedriveError> {
        let old = self
            .status(id)
            .ok_or_else(|| RedriveError::NotFound(format!("no redrive job {id}")))?;
        if old.state == JobState::Running {
            return Err(RedriveError::Conflict(format!(
                "redrive job {id} is still running"
            )));
        }
        let mut request = old.request;
        if let Some(max) = request.max {
            let left = max.saturating_sub(old.moved);
            if left == 0 {
                return Err(RedriveError::Conflict(format!(
                    "redrive job {id} moved its max of {max} messages: nothing to resume"
                )));
            }
            request.max = Some(left);
        }
        self.start_resuming(request, Some(id))
    }

    fn finish(&self, id: u64, state: JobState, error: Option<String>) {
        let mut table = self.table();
        table.finish(id, state, error, Instant::now());
        self.inner.metrics.set_redrive_jobs(table.running());
        if let Some(s) = table.status(id, Instant::now()) {
            tracing::info!(id, state = ?s.state, moved = s.moved, skipped = s.skipped,
                           failed = s.failed, error = ?s.error, "redrive job finished");
        }
    }
}

/// One job in embedded mode.
struct EmbeddedJob {
    redriver: Redriver,
    broker: Arc<Broker>,
    id: u64,
    plan: Plan,
    request: RedriveRequest,
    /// The pass's end; none: the queue was empty.
    end: Option<u64>,
    cancel: CancellationToken,
}

impl EmbeddedJob {
    async fn run(self) {
        let (state, error) = self.passes().await;
        self.redriver.finish(self.id, state, error);
    }

    async fn passes(&self) -> (JobState, Option<String>) {
        let Some(end) = self.end else {
            return (JobState::Done, None);
        };
        let request = &self.request;
        let metrics = &self.redriver.inner.metrics;
        let mut cursor = RedriveCursor { after: None, end };
        let mut bucket = request.rate.map(|rate| {
            let burst = (rate / 10.0).ceil() as u64;
            TokenBucket::new(rate, burst.clamp(1, BATCH_MOVES), Instant::now())
        });
        let mut left = request.max.unwrap_or(u64::MAX);
        loop {
            if self.cancel.is_cancelled() {
                return (JobState::Cancelled, None);
            }
            if left == 0 {
                return (JobState::Done, None);
            }
            let mut grant = BATCH_MOVES.min(left);
            if let Some(bucket) = &mut bucket {
                grant = bucket.take(grant, Instant::now());
                if grant == 0 {
                    let wait = bucket.wait(Instant::now());
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = self.cancel.cancelled() => {}
                    }
                    continue;
                }
            }
            let limits = BatchLimits {
                examine: BATCH_EXAMINE,
                moves: grant,
                dry_run: request.dry_run,
            };
            let batch = match self.broker.redrive_batch(
                &request.vhost,
                &request.from,
                &self.plan,
                cursor,
                limits,
            ) {
                Ok(batch) => batch,
                Err(error) => return (JobState::Failed, Some(error)),
            };
            let moved = batch.moved.len() as u64;
            if let Some(bucket) = &mut bucket {
                bucket.give_back(grant.saturating_sub(moved));
            }
            left = left.saturating_sub(moved);
            if !request.dry_run {
                metrics.redrive_counted(
                    &request.vhost,
                    &request.from,
                    &batch.moved,
                    batch.skipped,
                    &batch.failed,
                );
            }
            self.redriver.table().update(self.id, |s| {
                s.add(batch.examined, &batch.moved, batch.skipped, &batch.failed)
            });
            cursor.after = batch.after;
            if batch.done {
                return (JobState::Done, None);
            }
            // Other connections get the broker lock between batches.
            tokio::task::yield_now().await;
        }
    }
}
