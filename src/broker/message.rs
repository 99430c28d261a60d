//! Messages as the broker stores them.
//!
//! A [`Message`] is immutable once published and shared (`Arc`) by every queue it was routed
//! to. Its exchange, routing key, raw properties and body live in **one** allocation, and the
//! properties stay the publisher's exact bytes, decoded only when a rule needs to look inside:
//! a queued 100-byte message costs under 200 bytes of bookkeeping and is delivered byte for
//! byte as published.

use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use bytes::{BufMut, Bytes, BytesMut};

use crate::amqp::content::{ContentError, decode_properties};
use crate::amqp::reply::truncate_str;

/// A published (or dead-lettered) message.
#[derive(Debug)]
pub struct Message {
    /// exchange ++ routing key ++ properties ++ body.
    content: Bytes,
    exchange_len: u8,
    key_len: u8,
    props_len: u32,
    /// CC then BCC keys, in header order (rare, so boxed apart).
    extra_keys: Option<Box<[Box<str>]>>,
    /// Per-message TTL from the `expiration` property, in milliseconds.
    pub expiration_ms: Option<u64>,
    /// True once the broker itself dead-lettered this message (its x-death is ours).
    pub dead_lettered: bool,
    /// delivery_mode = 2: kept on disk when it is in a durable queue.
    pub persistent: bool,
}

impl Message {
    /// Builds a message. `routing_keys` are all keys it is routed with: the publish key first,
    /// then CC keys, then BCC keys (names longer than 255 bytes are cut, as AMQP allows no
    /// more).
    pub fn new<K: AsRef<str>>(
        exchange: &str,
        routing_keys: &[K],
        raw_properties: &[u8],
        body: &[u8],
        expiration_ms: Option<u64>,
        dead_lettered: bool,
    ) -> Message {
        let exchange = truncate_str(exchange, 255);
        let key = routing_keys
            .first()
            .map_or("", |k| truncate_str(k.as_ref(), 255));
        let mut content =
            BytesMut::with_capacity(exchange.len() + key.len() + raw_properties.len() + body.len());
        content.put_slice(exchange.as_bytes());
        content.put_slice(key.as_bytes());
        content.put_slice(raw_properties);
        content.put_slice(body);
        let extra_keys = (routing_keys.len() > 1).then(|| {
            routing_keys[1..]
                .iter()
                .map(|k| Box::from(k.as_ref()))
                .collect::<Box<[Box<str>]>>()
        });
        Message {
            content: content.freeze(),
            exchange_len: exchange.len() as u8,
            key_len: key.len() as u8,
            props_len: raw_properties.len() as u32,
            extra_keys,
            expiration_ms,
            dead_lettered,
            persistent: persistent_in(raw_properties),
        }
    }

    fn header_len(&self) -> usize {
        self.exchange_len as usize + self.key_len as usize
    }

    /// The exchange it was last published or dead-lettered to ("" = default exchange).
    pub fn exchange(&self) -> &str {
        std::str::from_utf8(&self.content[..self.exchange_len as usize]).unwrap_or_default()
    }

    /// The routing key delivered to consumers (the publish key).
    pub fn routing_key(&self) -> &str {
        std::str::from_utf8(&self.content[self.exchange_len as usize..self.header_len()])
            .unwrap_or_default()
    }

