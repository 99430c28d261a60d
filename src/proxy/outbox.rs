//! Byte-counted outboxes: what the connection has to write to one socket half, written by the
//! connection task itself as the socket accepts it.
//!
//! The outbox holds bytes only; the socket's write half is the task's, passed to
//! [`Outbox::write_some`] and [`Outbox::close`]. So the session state that fills outboxes
//! (`super::client_session`) owns no socket and runs in unit tests, which take what it queued
//! with [`Outbox::take_queued`].
//!
//! The connection task never waits on a socket write. It hands encoded frames to an
//! [`Outbox`] and checks [`Outbox::is_full`] before it reads the next frame that would be
//! forwarded into that outbox; when a peer reads slowly its outbox fills, the connection task
//! stops reading from the other side and TCP backpressure does the rest. While an outbox holds
//! bytes, the connection loop also waits on [`Outbox::write_some`], which writes what the
//! socket takes (vectored, several frames per system call) and returns after any progress.
//!
//! Writing from the connection task, instead of handing frames to a writer task, keeps a
//! forwarded frame on one thread: no channel, no cross-thread wake-up per burst. Small frames
//! and short runs are gathered into one buffer (fewer, larger writes); large frames and long
//! pass-through runs are queued as they are, sharing the read buffer they were cut from (no
//! copy, and a bounded number of read buffers kept alive, `SHARED_BUFFERS_MAX`).

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::metrics::{Direction, Metrics};

/// Frames smaller than this are copied into the gathering buffer; larger ones are queued as
/// they are. As large as the largest read ([`super::wire::READ_CHUNK_MAX`]), so a frame kept
/// as it is never holds on to a read buffer much larger than itself.
pub(super) const GATHER_FRAME_MAX: usize = super::wire::READ_CHUNK_MAX;

/// The room of a new gathering buffer (more when the frame needs it).
const GATHER_RESERVE: usize = 16 * 1024;

/// A gathering buffer that lacks room is kept (its unwritten rest moved to its start) while
/// that rest is at most this much; a larger one becomes a piece of its own.
const GATHER_KEEP_REST: usize = 4 * 1024;

/// A gathering buffer is queued once it holds this much.
const GATHER_MAX: usize = 64 * 1024;

/// A pass-through run this long or longer is queued without a copy ([`Outbox::send_run`]).
pub(super) const RUN_SHARE_MIN: usize = 2 * 1024;

/// Most writes one [`Outbox::poll_drain`] makes before it returns, so that one busy socket
/// does not keep the connection loop from its other work.
const DRAIN_WRITES: usize = 8;

/// Most read buffers that the runs queued in one outbox without a copy keep alive. A shared
/// run keeps its read buffer's allocation (at most [`super::wire::READ_CHUNK_MAX`], or one
/// frame and a read) until it is written, whatever else of that buffer was consumed. At this
/// many buffers the outbox counts as full ([`Outbox::is_full`]), so the reader waits for a
/// write rather than read into another buffer; a run past the bound all the same (from a side
/// read whatever the outbox holds, such as one that is closing) is copied. So an outbox holds
/// at most its byte limit plus this many read buffers: 512 KiB with reads of the largest size,
/// more only where a frame larger than a read had a buffer of its own.
pub(super) const SHARED_BUFFERS_MAX: usize = 16;

/// Most pieces handed to one vectored write.
const WRITE_SLICES: usize = 64;

/// A socket's write half, as the outbox sees it.
pub type SocketWriter = Pin<Box<dyn AsyncWrite + Send>>;

/// The bytes waiting for one socket.
pub struct Outbox {
    /// Pieces in order; the first may be partly written.
    pieces: VecDeque<Bytes>,
    /// Small frames queued after the last piece, not yet a piece of their own.
    gathered: BytesMut,
    /// Pieces popped so far: `pieces[i]` is piece number `popped + i`.
    popped: u64,
    /// The numbers of the queued pieces that are shared runs starting on a read buffer the
    /// pieces before them do not hold (ascending): one per read buffer kept alive, but for
    /// the front piece's.
    buffer_starts: VecDeque<u64>,
    /// Where the last shared run ends (its address): a run that starts there was cut from
    /// the same read buffer.
    shared_end: usize,
    /// Bytes in `pieces` and `gathered`.
    queued: usize,
    limit: usize,
    /// Written bytes since the last flush (TLS streams buffer inside).
    unflushed: bool,
    failed: bool,
    direction: Direction,
    metrics: Arc<Metrics>,
    /// Traffic not yet added to the metrics (added after each write).
    unreported_frames: u64,
    unreported_bytes: u64,
    /// Change of the queued bytes not yet in this direction's gauge: queuing adds to it
    /// frame by frame, and it reaches the gauge in one step at the next write, discard or
    /// [`Outbox::report_gauge`] (the session calls it before each wait).
    unreported_queued: i64,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("queued", &self.queued)
            .field("limit", &self.limit)
            .field("failed", &self.failed)
            .finish()
    }
}

