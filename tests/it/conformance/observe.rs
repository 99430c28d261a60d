//! The normalised observation: what a scenario records about a message, a publish or an error,
//! in the exact JSON shape of the recording (`expected.json`, format `dlx-conformance/1`).
//!
//! A message becomes its body, exchange, routing key, redelivered flag, its non-empty basic
//! properties and its headers next to `header_types`, the AMQP field-type tag of every header
//! value nested the same way (`S` longstr, `l` int64, `I` int32, `T` timestamp, ...): types are
//! compared, not only values. Timestamps within a minute of now become `"recent-timestamp"`;
//! the scenario's random name suffix becomes `$SFX` everywhere (see [`replace_token`]). An
//! error becomes its reply code and the reply-text class (the text before ` - `).
//!
//! Properties and headers are decoded here from the content header's raw bytes (recorded by
//! [`super::tap`]), not taken from lapin, whose `FieldTable` keeps one value per key: a key
//! repeated on the wire keeps all its values, under `__duplicate_keys__`.

use amq_protocol::protocol::AMQPErrorKind;
use lapin::message::Delivery;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

/// What the random suffix of every name becomes in an observation.
pub const SUFFIX_TOKEN: &str = "$SFX";
/// A timestamp this close to now (seconds) is recorded as `"recent-timestamp"`.
const RECENT_WINDOW_S: f64 = 60.0;
/// Bodies and longstr values above this many bytes are recorded as length and SHA-256.
const INLINE_MAX: usize = 256;

/// Wall clock in seconds, the `now` the normalisation compares timestamps with.
pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of bytes, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(Sha256::digest(bytes).as_slice())
}

/// A body: UTF-8 text, `{"hex"}` when not UTF-8, `{"len", "sha256"}` above 256 bytes.
pub fn body_repr(body: &[u8]) -> Value {
    if body.len() > INLINE_MAX {
        return json!({"len": body.len(), "sha256": sha256_hex(body)});
    }
    match std::str::from_utf8(body) {
        Ok(text) => Value::String(text.to_string()),
        Err(_) => json!({"hex": hex(body)}),
    }
}

/// A field value as it was on the wire: its type tag and value. Tables keep every key in
/// wire order, repeated keys included.
#[derive(Clone, Debug, PartialEq)]
pub enum Typed {
    Table(Vec<(String, Typed)>),
    Array(Vec<Typed>),
    /// `S` (longstr) or `x` (byte array).
    Bytes(char, Vec<u8>),
    /// Every integer kind and `T` (timestamp), with its tag.
    Int(char, i128),
    Float(char, f64),
    Bool(bool),
    Decimal(u8, i32),
    Void,
}

/// Reads field values from a byte slice; every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    depth: usize,
}

/// How deeply arrays and tables may nest (the decoder recurses once per level).
const MAX_DEPTH: usize = 64;

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("truncated at byte {} (need {n})", self.at))?;
        let bytes = &self.buf[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let bytes = self.take(N)?;
        bytes.try_into().map_err(|_| "short read".to_string())
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn shortstr(&mut self) -> Result<Vec<u8>, String> {
        let n = self.u8()?;
        Ok(self.take(n.into())?.to_vec())
    }

    fn value(&mut self) -> Result<Typed, String> {
        let tag = char::from(self.u8()?);
        Ok(match tag {
            't' => Typed::Bool(self.u8()? != 0),
            'b' => Typed::Int(tag, i8::from_be_bytes(self.array()?).into()),
            'B' => Typed::Int(tag, self.u8()?.into()),
            's' | 'U' => Typed::Int(tag, i16::from_be_bytes(self.array()?).into()),
            'u' => Typed::Int(tag, self.u16()?.into()),
            'I' => Typed::Int(tag, i32::from_be_bytes(self.array()?).into()),
            'i' => Typed::Int(tag, self.u32()?.into()),
            'l' | 'L' => Typed::Int(tag, i64::from_be_bytes(self.array()?).into()),
            'T' => Typed::Int(tag, u64::from_be_bytes(self.array()?).into()),
            'f' => Typed::Float(tag, f32::from_be_bytes(self.array()?).into()),
            'd' => Typed::Float(tag, f64::from_be_bytes(self.array()?)),
            'D' => Typed::Decimal(self.u8()?, i32::from_be_bytes(self.array()?)),
            'S' | 'x' => {
                let n = self.u32()? as usize;
                Typed::Bytes(tag, self.take(n)?.to_vec())
            }
            'A' => {
                let mut inner = self.sized()?;
                let mut items = Vec::new();
                while inner.at < inner.buf.len() {
                    items.push(inner.value()?);
                }
                Typed::Array(items)
            }
            'F' => Typed::Table(self.table()?),
            'V' => Typed::Void,
            other => return Err(format!("unknown field type {other:?}")),
        })
    }

    fn table(&mut self) -> Result<Vec<(String, Typed)>, String> {
        let mut inner = self.sized()?;
        let mut items = Vec::new();
        while inner.at < inner.buf.len() {
            let key = String::from_utf8_lossy(&inner.shortstr()?).into_owned();
            items.push((key, inner.value()?));
        }
        Ok(items)
    }

    /// A reader over the next long-size-prefixed block (an array's or a table's), one level
    /// deeper; nesting past [`MAX_DEPTH`] is an error.
    fn sized(&mut self) -> Result<Reader<'a>, String> {
        if self.depth >= MAX_DEPTH {
            return Err(format!("tables nested deeper than {MAX_DEPTH}"));
        }
        let n = self.u32()? as usize;
        Ok(Reader {
            buf: self.take(n)?,
            at: 0,
            depth: self.depth + 1,
        })
    }
}

