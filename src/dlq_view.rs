//! What a dead-letter queue inspection shows, and how a message is rendered for it: pure
//! functions, no sockets, no locks.
//!
//! The admin API's `GET /api/queues/{vhost}/{queue}/messages` and `.../messages/summary`
//! ([`crate::admin`]) and `dlx-proxy dlq list|summary` ([`crate::dlq_cli`]) share these types.
//! Where the messages come from is [`crate::dlq_inspect`]'s business: the embedded broker's
//! queue, read in place, renders each [`crate::broker::message::Message`] with
//! [`MessageView::from_amqp`] (headers with their AMQP types); RabbitMQ's management API
//! (proxy mode) gives JSON, which [`MessageView::from_management`] maps onto the same shape
//! (headers as RabbitMQ renders them, without types).
//!
//! Header values nest at most [`crate::amqp::headers::HEADER_DECODE_DEPTH`] levels (deeper
//! entries are opaque and decode as void), so the recursive rendering is bounded.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use crate::proxy::bcc::PRIVATE_HEADER_PREFIX;

/// Messages in a page when `limit` is not given.
pub const DEFAULT_LIMIT: usize = 20;
/// The largest page (`limit` above it is refused with 400).
pub const MAX_LIMIT: usize = 1000;
/// Body bytes shown per message; the full size is given beside.
pub const PREVIEW_BYTES: usize = 1024;
/// Messages a summary reads at most (from the head of the queue); `truncated` says when the
/// queue held more.
pub const SUMMARY_CAP: usize = 10_000;
/// Header values rendered per message at most (each table entry and array element counts
/// one): a header of many one-byte values would otherwise take hundreds of bytes of JSON
/// each. Past it, tables and arrays stop and `headers_truncated` is set.
pub const MAX_HEADER_VALUES: usize = 1000;
/// Table and array nesting rendered at most; deeper values show as `{"type": "truncated"}`,
/// so a page stays within JSON readers' recursion limits (serde_json's is 128).
pub const MAX_HEADER_NESTING: usize = 16;
/// `x-death` entries shown per message at most (newest first), and routing keys per entry.
pub const MAX_DEATHS_SHOWN: usize = 100;

/// One entry of a message's `x-death` header, newest first as RabbitMQ keeps them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeathEntry {
    pub queue: Option<String>,
    pub reason: Option<String>,
    pub count: Option<i64>,
    pub exchange: Option<String>,
    #[serde(rename = "routing-keys")]
    pub routing_keys: Vec<String>,
    /// Seconds since the Unix epoch.
    pub time: Option<i64>,
}

/// A message as the inspection shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MessageView {
    /// 0-based position from the head of the queue.
    pub position: usize,
    pub exchange: String,
    pub routing_key: String,
    pub redelivered: bool,
    /// The properties other than headers (absent ones omitted).
    pub properties: BTreeMap<String, Value>,
    /// Header name → value; embedded mode gives `{"type": ..., "value": ...}` objects.
    pub headers: BTreeMap<String, Value>,
    /// The `x-death` header, summarised.
    pub x_death: Vec<DeathEntry>,
    /// The body's full size in bytes.
    pub body_size: u64,
    /// The first [`PREVIEW_BYTES`] of the body: text if UTF-8, else base64.
    pub body_preview: String,
    /// "string" or "base64".
    pub body_encoding: String,
    /// Whether the preview is shorter than the body.
    pub body_truncated: bool,
    /// Whether `headers` shows less than the message has ([`MAX_HEADER_VALUES`],
    /// [`MAX_HEADER_NESTING`]).
    #[serde(default)]
    pub headers_truncated: bool,
}

/// A page of `GET .../messages`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MessagePage {
    pub vhost: String,
    pub queue: String,
    /// Messages in the queue when it was read (ready ones).
    pub queue_length: u64,
    pub limit: usize,
    pub messages: Vec<MessageView>,
}

