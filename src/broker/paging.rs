//! Paging: the memory budget for the content of queued messages kept on disk.
//!
//! A persistent message in a durable queue has its Publish record in the log
//! ([`crate::storage`]). While the content of such messages held by the queues is over
//! `storage.paging_budget`, queues drop the content of their newest ones (the head is
//! delivered soonest) and keep only what the queue needs without it
//! ([`crate::broker::message::PagedMeta`], the message id); the location of the record is in
//! the storage index. Delivering, dead-lettering, inspecting or requeuing such a message reads
//! its content back first ([`PageStore::read`]). Messages without a record (non-persistent, or
//! in transient queues) are never paged: the memory high watermark bounds them.
//!
//! [`Paging`] is shared by the queues that can page (their [`crate::broker::queue::QueueState`]
//! holds it): it keeps the account of resident and paged content across queues and the
//! counters the metrics show. The decisions (which message pages out) are in the queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::message::Message;
use crate::storage::Storage;
use crate::storage::pagein::PagedIn;

/// Where paged-out contents are: the written records of the log.
pub trait PageStore: Send + Sync {
    /// Which of the messages `ids` have their record written (may be paged out).
    fn written(&self, ids: &[u64]) -> Vec<bool>;
    /// Reads message `id` back.
    fn read(&self, id: u64) -> std::io::Result<PagedIn>;
}

impl PageStore for Storage {
    fn written(&self, ids: &[u64]) -> Vec<bool> {
        Storage::written(self, ids)
    }
    fn read(&self, id: u64) -> std::io::Result<PagedIn> {
        Storage::read(self, id)
    }
}

/// The smallest step a queue pages out at once (the budget's sixteenth when larger).
const MIN_STEP: u64 = 64 << 10;

/// The paging account shared by the queues that can page.
pub struct Paging {
    store: Arc<dyn PageStore>,
    budget: AtomicU64,
    /// Content bytes of queued messages with a record, held in memory.
    resident: AtomicU64,
    /// Queued messages whose content is on disk only, and their body bytes.
    paged: AtomicU64,
    paged_bytes: AtomicU64,
    page_outs: AtomicU64,
    page_ins: AtomicU64,
    /// Page-ins that took a read from a segment file (the others came from the read-ahead).
    reads: AtomicU64,
    /// Messages whose content could not be read back (lost: disk fault).
    failures: AtomicU64,
    /// Reads that failed with an error that may pass; the message stays queued.
    retries: AtomicU64,
}

/// Failed reads of one message before it counts as lost (the waits between them
/// double from [`READ_RETRY_FIRST_MS`]: about 25 s in all).
pub const READ_ATTEMPTS: u32 = 9;

/// The wait after the first failed read of a paged message.
pub const READ_RETRY_FIRST_MS: u64 = 100;

/// Why a paged message's content was not read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFailure {
    /// The record is gone or damaged: it will never be read.
    Permanent,
    /// An error that may pass (too many open files, an I/O error): try again later.
    Transient,
}

/// Whether a read error can pass: a missing or damaged record cannot.
pub fn read_failure(error: &std::io::Error) -> ReadFailure {
    use std::io::ErrorKind;
    match error.kind() {
        ErrorKind::NotFound | ErrorKind::InvalidData | ErrorKind::UnexpectedEof => {
            ReadFailure::Permanent
        }
        _ => ReadFailure::Transient,
    }
}

impl std::fmt::Debug for Paging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Paging")
            .field("budget", &self.budget())
            .field("resident", &self.resident())
            .finish_non_exhaustive()
    }
}

/// The counters of [`Paging`], for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagingStats {
    pub budget: u64,
    pub resident_bytes: u64,
    pub paged_messages: u64,
    pub paged_bytes: u64,
    pub page_outs: u64,
    pub page_ins: u64,
    pub page_in_reads: u64,
    pub page_in_failures: u64,
    pub page_in_retries: u64,
}

impl Paging {
    pub fn new(store: Arc<dyn PageStore>, budget: u64) -> Arc<Paging> {
        Arc::new(Paging {
            store,
            budget: AtomicU64::new(budget),
            resident: AtomicU64::new(0),
            paged: AtomicU64::new(0),
            paged_bytes: AtomicU64::new(0),
            page_outs: AtomicU64::new(0),
            page_ins: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        })
    }

    pub fn budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    /// A new budget (config reload): applied as queues next grow.
    pub fn set_budget(&self, budget: u64) {
        self.budget.store(budget, Ordering::Relaxed);
    }