/// One basic property as it was on the wire.
#[derive(Debug, PartialEq)]
enum Property {
    Short(Vec<u8>),
    Octet(u8),
    Timestamp(u64),
    Table(Vec<(String, Typed)>),
}

/// The basic properties in wire order, by name (`type` is the property named type).
const PROPERTIES: [&str; 14] = [
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
];

/// Decodes a content header's property flags and list (the bytes after class, weight and
/// body size): the present properties by name.
fn decode_properties(raw: &[u8]) -> Result<Vec<(&'static str, Property)>, String> {
    let mut r = Reader {
        buf: raw,
        at: 0,
        depth: 0,
    };
    let mut flags: u64 = 0;
    for word in 0..4 {
        let partial = u64::from(r.u16()?);
        flags |= partial << (word * 16);
        if partial & 1 == 0 {
            break;
        }
    }
    let mut out = Vec::new();
    for (i, name) in PROPERTIES.iter().enumerate() {
        if flags & (1 << (15 - i)) == 0 {
            continue;
        }
        let value = match *name {
            "headers" => Property::Table(r.table()?),
            "delivery_mode" | "priority" => Property::Octet(r.u8()?),
            "timestamp" => Property::Timestamp(u64::from_be_bytes(r.array()?)),
            _ => Property::Short(r.shortstr()?),
        };
        out.push((*name, value));
    }
    Ok(out)
}

fn is_int_tag(tag: char) -> bool {
    matches!(
        tag,
        'b' | 'B' | 's' | 'U' | 'u' | 'I' | 'i' | 'l' | 'L' | 'T'
    )
}

fn float(f: f64) -> Value {
    serde_json::Number::from_f64(f)
        .map(Value::Number)
        .unwrap_or_else(|| Value::String("NaN".into()))
}

/// Bytes as text, or `{wrapper: hex}` when they are not UTF-8.
fn text_or_hex(bytes: &[u8], wrapper: &str) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(text.to_string()),
        Err(_) => json!({ wrapper: hex(bytes) }),
    }
}

/// A typed value → (plain value, type signature). `key` is the table key the value sits
/// under: an integer named `time` is a timestamp too.
pub fn norm_typed(value: &Typed, now: f64, key: Option<&str>) -> (Value, Value) {
    let sig = |t: char| Value::String(t.to_string());
    match value {
        Typed::Table(items) => norm_table(items, now),
        Typed::Array(items) => {
            let (values, sigs) = items.iter().map(|v| norm_typed(v, now, None)).unzip();
            (Value::Array(values), Value::Array(sigs))
        }
        Typed::Bytes('S', bytes) if bytes.len() > INLINE_MAX => (
            json!({"len": bytes.len(), "sha256": sha256_hex(bytes)}),
            sig('S'),
        ),
        Typed::Bytes('S', bytes) => (text_or_hex(bytes, "bytes_hex"), sig('S')),
        Typed::Bytes(tag, bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => (json!({ "binary": text }), sig(*tag)),
            Err(_) => (json!({ "binary_hex": hex(bytes) }), sig(*tag)),
        },
        Typed::Int(tag, n) if *tag == 'T' || (key == Some("time") && is_int_tag(*tag)) => {
            if (*n as f64 - now).abs() <= RECENT_WINDOW_S {
                (json!("recent-timestamp"), sig(*tag))
            } else {
                (json!(*n as i64), sig(*tag))
            }
        }
        Typed::Int(tag, n) => (json!(*n as i64), sig(*tag)),
        Typed::Float(tag, f) => (float(*f), sig(*tag)),
        Typed::Bool(b) => (json!(b), sig('t')),
        Typed::Decimal(scale, raw) => (json!({"decimal": [scale, raw]}), sig('D')),
        Typed::Void => (Value::Null, sig('V')),
    }
}

