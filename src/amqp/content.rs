//! Message content on the wire: the content header (class, body size, properties) and body
//! frames.
//!
//! Properties are kept as the exact bytes the publisher sent, so a message is delivered byte
//! for byte as published (amq-protocol re-sorts tables and folds some type tags when it
//! re-encodes). They are decoded where the broker needs to look inside (expiration, CC/BCC,
//! headers-exchange routing) and re-encoded only when a rule rewrites them (dead-lettering,
//! BCC removal); header entries nested too deep to decode are carried as their bytes
//! ([`super::headers`]).

use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::basic::{gen_properties, parse_properties};
use amq_protocol::types::{AMQPValue, ShortString};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::BTreeMap;

use super::codec::{FRAME_BODY, FRAME_HEADER, FRAME_OVERHEAD, put_raw_frame};

/// The headers of `props` as a map to edit (empty when it has none).
pub fn header_map(props: &BasicProperties) -> BTreeMap<ShortString, AMQPValue> {
    props
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default()
}

/// The basic class id, the only class that carries content.
pub const BASIC_CLASS_ID: u16 = 60;

/// A decoded content header frame.
#[derive(Clone, Debug)]
pub struct ContentHeader {
    pub class_id: u16,
    pub body_size: u64,
    /// The property flags and property list exactly as received.
    pub raw_properties: Bytes,
    pub properties: BasicProperties,
}

/// Why a content header frame could not be read (answered with 502 SYNTAX_ERROR / 505).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ContentError {
    #[error("content header frame is too short")]
    TooShort,
    #[error("content header properties do not parse")]
    BadProperties,
}

