//! Recovery: replays the definitions snapshot and the segments into a plain [`Recovered`]
//! state the broker loads at start, and the index the storage thread continues from.
//!
//! A torn tail (a segment ends inside a record: a crash during a write) is cut off at the
//! last whole record, logged and counted; the torn record's bytes are not searched (a
//! message body can hold a framed record). A damaged record (CRC mismatch or unreadable
//! contents) with valid records after it is skipped: by its own length when a whole record
//! follows there, else the scan moves byte by byte to the next offset where a whole record
//! with a matching CRC starts, and the skipped records are counted (each message publish is
//! one record, so that is an upper bound on the messages lost).
//!
//! Message contents are not kept: a recovered message is its id, its record's location (in
//! the index) and what its queue needs without the content ([`PagedMeta`]). The broker
//! restores every one paged out and reads contents back as they are needed, so a backlog
//! larger than memory comes back without loading it.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use super::definitions::{self, Definitions};
use super::index::Index;
use super::record::{FRAME_HEADER, Frame, Parts, Record, decode_frame};
use super::segment;
use crate::broker::message::PagedMeta;

/// A message of a durable queue as recovered, in queue order.
#[derive(Debug, Clone)]
pub struct RecoveredMessage {
    pub id: u64,
    /// What its queue keeps while the content stays on disk.
    pub meta: PagedMeta,
    /// How many times it was delivered without being settled (> 0: redelivered).
    pub deliveries: u32,
    /// When it entered the queue (Unix milliseconds; `None` from records of the first
    /// format): its TTL deadline counts from here.
    pub at: Option<u64>,
    /// Held in its queue's retry hold until then (Unix milliseconds; retry tiers).
    pub held_until: Option<u64>,
}

/// What recovery found and repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    pub segments: u64,
    pub records: u64,
    /// Bytes cut off torn tails.
    pub torn_bytes: u64,
    /// Damaged records skipped in the middle of a segment (messages lost: at most this many).
    pub damaged_records: u64,
    pub skipped_bytes: u64,
    /// Messages restored into queues.
    pub messages: u64,
    /// Messages of queues that no longer exist, discarded.
    pub orphans: u64,
}

/// The durable state found on disk.
#[derive(Debug, Default)]
pub struct Recovered {
    pub definitions: Definitions,
    /// Queue id → its messages in queue order.
    pub queues: BTreeMap<u64, Vec<RecoveredMessage>>,
    /// The next unused message id.
    pub next_id: u64,
    /// Above every queue id a stored message names, deleted queues' included (their
    /// messages stay on disk until compaction): a queue declared after the restart must not
    /// take such an id, or those messages would come back into it at the next start.
    pub next_queue_id: u64,
    pub stats: RecoveryStats,
    pub(super) index: Index,
    /// The segment to continue appending to.
    pub(super) current_segment: u64,
}

/// Why recovery could not run.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: the definitions snapshot is damaged (CRC or contents)")]
    Definitions { path: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RecoveryError + '_ {
    move |source| RecoveryError::Io {
        path: path.display().to_string(),
        source,
    }
}

struct Entry {
    segment: u64,
    offset: u32,
    meta: PagedMeta,
    deliveries: u32,
    at: Option<u64>,
    held_until: Option<u64>,
}

/// Reads `dir` (created if missing) into a [`Recovered`] state, truncating torn tails.
pub fn recover(dir: &Path) -> Result<Recovered, RecoveryError> {
    let _step = HeapStep::enlarge();
    std::fs::create_dir_all(segment::segments_dir(dir)).map_err(io(dir))?;
    let defs_path = dir.join(definitions::FILE);
    let definitions = match std::fs::read(&defs_path) {
        Ok(bytes) => Definitions::decode(&bytes).ok_or_else(|| RecoveryError::Definitions {
            path: defs_path.display().to_string(),
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Definitions::default(),
        Err(e) => return Err(io(&defs_path)(e)),
    };
    let numbers = segment::list(dir).map_err(io(dir))?;
    let mut stats = RecoveryStats::default();
    let mut messages: BTreeMap<(u64, u64), Entry> = BTreeMap::new();
    let mut max_id = 0u64;
    let mut index = Index::default();
    // One buffer for every segment: its pages are faulted in once, not once per segment.
    let mut buf = Vec::new();
    for &number in &numbers {
        index.add_segment(number);
        let path = segment::segment_path(dir, number);
        buf.clear();
        std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut buf))
            .map_err(io(&path))?;
        let bytes = &buf[..];
        stats.segments += 1;
        let end = replay_segment(bytes, number, &mut messages, &mut max_id, &mut stats);
        if end < bytes.len() {
            tracing::warn!(
                segment = %path.display(),
                offset = end,
                bytes = bytes.len() - end,
                "torn record at the end of a segment cut off"
            );
            stats.torn_bytes += (bytes.len() - end) as u64;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io(&path))?;
            f.set_len(end as u64).map_err(io(&path))?;
            f.sync_all().map_err(io(&path))?;
        }
    }
    let known: HashSet<u64> = definitions.queues.iter().map(|q| q.id).collect();
    let next_queue_id = messages
        .keys()
        .map(|(queue, _)| queue.saturating_add(1))
        .max()
        .unwrap_or(0);
    let mut queues: BTreeMap<u64, Vec<RecoveredMessage>> = BTreeMap::new();
    for ((queue, id), entry) in messages {
        if !known.contains(&queue) {
            stats.orphans += 1;
            continue;
        }
        index.add(id, queue, entry.segment, entry.offset, entry.deliveries);
        stats.messages += 1;
        queues.entry(queue).or_default().push(RecoveredMessage {
            id,
            meta: entry.meta,
            deliveries: entry.deliveries,
            at: entry.at,
            held_until: entry.held_until,
        });
    }
    if stats.damaged_records > 0 {
        tracing::error!(
            damaged_records = stats.damaged_records,
            skipped_bytes = stats.skipped_bytes,
            "damaged records skipped during recovery; at most this many messages were lost"
        );
    }
    Ok(Recovered {
        definitions,
        queues,
        next_id: max_id + 1,
        next_queue_id,
        stats,
        index,
        current_segment: numbers.last().copied().unwrap_or(0),
    })
}