/// `GET .../messages/summary`: counts by the newest death's reason and source queue.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub vhost: String,
    pub queue: String,
    pub queue_length: u64,
    /// Messages counted (at most the cap).
    pub inspected: u64,
    /// Whether the queue held more than were counted.
    pub truncated: bool,
    /// Newest x-death reason → messages ("none" without x-death).
    pub by_reason: BTreeMap<String, u64>,
    /// Newest x-death queue → messages ("none" without x-death).
    pub by_source_queue: BTreeMap<String, u64>,
}

impl Summary {
    /// Counts one message by its newest death.
    pub fn add(&mut self, deaths: &[DeathEntry]) {
        let newest = deaths.first();
        let reason = newest.and_then(|d| d.reason.clone());
        let queue = newest.and_then(|d| d.queue.clone());
        *self
            .by_reason
            .entry(reason.unwrap_or_else(|| "none".into()))
            .or_default() += 1;
        *self
            .by_source_queue
            .entry(queue.unwrap_or_else(|| "none".into()))
            .or_default() += 1;
        self.inspected += 1;
    }
}

/// The page size for a `limit` query parameter; `Err` explains a refusal.
pub fn page_limit(limit: Option<&str>) -> Result<usize, String> {
    let Some(text) = limit else {
        return Ok(DEFAULT_LIMIT);
    };
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(format!(
            "limit must be an integer from 1 to {MAX_LIMIT}, not {text:?}"
        )),
    }
}

/// The body preview: (text, encoding, truncated).
pub fn preview(body: &[u8]) -> (String, &'static str, bool) {
    let shown = &body[..body.len().min(PREVIEW_BYTES)];
    let truncated = shown.len() < body.len();
    // A cut may split a UTF-8 sequence: accept an incomplete tail.
    match std::str::from_utf8(shown) {
        Ok(text) => (text.to_string(), "string", truncated),
        Err(e) if truncated && e.error_len().is_none() => (
            String::from_utf8_lossy(&shown[..e.valid_up_to()]).into_owned(),
            "string",
            truncated,
        ),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(shown),
            "base64",
            truncated,
        ),
    }
}

/// Renders header values as JSON with their types (`{"type": "long", "value": 5}`; tables
/// and arrays hold typed values) within [`MAX_HEADER_VALUES`] and [`MAX_HEADER_NESTING`].
struct TypedRendering {
    left: usize,
    truncated: bool,
}

impl TypedRendering {
    fn new() -> TypedRendering {
        TypedRendering {
            left: MAX_HEADER_VALUES,
            truncated: false,
        }
    }

    /// Whether the budget has room for one more value (noting the truncation if not).
    fn room(&mut self) -> bool {
        if self.left == 0 {
            self.truncated = true;
            return false;
        }
        self.left -= 1;
        true
    }

    fn value(&mut self, value: &AMQPValue, depth: usize) -> Value {
        let nested = matches!(value, AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_));
        if nested && depth >= MAX_HEADER_NESTING {
            self.truncated = true;
            return json!({"type": "truncated"});
        }
        let (kind, value) = match value {
            AMQPValue::Boolean(b) => ("bool", json!(b)),
            AMQPValue::ShortShortInt(n) => ("byte", json!(n)),
            AMQPValue::ShortShortUInt(n) => ("unsigned-byte", json!(n)),
            AMQPValue::ShortInt(n) => ("short", json!(n)),
            AMQPValue::ShortUInt(n) => ("unsigned-short", json!(n)),
            AMQPValue::LongInt(n) => ("int", json!(n)),
            AMQPValue::LongUInt(n) => ("unsigned-int", json!(n)),
            AMQPValue::LongLongInt(n) => ("long", json!(n)),
            AMQPValue::Float(n) => ("float", json!(n)),
            AMQPValue::Double(n) => ("double", json!(n)),
            AMQPValue::DecimalValue(d) => ("decimal", json!({"scale": d.scale, "value": d.value})),
            AMQPValue::ShortString(s) => ("shortstr", json!(s.as_str())),
            AMQPValue::LongString(s) => ("longstr", bytes_json(s.as_bytes())),
            AMQPValue::FieldArray(a) => {
                let mut items = Vec::new();
                for item in a.as_slice() {
                    if !self.room() {
                        break;
                    }
                    items.push(self.value(item, depth + 1));
                }
                ("array", Value::Array(items))
            }
            AMQPValue::Timestamp(t) => ("timestamp", json!(t)),
            AMQPValue::FieldTable(t) => (
                "table",
                Value::Object(self.table(t, depth + 1).into_iter().collect()),
            ),
            AMQPValue::ByteArray(b) => ("bytes", bytes_json(b.as_slice())),
            AMQPValue::Void => ("void", Value::Null),
        };
        json!({"type": kind, "value": value})
    }

    fn table(&mut self, table: &FieldTable, depth: usize) -> BTreeMap<String, Value> {
        let mut out = BTreeMap::new();
        for (k, v) in table {
            if !self.room() {
                break;
            }
            out.insert(k.as_str().to_string(), self.value(v, depth));
        }
        out
    }
}

