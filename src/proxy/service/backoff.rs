//! When a lost service connection tries again: exponential backoff with jitter, pure (the
//! caller supplies the random number), so every instance of a fleet does not reconnect to the
//! surviving nodes in the same instant.

use std::time::Duration;

/// The first delay.
pub const BASE: Duration = Duration::from_millis(100);
/// The longest delay.
pub const CAP: Duration = Duration::from_secs(5);

/// Consecutive failed attempts and the delay before the next one.
#[derive(Clone, Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    pub fn new() -> Self {
        Backoff::default()
    }

    /// The delay before the next attempt, `jitter` in [0, 1): half the exponential delay
    /// (`BASE · 2^failures`, at most [`CAP`]) plus up to the other half at random.
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        let exponential = BASE.saturating_mul(1u32 << self.failures.min(16)).min(CAP);
        self.failures = self.failures.saturating_add(1);
        let half = exponential / 2;
        half + half.mul_f64(jitter.clamp(0.0, 1.0))
    }

    /// The connection worked: the next loss starts from [`BASE`] again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new();
        assert_eq!(b.next_delay(0.0), Duration::from_millis(50));
        assert_eq!(b.next_delay(0.0), Duration::from_millis(100));
        let third = b.next_delay(0.999);
        assert!(third >= Duration::from_millis(399) && third < Duration::from_millis(400));
        for _ in 0..40 {
            let d = b.next_delay(0.5);
            assert!(d <= CAP, "{d:?}");
        }
        assert_eq!(b.next_delay(0.0), CAP / 2);
        assert_eq!(b.next_delay(1.0), CAP);
        b.reset();
        assert_eq!(b.next_delay(1.0), BASE);
    }
}
