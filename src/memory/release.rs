//! Handing memory the allocator keeps after frees back to the operating system.
//!
//! The service uses the system allocator (glibc malloc in the images). glibc returns memory
//! to the kernel only from the top of a heap and from large mappings; the memory of millions
//! of freed small messages stays resident, so after a queue was drained or deleted the
//! resident size stayed near its peak (BENCHMARKS.md, "Memory after queues are emptied").
//! `malloc_trim(0)` walks every arena and releases the free pages inside them too.
//!
//! [`ReleaseSchedule`] decides when (pure, takes `now`): on every sample while used memory
//! is above the watermark or the alarm is raised, so blocked publishers resume as soon as
//! consumers have freed memory, and otherwise once per [`RELEASE_EVERY`]. Frees cannot be
//! seen in the resident size before the release itself, so there is no cheaper trigger; a
//! release that finds nothing to give back costs well under a millisecond (BENCHMARKS.md).

use std::time::{Duration, Instant};

/// Time between two releases while memory is below the watermark.
pub const RELEASE_EVERY: Duration = Duration::from_secs(10);

/// When to release free memory.
#[derive(Clone, Debug, Default)]
pub struct ReleaseSchedule {
    last: Option<Instant>,
}

impl ReleaseSchedule {
    /// Whether to release at `now`; `pressed`: used memory is above the watermark or the
    /// alarm is raised.
    pub fn due(&self, now: Instant, pressed: bool) -> bool {
        pressed
            || self
                .last
                .is_none_or(|last| now.duration_since(last) >= RELEASE_EVERY)
    }

    /// A release was made at `now`.
    pub fn released(&mut self, now: Instant) {
        self.last = Some(now);
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
    fn every_sample_under_pressure_otherwise_every_ten_seconds() {
        let mut schedule = ReleaseSchedule::default();
        let t0 = Instant::now();
        assert!(schedule.due(t0, false), "first sample");
        schedule.released(t0);
        assert!(!schedule.due(t0 + Duration::from_secs(1), false));
        assert!(schedule.due(t0 + Duration::from_millis(1), true));
        schedule.released(t0 + Duration::from_millis(1));
        assert!(!schedule.due(t0 + RELEASE_EVERY, false));
        assert!(schedule.due(t0 + RELEASE_EVERY + Duration::from_millis(1), false));
    }

    #[test]
    fn releasing_is_harmless() {
        let block = vec![7u8; 8 << 20];
        drop(block);
        // Whether anything was left to release depends on the allocator; it must not fail.
        let _ = release_free_memory();
    }
}
