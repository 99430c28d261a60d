//! What the benchmark reads about a process from /proc: resident memory (VmRSS), thread count
//! and CPU time. The parsers are pure; [`ProcSample::read`] does the file reads.
//!
//! CPU time comes two ways. /proc/PID/stat counts user and system time in clock ticks of 10 ms,
//! so a run of 0.2 s of CPU (100 000 small messages through a forwarder) is measured to within
//! about 5 %: too coarse to tell 1.1× from 1.2×. Each thread's /proc/PID/task/TID/schedstat
//! holds its time on a CPU in nanoseconds; their sum is exact for the threads alive at both
//! samples, but misses the time of threads that ended in between, which the ticks still count.
//! [`cpu_used`] takes the nanosecond sum unless the ticks say threads ended with time of
//! their own.

use std::path::PathBuf;

/// Linux reports CPU time in clock ticks of 1/100 s (USER_HZ) on every common architecture.
const TICKS_PER_SEC: f64 = 100.0;

/// One look at a process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcSample {
    pub rss_kib: u64,
    pub threads: u64,
    /// User plus system CPU time, in seconds, from clock ticks (10 ms steps).
    pub cpu_secs: f64,
    /// Time on a CPU summed over the threads alive now, in seconds, to the nanosecond (`None`
    /// when a thread's schedstat could not be read).
    pub run_secs: Option<f64>,
}

impl ProcSample {
    /// Reads /proc/PID/status and /proc/PID/stat.
    pub fn read(pid: u32) -> std::io::Result<ProcSample> {
        let base = PathBuf::from(format!("/proc/{pid}"));
        let status = std::fs::read_to_string(base.join("status"))?;
        let stat = std::fs::read_to_string(base.join("stat"))?;
        let bad = |what: &str| std::io::Error::other(format!("/proc/{pid}: no {what}"));
        Ok(ProcSample {
            rss_kib: status_field_kib(&status, "VmRSS").ok_or_else(|| bad("VmRSS"))?,
            threads: status_field_kib(&status, "Threads").unwrap_or(0),
            cpu_secs: stat_cpu_ticks(&stat).ok_or_else(|| bad("CPU times"))? as f64 / TICKS_PER_SEC,
            run_secs: threads_run_ns(&base).map(|ns| ns as f64 / 1e9),
        })
    }

    /// This process.
    pub fn read_self() -> std::io::Result<ProcSample> {
        ProcSample::read(std::process::id())
    }

    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }
}

/// The CPU time used between two samples of one process, in seconds, and where it came from
/// ("schedstat" or "ticks"). The nanosecond sums are used when both samples have them and the
/// ticks do not exceed them by more than their own resolution (3 ticks and 5 %): more means
/// threads ended between the samples with time the sums no longer hold.
pub fn cpu_used(start: &ProcSample, end: &ProcSample) -> (f64, &'static str) {
    let ticks = end.cpu_secs - start.cpu_secs;
    if let (Some(a), Some(b)) = (start.run_secs, end.run_secs) {
        let exact = b - a;
        if exact >= 0.0 && ticks <= exact * 1.05 + 3.0 / TICKS_PER_SEC {
            return (exact, "schedstat");
        }
    }
    (ticks, "ticks")
}

/// The sum of the first field (nanoseconds on a CPU) of every thread's schedstat, or `None`
/// when the kernel does not keep it: no schedstat files, or files that read all zeros (kernels
/// and sandboxes without scheduler statistics). The caller then falls back to the ticks.
fn threads_run_ns(base: &std::path::Path) -> Option<u64> {
    let mut texts = Vec::new();
    for entry in std::fs::read_dir(base.join("task")).ok()? {
        let thread = entry.ok()?.path();
        match std::fs::read_to_string(thread.join("schedstat")) {
            Ok(text) => texts.push(text),
            // The thread ended between the listing and the read: its time is lost either way.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && !thread.exists() => {}
            Err(_) => return None,
        }
    }
    sum_run_ns(texts.iter().map(String::as_str))
}

