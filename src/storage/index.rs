//! The storage thread's in-memory index: which segment holds each live message, and how many
//! live messages each segment still has. A segment is deleted once it has none left **and**
//! every older segment is gone: removal records in a segment refer to messages in older ones,
//! so deleting from the head only keeps every removal that still matters.

use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Debug, Default)]
pub struct Index {
    /// Message id → (queue id, segment number).
    live: HashMap<u64, (u64, u64)>,
    /// Segment number → live messages in it (every segment file on disk has an entry).
    segments: BTreeMap<u64, u64>,
}

impl Index {
    /// Registers a segment file (possibly empty of live messages).
    pub fn add_segment(&mut self, number: u64) {
        self.segments.entry(number).or_insert(0);
    }

    pub fn add(&mut self, id: u64, queue: u64, segment: u64) {
        if self.live.insert(id, (queue, segment)).is_none() {
            *self.segments.entry(segment).or_insert(0) += 1;
        }
    }

    pub fn remove(&mut self, id: u64) {
        if let Some((_, segment)) = self.live.remove(&id)
            && let Some(n) = self.segments.get_mut(&segment)
        {
            *n = n.saturating_sub(1);
        }
    }

    /// Forgets the messages of queues not in `queues` (deleted queues).
    pub fn retain_queues(&mut self, queues: &HashSet<u64>) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, (q, _))| !queues.contains(q))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.remove(id);
        }
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
        ix.add(1, 7, 0);
        ix.add(2, 7, 1);
        ix.add(3, 8, 2);
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
}
