//! Embedded mode's durable storage: durable definitions and persistent messages of durable
//! queues survive a restart or a crash. No sockets here; the broker calls [`Storage`] under
//! its lock and loads the [`Recovered`] state at start. docs/storage.md has the design.
//!
//! - [`record`]: the log records and their framing (length, CRC-32) — [`crc`], [`codec`];
//! - [`segment`]: append-only segment files, rotated at `segment_size`;
//! - [`definitions`]: the snapshot of durable exchanges, queues and bindings;
//! - [`recovery`]: replays the files into [`Recovered`] (torn tails cut, damage skipped);
//! - [`index`]: live messages per segment, for deleting segments whose messages are gone,
//!   and where each one's record is;
//! - [`pagein`]: reading a paged-out message back from its record (with read-ahead);
//! - [`rewrite`]: a head segment pinned by a few live messages is written again at the end;
//! - `writer`: the storage thread (group commit: one write and one fsync per batch);
//! - [`disk`]: the disk alarm (free space below `storage.disk_free_limit`).

pub mod codec;
pub mod crc;
pub mod definitions;
pub mod disk;
pub mod index;
pub mod pagein;
pub mod record;
pub mod recovery;
pub mod rewrite;
pub mod segment;
mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

pub use definitions::Definitions;
use index::Index;
use pagein::{ChunkReader, PagedIn};
pub use record::{Record, Target};
pub use recovery::{Recovered, RecoveredMessage, RecoveryError, RecoveryStats};
use writer::{Op, Request};

/// Takes the index lock (a panic elsewhere cannot leave it half-updated: each change is one
/// map operation).
pub(crate) fn lock_index(index: &Mutex<Index>) -> MutexGuard<'_, Index> {
    match index.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Settings from `[storage]`.
#[derive(Clone, Debug)]
pub struct StorageOptions {
    pub dir: PathBuf,
    /// fsync before a durable request is answered (false: written to the page cache only).
    pub fsync: bool,
    pub segment_size: u64,
    /// `storage.paging_budget`: content bytes of queued persistent messages held in memory
    /// before queues page out ([`crate::broker::paging`]).
    pub paging_budget: u64,
}

/// Counters the storage thread keeps (read by the metrics).
#[derive(Debug, Default)]
pub struct StorageStats {
    bytes_written: AtomicU64,
    bytes_removed: AtomicU64,
    segments: AtomicU64,
    fsyncs: AtomicU64,
    fsync_micros: AtomicU64,
}

impl StorageStats {
    fn add_bytes(&self, n: u64) {
        self.bytes_written.fetch_add(n, Ordering::Relaxed);
    }
    fn add_bytes_removed(&self, n: u64) {
        self.bytes_removed.fetch_add(n, Ordering::Relaxed);
    }
    fn set_segments(&self, n: u64) {
        self.segments.store(n, Ordering::Relaxed);
    }
    fn observe_fsync(&self, d: Duration) {
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.fsync_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }
    /// Segment bytes on disk (those found at start plus written minus deleted).
    pub fn bytes_on_disk(&self) -> u64 {
        self.bytes_written
            .load(Ordering::Relaxed)
            .saturating_sub(self.bytes_removed.load(Ordering::Relaxed))
    }
    pub fn segments(&self) -> u64 {
        self.segments.load(Ordering::Relaxed)
    }
    /// fsyncs done and their total time.
    pub fn fsyncs(&self) -> (u64, Duration) {
        (
            self.fsyncs.load(Ordering::Relaxed),
            Duration::from_micros(self.fsync_micros.load(Ordering::Relaxed)),
        )
    }
}

/// The handle the broker writes through.
pub struct Storage {
    tx: Sender<Request>,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub stats: std::sync::Arc<StorageStats>,
    /// Shared with the storage thread: where each live message's record is.
    index: Arc<Mutex<Index>>,
    /// The last chunk read for page-ins (read-ahead).
    reader: Mutex<ChunkReader>,
    dir: PathBuf,
    paging_budget: u64,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage").finish_non_exhaustive()
    }
}

/// A durable request's answer: `true` once on stable storage, `false` (or a dropped sender)
/// when it could not be written.
pub type Durable = oneshot::Receiver<bool>;