    /// All keys it was routed with: the publish key, then CC and BCC keys.
    pub fn routing_keys(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.routing_key()).chain(
            self.extra_keys
                .iter()
                .flat_map(|keys| keys.iter().map(|k| &**k)),
        )
    }

    pub fn routing_keys_vec(&self) -> Vec<String> {
        self.routing_keys().map(str::to_string).collect()
    }

    /// Property flags and list, as they go on the wire (BCC already removed).
    pub fn raw_properties(&self) -> &[u8] {
        let start = self.header_len();
        &self.content[start..start + self.props_len as usize]
    }

    pub fn body(&self) -> &[u8] {
        &self.content[self.header_len() + self.props_len as usize..]
    }

    /// The body as shared bytes (no copy).
    pub fn body_bytes(&self) -> Bytes {
        self.content
            .slice(self.header_len() + self.props_len as usize..)
    }

    pub fn properties(&self) -> Result<BasicProperties, ContentError> {
        decode_properties(self.raw_properties())
    }

    /// Whether it carries an x-death history: dead-lettered by this broker, or published with
    /// a non-empty `x-death` array (a dead letter republished by a client or a shovel). The
    /// properties are decoded only for a message the broker did not dead-letter itself.
    pub fn has_death_history(&self) -> bool {
        self.dead_lettered || death_history_in(self.raw_properties())
    }

    /// Body bytes, the unit of max-length-bytes.
    pub fn body_len(&self) -> u64 {
        (self.content.len() - self.header_len() - self.props_len as usize) as u64
    }

    /// Bytes of its one allocation (exchange, keys, properties, body): what paging it out
    /// frees.
    pub fn content_len(&self) -> u64 {
        self.content.len() as u64
    }

    /// What a queue keeps of it while its content is on disk only.
    pub fn paged_meta(&self) -> PagedMeta {
        PagedMeta::from_parts(
            self.raw_properties(),
            self.body_len(),
            self.expiration_ms,
            self.dead_lettered,
        )
    }
}

/// Whether raw properties carry a non-empty `x-death` array.
fn death_history_in(raw_properties: &[u8]) -> bool {
    decode_properties(raw_properties).is_ok_and(|props| {
        props.headers().as_ref().is_some_and(|h| {
            matches!(
                h.inner().get("x-death"),
                Some(amq_protocol::types::AMQPValue::FieldArray(a)) if !a.as_slice().is_empty()
            )
        })
    })
}

/// What a queue keeps of a message whose content is on disk only (paged out): enough for
/// its length limits, its TTL and the dead-letter TTL exemption, without the content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedMeta {
    pub body_len: u64,
    pub expiration_ms: Option<u64>,
    /// It carries an x-death history ([`Message::has_death_history`]).
    pub death_history: bool,
}

impl PagedMeta {
    /// From a message's parts (recovery reads them from its record without building the
    /// message). The properties are decoded only when they may hold an x-death header.
    pub fn from_parts(
        raw_properties: &[u8],
        body_len: u64,
        expiration_ms: Option<u64>,
        dead_lettered: bool,
    ) -> PagedMeta {
        let death_history = dead_lettered
            || (raw_properties.windows(7).any(|w| w == b"x-death")
                && death_history_in(raw_properties));
        PagedMeta {
            body_len,
            expiration_ms,
            death_history,
        }
    }
}

/// Whether raw properties (flags, then the list) say delivery_mode 2, read without decoding
/// them: content-type, content-encoding and headers are skipped by their lengths.
fn persistent_in(raw: &[u8]) -> bool {
    const CONTENT_TYPE: u16 = 1 << 15;
    const CONTENT_ENCODING: u16 = 1 << 14;
    const HEADERS: u16 = 1 << 13;
    const DELIVERY_MODE: u16 = 1 << 12;
    let [a, b, ..] = raw else { return false };
    let flags = u16::from_be_bytes([*a, *b]);
    if flags & DELIVERY_MODE == 0 {
        return false;
    }
    let mut pos = 2usize;
    for bit in [CONTENT_TYPE, CONTENT_ENCODING] {
        if flags & bit != 0 {
            let Some(n) = raw.get(pos) else { return false };
            pos += 1 + *n as usize;
        }
    }
    if flags & HEADERS != 0 {
        let Some(&[a, b, c, d]) = raw.get(pos..pos + 4) else {
            return false;
        };
        pos += 4 + u32::from_be_bytes([a, b, c, d]) as usize;
    }
    raw.get(pos) == Some(&2)
}