    pub fn resident(&self) -> u64 {
        self.resident.load(Ordering::Relaxed)
    }

    /// Bytes of resident content over the budget (0 within it).
    pub fn over_budget(&self) -> u64 {
        self.resident().saturating_sub(self.budget())
    }

    /// How much a queue pages out past what is over the budget, so that it does not page
    /// out one message per publish: a sixteenth of the budget, at least `MIN_STEP`.
    pub fn step(&self) -> u64 {
        (self.budget() / 16).max(MIN_STEP)
    }

    pub(super) fn add_resident(&self, bytes: u64) {
        self.resident.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(super) fn sub_resident(&self, bytes: u64) {
        sub(&self.resident, bytes);
    }

    pub(super) fn add_paged(&self, messages: u64, bytes: u64) {
        self.paged.fetch_add(messages, Ordering::Relaxed);
        self.paged_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(super) fn sub_paged(&self, messages: u64, bytes: u64) {
        sub(&self.paged, messages);
        sub(&self.paged_bytes, bytes);
    }

    /// Records `n` page-outs.
    pub(super) fn paged_out(&self, n: u64) {
        self.page_outs.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn written(&self, ids: &[u64]) -> Vec<bool> {
        self.store.written(ids)
    }

    /// Reads the content of message `id` back. A failure is logged; `last_try` says the
    /// caller gives up after this one (the message is lost and counted as such).
    pub(super) fn read(&self, id: u64, last_try: bool) -> Result<Arc<Message>, ReadFailure> {
        match self.store.read(id) {
            Ok(back) => {
                self.page_ins.fetch_add(1, Ordering::Relaxed);
                self.reads
                    .fetch_add(u64::from(back.read), Ordering::Relaxed);
                Ok(back.message)
            }
            Err(e) => {
                let failure = read_failure(&e);
                if failure == ReadFailure::Permanent || last_try {
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(message_id = id, error = %e, "a paged-out message could not be read back from the log; it is lost");
                    return Err(ReadFailure::Permanent);
                }
                self.retries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(message_id = id, error = %e, "a paged-out message could not be read back from the log; it stays queued and is read again later");
                Err(failure)
            }
        }
    }

    pub fn stats(&self) -> PagingStats {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PagingStats {
            budget: self.budget(),
            resident_bytes: load(&self.resident),
            paged_messages: load(&self.paged),
            paged_bytes: load(&self.paged_bytes),
            page_outs: load(&self.page_outs),
            page_ins: load(&self.page_ins),
            page_in_reads: load(&self.reads),
            page_in_failures: load(&self.failures),
            page_in_retries: load(&self.retries),
        }
    }
}

fn sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

/// A store in memory for unit tests: records by id, and which are written.
#[cfg(test)]
pub(crate) mod test_store {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    pub struct MemoryStore {
        pub messages: Mutex<HashMap<u64, Arc<Message>>>,
        /// Ids whose record is not written yet.
        pub unwritten: Mutex<std::collections::HashSet<u64>>,
        /// Ids whose reads fail with an error that may pass (as too many open files).
        pub failing: Mutex<std::collections::HashSet<u64>>,
        pub reads: AtomicU64,
    }

    impl MemoryStore {
        pub fn put(&self, id: u64, m: &Arc<Message>) {
            self.messages.lock().unwrap().insert(id, m.clone());
        }
    }

    impl PageStore for MemoryStore {
        fn written(&self, ids: &[u64]) -> Vec<bool> {
            let unwritten = self.unwritten.lock().unwrap();
            let messages = self.messages.lock().unwrap();
            ids.iter()
                .map(|id| messages.contains_key(id) && !unwritten.contains(id))
                .collect()
        }
        fn read(&self, id: u64) -> std::io::Result<PagedIn> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            if self.failing.lock().unwrap().contains(&id) {
                return Err(std::io::Error::from_raw_os_error(24));
            }
            // A copy, as a read from disk makes (not the allocation that was paged out).
            let m = self.messages.lock().unwrap().get(&id).cloned();
            let m = m.ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
            let keys: Vec<&str> = m.routing_keys().collect();
            Ok(PagedIn {
                message: Arc::new(Message::new(
                    m.exchange(),
                    &keys,
                    m.raw_properties(),
                    m.body(),
                    m.expiration_ms,
                    m.dead_lettered,
                )),
                read: true,
            })
        }
    }
}
