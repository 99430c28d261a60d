//! Structured inputs shared by the fuzz targets in `fuzz_targets/`.
//!
//! Raw byte targets (`frame_decode`, `content_header`, the raw half of `field_table`) let
//! libFuzzer mutate wire bytes directly. The rule targets (`queue_args`, `policy_merge`,
//! `x_death`) would rarely get past the parsers that way, so they take `arbitrary`-derived
//! values that are turned into the amq-protocol types the product code consumes. Keys and
//! strings are drawn mostly from the vocabulary the rules look at (x-arguments, x-death
//! fields, queue types, reasons) so the fuzzer reaches the interesting branches quickly,
//! with arbitrary text mixed in.
//!
//! Nesting is capped at [`MAX_DEPTH`] when a structured value is converted: the recursion
//! limit for peer-sent tables is a separate fix (deeply nested input is fuzzed through the
//! raw byte targets).

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use arbitrary::Arbitrary;
use dlx_proxy::amqp::content::{decode_properties, encode_properties};
use dlx_proxy::broker::delivery::short;

/// Deepest table/array nesting a structured value is converted to.
pub const MAX_DEPTH: usize = 6;

/// Field names the product code reads (x-arguments, x-death entries, CC/BCC, ...).
pub const KEYS: &[&str] = &[
    "x-queue-type",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-delivery-limit",
    "x-max-priority",
    "x-death",
    "x-first-death-reason",
    "x-first-death-queue",
    "x-first-death-exchange",
    "x-last-death-reason",
    "x-last-death-queue",
    "x-last-death-exchange",
    "x-death-total",
    "x-delivery-count",
    "CC",
    "BCC",
    "count",
    "reason",
    "queue",
    "time",
    "exchange",
    "routing-keys",
    "original-expiration",
];

/// Values the product code compares strings with.
pub const TEXTS: &[&str] = &[
    "",
    "classic",
    "quorum",
    "stream",
    "drop-head",
    "reject-publish",
    "reject-publish-dlx",
    "at-most-once",
    "at-least-once",
    "rejected",
    "expired",
    "maxlen",
    "delivery_limit",
    "q1",
    "q2",
    "dlx",
    "rk",
    "100",
    "-0",
    "+5",
    "315360000000",
    "315360000001",
];

/// A string: mostly from [`TEXTS`], sometimes arbitrary.
#[derive(Arbitrary, Clone, Debug)]
pub enum Text {
    Known(u8),
    Other(String),
}

impl Text {
    pub fn get(&self) -> String {
        match self {
            Text::Known(i) => TEXTS[*i as usize % TEXTS.len()].to_string(),
            Text::Other(s) => s.clone(),
        }
    }

    /// As a shortstr (cut to 255 bytes on a character boundary).
    pub fn short(&self) -> ShortString {
        short(&self.get())
    }
}

/// A field name: mostly from [`KEYS`], sometimes arbitrary.
#[derive(Arbitrary, Clone, Debug)]
pub enum Key {
    Known(u8),
    Other(String),
}

impl Key {
    pub fn get(&self) -> ShortString {
        match self {
            Key::Known(i) => ShortString::from(KEYS[*i as usize % KEYS.len()]),
            Key::Other(s) => short(s),
        }
    }
}

/// Every AMQP field value type that exists on the wire (amq-protocol's `ShortString` value
/// has no type tag of its own: it is never decoded and cannot be encoded in a table).
#[derive(Arbitrary, Clone, Debug)]
pub enum Value {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
    Decimal(u8, u32),
    Long(Text),
    LongBytes(Vec<u8>),
    Array(Vec<Value>),
    Timestamp(u64),
    Table(Vec<(Key, Value)>),
    Bytes(Vec<u8>),
    Void,
}

impl Value {
    pub fn to_amqp(&self) -> AMQPValue {
        self.convert(0)
    }