/// A message inside one queue, with that queue's bookkeeping.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    pub message: Arc<Message>,
    /// Position in the queue's publish order; requeued messages go back to their position.
    pub seq: u64,
    /// Milliseconds since the broker's epoch when it entered the queue.
    pub enqueued_at: u64,
    /// Absolute expiry (broker milliseconds), the lower of queue and message TTL.
    pub expires_at: Option<u64>,
    /// How many times it was returned to the queue (x-delivery-count).
    pub delivery_count: u32,
    pub redelivered: bool,
    /// Its message id in storage, when it is kept on disk (persistent, in a durable queue).
    pub store_id: Option<u64>,
    /// Never expires in this queue: it has an x-death history and the queue keeps dead
    /// letters (`dead_letter.ttl_on_dead_letters = false`).
    pub ttl_exempt: bool,
}

impl QueuedMessage {
    pub fn body_len(&self) -> u64 {
        self.message.body_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_share_one_buffer_and_read_back() {
        let m = Message::new(
            "x",
            &["rk", "cc", "bcc"],
            &[0x80, 0],
            b"body",
            Some(5),
            false,
        );
        assert_eq!(m.exchange(), "x");
        assert_eq!(m.routing_key(), "rk");
        assert_eq!(m.routing_keys_vec(), vec!["rk", "cc", "bcc"]);
        assert_eq!(m.raw_properties(), &[0x80, 0]);
        assert_eq!(m.body(), b"body");
        assert_eq!(&m.body_bytes()[..], b"body");
        assert_eq!(m.body_len(), 4);
        assert_eq!(m.expiration_ms, Some(5));
    }

    #[test]
    fn delivery_mode_two_is_read_from_the_raw_properties() {
        use amq_protocol::protocol::BasicProperties;
        use amq_protocol::types::{AMQPValue, FieldTable};
        let mut headers = FieldTable::default();
        headers.insert("h".into(), AMQPValue::LongString("v".into()));
        let cases = [
            (BasicProperties::default(), false),
            (BasicProperties::default().with_delivery_mode(1), false),
            (BasicProperties::default().with_delivery_mode(2), true),
            (
                BasicProperties::default()
                    .with_content_type("text/plain".into())
                    .with_content_encoding("gzip".into())
                    .with_headers(headers)
                    .with_delivery_mode(2)
                    .with_priority(2),
                true,
            ),
        ];
        for (props, persistent) in cases {
            let raw = crate::amqp::content::encode_properties(&props);
            assert_eq!(persistent_in(&raw), persistent, "{props:?}");
        }
        assert!(!persistent_in(&[0x10]));
        assert!(!persistent_in(&[0x30, 0x00, 0, 0]));
    }

    #[test]
    fn paged_meta_finds_an_x_death_history_only_in_the_x_death_header() {
        use amq_protocol::protocol::BasicProperties;
        use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};
        let with = |name: &str, value: AMQPValue| {
            let mut headers = FieldTable::default();
            headers.insert(name.into(), value);
            let raw = crate::amqp::content::encode_properties(
                &BasicProperties::default().with_headers(headers),
            );
            Message::new("", &["k"], &raw, b"body", Some(7), false).paged_meta()
        };
        let mut deaths = FieldArray::default();
        deaths.push(AMQPValue::FieldTable(FieldTable::default()));
        let meta = with("x-death", AMQPValue::FieldArray(deaths));
        assert_eq!(
            meta,
            PagedMeta {
                body_len: 4,
                expiration_ms: Some(7),
                death_history: true
            }
        );
        assert!(!with("note", AMQPValue::LongString("x-death".into())).death_history);
        assert!(!with("x-death", AMQPValue::FieldArray(FieldArray::default())).death_history);
    }

    #[test]
    fn default_exchange_and_empty_key() {
        let m = Message::new("", &[""], &[0, 0], b"", None, true);
        assert_eq!(m.exchange(), "");
        assert_eq!(m.routing_key(), "");
        assert_eq!(m.routing_keys().count(), 1);
        assert_eq!(m.body_len(), 0);
    }
}
