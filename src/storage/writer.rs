//! The storage thread: the only writer of the log. Requests arrive in the order the broker
//! made its changes (they are sent under the broker lock); the thread takes every request
//! already waiting, writes them with one `write`, makes them stable with one fsync when any
//! requester waits for it (group commit), and only then tells each requester. It also keeps
//! the [`Index`] and deletes head segments whose messages are all gone.
//!
//! The index is shared with the broker's page-in reads ([`super::Storage::read`]): a record's
//! location enters it only after the record's bytes are written (the records of a batch are
//! tracked after the batch's `write`), so every location the index gives can be read.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

use super::definitions::Definitions;
use super::index::Index;
use super::record::Record;
use super::rewrite;
use super::segment::{SegmentWriter, segment_path};
use super::{StorageOptions, StorageStats, lock_index};

/// Most requests taken into one batch.
const MAX_BATCH: usize = 4096;

pub(super) enum Op {
    Append(Record),
    Definitions(Definitions),
    /// Flush, sync and stop.
    Close,
}

pub(super) struct Request {
    pub op: Op,
    /// Told `true` once the request is on stable storage (`false`: it could not be written).
    pub done: Option<oneshot::Sender<bool>>,
}

/// Records encoded into the buffer but not written yet, with where each one starts: they
/// enter the index once the buffer is written.
#[derive(Default)]
struct Pending {
    buf: Vec<u8>,
    records: Vec<(Record, u64, u32)>,
}

impl Pending {
    /// Encodes `record` after what is pending (rotating first when the segment is full).
    fn push(
        &mut self,
        record: Record,
        segment: &mut SegmentWriter,
        index: &Mutex<Index>,
        options: &StorageOptions,
        stats: &StorageStats,
    ) -> bool {
        let start = self.buf.len();
        record.encode(&mut self.buf);
        let len = self.buf.len() - start;
        let mut ok = true;
        if segment.should_rotate(start, len) {
            let encoded = self.buf.split_off(start);
            ok &= self.write(segment, index);
            self.buf = encoded;
            ok &= report(segment.rotate(options.fsync), "start a new segment");
            lock_index(index).add_segment(segment.number());
        }
        let offset = segment.written() + (self.buf.len() - len) as u64;
        stats.add_bytes(len as u64);
        self.records
            .push((record, segment.number(), offset.min(u32::MAX as u64) as u32));
        ok
    }

    /// Writes the buffer, then tracks its records in the index (only when written: a
    /// location in the index can be read).
    fn write(&mut self, segment: &mut SegmentWriter, index: &Mutex<Index>) -> bool {
        let ok = self.buf.is_empty() || report(segment.append(&self.buf), "write a segment");
        self.buf.clear();
        let records = std::mem::take(&mut self.records);
        if ok {
            let mut index = lock_index(index);
            for (record, number, offset) in &records {
                track(&mut index, record, *number, *offset);
            }
        }
        ok
    }
}

