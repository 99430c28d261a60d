//! The scenarios and what they share: resource names unique to this run, producers split over
//! connections, and the broker watch (RSS and CPU time through /proc when `--pid` is given).

mod deadletter;
mod expire;
mod fill;
mod idle;
mod memory;
mod ping;
mod redrive;
mod throughput;

use std::time::{Duration, Instant};

use std::sync::Arc;

use anyhow::{Result, bail};
use tokio::sync::watch;

use crate::client::{self, ConsumeSpec, Progress, PublishResult, PublishSpec, RunningConsumer};
use crate::procfs::ProcSample;
use crate::report::Report;
use crate::{Cli, ClientKind, Common, Scenario, raw};

pub async fn run(cli: &Cli) -> Result<Report> {
    let c = &cli.common;
    if c.producers == 0 {
        bail!("--producers must be at least 1");
    }
    match &cli.scenario {
        Scenario::Throughput => throughput::run(c).await,
        Scenario::Ping { warmup } => ping::run(c, *warmup).await,
        Scenario::Deadletter {
            kind,
            ttl_ms,
            max_length,
            delivery_limit,
            at_least_once,
        } => {
            let limits = deadletter::Limits {
                ttl_ms: *ttl_ms,
                max_length: *max_length,
                delivery_limit: *delivery_limit,
                at_least_once: *at_least_once,
            };
            deadletter::run(c, *kind, limits).await
        }
        Scenario::ExpireBulk {
            ttl_ms,
            into_dlq,
            drain_timeout,
        } => expire::run(c, *ttl_ms, *into_dlq, *drain_timeout).await,
        Scenario::IdleConnections {
            count,
            hold_seconds,
            client_frame_max,
        } => idle::run(c, *count, *hold_seconds, *client_frame_max).await,
        Scenario::Memory {
            settle_seconds,
            keep,
        } => memory::run(c, *settle_seconds, *keep).await,
        Scenario::Redrive { admin, token } => redrive::run(c, admin, token.as_deref()).await,
        Scenario::Fill { queue } => fill::fill(c, queue).await,
        Scenario::Drain { queue } => fill::drain(c, queue).await,
    }
}

/// A queue or exchange name unique to this run.
fn name(kind: &str) -> String {
    format!("dlxbench.{kind}.{}", std::process::id())
}

fn secs_between(from_nanos: u64, to_nanos: u64) -> f64 {
    to_nanos.saturating_sub(from_nanos) as f64 / 1e9
}

fn rate(count: u64, secs: f64) -> f64 {
    if secs > 0.0 { count as f64 / secs } else { 0.0 }
}

/// The broker process (with --pid) and this process, sampled at the start of a measurement.
struct Watch {
    pid: Option<u32>,
    broker_start: Option<ProcSample>,
    self_start: Option<ProcSample>,
}

impl Watch {
    fn start(pid: Option<u32>) -> Watch {
        Watch {
            pid,
            broker_start: pid.and_then(|p| ProcSample::read(p).ok()),
            self_start: ProcSample::read_self().ok(),
        }
    }

    fn broker(&self) -> Option<ProcSample> {
        self.pid.and_then(|p| ProcSample::read(p).ok())
    }

    fn rss_mib(&self) -> Option<f64> {
        self.broker().map(|s| s.rss_mib())
    }

    /// Adds CPU time used since start (broker and this benchmark) and per message.
    fn cpu_into(&self, report: &mut Report, messages: u64) {
        if let (Some(a), Some(b)) = (self.broker_start, self.broker()) {
            let (cpu, source) = crate::procfs::cpu_used(&a, &b);
            report.set("broker_cpu_s", cpu);
            report.set("broker_cpu_source", source);
            if messages > 0 {
                report.set("broker_cpu_us_per_msg", cpu * 1e6 / messages as f64);
            }
            report.set("broker_rss_mib", b.rss_mib());
        }
        if let (Some(a), Ok(b)) = (self.self_start, ProcSample::read_self()) {
            report.set("bench_cpu_s", crate::procfs::cpu_used(&a, &b).0);
        }
    }
}

/// All producers of a run.
struct Published {
    results: Vec<PublishResult>,
}

impl Published {
    /// Sequence numbers each producer published (0..n), for the id verdict.
    fn per_producer(&self) -> Vec<u64> {
        self.results.iter().map(|r| r.published).collect()
    }

    fn total(&self) -> u64 {
        self.results.iter().map(|r| r.published).sum()
    }

    fn nacked(&self) -> u64 {
        self.results.iter().map(|r| r.nacked).sum()
    }

    fn started_nanos(&self) -> u64 {
        self.results
            .iter()
            .map(|r| r.started_nanos)
            .min()
            .unwrap_or(0)
    }

