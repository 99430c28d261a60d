//! Frame codec: splits a byte stream into raw AMQP frames and writes frames back.
//!
//! A frame is `type:u8 channel:u16 size:u32 payload[size] 0xCE`. The decoder reads the 7-byte
//! header itself and refuses a size above the negotiated `frame_max` before buffering the
//! payload, so a peer cannot make us allocate more than one frame. Payloads are handed out as
//! `Bytes` slices of the read buffer (no copy); only the frames that are interpreted get decoded
//! with amq-protocol.

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::AMQPClass;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;
pub const FRAME_END: u8 = 0xCE;
/// Bytes a frame adds around its payload (7 header + 1 end).
pub const FRAME_OVERHEAD: usize = 8;
/// The smallest frame_max a peer may negotiate (AMQP 0-9-1 frame-min-size).
pub const FRAME_MIN_SIZE: u32 = 4096;
/// The largest frame a client may send before its connection is tuned (connection.start-ok,
/// SASL secure-ok, tune-ok, open): RabbitMQ 4.1's initial frame_max, room for a SASL response
/// carrying a JWT. A connection that has not authenticated yet cannot make the server hold a
/// frame of the full `limits.frame_max`.
pub const INITIAL_FRAME_MAX: u32 = 8192;
/// The protocol header of AMQP 0-9-1.
pub const PROTOCOL_HEADER: [u8; 8] = *b"AMQP\x00\x00\x09\x01";

/// One frame as it came off the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub kind: u8,
    pub channel: u16,
    pub payload: Bytes,
}

impl RawFrame {
    /// Encoded size on the wire.
    pub fn wire_len(&self) -> usize {
        self.payload.len() + FRAME_OVERHEAD
    }
}

/// Why the byte stream is not a valid frame sequence (answered with 501 FRAME_ERROR).
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {size} bytes exceeds frame_max {max}")]
    TooLarge { size: usize, max: usize },
    #[error("frame end octet is {0:#04x}, expected 0xce")]
    BadFrameEnd(u8),
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// tokio-util codec for raw frames with a size limit that can change after tune.
#[derive(Clone, Debug)]
pub struct FrameCodec {
    max_frame: usize,
}

impl FrameCodec {
    /// `frame_max` counts the whole frame, as in connection.tune.
    pub fn new(frame_max: u32) -> Self {
        FrameCodec {
            max_frame: frame_max.max(FRAME_MIN_SIZE) as usize,
        }
    }

    pub fn set_frame_max(&mut self, frame_max: u32) {
        self.max_frame = frame_max.max(FRAME_MIN_SIZE) as usize;
    }

    pub fn frame_max(&self) -> usize {
        self.max_frame
    }
}

impl Decoder for FrameCodec {
    type Item = RawFrame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<RawFrame>, FrameError> {
        let Some(header) = complete_frame(src, self.max_frame)? else {
            return Ok(None);
        };
        src.advance(7);
        let payload = src.split_to(header.size).freeze();
        src.advance(1);
        Ok(Some(RawFrame {
            kind: header.kind,
            channel: header.channel,
            payload,
        }))
    }
}

/// The header of a frame that is complete in a read buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: u8,
    pub channel: u16,
    /// Payload size; the frame takes `size + FRAME_OVERHEAD` bytes.
    pub size: usize,
}

/// Checks the frame at the start of `src` for [`FrameCodec`] ([`frame_at`]): a known frame
/// type, a size within `max_frame` (checked before anything is buffered), and the frame-end
/// octet. `Ok(None)` while the frame is incomplete; room for the rest is reserved then. (The
/// proxy's forwarding codec uses [`frame_at`] alone: its frame reader makes room itself.)
pub fn complete_frame(
    src: &mut BytesMut,
    max_frame: usize,
) -> Result<Option<FrameHeader>, FrameError> {
    let header = frame_at(src, max_frame)?;
    if header.is_none() && src.len() >= 7 {
        let size = u32::from_be_bytes([src[3], src[4], src[5], src[6]]) as usize;
        let total = size.saturating_add(FRAME_OVERHEAD);
        src.reserve(total.saturating_sub(src.len()));
    }
    Ok(header)
}

/// The checks of [`complete_frame`] on bytes that are only read: the header of the frame at
/// the start of `src`, `Ok(None)` while it is incomplete.
pub fn frame_at(src: &[u8], max_frame: usize) -> Result<Option<FrameHeader>, FrameError> {
    let Some(&[kind, c0, c1, s0, s1, s2, s3]) = src.get(..7) else {
        return Ok(None);
    };
    if !matches!(
        kind,
        FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT
    ) {
        return Err(FrameError::UnknownType(kind));
    }
    let size = u32::from_be_bytes([s0, s1, s2, s3]) as usize;
    let total = size.saturating_add(FRAME_OVERHEAD);
    if total > max_frame {
        return Err(FrameError::TooLarge {
            size: total,
            max: max_frame,
        });
    }
    let Some(&end) = src.get(total - 1) else {
        return Ok(None);
    };
    if end != FRAME_END {
        return Err(FrameError::BadFrameEnd(end));
    }
    Ok(Some(FrameHeader {
        kind,
        channel: u16::from_be_bytes([c0, c1]),
        size,
    }))
}

