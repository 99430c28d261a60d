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
//! buffer. Replies to the client's own requests (a `basic.get-ok` with its message, confirms,
//! returns) are bounded the same way: once the queue holds twice its budget the connection
//! stops reading the client's frames until the writer has drained it below that
//! ([`WriteQueue::wait_for_room`]), so a client that sends requests without reading the
//! answers cannot grow it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use tokio::sync::Notify;

use crate::metrics::Metrics;

/// Encoded frames for one connection's socket, with a byte budget.
pub struct WriteQueue {
    buf: Mutex<BytesMut>,
    notify: Notify,
    /// Woken whenever bytes reach the socket (and on close), for [`Self::wait_for_room`].
    drained: Notify,
    pending: AtomicUsize,
    budget: usize,
    closed: AtomicBool,
    /// Set when the dispatcher skipped a consumer because the queue was over budget (set and
    /// taken under the `buf` lock; see [`Self::is_full_marking_starved`]).
    starved: AtomicBool,
    /// Where the bytes waiting are counted (`outbox_bytes`), for a connection's own queue.
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for WriteQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteQueue")
            .field("pending", &self.pending())
            .field("budget", &self.budget)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl WriteQueue {
    pub fn new(budget: usize) -> Self {
        WriteQueue::with_metrics(budget, None)
    }

    /// A write queue whose waiting bytes are counted in the `outbox_bytes` gauge of
    /// `metrics` (until written, or until the queue is dropped).
    pub fn counted(budget: usize, metrics: Arc<Metrics>) -> Self {
        WriteQueue::with_metrics(budget, Some(metrics))
    }

    fn with_metrics(budget: usize, metrics: Option<Arc<Metrics>>) -> Self {
        WriteQueue {
            buf: Mutex::new(BytesMut::with_capacity(16 * 1024)),
            notify: Notify::new(),
            drained: Notify::new(),
            pending: AtomicUsize::new(0),
            budget,
            closed: AtomicBool::new(false),
            starved: AtomicBool::new(false),
            metrics,
        }
    }

    fn count(&self, delta: i64) {
        if let Some(metrics) = &self.metrics {
            metrics.add_outbox_bytes(delta);
        }
    }

    /// Appends frames written by `write` and wakes the writer.
    pub fn push(&self, write: impl FnOnce(&mut BytesMut)) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let added = {
            let mut buf = self.lock_buf();
            let before = buf.len();
            write(&mut buf);
            let added = buf.len() - before;
            // Counted before the lock is released: a writer that takes these bytes in a batch
            // then finds them counted when it reports them written (counted after, they
            // would stay counted for ever and the queue would look fuller and fuller).
            self.pending.fetch_add(added, Ordering::Relaxed);
            added
        };
        self.count(added as i64);
        self.notify.notify_one();
    }

    /// True while the bytes waiting exceed the budget (deliveries pause).
    pub fn is_full(&self) -> bool {
        self.pending.load(Ordering::Relaxed) >= self.budget
    }

    /// True while the bytes waiting exceed twice the budget: the connection then stops reading
    /// the client's requests (deliveries alone stop at the budget, plus one message).
    pub fn is_over_read_limit(&self) -> bool {
        self.pending() >= self.budget.saturating_mul(2)
    }

