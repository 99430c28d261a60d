//! Byte-counted outboxes: one writer task per socket half, fed by the connection task.
//!
//! The connection task never waits on a socket write. It hands encoded frames to an
//! [`Outbox`] and checks [`Outbox::is_full`] before it reads the next frame that would be
//! forwarded into that outbox; when a peer reads slowly its outbox fills, the connection task
//! stops reading from the other side and TCP backpressure does the rest.
//!
//! Small frames are gathered in the outbox and handed to the writer as one piece when the
//! connection task calls [`Outbox::flush`] (once per turn of its loop, before it waits), so a
//! burst of frames costs one hand-over and one socket write instead of one per frame. Large
//! frames go as they are (no copy). The writer wakes the connection task as bytes drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::metrics::{Direction, Metrics};

/// Most bytes gathered into one socket write.
const WRITE_BATCH: usize = 64 * 1024;

/// Frames at least this large are handed to the writer as they are instead of being copied
/// into the gathered batch.
const GATHER_FRAME_MAX: usize = 8 * 1024;

#[derive(Debug, Default)]
struct OutboxState {
    queued: AtomicUsize,
    drained: Notify,
    failed: AtomicBool,
}

/// The sending side of one socket's writer task.
pub struct Outbox {
    sender: mpsc::UnboundedSender<Piece>,
    state: Arc<OutboxState>,
    limit: usize,
    count_outbox_gauge: bool,
    metrics: Arc<Metrics>,
    /// Small frames queued since the last flush, in order (counted in `queued` already).
    gathered: BytesMut,
    gathered_frames: u64,
}

/// What the writer gets: one frame, or several gathered ones.
#[derive(Debug)]
struct Piece {
    bytes: Bytes,
    frames: u64,
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
    /// Queues bytes for the socket; `false` once the writer has stopped. Small frames wait in
    /// the outbox until [`Outbox::flush`].
    pub fn send(&mut self, bytes: Bytes) -> bool {
        if bytes.is_empty() {
            return true;
        }
        if self.sender.is_closed() {
            return false;
        }
        let len = bytes.len();
        self.state.queued.fetch_add(len, Ordering::AcqRel);
        if self.count_outbox_gauge {
            self.metrics.add_outbox_bytes(len as i64);
        }
        if len >= GATHER_FRAME_MAX {
            // Order: what was gathered before goes first.
            return self.flush() && self.hand_over(Piece { bytes, frames: 1 });
        }
        self.gathered.extend_from_slice(&bytes);
        self.gathered_frames += 1;
        if self.gathered.len() >= WRITE_BATCH {
            return self.flush();
        }
        true
    }

    /// Hands the gathered frames to the writer; `false` once the writer has stopped.
    pub fn flush(&mut self) -> bool {
        if self.gathered.is_empty() {
            return true;
        }
        let piece = Piece {
            bytes: self.gathered.split().freeze(),
            frames: std::mem::take(&mut self.gathered_frames),
        };
        self.hand_over(piece)
    }

    fn hand_over(&mut self, piece: Piece) -> bool {
        let len = piece.bytes.len();
        if self.sender.send(piece).is_err() {
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

impl Drop for Outbox {
    fn drop(&mut self) {
        // What was gathered is still written (a final close-ok) before the writer ends.
        self.flush();
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
        gathered: BytesMut::new(),
        gathered_frames: 0,
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
    mut receiver: mpsc::UnboundedReceiver<Piece>,
    state: Arc<OutboxState>,
    direction: Direction,
    metrics: Arc<Metrics>,
    count_outbox_gauge: bool,
) where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut batch = BytesMut::new();
    while let Some(first) = receiver.recv().await {
        let mut taken = first.bytes.len();
        let mut frames = first.frames;
        let result = match receiver.try_recv() {
            // The common case: one gathered piece at a time, written without a copy.
            Err(_) => writer.write_all(&first.bytes).await,
            Ok(second) => {
                batch.clear();
                batch.extend_from_slice(&first.bytes);
                batch.extend_from_slice(&second.bytes);
                taken += second.bytes.len();
                frames += second.frames;
                while batch.len() < WRITE_BATCH {
                    match receiver.try_recv() {
                        Ok(more) => {
                            taken += more.bytes.len();
                            frames += more.frames;
                            batch.extend_from_slice(&more.bytes);
                        }
                        Err(_) => break,
                    }
                }
                writer.write_all(&batch).await
            }
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
                state.queued.fetch_sub(rest.bytes.len(), Ordering::AcqRel);
                if count_outbox_gauge {
                    metrics.add_outbox_bytes(-(rest.bytes.len() as i64));
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
        let (mut outbox, task) = spawn_writer(a, 8, Direction::ClientOut, metrics);
        assert!(outbox.send(Bytes::from_static(b"hello ")));
        assert!(outbox.send(Bytes::from_static(b"world")));
        assert!(outbox.queued() <= 11);
        // Dropping the outbox hands over what was gathered.
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
        let (mut outbox, _task) = spawn_writer(a, 32, Direction::UpstreamOut, metrics);
        outbox.send(Bytes::from(vec![1u8; 64]));
        assert!(outbox.is_full(), "gathered bytes count before the flush");
        outbox.flush();
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
        let (mut outbox, task) = spawn_writer(a, 32, Direction::ClientOut, metrics);
        outbox.send(Bytes::from_static(b"x"));
        outbox.flush();
        task.await.unwrap();
        assert!(outbox.has_failed());
        assert!(!outbox.send(Bytes::from_static(b"y")));
    }

    #[tokio::test]
    async fn large_frames_keep_their_place_between_gathered_ones() {
        let (a, mut b) = tokio::io::duplex(64 * 1024);
        let metrics = Metrics::new(10);
        let (mut outbox, task) = spawn_writer(a, 1 << 20, Direction::ClientOut, metrics.clone());
        let large = vec![b'b'; GATHER_FRAME_MAX + 10];
        assert!(outbox.send(Bytes::from_static(b"a")));
        assert!(outbox.send(Bytes::from(large.clone())));
        assert!(outbox.send(Bytes::from_static(b"c")));
        assert_eq!(outbox.queued(), large.len() + 2);
        outbox.flush();
        drop(outbox);
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        task.await.unwrap();
        let mut expected = b"a".to_vec();
        expected.extend_from_slice(&large);
        expected.push(b'c');
        assert_eq!(got, expected);
        let text = metrics.encode();
        assert!(
            text.contains("dlx_proxy_frames_total{direction=\"client_out\"} 3"),
            "three frames counted, however they were written: {text}"
        );
    }
}