/// Parses a content header payload.
pub fn parse_content_header(payload: &Bytes) -> Result<ContentHeader, ContentError> {
    if payload.len() < 14 {
        return Err(ContentError::TooShort);
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let body_size = u64::from_be_bytes([
        payload[4],
        payload[5],
        payload[6],
        payload[7],
        payload[8],
        payload[9],
        payload[10],
        payload[11],
    ]);
    let raw_properties = payload.slice(12..);
    let properties = decode_properties(&raw_properties)?;
    Ok(ContentHeader {
        class_id,
        body_size,
        raw_properties,
        properties,
    })
}

/// Decodes a raw property section (flags + list). Header entries nested deeper than
/// [`HEADER_DECODE_DEPTH`](super::headers::HEADER_DECODE_DEPTH) are never decoded: they read
/// as void values, and [`encode_properties_from`] puts their bytes back (see
/// [`super::headers`]).
pub fn decode_properties(raw: &[u8]) -> Result<BasicProperties, ContentError> {
    let shallow =
        super::headers::shallow_properties(raw).map_err(|_| ContentError::BadProperties)?;
    match parse_properties(&shallow[..]) {
        Ok(([], props)) => Ok(props),
        _ => Err(ContentError::BadProperties),
    }
}

/// Encodes properties decoded from `original` (and possibly rewritten), with the header
/// entries too deep to decode restored byte for byte from `original`.
pub fn encode_properties_from(props: &BasicProperties, original: &[u8]) -> Bytes {
    keep_opaque_headers(encode_properties(props), original)
}

/// `encoded` with the opaque header entries of `original` restored (see
/// [`super::headers::restore_opaque`]); no copy when there are none.
pub fn keep_opaque_headers(encoded: Bytes, original: &[u8]) -> Bytes {
    match super::headers::restore_opaque(&encoded, original) {
        std::borrow::Cow::Borrowed(_) => encoded,
        std::borrow::Cow::Owned(restored) => Bytes::from(restored),
    }
}

thread_local! {
    /// Where [`encode_properties`] generates, kept between calls: the encoder grows its buffer
    /// as it writes, and a buffer started small was reallocated two or three times for a
    /// dead letter's headers (x-death tables).
    static PROPERTIES_SCRATCH: std::cell::RefCell<Vec<u8>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Room the scratch buffer starts with; larger property sections grow it.
const SCRATCH_START: usize = 1024;
/// Largest scratch buffer kept for the next call (one with huge headers is let go).
const SCRATCH_KEPT: usize = 64 * 1024;

/// Encodes properties into a raw property section, in an allocation of exactly its size.
pub fn encode_properties(props: &BasicProperties) -> Bytes {
    PROPERTIES_SCRATCH.with(|cell| {
        let mut scratch = cell.take();
        scratch.clear();
        scratch.reserve(SCRATCH_START);
        match gen_properties(props)(WriteContext::from(scratch)) {
            Ok(ctx) => {
                let encoded = Bytes::copy_from_slice(&ctx.write);
                if ctx.write.capacity() <= SCRATCH_KEPT {
                    cell.replace(ctx.write);
                }
                encoded
            }
            Err(err) => {
                // Only reachable for values amq-protocol cannot represent; every table we
                // build comes from decoded input, so fall back to "no properties" and say so.
                tracing::error!(%err, "failed to encode message properties");
                Bytes::from_static(&[0, 0])
            }
        }
    })
}

/// Appends the content header frame and the body frames of one message, splitting the body so
/// that no frame exceeds `frame_max`.
pub fn put_content(
    dst: &mut BytesMut,
    channel: u16,
    raw_properties: &[u8],
    body: &[u8],
    frame_max: usize,
) {
    let header_len = 12 + raw_properties.len();
    dst.reserve(header_len + FRAME_OVERHEAD + body.len() + FRAME_OVERHEAD);
    dst.put_u8(FRAME_HEADER);
    dst.put_u16(channel);
    dst.put_u32(header_len as u32);
    dst.put_u16(BASIC_CLASS_ID);
    dst.put_u16(0);
    dst.put_u64(body.len() as u64);
    dst.put_slice(raw_properties);
    dst.put_u8(super::codec::FRAME_END);
    let chunk = frame_max.saturating_sub(FRAME_OVERHEAD).max(1);
    for part in body.chunks(chunk) {
        put_raw_frame(dst, FRAME_BODY, channel, part);
    }
}

/// Collects a body from body frames, refusing more bytes than the header announced.
#[derive(Debug)]
pub struct BodyCollector {
    expected: u64,
    buf: BytesMut,
    first: Option<Bytes>,
}

impl BodyCollector {
    pub fn new(expected: u64) -> Self {
        BodyCollector {
            expected,
            buf: BytesMut::new(),
            first: None,
        }
    }

    /// Adds one body frame; `Err` if it goes past the announced size.
    pub fn push(&mut self, part: Bytes) -> Result<(), ContentError> {
        let have = self.len() as u64;
        if have + part.len() as u64 > self.expected {
            return Err(ContentError::TooShort);
        }
        if self.first.is_none() && self.buf.is_empty() {
            // Single-frame bodies (the common case) are kept without a copy.
            self.first = Some(part);
        } else {
            if let Some(first) = self.first.take() {
                // Room for what arrived, doubled, not for what the header announced: a peer
                // that announces a large body and sends little of it holds little memory.
                let arrived = first.len() + part.len();
                self.buf
                    .reserve((self.expected as usize).min(arrived.saturating_mul(2)));
                self.buf.extend_from_slice(&first);
            }
            self.buf.extend_from_slice(&part);
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.first.as_ref().map_or(self.buf.len(), |b| b.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_complete(&self) -> bool {
        self.len() as u64 == self.expected
    }

    /// The finished body. A single-frame body is still a slice of the read buffer: callers
    /// that keep it (the broker's `Message::new`) copy it into storage of their own.
    pub fn finish(self) -> Bytes {
        match self.first {
            Some(b) => b,
            None => self.buf.freeze(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::codec::FrameCodec;
    use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
    use tokio_util::codec::Decoder;

    #[test]
    fn properties_encode_alike_before_and_after_one_larger_than_the_kept_scratch() {
        let with_header = |value: &str| {
            let mut headers = FieldTable::default();
            headers.insert(
                ShortString::from("k"),
                AMQPValue::LongString(LongString::from(value)),
            );
            BasicProperties::default()
                .with_headers(headers)
                .with_correlation_id(ShortString::from("c-1"))
        };
        let small = with_header("v");
        let first = encode_properties(&small);
        let huge_value = "x".repeat(SCRATCH_KEPT * 2);
        let huge = encode_properties(&with_header(&huge_value));
        assert!(huge.len() > SCRATCH_KEPT * 2);
        assert_eq!(decode_properties(&huge).unwrap(), with_header(&huge_value));
        let again = encode_properties(&small);
        assert_eq!(
            first, again,
            "the same bytes whatever the scratch went through"
        );
        assert_eq!(decode_properties(&again).unwrap(), small);
    }

    #[test]
    fn a_body_takes_room_for_what_arrived_not_for_what_was_announced() {
        let mut body = BodyCollector::new(128 * 1024 * 1024);
        body.push(Bytes::from_static(b"a")).unwrap();
        body.push(Bytes::from_static(b"b")).unwrap();
        assert!(body.buf.capacity() < 64 * 1024, "{}", body.buf.capacity());
        let part = Bytes::from(vec![1u8; 100_000]);
        for _ in 0..10 {
            body.push(part.clone()).unwrap();
        }
        assert_eq!(body.len(), 1_000_002);
        assert!(
            body.buf.capacity() < 4 * 1_000_002,
            "{}",
            body.buf.capacity()
        );
        assert!(!body.is_complete());
        let mut exact = BodyCollector::new(4);
        exact.push(Bytes::from_static(b"ab")).unwrap();
        exact.push(Bytes::from_static(b"cd")).unwrap();
        assert!(exact.is_complete());
        assert_eq!(&exact.finish()[..], b"abcd");
    }

    #[test]
    fn content_split_and_parsed_back() {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("k"),
            AMQPValue::LongString(LongString::from("v")),
        );
        let props = BasicProperties::default()
            .with_headers(headers)
            .with_expiration(ShortString::from("100"));
        let raw = encode_properties(&props);
        let body = vec![7u8; 10_000];
        let mut buf = BytesMut::new();
        put_content(&mut buf, 9, &raw, &body, 4096);
        let mut codec = FrameCodec::new(4096);
        let header = codec.decode(&mut buf).unwrap().unwrap();
        let parsed = parse_content_header(&header.payload).unwrap();
        assert_eq!(parsed.body_size, 10_000);
        assert_eq!(parsed.properties, props);
        assert_eq!(&parsed.raw_properties[..], &raw[..]);
        let mut collector = BodyCollector::new(parsed.body_size);
        let mut frames = 0;
        while let Some(f) = codec.decode(&mut buf).unwrap() {
            assert!(f.wire_len() <= 4096);
            collector.push(f.payload).unwrap();
            frames += 1;
        }
        assert_eq!(frames, 3);
        assert!(collector.is_complete());
        assert_eq!(&collector.finish()[..], &body[..]);
    }

    #[test]
    fn body_collector_refuses_overrun() {
        let mut c = BodyCollector::new(3);
        c.push(Bytes::from_static(b"ab")).unwrap();
        assert!(c.push(Bytes::from_static(b"cd")).is_err());
    }

    #[test]
    fn short_header_is_an_error() {
        assert_eq!(
            parse_content_header(&Bytes::from_static(&[0, 60, 0])).unwrap_err(),
            ContentError::TooShort
        );
    }
}
