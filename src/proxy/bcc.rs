//! BCC keys for dead-lettering: RabbitMQ routes a dead-lettered message (without a
//! dead-letter routing key) with every key it was published with, BCC keys included, but it
//! strips the `BCC` header at publish, so no consumer, and so not the proxy, ever sees them.
//!
//! The proxy therefore copies them, at publish, into a header of its own that the upstream
//! keeps: [`PRIVATE_BCC_HEADER`] (`x-dlx-proxy-bcc`, an array of longstr keys, like `BCC`).
//! - client → upstream: a basic.publish content header that carries `BCC` (or the private
//!   header, which a client may not set) is rewritten ([`publish_header`]): the private header
//!   gets the BCC keys, `BCC` stays for the upstream to route by and strip. Every other publish
//!   is forwarded as its bytes; spotting the two keys costs a byte scan of header frames
//!   whose property flags announce headers. One content header frame replaces another, so
//!   frame counts, delivery tags and confirm sequence numbers are unchanged; a rewrite that
//!   would not fit `frame_max` keeps no BCC keys.
//! - upstream → client: the private header is removed from every delivered, got or returned
//!   message that has one ([`delivered_header`]); the proxy's kept copy still has it.
//! - dead-lettering: [`kept_bcc_keys`] are routing keys after the publish key and the CC keys
//!   (never in x-death's `routing-keys`, as in RabbitMQ); a dead letter routed with BCC keys
//!   carries them in the private header again, so a second hop routes with them too.
//!
//! The proxy's other private header, [`PRIVATE_HOP_HEADER`] (`x-dlx-proxy-hop`), marks a
//! message the proxy dead-lettered: it stays on the message in the queues its dead-letter
//! exchange routed it to, and goes when a client republishes it (clients never see it, and may
//! not set it). The cycle rule for dead-letter exchanges other than the default one reads it
//! ([`super::outgoing::keys_after_cycle_rule`]). Both directions treat every header named
//! `x-dlx-proxy-...` as private, with one byte scan for the prefix.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::{BufMut, Bytes, BytesMut};

use crate::amqp::content::{decode_properties, encode_properties_from};
use crate::deadletter::HEADER_BCC;

/// The header in which the proxy keeps a message's BCC keys.
pub const PRIVATE_BCC_HEADER: &str = "x-dlx-proxy-bcc";

/// The header that marks a message the proxy dead-lettered (true), until a client republishes
/// it.
pub const PRIVATE_HOP_HEADER: &str = "x-dlx-proxy-hop";

/// What the name of every private header starts with.
pub(crate) const PRIVATE_HEADER_PREFIX: &str = "x-dlx-proxy-";

/// Bytes of a content header payload before the property flags: class, weight, body size.
const CONTENT_HEADER_PREFIX: usize = 12;

/// Property flag bit of `headers` (the third basic property).
const HEADERS_FLAG: u16 = 0x2000;

/// How the keys look inside an encoded table (a shortstr: length octet, then the name).
const BCC_KEY_BYTES: &[u8] = b"\x03BCC";
const PRIVATE_PREFIX_BYTES: &[u8] = PRIVATE_HEADER_PREFIX.as_bytes();

/// Whether a content header payload may hold a header table containing `key_bytes` (a cheap
/// test: false positives are settled by decoding).
fn may_hold(payload: &[u8], key_bytes: &[u8]) -> bool {
    let Some(flags) = payload.get(CONTENT_HEADER_PREFIX..CONTENT_HEADER_PREFIX + 2) else {
        return false;
    };
    u16::from_be_bytes([flags[0], flags[1]]) & HEADERS_FLAG != 0
        && payload[CONTENT_HEADER_PREFIX..]
            .windows(key_bytes.len())
            .any(|w| w == key_bytes)
}

fn long_string_keys(value: &AMQPValue) -> Vec<String> {
    crate::deadletter::routing_key_list(Some(value))
}

/// The array value of a key header.
pub fn keys_value(keys: &[String]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        keys.iter()
            .map(|k| AMQPValue::LongString(LongString::from(k.as_str())))
            .collect::<Vec<_>>(),
    ))
}

/// Removes every private header; whether there was one.
fn remove_private(headers: &mut std::collections::BTreeMap<ShortString, AMQPValue>) -> bool {
    let before = headers.len();
    headers.retain(|key, _| !key.as_str().starts_with(PRIVATE_HEADER_PREFIX));
    headers.len() != before
}

/// `props` without the proxy's private headers: what a republish of the message carries (a
/// redrive is one: its message is no longer the proxy's dead letter, and its BCC keys went
/// with the publish that had them).
pub fn without_private_headers(props: &BasicProperties) -> BasicProperties {
    let Some(headers) = props.headers().as_ref() else {
        return props.clone();
    };
    let mut headers = headers.inner().clone();
    if !remove_private(&mut headers) {
        return props.clone();
    }
    props.clone().with_headers(FieldTable::from(headers))
}

