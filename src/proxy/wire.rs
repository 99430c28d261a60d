//! Frames as the proxy sees them: the decoded header fields plus the exact bytes that came off
//! the wire, so a frame that needs no change is forwarded as those bytes (no re-encoding).
//!
//! [`WireCodec`] is the forwarding twin of [`crate::amqp::codec::FrameCodec`]: the same checks
//! ([`crate::amqp::codec::frame_at`]: frame type, `frame_max` before buffering, frame-end
//! octet), but the item keeps the whole frame as one `Bytes` slice of the read buffer, and
//! room for an incomplete frame is made by [`FrameReader`]. The helpers below build the few
//! frames the proxy writes itself.

use amq_protocol::protocol::AMQPClass;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::codec::Decoder;

use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, FRAME_MIN_SIZE, FRAME_OVERHEAD,
    FrameError, frame_at, put_method, put_raw_frame,
};

/// One frame: header fields and the whole frame as received (its payload is read in place,
/// [`WireFrame::payload`], so a frame costs one shared reference to the read buffer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireFrame {
    pub kind: u8,
    pub channel: u16,
    /// The complete frame, header and end octet included.
    pub raw: Bytes,
}

impl WireFrame {
    /// The payload: `raw` without the 7-byte header and the end octet.
    pub fn payload(&self) -> &[u8] {
        self.raw
            .get(7..self.raw.len().saturating_sub(1))
            .unwrap_or_default()
    }

    /// The payload as a shared slice of `raw` (for content kept past the frame).
    pub fn payload_bytes(&self) -> Bytes {
        let end = self.raw.len().saturating_sub(1);
        if end <= 7 {
            return Bytes::new();
        }
        self.raw.slice(7..end)
    }

    /// Class and method ids of a method frame (`(0, 0)` for other frames or short payloads).
    pub fn method_ids(&self) -> (u16, u16) {
        if self.kind != FRAME_METHOD {
            return (0, 0);
        }
        crate::amqp::codec::method_ids(self.payload())
    }

    pub fn is_heartbeat(&self) -> bool {
        self.kind == FRAME_HEARTBEAT
    }

    pub fn is_content(&self) -> bool {
        self.kind == FRAME_HEADER || self.kind == FRAME_BODY
    }
}

/// What frames read from the upstream may exceed the agreed frame_max by. RabbitMQ splits
/// bodies by frame_max but sends a content header as one frame, and its own dead-lettering
/// adds an x-death entry and the x-first-death-* headers to properties that filled a frame
/// when published: a consumer of the dead letter (the capture consumer among them) then
/// reads a header frame over frame_max. Refusing it would end the connection, and the
/// message, redelivered, would end the next one the same way.
pub const UPSTREAM_FRAME_SLACK: u32 = 1 << 20;

/// The largest frame accepted from the upstream after a tune of `frame_max`.
pub fn upstream_frame_limit(frame_max: u32) -> u32 {
    frame_max.saturating_add(UPSTREAM_FRAME_SLACK)
}

/// Splits a byte stream into [`WireFrame`]s, refusing frames above `frame_max`.
#[derive(Clone, Debug)]
pub struct WireCodec {
    max_frame: usize,
}

impl WireCodec {
    /// `frame_max` counts the whole frame, as in connection.tune.
    pub fn new(frame_max: u32) -> Self {
        WireCodec {
            max_frame: frame_max.max(FRAME_MIN_SIZE) as usize,
        }
    }

    pub fn set_frame_max(&mut self, frame_max: u32) {
        self.max_frame = frame_max.max(FRAME_MIN_SIZE) as usize;
    }

    /// The largest frame accepted, overhead included.
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }
}

impl Decoder for WireCodec {
    type Item = WireFrame;
    type Error = FrameError;

    /// Reserves nothing for an incomplete frame: [`FrameReader`] makes room itself, in the
    /// same allocation or a new one holding only the unread bytes (reserving here would
    /// allocate and copy while queued runs still share the buffer).
    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<WireFrame>, FrameError> {
        let Some(header) = frame_at(src, self.max_frame)? else {
            return Ok(None);
        };
        let total = header.size + FRAME_OVERHEAD;
        let raw = src.split_to(total).freeze();
        Ok(Some(WireFrame {
            kind: header.kind,
            channel: header.channel,
            raw,
        }))
    }
}

