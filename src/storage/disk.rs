//! The disk alarm (embedded mode with storage): free space on the file system of
//! `storage.dir`, read with `statvfs` every [`CHECK_INTERVAL`]; below `storage.disk_free_limit`
//! the alarm is raised and connections that publish are blocked ("low on disk", by
//! [`crate::server::blocking`], like the memory alarm) until free space is back above it, as
//! RabbitMQ's disk alarm does. Consumers keep draining queues meanwhile.
//!
//! The limit is a size (`"50MB"`) or, as RabbitMQ's `disk_free_limit.relative`, a multiple of
//! the memory available to the process (`"1.5x"`: the memory limit of
//! [`crate::memory::system`], the cgroup's or else total RAM): [`Limit`].
//!
//! [`raised`] is the decision (pure); [`free_bytes`] the one system call; [`run`] the task
//! that ties them to the alarm's `watch` channel and the metrics.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// Time between two reads of free space.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// A parsed `storage.disk_free_limit`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// This many bytes (0: no disk alarm).
    Absolute(u64),
    /// This multiple of the memory available to the process.
    Relative(f64),
}

/// Largest multiple of memory accepted (RabbitMQ suggests 1.0 to 2.0).
const MAX_RELATIVE: f64 = 100.0;

impl Limit {
    /// Reads the setting's text: a size (`"50MB"`, `"1048576"`, `0`) or a multiple of memory
    /// (`"1.5x"`, `"2x"`). The error says what is wrong (the caller names the key).
    pub fn parse(text: &str) -> Result<Limit, String> {
        let text = text.trim();
        let Some(multiple) = text.strip_suffix(['x', 'X']) else {
            if text.contains('.') {
                return Err(format!(
                    "{text:?} is not a size; write a multiple of memory with an x (\"{text}x\")"
                ));
            }
            return crate::memory::watermark::parse_size(text).map(Limit::Absolute);
        };
        let factor: f64 = multiple.trim().parse().map_err(|_| {
            format!("{text:?} is not a multiple of memory such as \"1.5x\" (or a size)")
        })?;
        if !(factor > 0.0 && factor <= MAX_RELATIVE) {
            return Err(format!(
                "{text:?}: the multiple of memory must be more than 0 and at most {MAX_RELATIVE}"
            ));
        }
        Ok(Limit::Relative(factor))
    }

    /// The limit in bytes, given the process's memory limit (`None`: unknown, then a
    /// relative limit falls back to RabbitMQ's default of 50 MB).
    pub fn bytes(self, memory: Option<u64>) -> u64 {
        match (self, memory) {
            (Limit::Absolute(bytes), _) => bytes,
            // Saturates at u64::MAX; a relative limit is never 0 (which would mean off).
            (Limit::Relative(factor), Some(memory)) => ((memory as f64 * factor) as u64).max(1),
            (Limit::Relative(_), None) => 50_000_000,
        }
    }
}

/// Whether `free` bytes are below `limit` (a limit of 0 never raises the alarm).
pub fn raised(free: u64, limit: u64) -> bool {
    free < limit
}

/// Bytes an unprivileged process may still write on the file system holding `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c_path` is a NUL-terminated string and `stat` points to writable memory of
    // the right type; statvfs writes only into it.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `stat` (zeroed before, so every field is
    // initialised either way).
    let stat = unsafe { stat.assume_init() };
    // fsblkcnt_t and c_ulong are 32 bits on some targets.
    #[allow(clippy::unnecessary_cast)]
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Reads free space under `dir` every [`CHECK_INTERVAL`] against the `limit` in force (it
/// can change on reload), sets the metrics and sends the alarm state (true = raised) on
/// `signal` when it changes. A failed read is logged once and leaves the alarm as it is.
pub async fn run(
    dir: PathBuf,
    limit: impl Fn() -> u64,
    metrics: Arc<Metrics>,
    signal: watch::Sender<bool>,
    mut shutdown: Shutdown,
) {
    let mut failing = false;
    loop {
        let limit = limit();
        let path = dir.clone();
        match tokio::task::spawn_blocking(move || free_bytes(&path)).await {
            Ok(Ok(free)) => {
                failing = false;
                metrics.set_disk(free, limit);
                let now = raised(free, limit);
                if *signal.borrow() != now {
                    if now {
                        tracing::warn!(free, limit, dir = %dir.display(), "disk alarm raised: free space below storage.disk_free_limit, publishers are blocked");
                    } else {
                        tracing::info!(free, limit, dir = %dir.display(), "disk alarm cleared");
                    }
                    metrics.set_disk_alarm(now);
                    signal.send_replace(now);
                }
            }
            Ok(Err(e)) if !failing => {
                failing = true;
                tracing::warn!(dir = %dir.display(), error = %e, "cannot read free disk space");
            }
            _ => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(CHECK_INTERVAL) => {}
            _ = shutdown.recv() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_limit_only_and_never_with_no_limit() {
        assert!(raised(99, 100));
        assert!(!raised(100, 100));
        assert!(!raised(0, 0), "0: no disk alarm");
    }

    #[test]
    fn a_limit_is_a_size_or_a_multiple_of_memory() {
        assert_eq!(Limit::parse("50MB"), Ok(Limit::Absolute(50_000_000)));
        assert_eq!(Limit::parse("0"), Ok(Limit::Absolute(0)));
        assert_eq!(Limit::parse(" 1.5x "), Ok(Limit::Relative(1.5)));
        assert_eq!(Limit::parse("2X"), Ok(Limit::Relative(2.0)));
        for bad in [
            "x", "0x", "-1x", "1.5", "abcx", "101x", "NaNx", "infx", "1.5 GiB",
        ] {
            assert!(Limit::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(Limit::Relative(1.5).bytes(Some(1 << 30)), 3 << 29);
        assert_eq!(Limit::Relative(1.0).bytes(None), 50_000_000);
        assert_eq!(Limit::Relative(100.0).bytes(Some(u64::MAX)), u64::MAX);
        assert_eq!(Limit::Absolute(7).bytes(Some(1 << 30)), 7);
    }

    #[test]
    fn free_space_of_a_real_directory() {
        let free = free_bytes(&std::env::temp_dir()).expect("statvfs");
        assert!(free > 0);
        assert!(free_bytes(Path::new("/no/such/dir")).is_err());
    }
}