impl Outbox {
    /// An outbox full at `limit` bytes.
    pub fn new(limit: usize, direction: Direction, metrics: Arc<Metrics>) -> Self {
        Outbox {
            pieces: VecDeque::new(),
            gathered: BytesMut::new(),
            popped: 0,
            buffer_starts: VecDeque::new(),
            shared_end: 0,
            queued: 0,
            limit: limit.max(1),
            unflushed: false,
            failed: false,
            direction,
            metrics,
            unreported_frames: 0,
            unreported_bytes: 0,
            unreported_queued: 0,
        }
    }

    /// Queues one frame (or several, encoded back to back); `false` once the socket failed.
    pub fn send(&mut self, bytes: Bytes) -> bool {
        if self.failed {
            return false;
        }
        if bytes.is_empty() {
            return true;
        }
        self.count(bytes.len(), 1);
        if bytes.len() >= GATHER_FRAME_MAX {
            self.seal_gathered();
            self.pieces.push_back(bytes);
        } else {
            self.gather(&bytes);
        }
        true
    }

    /// Queues a run of `frames` complete frames, the first `len` bytes of the read buffer
    /// `unread` (the pass-through runs of the proxy's `passthrough`), and takes them from it;
    /// `false` once the socket failed (the bytes are taken all the same). A run of at least
    /// `RUN_SHARE_MIN` bytes is cut from the buffer and queued as it is, sharing the read
    /// buffer's allocation (no copy), while the shared runs waiting keep fewer than
    /// `SHARED_BUFFERS_MAX` read buffers alive. A shorter run, or one past that bound, is
    /// copied into the gathering buffer straight from the read buffer, which is only advanced:
    /// no cut, so no shared count to take and drop, for the runs of a few small frames that
    /// most turns of the connection loop carry.
    pub fn send_run(&mut self, unread: &mut BytesMut, len: usize, frames: u64) -> bool {
        let len = len.min(unread.len());
        if self.failed {
            unread.advance(len);
            return false;
        }
        if len == 0 {
            return true;
        }
        self.count(len, frames);
        // A run that starts where the last shared one ended was cut from the same buffer
        // (the reader moves forward through a buffer and never returns to an old one).
        let start = unread.as_ptr() as usize;
        let new_buffer = start != self.shared_end;
        if len < RUN_SHARE_MIN || (new_buffer && self.buffer_starts.len() >= SHARED_BUFFERS_MAX) {
            self.gather(&unread[..len]);
            unread.advance(len);
            return true;
        }
        self.seal_gathered();
        if new_buffer {
            self.buffer_starts
                .push_back(self.popped + self.pieces.len() as u64);
            self.metrics.add_outbox_read_buffers(1);
        }
        self.shared_end = start + len;
        self.pieces.push_back(unread.split_to(len).freeze());
        true
    }

    /// Read buffers that shared runs waiting in this outbox keep alive, at most (for tests).
    #[cfg(test)]
    fn shared_buffers(&self) -> usize {
        self.buffer_starts.len() + 1
    }

    /// Changes the gauge of this outbox's direction by `delta` bytes, at the next report.
    fn gauge_bytes(&mut self, delta: i64) {
        self.unreported_queued += delta;
    }

    /// Adds the change of the queued bytes since the last report to the gauge of this
    /// outbox's direction: one update per turn of the connection loop rather than one per
    /// frame queued.
    pub fn report_gauge(&mut self) {
        let delta = std::mem::take(&mut self.unreported_queued);
        if delta == 0 {
            return;
        }
        match self.direction {
            Direction::ClientOut => self.metrics.add_outbox_bytes(delta),
            Direction::UpstreamOut => self.metrics.add_upstream_outbox_bytes(delta),
            Direction::ClientIn | Direction::UpstreamIn => {}
        }
    }

    fn count(&mut self, len: usize, frames: u64) {
        self.queued += len;
        self.unreported_frames += frames;
        self.gauge_bytes(len as i64);
    }