/// A property section without [`PRIVATE_HOP_HEADER`], or `None` when it has none (or cannot
/// be read): what a dead letter too large for one frame with the mark goes out as.
pub fn without_hop_header(raw_properties: &[u8]) -> Option<Bytes> {
    let key = PRIVATE_HOP_HEADER.as_bytes();
    if !raw_properties.windows(key.len()).any(|w| w == key) {
        return None;
    }
    let props = decode_properties(raw_properties).ok()?;
    let mut headers = props.headers().as_ref()?.inner().clone();
    headers.remove(PRIVATE_HOP_HEADER)?;
    Some(encode_properties_from(
        &props.with_headers(FieldTable::from(headers)),
        raw_properties,
    ))
}

/// Whether the proxy dead-lettered this message, and no client republished it since.
pub fn dead_lettered_by_proxy(props: &BasicProperties) -> bool {
    props
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key(PRIVATE_HOP_HEADER))
}

/// The BCC keys the proxy kept for a message (empty when none).
pub fn kept_bcc_keys(props: &BasicProperties) -> Vec<String> {
    props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(PRIVATE_BCC_HEADER))
        .map(long_string_keys)
        .unwrap_or_default()
}

fn with_headers(payload: &[u8], props: BasicProperties, headers: FieldTable) -> Bytes {
    let properties = encode_properties_from(
        &props.with_headers(headers),
        &payload[CONTENT_HEADER_PREFIX..],
    );
    let mut out = BytesMut::with_capacity(CONTENT_HEADER_PREFIX + properties.len());
    out.put_slice(&payload[..CONTENT_HEADER_PREFIX]);
    out.put_slice(&properties);
    out.freeze()
}

/// The content header payload to send upstream instead of a client's publish `payload`, or
/// `None` to forward it unchanged. The rewritten payload is at most `max_payload` bytes: when
/// the kept keys would not fit, only a client's own private header is removed.
pub fn publish_header(payload: &[u8], max_payload: usize) -> Option<Bytes> {
    if !may_hold(payload, BCC_KEY_BYTES) && !may_hold(payload, PRIVATE_PREFIX_BYTES) {
        return None;
    }
    let props = decode_properties(&payload[CONTENT_HEADER_PREFIX..]).ok()?;
    let mut headers = props.headers().as_ref()?.inner().clone();
    let bcc = headers
        .get(HEADER_BCC)
        .map(long_string_keys)
        .unwrap_or_default();
    let had_private = remove_private(&mut headers);
    if !bcc.is_empty() {
        let mut kept = headers.clone();
        kept.insert(ShortString::from(PRIVATE_BCC_HEADER), keys_value(&bcc));
        let rewritten = with_headers(payload, props.clone(), FieldTable::from(kept));
        if rewritten.len() <= max_payload {
            return Some(rewritten);
        }
        tracing::debug!(
            keys = bcc.len(),
            "BCC keys not kept for dead-lettering: the content header would exceed frame_max"
        );
    }
    had_private.then(|| with_headers(payload, props, FieldTable::from(headers)))
}