    /// Waits until the bytes waiting are below twice the budget ([`Self::is_over_read_limit`])
    /// or the queue is closed.
    pub async fn wait_for_room(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if !self.is_over_read_limit() || self.is_closed() {
                return;
            }
            drained.await;
        }
    }

    /// Bytes waiting for the socket.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// For the dispatcher: whether the queue is too full to take a delivery. When it is, the
    /// connection is marked as skipped, and the writer resumes its dispatch once it has
    /// written enough ([`Self::take_starved_with_room`]). The mark is set, after a second look
    /// at the bytes waiting, under the lock the writer's check takes, so a writer draining the
    /// queue at that moment either sees the mark or has made the room the second look sees:
    /// a skipped connection is never left without a resume.
    pub fn is_full_marking_starved(&self) -> bool {
        if !self.is_full() {
            return false;
        }
        let _buf = self.lock_buf();
        if !self.is_full() {
            return false;
        }
        self.starved.store(true, Ordering::Relaxed);
        true
    }

    /// For the writer, after a write: whether the dispatcher skipped this connection while
    /// it was full and there is room now (the mark is cleared then; the caller resumes the
    /// connection's dispatch).
    pub fn take_starved_with_room(&self) -> bool {
        let _buf = self.lock_buf();
        !self.is_full() && self.starved.swap(false, Ordering::Relaxed)
    }

    fn lock_buf(&self) -> std::sync::MutexGuard<'_, BytesMut> {
        match self.buf.lock() {
            Ok(b) => b,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Waits until there is something to write, then takes it all.
    pub async fn next_batch(&self) -> BytesMut {
        loop {
            let notified = self.notify.notified();
            {
                let mut buf = self.lock_buf();
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
        self.lock_buf().split()
    }

    /// Records that `n` bytes reached the socket.
    pub fn written(&self, n: usize) {
        let n = n.min(self.pending());
        self.pending.fetch_sub(n, Ordering::Relaxed);
        self.count(-(n as i64));
        self.drained.notify_waiters();
    }

    /// Stops accepting frames and wakes the writer so it can finish.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.notify.notify_one();
        self.drained.notify_waiters();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

impl Drop for WriteQueue {
    fn drop(&mut self) {
        // Bytes that never reached the socket (the connection ended) leave the gauge too.
        self.count(-(self.pending() as i64));
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

    #[tokio::test]
    async fn reading_waits_for_room_below_twice_the_budget() {
        let o = Arc::new(WriteQueue::new(10));
        o.push(|b| b.extend_from_slice(b"0123456789012345678"));
        assert!(!o.is_over_read_limit(), "19 bytes: under twice the budget");
        o.wait_for_room().await;
        o.push(|b| b.extend_from_slice(b"9"));
        assert!(o.is_over_read_limit());
        let waiting = tokio::spawn({
            let o = o.clone();
            async move { o.wait_for_room().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "no room while 20 bytes wait");
        let batch = o.next_batch().await;
        o.written(batch.len());
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("room once written")
            .expect("the waiting task");
    }

    #[test]
    fn bytes_pushed_while_the_writer_takes_a_batch_are_all_counted_out() {
        // A push and the writer's batch race on two threads: whatever the writer takes and
        // reports written, the bytes waiting end at 0 once everything is written (no bytes
        // taken before they were counted, which `written` would then fail to count out).
        const PUSHES: usize = 200_000;
        let o = Arc::new(WriteQueue::new(usize::MAX));
        let pusher = std::thread::spawn({
            let o = o.clone();
            move || {
                for _ in 0..PUSHES {
                    o.push(|b| b.extend_from_slice(b"x"));
                }
            }
        });
        let mut written = 0;
        while written < PUSHES {
            let batch = o.try_batch();
            written += batch.len();
            o.written(batch.len());
        }
        pusher.join().expect("the pushing thread");
        assert_eq!(o.pending(), 0);
    }

    #[test]
    fn a_connection_skipped_while_full_is_resumed_once_there_is_room() {
        let o = WriteQueue::new(4);
        assert!(!o.is_full_marking_starved(), "room: not skipped");
        assert!(!o.take_starved_with_room(), "nobody skipped it");
        o.push(|b| b.extend_from_slice(b"12345"));
        assert!(o.is_full_marking_starved());
        let batch = o.try_batch();
        o.push(|b| b.extend_from_slice(b"6789"));
        o.written(batch.len());
        assert!(!o.take_starved_with_room(), "still full: the mark stays");
        let batch = o.try_batch();
        o.written(batch.len());
        assert!(o.take_starved_with_room());
        assert!(!o.take_starved_with_room(), "resumed once");
    }

    #[tokio::test]
    async fn a_counted_queue_keeps_the_outbox_gauge() {
        let metrics = Metrics::new(10);
        let gauge = |n: i64| {
            metrics
                .encode()
                .contains(&format!("dlx_proxy_outbox_bytes {n}\n"))
        };
        let o = WriteQueue::counted(1 << 20, metrics.clone());
        o.push(|b| b.extend_from_slice(b"hello"));
        o.push(|b| b.extend_from_slice(b"world!"));
        assert!(gauge(11));
        let batch = o.next_batch().await;
        o.written(4);
        assert!(gauge(7));
        o.written(batch.len());
        assert!(gauge(0), "no more than what was queued leaves it");
        o.push(|b| b.extend_from_slice(b"left behind"));
        assert!(gauge(11));
        drop(o);
        assert!(gauge(0));
    }
}
