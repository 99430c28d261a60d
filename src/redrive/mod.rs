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
//!   `max` is reached, or the job is cancelled; in proxy mode one pass of
//!   [`crate::proxy::redrive`] on a connection of its own to the upstream (consume, publish
//!   with confirms, ack), reported here message by message.

pub mod bucket;
pub mod jobs;
pub mod plan;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::broker::methods::{BatchLimits, RedriveCursor};
use crate::config::ServiceIdentity;
use crate::metrics::Metrics;
use crate::proxy::ProxyShared;
use crate::proxy::redrive::{OpenError, Pass, PassEnd, RedriveConnection};
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
    /// 502: the upstream could not be reached or refused the proxy's login.
    Upstream(String),
}

impl std::fmt::Display for RedriveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedriveError::BadRequest(m)
            | RedriveError::NotFound(m)
            | RedriveError::Conflict(m)
            | RedriveError::Full(m)
            | RedriveError::Unavailable(m)
            | RedriveError::Upstream(m) => f.write_str(m),
        }
    }
}

/// Where redrives move messages.
#[derive(Clone)]
pub enum Backend {
    /// Embedded mode: inside the broker.
    Broker(Arc<Broker>),
    /// Proxy mode: through the upstream, logged in as the service identity.
    Proxy {
        shared: Arc<ProxyShared>,
        identity: ServiceIdentity,
    },
    /// Proxy mode without a service identity (`upstream.user`).
    Unavailable,
}

const PROXY_UNAVAILABLE: &str = "redrive in proxy mode needs the proxy's own login on the \
                                 upstream: set upstream.user and upstream.password";

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
    pub async fn start(&self, request: RedriveRequest) -> Result<JobStatus, RedriveError> {
        self.start_resuming(request, None).await
    }

    async fn start_resuming(
        &self,
        request: RedriveRequest,
        resumes: Option<u64>,
    ) -> Result<JobStatus, RedriveError> {
        let plan = request.plan().map_err(RedriveError::BadRequest)?;
        let (start, total) = match &self.inner.backend {
            Backend::Broker(broker) => {
                let (end, total) = broker
                    .redrive_start(&request.vhost, &request.from)
                    .map_err(RedriveError::NotFound)?;
                (Start::Broker(broker.clone(), end), total)
            }
            Backend::Proxy { shared, identity } => {
                // A busy queue is refused before any connection is opened.
                if let Some(id) = self.table().running_on(&request.vhost, &request.from) {
                    return Err(busy(id, &request));
                }
                let conn =
                    crate::proxy::redrive::open(shared, identity, &request.vhost, &request.from)
                        .await
                        .map_err(|e| match e {
                            OpenError::NotFound(m) => RedriveError::NotFound(m),
                            OpenError::Upstream(m) => RedriveError::Upstream(m),
                        })?;
                let total = conn.total;
                (Start::Proxy(Box::new(conn)), total)
            }
            Backend::Unavailable => {
                return Err(RedriveError::Unavailable(PROXY_UNAVAILABLE.into()));
            }
        };
        let now = Instant::now();
        let mut table = self.table();
        let (id, cancel) =
            table
                .start(request.clone(), total, now)
                .map_err(|refusal| match refusal {
                    StartRefusal::Busy(id) => busy(id, &request),
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
        match start {
            Start::Broker(broker, end) => {
                let job = EmbeddedJob {
                    redriver: self.clone(),
                    broker,
                    id,
                    plan,
                    request,
                    end,
                    cancel,
                };
                self.watch_job(id, tokio::spawn(job.run()));
            }
            Start::Proxy(conn) => {
                let job = tokio::spawn(self.clone().proxy_job(id, *conn, plan, request, cancel));
                self.watch_job(id, job);
            }
        }
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
    pub async fn resume(&self, id: u64) -> Result<JobStatus, RedriveError> {
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
        self.start_resuming(request, Some(id)).await
    }

    /// One job in proxy mode: one pass on its own upstream connection.
    async fn proxy_job(
        self,
        id: u64,
        conn: RedriveConnection,
        plan: Plan,
        request: RedriveRequest,
        cancel: CancellationToken,
    ) {
        let pass = Pass {
            plan,
            dry_run: request.dry_run,
            rate: request.rate,
            max: request.max,
            cancel,
        };
        let metrics = self.inner.metrics.clone();
        let report = |p: crate::proxy::redrive::Progress| {
            if !request.dry_run {
                metrics.redrive_counted(
                    &request.vhost,
                    &request.from,
                    &p.moved,
                    p.skipped,
                    &p.failed,
                );
            }
            self.table()
                .update(id, |s| s.add(p.examined, &p.moved, p.skipped, &p.failed));
        };
        let (state, error) = match conn.run(pass, report).await {
            Ok(PassEnd::Done) => (JobState::Done, None),
            Ok(PassEnd::Cancelled) => (JobState::Cancelled, None),
            Err(error) => (JobState::Failed, Some(error)),
        };
        self.finish(id, state, error);
    }

    /// Marks job `id` failed if its task ends without finishing it (a panic): otherwise it
    /// would show `running` for ever and refuse every later redrive of its queue.
    fn watch_job(&self, id: u64, job: tokio::task::JoinHandle<()>) {
        let redriver = self.clone();
        tokio::spawn(async move {
            if let Err(err) = job.await {
                tracing::error!(id, error = %err, "redrive job stopped unexpectedly");
                redriver.finish(
                    id,
                    JobState::Failed,
                    Some(format!("the job stopped: {err}")),
                );
            }
        });
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

/// How a job starts, by mode.
enum Start {
    /// The broker and the pass's end.
    Broker(Arc<Broker>, Option<u64>),
    /// The pass's upstream connection, open.
    Proxy(Box<RedriveConnection>),
}

fn busy(id: u64, request: &RedriveRequest) -> RedriveError {
    RedriveError::Conflict(format!(
        "redrive job {id} is running on queue {:?} in vhost {:?}",
        request.from, request.vhost
    ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A job whose task dies (a panic) is failed, not left running: its queue can be redriven
    /// again and the running-jobs gauge comes back down.
    #[tokio::test]
    async fn a_job_whose_task_dies_is_failed() {
        let metrics = Metrics::new(10);
        let redriver = Redriver::new(Backend::Unavailable, metrics.clone());
        let request = RedriveRequest {
            vhost: "/".into(),
            from: "dlq".into(),
            ..RedriveRequest::default()
        };
        let (id, _cancel) = redriver
            .table()
            .start(request.clone(), 2, Instant::now())
            .map_err(|_| "refused")
            .unwrap();
        redriver.watch_job(id, tokio::spawn(async { panic!("a job's bug") }));
        let deadline = Instant::now() + Duration::from_secs(5);
        while redriver.status(id).map(|s| s.state) == Some(JobState::Running) {
            assert!(Instant::now() < deadline, "the job stays running");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let status = redriver.status(id).unwrap();
        assert_eq!(status.state, JobState::Failed);
        assert!(
            status
                .error
                .as_deref()
                .unwrap_or("")
                .contains("the job stopped"),
            "{status:?}"
        );
        assert!(redriver.table().start(request, 2, Instant::now()).is_ok());
    }
}