/// Recovery allocates every stored message at once (a gigabyte for 1 M 1 KiB messages), and
/// glibc grows a thread's heap by `M_TOP_PAD` (128 KiB) at a time, with one `mprotect` each:
/// a fifth of recovery's time in a profile. While it lives, the heap grows 64 MiB at a time
/// (address space only: untouched pages are not resident); the default comes back on drop.
struct HeapStep;

/// glibc's default `M_TOP_PAD`.
const DEFAULT_TOP_PAD: i32 = 128 << 10;

impl HeapStep {
    fn enlarge() -> HeapStep {
        set_top_pad(64 << 20);
        HeapStep
    }
}

impl Drop for HeapStep {
    fn drop(&mut self) {
        set_top_pad(DEFAULT_TOP_PAD);
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_top_pad(bytes: i32) {
    // SAFETY: mallopt only changes one of glibc's allocator parameters (under its own lock).
    unsafe {
        libc::mallopt(libc::M_TOP_PAD, bytes);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_top_pad(_bytes: i32) {}

/// Applies the records of one segment; returns where the valid data ends (the torn tail, if
/// any, starts there).
///
/// A record the file ends inside is the one being written at a crash: the segment is cut
/// there, and its bytes are never searched, since a message body may hold anything, a whole
/// framed record included. (Only a length damaged to point past the end looks the same: the
/// records after it in that segment are then lost with it.) A damaged record is stepped over
/// by its own length when a whole record or the end follows it there; otherwise the next
/// whole record is searched for, byte by byte.
fn replay_segment(
    bytes: &[u8],
    number: u64,
    messages: &mut BTreeMap<(u64, u64), Entry>,
    max_id: &mut u64,
    stats: &mut RecoveryStats,
) -> usize {
    let mut pos = 0;
    while pos < bytes.len() {
        match decode_frame(&bytes[pos..]) {
            Frame::Whole(payload, used) => match Parts::decode(payload) {
                Ok(record) => {
                    stats.records += 1;
                    let offset = u32::try_from(pos).unwrap_or(u32::MAX);
                    apply(record, (number, offset), messages, max_id);
                    pos += used;
                }
                Err(_) => {
                    stats.damaged_records += 1;
                    stats.skipped_bytes += used as u64;
                    pos += used;
                }
            },
            Frame::Torn => return pos,
            Frame::Damaged => {
                match past_damaged(bytes, pos).or_else(|| next_valid(bytes, pos + 1)) {
                    Some(next) => {
                        stats.damaged_records += 1;
                        stats.skipped_bytes += (next - pos) as u64;
                        pos = next;
                    }
                    None => return pos,
                }
            }
        }
    }
    pos
}

/// Where the damaged record at `at` ends by its own length, when that is the segment's end
/// or the start of a whole record (the length was right, only its contents are damaged). A
/// torn record there is not taken: a damaged length can land inside a body, whose bytes
/// read as a torn record often enough, and a torn record ends the segment.
fn past_damaged(bytes: &[u8], at: usize) -> Option<usize> {
    let header = bytes.get(at..at + FRAME_HEADER)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let end = at.checked_add(FRAME_HEADER)?.checked_add(len)?;
    if len == 0 || end > bytes.len() {
        return None;
    }
    if end == bytes.len() {
        return Some(end);
    }
    match decode_frame(&bytes[end..]) {
        Frame::Whole(payload, _) if Parts::decode(payload).is_ok() => Some(end),
        _ => None,
    }
}

/// The first offset at or after `from` where a whole record with a matching CRC starts.
fn next_valid(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len()).find(|&p| match decode_frame(&bytes[p..]) {
        Frame::Whole(payload, _) => Parts::decode(payload).is_ok(),
        _ => false,
    })
}

/// Applies one record found at `at` (segment, offset): a publish as its borrowed parts, of
/// which only what the queue keeps is taken (no message is built).
fn apply(
    record: Parts<'_>,
    (segment, offset): (u64, u32),
    messages: &mut BTreeMap<(u64, u64), Entry>,
    max_id: &mut u64,
) {
    match record {
        Parts::Publish(p) => {
            let at = p.at;
            let held_until = p.held_until;
            if let Some(key) = p.remove {
                messages.remove(&key);
            }
            let meta = PagedMeta::from_parts(
                p.properties,
                p.body.len() as u64,
                p.expiration,
                p.dead_lettered,
            );
            let targets = p.targets;
            for t in targets {
                *max_id = (*max_id).max(t.id);
                messages.insert(
                    (t.queue, t.id),
                    Entry {
                        segment,
                        offset,
                        meta,
                        deliveries: t.delivered as u32,
                        at,
                        held_until,
                    },
                );
            }
        }
        Parts::Other(Record::Remove { items }) => {
            for key in items {
                messages.remove(&key);
            }
        }
        Parts::Other(Record::Publish { .. }) => {}
        Parts::Other(Record::Delivered { queue, id }) => {
            if let Some(e) = messages.get_mut(&(queue, id)) {
                e.deliveries = e.deliveries.saturating_add(1);
            }
        }
    }
}

#[cfg(test)]
mod tests;
