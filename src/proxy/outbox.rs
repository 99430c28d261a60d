//! Byte-counted outboxes: one writer task per socket half, fed by the connection task.
//!
//! The connection task never waits on a socket write. It hands encoded frames to an
//! [`Outbox`] and checks [`Outbox::is_full`] before it reads the next frame that would be
//! forwarded into that outbox; when a peer reads slowly its outbox fills, the connection task
//! stops reading from the other side and TCP backpressure does the rest. The writer task
//! batches queued frames into few writes and wakes the connection task as bytes drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::metrics::{Direction, Metrics};

/// Most bytes gathered into one socket write.
const WRITE_BATCH: usize = 64 * 1024;

#[derive(Debug, Default)]
struct OutboxState {
    queued: AtomicUsize,
    drained: Notify,
    failed: AtomicBool,
}

/// The sending side of one socket's writer task.
pub struct Outbox {
    sender: mpsc::UnboundedSender<Bytes>,
    state: Arc<OutboxState>,
    limit: usize,
    count_outbox_gauge: bool,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("queued", &self.queued())
            .field("limit", &self.limit)
            .finish()
    }
}

impl Outbox {
    /// Queues bytes for the socket; `false` once the writer has stopped.
    pub fn send(&self, bytes: Bytes) -> bool {
        if bytes.is_empty() {
            return true;
        }
        let len = bytes.len();
        self.state.queued.fetch_add(len, Ordering::AcqRel);
        if self.count_outbox_gauge {
            self.metrics.add_outbox_bytes(len as i64);
        }
        if self.sender.send(bytes).is_err() {
            self.state.queued.fetch_sub(len, Ordering::AcqRel);
            if self.count_outbox_gauge {
                self.metrics.add_outbox_bytes(-(len as i64));
            }
            return false;
        }
        true
    }

    /// Bytes waiting for the socket.
    pub fn queued(&self) -> usize {
        self.state.queued.load(Ordering::Acquire)
    }

    /// Whether the connection task should stop feeding this outbox.
    pub fn is_full(&self) -> bool {
        self.queued() >= self.limit
    }

    /// Whether the socket write failed (the peer is gone).
    pub fn has_failed(&self) -> bool {
        self.state.failed.load(Ordering::Acquire)
    }

    /// Resolves after the writer made progress (or failed). Cancel-safe.
    pub async fn progressed(&self) {
        self.state.drained.notified().await;
    }

    /// A handle that waits for progress without borrowing the outbox.
    pub fn progress_signal(&self) -> ProgressSignal {
        ProgressSignal(self.state.clone())
    }
}

/// Waits for an outbox's writer to make progress (see [`Outbox::progress_signal`]).
#[derive(Clone, Debug)]
pub struct ProgressSignal(Arc<OutboxState>);

impl ProgressSignal {
    /// Resolves after the writer made progress (or failed). Cancel-safe.
    pub async fn progressed(&self) {
        self.0.drained.notified().await;
    }
}

/// A writer task for `writer` and the outbox that feeds it. The task ends when the outbox is
/// dropped (after writing what was queued and shutting the socket down) or on a write error.
pub fn spawn_writer<W>(
    writer: W,
    limit: usize,
    direction: Direction,
    metrics: Arc<Metrics>,
) -> (Outbox, JoinHandle<()>)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (sender, receiver) = mpsc::unbounded_channel();
    let state = Arc::new(OutboxState::default());
    let count_outbox_gauge = direction == Direction::ClientOut;
    let outbox = Outbox {
        sender,
        state: state.clone(),
        limit: limit.max(1),
        count_outbox_gauge,
        metrics: metrics.clone(),
    };
    let task = tokio::spawn(write_loop(
        writer,
        receiver,
        state,
        direction,
        metrics,
        count_outbox_gauge,
    ));
    (outbox, task)
}

async fn write_loop<W>(
    mut writer: W,
    mut receiver: mpsc::UnboundedReceiver<Bytes>,
    state: Arc<OutboxState>,
    direction: Direction,
    metrics: Arc<Metrics>,
    count_outbox_gauge: bool,
) where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut batch = BytesMut::with_capacity(WRITE_BATCH);
    while let Some(first) = receiver.recv().await {
        let mut taken = first.len();
        let mut frames = 1u64;
        let result = if first.len() >= WRITE_BATCH {
            writer.write_all(&first).await
        } else {
            batch.clear();
            batch.extend_from_slice(&first);
            while batch.len() < WRITE_BATCH {
                match receiver.try_recv() {
                    Ok(more) => {
                        taken += more.len();
                        frames += 1;
                        batch.extend_from_slice(&more);
                    }
                    Err(_) => break,
                }
            }
            writer.write_all(&batch).await
        };
        let result = match result {
            Ok(()) if receiver.is_empty() => writer.flush().await,
            other => other,
        };
        state.queued.fetch_sub(taken, Ordering::AcqRel);
        if count_outbox_gauge {
            metrics.add_outbox_bytes(-(taken as i64));
        }
        metrics.traffic(direction, frames, taken as u64);
        if let Err(err) = result {
            tracing::debug!(%err, direction = direction.as_str(), "socket write failed");
            state.failed.store(true, Ordering::Release);
            state.drained.notify_one();
            // Release what is still queued so gauges stay right.
            receiver.close();
            while let Ok(rest) = receiver.try_recv() {
                state.queued.fetch_sub(rest.len(), Ordering::AcqRel);
                if count_outbox_gauge {
                    metrics.add_outbox_bytes(-(rest.len() as i64));
                }
            }
            return;
        }
        state.drained.notify_one();
    }
    let _ = writer.flush().await;
    let _ = writer.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn writes_in_order_and_counts_bytes() {
        let (a, mut b) = tokio::io::duplex(1024);
        let metrics = Metrics::new(10);
        let (outbox, task) = spawn_writer(a, 8, Direction::ClientOut, metrics);
        assert!(outbox.send(Bytes::from_static(b"hello ")));
        assert!(outbox.send(Bytes::from_static(b"world")));
        assert!(outbox.queued() <= 11);
        drop(outbox);
        let mut got = String::new();
        b.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "hello world");
        task.await.unwrap();
    }

    #[tokio::test]
    async fn reports_fullness_while_the_peer_does_not_read() {
        let (a, mut b) = tokio::io::duplex(16);
        let metrics = Metrics::new(10);
        let (outbox, _task) = spawn_writer(a, 32, Direction::UpstreamOut, metrics);
        outbox.send(Bytes::from(vec![1u8; 64]));
        tokio::task::yield_now().await;
        assert!(outbox.is_full());
        let mut sink = vec![0u8; 64];
        b.read_exact(&mut sink).await.unwrap();
        while outbox.is_full() {
            outbox.progressed().await;
        }
        assert_eq!(outbox.queued(), 0);
    }

    #[tokio::test]
    async fn marks_failure_when_the_peer_is_gone() {
        let (a, b) = tokio::io::duplex(16);
        drop(b);
        let metrics = Metrics::new(10);
        let (outbox, task) = spawn_writer(a, 32, Direction::ClientOut, metrics);
        outbox.send(Bytes::from_static(b"x"));
        task.await.unwrap();
        assert!(outbox.has_failed());
        assert!(!outbox.send(Bytes::from_static(b"y")));
    }
}
