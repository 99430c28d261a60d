//! Unit tests of [`crate::amqp::headers`].

use super::*;
use crate::amqp::content::{decode_properties, encode_properties, encode_properties_from};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

/// The encoded value of `depth` arrays inside each other (built without recursion).
fn nested_arrays(depth: usize) -> Vec<u8> {
    crate::amqp::depth::tests::nested(b'A', depth)
}

fn entry(key: &str, tag: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![key.len() as u8];
    out.extend_from_slice(key.as_bytes());
    out.push(tag);
    out.extend_from_slice(value);
    out
}

/// A property section: content-type "text/plain", then headers made of `entries`, then
/// priority 3.
fn properties(entries: &[Vec<u8>]) -> Vec<u8> {
    let contents: Vec<u8> = entries.concat();
    // content-type, headers and priority.
    let mut out = vec![0xA8, 0x00];
    out.push(10);
    out.extend_from_slice(b"text/plain");
    out.extend_from_slice(&(contents.len() as u32).to_be_bytes());
    out.extend_from_slice(&contents);
    out.push(3);
    out
}

fn long(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref().and_then(|h| h.inner().get(key))
}

#[test]
fn shallow_headers_are_left_as_they_are() {
    let raw = properties(&[
        entry("a", b'S', &long("x")),
        entry("n", b'A', &nested_arrays(63)),
    ]);
    assert!(matches!(shallow_properties(&raw), Ok(Cow::Borrowed(_))));
    let props = decode_properties(&raw).unwrap();
    assert!(matches!(
        header(&props, "n"),
        Some(AMQPValue::FieldArray(_))
    ));
    let encoded = encode_properties(&props);
    assert!(matches!(restore_opaque(&encoded, &raw), Cow::Borrowed(_)));
    // No headers at all.
    assert!(matches!(shallow_properties(&[0, 0]), Ok(Cow::Borrowed(_))));
}

#[test]
fn an_entry_one_level_past_the_limit_is_opaque_and_comes_back_byte_exact() {
    // 63 arrays + the headers table = 64 levels: decoded; 64 arrays: opaque.
    let deep = entry("deep", b'A', &nested_arrays(HEADER_DECODE_DEPTH));
    let raw = properties(&[
        entry("a", b'S', &long("x")),
        deep.clone(),
        entry("z", b'I', &[0, 0, 0, 7]),
    ]);
    let props = decode_properties(&raw).unwrap();
    assert_eq!(header(&props, "deep"), Some(&AMQPValue::Void));
    assert_eq!(
        header(&props, "a"),
        Some(&AMQPValue::LongString(LongString::from("x")))
    );
    assert_eq!(
        props.content_type().as_ref().map(|c| c.as_str()),
        Some("text/plain")
    );

    // A rewrite adds and removes other headers; the opaque one is put back.
    let mut headers = props.headers().clone().unwrap().inner().clone();
    headers.remove("z");
    headers.insert(ShortString::from("x-death"), AMQPValue::LongLongInt(1));
    let rewritten = props.clone().with_headers(FieldTable::from(headers));
    let encoded = encode_properties_from(&rewritten, &raw);
    let found = encoded
        .windows(deep.len())
        .filter(|w| *w == &deep[..])
        .count();
    assert_eq!(found, 1, "the deep entry, byte for byte");
    let again = decode_properties(&encoded).unwrap();
    assert_eq!(header(&again, "deep"), Some(&AMQPValue::Void));
    assert_eq!(header(&again, "x-death"), Some(&AMQPValue::LongLongInt(1)));
    assert_eq!(header(&again, "z"), None);
    assert_eq!(header(&again, "a"), header(&props, "a"));
    // Encoding again from the rewritten bytes keeps it too.
    let twice = encode_properties_from(&again, &encoded);
    assert_eq!(twice, encoded);
}

#[test]
fn ten_thousand_levels_never_reach_a_recursive_decoder() {
    let deep = entry("deep", b'A', &nested_arrays(10_000));
    let raw = properties(std::slice::from_ref(&deep));
    let handle = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            let props = decode_properties(&raw).unwrap();
            let encoded = encode_properties_from(&props, &raw);
            (props, encoded.to_vec(), raw)
        })
        .unwrap();
    let (props, encoded, raw) = handle.join().unwrap();
    assert_eq!(header(&props, "deep"), Some(&AMQPValue::Void));
    assert_eq!(encoded, raw);
}