/// Reads [`WireFrame`]s from one socket half. [`FrameReader::next`] is cancel-safe, so it can
/// sit in a `select!` and simply not be polled while the other side is backed up.
///
/// The read size adapts: it starts at [`READ_CHUNK_MIN`], doubles (up to [`READ_CHUNK_MAX`])
/// each time a read fills all the room it was given (a burst is running, so fewer and larger
/// reads and writes follow) and halves when reads come back small; an idle connection goes
/// back to a small buffer.
#[derive(Debug)]
pub struct FrameReader<R> {
    reader: R,
    codec: WireCodec,
    buffer: BytesMut,
    /// Bytes asked of the socket per read.
    chunk: usize,
    eof: bool,
}

/// Smallest (and first) read size.
pub const READ_CHUNK_MIN: usize = 16 * 1024;
/// Largest read size, during bursts. Reads of 64 KiB cost 10–15 % more CPU per forwarded
/// 4 KiB message than reads of 16 or 32 KiB in the benchmark (BENCHMARKS.md).
pub const READ_CHUNK_MAX: usize = 32 * 1024;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(reader: R, frame_max: u32) -> Self {
        FrameReader {
            reader,
            codec: WireCodec::new(frame_max),
            buffer: BytesMut::with_capacity(READ_CHUNK_MIN),
            chunk: READ_CHUNK_MIN,
            eof: false,
        }
    }

    /// Changes the frame size limit (after tune).
    pub fn set_frame_max(&mut self, frame_max: u32) {
        self.codec.set_frame_max(frame_max);
    }

    /// Starts with bytes that were already read from the socket.
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next frame already in the read buffer, without touching the socket: `None` when
    /// no complete frame is buffered.
    pub fn buffered(&mut self) -> Option<Result<WireFrame, FrameError>> {
        self.codec.decode(&mut self.buffer).transpose()
    }

    /// The bytes read and not yet handed out, for a caller that handles frames in place (the
    /// proxy's `passthrough`) and cuts what it handled from their front.
    pub fn unread_mut(&mut self) -> &mut BytesMut {
        &mut self.buffer
    }

    /// The frame size limit in force, overhead included.
    pub fn max_frame(&self) -> usize {
        self.codec.max_frame()
    }

    /// Bytes the next read asks for.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Grows the read size after a read that filled its `room`, shrinks it after a small one.
    fn adapt_chunk(&mut self, read: usize, room: usize) {
        if read >= room {
            self.chunk = (self.chunk * 2).min(READ_CHUNK_MAX);
        } else if read < self.chunk / 4 && self.chunk > READ_CHUNK_MIN {
            self.chunk = (self.chunk / 2).max(READ_CHUNK_MIN);
        }
    }

    /// Makes room for `more` bytes after the unread ones: in the buffer's own allocation when
    /// its front was consumed and nothing else holds it, else in a new one that gets only
    /// the unread bytes. (`BytesMut::reserve` would grow the old allocation instead, copying
    /// what was consumed too, and keep doubling it.)
    fn make_room(&mut self, more: usize) {
        if self.buffer.capacity() - self.buffer.len() >= more || self.buffer.try_reclaim(more) {
            return;
        }
        let mut fresh = BytesMut::with_capacity((self.buffer.len() + more).max(self.chunk));
        fresh.extend_from_slice(&self.buffer);
        self.buffer = fresh;
    }

    /// The next frame; `None` at a clean end of stream (no partial frame buffered).
    pub async fn next(&mut self) -> Option<Result<WireFrame, FrameError>> {
        loop {
            if let Some(frame) = self.buffered() {
                return Some(frame);
            }
            if let Err(err) = self.fill().await? {
                return Some(Err(err));
            }
        }
    }

    /// Reads from the socket until a complete frame (or bytes that are not one) is buffered,
    /// without taking it: for a caller that handles frames in place ([`Self::unread_mut`]) and
    /// takes the rest with [`Self::buffered`], which reports what is not a frame. `None` at
    /// a clean end of stream; an error when the stream ends inside a frame or a read fails.
    /// Cancel-safe.
    pub async fn fill(&mut self) -> Option<Result<(), FrameError>> {
        loop {
            if !matches!(frame_at(&self.buffer, self.codec.max_frame()), Ok(None)) {
                return Some(Ok(()));
            }
            if self.eof {
                if self.buffer.is_empty() {
                    return None;
                }
                return Some(Err(FrameError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame",
                ))));
            }
            if self.chunk == READ_CHUNK_MIN
                && self.buffer.is_empty()
                && self.buffer.capacity() > 2 * READ_CHUNK_MIN
            {
                // The burst is over: let its large allocation go (once the frames cut from it
                // are written) rather than keep it for an idle connection.
                self.buffer = BytesMut::with_capacity(READ_CHUNK_MIN);
            }
            if self.buffer.capacity() - self.buffer.len() < self.chunk / 4 {
                self.make_room(self.chunk);
            }
            // Room for the rest of a frame that is larger than the read size.
            if let Some(size) = self.buffer.get(3..7) {
                let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
                let total = size.saturating_add(FRAME_OVERHEAD);
                self.make_room(total.saturating_sub(self.buffer.len()));
            }
            let room = self.buffer.capacity() - self.buffer.len();
            match self.reader.read_buf(&mut self.buffer).await {
                Ok(0) => self.eof = true,
                Ok(read) => self.adapt_chunk(read, room),
                Err(err) => return Some(Err(FrameError::Io(err))),
            }
        }
    }
}

