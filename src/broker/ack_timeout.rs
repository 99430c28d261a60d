//! Consumer timeouts (embedded mode): when an unacknowledged delivery of a channel has been
//! held too long, as RabbitMQ's `consumer_timeout` / `x-consumer-timeout` do.
//!
//! Pure bookkeeping, no clock: each channel keeps the deadline of every delivery that has a
//! timeout ([`AckDeadlines`]), the broker asks [`AckDeadlines::due`] with `now`, and the
//! connection task closes a channel that is due with [`timeout_error`] (406, RabbitMQ's text),
//! which requeues its deliveries counting each as a delivery attempt. The timeout of a delivery
//! is fixed when it is delivered: the lower of `limits.consumer_timeout` and its queue's
//! setting ([`delivery_timeout`]).

use std::collections::BTreeSet;

use crate::amqp::reply::AmqpError;

/// When one delivery times out, and the timeout that gave that deadline (for the reply text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub at: u64,
    pub timeout: u64,
}

/// The deadlines of one channel's unacknowledged deliveries that have a timeout.
#[derive(Debug, Default)]
pub struct AckDeadlines {
    /// (deadline, delivery tag, timeout): the earliest first.
    by_deadline: BTreeSet<(u64, u64, u64)>,
}

impl AckDeadlines {
    /// Records delivery `tag`, delivered at `now` with `timeout` ms; returns its deadline.
    pub fn insert(&mut self, tag: u64, now: u64, timeout: u64) -> Deadline {
        let deadline = Deadline {
            at: now.saturating_add(timeout),
            timeout,
        };
        self.by_deadline.insert((deadline.at, tag, timeout));
        deadline
    }

    /// Delivery `tag` was settled (or left the channel otherwise).
    pub fn remove(&mut self, tag: u64, deadline: Deadline) {
        self.by_deadline
            .remove(&(deadline.at, tag, deadline.timeout));
    }

    /// The earliest deadline, if any delivery has one.
    pub fn earliest(&self) -> Option<u64> {
        self.by_deadline.first().map(|(at, _, _)| *at)
    }

    /// The earliest delivery whose deadline has passed at `now`, as (delivery tag, timeout):
    /// the channel must be closed.
    pub fn due(&self, now: u64) -> Option<(u64, u64)> {
        self.by_deadline
            .first()
            .filter(|(at, _, _)| *at <= now)
            .map(|(_, tag, timeout)| (*tag, *timeout))
    }

    pub fn len(&self) -> usize {
        self.by_deadline.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_deadline.is_empty()
    }
}

/// The timeout of a delivery from a queue with `queue_timeout` (the lower of its argument and
/// policy) under `limits.consumer_timeout` = `configured`: the lower of the two.
pub fn delivery_timeout(configured: Option<u64>, queue_timeout: Option<u64>) -> Option<u64> {
    crate::policy::lower(queue_timeout, configured)
}

/// The channel.close RabbitMQ sends when a delivery on `channel` was not acknowledged within
/// `timeout` ms (rabbit_channel, 3.8.15+): 406, class and method 0.
pub fn timeout_error(channel: u16, timeout: u64) -> AmqpError {
    AmqpError::precondition(format!(
        "delivery acknowledgement on channel {channel} timed out. Timeout value used: {timeout} ms. This timeout value can be configured, see consumers doc guide to learn more"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_earliest_deadline_decides_and_settling_removes_it() {
        let mut d = AckDeadlines::default();
        let first = d.insert(1, 0, 1000);
        let second = d.insert(2, 100, 300);
        assert_eq!(d.earliest(), Some(400));
        assert_eq!(d.due(399), None);
        assert_eq!(d.due(400), Some((2, 300)));
        d.remove(2, second);
        assert_eq!(d.due(400), None);
        assert_eq!(d.due(1000), Some((1, 1000)));
        d.remove(1, first);
        assert!(d.is_empty());
        assert_eq!(d.earliest(), None);
    }

    #[test]
    fn the_lower_timeout_wins() {
        assert_eq!(delivery_timeout(None, None), None);
        assert_eq!(delivery_timeout(Some(5000), None), Some(5000));
        assert_eq!(delivery_timeout(None, Some(700)), Some(700));
        assert_eq!(delivery_timeout(Some(5000), Some(700)), Some(700));
        assert_eq!(delivery_timeout(Some(300), Some(700)), Some(300));
    }

    #[test]
    fn the_error_is_rabbitmqs() {
        let err = timeout_error(3, 1500);
        assert_eq!(err.code, 406);
        assert_eq!((err.class_id, err.method_id), (0, 0));
        assert_eq!(
            err.text,
            "PRECONDITION_FAILED - delivery acknowledgement on channel 3 timed out. Timeout value used: 1500 ms. This timeout value can be configured, see consumers doc guide to learn more"
        );
    }

    #[test]
    fn a_huge_timeout_does_not_overflow() {
        let mut d = AckDeadlines::default();
        d.insert(1, 10, u64::MAX);
        assert_eq!(d.due(u64::MAX - 1), None);
    }
}