#[test]
fn rule_keys_nested_too_deep_read_as_void_and_are_not_restored() {
    let deep = nested_arrays(HEADER_DECODE_DEPTH);
    for key in [
        "x-death",
        "CC",
        "BCC",
        "x-first-death-queue",
        "x-dlx-proxy-bcc",
    ] {
        assert!(is_rule_key(key.as_bytes()));
        let raw = properties(&[entry(key, b'A', &deep)]);
        let props = decode_properties(&raw).unwrap();
        assert_eq!(header(&props, key), Some(&AMQPValue::Void), "{key}");
        let encoded = encode_properties_from(&props, &raw);
        assert_eq!(encoded, encode_properties(&props), "{key} stays void");
    }
    assert!(!is_rule_key(b"x-deaths"));
}

#[test]
fn a_removed_or_replaced_opaque_key_stays_as_the_rewrite_left_it() {
    let raw = properties(&[entry("deep", b'A', &nested_arrays(100))]);
    let props = decode_properties(&raw).unwrap();
    let removed = props.clone().with_headers(FieldTable::default());
    assert_eq!(
        encode_properties_from(&removed, &raw),
        encode_properties(&removed)
    );
    let mut replaced = FieldTable::default();
    replaced.insert(ShortString::from("deep"), AMQPValue::Boolean(true));
    let replaced = props.with_headers(replaced);
    assert_eq!(
        encode_properties_from(&replaced, &raw),
        encode_properties(&replaced)
    );
}

#[test]
fn the_last_entry_of_a_repeated_key_decides() {
    let deep = entry("k", b'A', &nested_arrays(100));
    let shallow = entry("k", b'V', &[]);
    // Deep first, a (genuine) void later: the void counts, nothing is restored.
    let raw = properties(&[deep.clone(), shallow.clone()]);
    let props = decode_properties(&raw).unwrap();
    assert_eq!(
        encode_properties_from(&props, &raw),
        encode_properties(&props)
    );
    // Void first, deep later: the deep one counts.
    let raw = properties(&[shallow, deep.clone()]);
    let props = decode_properties(&raw).unwrap();
    let encoded = encode_properties_from(&props, &raw);
    assert!(encoded.windows(deep.len()).any(|w| w == &deep[..]));
}

#[test]
fn malformed_headers_do_not_decode() {
    let mut raw = properties(&[entry("deep", b'A', &nested_arrays(100))]);
    // The deep value claims more bytes than its table holds.
    let at = raw.len() - 1 - 100 * 5 + 3;
    raw[at] = 0xff;
    assert!(decode_properties(&raw).is_err());
    assert!(decode_properties(&properties(&[entry("a", b'?', &[])])).is_err());
    assert!(decode_properties(&[0x20, 0, 0, 0]).is_err());
}

#[test]
fn one_header_reads_as_a_full_decode_reads_it() {
    let key = "x-delivery-count";
    let cases: Vec<Vec<u8>> = vec![
        properties(&[entry(key, b'l', &7i64.to_be_bytes())]),
        properties(&[entry(key, b'L', &7i64.to_be_bytes())]),
        properties(&[entry(key, b'I', &(-2i32).to_be_bytes())]),
        properties(&[entry(key, b'i', &3u32.to_be_bytes())]),
        properties(&[entry(key, b's', &5i16.to_be_bytes())]),
        properties(&[entry(key, b'u', &5u16.to_be_bytes())]),
        properties(&[entry(key, b'b', &[0xfe])]),
        properties(&[entry(key, b'B', &[9])]),
        properties(&[entry(key, b'S', &long("4"))]),
        properties(&[entry(key, b'V', &[])]),
        // A repeated key: the last entry counts.
        properties(&[
            entry(key, b'l', &1i64.to_be_bytes()),
            entry("other", b'S', &long("x")),
            entry(key, b'l', &2i64.to_be_bytes()),
        ]),
        // Too deep to decode: void, as the full decode sees it.
        properties(&[entry(key, b'A', &nested_arrays(100))]),
        // Absent, with and without other headers.
        properties(&[entry("x-death", b'A', &nested_arrays(2))]),
        properties(&[]),
        encode_properties(&BasicProperties::default().with_priority(1)).to_vec(),
    ];
    for raw in &cases {
        let decoded = decode_properties(raw).expect("the case decodes");
        assert_eq!(
            header_value(raw, key).expect("the headers scan"),
            header(&decoded, key).cloned(),
            "{raw:?}"
        );
    }
    // Malformed headers: both refuse.
    let truncated = properties(&[entry(key, b'l', &[0, 0, 1])]);
    assert!(decode_properties(&truncated).is_err());
    assert!(header_value(&truncated, key).is_err());
    let unknown = properties(&[entry("a", b'?', &[]), entry(key, b'l', &[0; 8])]);
    assert!(decode_properties(&unknown).is_err());
    assert!(header_value(&unknown, key).is_err());
}
