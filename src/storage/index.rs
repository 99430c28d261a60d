//! The storage thread's in-memory index: which segment holds each live message, and how many
//! live messages each segment still has. A segment is deleted once it has none left **and**
//! every older segment is gone: removal records in a segment refer to messages in older ones,
//! so deleting from the head only keeps every removal that still matters.
//!
//! The index also says where each live message's Publish record starts (segment and offset):
//! paged-out messages ([`crate::broker::paging`]) are read back from there. The storage thread
//! records a location only once the record's bytes are written, so a location the index gives
//! can always be read.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A live message as the index knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Live {
    pub queue: u64,
    pub segment: u64,
    /// Where its Publish record starts in the segment (segments are smaller than 4 GiB).
    pub offset: u32,
    /// Deliveries not settled (Delivered records, a delivered publish), kept so that a
    /// rewritten message keeps its delivery count.
    pub deliveries: u32,
}

#[derive(Debug, Default)]
pub struct Index {
    /// Message id → where it is.
    live: HashMap<u64, Live>,
    /// Segment number → live messages in it (every segment file on disk has an entry).
    segments: BTreeMap<u64, u64>,
}

impl Index {
    /// Registers a segment file (possibly empty of live messages).
    pub fn add_segment(&mut self, number: u64) {
        self.segments.entry(number).or_insert(0);
    }

    /// A message written to `segment` at `offset` (moved there when it was live elsewhere).
    pub fn add(&mut self, id: u64, queue: u64, segment: u64, offset: u32, deliveries: u32) {
        self.remove(id);
        self.live.insert(
            id,
            Live {
                queue,
                segment,
                offset,
                deliveries,
            },
        );
        *self.segments.entry(segment).or_insert(0) += 1;
    }

    pub fn remove(&mut self, id: u64) {
        if let Some(live) = self.live.remove(&id)
            && let Some(n) = self.segments.get_mut(&live.segment)
        {
            *n = n.saturating_sub(1);
        }
    }

    /// A delivery of message `id` not settled yet.
    pub fn delivered(&mut self, id: u64) {
        if let Some(live) = self.live.get_mut(&id) {
            live.deliveries = live.deliveries.saturating_add(1);
        }
    }

    pub fn get(&self, id: u64) -> Option<Live> {
        self.live.get(&id).copied()
    }

    /// The oldest segment and its live messages.
    pub fn head(&self) -> Option<(u64, u64)> {
        self.segments.first_key_value().map(|(n, live)| (*n, *live))
    }

    /// Forgets the messages of queues not in `queues` (deleted queues).
    pub fn retain_queues(&mut self, queues: &HashSet<u64>) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, live)| !queues.contains(&live.queue))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.remove(id);
        }
    }

    /// Whether [`take_deletable`](Self::take_deletable) would return a segment.
    pub fn has_deletable(&self, current: u64) -> bool {
        self.segments
            .first_key_value()
            .is_some_and(|(&number, &live)| number < current && live == 0)
    }

    /// Head segments older than `current` with no live message: removed from the index and
    /// returned, to be deleted.
    pub fn take_deletable(&mut self, current: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some((&number, &live)) = self.segments.first_key_value() {
            if number >= current || live > 0 {
                break;
            }
            self.segments.remove(&number);
            out.push(number);
        }
        out
    }

    pub fn live_messages(&self) -> usize {
        self.live.len()
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_head_segments_without_live_messages_are_deleted() {
        let mut ix = Index::default();
        for s in 0..3 {
            ix.add_segment(s);
        }
        ix.add(1, 7, 0, 0, 0);
        ix.add(2, 7, 1, 0, 0);
        ix.add(3, 8, 2, 0, 0);
        assert!(ix.take_deletable(2).is_empty());
        ix.remove(2);
        assert!(
            ix.take_deletable(2).is_empty(),
            "segment 0 still holds message 1"
        );
        ix.remove(1);
        assert_eq!(ix.take_deletable(2), vec![0, 1]);
        ix.retain_queues(&HashSet::from([7]));
        assert_eq!(ix.live_messages(), 0);
        assert!(
            ix.take_deletable(2).is_empty(),
            "the current segment is kept"
        );
        assert_eq!(ix.take_deletable(3), vec![2]);
        assert_eq!(ix.segment_count(), 0);
    }

    #[test]
    fn a_message_written_again_moves_with_its_deliveries() {
        let mut ix = Index::default();
        ix.add_segment(0);
        ix.add(1, 7, 0, 40, 1);
        ix.delivered(1);
        assert_eq!(ix.head(), Some((0, 1)));
        let live = ix.get(1).unwrap();
        ix.add(1, live.queue, 3, 96, live.deliveries);
        assert_eq!(ix.head(), Some((0, 0)), "moved out of segment 0");
        assert_eq!(
            ix.get(1).map(|l| (l.segment, l.offset, l.deliveries)),
            Some((3, 96, 2)),
            "its location follows the copy"
        );
        assert_eq!(ix.take_deletable(3), vec![0]);
        assert_eq!(ix.live_messages(), 1);
    }
}