/// The encoded method frame.
pub fn method_frame(channel: u16, method: AMQPClass) -> Bytes {
    let mut buf = BytesMut::with_capacity(64);
    put_method(&mut buf, channel, method);
    buf.freeze()
}

/// The content header frame with this payload.
pub fn header_frame(channel: u16, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(payload.len() + FRAME_OVERHEAD);
    put_raw_frame(&mut buf, FRAME_HEADER, channel, payload);
    buf.freeze()
}

/// The body size announced by a content header payload, if it is long enough.
pub fn content_body_size(payload: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = payload.get(4..12)?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::channel;

    #[test]
    fn keeps_the_exact_frame_bytes() {
        let mut buf = BytesMut::new();
        put_raw_frame(&mut buf, FRAME_BODY, 7, b"abc");
        put_raw_frame(&mut buf, FRAME_HEARTBEAT, 0, b"");
        let whole = buf.clone().freeze();
        let mut codec = WireCodec::new(4096);
        let first = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!(first.kind, FRAME_BODY);
        assert_eq!(first.channel, 7);
        assert_eq!(first.payload(), b"abc");
        assert_eq!(&first.raw[..], &whole[..11]);
        let second = codec.decode(&mut buf).unwrap().unwrap();
        assert!(second.is_heartbeat());
        assert!(codec.decode(&mut buf).unwrap().is_none());
    }

    #[test]
    fn refuses_oversized_and_bad_frames() {
        let mut codec = WireCodec::new(4096);
        let mut buf = BytesMut::from(&[FRAME_BODY, 0, 1, 0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::TooLarge { .. })
        ));
        let mut buf = BytesMut::from(&[9u8, 0, 1, 0, 0, 0, 0, 0xce][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::UnknownType(9))
        ));
        let mut buf = BytesMut::from(&[FRAME_BODY, 0, 1, 0, 0, 0, 0, 0][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::BadFrameEnd(0))
        ));
    }

    #[tokio::test]
    async fn frame_reader_reads_frames_and_reports_truncation() {
        let mut buf = BytesMut::new();
        put_raw_frame(&mut buf, FRAME_BODY, 1, b"one");
        put_raw_frame(&mut buf, FRAME_BODY, 2, b"two");
        let mut bytes = buf.to_vec();
        bytes.extend_from_slice(&[FRAME_BODY, 0]);
        let mut reader = FrameReader::new(&bytes[..], 4096);
        assert_eq!(reader.next().await.unwrap().unwrap().channel, 1);
        assert_eq!(reader.next().await.unwrap().unwrap().channel, 2);
        assert!(matches!(reader.next().await, Some(Err(FrameError::Io(_)))));
        let mut reader = FrameReader::new(&b""[..], 4096);
        assert!(reader.next().await.is_none());
    }

    /// The address range of the allocation a buffer's unread bytes and spare room are in.
    fn span(buffer: &BytesMut) -> std::ops::Range<usize> {
        let start = buffer.as_ptr() as usize;
        start..start + buffer.capacity()
    }

    #[test]
    fn room_is_made_in_the_same_allocation_or_a_new_one_with_only_the_unread_bytes() {
        let mut reader = FrameReader::new(&b""[..], 4096);
        reader.buffer = BytesMut::with_capacity(READ_CHUNK_MIN);
        reader.buffer.extend_from_slice(&[1u8; READ_CHUNK_MIN]);
        let first = reader.buffer.as_ptr() as usize;
        // Most of it was handled and written (nothing else holds it): the rest moves to the
        // front of the same allocation.
        drop(reader.buffer.split_to(READ_CHUNK_MIN - 10).freeze());
        reader.make_room(READ_CHUNK_MIN / 2);
        assert_eq!(
            reader.buffer.as_ptr() as usize,
            first,
            "the allocation is kept"
        );
        assert_eq!(&reader.buffer[..], &[1u8; 10]);
        assert!(reader.buffer.capacity() >= READ_CHUNK_MIN / 2 + 10);
        // A run still queued holds the front: the unread bytes go to a new allocation, and
        // the run keeps its bytes.
        reader.buffer.resize(READ_CHUNK_MIN, 2);
        let queued = reader.buffer.split_to(READ_CHUNK_MIN - 10).freeze();
        let old = span(&reader.buffer);
        reader.make_room(READ_CHUNK_MIN);
        assert!(!old.contains(&(reader.buffer.as_ptr() as usize)));
        assert_eq!(&reader.buffer[..], &[2u8; 10]);
        assert!(reader.buffer.capacity() >= READ_CHUNK_MIN + 10);
        assert!(queued[..10].iter().all(|b| *b == 1) && queued[10..].iter().all(|b| *b == 2));
        // Enough room already: nothing moves.
        let at = reader.buffer.as_ptr();
        reader.make_room(16);
        assert_eq!(reader.buffer.as_ptr(), at);
    }

    #[tokio::test]
    async fn fill_reads_until_a_frame_is_complete_and_leaves_it_unread() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let mut frame = BytesMut::new();
        put_raw_frame(&mut frame, FRAME_BODY, 3, &[5u8; 100]);
        let mut reader = FrameReader::new(rx, 4096);
        // Half a frame is not enough: fill waits for the rest.
        tx.write_all(&frame[..50]).await.unwrap();
        let early = tokio::time::timeout(std::time::Duration::from_millis(50), reader.fill());
        assert!(early.await.is_err(), "half a frame does not end the wait");
        tx.write_all(&frame[50..]).await.unwrap();
        assert!(matches!(reader.fill().await, Some(Ok(()))));
        assert_eq!(&reader.unread_mut()[..], &frame[..]);
        // A frame already buffered answers at once; cut from the front, it is gone.
        assert!(matches!(reader.fill().await, Some(Ok(()))));
        let taken = reader.unread_mut().split_to(frame.len());
        assert_eq!(taken, frame);
        assert!(reader.unread_mut().is_empty());
        // Bytes that are not a frame are ready too: `buffered` reports them.
        tx.write_all(&[9u8, 0, 0, 0, 0, 0, 0, 0xce]).await.unwrap();
        assert!(matches!(reader.fill().await, Some(Ok(()))));
        assert!(matches!(
            reader.buffered(),
            Some(Err(FrameError::UnknownType(9)))
        ));
        // The stream ends inside a frame, and cleanly.
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 4096);
        tx.write_all(&frame[..20]).await.unwrap();
        drop(tx);
        assert!(matches!(reader.fill().await, Some(Err(FrameError::Io(_)))));
        let (tx, rx) = tokio::io::duplex(16);
        drop(tx);
        assert!(FrameReader::new(rx, 4096).fill().await.is_none());
    }

    #[tokio::test]
    async fn read_size_grows_in_a_burst_and_shrinks_after_it() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let mut burst = BytesMut::new();
        for _ in 0..64 {
            put_raw_frame(&mut burst, FRAME_BODY, 1, &[7u8; 4000]);
        }
        tx.write_all(&burst).await.unwrap();
        let mut reader = FrameReader::new(rx, 1 << 17);
        assert_eq!(reader.chunk(), READ_CHUNK_MIN);
        // Mid-burst (the burst's last read may be a short one, which shrinks it again).
        for _ in 0..48 {
            assert_eq!(reader.next().await.unwrap().unwrap().payload().len(), 4000);
        }
        assert_eq!(
            reader.chunk(),
            READ_CHUNK_MAX,
            "reads that fill their room grow"
        );
        for _ in 48..64 {
            assert_eq!(reader.next().await.unwrap().unwrap().payload().len(), 4000);
        }
        for _ in 0..4 {
            let mut small = BytesMut::new();
            put_raw_frame(&mut small, FRAME_HEARTBEAT, 0, b"");
            tx.write_all(&small).await.unwrap();
            assert!(reader.next().await.unwrap().unwrap().is_heartbeat());
        }
        assert_eq!(reader.chunk(), READ_CHUNK_MIN, "small reads shrink it back");
    }

    #[test]
    fn method_frames_carry_their_ids() {
        let raw = method_frame(
            3,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        );
        let mut buf = BytesMut::from(&raw[..]);
        let frame = WireCodec::new(4096).decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.method_ids(), (20, 11));
        assert_eq!(frame.raw, raw);
        assert_eq!(
            content_body_size(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2]),
            Some(258)
        );
        assert_eq!(content_body_size(&[0, 60]), None);
    }
}
