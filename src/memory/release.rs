//! Handing memory the allocator keeps after frees back to the operating system.
//!
//! The service uses the system allocator (glibc malloc in the images). glibc returns memory
//! to the kernel only from the top of a heap and from large mappings; the memory of millions
//! of freed small messages stays resident, so after a queue was drained or deleted the
//! resident size stayed near its peak (BENCHMARKS.md, "Memory after queues are emptied").
//! `malloc_trim(0)` walks every arena and releases the free pages inside them too.
//!
//! [`ReleaseSchedule`] decides when (pure, takes `now`): on every sample while the memory
//! alarm is raised, so blocked publishers resume as soon as consumers have freed memory, and
//! otherwise at most once per [`RELEASE_EVERY`], after used memory was seen above what it was
//! at the previous release (something was allocated that may since have been freed).

use std::time::{Duration, Instant};

/// Shortest time between two releases while the alarm is not raised.
pub const RELEASE_EVERY: Duration = Duration::from_secs(10);

/// When to release free memory.
#[derive(Clone, Debug, Default)]
pub struct ReleaseSchedule {
    last: Option<Instant>,
    /// Used memory just after the last release.
    floor: u64,
    /// Highest used memory seen since the last release.
    peak: u64,
}

impl ReleaseSchedule {
    /// Takes a sample (`used` bytes, the alarm state); whether to release now.
    pub fn due(&mut self, now: Instant, used: u64, alarm_raised: bool) -> bool {
        self.peak = self.peak.max(used);
        if alarm_raised {
            return true;
        }
        let waited = self
            .last
            .is_none_or(|last| now.duration_since(last) >= RELEASE_EVERY);
        waited && self.peak > self.floor
    }

    /// A release was made at `now`; `used` is the used memory after it.
    pub fn released(&mut self, now: Instant, used: u64) {
        self.last = Some(now);
        self.floor = used;
        self.peak = used;
    }
}

/// Releases the allocator's free memory to the operating system; whether any was released.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_free_memory() -> bool {
    // SAFETY: malloc_trim only takes glibc's own arena locks; any thread may call it.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Other allocators return memory on their own: nothing to do.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_while_the_alarm_is_raised() {
        let mut schedule = ReleaseSchedule::default();
        let t0 = Instant::now();
        assert!(schedule.due(t0, 100, true));
        schedule.released(t0, 100);
        assert!(schedule.due(t0 + Duration::from_millis(1), 100, true));
    }

    #[test]
    fn otherwise_after_growth_and_at_most_every_ten_seconds() {
        let mut schedule = ReleaseSchedule::default();
        let t0 = Instant::now();
        assert!(schedule.due(t0, 100, false), "first sample");
        schedule.released(t0, 80);
        // Grew, but too soon.
        assert!(!schedule.due(t0 + Duration::from_secs(1), 500, false));
        // Back down before the ten seconds: the peak in between still counts.
        assert!(schedule.due(t0 + RELEASE_EVERY, 90, false));
        schedule.released(t0 + RELEASE_EVERY, 70);
        // No growth since: nothing to release, however long it waits.
        assert!(!schedule.due(t0 + RELEASE_EVERY * 5, 70, false));
        assert!(!schedule.due(t0 + RELEASE_EVERY * 5, 60, false));
        assert!(schedule.due(t0 + RELEASE_EVERY * 5, 71, false));
    }

    #[test]
    fn releasing_is_harmless() {
        let block = vec![7u8; 8 << 20];
        drop(block);
        // Whether anything was left to release depends on the allocator; it must not fail.
        let _ = release_free_memory();
    }
}
