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

    /// Takes one sample at `now` with the current `watermark`; `None` when used memory cannot
    /// be read.
    pub fn sample(&mut self, now: Instant, watermark: Watermark) -> Option<Option<AlarmChange>> {
        self.alarm.set_watermark(watermark.bytes(self.limit));
        let mut used = self.sources.used()?;
        let pressed = self.alarm.is_raised() || used > self.alarm.watermark();
        if self.schedule.due(now, used, pressed) {
            if release_free_memory() {
                self.metrics.memory_released();
                used = self.sources.used().unwrap_or(used);
            }
            self.schedule.released(now, used);
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
    /// read, which is logged); the alarm is cleared when it ends.
    pub async fn run(
        mut self,
        settings: impl Fn() -> MonitorSettings + Send,
        mut shutdown: Shutdown,
    ) {
        loop {
            let current = settings();
            if self.sample(Instant::now(), current.watermark).is_none() {
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
