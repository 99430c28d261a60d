//! The retry hold of one queue (retry tiers, `x-retry-delays`): messages rejected with
//! requeue=false that wait for their tier's delay before going back to the tail of their queue.
//!
//! Pure: no clock, no I/O. The hold is ordered by (due time, arrival), so messages come back in
//! deadline order whatever their delays (a short delay given later overtakes a long one given
//! earlier: no head-of-line blocking), and the queue needs one timer deadline for all of them,
//! [`RetryHold::next_due`], which the broker's timer heap carries with the queue's expiry
//! (`Queue::next_deadline`). What a held message looks like is decided by
//! [`crate::deadletter::retry`]; moving it back into the queue is the broker's job
//! (`broker::methods::retry`).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::message::Message;

/// A message waiting for its retry delay.
#[derive(Clone, Debug)]
pub struct HeldMessage {
    /// The message as it comes back (rewritten `x-retry-count` and x-death; exchange "" and
    /// the queue's name as routing key).
    pub message: Arc<Message>,
    /// Its message id in storage while held, when it is kept on disk.
    pub store_id: Option<u64>,
}

/// The held messages of one queue, by due time.
#[derive(Debug, Default)]
pub struct RetryHold {
    held: BTreeMap<(u64, u64), HeldMessage>,
    next_seq: u64,
    bytes: u64,
}

impl RetryHold {
    /// Holds `message` until broker time `due`.
    pub fn hold(&mut self, due: u64, message: HeldMessage) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += message.message.body_len();
        self.held.insert((due, seq), message);
    }

    /// When the earliest held message is due.
    pub fn next_due(&self) -> Option<u64> {
        self.held.keys().next().map(|(due, _)| *due)
    }

    /// Takes every message due at `now`, earliest deadline first (equal deadlines in the
    /// order they were held).
    pub fn take_due(&mut self, now: u64) -> Vec<HeldMessage> {
        let due = match now.checked_add(1) {
            Some(after) => {
                let later = self.held.split_off(&(after, 0));
                std::mem::replace(&mut self.held, later)
            }
            None => std::mem::take(&mut self.held),
        };
        let out: Vec<HeldMessage> = due.into_values().collect();
        self.bytes -= out.iter().map(|m| m.message.body_len()).sum::<u64>();
        out
    }

    /// Takes every held message (queue.purge): they are dropped, not returned.
    pub fn take_all(&mut self) -> Vec<HeldMessage> {
        self.bytes = 0;
        std::mem::take(&mut self.held).into_values().collect()
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Body bytes of the held messages.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The held messages in deadline order, with their due times.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &HeldMessage)> {
        self.held.iter().map(|((due, _), m)| (*due, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(body: &str) -> HeldMessage {
        HeldMessage {
            message: Arc::new(Message::new(
                "",
                &["q"],
                &[0, 0],
                body.as_bytes(),
                None,
                true,
            )),
            store_id: None,
        }
    }

    fn bodies(list: &[HeldMessage]) -> Vec<&[u8]> {
        list.iter().map(|m| m.message.body()).collect()
    }

    #[test]
    fn messages_come_back_in_deadline_order_not_arrival_order() {
        let mut hold = RetryHold::default();
        hold.hold(1_600, held("long"));
        hold.hold(1_200, held("short"));
        hold.hold(1_200, held("short-2"));
        assert_eq!((hold.len(), hold.bytes()), (3, 16));
        assert_eq!(hold.next_due(), Some(1_200));
        assert!(hold.take_due(1_199).is_empty());
        assert_eq!(
            bodies(&hold.take_due(1_200)),
            vec![&b"short"[..], &b"short-2"[..]]
        );
        assert_eq!(
            (hold.len(), hold.bytes(), hold.next_due()),
            (1, 4, Some(1_600))
        );
        assert_eq!(bodies(&hold.take_due(5_000)), vec![&b"long"[..]]);
        assert!(hold.is_empty());
        assert_eq!((hold.bytes(), hold.next_due()), (0, None));
    }

    #[test]
    fn a_due_time_at_the_end_of_time_is_still_taken() {
        let mut hold = RetryHold::default();
        hold.hold(u64::MAX, held("x"));
        assert!(hold.take_due(u64::MAX - 1).is_empty());
        assert_eq!(hold.take_due(u64::MAX).len(), 1);
    }

    #[test]
    fn purge_takes_everything_and_resets_the_bytes() {
        let mut hold = RetryHold::default();
        hold.hold(10, held("ab"));
        hold.hold(5, held("c"));
        let order: Vec<u64> = hold.iter().map(|(due, _)| due).collect();
        assert_eq!(order, vec![5, 10]);
        assert_eq!(hold.take_all().len(), 2);
        assert_eq!((hold.len(), hold.bytes()), (0, 0));
    }
}