/// The sum of the times on a CPU of the given schedstat lines, `None` if one does not parse or
/// the sum is 0: a live process has had some time on a CPU, so a 0 means no statistics.
pub fn sum_run_ns<'a>(schedstats: impl IntoIterator<Item = &'a str>) -> Option<u64> {
    let mut total = 0u64;
    for text in schedstats {
        total = total.saturating_add(schedstat_run_ns(text)?);
    }
    (total > 0).then_some(total)
}

/// The time on a CPU (the first field, nanoseconds) of a /proc/…/schedstat line.
pub fn schedstat_run_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
}

/// The number in a `Name:  value [kB]` line of /proc/PID/status.
pub fn status_field_kib(status: &str, name: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// utime + stime (fields 14 and 15) of /proc/PID/stat. The command name (field 2) is in
/// parentheses and may contain spaces or parentheses, so fields are counted after the last ')'.
pub fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace();
    // After the name come field 3 (state) onwards: utime is field 14, the 12th from here.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_rss_and_threads() {
        let status = "Name:\tbeam.smp\nVmPeak:\t  123 kB\nVmRSS:\t   98765 kB\nThreads:\t41\n";
        assert_eq!(status_field_kib(status, "VmRSS"), Some(98765));
        assert_eq!(status_field_kib(status, "Threads"), Some(41));
        assert_eq!(status_field_kib(status, "VmSwap"), None);
    }

    #[test]
    fn cpu_ticks_survive_odd_command_names() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 3 0";
        assert_eq!(stat_cpu_ticks(stat), Some(287));
        assert_eq!(stat_cpu_ticks("garbage"), None);
    }

    #[test]
    fn reads_this_process() {
        let s = ProcSample::read_self().unwrap();
        assert!(s.rss_kib > 0);
        assert!(s.threads >= 1);
        // Kernels without scheduler statistics give none; the ticks are then used.
        assert!(s.run_secs.is_none_or(|secs| secs > 0.0));
    }

    #[test]
    fn schedstats_that_read_zero_are_no_statistics() {
        assert_eq!(sum_run_ns(["5 1 2\n", "7 0 1\n"]), Some(12));
        assert_eq!(sum_run_ns(["0 0 0\n", "0 0 0\n"]), None);
        assert_eq!(sum_run_ns(["5 1 2\n", "bad"]), None);
        assert_eq!(sum_run_ns([]), None);
    }

    #[test]
    fn schedstat_gives_nanoseconds_on_a_cpu() {
        assert_eq!(schedstat_run_ns("5331306 1092562 7\n"), Some(5_331_306));
        assert_eq!(schedstat_run_ns(""), None);
        assert_eq!(schedstat_run_ns("x 1 2"), None);
    }

    fn sample(ticks_secs: f64, run_secs: Option<f64>) -> ProcSample {
        ProcSample {
            cpu_secs: ticks_secs,
            run_secs,
            ..ProcSample::default()
        }
    }

    #[test]
    fn cpu_used_prefers_nanoseconds_within_the_ticks_resolution() {
        // 0.16 s in ticks, 0.1834 s exact: the exact figure.
        let (secs, source) = cpu_used(&sample(1.00, Some(2.0)), &sample(1.16, Some(2.1834)));
        assert!((secs - 0.1834).abs() < 1e-9);
        assert_eq!(source, "schedstat");
        // Ticks far above the sums: a thread ended with its time; the ticks hold it.
        let (secs, source) = cpu_used(&sample(1.00, Some(2.0)), &sample(1.90, Some(2.1)));
        assert!((secs - 0.90).abs() < 1e-9);
        assert_eq!(source, "ticks");
        // No sums on one side.
        let (_, source) = cpu_used(&sample(1.00, None), &sample(1.20, Some(2.1)));
        assert_eq!(source, "ticks");
    }
}
