//! A connection's write queue (its "outbox", `limits.connection_outbox_bytes`): encoded frames
//! waiting for the connection's socket, shared between threads.
//!
//! Any connection task writes into it: the broker writes deliveries straight into the consumer
//! connection's write queue (under the broker lock, no allocation per message beyond the frame
//! bytes) and the connection's own writer task drains it in large writes. (Proxy mode's
//! `proxy::outbox` is different: single-task socket buffers, no lock.) The write queue has a
//! byte budget: while it is over budget the dispatcher skips that connection's consumers, and
//! the writer asks the broker to resume dispatching once it has drained. So a slow consumer
//! holds messages in its queue (where the queue limits apply), never in an ever-growing socket
//! buffer.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::BytesMut;
use tokio::sync::Notify;

/// Encoded frames for one connection's socket, with a byte budget.
#[derive(Debug)]
pub struct WriteQueue {
    buf: Mutex<BytesMut>,
    notify: Notify,
    pending: AtomicUsize,
    budget: usize,
    closed: AtomicBool,
    /// Set when the dispatcher skipped a consumer because the queue was over budget.
    starved: AtomicBool,
}

impl WriteQueue {
    pub fn new(budget: usize) -> Self {
        WriteQueue {
            buf: Mutex::new(BytesMut::with_capacity(16 * 1024)),
            notify: Notify::new(),
            pending: AtomicUsize::new(0),
            budget,
            closed: AtomicBool::new(false),
            starved: AtomicBool::new(false),
        }
    }

    /// Appends frames written by `write` and wakes the writer.
    pub fn push(&self, write: impl FnOnce(&mut BytesMut)) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let added = {
            let mut buf = match self.buf.lock() {
                Ok(b) => b,
                Err(poisoned) => poisoned.into_inner(),
            };
            let before = buf.len();
            write(&mut buf);
            buf.len() - before
        };
        self.pending.fetch_add(added, Ordering::Relaxed);
        self.notify.notify_one();
    }

    /// True while the bytes waiting exceed the budget (deliveries pause).
    pub fn is_full(&self) -> bool {
        self.pending.load(Ordering::Relaxed) >= self.budget
    }

    /// Bytes waiting for the socket.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    pub fn mark_starved(&self) {
        self.starved.store(true, Ordering::Relaxed);
    }

    /// Clears and returns the starved flag (the writer resumes dispatch when it was set).
    pub fn take_starved(&self) -> bool {
        self.starved.swap(false, Ordering::Relaxed)
    }

    /// Waits until there is something to write, then takes it all.
    pub async fn next_batch(&self) -> BytesMut {
        loop {
            let notified = self.notify.notified();
            {
                let mut buf = match self.buf.lock() {
                    Ok(b) => b,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if !buf.is_empty() {
                    return buf.split();
                }
            }
            if self.closed.load(Ordering::Relaxed) {
                return BytesMut::new();
            }
            notified.await;
        }
    }

    /// Takes whatever is queued without waiting.
    pub fn try_batch(&self) -> BytesMut {
        match self.buf.lock() {
            Ok(mut b) => b.split(),
            Err(poisoned) => poisoned.into_inner().split(),
        }
    }

    /// Records that `n` bytes reached the socket.
    pub fn written(&self, n: usize) {
        self.pending
            .fetch_sub(n.min(self.pending()), Ordering::Relaxed);
    }

    /// Stops accepting frames and wakes the writer so it can finish.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.notify.notify_one();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn batches_and_budget() {
        let o = WriteQueue::new(10);
        o.push(|b| b.extend_from_slice(b"hello"));
        assert!(!o.is_full());
        o.push(|b| b.extend_from_slice(b"world!"));
        assert!(o.is_full());
        let batch = o.next_batch().await;
        assert_eq!(&batch[..], b"helloworld!");
        o.written(batch.len());
        assert!(!o.is_full());
        o.close();
        assert!(o.next_batch().await.is_empty());
    }
}
