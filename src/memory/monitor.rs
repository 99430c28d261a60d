//! The memory monitor: a task that samples used memory every
//! `limits.memory_check_interval_ms`, hands free allocator memory back when
//! [`ReleaseSchedule`] says so, raises or clears the [`MemoryAlarm`], publishes the alarm
//! state to the connections and sets the memory metrics. It stops with the service's
//! shutdown signal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::alarm::{AlarmChange, MemoryAlarm};
use super::release::{ReleaseSchedule, release_free_memory};
use super::system::MemorySources;
use super::watermark::Watermark;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// The settings the monitor re-reads before each sample (they can change on reload).
#[derive(Clone, Copy, Debug)]
pub struct MonitorSettings {
    pub watermark: Watermark,
    pub interval: Duration,
}

/// The monitor's state between samples.
pub struct Monitor {
    sources: MemorySources,
    limit: u64,
    alarm: MemoryAlarm,
    schedule: ReleaseSchedule,
    metrics: Arc<Metrics>,
    signal: watch::Sender<bool>,
}

impl Monitor {
    /// Reads the memory limit; `signal` carries the alarm state (true = raised) to the
    /// connections. A fraction needs the limit: without one the error says so.
    pub fn new(
        sources: MemorySources,
        watermark: Watermark,
        metrics: Arc<Metrics>,
        signal: watch::Sender<bool>,
    ) -> Result<Monitor, String> {
        let limit = match (sources.limit(), watermark) {
            (Some((limit, source)), _) => {
                tracing::info!(
                    limit,
                    source = source.as_str(),
                    watermark = %watermark,
                    watermark_bytes = watermark.bytes(limit),
                    "memory high watermark"
                );
                limit
            }
            (None, Watermark::Absolute(bytes)) => bytes,
            (None, Watermark::Relative(_)) => {
                return Err(
                    "a fraction needs the memory limit, and neither the cgroup limit \
                            nor /proc/meminfo can be read: give an absolute size"
                        .into(),
                );
            }
        };
        let alarm = MemoryAlarm::new(watermark.bytes(limit));
        metrics.set_memory(0, limit, alarm.watermark());
        Ok(Monitor {
            sources,
            limit,
            alarm,
            schedule: ReleaseSchedule::default(),
            metrics,
            signal,
        })
    }

    /// Takes one sample at `now` with the current `watermark`, releasing free memory on this
    /// thread when due; `None` when used memory cannot be read.
    pub fn sample(&mut self, now: Instant, watermark: Watermark) -> Option<Option<AlarmChange>> {
        let (due, before) = self.prepare(now, watermark)?;
        let release = due.then(timed_release);
        self.finish(now, before, release)
    }

    /// First half of a sample: applies the watermark, reads used memory; whether a release of
    /// free memory is due, and the used memory read.
    fn prepare(&mut self, now: Instant, watermark: Watermark) -> Option<(bool, u64)> {
        self.alarm.set_watermark(watermark.bytes(self.limit));
        let used = self.sources.used()?;
        let pressed = self.alarm.is_raised() || used > self.alarm.watermark();
        Some((self.schedule.due(now, pressed), used))
    }

    /// Second half: notes the release made since [`prepare`](Self::prepare) (whether it gave
    /// memory back and how long it took; `before` is the used memory `prepare` read), reads
    /// used memory again and raises or clears the alarm.
    fn finish(
        &mut self,
        now: Instant,
        before: u64,
        release: Option<(bool, Duration)>,
    ) -> Option<Option<AlarmChange>> {
        let used = match release {
            Some(_) => self.sources.used()?,
            None => before,
        };
        if let Some((released, took)) = release {
            self.schedule.released(now);
            if released {
                self.metrics.memory_released();
                tracing::debug!(
                    before,
                    after = used,
                    micros = took.as_micros() as u64,
                    "free memory handed back to the operating system"
                );
            }
        }
        let change = self.alarm.observe(used);
        self.metrics
            .set_memory(used, self.limit, self.alarm.watermark());
        if let Some(change) = change {
            let raised = change == AlarmChange::Raised;
            self.signal.send_replace(raised);
            self.metrics.set_memory_alarm(raised);
            let watermark = self.alarm.watermark();
            if raised {
                tracing::warn!(
                    used,
                    watermark,
                    "memory alarm raised: publishing connections are blocked"
                );
            } else {
                tracing::info!(
                    used,
                    watermark,
                    "memory alarm cleared: publishing connections resume"
                );
            }
        }
        Some(change)
    }

