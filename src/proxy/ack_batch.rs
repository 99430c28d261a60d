//! Which capture deliveries to acknowledge, and how: contiguous runs of settled deliveries go
//! out as one `basic.ack multiple=true`, so the capture queue (a quorum queue, where each ack
//! is a replicated command) gets one ack per confirmed run instead of one per message.
//!
//! A pure piece of the capture consumer ([`super::capture::CaptureConsumer`]): deliveries are
//! [`delivered`](AckBatch::delivered) in tag order, [`settled`](AckBatch::settled) in any
//! order (once their dead letter is confirmed, dropped or discarded), and
//! [`take`](AckBatch::take) returns the acks to send now:
//! - every settled tag below the lowest unsettled one is covered by one ack of the highest of
//!   them (`multiple=true` when it covers more than one), which is safe because every
//!   delivery below it was settled;
//! - settled tags above an unsettled one (held behind a dead letter the upstream refuses, see
//!   [`super::retry`]) wait for it, but once more than `behind_limit` wait, they are acked one
//!   by one, so one held message never stalls the capture consumer's whole prefetch.
//!
//! At-least-once is kept: a tag is acked only after [`AckBatch::settled`]. All it holds is
//! bounded by the consumer's prefetch (the upstream delivers no more unacked messages).

use std::collections::BTreeSet;

/// One basic.ack to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    pub delivery_tag: u64,
    pub multiple: bool,
}

/// Delivered and settled capture deliveries of one channel epoch.
#[derive(Debug)]
pub struct AckBatch {
    /// Delivered, not settled yet.
    unsettled: BTreeSet<u64>,
    /// Settled, not acked yet.
    ready: BTreeSet<u64>,
    /// How many settled deliveries may wait behind an unsettled one.
    behind_limit: usize,
}

impl AckBatch {
    pub fn new(behind_limit: usize) -> Self {
        AckBatch {
            unsettled: BTreeSet::new(),
            ready: BTreeSet::new(),
            behind_limit: behind_limit.max(1),
        }
    }

    /// A delivery arrived.
    pub fn delivered(&mut self, delivery_tag: u64) {
        self.unsettled.insert(delivery_tag);
    }

    /// A delivery is settled and may be acked. `false` if it was not delivered (or settled
    /// already) in this epoch.
    pub fn settled(&mut self, delivery_tag: u64) -> bool {
        if !self.unsettled.remove(&delivery_tag) {
            return false;
        }
        self.ready.insert(delivery_tag);
        true
    }

    /// A delivery leaves without an ack (requeued by a basic.nack): it no longer blocks a run.
    pub fn forget(&mut self, delivery_tag: u64) -> bool {
        self.unsettled.remove(&delivery_tag)
    }

    /// Deliveries delivered and not acked yet (settled or not).
    pub fn outstanding(&self) -> usize {
        self.unsettled.len() + self.ready.len()
    }

    /// The acks to send now (see the module doc).
    pub fn take(&mut self) -> Vec<Ack> {
        let mut acks = Vec::new();
        let floor = self.unsettled.first().copied();
        let run: BTreeSet<u64> = match floor {
            Some(floor) => {
                let behind = self.ready.split_off(&floor);
                std::mem::replace(&mut self.ready, behind)
            }
            None => std::mem::take(&mut self.ready),
        };
        if let Some(&last) = run.last() {
            acks.push(Ack {
                delivery_tag: last,
                multiple: run.len() > 1,
            });
        }
        if self.ready.len() > self.behind_limit {
            acks.extend(std::mem::take(&mut self.ready).into_iter().map(|tag| Ack {
                delivery_tag: tag,
                multiple: false,
            }));
        }
        acks
    }

    /// Every settled delivery, each with its own ack (shutdown: what waits behind a held
    /// delivery is acked now rather than delivered again after the connection closes).
    pub fn take_each(&mut self) -> Vec<Ack> {
        std::mem::take(&mut self.ready)
            .into_iter()
            .map(|tag| Ack {
                delivery_tag: tag,
                multiple: false,
            })
            .collect()
    }

