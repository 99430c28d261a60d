//! Busy polling: how long a connection task keeps polling its sockets after its last traffic
//! before it lets its thread sleep in `epoll_wait`.
//!
//! A proxied round trip crosses the proxy several times (publish, delivery, ack, confirm), and
//! each crossing that finds the task asleep pays a thread wake-up and a context switch. On
//! virtual machines waking an idle vCPU costs tens of microseconds, which is most of the
//! latency the proxy adds. With `proxy.busy_poll_us` set, a task that moved traffic less than
//! that long ago yields to the runtime instead of parking, so the runtime polls the sockets
//! without sleeping and the next frame is picked up at once. The price is CPU: the time spent
//! polling counts as the proxy's. 0 (the default) never polls and suits a sidecar whose CPU is
//! scarce; RabbitMQ's own schedulers busy-wait the same way by default.
//!
//! This is the decision only (no I/O); the session loop asks [`BusyPoll::should_poll`] before
//! each wait and reports traffic with [`BusyPoll::traffic`].

use std::time::{Duration, Instant};

/// The busy-poll window of one connection task.
#[derive(Clone, Copy, Debug)]
pub struct BusyPoll {
    window: Duration,
    last_traffic: Instant,
}

impl BusyPoll {
    /// A window of `window` after each traffic; `Duration::ZERO` turns polling off.
    pub fn new(window: Duration, now: Instant) -> Self {
        BusyPoll {
            window,
            last_traffic: now,
        }
    }

    /// A frame was read or bytes were written at `now`.
    pub fn traffic(&mut self, now: Instant) {
        self.last_traffic = now;
    }

    /// Whether the task should poll again rather than sleep.
    pub fn should_poll(&self, now: Instant) -> bool {
        !self.window.is_zero() && now.saturating_duration_since(self.last_traffic) < self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_only_within_the_window_after_traffic() {
        let start = Instant::now();
        let mut poll = BusyPoll::new(Duration::from_micros(100), start);
        assert!(poll.should_poll(start));
        assert!(poll.should_poll(start + Duration::from_micros(99)));
        assert!(!poll.should_poll(start + Duration::from_micros(100)));
        poll.traffic(start + Duration::from_micros(500));
        assert!(poll.should_poll(start + Duration::from_micros(550)));
        assert!(!poll.should_poll(start + Duration::from_millis(1)));
    }

    #[test]
    fn a_zero_window_never_polls() {
        let start = Instant::now();
        let poll = BusyPoll::new(Duration::ZERO, start);
        assert!(!poll.should_poll(start));
    }
}
