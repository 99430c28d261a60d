//! Recovery over files the storage thread really wrote.

use std::path::PathBuf;
use std::sync::Arc;

use amq_protocol::types::FieldTable;

use super::super::definitions::QueueDef;
use super::super::{Definitions, Record, Storage, StorageOptions, Target, segment};
use crate::broker::message::Message;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dlx-recovery-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn options(dir: &std::path::Path, segment_size: u64) -> StorageOptions {
    StorageOptions {
        dir: dir.to_path_buf(),
        fsync: true,
        segment_size,
        paging_budget: 0,
    }
}

fn queues(ids: &[u64]) -> Definitions {
    Definitions {
        queues: ids
            .iter()
            .map(|id| QueueDef {
                vhost: "/".into(),
                name: format!("q{id}"),
                id: *id,
                auto_delete: false,
                arguments: FieldTable::default(),
            })
            .collect(),
        ..Definitions::default()
    }
}

fn publish(s: &Storage, queue: u64, body: &str) -> u64 {
    let id = s.next_id();
    s.append(super::super::record::test_publish(queue, id, body));
    id
}

/// The bodies of a recovered queue, each read back from its record (recovery keeps none).
fn bodies(s: &Storage, r: &super::Recovered, queue: u64) -> Vec<String> {
    r.queues
        .get(&queue)
        .map(|ms| {
            ms.iter()
                .map(|m| {
                    let back = s.read(m.id).expect("read back");
                    assert_eq!(back.message.body_len(), m.meta.body_len);
                    String::from_utf8_lossy(back.message.body()).into_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn publishes_removals_deliveries_and_moves_replay_in_order() {
    let d = dir("replay");
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(r.stats.messages, 0);
    s.definitions(queues(&[1, 2]));
    let a = publish(&s, 1, "a");
    let b = publish(&s, 1, "b");
    let c = publish(&s, 1, "c");
    let _d = publish(&s, 1, "d");
    s.append(Record::Remove {
        items: vec![(1, a)],
    });
    s.append(Record::Delivered { queue: 1, id: c });
    let moved = s.next_id();
    let durable = s.append_durable(Record::Publish {
        targets: vec![Target {
            queue: 2,
            id: moved,
            delivered: false,
        }],
        remove: Some((1, b)),
        message: Arc::new(Message::new("dlx", &["k"], &[0, 0], b"b", None, true)),
        at: Some(5_000),
        held_until: None,
    });
    assert_eq!(durable.blocking_recv(), Ok(true));
    s.close();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["c", "d"]);
    assert_eq!(bodies(&s, &r, 2), vec!["b"]);
    let q1 = &r.queues[&1];
    assert_eq!((q1[0].deliveries, q1[1].deliveries), (1, 0));
    assert_eq!((q1[0].at, q1[1].at), (Some(1_000 + c), Some(1_000 + c + 1)));
    assert!(
        r.queues[&2][0].meta.death_history,
        "dead-lettered by the broker"
    );
    assert_eq!(
        r.queues[&2][0].at,
        Some(5_000),
        "a move enters its target then"
    );
    assert_eq!(r.stats.messages, 3);
    assert_eq!(r.stats.torn_bytes, 0);
    assert!(r.next_id > moved);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn messages_of_deleted_queues_are_orphans() {
    let d = dir("orphans");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    s.definitions(queues(&[1, 2]));
    publish(&s, 1, "a");
    publish(&s, 2, "b");
    s.definitions(queues(&[2]));
    s.close();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), Vec::<String>::new());
    assert_eq!(bodies(&s, &r, 2), vec!["b"]);
    assert_eq!(r.stats.orphans, 1);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_torn_tail_is_cut_and_only_the_torn_record_is_lost() {
    let d = dir("torn");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    s.definitions(queues(&[1]));
    for i in 0..5 {
        publish(&s, 1, &format!("m{i}"));
    }
    s.close();
    let path = segment::segment_path(&d, 0);
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 3).unwrap();
    drop(f);
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["m0", "m1", "m2", "m3"]);
    assert!(r.stats.torn_bytes > 0);
    assert_eq!(r.stats.damaged_records, 0);
    // The file was cut at the last whole record, and writing goes on after it.
    publish(&s, 1, "m5");
    s.close();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["m0", "m1", "m2", "m3", "m5"]);
    assert_eq!(r.stats.torn_bytes, 0);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_flipped_byte_in_the_middle_loses_that_record_only() {
    let d = dir("flip");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    s.definitions(queues(&[1]));
    for i in 0..5 {
        publish(&s, 1, &format!("body-{i}"));
    }
    s.close();
    let path = segment::segment_path(&d, 0);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(6)
        .position(|w| w == b"body-2")
        .expect("third body on disk");
    bytes[at] ^= 0xFF;
    std::fs::write(&path, &bytes).unwrap();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(
        bodies(&s, &r, 1),
        vec!["body-0", "body-1", "body-3", "body-4"]
    );
    assert_eq!(r.stats.damaged_records, 1);
    assert_eq!(r.stats.torn_bytes, 0);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn segments_rotate_and_head_segments_without_messages_are_deleted() {
    let d = dir("compact");
    let (s, _) = Storage::open(options(&d, 200), None).unwrap();
    s.definitions(queues(&[1]));
    let ids: Vec<u64> = (0..20)
        .map(|i| publish(&s, 1, &format!("{i:040}")))
        .collect();
    assert_eq!(
        s.append_durable(Record::Delivered {
            queue: 1,
            id: ids[0]
        })
        .blocking_recv(),
        Ok(true)
    );
    let before = segment::list(&d).unwrap();
    assert!(before.len() >= 5, "{before:?}");
    // Remove all but the last message: every older segment goes.
    s.append(Record::Remove {
        items: ids[..19].iter().map(|id| (1, *id)).collect(),
    });
    let sync = s.append_durable(Record::Delivered {
        queue: 1,
        id: ids[19],
    });
    assert_eq!(sync.blocking_recv(), Ok(true));
    // Segments are deleted after the batch's answers: one more batch makes sure it ran.
    let again = s.append_durable(Record::Delivered {
        queue: 1,
        id: ids[19],
    });
    assert_eq!(again.blocking_recv(), Ok(true));
    let after = segment::list(&d).unwrap();
    // Kept: the segment of the last message and the newer ones (the removal and the
    // delivered records, in as many segments as the writer's batches made under load); the
    // older ones are gone from the head.
    assert!(
        !after.is_empty() && after[0] >= before.len() as u64 - 4,
        "{before:?} → {after:?}"
    );
    assert!(s.stats.bytes_on_disk() > 0);
    s.close();
    let (s, r) = Storage::open(options(&d, 200), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec![format!("{:040}", 19)]);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

/// A dead-letter move nobody waits for (a TTL expiry, a reject) is not synced with its batch;
/// the head segments it empties are deleted only once it is: otherwise a power loss would
/// take the copy (unsynced) and the original (its segment deleted) together.
#[test]
fn segments_emptied_by_unsynced_dead_letter_moves_are_deleted_after_a_sync() {
    let d = dir("move-sync");
    // Five messages a segment: six take two segments, and the five short moves fit in the
    // second, so there are never enough segments for a head rewrite (MIN_SEGMENTS): the
    // first segment is deleted only because the moves emptied it.
    let mut one = Vec::new();
    super::super::record::test_publish(1, 1, &format!("{:040}", 0)).encode(&mut one);
    let segment_size = one.len() as u64 * 11 / 2;
    let (s, _) = Storage::open(options(&d, segment_size), None).unwrap();
    s.definitions(queues(&[1, 2]));
    let ids: Vec<u64> = (0..6)
        .map(|i| publish(&s, 1, &format!("{i:040}")))
        .collect();
    let written = s.append_durable(Record::Delivered {
        queue: 1,
        id: ids[5],
    });
    assert_eq!(written.blocking_recv(), Ok(true));
    let before = segment::list(&d).unwrap();
    assert_eq!(before.len(), 2, "{before:?}");
    let (fsyncs, _) = s.stats.fsyncs();
    // The first five moved from queue 1 to queue 2, each in one record with nobody waiting.
    for (i, id) in ids[..5].iter().enumerate() {
        let Record::Publish { message, .. } =
            super::super::record::test_publish(2, 0, &format!("x{i}"))
        else {
            unreachable!("a publish record")
        };
        s.append(Record::Publish {
            targets: vec![Target {
                queue: 2,
                id: s.next_id(),
                delivered: false,
            }],
            remove: Some((1, *id)),
            message,
            at: Some(1),
            held_until: None,
        });
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while segment::list(&d).unwrap().first() == before.first() {
        assert!(
            std::time::Instant::now() < deadline,
            "no segment was deleted"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(segment::list(&d).unwrap(), before[1..], "no rotation");
    assert!(
        s.stats.fsyncs().0 > fsyncs,
        "head segments were deleted before the moves that emptied them were synced"
    );
    s.close();
    // Every moved message is in queue 2.
    let (s, r) = Storage::open(options(&d, segment_size), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec![format!("{:040}", 5)]);
    assert_eq!(
        bodies(&s, &r, 2),
        (0..5).map(|i| format!("x{i}")).collect::<Vec<_>>()
    );
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn one_old_unsettled_message_does_not_keep_every_newer_segment() {
    let d = dir("rewrite");
    let (s, _) = Storage::open(options(&d, 200), None).unwrap();
    s.definitions(queues(&[1]));
    let pinned = publish(&s, 1, "pinned");
    s.append(Record::Delivered {
        queue: 1,
        id: pinned,
    });
    s.append(Record::Delivered {
        queue: 1,
        id: pinned,
    });
    // A stream of messages, each settled: without rewriting every segment since the first
    // would stay because of the pinned message in it.
    for i in 0..60 {
        let id = publish(&s, 1, &format!("{i:040}"));
        s.append(Record::Remove {
            items: vec![(1, id)],
        });
    }
    for _ in 0..2 {
        let sync = s.append_durable(Record::Remove { items: Vec::new() });
        assert_eq!(sync.blocking_recv(), Ok(true));
    }
    let after = segment::list(&d).unwrap();
    assert!(after.len() <= 4, "{after:?}");
    assert!(
        after[0] > 0,
        "the first segment was rewritten and deleted: {after:?}"
    );
    s.close();
    let (s, r) = Storage::open(options(&d, 200), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["pinned"]);
    let m = &r.queues[&1][0];
    assert_eq!(
        (m.id, m.deliveries, m.at),
        (pinned, 2, Some(1_000 + pinned))
    );
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

/// Cuts the segment file at `path` 100 bytes past the first copy of `marker` (a crash while
/// the body holding it was written).
fn tear_after(path: &std::path::Path, marker: &[u8]) {
    let bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("the body on disk");
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len((at + marker.len() + 100) as u64).unwrap();
}

/// A whole framed record removing message `id` of queue 1, as a client could put in a body.
fn removal_of(id: u64) -> Vec<u8> {
    let mut framed = Vec::new();
    Record::Remove {
        items: vec![(1, id)],
    }
    .encode(&mut framed);
    framed
}

#[test]
fn a_record_inside_the_body_of_a_torn_tail_is_not_replayed() {
    let d = dir("forged");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    s.definitions(queues(&[1]));
    let kept = publish(&s, 1, "kept");
    // A body holding a whole framed record that would remove `kept`, then padding.
    let forged = removal_of(kept);
    let mut body = forged.clone();
    body.extend_from_slice(&[0u8; 1024]);
    let id = s.next_id();
    s.append(super::super::record::test_publish_bytes(1, id, &body));
    s.close();
    // The crash comes while the padding is being written.
    tear_after(&segment::segment_path(&d, 0), &forged);
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["kept"]);
    assert!(r.stats.torn_bytes > 0);
    assert_eq!(r.stats.damaged_records, 0);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_damaged_record_is_stepped_over_by_its_length_not_searched() {
    let d = dir("damaged-body");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    s.definitions(queues(&[1]));
    let kept = publish(&s, 1, "kept");
    let forged = removal_of(kept);
    let mut body = forged.clone();
    body.extend_from_slice(b"-damaged-here-");
    let id = s.next_id();
    s.append(super::super::record::test_publish_bytes(1, id, &body));
    publish(&s, 1, "after");
    s.close();
    let path = segment::segment_path(&d, 0);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(14)
        .position(|w| w == b"-damaged-here-")
        .expect("the body on disk");
    bytes[at] ^= 0xFF;
    std::fs::write(&path, &bytes).unwrap();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(bodies(&s, &r, 1), vec!["kept", "after"]);
    assert_eq!(r.stats.damaged_records, 1);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_snapshot_that_could_not_be_written_is_written_again_and_nacks_meanwhile() {
    let d = dir("snapshot-retry");
    let (s, _) = Storage::open(options(&d, 1 << 20), None).unwrap();
    // The snapshot cannot be written while its temporary file's name is taken (a stand-in
    // for a full disk).
    let blocker = d.join("definitions.tmp");
    std::fs::create_dir_all(&blocker).unwrap();
    s.definitions(queues(&[1]));
    let id = s.next_id();
    let confirm = s.append_durable(super::super::record::test_publish(1, id, "early"));
    assert_eq!(
        confirm.blocking_recv(),
        Ok(false),
        "a publish into a queue the snapshot on disk does not list is not confirmed"
    );
    std::fs::remove_dir(&blocker).unwrap();
    let id = s.next_id();
    let confirm = s.append_durable(super::super::record::test_publish(1, id, "later"));
    assert_eq!(confirm.blocking_recv(), Ok(true));
    s.close();
    let (s, r) = Storage::open(options(&d, 1 << 20), None).unwrap();
    assert_eq!(r.definitions.queues.len(), 1);
    assert_eq!(bodies(&s, &r, 1), vec!["early", "later"]);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_torn_record_in_an_older_segment_is_not_searched_either() {
    let d = dir("forged-older");
    let (s, _) = Storage::open(options(&d, 4096), None).unwrap();
    s.definitions(queues(&[1]));
    let kept = publish(&s, 1, "kept");
    let forged = removal_of(kept);
    let mut body = forged.clone();
    body.extend_from_slice(&[0u8; 2048]);
    let id = s.next_id();
    s.append(super::super::record::test_publish_bytes(1, id, &body));
    // The next record does not fit: it starts segment 1.
    publish(&s, 1, &"n".repeat(3000));
    s.close();
    assert!(segment::segment_path(&d, 1).exists(), "a second segment");
    tear_after(&segment::segment_path(&d, 0), &forged);
    let (s, r) = Storage::open(options(&d, 4096), None).unwrap();
    let recovered = bodies(&s, &r, 1);
    assert_eq!(recovered.first().map(String::as_str), Some("kept"));
    assert_eq!(recovered.len(), 2, "kept and the one of segment 1");
    assert_eq!(r.stats.damaged_records, 0);
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}