/// A message's headers rendered with their types, and whether some were left out.
pub fn typed_headers(headers: &FieldTable) -> (BTreeMap<String, Value>, bool) {
    let mut rendering = TypedRendering::new();
    let rendered = rendering.table(headers, 0);
    (rendered, rendering.truncated)
}

/// Text if UTF-8, else `{"base64": ...}`.
fn bytes_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => json!(text),
        Err(_) => json!({"base64": base64::engine::general_purpose::STANDARD.encode(bytes)}),
    }
}

/// The `x-death` entries of decoded headers (malformed entries give empty fields).
pub fn deaths_amqp(headers: Option<&FieldTable>) -> Vec<DeathEntry> {
    let Some(AMQPValue::FieldArray(entries)) = headers.and_then(|h| h.inner().get("x-death"))
    else {
        return Vec::new();
    };
    let text = |v: Option<&AMQPValue>| match v {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    };
    let number = |v: Option<&AMQPValue>| match v {
        Some(AMQPValue::LongLongInt(n)) => Some(*n),
        Some(AMQPValue::LongInt(n)) => Some(i64::from(*n)),
        Some(AMQPValue::LongUInt(n)) => Some(i64::from(*n)),
        Some(AMQPValue::ShortInt(n)) => Some(i64::from(*n)),
        Some(AMQPValue::Timestamp(n)) => i64::try_from(*n).ok(),
        _ => None,
    };
    entries
        .as_slice()
        .iter()
        .filter_map(|entry| match entry {
            AMQPValue::FieldTable(t) => Some(t.inner()),
            _ => None,
        })
        .take(MAX_DEATHS_SHOWN)
        .map(|t| DeathEntry {
            queue: text(t.get("queue")),
            reason: text(t.get("reason")),
            count: number(t.get("count")),
            exchange: text(t.get("exchange")),
            routing_keys: match t.get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => keys
                    .as_slice()
                    .iter()
                    .filter_map(|k| text(Some(k)))
                    .take(MAX_DEATHS_SHOWN)
                    .collect(),
                _ => Vec::new(),
            },
            time: number(t.get("time")),
        })
        .collect()
}

/// The `x-death` entries of RabbitMQ management JSON headers.
pub fn deaths_json(headers: Option<&Value>) -> Vec<DeathEntry> {
    let Some(Value::Array(entries)) = headers.and_then(|h| h.get("x-death")) else {
        return Vec::new();
    };
    let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    entries
        .iter()
        .map(|t| DeathEntry {
            queue: text(t.get("queue")),
            reason: text(t.get("reason")),
            count: t.get("count").and_then(Value::as_i64),
            exchange: text(t.get("exchange")),
            routing_keys: t
                .get("routing-keys")
                .and_then(Value::as_array)
                .map(|keys| keys.iter().filter_map(|k| text(Some(k))).collect())
                .unwrap_or_default(),
            time: t.get("time").and_then(Value::as_i64),
        })
        .collect()
}

