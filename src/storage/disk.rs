//! The disk alarm (embedded mode with storage): free space on the file system of
//! `storage.dir`, read with `statvfs` every [`CHECK_INTERVAL`]; below `storage.disk_free_limit`
//! the alarm is raised and connections that publish are blocked ("low on disk", by
//! [`crate::server::blocking`], like the memory alarm) until free space is back above it, as
//! RabbitMQ's disk alarm does. Consumers keep draining queues meanwhile.
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
    fn free_space_of_a_real_directory() {
        let free = free_bytes(&std::env::temp_dir()).expect("statvfs");
        assert!(free > 0);
        assert!(free_bytes(Path::new("/no/such/dir")).is_err());
    }
}
