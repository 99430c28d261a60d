//! Held dead letters: a publish of the proxy that the upstream refused (nacked, not confirmed
//! in time, lost with the proxy's channel) is not given back to its queue, where it would be
//! delivered again at once and refused again (a hot loop). The original stays unacked upstream,
//! held by the proxy, and the same publish is retried after a backoff until it is confirmed.
//! The same holds for the republish of a requeue counted against a delivery limit.
//!
//! Pure pieces, no sockets, time passed in:
//! - [`Backoff`]: the delay before each retry, exponential from `proxy.retry_initial_ms`
//!   doubling to `proxy.retry_max_ms`, with jitter (uniform in the upper half of the delay, so
//!   connections refused at once do not retry in step);
//! - [`RetryReason`]: why a publish is retried (the label of
//!   `dead_letter_retries_total{reason}`), read from the publisher's [`Outcome`];
//! - [`RetrySchedule`]: what waits for its retry, by due time.
//!
//! The session keeps the accounting: a held message is charged against the connection's
//! inflight bound (`proxy.max_inflight_bytes`, `inflight_deliveries`) and counted in
//! `dead_letters_held` from its first refusal until it is confirmed or given up (the
//! connection or channel goes away and the upstream requeues the original).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::publisher::Outcome;

/// Why a publish is retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// basic.nack (a target queue at its length limit with `reject-publish`, ...).
    Nacked,
    /// No confirm within `proxy.confirm_timeout_secs`.
    Timeout,
    /// The proxy's channel closed before the confirm (the broker discarded the publish).
    ChannelLost,
    /// The client's user may not publish to the dead-letter exchange (403 on the proxy's
    /// channel). RabbitMQ dead-letters without checking permissions, so the message is kept
    /// until an operator grants them.
    AccessRefused,
    /// A message for a retry tier's delay queue routed nowhere (the queue was deleted): the
    /// next publish declares it again.
    Unroutable,
}

impl RetryReason {
    /// The metric label (one of [`crate::metrics::RETRY_REASONS`]).
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::Nacked => "nacked",
            RetryReason::Timeout => "timeout",
            RetryReason::ChannelLost => "channel_lost",
            RetryReason::AccessRefused => "access_refused",
            RetryReason::Unroutable => "unroutable",
        }
    }

    /// The cause a refusal is counted under in `dead_letter_publish_failures_total`.
    pub fn failure_cause(self, outcome: &Outcome) -> &'static str {
        match outcome {
            Outcome::Failed(cause) => cause,
            Outcome::TimedOut => "timeout",
            _ => self.as_str(),
        }
    }

    /// Why this outcome is retried; `None` for outcomes that end the publish (confirmed, or
    /// dropped as RabbitMQ drops: unroutable, missing exchange).
    pub fn of(outcome: &Outcome) -> Option<RetryReason> {
        match outcome {
            Outcome::Confirmed | Outcome::Unroutable | Outcome::ExchangeMissing => None,
            Outcome::TimedOut => Some(RetryReason::Timeout),
            Outcome::AccessRefused => Some(RetryReason::AccessRefused),
            Outcome::Failed(cause) if *cause == super::publisher::NACKED => {
                Some(RetryReason::Nacked)
            }
            Outcome::Failed(cause) if *cause == super::publisher::UNPUBLISHABLE => None,
            Outcome::Failed(_) => Some(RetryReason::ChannelLost),
        }
    }
}

/// The retry delays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
}

impl Backoff {
    /// Delays from `initial` doubling up to `max` (`max` below `initial` is raised to it).
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(1));
        Backoff {
            initial,
            max: max.max(initial),
        }
    }

    /// The delay before retry number `attempt` (1 after the first refusal): the nominal delay
    /// `d = min(initial * 2^(attempt-1), max)` scaled into `[d/2, d]` by `sample` (in [0, 1);
    /// values outside are clamped).
    pub fn delay(&self, attempt: u32, sample: f64) -> Duration {
        let doublings = attempt.saturating_sub(1).min(32);
        let nominal = self
            .initial
            .checked_mul(1u32 << doublings.min(31))
            .unwrap_or(self.max)
            .min(self.max);
        let sample = if sample.is_finite() {
            sample.clamp(0.0, 1.0)
        } else {
            0.0
        };
        nominal.mul_f64(0.5 + 0.5 * sample)
    }
}

/// Messages waiting for their retry, by due time (ties in the order they were scheduled).
#[derive(Debug)]
pub struct RetrySchedule<T> {
    backoff: Backoff,
    waiting: BTreeMap<(Instant, u64), T>,
    seq: u64,
}

impl<T> RetrySchedule<T> {
    pub fn new(backoff: Backoff) -> Self {
        RetrySchedule {
            backoff,
            waiting: BTreeMap::new(),
            seq: 0,
        }
    }