impl Encoder<RawFrame> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, frame: RawFrame, dst: &mut BytesMut) -> Result<(), FrameError> {
        put_raw_frame(dst, frame.kind, frame.channel, &frame.payload);
        Ok(())
    }
}

/// Appends one frame with the given payload.
pub fn put_raw_frame(dst: &mut BytesMut, kind: u8, channel: u16, payload: &[u8]) {
    dst.reserve(payload.len() + FRAME_OVERHEAD);
    dst.put_u8(kind);
    dst.put_u16(channel);
    dst.put_u32(payload.len() as u32);
    dst.put_slice(payload);
    dst.put_u8(FRAME_END);
}

/// Appends a method frame.
pub fn put_method(dst: &mut BytesMut, channel: u16, method: AMQPClass) {
    let frame = AMQPFrame::Method(channel, method);
    let ctx = WriteContext::from(Vec::with_capacity(64));
    match gen_frame(&frame)(ctx) {
        Ok(ctx) => dst.extend_from_slice(&ctx.write),
        // Generation into a Vec only fails on values amq-protocol cannot encode; every value we
        // build comes from validated short strings, so this is logged rather than unwinding.
        Err(err) => tracing::error!(%err, "failed to encode a method frame"),
    }
}

/// Longest AMQP short string (exchange names, routing keys), in bytes.
pub const SHORT_STRING_MAX: usize = 255;

/// Appends a method frame whose arguments `args` writes (hand-encoded hot-path methods).
fn put_method_with(
    dst: &mut BytesMut,
    channel: u16,
    class: u16,
    method: u16,
    args: impl FnOnce(&mut BytesMut),
) {
    dst.put_u8(FRAME_METHOD);
    dst.put_u16(channel);
    let size_at = dst.len();
    dst.put_u32(0);
    dst.put_u16(class);
    dst.put_u16(method);
    args(dst);
    let size = (dst.len() - size_at - 4) as u32;
    dst[size_at..size_at + 4].copy_from_slice(&size.to_be_bytes());
    dst.put_u8(FRAME_END);
}

fn put_short_str(dst: &mut BytesMut, s: &str) {
    let s = crate::amqp::reply::truncate_str(s, SHORT_STRING_MAX);
    dst.put_u8(s.len() as u8);
    dst.put_slice(s.as_bytes());
}

/// basic.deliver, encoded without an intermediate allocation (one per delivered message).
pub fn put_basic_deliver(
    dst: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
) {
    put_method_with(dst, channel, 60, 60, |d| {
        put_short_str(d, consumer_tag);
        d.put_u64(delivery_tag);
        d.put_u8(redelivered as u8);
        put_short_str(d, exchange);
        put_short_str(d, routing_key);
    });
}

/// basic.get-ok.
#[allow(clippy::too_many_arguments)]
pub fn put_basic_get_ok(
    dst: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    message_count: u32,
) {
    put_method_with(dst, channel, 60, 71, |d| {
        d.put_u64(delivery_tag);
        d.put_u8(redelivered as u8);
        put_short_str(d, exchange);
        put_short_str(d, routing_key);
        d.put_u32(message_count);
    });
}

/// basic.publish (the proxy's dead-letter and republish channel).
pub fn put_basic_publish(
    dst: &mut BytesMut,
    channel: u16,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
) {
    put_method_with(dst, channel, 60, 40, |d| {
        d.put_u16(0);
        put_short_str(d, exchange);
        put_short_str(d, routing_key);
        d.put_u8(mandatory as u8);
    });
}

/// basic.reject.
pub fn put_basic_reject(dst: &mut BytesMut, channel: u16, delivery_tag: u64, requeue: bool) {
    put_method_with(dst, channel, 60, 90, |d| {
        d.put_u64(delivery_tag);
        d.put_u8(requeue as u8);
    });
}

/// basic.ack (publisher confirms).
pub fn put_basic_ack(dst: &mut BytesMut, channel: u16, delivery_tag: u64, multiple: bool) {
    put_method_with(dst, channel, 60, 80, |d| {
        d.put_u64(delivery_tag);
        d.put_u8(multiple as u8);
    });
}

/// basic.nack (publisher confirms).
pub fn put_basic_nack(
    dst: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    multiple: bool,
    requeue: bool,
) {
    put_method_with(dst, channel, 60, 120, |d| {
        d.put_u64(delivery_tag);
        d.put_u8(multiple as u8 | (requeue as u8) << 1);
    });
}