impl MessageView {
    /// A message of the embedded broker.
    pub fn from_amqp(
        position: usize,
        exchange: &str,
        routing_key: &str,
        redelivered: bool,
        properties: &BasicProperties,
        body: &[u8],
    ) -> MessageView {
        let mut props = BTreeMap::new();
        let mut put = |name: &str, value: Option<Value>| {
            if let Some(value) = value {
                props.insert(name.to_string(), value);
            }
        };
        let short =
            |s: &Option<amq_protocol::types::ShortString>| s.as_ref().map(|s| json!(s.as_str()));
        put("content_type", short(properties.content_type()));
        put("content_encoding", short(properties.content_encoding()));
        put(
            "delivery_mode",
            properties.delivery_mode().map(|n| json!(n)),
        );
        put("priority", properties.priority().map(|n| json!(n)));
        put("correlation_id", short(properties.correlation_id()));
        put("reply_to", short(properties.reply_to()));
        put("expiration", short(properties.expiration()));
        put("message_id", short(properties.message_id()));
        put("timestamp", properties.timestamp().map(|n| json!(n)));
        put("type", short(properties.kind()));
        put("user_id", short(properties.user_id()));
        put("app_id", short(properties.app_id()));
        let (body_preview, encoding, body_truncated) = preview(body);
        let (headers, headers_truncated) = properties
            .headers()
            .as_ref()
            .map(typed_headers)
            .unwrap_or_default();
        MessageView {
            position,
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            redelivered,
            properties: props,
            headers,
            headers_truncated,
            x_death: deaths_amqp(properties.headers().as_ref()),
            body_size: body.len() as u64,
            body_preview,
            body_encoding: encoding.to_string(),
            body_truncated,
        }
    }

    /// One element of the answer of RabbitMQ's `POST /api/queues/{vhost}/{name}/get` (asked
    /// with `encoding=auto` and `truncate` = [`PREVIEW_BYTES`]).
    pub fn from_management(position: usize, message: &Value) -> MessageView {
        let text = |key: &str| {
            message
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let mut properties: BTreeMap<String, Value> = message
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let headers_value = properties.remove("headers");
        // The proxy's private headers (`x-dlx-proxy-...`) are not shown, as its clients never
        // see them.
        let headers = headers_value
            .as_ref()
            .and_then(Value::as_object)
            .map(|h| {
                h.iter()
                    .filter(|(k, _)| !k.starts_with(PRIVATE_HEADER_PREFIX))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let body_size = message
            .get("payload_bytes")
            .and_then(Value::as_u64)
            .unwrap_or_default();
        let payload = text("payload");
        let encoding = match message.get("payload_encoding").and_then(Value::as_str) {
            Some("base64") => "base64",
            _ => "string",
        };
        let shown = match encoding {
            "base64" => base64::engine::general_purpose::STANDARD
                .decode(&payload)
                .map_or(0, |b| b.len()),
            _ => payload.len(),
        };
        MessageView {
            position,
            exchange: text("exchange"),
            routing_key: text("routing_key"),
            redelivered: message
                .get("redelivered")
                .and_then(Value::as_bool)
                .unwrap_or_default(),
            properties,
            headers,
            x_death: deaths_json(headers_value.as_ref()),
            body_size,
            body_preview: payload,
            body_encoding: encoding.to_string(),
            body_truncated: (shown as u64) < body_size,
            headers_truncated: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{FieldArray, LongString, ShortString};

    fn death(queue: &str, reason: &str, count: i64) -> AMQPValue {
        let mut t = FieldTable::default();
        t.insert("queue".into(), AMQPValue::LongString(queue.into()));
        t.insert("reason".into(), AMQPValue::LongString(reason.into()));
        t.insert("count".into(), AMQPValue::LongLongInt(count));
        t.insert("exchange".into(), AMQPValue::LongString("".into()));
        t.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                LongString::from(queue),
            )])),
        );
        t.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        AMQPValue::FieldTable(t)
    }