    fn finished_nanos(&self) -> u64 {
        self.results
            .iter()
            .map(|r| r.finished_nanos)
            .max()
            .unwrap_or(0)
    }

    fn add_to(&self, report: &mut Report, confirms: bool) {
        let secs = secs_between(self.started_nanos(), self.finished_nanos());
        report.set("published", self.total());
        report.set("publish_secs", secs);
        report.set("publish_rate_msg_s", rate(self.total(), secs));
        if confirms {
            report.set("nacked", self.nacked());
            if self.nacked() > 0 {
                report.fail(format!("{} publishes were nacked", self.nacked()));
            }
        }
    }
}

/// Runs `--producers` producers to `routing_key` on the default exchange: `total` messages
/// split between them, or for `--seconds` when no total is given.
async fn publish_all(
    c: &Common,
    routing_key: &str,
    total: Option<u64>,
    confirms: bool,
) -> Result<Published> {
    let until = match (total, c.seconds) {
        (None, Some(s)) => Some(Instant::now() + Duration::from_secs_f64(s.max(0.0))),
        _ => None,
    };
    let p = u64::from(c.producers);
    let mut tasks = Vec::new();
    for i in 0..c.producers {
        let count = total.map(|t| t / p + u64::from(u64::from(i) < t % p));
        let spec = PublishSpec {
            url: c.url.clone(),
            producer: i,
            routing_key: routing_key.to_string(),
            count,
            until,
            size: c.size,
            confirms,
            confirm_window: c.confirm_window,
            pipeline: c.pipeline,
            persistent: c.persistent,
        };
        tasks.push(match c.client_or(ClientKind::Lapin) {
            ClientKind::Lapin => tokio::spawn(client::publish(spec)),
            ClientKind::Raw => tokio::spawn(raw::publish(spec)),
        });
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await??);
    }
    Ok(Published { results })
}

/// Starts a consumer with the client --client names (lapin by default).
async fn start_consumer(
    c: &Common,
    spec: ConsumeSpec,
    progress: Arc<Progress>,
    stop: watch::Receiver<bool>,
) -> Result<RunningConsumer> {
    match c.client_or(ClientKind::Lapin) {
        ClientKind::Lapin => client::start_consumer(spec, progress, stop).await,
        ClientKind::Raw => raw::start_consumer(spec, progress, stop).await,
    }
}

/// Starts --consumers consumers on `queue` that ack and record every delivery.
async fn start_acking_consumers(
    c: &Common,
    queue: &str,
    progress: &Arc<Progress>,
    stop: &watch::Receiver<bool>,
) -> Result<Vec<RunningConsumer>> {
    let mut consumers = Vec::new();
    for i in 0..c.consumers {
        let spec = ConsumeSpec {
            url: c.url.clone(),
            name: format!("consumer {i}"),
            queue: queue.to_string(),
            prefetch: c.prefetch,
            settle: client::Settle::Ack,
            ack_every: c.ack_every,
            record: true,
            events: None,
        };
        consumers.push(start_consumer(c, spec, progress.clone(), stop.clone()).await?);
    }
    Ok(consumers)
}

/// The message count of a run: --messages, else the scenario's default unless --seconds.
fn message_total(c: &Common, default: u64) -> Option<u64> {
    match (c.messages, c.seconds) {
        (Some(n), _) => Some(n),
        (None, Some(_)) => None,
        (None, None) => Some(default),
    }
}

/// Common header values of a report.
fn describe(report: &mut Report, c: &Common, confirms: bool) {
    report.set("producers", c.producers);
    report.set("consumers", c.consumers);
    report.set("size_bytes", c.size as u64);
    report.set("confirms", if confirms { "on" } else { "off" });
    report.set("prefetch", c.prefetch);
    report.set("client", c.client_or(ClientKind::Lapin).name());
    report.set("queue_type", c.queue_type.name());
    report.set("persistent", c.persistent);
}

/// Adds the exactly-once verdict; anything but exactly once is a failure.
fn verdict_into(report: &mut Report, v: &crate::payload::Verdict, what: &str) {
    report.set("expected", v.expected);
    report.set("distinct", v.distinct);
    report.set("missing", v.missing);
    report.set("duplicates", v.duplicates);
    report.set("exactly_once", v.exactly_once());
    if v.missing > 0 {
        report.fail(format!(
            "{} of {} messages not {what} (first ids as (producer, seq): {:?})",
            v.missing, v.expected, v.missing_examples
        ));
    }
    if v.duplicates > 0 {
        report.fail(format!("{} messages {what} more than once", v.duplicates));
    }
    if v.unexpected > 0 {
        report.fail(format!(
            "{} ids {what} that were never published",
            v.unexpected
        ));
    }
    if v.malformed > 0 {
        report.fail(format!("{} bodies without a benchmark stamp", v.malformed));
    }
}