    /// Copies bytes into the gathering buffer.
    fn gather(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = self.gathered.capacity() - self.gathered.len();
            if room < bytes.len().min(GATHER_RESERVE) {
                // A full buffer becomes a piece of its own and a new one is made, with room
                // for a run of small frames: growing it instead would copy what it holds
                // again. A buffer written from down to a small rest keeps its allocation
                // instead (the rest moves to its start).
                if self.gathered.len() > GATHER_KEEP_REST {
                    self.seal_gathered();
                }
                // Buffers of one of two sizes, which the allocator hands out again once
                // written (a long run is copied into several).
                let size = if bytes.len() > GATHER_RESERVE {
                    GATHER_MAX
                } else {
                    GATHER_RESERVE
                };
                self.gathered.reserve(size);
                continue;
            }
            let n = room.min(bytes.len());
            self.gathered.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.gathered.len() >= GATHER_MAX {
                self.seal_gathered();
            }
        }
    }

    /// Whether the outbox is full once `more` bytes are added.
    pub fn is_full_with(&self, more: usize) -> bool {
        self.queued + more >= self.limit
    }

    fn seal_gathered(&mut self) {
        if !self.gathered.is_empty() {
            self.pieces.push_back(self.gathered.split().freeze());
        }
    }

    /// Bytes waiting for the socket.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Whether the connection task should stop feeding this outbox: its byte limit is reached,
    /// or the runs waiting in it keep as many read buffers alive as shared runs may
    /// (`SHARED_BUFFERS_MAX`). Reading on past that would only have the next runs copied:
    /// waiting for a write to release a buffer costs nothing, the copy costs a pass over every
    /// byte (14 % of the proxy's user time with 4 KiB messages behind a slower upstream).
    pub fn is_full(&self) -> bool {
        self.queued >= self.limit || self.buffer_starts.len() >= SHARED_BUFFERS_MAX
    }

    /// Whether a socket write failed (the peer is gone); nothing is queued after that.
    pub fn has_failed(&self) -> bool {
        self.failed
    }

    /// Whether there is anything to write or flush.
    pub fn has_work(&self) -> bool {
        !self.failed && (self.queued > 0 || self.unflushed)
    }

    /// Everything queued, as if written (counted in the metrics the same way): for a caller
    /// that sends the bytes elsewhere, such as a test.
    pub fn take_queued(&mut self) -> Bytes {
        self.seal_gathered();
        let mut all = BytesMut::with_capacity(self.queued);
        for piece in &self.pieces {
            all.extend_from_slice(piece);
        }
        let n = all.len();
        if n > 0 {
            self.consume(n);
        }
        self.unflushed = false;
        all.freeze()
    }

    /// Writes what `writer` accepts now; resolves after any progress (or a failure).
    /// Cancel-safe: what was written is accounted for before it resolves.
    pub async fn write_some(&mut self, writer: &mut SocketWriter) {
        poll_fn(|cx| self.poll_drain(writer, cx)).await
    }

    /// Writes what `writer` accepts now, write after write, until the outbox is written and
    /// flushed, the socket takes no more (its readiness is then registered with `cx`) or
    /// `DRAIN_WRITES` (8) writes were made. Ready after any progress, a failure, or with nothing
    /// to do; pending when the socket took nothing. So one call does what would otherwise
    /// take a turn of the connection loop per write, and one more for the flush.
    pub fn poll_drain(&mut self, writer: &mut SocketWriter, cx: &mut Context<'_>) -> Poll<()> {
        let mut progressed = false;
        for _ in 0..DRAIN_WRITES {
            if !self.has_work() {
                return Poll::Ready(());
            }
            match self.poll_write_some(writer, cx) {
                Poll::Ready(()) => progressed = true,
                Poll::Pending if progressed => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(())
    }

    fn poll_write_some(&mut self, writer: &mut SocketWriter, cx: &mut Context<'_>) -> Poll<()> {
        if self.failed {
            return Poll::Ready(());
        }
        if self.pieces.is_empty() && self.gathered.is_empty() {
            if !self.unflushed {
                return Poll::Ready(());
            }
            return match writer.as_mut().poll_flush(cx) {
                Poll::Ready(Ok(())) => {
                    self.unflushed = false;
                    Poll::Ready(())
                }
                Poll::Ready(Err(err)) => {
                    self.fail(&err);
                    Poll::Ready(())
                }
                Poll::Pending => Poll::Pending,
            };
        }
        if !self.pieces.is_empty() {
            self.seal_gathered();
        }
        let written = if self.pieces.is_empty() {
            // Only gathered frames: written from the gathering buffer itself, which keeps its
            // allocation for the next frames (no buffer made and freed per write).
            writer.as_mut().poll_write(cx, &self.gathered)
        } else if self.pieces.len() > 1 && writer.is_write_vectored() {
            // On the stack: no allocation per write.
            let mut slices = [IoSlice::new(&[]); WRITE_SLICES];
            for (slice, piece) in slices.iter_mut().zip(&self.pieces) {
                *slice = IoSlice::new(piece);
            }
            let count = self.pieces.len().min(WRITE_SLICES);
            writer.as_mut().poll_write_vectored(cx, &slices[..count])
        } else {
            match self.pieces.front() {
                Some(front) => writer.as_mut().poll_write(cx, front),
                None => Poll::Ready(Ok(0)),
            }
        };
        match written {
            Poll::Ready(Ok(0)) => {
                self.fail(&std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "socket accepted no bytes",
                ));
                Poll::Ready(())
            }
            Poll::Ready(Ok(n)) => {
                self.consume(n);
                Poll::Ready(())
            }
            Poll::Ready(Err(err)) => {
                self.fail(&err);
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Drops `n` written bytes from the front and accounts for them.
    fn consume(&mut self, mut n: usize) {
        self.queued -= n;
        self.unflushed = true;
        self.gauge_bytes(-(n as i64));
        self.report_gauge();
        self.unreported_bytes += n as u64;
        while n > 0 {
            let Some(front) = self.pieces.front_mut() else {
                // The rest was written from the gathering buffer.
                self.gathered.advance(n.min(self.gathered.len()));
                break;
            };
            if front.len() <= n {
                n -= front.len();
                self.pop_piece();
            } else {
                front.advance(n);
                n = 0;
            }
        }
        if self.queued == 0 {
            self.report_traffic();
        } else if self.unreported_bytes >= GATHER_MAX as u64 {
            // Frames are counted when queued; bytes as they are written.
            self.report_traffic();
        }
    }

    /// Drops the front piece (written).
    fn pop_piece(&mut self) {
        if let Some(front) = self.pieces.pop_front()
            && front.as_ptr() as usize + front.len() == self.shared_end
        {
            // The last shared run is written: its buffer may be freed, and a new one could
            // start at the same address.
            self.shared_end = 0;
        }
        if self.buffer_starts.front() == Some(&self.popped) {
            self.buffer_starts.pop_front();
            self.metrics.add_outbox_read_buffers(-1);
        }
        self.popped += 1;
    }

    /// Drops everything queued (the socket is gone), taking it out of the gauges.
    fn discard_queued(&mut self) {
        if self.queued > 0 {
            self.gauge_bytes(-(self.queued as i64));
        }
        self.report_gauge();
        self.queued = 0;
        self.popped += self.pieces.len() as u64;
        self.pieces.clear();
        self.metrics
            .add_outbox_read_buffers(-(self.buffer_starts.len() as i64));
        self.buffer_starts.clear();
        self.shared_end = 0;
        self.gathered.clear();
    }

    fn report_traffic(&mut self) {
        let frames = std::mem::take(&mut self.unreported_frames);
        let bytes = std::mem::take(&mut self.unreported_bytes);
        self.metrics.traffic(self.direction, frames, bytes);
    }

    fn fail(&mut self, err: &std::io::Error) {
        tracing::debug!(%err, direction = self.direction.as_str(), "socket write failed");
        self.failed = true;
        self.discard_queued();
        self.unflushed = false;
        self.report_traffic();
    }

    /// Writes what is queued to `writer` (for at most `grace`), then shuts it down.
    pub async fn close(&mut self, writer: &mut SocketWriter, grace: Duration) {
        let drain = async {
            while self.has_work() {
                self.write_some(writer).await;
            }
        };
        let _ = tokio::time::timeout(grace, drain).await;
        if !self.failed {
            let _ = tokio::time::timeout(grace, writer.shutdown()).await;
        }
        self.discard_queued();
        self.report_traffic();
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // Keep the gauges right for bytes that never reached the socket.
        self.discard_queued();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn drain(outbox: &mut Outbox, writer: &mut SocketWriter) {
        while outbox.has_work() {
            outbox.write_some(writer).await;
        }
    }

    fn writer(w: tokio::io::DuplexStream) -> SocketWriter {
        Box::pin(w)
    }

    /// Everything the peer reads until the stream ends.
    fn read_all(mut b: tokio::io::DuplexStream) -> tokio::task::JoinHandle<Vec<u8>> {
        tokio::spawn(async move {
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.unwrap();
            got
        })
    }

    /// Writes what is queued, ends the stream, and returns what the peer read.
    async fn close_and_read(
        mut outbox: Outbox,
        mut w: SocketWriter,
        reader: tokio::task::JoinHandle<Vec<u8>>,
    ) -> Vec<u8> {
        outbox.close(&mut w, Duration::from_secs(5)).await;
        drop(outbox);
        drop(w);
        reader.await.unwrap()
    }

    /// More pieces than one vectored write takes, through a socket that writes vectored:
    /// every byte arrives, in order.
    #[tokio::test]
    async fn pieces_past_one_vectored_write_arrive_whole_and_in_order() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (client, accepted) = tokio::join!(
            tokio::net::TcpStream::connect(listener.local_addr().unwrap()),
            listener.accept()
        );
        let (mut peer, _) = accepted.unwrap();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut w: SocketWriter = Box::pin(client.unwrap());
        assert!(w.is_write_vectored());
        let mut outbox = Outbox::new(usize::MAX, Direction::ClientOut, Metrics::new(10));
        let mut expected = Vec::new();
        for i in 0..(WRITE_SLICES as u8 + 36) {
            // A small frame (gathered) and a large one (a piece of its own) each time.
            let small = Bytes::from(vec![i; 10]);
            let large = Bytes::from(vec![i.wrapping_add(128); GATHER_FRAME_MAX]);
            expected.extend_from_slice(&small);
            expected.extend_from_slice(&large);
            assert!(outbox.send(small));
            assert!(outbox.send(large));
        }
        outbox.seal_gathered();
        assert!(outbox.pieces.len() > WRITE_SLICES);
        outbox.close(&mut w, Duration::from_secs(5)).await;
        drop(w);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes arrive in the order queued");
    }

    #[tokio::test]
    async fn writes_in_order_and_counts_bytes() {
        let (a, mut b) = tokio::io::duplex(1024);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(8, Direction::ClientOut, metrics.clone());
        assert!(outbox.send(Bytes::from_static(b"hello ")));
        assert!(outbox.send(Bytes::from_static(b"world")));
        assert_eq!(outbox.queued(), 11);
        assert!(outbox.is_full());
        outbox.close(&mut w, Duration::from_secs(1)).await;
        let mut got = String::new();
        b.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "hello world");
        let text = metrics.encode();
        assert!(text.contains(r#"dlx_proxy_frames_total{direction="client_out"} 2"#));
        assert!(text.contains(r#"dlx_proxy_bytes_total{direction="client_out"} 11"#));
        assert!(text.contains("dlx_proxy_outbox_bytes 0"), "{text}");
    }

    #[tokio::test]
    async fn stays_full_while_the_peer_does_not_read() {
        let (a, mut b) = tokio::io::duplex(16);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(32, Direction::UpstreamOut, metrics);
        outbox.send(Bytes::from(vec![1u8; 64]));
        assert!(outbox.is_full());
        // The pipe takes 16 bytes; then the write waits for the reader.
        outbox.write_some(&mut w).await;
        assert_eq!(outbox.queued(), 48);
        let blocked =
            tokio::time::timeout(Duration::from_millis(50), outbox.write_some(&mut w)).await;
        assert!(blocked.is_err(), "no progress without a reader");
        assert!(outbox.is_full());
        let reader = tokio::spawn(async move {
            let mut sink = vec![0u8; 64];
            b.read_exact(&mut sink).await.unwrap();
            sink
        });
        drain(&mut outbox, &mut w).await;
        assert_eq!(outbox.queued(), 0);
        assert_eq!(reader.await.unwrap(), vec![1u8; 64]);
    }

    #[tokio::test]
    async fn marks_failure_when_the_peer_is_gone() {
        let (a, b) = tokio::io::duplex(16);
        drop(b);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(32, Direction::ClientOut, metrics.clone());
        outbox.send(Bytes::from_static(b"x"));
        drain(&mut outbox, &mut w).await;
        assert!(outbox.has_failed());
        assert!(!outbox.send(Bytes::from_static(b"y")));
        assert_eq!(outbox.queued(), 0);
        assert!(metrics.encode().contains("dlx_proxy_outbox_bytes 0"));
    }

    #[tokio::test]
    async fn large_frames_keep_their_place_between_gathered_ones() {
        let (a, mut b) = tokio::io::duplex(64 * 1024);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(1 << 20, Direction::ClientOut, metrics.clone());
        let large = vec![b'b'; GATHER_FRAME_MAX + 10];
        assert!(outbox.send(Bytes::from_static(b"a")));
        assert!(outbox.send(Bytes::from(large.clone())));
        assert!(outbox.send(Bytes::from_static(b"c")));
        assert_eq!(outbox.queued(), large.len() + 2);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.unwrap();
            got
        });
        outbox.close(&mut w, Duration::from_secs(1)).await;
        drop(outbox);
        drop(w);
        let mut expected = b"a".to_vec();
        expected.extend_from_slice(&large);
        expected.push(b'c');
        assert_eq!(reader.await.unwrap(), expected);
        let text = metrics.encode();
        assert!(
            text.contains(r#"dlx_proxy_frames_total{direction="client_out"} 3"#),
            "three frames counted, however they were written: {text}"
        );
    }

    #[tokio::test]
    async fn small_frames_past_one_gathering_buffer_arrive_whole_and_in_order() {
        // A slow reader: writes are partial, and frames keep coming in between.
        let (a, b) = tokio::io::duplex(1000);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(1 << 20, Direction::ClientOut, metrics.clone());
        let frames: Vec<Vec<u8>> = (0..2000u32)
            .map(|i| {
                let mut frame = i.to_be_bytes().to_vec();
                frame.resize(4 + (i as usize * 37) % 300, (i % 251) as u8);
                frame
            })
            .collect();
        let expected: Vec<u8> = frames.concat();
        assert!(expected.len() > 4 * GATHER_RESERVE);
        let reader = read_all(b);
        for (i, frame) in frames.into_iter().enumerate() {
            assert!(outbox.send(Bytes::from(frame)));
            if i % 97 == 0 {
                outbox.write_some(&mut w).await;
            }
        }
        assert_eq!(close_and_read(outbox, w, reader).await, expected);
        let text = metrics.encode();
        assert!(
            text.contains(r#"dlx_proxy_frames_total{direction="client_out"} 2000"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn runs_cut_from_a_read_buffer_go_in_order_between_frames() {
        // A slow reader: the gathering buffer is written from partly, then added to; long
        // runs are queued as they are, short ones copied.
        let (a, b) = tokio::io::duplex(100);
        let metrics = Metrics::new(10);
        let mut w = writer(a);
        let mut outbox = Outbox::new(1 << 22, Direction::UpstreamOut, metrics.clone());
        let reader = read_all(b);
        let mut expected = Vec::new();
        let mut read_buffer = BytesMut::new();
        for i in 0..300u32 {
            let len = if i % 5 == 0 {
                RUN_SHARE_MIN + i as usize
            } else {
                40 + (i as usize * 13) % 200
            };
            if read_buffer.len() < len {
                let bytes: Vec<u8> = (0..64 * 1024)
                    .map(|j| ((i as usize + j) % 251) as u8)
                    .collect();
                read_buffer = BytesMut::from(&bytes[..]);
            }
            let before = read_buffer.len();
            expected.extend_from_slice(&read_buffer[..len]);
            assert!(outbox.send_run(&mut read_buffer, len, 3));
            assert_eq!(read_buffer.len(), before - len, "the run is taken");
            let frame = i.to_be_bytes().to_vec();
            assert!(outbox.send(Bytes::from(frame.clone())));
            expected.extend_from_slice(&frame);
            if i % 7 == 0 {
                outbox.write_some(&mut w).await;
            }
        }
        assert!(
            outbox.send_run(&mut BytesMut::new(), 0, 0),
            "an empty run queues nothing"
        );
        assert_eq!(close_and_read(outbox, w, reader).await, expected);
        let text = metrics.encode();
        assert!(
            text.contains(r#"dlx_proxy_frames_total{direction="upstream_out"} 1200"#),
            "a run counts the frames it holds: {text}"
        );
    }

    /// Queues the first `len` bytes of `read_buffer` as a run of `frames` frames: what was
    /// queued, and where it lay in the read buffer.
    fn queue_run(
        outbox: &mut Outbox,
        read_buffer: &mut BytesMut,
        len: usize,
        frames: u64,
    ) -> (Bytes, usize) {
        let at = read_buffer.as_ptr() as usize;
        let run = Bytes::copy_from_slice(&read_buffer[..len]);
        assert!(outbox.send_run(read_buffer, len, frames));
        (run, at)
    }

    /// Whether the last piece queued is the run that lay at `at` in its read buffer, itself
    /// (not a copy).
    fn queued_as_is(outbox: &Outbox, (run, at): &(Bytes, usize)) -> bool {
        outbox
            .pieces
            .back()
            .is_some_and(|piece| piece.as_ptr() as usize == *at && piece[..] == run[..])
    }

    #[test]
    fn long_runs_share_their_read_buffer_and_short_ones_are_copied() {
        let metrics = Metrics::new(10);
        let mut outbox = Outbox::new(1 << 22, Direction::ClientOut, metrics);
        let bytes: Vec<u8> = (0..16 * 1024).map(|i| (i % 251) as u8).collect();
        let mut read_buffer = BytesMut::from(&bytes[..]);
        let long = queue_run(&mut outbox, &mut read_buffer, RUN_SHARE_MIN, 2);
        assert!(queued_as_is(&outbox, &long), "a long run is not copied");
        // The next run of the same buffer keeps no other buffer alive.
        let next = queue_run(&mut outbox, &mut read_buffer, RUN_SHARE_MIN * 2, 2);
        assert!(queued_as_is(&outbox, &next));
        assert_eq!(
            outbox.shared_buffers(),
            2,
            "one start, and the front's buffer"
        );
        let left = read_buffer.len();
        let short = queue_run(&mut outbox, &mut read_buffer, RUN_SHARE_MIN - 1, 1);
        assert!(!queued_as_is(&outbox, &short), "a short run is copied");
        assert_eq!(outbox.gathered[..], short.0[..]);
        assert_eq!(read_buffer.len(), left - short.0.len(), "and taken");
        let mut expected = [&long.0[..], &next.0[..], &short.0[..]].concat();
        assert_eq!(outbox.queued(), expected.len());
        let left = read_buffer.len();
        let rest = queue_run(&mut outbox, &mut read_buffer, left, 1);
        assert!(read_buffer.is_empty());
        expected.extend_from_slice(&rest.0);
        assert_eq!(&outbox.take_queued()[..], &expected[..]);
    }

    #[test]
    fn runs_are_copied_while_the_shared_ones_keep_the_most_read_buffers_alive() {
        let metrics = Metrics::new(10);
        let mut outbox = Outbox::new(1 << 24, Direction::ClientOut, metrics.clone());
        let read_buffers = |n: usize| {
            metrics
                .encode()
                .contains(&format!("dlx_proxy_outbox_read_buffers {n}\n"))
        };
        let mut expected = Vec::new();
        let mut buffers = Vec::new();
        for i in 0..SHARED_BUFFERS_MAX {
            assert!(!outbox.is_full(), "{i} buffers kept: the reader may go on");
            let mut read_buffer = BytesMut::from(&vec![i as u8; 8 * 1024][..]);
            let run = queue_run(&mut outbox, &mut read_buffer, RUN_SHARE_MIN, 1);
            assert!(
                queued_as_is(&outbox, &run),
                "buffer {i} is within the bound"
            );
            expected.extend_from_slice(&run.0);
            buffers.push(read_buffer);
        }
        // Far under its byte limit, the outbox tells the reader to wait: a run from another
        // read buffer would be copied.
        assert!(outbox.queued() < 1 << 20);
        assert!(outbox.is_full(), "at the read-buffer bound");
        // The last buffer goes on being shared; another one is copied.
        let mut last_buffer = buffers.pop().unwrap_or_default();
        let last = queue_run(&mut outbox, &mut last_buffer, RUN_SHARE_MIN, 1);
        assert!(queued_as_is(&outbox, &last));
        expected.extend_from_slice(&last.0);
        let other: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut other = BytesMut::from(&other[..]);
        let other = queue_run(&mut outbox, &mut other, 300_000, 40);
        assert!(
            outbox
                .pieces
                .iter()
                .all(|piece| piece.as_ptr() as usize != other.1),
            "past the bound, a run is copied"
        );
        // Copied into buffers of bounded size.
        assert!(outbox.gathered.capacity() <= GATHER_MAX);
        let copies = outbox.pieces.iter().skip(SHARED_BUFFERS_MAX + 1);
        assert!(copies.clone().all(|piece| piece.len() <= GATHER_MAX));
        assert!(copies.count() >= 4);
        expected.extend_from_slice(&other.0);
        assert!(read_buffers(SHARED_BUFFERS_MAX), "{}", metrics.encode());
        assert_eq!(outbox.queued(), expected.len());
        assert_eq!(&outbox.take_queued()[..], &expected[..]);
        assert!(read_buffers(0));
        assert!(!outbox.is_full());
        // Written, the buffers are let go: runs are shared again.
        let run = queue_run(&mut outbox, &mut buffers[0], RUN_SHARE_MIN, 1);
        assert!(queued_as_is(&outbox, &run));
        assert_eq!(outbox.shared_buffers(), 2);
        assert!(read_buffers(1));
        // An outbox dropped with runs queued (its connection gone) takes its count along.
        drop(outbox);
        assert!(read_buffers(0));
    }

    #[test]
    fn a_run_for_a_failed_socket_is_taken_and_not_queued() {
        let metrics = Metrics::new(10);
        let mut outbox = Outbox::new(1 << 20, Direction::ClientOut, metrics);
        outbox.fail(&std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        let mut read_buffer = BytesMut::from(&[1u8; 100][..]);
        assert!(!outbox.send_run(&mut read_buffer, 60, 1));
        assert_eq!(
            read_buffer.len(),
            40,
            "the run's bytes are taken all the same"
        );
        assert_eq!(outbox.queued(), 0);
    }

    #[test]
    fn each_direction_counts_its_queued_bytes_in_its_own_gauge() {
        let metrics = Metrics::new(10);
        let gauge = |name: &str, n: usize| {
            metrics
                .encode()
                .contains(&format!("dlx_proxy_{name} {n}\n"))
        };
        let mut upstream = Outbox::new(1 << 20, Direction::UpstreamOut, metrics.clone());
        let client = Outbox::new(1 << 20, Direction::ClientOut, metrics.clone());
        upstream.send(Bytes::from_static(b"publish"));
        upstream.send_run(
            &mut BytesMut::from(&[1u8; RUN_SHARE_MIN][..]),
            RUN_SHARE_MIN,
            2,
        );
        // Queued bytes reach the gauge at the report (once per turn of the connection loop).
        assert!(gauge("upstream_outbox_bytes", 0));
        upstream.report_gauge();
        assert!(gauge("upstream_outbox_bytes", 7 + RUN_SHARE_MIN));
        assert!(gauge("outbox_bytes", 0));
        assert!(gauge("outbox_read_buffers", 1));
        let written = upstream.take_queued();
        assert_eq!(written.len(), 7 + RUN_SHARE_MIN);
        assert!(gauge("upstream_outbox_bytes", 0));
        assert!(gauge("outbox_read_buffers", 0));
        upstream.send(Bytes::from_static(b"left"));
        drop(upstream);
        drop(client);
        assert!(gauge("upstream_outbox_bytes", 0));
    }

    #[test]
    fn taking_what_is_queued_empties_the_outbox_and_counts_it_as_written() {
        let metrics = Metrics::new(10);
        let mut outbox = Outbox::new(8, Direction::ClientOut, metrics.clone());
        outbox.send(Bytes::from_static(b"hello "));
        outbox.send(Bytes::from(vec![b'x'; GATHER_FRAME_MAX]));
        outbox.send(Bytes::from_static(b"!"));
        assert!(outbox.is_full());
        let got = outbox.take_queued();
        assert_eq!(got.len(), 7 + GATHER_FRAME_MAX);
        assert!(got.starts_with(b"hello x") && got.ends_with(b"x!"));
        assert_eq!(outbox.queued(), 0);
        assert!(!outbox.has_work() && !outbox.is_full());
        let text = metrics.encode();
        assert!(text.contains(r#"dlx_proxy_frames_total{direction="client_out"} 3"#));
        assert!(text.contains("dlx_proxy_outbox_bytes 0"), "{text}");
    }

    /// A socket that takes at most `per_write` bytes a write and refuses writes once it has
    /// taken `room` bytes, counting its writes and flushes.
    struct MeteredSocket {
        per_write: usize,
        room: usize,
        taken: Arc<std::sync::Mutex<Taken>>,
    }

    /// What a [`MeteredSocket`] took, in how many writes, and how often it was flushed.
    #[derive(Default)]
    struct Taken {
        bytes: Vec<u8>,
        writes: usize,
        flushes: usize,
    }

    impl AsyncWrite for MeteredSocket {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let mut taken = self.taken.lock().unwrap();
            let n = buf
                .len()
                .min(self.per_write)
                .min(self.room - taken.bytes.len());
            if n == 0 {
                return Poll::Pending;
            }
            taken.bytes.extend_from_slice(&buf[..n]);
            taken.writes += 1;
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            self.taken.lock().unwrap().flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn metered(per_write: usize, room: usize) -> (SocketWriter, Arc<std::sync::Mutex<Taken>>) {
        let taken = Arc::new(std::sync::Mutex::new(Taken::default()));
        let socket = MeteredSocket {
            per_write,
            room,
            taken: taken.clone(),
        };
        (Box::pin(socket), taken)
    }

    fn drain_once(outbox: &mut Outbox, writer: &mut SocketWriter) -> Poll<()> {
        let waker = std::task::Waker::noop();
        outbox.poll_drain(writer, &mut Context::from_waker(waker))
    }

    #[test]
    fn one_drain_writes_write_after_write_and_flushes() {
        let (mut w, taken) = metered(10, usize::MAX);
        let mut outbox = Outbox::new(1 << 20, Direction::UpstreamOut, Metrics::new(10));
        outbox.send(Bytes::from(vec![1u8; 25]));
        outbox.send(Bytes::from(vec![2u8; 5]));
        assert!(drain_once(&mut outbox, &mut w).is_ready());
        assert!(!outbox.has_work(), "written and flushed in one call");
        let taken = taken.lock().unwrap();
        assert_eq!(taken.bytes, [vec![1u8; 25], vec![2u8; 5]].concat());
        assert_eq!(
            (taken.writes, taken.flushes),
            (3, 1),
            "three writes of 10 bytes, one flush"
        );
    }

    #[test]
    fn a_drain_stops_where_the_socket_refuses_and_after_its_bound() {
        // The socket takes 12 bytes: the drain is ready (progress), and the next one pending.
        let (mut w, taken) = metered(5, 12);
        let mut outbox = Outbox::new(1 << 20, Direction::UpstreamOut, Metrics::new(10));
        outbox.send(Bytes::from(vec![7u8; 30]));
        assert!(drain_once(&mut outbox, &mut w).is_ready());
        assert_eq!(outbox.queued(), 18);
        assert!(drain_once(&mut outbox, &mut w).is_pending());
        assert_eq!(taken.lock().unwrap().writes, 3);
        // A socket that takes a byte a write: one drain makes DRAIN_WRITES writes and returns.
        let (mut w, taken) = metered(1, usize::MAX);
        let mut outbox = Outbox::new(1 << 20, Direction::UpstreamOut, Metrics::new(10));
        outbox.send(Bytes::from(vec![7u8; 100]));
        assert!(drain_once(&mut outbox, &mut w).is_ready());
        assert_eq!(taken.lock().unwrap().writes, DRAIN_WRITES);
        assert_eq!(outbox.queued(), 100 - DRAIN_WRITES);
    }
}