pub(super) fn run(
    rx: Receiver<Request>,
    mut segment: SegmentWriter,
    index: Arc<Mutex<Index>>,
    options: StorageOptions,
    stats: std::sync::Arc<StorageStats>,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
) {
    let mut pending = Pending {
        buf: Vec::with_capacity(1 << 16),
        records: Vec::new(),
    };
    // A snapshot that could not be written (a full disk): written again before each later
    // batch, whose writes fail (their confirms are nacks) until it is. Publishes confirmed
    // into a queue the snapshot on disk does not list would be discarded at the next start.
    let mut unwritten: Option<Definitions> = None;
    loop {
        let Ok(first) = rx.recv() else {
            // Every handle is gone: make what was written stable and stop.
            if let Some(defs) = unwritten.take() {
                report(defs.write_to(&options.dir), "write the definitions again");
            }
            let _ = segment.sync();
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let mut ok = true;
        if let Some(defs) = unwritten.take()
            && !report(defs.write_to(&options.dir), "write the definitions again")
        {
            ok = false;
            unwritten = Some(defs);
        }
        let mut waiters = Vec::new();
        let mut closing = false;
        for req in batch {
            match req.op {
                Op::Append(r) => {
                    ok &= pending.push(r, &mut segment, &index, &options, &stats);
                }
                Op::Definitions(defs) => {
                    // What came before is indexed before the deleted queues are forgotten.
                    ok &= pending.write(&mut segment, &index);
                    lock_index(&index).retain_queues(&defs.queues.iter().map(|q| q.id).collect());
                    if report(defs.write_to(&options.dir), "write the definitions") {
                        unwritten = None;
                    } else {
                        ok = false;
                        unwritten = Some(defs);
                    }
                }
                Op::Close => closing = true,
            }
            if let Some(w) = req.done {
                waiters.push(w);
            }
        }
        ok &= pending.write(&mut segment, &index);
        if options.fsync && (!waiters.is_empty() || closing) {
            let started = Instant::now();
            ok &= report(segment.sync(), "fsync a segment");
            stats.observe_fsync(started.elapsed());
            if let Some(m) = &metrics {
                m.observe_storage_fsync(started.elapsed());
            }
        }
        for w in waiters {
            let _ = w.send(ok);
        }
        let due = rewrite::due(&lock_index(&index), segment.number());
        if let Some(head) = due {
            rewrite_head(head, &mut segment, &index, &options, &stats);
        }
        if lock_index(&index).has_deletable(segment.number())
            && synced_for_deletion(&mut segment, &options, &stats, metrics.as_deref())
        {
            let deletable = lock_index(&index).take_deletable(segment.number());
            for number in deletable {
                let path = segment_path(&options.dir, number);
                let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                if report(std::fs::remove_file(&path), "delete a segment") {
                    stats.add_bytes_removed(size);
                }
            }
        }
        stats.set_segments(lock_index(&index).segment_count() as u64);
        if let Some(m) = &metrics {
            m.set_storage(stats.bytes_on_disk(), stats.segments());
        }
        if closing {
            return;
        }
    }
}

/// Makes the current segment stable before head segments are deleted, when it holds
/// unsynced bytes: the records that emptied those segments are there, and a dead-letter move
/// (one record: the copy and its original's removal) whose original segment were deleted
/// before the move reached the disk would lose the message at a power loss. Returns whether
/// the segments may go; if the sync fails they stay (recovery replays them with what did
/// reach the disk, at worst bringing a removed message back).
fn synced_for_deletion(
    segment: &mut SegmentWriter,
    options: &StorageOptions,
    stats: &StorageStats,
    metrics: Option<&crate::metrics::Metrics>,
) -> bool {
    if !options.fsync || !segment.has_unsynced() {
        return true;
    }
    let started = Instant::now();
    let synced = report(segment.sync(), "fsync a segment before deleting older ones");
    stats.observe_fsync(started.elapsed());
    if let Some(m) = metrics {
        m.observe_storage_fsync(started.elapsed());
    }
    synced
}

/// Writes the live messages of segment `head` again at the end of the log and syncs them, so
/// that the head holds nothing live and is deleted ([`rewrite`]). The copies enter the index
/// once written; until then (and if they cannot be written) the messages stay where they were.
fn rewrite_head(
    head: u64,
    segment: &mut SegmentWriter,
    index: &Mutex<Index>,
    options: &StorageOptions,
    stats: &StorageStats,
) {
    let path = segment_path(&options.dir, head);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(segment = %path.display(), error = %e, "storage: could not read a segment to rewrite");
            return;
        }
    };
    let records = rewrite::copies(&bytes, head, &lock_index(index));
    let mut pending = Pending::default();
    let mut ok = true;
    let mut copied = 0u64;
    let mut written = Vec::new();
    for r in records {
        let start = pending.buf.len();
        r.encode(&mut pending.buf);
        let len = pending.buf.len() - start;
        if segment.should_rotate(start, len) {
            let encoded = pending.buf.split_off(start);
            ok &= report(segment.append(&pending.buf), "write a segment");
            pending.buf = encoded;
            ok &= report(segment.rotate(options.fsync), "start a new segment");
            lock_index(index).add_segment(segment.number());
        }
        let offset = segment.written() + (pending.buf.len() - len) as u64;
        stats.add_bytes(len as u64);
        copied += matches!(r, Record::Publish { .. }) as u64;
        written.push((r, segment.number(), offset.min(u32::MAX as u64) as u32));
    }
    if !pending.buf.is_empty() {
        ok &= report(segment.append(&pending.buf), "write a segment");
    }
    // The copies must be stable before the head they replace is deleted.
    if ok && options.fsync {
        ok &= report(segment.sync(), "fsync a segment");
    }
    if ok {
        let mut index = lock_index(index);
        for (record, number, offset) in &written {
            track(&mut index, record, *number, *offset);
        }
        tracing::debug!(segment = head, messages = copied, "head segment rewritten");
    }
    // Otherwise the copies are not known to be on disk: the messages stay in the head, which
    // is kept (the copies are duplicates of them at worst).
}

/// Keeps the index in step with a record written to segment `number` at `offset`.
fn track(index: &mut Index, record: &Record, number: u64, offset: u32) {
    match record {
        Record::Publish {
            targets, remove, ..
        } => {
            if let Some((_, id)) = remove {
                index.remove(*id);
            }
            for t in targets {
                index.add(t.id, t.queue, number, offset, t.delivered as u32);
            }
        }
        Record::Remove { items } => {
            for (_, id) in items {
                index.remove(*id);
            }
        }
        Record::Delivered { id, .. } => index.delivered(*id),
    }
}

/// Logs a failed write; returns whether it succeeded.
fn report(result: std::io::Result<()>, what: &str) -> bool {
    match result {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(operation = what, error = %e, "storage: a disk operation failed");
            false
        }
    }
}
