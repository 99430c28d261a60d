//! Which upstream node to dial next: the pure bookkeeping behind
//! [`UpstreamPool`](super::UpstreamPool) (no sockets; every call takes `now`).
//!
//! The targets are tried in the order of `upstream.urls`, starting with the last one that
//! worked, so a fleet of proxies stays on one node until it fails. A target whose dial failed
//! is skipped for a backoff (1 s, doubling with each further failure, at most 30 s) while
//! another target is available; when every target is backing off they are all tried anyway,
//! soonest-recovering first, so a client is never refused without a dial.

use std::time::{Duration, Instant};

/// Backoff after a target's first failed dial.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest backoff of a target that keeps failing.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The dial order of `count` targets.
#[derive(Clone, Debug)]
pub struct TargetOrder {
    /// Where the next attempt starts: the last target that worked (or the one after the last
    /// that failed).
    preferred: usize,
    targets: Vec<TargetHealth>,
}

#[derive(Clone, Copy, Debug, Default)]
struct TargetHealth {
    /// Failed dials since the last success.
    failures: u32,
    /// Skipped (while another target is available) until then.
    skip_until: Option<Instant>,
}

impl TargetOrder {
    /// The order of `count` targets (at least one), starting with the first.
    pub fn new(count: usize) -> TargetOrder {
        TargetOrder {
            preferred: 0,
            targets: vec![TargetHealth::default(); count.max(1)],
        }
    }

    /// The targets to dial, in order: from the preferred one round the list, those not
    /// backing off first, then those backing off (soonest back first).
    pub fn attempts(&self, now: Instant) -> Vec<usize> {
        let count = self.targets.len();
        let rotation = (0..count).map(|step| (self.preferred + step) % count);
        let (mut ready, mut waiting): (Vec<usize>, Vec<usize>) =
            rotation.partition(|&index| !self.backing_off(index, now));
        // A stable sort keeps the rotation order among equal deadlines.
        waiting.sort_by_key(|&index| self.targets[index].skip_until);
        ready.append(&mut waiting);
        ready
    }

    /// Whether `index` is skipped at `now` (while another target is available).
    pub fn backing_off(&self, index: usize, now: Instant) -> bool {
        self.targets
            .get(index)
            .and_then(|target| target.skip_until)
            .is_some_and(|until| now < until)
    }

    /// A dial of `index` succeeded: it is where the next attempt starts.
    pub fn succeeded(&mut self, index: usize) {
        if let Some(target) = self.targets.get_mut(index) {
            *target = TargetHealth::default();
            self.preferred = index;
        }
    }

    /// A dial of `index` failed at `now`: it backs off, and if the next attempt would have
    /// started there, it starts at the following target instead.
    pub fn failed(&mut self, index: usize, now: Instant) {
        let count = self.targets.len();
        let Some(target) = self.targets.get_mut(index) else {
            return;
        };
        let backoff = FIRST_BACKOFF
            .saturating_mul(1u32 << target.failures.min(16))
            .min(MAX_BACKOFF);
        target.failures = target.failures.saturating_add(1);
        target.skip_until = Some(now + backoff);
        if self.preferred == index {
            self.preferred = (index + 1) % count;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn starts_with_the_first_and_keeps_the_list_order() {
        let order = TargetOrder::new(3);
        assert_eq!(order.attempts(Instant::now()), vec![0, 1, 2]);
    }

    #[test]
    fn starts_with_the_last_target_that_worked() {
        let now = Instant::now();
        let mut order = TargetOrder::new(3);
        order.succeeded(2);
        assert_eq!(order.attempts(now), vec![2, 0, 1]);
        order.succeeded(1);
        assert_eq!(order.attempts(now), vec![1, 2, 0]);
    }

    #[test]
    fn a_failed_target_is_skipped_for_its_backoff_then_tried_in_turn() {
        let t0 = Instant::now();
        let mut order = TargetOrder::new(3);
        order.failed(0, t0);
        // The next attempt starts after the failed one, which comes last while backing off.
        assert_eq!(order.attempts(t0), vec![1, 2, 0]);
        assert!(order.backing_off(0, t0 + secs(1) - Duration::from_millis(1)));
        assert!(!order.backing_off(0, t0 + secs(1)));
        // Its backoff over, it is back in its place in the rotation (after 1, where the next
        // attempt starts).
        assert_eq!(order.attempts(t0 + secs(1)), vec![1, 2, 0]);
        order.succeeded(2);
        assert_eq!(order.attempts(t0 + secs(1)), vec![2, 0, 1]);
    }

    #[test]
    fn a_failing_preferred_target_moves_the_start_to_the_next() {
        let t0 = Instant::now();
        let mut order = TargetOrder::new(2);
        order.succeeded(1);
        order.failed(1, t0);
        assert_eq!(order.attempts(t0), vec![0, 1]);
        // A failure of a target that is not where attempts start leaves the start alone.
        let mut order = TargetOrder::new(3);
        order.failed(2, t0);
        assert_eq!(order.attempts(t0), vec![0, 1, 2]);
    }

    #[test]
    fn backoff_doubles_up_to_its_ceiling_and_resets_on_success() {
        let t0 = Instant::now();
        let mut order = TargetOrder::new(2);
        let mut expected = Vec::new();
        for _ in 0..8 {
            order.failed(0, t0);
            let until = order.targets[0].skip_until.unwrap();
            expected.push(until - t0);
        }
        assert_eq!(
            expected,
            [1, 2, 4, 8, 16, 30, 30, 30].map(secs).to_vec(),
            "backoff sequence"
        );
        order.succeeded(0);
        assert!(!order.backing_off(0, t0));
        order.failed(0, t0);
        assert_eq!(order.targets[0].skip_until, Some(t0 + FIRST_BACKOFF));
    }

    #[test]
    fn when_every_target_backs_off_all_are_still_tried_soonest_back_first() {
        let t0 = Instant::now();
        let mut order = TargetOrder::new(3);
        order.failed(1, t0); // back at t0+1
        order.failed(2, t0);
        order.failed(2, t0); // back at t0+2
        order.failed(0, t0 + Duration::from_millis(500)); // back at t0+1.5
        assert_eq!(
            order.attempts(t0 + Duration::from_millis(600)),
            vec![1, 0, 2]
        );
        // One recovered: it comes first, the others after it by deadline.
        assert_eq!(
            order.attempts(t0 + Duration::from_millis(1200)),
            vec![1, 0, 2]
        );
        assert_eq!(order.attempts(t0 + secs(3)), vec![1, 2, 0]);
    }

    #[test]
    fn one_target_is_always_tried() {
        let t0 = Instant::now();
        let mut order = TargetOrder::new(1);
        order.failed(0, t0);
        assert_eq!(order.attempts(t0), vec![0]);
        order.succeeded(0);
        assert_eq!(order.attempts(t0), vec![0]);
        // Out-of-range indexes are ignored.
        order.failed(5, t0);
        order.succeeded(5);
        assert_eq!(order.attempts(t0), vec![0]);
    }
}
