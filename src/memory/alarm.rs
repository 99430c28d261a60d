//! The memory alarm decision: given the used memory sampled now, is the alarm raised?
//!
//! Raised when used memory goes above the watermark (as RabbitMQ's `vm_memory_monitor`);
//! cleared only once it is back below the watermark less [`CLEAR_MARGIN_PERCENT`]. RabbitMQ
//! clears at the watermark itself; the margin keeps one sample's jitter of the resident size
//! (a frame buffer, a socket read) from blocking and unblocking publishers on every sample
//! while usage hovers at the watermark. Pure: no clock, no I/O.

/// How far below the watermark (in percent of it) used memory must fall to clear the alarm.
pub const CLEAR_MARGIN_PERCENT: u64 = 5;

/// A raise or a clear of the alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlarmChange {
    Raised,
    Cleared,
}

/// The alarm state for one watermark.
#[derive(Clone, Debug)]
pub struct MemoryAlarm {
    watermark: u64,
    raised: bool,
}

impl MemoryAlarm {
    /// A cleared alarm at `watermark` bytes.
    pub fn new(watermark: u64) -> MemoryAlarm {
        MemoryAlarm {
            watermark,
            raised: false,
        }
    }

    pub fn watermark(&self) -> u64 {
        self.watermark
    }

    /// A new watermark (configuration reload); the next [`observe`](Self::observe) decides
    /// with it.
    pub fn set_watermark(&mut self, watermark: u64) {
        self.watermark = watermark;
    }

    pub fn is_raised(&self) -> bool {
        self.raised
    }

    /// Used memory must fall below this to clear a raised alarm.
    pub fn clear_level(&self) -> u64 {
        self.watermark - self.watermark / 100 * CLEAR_MARGIN_PERCENT
    }

    /// Takes a sample of used memory; returns the change it causes, if any.
    pub fn observe(&mut self, used: u64) -> Option<AlarmChange> {
        if !self.raised && used > self.watermark {
            self.raised = true;
            return Some(AlarmChange::Raised);
        }
        if self.raised && used < self.clear_level() {
            self.raised = false;
            return Some(AlarmChange::Cleared);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raised_above_the_watermark_and_cleared_below_the_margin() {
        let mut alarm = MemoryAlarm::new(1000);
        assert_eq!(alarm.clear_level(), 950);
        assert_eq!(alarm.observe(500), None);
        assert_eq!(
            alarm.observe(1000),
            None,
            "at the watermark is not above it"
        );
        assert!(!alarm.is_raised());
        assert_eq!(alarm.observe(1001), Some(AlarmChange::Raised));
        assert!(alarm.is_raised());
        assert_eq!(alarm.observe(2000), None, "raised once");
        assert_eq!(
            alarm.observe(999),
            None,
            "below the watermark, inside the margin"
        );
        assert_eq!(alarm.observe(950), None);
        assert_eq!(alarm.observe(949), Some(AlarmChange::Cleared));
        assert!(!alarm.is_raised());
        assert_eq!(alarm.observe(949), None, "cleared once");
        assert_eq!(
            alarm.observe(990),
            None,
            "not raised again inside the margin"
        );
        assert_eq!(alarm.observe(1001), Some(AlarmChange::Raised));
    }

    #[test]
    fn a_new_watermark_applies_to_the_next_sample() {
        let mut alarm = MemoryAlarm::new(1000);
        assert_eq!(alarm.observe(800), None);
        alarm.set_watermark(500);
        assert_eq!(alarm.watermark(), 500);
        assert_eq!(alarm.observe(800), Some(AlarmChange::Raised));
        alarm.set_watermark(10_000);
        assert_eq!(alarm.observe(800), Some(AlarmChange::Cleared));
    }

    #[test]
    fn tiny_watermarks_do_not_underflow() {
        let mut alarm = MemoryAlarm::new(1);
        assert_eq!(alarm.clear_level(), 1);
        assert_eq!(alarm.observe(2), Some(AlarmChange::Raised));
        assert_eq!(alarm.observe(1), None);
        assert_eq!(alarm.observe(0), Some(AlarmChange::Cleared));
    }
}