/// A table → (values by key, type signatures by key). A key repeated on the wire keeps all
/// its values, in wire order, under `__duplicate_keys__`.
pub fn norm_table(items: &[(String, Typed)], now: f64) -> (Value, Value) {
    let mut grouped: Vec<(&str, Vec<(Value, Value)>)> = Vec::new();
    for (k, v) in items {
        let normalised = norm_typed(v, now, Some(k));
        match grouped.iter_mut().find(|(key, _)| key == k) {
            Some((_, values)) => values.push(normalised),
            None => grouped.push((k, vec![normalised])),
        }
    }
    let mut values = Map::new();
    let mut sigs = Map::new();
    for (k, mut vals) in grouped {
        if vals.len() == 1 {
            let (v, s) = vals.remove(0);
            values.insert(k.to_string(), v);
            sigs.insert(k.to_string(), s);
        } else {
            let (vs, ss): (Vec<Value>, Vec<Value>) = vals.into_iter().unzip();
            values.insert(k.to_string(), json!({ "__duplicate_keys__": vs }));
            sigs.insert(k.to_string(), json!({ "__duplicate_keys__": ss }));
        }
    }
    (Value::Object(values), Value::Object(sigs))
}

/// A delivery as the recording shows it: body, exchange, routing key and redelivered from
/// the delivery, properties and headers from `raw`, its content header's property bytes. A
/// `user_id` equal to `username` becomes `$USER`.
pub fn message(d: &Delivery, raw: &[u8], username: &str) -> Result<Value, String> {
    let now = now_secs();
    let mut props = Map::new();
    let mut headers = (json!({}), json!({}));
    for (name, value) in decode_properties(raw).map_err(|e| format!("FieldDecodeError: {e}"))? {
        let v = match value {
            Property::Table(items) => {
                if !items.is_empty() {
                    headers = norm_table(&items, now);
                }
                continue;
            }
            Property::Short(s) if name == "user_id" && s == username.as_bytes() => json!("$USER"),
            Property::Short(s) => text_or_hex(&s, "hex"),
            Property::Octet(n) => json!(n),
            Property::Timestamp(n) => json!(n),
        };
        props.insert(name.to_string(), v);
    }
    Ok(json!({
        "body": body_repr(&d.data),
        "exchange": d.exchange.as_str(),
        "routing_key": d.routing_key.as_str(),
        "redelivered": d.redelivered,
        "props": props,
        "headers": headers.0,
        "header_types": headers.1,
    }))
}

/// `'PRECONDITION_FAILED - inequivalent arg ...'` → `'PRECONDITION_FAILED'`.
pub fn reply_class(text: &str) -> String {
    text.split(" - ").next().unwrap_or("").trim().to_string()
}

/// A lapin error as the recording shows it: a broker close with its code and reply-text
/// class, or what state the channel or connection was found in.
pub fn error(e: &lapin::Error) -> Value {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            let kind = match amqp.kind() {
                AMQPErrorKind::Soft(_) => "channel-closed",
                AMQPErrorKind::Hard(_) => "connection-closed",
            };
            json!({
                "error": kind,
                "code": amqp.get_id(),
                "text": reply_class(amqp.get_message().as_str()),
            })
        }
        lapin::ErrorKind::InvalidChannelState(..) | lapin::ErrorKind::ChannelsLimitReached => {
            json!({"error": "channel-not-open"})
        }
        lapin::ErrorKind::IOError(_) => json!({"error": "connection-lost"}),
        lapin::ErrorKind::InvalidConnectionState(_) => json!({"error": "connection-not-open"}),
        other => json!({"error": "exception", "type": format!("{other:?}")
            .split(['(', ' ', '{'])
            .next()
            .unwrap_or("")}),
    }
}