    /// Schedules retry number `attempt` of `item`; returns when it is due.
    pub fn schedule(&mut self, now: Instant, attempt: u32, sample: f64, item: T) -> Instant {
        let due = now + self.backoff.delay(attempt, sample);
        self.seq += 1;
        self.waiting.insert((due, self.seq), item);
        due
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// When the next retry is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.keys().next().map(|(at, _)| *at)
    }

    /// The items due at `now`, earliest first.
    pub fn take_due(&mut self, now: Instant) -> Vec<T> {
        let later = self.waiting.split_off(&(now, u64::MAX));
        std::mem::replace(&mut self.waiting, later)
            .into_values()
            .collect()
    }

    /// Removes and returns the items `gone` selects (their channel or connection went away).
    pub fn take_where(&mut self, mut gone: impl FnMut(&T) -> bool) -> Vec<T> {
        let keys: Vec<(Instant, u64)> = self
            .waiting
            .iter()
            .filter(|(_, item)| gone(item))
            .map(|(key, _)| *key)
            .collect();
        keys.into_iter()
            .filter_map(|key| self.waiting.remove(&key))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delays_double_up_to_the_cap() {
        let b = Backoff::new(ms(100), ms(5000));
        let top: Vec<u64> = (1..=9)
            .map(|a| b.delay(a, 1.0).as_millis() as u64)
            .collect();
        assert_eq!(top, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(b.delay(u32::MAX, 1.0), ms(5000));
        assert_eq!(b.delay(0, 1.0), ms(100));
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        let b = Backoff::new(ms(100), ms(5000));
        assert_eq!(b.delay(3, 0.0), ms(200));
        assert_eq!(b.delay(3, 0.5), ms(300));
        assert_eq!(b.delay(3, 2.0), ms(400));
        assert_eq!(b.delay(3, -1.0), ms(200));
        assert_eq!(b.delay(3, f64::NAN), ms(200));
        assert_eq!(b.delay(20, 0.0), ms(2500));
    }

    #[test]
    fn a_cap_below_the_start_is_raised() {
        let b = Backoff::new(ms(300), ms(100));
        assert_eq!(b.delay(5, 1.0), ms(300));
        let b = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(b.delay(1, 1.0), ms(1));
    }

    #[test]
    fn items_come_due_in_order() {
        let mut s = RetrySchedule::new(Backoff::new(ms(100), ms(5000)));
        let now = Instant::now();
        assert_eq!(s.schedule(now, 2, 1.0, "b"), now + ms(200));
        assert_eq!(s.schedule(now, 1, 1.0, "a"), now + ms(100));
        s.schedule(now, 1, 1.0, "a2");
        assert_eq!(s.next_deadline(), Some(now + ms(100)));
        assert!(s.take_due(now + ms(99)).is_empty());
        assert_eq!(s.take_due(now + ms(100)), vec!["a", "a2"]);
        assert_eq!(s.len(), 1);
        assert_eq!(s.take_due(now + ms(10_000)), vec!["b"]);
        assert!(s.is_empty());
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn items_of_a_closed_channel_are_taken_out() {
        let mut s = RetrySchedule::new(Backoff::new(ms(100), ms(5000)));
        let now = Instant::now();
        for (i, channel) in [1u16, 2, 1, 3].into_iter().enumerate() {
            s.schedule(now, i as u32 + 1, 0.0, channel);
        }
        let mut gone = s.take_where(|c| *c == 1);
        gone.sort();
        assert_eq!(gone, vec![1, 1]);
        assert_eq!(s.take_due(now + ms(10_000)), vec![2, 3]);
    }

    #[test]
    fn outcomes_map_to_reasons() {
        use super::super::publisher::{NACKED, UNPUBLISHABLE};
        assert_eq!(RetryReason::of(&Outcome::Confirmed), None);
        // A publish the service connection could not encode fails the same way every time.
        assert_eq!(RetryReason::of(&Outcome::Failed(UNPUBLISHABLE)), None);
        assert_eq!(RetryReason::of(&Outcome::Unroutable), None);
        assert_eq!(RetryReason::of(&Outcome::ExchangeMissing), None);
        assert_eq!(
            RetryReason::of(&Outcome::Failed(NACKED)),
            Some(RetryReason::Nacked)
        );
        assert_eq!(
            RetryReason::of(&Outcome::Failed("channel closed")),
            Some(RetryReason::ChannelLost)
        );
        assert_eq!(
            RetryReason::of(&Outcome::TimedOut),
            Some(RetryReason::Timeout)
        );
        assert_eq!(
            RetryReason::of(&Outcome::AccessRefused),
            Some(RetryReason::AccessRefused)
        );
        // Every reason is exported (at 0 from the start).
        let labels = [
            RetryReason::Nacked,
            RetryReason::Timeout,
            RetryReason::ChannelLost,
            RetryReason::AccessRefused,
            RetryReason::Unroutable,
        ]
        .map(RetryReason::as_str);
        assert_eq!(labels.as_slice(), crate::metrics::RETRY_REASONS);
    }
}