    /// Samples every `settings().interval` until shutdown (or until used memory cannot be
    /// read, which is logged); the alarm is cleared when it ends. A release runs on the
    /// blocking pool: handing back a gigabyte takes glibc most of a second.
    pub async fn run(
        mut self,
        settings: impl Fn() -> MonitorSettings + Send,
        mut shutdown: Shutdown,
    ) {
        loop {
            let current = settings();
            let now = Instant::now();
            let sampled = match self.prepare(now, current.watermark) {
                None => None,
                Some((due, before)) => {
                    let release = if due {
                        tokio::task::spawn_blocking(timed_release).await.ok()
                    } else {
                        None
                    };
                    self.finish(now, before, release)
                }
            };
            if sampled.is_none() {
                tracing::warn!(
                    "cannot read this process's resident memory; the memory alarm is off"
                );
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(current.interval) => {}
                _ = shutdown.recv() => break,
            }
        }
        self.signal.send_replace(false);
        self.metrics.set_memory_alarm(false);
    }
}

/// Releases free memory: whether any was given back, and how long it took.
fn timed_release() -> (bool, Duration) {
    let started = Instant::now();
    let released = release_free_memory();
    (released, started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn monitor(root: &std::path::Path, watermark: Watermark) -> (Monitor, Arc<Metrics>) {
        let metrics = Metrics::new(10);
        let sources = MemorySources {
            proc: root.join("proc"),
            cgroup: root.join("cgroup"),
        };
        let signal = watch::Sender::new(false);
        let monitor = Monitor::new(sources, watermark, metrics.clone(), signal).unwrap();
        (monitor, metrics)
    }

    fn set_resident_pages(root: &std::path::Path, pages: u64) {
        std::fs::write(
            root.join("proc/self/statm"),
            format!("1 {pages} 0 0 0 0 0\n"),
        )
        .unwrap();
    }

    #[test]
    fn samples_raise_and_clear_the_alarm_and_set_the_gauges() {
        let root = std::env::temp_dir().join(format!("dlx-monitor-{}", std::process::id()));
        std::fs::create_dir_all(root.join("proc/self")).unwrap();
        std::fs::create_dir_all(root.join("cgroup")).unwrap();
        std::fs::write(root.join("cgroup/memory.max"), "1048576000\n").unwrap();
        std::fs::write(root.join("proc/meminfo"), "MemTotal: 4096000 kB\n").unwrap();
        let (mut monitor, metrics) = monitor(&root, Watermark::Relative(0.5));
        let receiver = monitor.signal.subscribe();
        let now = Instant::now();
        let watermark = Watermark::Relative(0.5);
        // The page size is read from the system; sizes below are in pages of it.
        let page = {
            set_resident_pages(&root, 1);
            monitor.sources.used().unwrap()
        };
        let watermark_pages = 524_288_000 / page;
        set_resident_pages(&root, watermark_pages / 2);
        assert_eq!(monitor.sample(now, watermark), Some(None));
        assert!(!*receiver.borrow());
        set_resident_pages(&root, watermark_pages + 1);
        assert_eq!(
            monitor.sample(now, watermark),
            Some(Some(AlarmChange::Raised))
        );
        assert!(*receiver.borrow());
        let text = metrics.encode();
        assert!(text.contains("dlx_proxy_memory_alarm 1"), "{text}");
        assert!(
            text.contains("dlx_proxy_memory_limit_bytes 1048576000"),
            "{text}"
        );
        assert!(
            text.contains("dlx_proxy_memory_high_watermark_bytes 524288000"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "dlx_proxy_memory_used_bytes {}",
                (watermark_pages + 1) * page
            )),
            "{text}"
        );
        set_resident_pages(&root, watermark_pages / 2);
        assert_eq!(
            monitor.sample(now, watermark),
            Some(Some(AlarmChange::Cleared))
        );
        assert!(!*receiver.borrow());
        assert!(metrics.encode().contains("dlx_proxy_memory_alarm 0"));
        // A reload that lowers the watermark raises it again.
        assert_eq!(
            monitor.sample(now, Watermark::Absolute(page)),
            Some(Some(AlarmChange::Raised))
        );
        std::fs::remove_file(root.join("proc/self/statm")).unwrap();
        assert_eq!(monitor.sample(now, watermark), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_fraction_without_a_readable_limit_is_refused() {
        let sources = MemorySources {
            proc: "/nonexistent/proc".into(),
            cgroup: "/nonexistent/cgroup".into(),
        };
        let metrics = Metrics::new(10);
        let error = Monitor::new(
            sources.clone(),
            Watermark::Relative(0.4),
            metrics.clone(),
            watch::Sender::new(false),
        )
        .err()
        .unwrap();
        assert!(error.contains("absolute size"), "{error}");
        assert!(
            Monitor::new(
                sources,
                Watermark::Absolute(1 << 20),
                metrics,
                watch::Sender::new(false)
            )
            .is_ok()
        );
    }
}