/// Replaces `token` by `with` in every string and object key.
pub fn replace_token(value: Value, token: &str, with: &str) -> Value {
    match value {
        Value::String(s) => Value::String(s.replace(token, with)),
        Value::Array(items) => Value::Array(
            items
                .into_iter()
                .map(|v| replace_token(v, token, with))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k.replace(token, with), replace_token(v, token, with)))
                .collect(),
        ),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn longstr(tag: u8, s: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&(s.len() as u32).to_be_bytes());
        v.extend_from_slice(s);
        v
    }

    fn entry(key: &str, value: Vec<u8>) -> Vec<u8> {
        let mut v = vec![key.len() as u8];
        v.extend_from_slice(key.as_bytes());
        v.extend(value);
        v
    }

    fn table(entries: Vec<Vec<u8>>) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend(body);
        v
    }

    #[test]
    fn headers_keep_types_nesting_and_repeated_keys() {
        let now = 1_800_000_000.0;
        let mut time = vec![b'T'];
        time.extend_from_slice(&1_800_000_030u64.to_be_bytes());
        let mut count = vec![b'l'];
        count.extend_from_slice(&2i64.to_be_bytes());
        let death = table(vec![entry("count", count), entry("time", time)]);
        let mut array = vec![b'A'];
        let mut x_death = vec![b'F'];
        x_death.extend(death);
        array.extend_from_slice(&(x_death.len() as u32).to_be_bytes());
        array.extend(x_death);
        let headers = table(vec![
            entry("x-death", array),
            entry("r", longstr(b'S', b"a")),
            entry("r", longstr(b'S', b"b")),
            entry("bin", longstr(b'x', &[0, 1])),
            entry("n", vec![b'U', 0, 42]),
        ]);
        // flags: headers (bit 13) and priority (bit 11)
        let mut raw = 0x2800u16.to_be_bytes().to_vec();
        raw.extend(headers);
        raw.push(7);
        let items = match decode_properties(&raw).unwrap().remove(0) {
            ("headers", Property::Table(items)) => items,
            other => panic!("{other:?}"),
        };
        let (values, sigs) = norm_table(&items, now);
        assert_eq!(
            values,
            json!({"x-death": [{"count": 2, "time": "recent-timestamp"}],
                   "r": {"__duplicate_keys__": ["a", "b"]}, "bin": {"binary": "\u{0}\u{1}"}, "n": 42})
        );
        assert_eq!(
            sigs,
            json!({"x-death": [{"count": "l", "time": "T"}],
                   "r": {"__duplicate_keys__": ["S", "S"]}, "bin": "x", "n": "U"})
        );
        assert_eq!(
            decode_properties(&raw).unwrap()[1],
            ("priority", Property::Octet(7))
        );
    }

    #[test]
    fn truncated_or_unknown_input_is_an_error_not_a_panic() {
        assert!(decode_properties(&[0x20]).is_err());
        assert!(decode_properties(&[0x20, 0x00, 0, 0, 0, 9, 1, b'k']).is_err());
        let mut deep = vec![b'V'];
        for _ in 0..100 {
            let mut outer = vec![b'A'];
            outer.extend_from_slice(&(deep.len() as u32).to_be_bytes());
            outer.extend(deep);
            deep = outer;
        }
        let mut raw = 0x2000u16.to_be_bytes().to_vec();
        raw.extend(table(vec![entry("k", deep)]));
        assert!(decode_properties(&raw).is_err());
        let unknown = table(vec![entry("k", vec![b'Z'])]);
        let mut raw = 0x2000u16.to_be_bytes().to_vec();
        raw.extend(unknown);
        assert!(decode_properties(&raw).is_err());
    }

    #[test]
    fn an_integer_named_time_is_a_timestamp_too() {
        let (v, sig) = norm_typed(&Typed::Int('I', 1000), 1010.0, Some("time"));
        assert_eq!((v, sig), (json!("recent-timestamp"), json!("I")));
        let (v, _) = norm_typed(&Typed::Int('I', 1000), 1010.0, None);
        assert_eq!(v, json!(1000));
    }

    #[test]
    fn long_bodies_become_length_and_digest() {
        assert_eq!(body_repr(b"m1"), json!("m1"));
        assert_eq!(body_repr(&[0xff]), json!({"hex": "ff"}));
        let long = vec![b'a'; 300];
        assert_eq!(body_repr(&long)["len"], json!(300));
        assert_eq!(body_repr(&long)["sha256"].as_str().map(str::len), Some(64));
    }

    #[test]
    fn the_suffix_is_replaced_in_keys_and_values() {
        let v = json!({"q.dlxhabc": ["x.dlxhabc", 1]});
        assert_eq!(
            replace_token(v, "dlxhabc", "$SFX"),
            json!({"q.$SFX": ["x.$SFX", 1]})
        );
        assert_eq!(
            reply_class("PRECONDITION_FAILED - inequivalent arg"),
            "PRECONDITION_FAILED"
        );
    }
}
