//! What the benchmark reads about a process from /proc: resident memory (VmRSS), thread count
//! and CPU time. The parsers are pure; [`ProcSample::read`] does the file reads.

use std::path::PathBuf;

/// Linux reports CPU time in clock ticks of 1/100 s (USER_HZ) on every common architecture.
const TICKS_PER_SEC: f64 = 100.0;

/// One look at a process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcSample {
    pub rss_kib: u64,
    pub threads: u64,
    /// User plus system CPU time, in seconds.
    pub cpu_secs: f64,
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
    }
}