    fn convert(&self, depth: usize) -> AMQPValue {
        match self {
            Value::Bool(v) => AMQPValue::Boolean(*v),
            Value::I8(v) => AMQPValue::ShortShortInt(*v),
            Value::U8(v) => AMQPValue::ShortShortUInt(*v),
            Value::I16(v) => AMQPValue::ShortInt(*v),
            Value::U16(v) => AMQPValue::ShortUInt(*v),
            Value::I32(v) => AMQPValue::LongInt(*v),
            Value::U32(v) => AMQPValue::LongUInt(*v),
            Value::I64(v) => AMQPValue::LongLongInt(*v),
            Value::F32(v) => AMQPValue::Float(*v),
            Value::F64(v) => AMQPValue::Double(*v),
            Value::Decimal(scale, value) => AMQPValue::DecimalValue(DecimalValue {
                scale: *scale,
                value: *value,
            }),
            Value::Long(t) => AMQPValue::LongString(LongString::from(t.get())),
            Value::LongBytes(b) => AMQPValue::LongString(LongString::from(b.clone())),
            Value::Timestamp(t) => AMQPValue::Timestamp(*t),
            Value::Bytes(b) => AMQPValue::ByteArray(ByteArray::from(b.clone())),
            Value::Void => AMQPValue::Void,
            Value::Array(_) | Value::Table(_) if depth >= MAX_DEPTH => AMQPValue::Void,
            Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
                items
                    .iter()
                    .map(|v| v.convert(depth + 1))
                    .collect::<Vec<_>>(),
            )),
            Value::Table(fields) => AMQPValue::FieldTable(table_at(fields, depth + 1)),
        }
    }
}

/// A field table from structured fields (a repeated key keeps its last value).
pub fn table(fields: &[(Key, Value)]) -> FieldTable {
    table_at(fields, 0)
}

fn table_at(fields: &[(Key, Value)], depth: usize) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in fields {
        table.insert(key.get(), value.convert(depth));
    }
    table
}

/// Every basic property; `headers` is where the rules look.
#[derive(Arbitrary, Clone, Debug)]
pub struct Properties {
    pub content_type: Option<Text>,
    pub content_encoding: Option<Text>,
    pub headers: Option<Vec<(Key, Value)>>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<Text>,
    pub reply_to: Option<Text>,
    pub expiration: Option<Text>,
    pub message_id: Option<Text>,
    pub timestamp: Option<u64>,
    pub kind: Option<Text>,
    pub user_id: Option<Text>,
    pub app_id: Option<Text>,
    pub cluster_id: Option<Text>,
}

impl Properties {
    pub fn to_amqp(&self) -> BasicProperties {
        let mut p = BasicProperties::default();
        if let Some(v) = &self.content_type {
            p = p.with_content_type(v.short());
        }
        if let Some(v) = &self.content_encoding {
            p = p.with_content_encoding(v.short());
        }
        if let Some(v) = &self.headers {
            p = p.with_headers(table(v));
        }
        if let Some(v) = self.delivery_mode {
            p = p.with_delivery_mode(v);
        }
        if let Some(v) = self.priority {
            p = p.with_priority(v);
        }
        if let Some(v) = &self.correlation_id {
            p = p.with_correlation_id(v.short());
        }
        if let Some(v) = &self.reply_to {
            p = p.with_reply_to(v.short());
        }
        if let Some(v) = &self.expiration {
            p = p.with_expiration(v.short());
        }
        if let Some(v) = &self.message_id {
            p = p.with_message_id(v.short());
        }
        if let Some(v) = self.timestamp {
            p = p.with_timestamp(v);
        }
        if let Some(v) = &self.kind {
            p = p.with_type(v.short());
        }
        if let Some(v) = &self.user_id {
            p = p.with_user_id(v.short());
        }
        if let Some(v) = &self.app_id {
            p = p.with_app_id(v.short());
        }
        if let Some(v) = &self.cluster_id {
            p = p.with_cluster_id(v.short());
        }
        p
    }
}

/// Asserts that `props` survive the wire: encoding, decoding and encoding again gives the
/// same bytes (compared as bytes so that NaN floats do not make equal values unequal).
pub fn assert_properties_round_trip(props: &BasicProperties) {
    let raw = encode_properties(props);
    let decoded = decode_properties(&raw).expect("encoded properties must decode");
    assert_eq!(
        encode_properties(&decoded),
        raw,
        "properties changed on a round trip"
    );
}

/// Whether a value holds a float that is NaN anywhere inside it.
pub fn has_nan(value: &AMQPValue) -> bool {
    match value {
        AMQPValue::Float(f) => f.is_nan(),
        AMQPValue::Double(f) => f.is_nan(),
        AMQPValue::FieldArray(items) => items.as_slice().iter().any(has_nan),
        AMQPValue::FieldTable(t) => t.inner().values().any(has_nan),
        _ => false,
    }
}