/// Appends a heartbeat frame.
pub fn put_heartbeat(dst: &mut BytesMut) {
    put_raw_frame(dst, FRAME_HEARTBEAT, 0, &[]);
}

/// Why a method payload was not decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MethodError {
    /// The payload is not a method amq-protocol can read (unknown ids, bad or missing fields).
    Malformed,
    /// A field table in its arguments nests deeper than `limit` levels; it was never handed to
    /// amq-protocol's recursive parser.
    TooDeep { limit: usize },
}

impl MethodError {
    /// The connection error this answers, for a method with these ids.
    ///
    /// RabbitMQ answers a method whose fields it cannot decode from
    /// `rabbit_framing_amqp_0_9_1:decode_method_fields/2`'s catch-all clause, which calls
    /// `rabbit_misc:frame_error(MethodName, BinaryFields)` = `protocol_error(frame_error,
    /// "cannot decode ~w", [BinaryFields], MethodName)`: 501 FRAME_ERROR, "FRAME_ERROR - cannot
    /// decode <<...>>" naming the method. A table too deep to decode here is that case, with a
    /// readable reason instead of the binary dump. (Other malformed methods keep the
    /// established 502 SYNTAX_ERROR answer.)
    pub fn to_amqp_error(self, class_id: u16, method_id: u16) -> crate::amqp::reply::AmqpError {
        use crate::amqp::reply::AmqpError;
        match self {
            MethodError::Malformed => AmqpError::syntax_error("malformed method frame"),
            MethodError::TooDeep { limit } => AmqpError::frame_error(format!(
                "cannot decode method {class_id}/{method_id}: field tables nest deeper than \
                 limits.max_table_depth ({limit})"
            )),
        }
        .on_method(class_id, method_id)
    }
}

/// Decodes a method frame's payload whose field tables nest at most `max_depth` levels
/// (checked on the raw bytes first, see [`crate::amqp::depth`]).
pub fn decode_method_within(payload: &[u8], max_depth: usize) -> Result<AMQPClass, MethodError> {
    use crate::amqp::depth::{ScanError, check_method};
    match check_method(payload, max_depth) {
        Ok(()) => nom_free::parse_class_all(payload).ok_or(MethodError::Malformed),
        Err(ScanError::TooDeep) => Err(MethodError::TooDeep { limit: max_depth }),
        Err(ScanError::Truncated | ScanError::UnknownType(_)) => Err(MethodError::Malformed),
    }
}

/// Decodes a method frame's payload, for methods whose tables need no configured limit (the
/// upstream's replies, the proxy's own channels). Tables nested deeper than
/// [`MAX_TABLE_DEPTH_CEILING`](crate::amqp::depth::MAX_TABLE_DEPTH_CEILING) are refused like
/// any malformed method.
pub fn decode_method(payload: &[u8]) -> Option<AMQPClass> {
    decode_method_within(payload, crate::amqp::depth::MAX_TABLE_DEPTH_CEILING).ok()
}

mod nom_free {
    //! Keeps the parser-combinator types of amq-protocol out of the rest of the crate.
    use amq_protocol::protocol::{AMQPClass, parse_class};

    pub fn parse_class_all(payload: &[u8]) -> Option<AMQPClass> {
        match parse_class(payload) {
            Ok(([], class)) => Some(class),
            _ => None,
        }
    }
}

/// Whether (class, method) is a method of AMQP 0-9-1 with RabbitMQ's extensions
/// (connection.blocked/unblocked and update-secret, basic.nack, confirm.select). A look at the
/// ids only: the arguments may still not parse.
pub fn is_known_method(class_id: u16, method_id: u16) -> bool {
    match class_id {
        // connection
        10 => matches!(
            method_id,
            10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51 | 60 | 61 | 70 | 71
        ),
        // channel
        20 => matches!(method_id, 10 | 11 | 20 | 21 | 40 | 41),
        // access
        30 => matches!(method_id, 10 | 11),
        // exchange
        40 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 51),
        // queue
        50 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51),
        // basic
        60 => matches!(
            method_id,
            10 | 11
                | 20
                | 21
                | 30
                | 31
                | 40
                | 50
                | 60
                | 70
                | 71
                | 72
                | 80
                | 90
                | 100
                | 110
                | 111
                | 120
        ),
        // confirm
        85 => matches!(method_id, 10 | 11),
        // tx
        90 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31),
        _ => false,
    }
}

/// The class and method ids at the start of a method payload (for error replies even when the
/// arguments do not parse).
pub fn method_ids(payload: &[u8]) -> (u16, u16) {
    if payload.len() < 4 {
        return (0, 0);
    }
    (
        u16::from_be_bytes([payload[0], payload[1]]),
        u16::from_be_bytes([payload[2], payload[3]]),
    )
}

#[cfg(test)]
mod tests;