impl Storage {
    /// Recovers `options.dir` (created if missing) and starts the storage thread, which
    /// reports to `metrics` when given.
    pub fn open(
        options: StorageOptions,
        metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    ) -> Result<(Storage, Recovered), RecoveryError> {
        let mut recovered = recovery::recover(&options.dir)?;
        let index = Arc::new(Mutex::new(std::mem::take(&mut recovered.index)));
        let segment = segment::SegmentWriter::open(
            &options.dir,
            recovered.current_segment,
            options.segment_size,
        )
        .map_err(|source| RecoveryError::Io {
            path: options.dir.display().to_string(),
            source,
        })?;
        let stats = std::sync::Arc::new(StorageStats::default());
        let on_disk: u64 = segment::list(&options.dir)
            .unwrap_or_default()
            .iter()
            .filter_map(|n| std::fs::metadata(segment::segment_path(&options.dir, *n)).ok())
            .map(|m| m.len())
            .sum();
        stats.add_bytes(on_disk);
        stats.set_segments(lock_index(&index).segment_count().max(1) as u64);
        if let Some(m) = &metrics {
            let r = &recovered.stats;
            m.set_storage_recovery(r.messages, r.damaged_records, r.torn_bytes);
            m.set_storage(stats.bytes_on_disk(), stats.segments());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let thread_stats = stats.clone();
        let thread_index = index.clone();
        let dir = options.dir.clone();
        let paging_budget = options.paging_budget;
        let thread = std::thread::Builder::new()
            .name("dlx-storage".into())
            .spawn(move || writer::run(rx, segment, thread_index, options, thread_stats, metrics))
            .map_err(|source| RecoveryError::Io {
                path: "storage thread".into(),
                source,
            })?;
        Ok((
            Storage {
                tx,
                next_id: AtomicU64::new(recovered.next_id),
                thread: Mutex::new(Some(thread)),
                stats,
                index,
                reader: Mutex::new(ChunkReader::default()),
                dir,
                paging_budget,
            },
            recovered,
        ))
    }

    /// `storage.paging_budget` at start.
    pub fn paging_budget(&self) -> u64 {
        self.paging_budget
    }

    /// A new message id (ids only grow: queue order is id order).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Appends a record; nobody waits for it (made stable with the next fsync).
    pub fn append(&self, record: Record) {
        let _ = self.tx.send(Request {
            op: Op::Append(record),
            done: None,
        });
    }

    /// Appends a record; the answer comes once it is on stable storage.
    pub fn append_durable(&self, record: Record) -> Durable {
        let (done, rx) = oneshot::channel();
        let _ = self.tx.send(Request {
            op: Op::Append(record),
            done: Some(done),
        });
        rx
    }

    /// Which of the messages `ids` have their record written (they can be paged out: read
    /// back with [`Storage::read`]).
    pub fn written(&self, ids: &[u64]) -> Vec<bool> {
        let index = lock_index(&self.index);
        ids.iter().map(|id| index.get(*id).is_some()).collect()
    }

    /// Reads message `id` back from its record (a page-in): from the chunk read last when
    /// it holds the record, else with a positioned read of a new chunk (read-ahead).
    pub fn read(&self, id: u64) -> std::io::Result<PagedIn> {
        let mut reader = match self.reader.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let (segment, offset, file) = {
            let index = lock_index(&self.index);
            let live = index.get(id).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("message {id} is not in the log"),
                )
            })?;
            let offset = u64::from(live.offset);
            // Opened under the index lock: the segment cannot be deleted before it is open.
            let file = if reader.covers(live.segment, offset) {
                None
            } else {
                Some(std::fs::File::open(segment::segment_path(
                    &self.dir,
                    live.segment,
                ))?)
            };
            (live.segment, offset, file)
        };
        reader.message(segment, offset, id, file)
    }

    /// Replaces the definitions snapshot.
    pub fn definitions(&self, definitions: Definitions) {
        let _ = self.tx.send(Request {
            op: Op::Definitions(definitions),
            done: None,
        });
    }

    /// Writes and syncs everything sent so far and stops the storage thread (blocking).
    pub fn close(&self) {
        let _ = self.tx.send(Request {
            op: Op::Close,
            done: None,
        });
        let thread = match self.thread.lock() {
            Ok(mut t) => t.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}
