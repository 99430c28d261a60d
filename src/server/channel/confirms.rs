//! The publisher confirms of one channel in confirm mode, and the frames that tell them.
//!
//! Each publish gets a sequence number and is either settled at once (a transient publish is
//! acked when routed, nacked when a queue refused it) or waits for storage (a persistent one
//! is acked once its record is on stable storage, nacked when it could not be written). A
//! group commit makes hundreds of waiting publishes stable at once; writing one `basic.ack`
//! per message cost a write per message, so the [`ConfirmTracker`] records every publish and
//! yields the confirms that may be told now, coalesced: the longest run of acked publishes in
//! sequence order becomes ONE `basic.ack` (`multiple = true` when it covers more than one
//! publish), and every nack is its own `basic.nack` (never folded into a multiple ack, which
//! would tell the client it was stored).
//!
//! Confirms are told strictly in sequence order: a publish settled while an earlier one still
//! waits for storage is held until that one is settled. Transient publishes on the same channel
//! go through the same tracker, so a `multiple` ack can never cover a publish whose outcome is
//! not known yet (at most one group commit of delay for a transient publish queued behind a
//! persistent one). When nothing waits, a publish settled at once is told at once, as one
//! single ack or nack, as before.
//!
//! Not [`crate::proxy::ack_batch`]: that one batches a consumer's acks, where a delivery
//! leaves without a nack; here a nack must be told, in order, and never covered by an ack.
//!
//! Pure logic, no sockets: the channel handler records publishes
//! ([`super::content`]), and the channel's completion task
//! ([`super::confirm_task`]) settles the persistent ones as storage answers; both then
//! write what [`ConfirmTracker::take_ready`] yields.

use std::collections::VecDeque;

/// One confirm frame to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfirmFrame {
    /// `basic.ack`: `tag` alone, or every unconfirmed publish up to `tag` when `multiple`.
    Ack { tag: u64, multiple: bool },
    /// `basic.nack` of `tag` alone.
    Nack { tag: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Waits for storage.
    Pending,
    Ack,
    Nack,
}

/// The unconfirmed publishes of one channel, oldest first (sequence numbers increase).
#[derive(Debug, Default)]
pub struct ConfirmTracker {
    unconfirmed: VecDeque<(u64, Outcome)>,
}

impl ConfirmTracker {
    /// Publishes recorded and not yet told to the client.
    #[cfg(test)]
    fn unconfirmed(&self) -> usize {
        self.unconfirmed.len()
    }

    /// Records publish `seq` as waiting for storage. Sequence numbers must increase.
    pub fn pending(&mut self, seq: u64) {
        self.record(seq, Outcome::Pending);
    }

    /// Records publish `seq` as already settled: acked when `ok`, nacked otherwise.
    pub fn settled(&mut self, seq: u64, ok: bool) {
        self.record(seq, if ok { Outcome::Ack } else { Outcome::Nack });
    }

    fn record(&mut self, seq: u64, outcome: Outcome) {
        debug_assert!(self.unconfirmed.back().is_none_or(|(last, _)| *last < seq));
        self.unconfirmed.push_back((seq, outcome));
    }

    /// Settles waiting publish `seq`: stored (`ok`) or not. A seq not waiting is ignored.
    pub fn complete(&mut self, seq: u64, ok: bool) {
        if let Ok(i) = self.unconfirmed.binary_search_by_key(&seq, |(s, _)| *s)
            && let Some(entry) = self.unconfirmed.get_mut(i)
            && entry.1 == Outcome::Pending
        {
            entry.1 = if ok { Outcome::Ack } else { Outcome::Nack };
        }
    }

    /// Removes the settled publishes at the front and appends the frames that tell them to
    /// `out`: each run of acks as one ack (multiple when longer than one), each nack alone.
    pub fn take_ready(&mut self, out: &mut Vec<ConfirmFrame>) {
        let mut run: Option<(u64, usize)> = None; // last acked seq, run length
        let flush = |run: &mut Option<(u64, usize)>, out: &mut Vec<ConfirmFrame>| {
            if let Some((tag, len)) = run.take() {
                out.push(ConfirmFrame::Ack {
                    tag,
                    multiple: len > 1,
                });
            }
        };
        while let Some(&(seq, outcome)) = self.unconfirmed.front() {
            match outcome {
                Outcome::Pending => break,
                Outcome::Ack => {
                    run = Some((seq, run.map_or(1, |(_, len)| len + 1)));
                }
                Outcome::Nack => {
                    flush(&mut run, out);
                    out.push(ConfirmFrame::Nack { tag: seq });
                }
            }
            self.unconfirmed.pop_front();
        }
        flush(&mut run, out);
    }