/// The content header payload to deliver to a client instead of `payload`, without the
/// private headers, or `None` when it has none.
pub fn delivered_header(payload: &[u8]) -> Option<Bytes> {
    if !may_hold(payload, PRIVATE_PREFIX_BYTES) {
        return None;
    }
    let props = decode_properties(&payload[CONTENT_HEADER_PREFIX..]).ok()?;
    let mut headers = props.headers().as_ref()?.inner().clone();
    if !remove_private(&mut headers) {
        return None;
    }
    Some(with_headers(payload, props, FieldTable::from(headers)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::content::encode_properties;
    use crate::deadletter::HEADER_CC;

    fn payload_of(props: &BasicProperties) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        payload.extend_from_slice(&encode_properties(props));
        payload
    }

    fn headers_of(payload: &[u8]) -> std::collections::BTreeMap<ShortString, AMQPValue> {
        assert_eq!(&payload[..12], &[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5]);
        decode_properties(&payload[12..])
            .unwrap()
            .headers()
            .clone()
            .map(|h| h.inner().clone())
            .unwrap_or_default()
    }

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|k| k.to_string()).collect()
    }

    fn props(entries: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in entries {
            table.insert(ShortString::from(*k), v.clone());
        }
        BasicProperties::default()
            .with_headers(table)
            .with_content_type("text/plain".into())
    }

    #[test]
    fn publishes_without_bcc_are_left_alone() {
        assert_eq!(
            publish_header(&payload_of(&BasicProperties::default()), 4096),
            None
        );
        let cc_only = props(&[(HEADER_CC, keys_value(&keys(&["b"])))]);
        assert_eq!(publish_header(&payload_of(&cc_only), 4096), None);
        // The key's bytes in a value are a false alarm, settled by decoding.
        let lookalike = props(&[("note", AMQPValue::LongString("\x03BCC".into()))]);
        assert_eq!(publish_header(&payload_of(&lookalike), 4096), None);
        // Too short to be a content header.
        assert_eq!(publish_header(&[0, 60], 4096), None);
    }

    #[test]
    fn bcc_keys_are_kept_in_the_private_header_and_bcc_stays() {
        let original = props(&[
            (HEADER_BCC, keys_value(&keys(&["c", "d"]))),
            ("keep", AMQPValue::LongString("yes".into())),
        ]);
        let rewritten = publish_header(&payload_of(&original), 4096).unwrap();
        let headers = headers_of(&rewritten);
        assert_eq!(
            headers.get(HEADER_BCC),
            Some(&keys_value(&keys(&["c", "d"])))
        );
        assert_eq!(
            headers.get(PRIVATE_BCC_HEADER),
            Some(&keys_value(&keys(&["c", "d"])))
        );
        assert_eq!(
            headers.get("keep"),
            Some(&AMQPValue::LongString("yes".into()))
        );
        let decoded = decode_properties(&rewritten[12..]).unwrap();
        assert_eq!(
            decoded.content_type().as_ref().unwrap().as_str(),
            "text/plain"
        );
        assert_eq!(kept_bcc_keys(&decoded), keys(&["c", "d"]));
        // Delivered: the private header goes, everything else stays.
        let delivered = delivered_header(&rewritten).unwrap();
        let headers = headers_of(&delivered);
        assert!(!headers.contains_key(PRIVATE_BCC_HEADER));
        assert_eq!(
            headers.get("keep"),
            Some(&AMQPValue::LongString("yes".into()))
        );
        assert_eq!(delivered_header(&delivered), None);
    }

    #[test]
    fn a_clients_own_private_header_is_replaced_or_removed() {
        let spoofed = props(&[(PRIVATE_BCC_HEADER, keys_value(&keys(&["evil"])))]);
        let rewritten = publish_header(&payload_of(&spoofed), 4096).unwrap();
        assert!(!headers_of(&rewritten).contains_key(PRIVATE_BCC_HEADER));
        let both = props(&[
            (PRIVATE_BCC_HEADER, keys_value(&keys(&["evil"]))),
            (HEADER_BCC, keys_value(&keys(&["c"]))),
        ]);
        let rewritten = publish_header(&payload_of(&both), 4096).unwrap();
        assert_eq!(
            headers_of(&rewritten).get(PRIVATE_BCC_HEADER),
            Some(&keys_value(&keys(&["c"])))
        );
    }

    /// The proxy's mark of its own dead letters: a client may not set it (so its republish
    /// is not taken for the proxy's) and never sees it.
    #[test]
    fn the_dead_letter_mark_is_the_proxys_alone() {
        let marked = props(&[
            (PRIVATE_HOP_HEADER, AMQPValue::Boolean(true)),
            ("keep", AMQPValue::LongString("yes".into())),
        ]);
        assert!(dead_lettered_by_proxy(&marked));
        for rewritten in [
            publish_header(&payload_of(&marked), 4096).unwrap(),
            delivered_header(&payload_of(&marked)).unwrap(),
        ] {
            let headers = headers_of(&rewritten);
            assert!(!headers.contains_key(PRIVATE_HOP_HEADER));
            assert!(headers.contains_key("keep"));
        }
        let plain = props(&[("keep", AMQPValue::LongString("yes".into()))]);
        assert!(!dead_lettered_by_proxy(&plain));
        assert_eq!(delivered_header(&payload_of(&plain)), None);
    }

    #[test]
    fn only_long_string_keys_of_an_array_count() {
        // RabbitMQ routes only the longstr elements of a BCC array; a BCC that is not an
        // array is the upstream's to refuse.
        let mixed = props(&[(
            HEADER_BCC,
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongInt(1),
                AMQPValue::LongString("c".into()),
            ])),
        )]);
        let rewritten = publish_header(&payload_of(&mixed), 4096).unwrap();
        assert_eq!(
            headers_of(&rewritten).get(PRIVATE_BCC_HEADER),
            Some(&keys_value(&keys(&["c"])))
        );
        let not_an_array = props(&[(HEADER_BCC, AMQPValue::LongString("c".into()))]);
        assert_eq!(publish_header(&payload_of(&not_an_array), 4096), None);
    }

    #[test]
    fn a_rewrite_that_would_not_fit_keeps_no_keys() {
        let original = props(&[(HEADER_BCC, keys_value(&keys(&["c"; 20])))]);
        let payload = payload_of(&original);
        assert_eq!(publish_header(&payload, payload.len()), None);
        let spoofed = props(&[
            (HEADER_BCC, keys_value(&keys(&["c"; 20]))),
            (PRIVATE_BCC_HEADER, keys_value(&keys(&["x"]))),
        ]);
        let payload = payload_of(&spoofed);
        let stripped = publish_header(&payload, payload.len()).unwrap();
        assert!(stripped.len() < payload.len());
        let headers = headers_of(&stripped);
        assert!(!headers.contains_key(PRIVATE_BCC_HEADER));
        assert!(headers.contains_key(HEADER_BCC));
    }
}