    /// The channel is gone: everything it held went back to the queue.
    pub fn clear(&mut self) {
        self.unsettled.clear();
        self.ready.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(delivery_tag: u64, multiple: bool) -> Ack {
        Ack {
            delivery_tag,
            multiple,
        }
    }

    #[test]
    fn a_settled_run_is_one_multiple_ack() {
        let mut b = AckBatch::new(8);
        for tag in 1..=5 {
            b.delivered(tag);
        }
        // Settled out of order: nothing below 1 is settled until 1 is.
        assert!(b.settled(3));
        assert!(b.settled(2));
        assert_eq!(b.take(), vec![]);
        assert!(b.settled(1));
        assert_eq!(b.take(), vec![ack(3, true)]);
        assert_eq!(b.outstanding(), 2);
        assert!(b.settled(5));
        assert_eq!(b.take(), vec![]);
        assert!(b.settled(4));
        assert_eq!(b.take(), vec![ack(5, true)]);
        assert_eq!(b.outstanding(), 0);
        assert_eq!(b.take(), vec![]);
    }

    #[test]
    fn a_lone_settled_delivery_is_a_single_ack() {
        let mut b = AckBatch::new(8);
        b.delivered(7);
        b.settled(7);
        assert_eq!(b.take(), vec![ack(7, false)]);
    }

    #[test]
    fn unknown_and_repeated_settles_are_refused() {
        let mut b = AckBatch::new(8);
        b.delivered(1);
        assert!(!b.settled(2));
        assert!(b.settled(1));
        assert!(!b.settled(1));
        assert_eq!(b.take(), vec![ack(1, false)]);
        assert!(!b.settled(1), "acked already");
    }

    #[test]
    fn a_held_delivery_delays_those_behind_it_only_up_to_the_limit() {
        let mut b = AckBatch::new(3);
        for tag in 1..=6 {
            b.delivered(tag);
        }
        // 1 is held (its dead letter refused); 2.. are confirmed.
        for tag in 2..=4 {
            b.settled(tag);
        }
        assert_eq!(b.take(), vec![], "3 wait behind 1: at the limit");
        b.settled(5);
        assert_eq!(
            b.take(),
            vec![ack(2, false), ack(3, false), ack(4, false), ack(5, false)]
        );
        // The held one is confirmed at last: it and 6 go out as one run.
        b.settled(6);
        b.settled(1);
        let acks = b.take();
        // 1 and 6 are not contiguous runs of unacked tags, but every tag up to 6 is settled
        // (2..5 acked already), so one multiple ack of 6 covers exactly 1 and 6.
        assert_eq!(acks, vec![ack(6, true)]);
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn at_shutdown_those_behind_a_held_delivery_are_acked_one_by_one() {
        let mut b = AckBatch::new(8);
        for tag in 1..=3 {
            b.delivered(tag);
        }
        b.settled(2);
        b.settled(3);
        assert_eq!(b.take(), vec![]);
        assert_eq!(b.take_each(), vec![ack(2, false), ack(3, false)]);
        // The held one stays unacked (the upstream requeues it with the connection).
        assert_eq!(b.outstanding(), 1);
        assert_eq!(b.take(), vec![]);
    }

    #[test]
    fn a_requeued_delivery_does_not_block_the_run() {
        let mut b = AckBatch::new(8);
        for tag in 1..=3 {
            b.delivered(tag);
        }
        b.settled(1);
        assert!(b.forget(2));
        b.settled(3);
        assert_eq!(b.take(), vec![ack(3, true)]);
    }

    #[test]
    fn clearing_forgets_the_epoch() {
        let mut b = AckBatch::new(8);
        b.delivered(1);
        b.delivered(2);
        b.settled(2);
        b.clear();
        assert_eq!(b.outstanding(), 0);
        assert_eq!(b.take(), vec![]);
        assert!(!b.settled(1));
    }
}
