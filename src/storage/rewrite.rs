//! Rewriting a pinned head segment: segments are deleted from the head only, so one old
//! message nobody settles (an unacked delivery, a message at the head of a queue without
//! consumers) would keep every newer segment on disk. When the oldest segment holds only a
//! few live messages and at least [`MIN_SEGMENTS`] segments exist, the storage thread writes
//! those messages again at the end of the log (the same queue and message ids, their
//! wall-clock time, their unsettled delivery count as Delivered records), syncs, and the head
//! segment holds nothing live any more: it is deleted like any other.
//!
//! Pure over the head segment's bytes and the [`Index`]; the storage thread does the I/O.

use super::index::Index;
use super::record::{Frame, Record, Target, decode_frame};

/// A head segment is rewritten only while it has at most this many live messages (more: it
/// is not pinned by a few stragglers, it is a backlog).
pub const MAX_LIVE: u64 = 256;
/// ... and only while it keeps at least this many segments (itself included) on disk.
pub const MIN_SEGMENTS: usize = 3;
/// Delivered records written again per message, at most. A message requeued without end
/// (no delivery limit) counts millions of deliveries; one record each would make its copy
/// span segments and be due for a rewrite again at once, for ever. Its count comes back at
/// most this high after a restart (still redelivered; a delivery limit above it counts
/// from here).
pub const MAX_DELIVERIES_COPIED: u32 = 1000;

/// Whether the head segment (number and live messages) should be rewritten, `current` being
/// the segment written to.
pub fn due(index: &Index, current: u64) -> Option<u64> {
    let (head, live) = index.head()?;
    (head < current && live > 0 && live <= MAX_LIVE && index.segment_count() >= MIN_SEGMENTS)
        .then_some(head)
}

/// The records that write the live messages of segment `head` (its file's `bytes`) again:
/// per message a Publish without removal, then one Delivered record per unsettled delivery
/// (at most [`MAX_DELIVERIES_COPIED`]).
/// Records that cannot be read are skipped: their messages stay live in the head, which is
/// then not deleted.
pub fn copies(bytes: &[u8], head: u64, index: &Index) -> Vec<Record> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let Frame::Whole(payload, used) = decode_frame(&bytes[pos..]) else {
            pos += 1;
            continue;
        };
        pos += used;
        let Ok(Record::Publish {
            targets,
            message,
            at,
            held_until,
            ..
        }) = Record::decode_payload(payload)
        else {
            continue;
        };
        let mut deliveries = Vec::new();
        let kept: Vec<Target> = targets
            .into_iter()
            .filter_map(|t| {
                let live = index.get(t.id)?;
                (live.segment == head && live.queue == t.queue).then(|| {
                    let copied = live.deliveries.min(MAX_DELIVERIES_COPIED);
                    deliveries.extend((0..copied).map(|_| Record::Delivered {
                        queue: t.queue,
                        id: t.id,
                    }));
                    Target {
                        delivered: false,
                        ..t
                    }
                })
            })
            .collect();
        if !kept.is_empty() {
            out.push(Record::Publish {
                targets: kept,
                remove: None,
                message,
                at,
                held_until,
            });
            out.extend(deliveries);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::record::test_publish as publish;

    #[test]
    fn only_live_messages_of_the_head_are_copied_with_their_deliveries() {
        let mut bytes = Vec::new();
        for id in 1..=4 {
            publish(7, id, &format!("m{id}")).encode(&mut bytes);
        }
        let mut index = Index::default();
        for s in 0..3 {
            index.add_segment(s);
        }
        for id in 1..=4 {
            index.add(id, 7, 0, 0, 0);
        }
        index.remove(1);
        index.remove(3);
        index.delivered(4);
        index.delivered(4);
        assert_eq!(due(&index, 2), Some(0));
        let out = copies(&bytes, 0, &index);
        let want = vec![
            publish(7, 2, "m2"),
            publish(7, 4, "m4"),
            Record::Delivered { queue: 7, id: 4 },
            Record::Delivered { queue: 7, id: 4 },
        ];
        assert_eq!(out, want);
    }

    #[test]
    fn a_message_requeued_without_end_is_copied_with_a_bounded_count() {
        let mut bytes = Vec::new();
        publish(7, 1, "poison").encode(&mut bytes);
        let mut index = Index::default();
        index.add_segment(0);
        index.add(1, 7, 0, 0, 2_000_000);
        let out = copies(&bytes, 0, &index);
        assert_eq!(out.len(), 1 + MAX_DELIVERIES_COPIED as usize);
        assert_eq!(out[0], publish(7, 1, "poison"));
        assert!(
            out[1..]
                .iter()
                .all(|r| *r == Record::Delivered { queue: 7, id: 1 })
        );
    }

    #[test]
    fn a_held_retry_is_copied_with_its_due_time() {
        let held = |held_until| {
            let Record::Publish {
                targets,
                message,
                at,
                ..
            } = publish(7, 1, "m1")
            else {
                unreachable!("test_publish is a publish");
            };
            Record::Publish {
                targets,
                remove: Some((7, 0)),
                message,
                at,
                held_until,
            }
        };
        let mut bytes = Vec::new();
        held(Some(9_000)).encode(&mut bytes);
        let mut index = Index::default();
        index.add_segment(0);
        index.add(1, 7, 0, 0, 0);
        let copied = copies(&bytes, 0, &index);
        let Some(Record::Publish {
            remove, held_until, ..
        }) = copied.first()
        else {
            panic!("{copied:?}");
        };
        assert_eq!((*remove, *held_until), (None, Some(9_000)));
    }

    #[test]
    fn a_backlog_or_too_few_segments_is_left_alone() {
        let mut index = Index::default();
        index.add_segment(0);
        index.add_segment(1);
        index.add(1, 7, 0, 0, 0);
        assert_eq!(due(&index, 1), None, "two segments");
        index.add_segment(2);
        assert_eq!(due(&index, 2), Some(0));
        assert_eq!(due(&index, 0), None, "the head is the current segment");
        for id in 2..=MAX_LIVE + 1 {
            index.add(id, 7, 0, 0, 0);
        }
        assert_eq!(due(&index, 2), None, "a backlog, not stragglers");
        index.remove(1);
        index.remove(2);
        for id in 3..=MAX_LIVE + 1 {
            index.remove(id);
        }
        assert_eq!(due(&index, 2), None, "nothing live: deleted, not rewritten");
    }
}
