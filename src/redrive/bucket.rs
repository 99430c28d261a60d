//! The redrive rate limit: a token bucket, pure (the caller passes `now`).
//!
//! `rate` tokens are added per second up to `burst`; each moved message takes one. The bucket
//! starts with one token, so a job at R/s moves N messages in at least (N − 1)/R seconds
//! whatever its batch size, and a batch never takes more than the tokens there are. Tokens a
//! batch was granted but did not use (messages it skipped or could not move) are given back.

use std::time::{Duration, Instant};

/// The longest [`TokenBucket::wait`]: a token's time at the lowest accepted rate
/// ([`MIN_RATE`](super::jobs::MIN_RATE)).
pub const LONGEST_WAIT: Duration = Duration::from_secs(1000);

/// A token bucket over [`Instant`]s the caller supplies.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// `rate` tokens per second (> 0), at most `burst` (≥ 1) saved up; one token at `now`.
    pub fn new(rate: f64, burst: u64, now: Instant) -> TokenBucket {
        TokenBucket {
            rate: rate.max(f64::MIN_POSITIVE),
            burst: burst.max(1) as f64,
            tokens: 1.0,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = self.at.max(now);
    }

    /// Takes up to `want` whole tokens; returns how many were granted (0 when empty).
    pub fn take(&mut self, want: u64, now: Instant) -> u64 {
        self.refill(now);
        let granted = (self.tokens.floor() as u64).min(want);
        self.tokens -= granted as f64;
        granted
    }

    /// Gives back `unused` tokens of a grant (capped at the burst).
    pub fn give_back(&mut self, unused: u64) {
        self.tokens = (self.tokens + unused as f64).min(self.burst);
    }

    /// How long until one whole token is there (zero if one is).
    pub fn wait(&mut self, now: Instant) -> Duration {
        self.refill(now);
        if self.tokens >= 1.0 {
            return Duration::ZERO;
        }
        // Capped: a rate the job table refuses (below MIN_RATE) must not overflow a timer.
        Duration::try_from_secs_f64((1.0 - self.tokens) / self.rate)
            .unwrap_or(LONGEST_WAIT)
            .min(LONGEST_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_come_at_the_rate_up_to_the_burst() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(100.0, 10, start);
        assert_eq!(bucket.take(5, start), 1, "one token at the start");
        assert_eq!(bucket.take(5, start), 0);
        assert_eq!(bucket.wait(start), Duration::from_millis(10));
        // A rate below what the job table accepts waits at most the longest wait, and the
        // deadline fits an Instant.
        let mut slow = TokenBucket::new(1e-300, 1, start);
        assert_eq!(slow.take(1, start), 1);
        assert_eq!(slow.wait(start), LONGEST_WAIT);
        assert!(start.checked_add(slow.wait(start)).is_some());
        let later = start + Duration::from_millis(50);
        assert_eq!(bucket.take(100, later), 5);
        assert_eq!(bucket.wait(later), Duration::from_millis(10));
        // A long pause saves up no more than the burst.
        let much_later = later + Duration::from_secs(60);
        assert_eq!(bucket.take(100, much_later), 10);
        bucket.give_back(3);
        assert_eq!(bucket.take(100, much_later), 3);
        bucket.give_back(100);
        assert_eq!(
            bucket.take(100, much_later),
            10,
            "given back up to the burst"
        );
    }

    #[test]
    fn n_messages_take_n_minus_one_over_rate_seconds() {
        // Whatever the grant size, 101 tokens at 50/s span at least 2 s.
        for want in [1, 7, 64, 1000] {
            let start = Instant::now();
            let mut bucket = TokenBucket::new(50.0, 25, start);
            let mut now = start;
            let mut taken = 0;
            while taken < 101 {
                let got = bucket.take(want.min(101 - taken), now);
                taken += got;
                if got == 0 {
                    now += bucket.wait(now);
                }
            }
            assert!(
                now - start >= Duration::from_secs(2),
                "{want}: {:?}",
                now - start
            );
            assert!(
                now - start < Duration::from_millis(2050),
                "{want}: {:?}",
                now - start
            );
        }
    }

    #[test]
    fn time_going_backwards_adds_nothing() {
        let start = Instant::now() + Duration::from_secs(1);
        let mut bucket = TokenBucket::new(10.0, 10, start);
        assert_eq!(bucket.take(1, start), 1);
        assert_eq!(bucket.take(1, start - Duration::from_secs(1)), 0);
    }
}