    /// Forgets everything (the channel closed: nothing more is told).
    pub fn clear(&mut self) {
        self.unconfirmed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::ConfirmFrame::{Ack, Nack};
    use super::*;

    fn ready(t: &mut ConfirmTracker) -> Vec<ConfirmFrame> {
        let mut out = Vec::new();
        t.take_ready(&mut out);
        out
    }

    #[test]
    fn a_publish_settled_at_once_is_told_alone() {
        let mut t = ConfirmTracker::default();
        t.settled(1, true);
        assert_eq!(
            ready(&mut t),
            vec![Ack {
                tag: 1,
                multiple: false
            }]
        );
        t.settled(2, false);
        assert_eq!(ready(&mut t), vec![Nack { tag: 2 }]);
        assert_eq!(t.unconfirmed(), 0);
        assert_eq!(ready(&mut t), vec![]);
    }

    #[test]
    fn a_stored_contiguous_prefix_is_one_multiple_ack() {
        let mut t = ConfirmTracker::default();
        for seq in 1..=5 {
            t.pending(seq);
        }
        assert_eq!(ready(&mut t), vec![], "nothing stored yet");
        for seq in 1..=3 {
            t.complete(seq, true);
        }
        assert_eq!(
            ready(&mut t),
            vec![Ack {
                tag: 3,
                multiple: true
            }]
        );
        assert_eq!(t.unconfirmed(), 2, "4 and 5 still wait");
        t.complete(4, true);
        assert_eq!(
            ready(&mut t),
            vec![Ack {
                tag: 4,
                multiple: false
            }],
            "a run of one is a single ack"
        );
    }

    #[test]
    fn a_nack_in_the_middle_splits_the_run_and_is_told_alone() {
        let mut t = ConfirmTracker::default();
        for seq in 1..=6 {
            t.pending(seq);
        }
        t.complete(1, true);
        t.complete(2, true);
        t.complete(3, false);
        t.complete(4, true);
        t.complete(5, true);
        t.complete(6, false);
        assert_eq!(
            ready(&mut t),
            vec![
                Ack {
                    tag: 2,
                    multiple: true
                },
                Nack { tag: 3 },
                Ack {
                    tag: 5,
                    multiple: true
                },
                Nack { tag: 6 },
            ]
        );
        assert_eq!(t.unconfirmed(), 0);
    }

    #[test]
    fn completions_out_of_order_wait_for_the_earliest_pending() {
        let mut t = ConfirmTracker::default();
        for seq in 1..=4 {
            t.pending(seq);
        }
        t.complete(4, true);
        t.complete(2, true);
        assert_eq!(
            ready(&mut t),
            vec![],
            "1 still waits: nothing after it is told"
        );
        t.complete(3, false);
        assert_eq!(ready(&mut t), vec![]);
        t.complete(1, true);
        assert_eq!(
            ready(&mut t),
            vec![
                Ack {
                    tag: 2,
                    multiple: true
                },
                Nack { tag: 3 },
                Ack {
                    tag: 4,
                    multiple: false
                },
            ]
        );
    }

    #[test]
    fn transient_publishes_behind_a_pending_one_wait_and_join_its_ack() {
        let mut t = ConfirmTracker::default();
        t.pending(1);
        t.settled(2, true);
        t.settled(3, false);
        t.settled(4, true);
        assert_eq!(ready(&mut t), vec![], "the pending one holds the rest");
        t.complete(1, true);
        assert_eq!(
            ready(&mut t),
            vec![
                Ack {
                    tag: 2,
                    multiple: true
                },
                Nack { tag: 3 },
                Ack {
                    tag: 4,
                    multiple: false
                },
            ]
        );
    }

    #[test]
    fn a_pending_publish_is_never_folded_into_a_multiple_ack() {
        let mut t = ConfirmTracker::default();
        t.settled(1, true);
        t.settled(2, true);
        t.pending(3);
        t.settled(4, true);
        assert_eq!(
            ready(&mut t),
            vec![Ack {
                tag: 2,
                multiple: true
            }]
        );
        assert_eq!(t.unconfirmed(), 2);
    }

    #[test]
    fn unknown_or_repeated_completions_are_ignored() {
        let mut t = ConfirmTracker::default();
        t.pending(5);
        t.complete(4, true);
        t.complete(9, true);
        assert_eq!(ready(&mut t), vec![]);
        t.complete(5, false);
        t.complete(5, true);
        assert_eq!(ready(&mut t), vec![Nack { tag: 5 }]);
    }

    #[test]
    fn gaps_in_sequence_numbers_keep_their_order() {
        let mut t = ConfirmTracker::default();
        t.pending(2);
        t.pending(7);
        t.complete(7, true);
        t.complete(2, true);
        assert_eq!(
            ready(&mut t),
            vec![Ack {
                tag: 7,
                multiple: true
            }]
        );
        t.clear();
        assert_eq!(t.unconfirmed(), 0);
    }
}