    fn headers() -> FieldTable {
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                death("work", "rejected", 2),
                death("delay", "expired", 1),
            ])),
        );
        h.insert("n".into(), AMQPValue::ShortInt(-3));
        h.insert("raw".into(), AMQPValue::ByteArray(vec![0xff, 0].into()));
        h
    }

    #[test]
    fn x_death_entries_are_summarised_newest_first() {
        let deaths = deaths_amqp(Some(&headers()));
        assert_eq!(
            deaths[0],
            DeathEntry {
                queue: Some("work".into()),
                reason: Some("rejected".into()),
                count: Some(2),
                exchange: Some(String::new()),
                routing_keys: vec!["work".into()],
                time: Some(1_700_000_000),
            }
        );
        assert_eq!(deaths[1].reason.as_deref(), Some("expired"));
        assert!(deaths_amqp(None).is_empty());
        let mut wrong = FieldTable::default();
        wrong.insert("x-death".into(), AMQPValue::LongString("no".into()));
        assert!(deaths_amqp(Some(&wrong)).is_empty());
    }

    #[test]
    fn headers_keep_their_amqp_types() {
        let props = BasicProperties::default()
            .with_headers(headers())
            .with_content_type(ShortString::from("text/plain"))
            .with_delivery_mode(2);
        let view = MessageView::from_amqp(3, "dlx", "rk", false, &props, b"hello");
        assert_eq!(view.position, 3);
        assert_eq!(view.headers["n"], json!({"type": "short", "value": -3}));
        assert_eq!(
            view.headers["raw"],
            json!({"type": "bytes", "value": {"base64": "/wA="}})
        );
        let first = &view.headers["x-death"]["value"][0];
        assert_eq!(first["type"], "table");
        assert_eq!(first["value"]["count"], json!({"type": "long", "value": 2}));
        assert_eq!(
            first["value"]["time"],
            json!({"type": "timestamp", "value": 1_700_000_000})
        );
        assert_eq!(view.properties["content_type"], json!("text/plain"));
        assert_eq!(view.properties["delivery_mode"], json!(2));
        assert!(!view.properties.contains_key("priority"));
        assert_eq!(
            (
                view.body_size,
                view.body_preview.as_str(),
                view.body_truncated
            ),
            (5, "hello", false)
        );
        assert_eq!(view.x_death.len(), 2);
    }

    #[test]
    fn the_preview_is_capped_and_binary_is_base64() {
        let long = "é".repeat(PREVIEW_BYTES);
        let (text, encoding, truncated) = preview(long.as_bytes());
        assert_eq!((encoding, truncated), ("string", true));
        assert_eq!(text.len(), PREVIEW_BYTES);
        let (text, encoding, truncated) = preview(&[0xff, 0xfe]);
        assert_eq!(
            (text.as_str(), encoding, truncated),
            ("//4=", "base64", false)
        );
    }

    #[test]
    fn limits_have_a_default_and_a_maximum() {
        assert_eq!(page_limit(None), Ok(DEFAULT_LIMIT));
        assert_eq!(page_limit(Some("5")), Ok(5));
        assert_eq!(page_limit(Some("1000")), Ok(1000));
        for bad in ["0", "1001", "-1", "x"] {
            let error = page_limit(Some(bad)).unwrap_err();
            assert!(error.contains("from 1 to 1000"), "{error}");
        }
    }

    #[test]
    fn summaries_count_the_newest_death() {
        let mut summary = Summary::default();
        summary.add(&deaths_amqp(Some(&headers())));
        summary.add(&deaths_amqp(Some(&headers())));
        summary.add(&[]);
        assert_eq!(summary.inspected, 3);
        assert_eq!(summary.by_reason["rejected"], 2);
        assert_eq!(summary.by_reason["none"], 1);
        assert_eq!(summary.by_source_queue["work"], 2);
        assert!(!summary.by_reason.contains_key("expired"));
    }

    #[test]
    fn management_messages_map_onto_the_same_shape() {
        let message = json!({
            "payload_bytes": 2000, "redelivered": true, "exchange": "dlx",
            "routing_key": "work", "payload": "abc", "payload_encoding": "string",
            "properties": {"delivery_mode": 2, "headers": {"x-death": [
                {"count": 1, "reason": "expired", "queue": "work", "time": 1700000000,
                 "exchange": "", "routing-keys": ["work"]}],
                "x-dlx-proxy-hop": true, "x-dlx-proxy-bcc": ["audit"]}}
        });
        let view = MessageView::from_management(0, &message);
        assert_eq!(view.x_death[0].reason.as_deref(), Some("expired"));
        assert_eq!(view.x_death[0].count, Some(1));
        assert_eq!(view.properties["delivery_mode"], json!(2));
        assert!(view.headers.contains_key("x-death"));
        assert_eq!(
            view.headers.len(),
            1,
            "the proxy's private headers are not shown"
        );
        assert!(view.redelivered && view.body_truncated);
        assert_eq!(view.body_size, 2000);
    }
    fn view_of(headers: FieldTable) -> MessageView {
        let properties = BasicProperties::default().with_headers(headers);
        MessageView::from_amqp(0, "dlx", "k", false, &properties, b"body")
    }

    /// A header of 130 000 one-byte values (one frame) renders within the value budget, not
    /// as 130 000 JSON objects.
    #[test]
    fn a_header_of_many_small_values_renders_within_the_budget() {
        let mut h = FieldTable::default();
        h.insert(
            "many".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void; 130_000])),
        );
        h.insert("after".into(), AMQPValue::LongInt(1));
        let view = view_of(h);
        assert!(view.headers_truncated);
        let json = serde_json::to_string(&view).unwrap();
        assert!(json.len() < 64 * 1024, "{} bytes", json.len());
        // The budget counts every value: the array and what follows it share it.
        let rendered = view.headers.values().map(count_values).sum::<usize>();
        assert!(rendered <= MAX_HEADER_VALUES, "{rendered}");
        // A message within the budget is whole and says so.
        let whole = view_of(headers());
        assert!(!whole.headers_truncated);
        assert_eq!(whole.headers["n"], json!({"type": "short", "value": -3}));
    }

    fn count_values(v: &Value) -> usize {
        1 + match v.get("value") {
            Some(Value::Array(items)) => items.iter().map(count_values).sum(),
            Some(Value::Object(entries)) if v["type"] == "table" => {
                entries.values().map(count_values).sum()
            }
            _ => 0,
        }
    }

    /// A header nested 63 levels deep (within what the broker decodes) renders 16 deep, so
    /// the page is read back by a JSON reader with a recursion limit (the CLI's).
    #[test]
    fn deep_headers_render_within_the_json_readers_limit() {
        let mut value = AMQPValue::LongInt(7);
        for _ in 0..63 {
            value = AMQPValue::FieldArray(FieldArray::from(vec![value]));
        }
        let mut h = FieldTable::default();
        h.insert("deep".into(), value);
        let view = view_of(h);
        assert!(view.headers_truncated);
        let page = MessagePage {
            vhost: "/".into(),
            queue: "dlq".into(),
            queue_length: 1,
            limit: 1,
            messages: vec![view],
        };
        let text = serde_json::to_string(&page).unwrap();
        let back: MessagePage = serde_json::from_str(&text).expect("read back");
        assert_eq!(back, page);
    }

    /// `x_death` shows the newest 100 entries, each with at most 100 routing keys.
    #[test]
    fn long_death_histories_are_shown_in_part() {
        let mut entry = FieldTable::default();
        entry.insert("reason".into(), AMQPValue::LongString("rejected".into()));
        entry.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongString("k".into());
                500
            ])),
        );
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry); 500])),
        );
        let deaths = deaths_amqp(Some(&h));
        assert_eq!(deaths.len(), MAX_DEATHS_SHOWN);
        assert_eq!(deaths[0].routing_keys.len(), MAX_DEATHS_SHOWN);
    }
}
