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
//! Header tables come from lapin, which keeps every value's type but keeps one value per key
//! (the last) and reads the rare `U`/`L` tags as `s`/`l`; the recording has neither.

use amq_protocol::protocol::AMQPErrorKind;
use amq_protocol::types::{AMQPValue, FieldTable};
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

/// The AMQP field-type tag of a value (`l` for both 64-bit integer kinds).
fn tag(value: &AMQPValue) -> char {
    value.get_type().get_id()
}

fn is_int_tag(tag: char) -> bool {
    matches!(
        tag,
        'b' | 'B' | 's' | 'U' | 'u' | 'I' | 'i' | 'l' | 'L' | 'T'
    )
}

/// An integer value as i128 (every integer kind and the timestamp), else `None`.
fn as_integer(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(n) => *n as i128,
        AMQPValue::ShortShortUInt(n) => *n as i128,
        AMQPValue::ShortInt(n) => *n as i128,
        AMQPValue::ShortUInt(n) => *n as i128,
        AMQPValue::LongInt(n) => *n as i128,
        AMQPValue::LongUInt(n) => *n as i128,
        AMQPValue::LongLongInt(n) => *n as i128,
        AMQPValue::Timestamp(n) => *n as i128,
        _ => return None,
    })
}

fn float(f: f64) -> Value {
    serde_json::Number::from_f64(f)
        .map(Value::Number)
        .unwrap_or_else(|| Value::String("NaN".into()))
}

/// A typed field value → (plain value, type signature). `key` is the table key the value sits
/// under: an integer named `time` is a timestamp too.
pub fn norm_typed(value: &AMQPValue, now: f64, key: Option<&str>) -> (Value, Value) {
    let t = tag(value);
    let sig = Value::String(t.to_string());
    let is_time = t == 'T' || (key == Some("time") && is_int_tag(t));
    if is_time && let Some(n) = as_integer(value) {
        if (n as f64 - now).abs() <= RECENT_WINDOW_S {
            return (Value::String("recent-timestamp".into()), sig);
        }
        return (json!(n as i64), sig);
    }
    let plain = match value {
        AMQPValue::FieldTable(table) => return norm_table(table, now),
        AMQPValue::FieldArray(items) => {
            let (values, sigs): (Vec<Value>, Vec<Value>) = items
                .as_slice()
                .iter()
                .map(|item| norm_typed(item, now, None))
                .unzip();
            return (Value::Array(values), Value::Array(sigs));
        }
        AMQPValue::LongString(s) => {
            let bytes = s.as_bytes();
            if bytes.len() > INLINE_MAX {
                json!({"len": bytes.len(), "sha256": sha256_hex(bytes)})
            } else {
                match std::str::from_utf8(bytes) {
                    Ok(text) => Value::String(text.to_string()),
                    Err(_) => json!({"bytes_hex": hex(bytes)}),
                }
            }
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::ByteArray(b) => match std::str::from_utf8(b.as_slice()) {
            Ok(text) => json!({"binary": text}),
            Err(_) => json!({"binary_hex": hex(b.as_slice())}),
        },
        AMQPValue::DecimalValue(d) => json!({"decimal": [d.scale, d.value]}),
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::Float(f) => float(*f as f64),
        AMQPValue::Double(f) => float(*f),
        AMQPValue::Void => Value::Null,
        other => match as_integer(other) {
            Some(n) => json!(n as i64),
            None => Value::Null,
        },
    };
    (plain, sig)
}

/// A header table → (values by key, type signatures by key).
pub fn norm_table(table: &FieldTable, now: f64) -> (Value, Value) {
    let mut values = Map::new();
    let mut sigs = Map::new();
    for (k, v) in table.inner() {
        let (value, sig) = norm_typed(v, now, Some(k.as_str()));
        values.insert(k.as_str().to_string(), value);
        sigs.insert(k.as_str().to_string(), sig);
    }
    (Value::Object(values), Value::Object(sigs))
}

/// A delivery (basic.deliver or basic.get-ok) as the recording shows it. A `user_id` equal to
/// `username` becomes `$USER`.
pub fn message(d: &Delivery, username: &str) -> Value {
    let now = now_secs();
    let p = &d.properties;
    let mut props = Map::new();
    let mut text = |name: &str, v: &Option<amq_protocol::types::ShortString>| {
        if let Some(v) = v {
            let s = v.as_str();
            let s = if name == "user_id" && s == username {
                "$USER"
            } else {
                s
            };
            props.insert(name.to_string(), Value::String(s.to_string()));
        }
    };
    text("content_type", p.content_type());
    text("content_encoding", p.content_encoding());
    text("correlation_id", p.correlation_id());
    text("reply_to", p.reply_to());
    text("expiration", p.expiration());
    text("message_id", p.message_id());
    text("type", p.kind());
    text("user_id", p.user_id());
    text("app_id", p.app_id());
    text("cluster_id", p.cluster_id());
    if let Some(v) = p.delivery_mode() {
        props.insert("delivery_mode".into(), json!(v));
    }
    if let Some(v) = p.priority() {
        props.insert("priority".into(), json!(v));
    }
    if let Some(v) = p.timestamp() {
        props.insert("timestamp".into(), json!(v));
    }
    let (headers, header_types) = match p.headers() {
        Some(table) => norm_table(table, now),
        None => (json!({}), json!({})),
    };
    json!({
        "body": body_repr(&d.data),
        "exchange": d.exchange.as_str(),
        "routing_key": d.routing_key.as_str(),
        "redelivered": d.redelivered,
        "props": props,
        "headers": headers,
        "header_types": header_types,
    })
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
    use amq_protocol::types::{ByteArray, FieldArray, LongString, ShortString};

    fn table(pairs: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(k), v);
        }
        t
    }

    #[test]
    fn types_are_kept_nested_and_recent_timestamps_normalised() {
        let now = 1_800_000_000.0;
        let entry = table(vec![
            ("count", AMQPValue::LongLongInt(2)),
            ("time", AMQPValue::Timestamp(1_800_000_030)),
            (
                "routing-keys",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                    LongString::from("rk"),
                )])),
            ),
        ]);
        let headers = table(vec![
            (
                "x-death",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
            ),
            ("old", AMQPValue::Timestamp(1_577_836_800)),
            ("bin", AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1]))),
            ("n", AMQPValue::LongInt(42)),
        ]);
        let (values, sigs) = norm_table(&headers, now);
        assert_eq!(
            values,
            json!({"x-death": [{"count": 2, "time": "recent-timestamp", "routing-keys": ["rk"]}],
                   "old": 1_577_836_800u64, "bin": {"binary": "\u{0}\u{1}"}, "n": 42})
        );
        assert_eq!(
            sigs,
            json!({"x-death": [{"count": "l", "time": "T", "routing-keys": ["S"]}],
                   "old": "T", "bin": "x", "n": "I"})
        );
    }

    #[test]
    fn an_integer_named_time_is_a_timestamp_too() {
        let (v, sig) = norm_typed(&AMQPValue::LongInt(1000), 1010.0, Some("time"));
        assert_eq!((v, sig), (json!("recent-timestamp"), json!("I")));
        let (v, _) = norm_typed(&AMQPValue::LongInt(1000), 1010.0, None);
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
