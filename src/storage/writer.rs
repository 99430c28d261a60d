//! The storage thread: the only writer of the log. Requests arrive in the order the broker
//! made its changes (they are sent under the broker lock); the thread takes every request
//! already waiting, writes them with one `write`, makes them stable with one fsync when any
//! requester waits for it (group commit), and only then tells each requester. It also keeps
//! the [`Index`] and deletes head segments whose messages are all gone.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use tokio::sync::oneshot;

use super::definitions::Definitions;
use super::index::Index;
use super::record::Record;
use super::rewrite;
use super::segment::{SegmentWriter, segment_path};
use super::{StorageOptions, StorageStats};

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

pub(super) fn run(
    rx: Receiver<Request>,
    mut segment: SegmentWriter,
    mut index: Index,
    options: StorageOptions,
    stats: std::sync::Arc<StorageStats>,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
) {
    let mut buf = Vec::with_capacity(1 << 16);
    let mut record = Vec::new();
    loop {
        let Ok(first) = rx.recv() else {
            // Every handle is gone: make what was written stable and stop.
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
        let mut waiters = Vec::new();
        let mut closing = false;
        for req in batch {
            match req.op {
                Op::Append(r) => {
                    record.clear();
                    r.encode(&mut record);
                    if segment.should_rotate(buf.len(), record.len()) {
                        ok &= report(segment.append(&buf), "write a segment");
                        buf.clear();
                        ok &= report(segment.rotate(options.fsync), "start a new segment");
                        index.add_segment(segment.number());
                    }
                    buf.extend_from_slice(&record);
                    stats.add_bytes(record.len() as u64);
                    track(&mut index, &r, segment.number());
                }
                Op::Definitions(defs) => {
                    ok &= report(defs.write_to(&options.dir), "write the definitions");
                    index.retain_queues(&defs.queues.iter().map(|q| q.id).collect());
                }
                Op::Close => closing = true,
            }
            if let Some(w) = req.done {
                waiters.push(w);
            }
        }
        if !buf.is_empty() {
            ok &= report(segment.append(&buf), "write a segment");
            buf.clear();
        }
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
        if let Some(head) = rewrite::due(&index, segment.number()) {
            rewrite_head(head, &mut segment, &mut index, &options, &stats);
        }
        for number in index.take_deletable(segment.number()) {
            let path = segment_path(&options.dir, number);
            let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if report(std::fs::remove_file(&path), "delete a segment") {
                stats.add_bytes_removed(size);
            }
        }
        stats.set_segments(index.segment_count() as u64);
        if let Some(m) = &metrics {
            m.set_storage(stats.bytes_on_disk(), stats.segments());
        }
        if closing {
            return;
        }
    }
}

/// Writes the live messages of segment `head` again at the end of the log and syncs them, so
/// that the head holds nothing live and is deleted ([`rewrite`]).
fn rewrite_head(
    head: u64,
    segment: &mut SegmentWriter,
    index: &mut Index,
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
    let records = rewrite::copies(&bytes, head, index);
    // Where the copied messages were, to put them back if the copies fail.
    let before: Vec<(u64, super::index::Live)> = records
        .iter()
        .filter_map(|r| match r {
            Record::Publish { targets, .. } => Some(targets),
            _ => None,
        })
        .flatten()
        .filter_map(|t| Some((t.id, index.get(t.id)?)))
        .collect();
    let mut buf = Vec::new();
    let mut ok = true;
    let mut copied = 0u64;
    for r in records {
        let start = buf.len();
        r.encode(&mut buf);
        let len = buf.len() - start;
        if segment.should_rotate(start, len) {
            let record = buf.split_off(start);
            ok &= report(segment.append(&buf), "write a segment");
            buf = record;
            ok &= report(segment.rotate(options.fsync), "start a new segment");
            index.add_segment(segment.number());
        }
        stats.add_bytes(len as u64);
        copied += matches!(r, Record::Publish { .. }) as u64;
        track(index, &r, segment.number());
    }
    if !buf.is_empty() {
        ok &= report(segment.append(&buf), "write a segment");
    }
    // The copies must be stable before the head they replace is deleted.
    if ok && options.fsync {
        ok &= report(segment.sync(), "fsync a segment");
    }
    if ok {
        tracing::debug!(segment = head, messages = copied, "head segment rewritten");
    } else {
        // Not known to be on disk: the messages stay in the head, which is kept (the copies
        // are duplicates of them at worst).
        for (id, live) in before {
            index.add(id, live.queue, live.segment, live.deliveries);
        }
    }
}

/// Keeps the index in step with a record written to segment `number`.
fn track(index: &mut Index, record: &Record, number: u64) {
    match record {
        Record::Publish {
            targets, remove, ..
        } => {
            if let Some((_, id)) = remove {
                index.remove(*id);
            }
            for t in targets {
                index.add(t.id, t.queue, number, t.delivered as u32);
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
