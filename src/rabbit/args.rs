//! Queue argument validation, shared by `queue.declare` in both modes.
//!
//! [`parse_queue_arguments`] turns a client's x-arguments into [`QueueArguments`] and refuses
//! invalid ones with the same 406 reply texts as RabbitMQ 3.10; [`check_equivalent`] is
//! RabbitMQ's redeclare check; [`parse_expiration`] validates the per-message `expiration`
//! property of a publish. The policy merge that turns arguments into effective settings lives
//! in [`crate::policy`].
//!
//! Validation order follows RabbitMQ: the dead-letter exchange's type (checked by the channel
//! before anything else), then `x-queue-type`, then the values in RabbitMQ's `declare_args`
//! order, then arguments the queue type does not accept. Unknown x-arguments are ignored.
//! Deliberate differences: `x-delivery-limit` is accepted on every queue type (a non-negative
//! integer), and `x-queue-type = "stream"` is refused because the embedded broker does not
//! implement streams (proxy mode does not call this for a stream: it passes the declare to
//! RabbitMQ, see `crate::proxy::declare::passes_through`).

use amq_protocol::types::{AMQPValue, FieldTable};
use std::fmt::Write as _;
use std::str::FromStr;

/// Largest TTL RabbitMQ accepts, in milliseconds (ten years): `x-message-ttl`, `x-expires`
/// and the per-message `expiration`.
pub const MAX_EXPIRY_MS: u64 = 315_360_000_000;

pub const ARG_QUEUE_TYPE: &str = "x-queue-type";
pub const ARG_DEAD_LETTER_EXCHANGE: &str = "x-dead-letter-exchange";
pub const ARG_DEAD_LETTER_ROUTING_KEY: &str = "x-dead-letter-routing-key";
pub const ARG_DEAD_LETTER_STRATEGY: &str = "x-dead-letter-strategy";
pub const ARG_MESSAGE_TTL: &str = "x-message-ttl";
pub const ARG_EXPIRES: &str = "x-expires";
pub const ARG_MAX_LENGTH: &str = "x-max-length";
pub const ARG_MAX_LENGTH_BYTES: &str = "x-max-length-bytes";
pub const ARG_OVERFLOW: &str = "x-overflow";
pub const ARG_DELIVERY_LIMIT: &str = "x-delivery-limit";
pub const ARG_MAX_PRIORITY: &str = "x-max-priority";
/// RabbitMQ 3.12+: milliseconds a consumer may hold a delivery unacknowledged.
pub const ARG_CONSUMER_TIMEOUT: &str = "x-consumer-timeout";
/// This service's retry tiers: delays in milliseconds before a rejected message comes back.
pub const ARG_RETRY_DELAYS: &str = "x-retry-delays";
/// The consumer argument: consumers of a higher priority get messages first.
pub const ARG_CONSUMER_PRIORITY: &str = "x-priority";
/// One consumer at a time gets the queue's messages (a bool).
pub const ARG_SINGLE_ACTIVE_CONSUMER: &str = "x-single-active-consumer";

/// Most tiers `x-retry-delays` (and the policy's `retry-delays`) may list.
pub const MAX_RETRY_TIERS: usize = 32;

/// RabbitMQ's 3.10 `x-queue-mode` (classic queues).
pub const ARG_QUEUE_MODE: &str = "x-queue-mode";

/// The x-arguments compared on redeclare of a classic queue, in the order RabbitMQ 3.10
/// compares them (the classic queue type's argument list), then this service's
/// `x-delivery-limit` (RabbitMQ refuses it on classic queues; this service enforces it).
pub const CLASSIC_EQUIVALENCE_ARGUMENTS: [&str; 13] = [
    ARG_EXPIRES,
    ARG_MESSAGE_TTL,
    ARG_DEAD_LETTER_EXCHANGE,
    ARG_DEAD_LETTER_ROUTING_KEY,
    ARG_MAX_LENGTH,
    ARG_MAX_LENGTH_BYTES,
    ARG_MAX_PRIORITY,
    ARG_OVERFLOW,
    ARG_QUEUE_MODE,
    ARG_SINGLE_ACTIVE_CONSUMER,
    ARG_QUEUE_TYPE,
    "x-queue-master-locator",
    ARG_DELIVERY_LIMIT,
];

/// The x-arguments compared on redeclare of a quorum queue, in the order RabbitMQ 3.10
/// compares them (the quorum queue type's argument list: `x-max-priority` is not in it).
pub const QUORUM_EQUIVALENCE_ARGUMENTS: [&str; 15] = [
    ARG_DEAD_LETTER_EXCHANGE,
    ARG_DEAD_LETTER_ROUTING_KEY,
    ARG_DEAD_LETTER_STRATEGY,
    ARG_EXPIRES,
    ARG_MAX_LENGTH,
    ARG_MAX_LENGTH_BYTES,
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    ARG_OVERFLOW,
    ARG_SINGLE_ACTIVE_CONSUMER,
    ARG_QUEUE_TYPE,
    "x-quorum-initial-group-size",
    ARG_DELIVERY_LIMIT,
    ARG_MESSAGE_TTL,
    "x-queue-leader-locator",
];

/// The x-arguments RabbitMQ 3.10 takes for stream queues only. With the two lists above they
/// are the arguments RabbitMQ knows: a queue whose type does not take one is refused at
/// declare (`invalid arg 'x-max-priority' for queue 'q' in vhost '/' of queue type
/// rabbit_quorum_queue`); arguments no type knows are accepted and ignored.
pub const STREAM_ONLY_ARGUMENTS: [&str; 3] = [
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size",
];

/// The most x-arguments one redeclare check compares (the longer of the two lists).
pub const MOST_EQUIVALENCE_ARGUMENTS: usize = QUORUM_EQUIVALENCE_ARGUMENTS.len();

/// The x-arguments a redeclare compares for an existing queue of `queue_type`, in order.
pub fn equivalence_arguments(queue_type: QueueType) -> &'static [&'static str] {
    match queue_type {
        QueueType::Classic => &CLASSIC_EQUIVALENCE_ARGUMENTS,
        QueueType::Quorum => &QUORUM_EQUIVALENCE_ARGUMENTS,
    }
}

/// The queue types this service implements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
}

impl QueueType {
    /// The `x-queue-type` value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }

    /// RabbitMQ's module name for the type, as it appears in its error texts.
    pub fn rabbit_module(self) -> &'static str {
        match self {
            QueueType::Classic => "rabbit_classic_queue",
            QueueType::Quorum => "rabbit_quorum_queue",
        }
    }
}

/// What a queue does when a publish would exceed its length limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Drop (dead-letter as `maxlen`) the oldest messages. RabbitMQ's default.
    #[default]
    DropHead,
    /// Refuse the publish (nack with confirms, silent drop without).
    RejectPublish,
    /// Refuse the publish and dead-letter it as `maxlen`.
    RejectPublishDlx,
}

impl Overflow {
    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::DropHead => "drop-head",
            Overflow::RejectPublish => "reject-publish",
            Overflow::RejectPublishDlx => "reject-publish-dlx",
        }
    }
}

/// A string that names no known variant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown value '{0}'")]
pub struct UnknownValue(pub String);

impl FromStr for Overflow {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "drop-head" => Ok(Overflow::DropHead),
            "reject-publish" => Ok(Overflow::RejectPublish),
            "reject-publish-dlx" => Ok(Overflow::RejectPublishDlx),
            other => Err(UnknownValue(other.to_string())),
        }
    }
}

/// `x-dead-letter-strategy` (quorum queues only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterStrategy {
    AtMostOnce,
    AtLeastOnce,
}

impl DeadLetterStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterStrategy::AtMostOnce => "at-most-once",
            DeadLetterStrategy::AtLeastOnce => "at-least-once",
        }
    }
}

impl FromStr for DeadLetterStrategy {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "at-most-once" => Ok(DeadLetterStrategy::AtMostOnce),
            "at-least-once" => Ok(DeadLetterStrategy::AtLeastOnce),
            other => Err(UnknownValue(other.to_string())),
        }
    }
}

/// What a client's x-arguments say (`None` = absent). Policies are merged later.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueArguments {
    pub queue_type: QueueType,
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    pub dead_letter_strategy: Option<DeadLetterStrategy>,
    /// Milliseconds.
    pub message_ttl: Option<u64>,
    /// Milliseconds, at least 1.
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Option<Overflow>,
    /// Accepted on every queue type (RabbitMQ 3.10 refuses it on classic queues).
    pub delivery_limit: Option<u64>,
    /// Milliseconds (RabbitMQ 3.12's `x-consumer-timeout`, enforced by this service in both
    /// modes on every queue type).
    pub consumer_timeout: Option<u64>,
    /// Milliseconds, one delay per retry tier (`x-retry-delays`, this service's extension).
    pub retry_delays: Option<Vec<u64>>,
    /// `x-single-active-consumer`: only the earliest registered consumer still there gets
    /// messages.
    pub single_active_consumer: bool,
}

/// How RabbitMQ words an argument error; selects the reply text layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgumentErrorKind {
    /// `invalid arg 'A' for queue 'Q' in vhost 'V': DETAIL` (the detail is an Erlang term).
    InvalidValue,
    /// `invalid type 'T' for arg 'A' in queue 'Q' in vhost 'V'` (the dead-letter exchange;
    /// `detail` holds the type name).
    InvalidType,
    /// `invalid arg 'A' for queue 'Q' in vhost 'V' of queue type M` (`detail` holds the
    /// queue type's module name).
    UnsupportedByQueueType,
}

/// An x-argument RabbitMQ would refuse with 406 PRECONDITION_FAILED.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct ArgumentError {
    /// The x-argument at fault.
    pub argument: String,
    /// RabbitMQ's detail (see [`ArgumentErrorKind`] for what it holds).
    pub detail: String,
    pub kind: ArgumentErrorKind,
}

impl ArgumentError {
    fn invalid_value(argument: &str, detail: String) -> Self {
        ArgumentError {
            argument: argument.to_string(),
            detail,
            kind: ArgumentErrorKind::InvalidValue,
        }
    }

    /// The AMQP reply code (406 PRECONDITION_FAILED).
    pub fn reply_code(&self) -> u16 {
        406
    }

    /// The text without the queue name: `invalid arg 'x-message-ttl': {value_negative,-1}`.
    fn describe(&self) -> String {
        match self.kind {
            ArgumentErrorKind::InvalidValue => {
                format!("invalid arg '{}': {}", self.argument, self.detail)
            }
            ArgumentErrorKind::InvalidType => {
                format!("invalid type '{}' for arg '{}'", self.detail, self.argument)
            }
            ArgumentErrorKind::UnsupportedByQueueType => {
                format!(
                    "invalid arg '{}' of queue type {}",
                    self.argument, self.detail
                )
            }
        }
    }

    /// The full channel.close reply text, as RabbitMQ writes it, e.g.
    /// `PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}`.
    /// Not truncated: the caller fits it into a shortstr.
    pub fn reply_text(&self, queue: &str, vhost: &str) -> String {
        let resource = format!("queue '{queue}' in vhost '{vhost}'");
        match self.kind {
            ArgumentErrorKind::InvalidValue => format!(
                "PRECONDITION_FAILED - invalid arg '{}' for {}: {}",
                self.argument, resource, self.detail
            ),
            ArgumentErrorKind::InvalidType => format!(
                "PRECONDITION_FAILED - invalid type '{}' for arg '{}' in {}",
                self.detail, self.argument, resource
            ),
            ArgumentErrorKind::UnsupportedByQueueType => format!(
                "PRECONDITION_FAILED - invalid arg '{}' for {} of queue type {}",
                self.argument, resource, self.detail
            ),
        }
    }
}

/// RabbitMQ's name for the AMQP field type of a value (`signedint`, `longstr`, ...).
pub fn erlang_type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

/// The value of any AMQP integer type (`b B s u I i l`); `None` for every other type.
pub fn amqp_integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// An Erlang string as `~p` prints it: double-quoted, `"` and `\` escaped.
fn erlang_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn unacceptable_type(argument: &str, value: &AMQPValue) -> ArgumentError {
    ArgumentError::invalid_value(
        argument,
        format!("{{unacceptable_type,{}}}", erlang_type_name(value)),
    )
}

/// RabbitMQ's `check_int_arg`.
fn integer_argument(argument: &str, value: &AMQPValue) -> Result<i64, ArgumentError> {
    amqp_integer(value).ok_or_else(|| {
        ArgumentError::invalid_value(
            argument,
            erlang_string(&format!(
                "expected integer, got {}",
                erlang_type_name(value)
            )),
        )
    })
}

/// The consumer argument `x-priority`: any AMQP integer (0 when absent), as RabbitMQ's
/// `check_int_arg`; clamped to the `i32` range (only the order of priorities matters).
pub fn consumer_priority(args: &FieldTable) -> Result<i32, ArgumentError> {
    match args.inner().get(ARG_CONSUMER_PRIORITY) {
        None => Ok(0),
        Some(value) => {
            let n = integer_argument(ARG_CONSUMER_PRIORITY, value)?;
            Ok(n.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32)
        }
    }
}

/// RabbitMQ's `check_non_neg_int_arg`.
fn non_negative_argument(argument: &str, value: &AMQPValue) -> Result<u64, ArgumentError> {
    let n = integer_argument(argument, value)?;
    u64::try_from(n)
        .map_err(|_| ArgumentError::invalid_value(argument, format!("{{value_negative,{n}}}")))
}

/// RabbitMQ's `rabbit_misc:check_expiry`: 0..=[`MAX_EXPIRY_MS`].
fn expiry_value(argument: &str, n: i64) -> Result<u64, ArgumentError> {
    match u64::try_from(n) {
        Ok(v) if v > MAX_EXPIRY_MS => Err(ArgumentError::invalid_value(
            argument,
            format!("{{value_too_big,{n}}}"),
        )),
        Ok(v) => Ok(v),
        Err(_) => Err(ArgumentError::invalid_value(
            argument,
            format!("{{value_negative,{n}}}"),
        )),
    }
}

/// `x-retry-delays`: an array of 1 to [`MAX_RETRY_TIERS`] integers, each a delay in
/// milliseconds from 0 to [`MAX_EXPIRY_MS`].
fn retry_delays_argument(value: &AMQPValue) -> Result<Vec<u64>, ArgumentError> {
    let AMQPValue::FieldArray(items) = value else {
        return Err(unacceptable_type(ARG_RETRY_DELAYS, value));
    };
    let items = items.as_slice();
    if items.is_empty() || items.len() > MAX_RETRY_TIERS {
        return Err(ArgumentError::invalid_value(
            ARG_RETRY_DELAYS,
            erlang_string(&format!(
                "expected 1 to {MAX_RETRY_TIERS} delays, got {}",
                items.len()
            )),
        ));
    }
    items
        .iter()
        .map(|item| {
            let n = integer_argument(ARG_RETRY_DELAYS, item)?;
            expiry_value(ARG_RETRY_DELAYS, n)
        })
        .collect()
}

/// A longstr argument as UTF-8 text (names in this service are UTF-8 shortstrs).
fn text_argument(argument: &str, bytes: &[u8]) -> Result<String, ArgumentError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| {
        ArgumentError::invalid_value(argument, erlang_string("expected a UTF-8 string"))
    })
}

/// Validate a `queue.declare`'s x-arguments the way RabbitMQ 3.10 does.
pub fn parse_queue_arguments(args: &FieldTable) -> Result<QueueArguments, ArgumentError> {
    let table = args.inner();
    let mut parsed = QueueArguments::default();

    // 1. rabbit_channel checks the dead-letter exchange's type before the queue code runs.
    if let Some(value) = table.get(ARG_DEAD_LETTER_EXCHANGE) {
        match value {
            AMQPValue::LongString(name) => {
                parsed.dead_letter_exchange =
                    Some(text_argument(ARG_DEAD_LETTER_EXCHANGE, name.as_bytes())?);
            }
            other => {
                return Err(ArgumentError {
                    argument: ARG_DEAD_LETTER_EXCHANGE.to_string(),
                    detail: erlang_type_name(other).to_string(),
                    kind: ArgumentErrorKind::InvalidType,
                });
            }
        }
    }

    // 2. The queue type decides which other arguments are accepted.
    if let Some(value) = table.get(ARG_QUEUE_TYPE) {
        parsed.queue_type = match value {
            AMQPValue::LongString(name) => match name.as_bytes() {
                b"classic" => QueueType::Classic,
                b"quorum" => QueueType::Quorum,
                b"stream" => {
                    return Err(ArgumentError::invalid_value(
                        ARG_QUEUE_TYPE,
                        erlang_string("stream queues are not supported"),
                    ));
                }
                other => {
                    return Err(ArgumentError::invalid_value(
                        ARG_QUEUE_TYPE,
                        erlang_string(&format!(
                            "unsupported queue type '{}'",
                            String::from_utf8_lossy(other)
                        )),
                    ));
                }
            },
            other => return Err(unacceptable_type(ARG_QUEUE_TYPE, other)),
        };
    }

    // 3. Values, in RabbitMQ's declare_args order.
    if let Some(value) = table.get(ARG_EXPIRES) {
        let n = integer_argument(ARG_EXPIRES, value)?;
        if n == 0 {
            return Err(ArgumentError::invalid_value(
                ARG_EXPIRES,
                "{value_zero,0}".to_string(),
            ));
        }
        parsed.expires = Some(expiry_value(ARG_EXPIRES, n)?);
    }
    if let Some(value) = table.get(ARG_MESSAGE_TTL) {
        let n = integer_argument(ARG_MESSAGE_TTL, value)?;
        parsed.message_ttl = Some(expiry_value(ARG_MESSAGE_TTL, n)?);
    }
    if let Some(value) = table.get(ARG_DEAD_LETTER_ROUTING_KEY) {
        match value {
            AMQPValue::LongString(key) => {
                if parsed.dead_letter_exchange.is_none() {
                    return Err(ArgumentError::invalid_value(
                        ARG_DEAD_LETTER_ROUTING_KEY,
                        "routing_key_but_no_dlx_defined".to_string(),
                    ));
                }
                parsed.dead_letter_routing_key =
                    Some(text_argument(ARG_DEAD_LETTER_ROUTING_KEY, key.as_bytes())?);
            }
            other => return Err(unacceptable_type(ARG_DEAD_LETTER_ROUTING_KEY, other)),
        }
    }
    if parsed.queue_type == QueueType::Quorum
        && let Some(value) = table.get(ARG_DEAD_LETTER_STRATEGY)
    {
        match value {
            AMQPValue::LongString(strategy) => {
                let strategy = std::str::from_utf8(strategy.as_bytes())
                    .ok()
                    .and_then(|s| s.parse::<DeadLetterStrategy>().ok())
                    .ok_or_else(|| {
                        ArgumentError::invalid_value(
                            ARG_DEAD_LETTER_STRATEGY,
                            "invalid_dlx_strategy".to_string(),
                        )
                    })?;
                parsed.dead_letter_strategy = Some(strategy);
            }
            other => return Err(unacceptable_type(ARG_DEAD_LETTER_STRATEGY, other)),
        }
    }
    if let Some(value) = table.get(ARG_MAX_LENGTH) {
        parsed.max_length = Some(non_negative_argument(ARG_MAX_LENGTH, value)?);
    }
    if let Some(value) = table.get(ARG_MAX_LENGTH_BYTES) {
        parsed.max_length_bytes = Some(non_negative_argument(ARG_MAX_LENGTH_BYTES, value)?);
    }
    if let Some(value) = table.get(ARG_OVERFLOW) {
        match value {
            AMQPValue::LongString(mode) => {
                let mode = std::str::from_utf8(mode.as_bytes())
                    .ok()
                    .and_then(|s| s.parse::<Overflow>().ok())
                    .ok_or_else(|| {
                        ArgumentError::invalid_value(ARG_OVERFLOW, "invalid_overflow".to_string())
                    })?;
                parsed.overflow = Some(mode);
            }
            other => return Err(unacceptable_type(ARG_OVERFLOW, other)),
        }
    }
    // Our extension: a delivery limit on every queue type.
    if let Some(value) = table.get(ARG_DELIVERY_LIMIT) {
        parsed.delivery_limit = Some(non_negative_argument(ARG_DELIVERY_LIMIT, value)?);
    }
    // RabbitMQ 3.12: a non-negative integer (3.10 ignores it; this service enforces it).
    if let Some(value) = table.get(ARG_CONSUMER_TIMEOUT) {
        parsed.consumer_timeout = Some(non_negative_argument(ARG_CONSUMER_TIMEOUT, value)?);
    }
    // RabbitMQ's check_bool_arg.
    if let Some(value) = table.get(ARG_SINGLE_ACTIVE_CONSUMER) {
        match value {
            AMQPValue::Boolean(on) => parsed.single_active_consumer = *on,
            other => return Err(unacceptable_type(ARG_SINGLE_ACTIVE_CONSUMER, other)),
        }
    }
    // Our extension: retry tiers, an array of 1 to MAX_RETRY_TIERS delays in ms.
    if let Some(value) = table.get(ARG_RETRY_DELAYS) {
        parsed.retry_delays = Some(retry_delays_argument(value)?);
    }

    // 4. Arguments the queue type does not take: the one the proxy owns (the upstream never
    // sees it on a classic queue); the others in [`check_queue_type_arguments`].
    if parsed.queue_type == QueueType::Classic && table.contains_key(ARG_DEAD_LETTER_STRATEGY) {
        return Err(unsupported_by(ARG_DEAD_LETTER_STRATEGY, parsed.queue_type));
    }

    Ok(parsed)
}

fn unsupported_by(argument: &str, queue_type: QueueType) -> ArgumentError {
    ArgumentError {
        argument: argument.to_string(),
        detail: queue_type.rabbit_module().to_string(),
        kind: ArgumentErrorKind::UnsupportedByQueueType,
    }
}

/// The embedded broker's check, after [`parse_queue_arguments`], of the arguments RabbitMQ
/// 3.10 knows for another queue type only (`x-max-priority` on a quorum queue,
/// `x-max-in-memory-length` on a classic one, the stream ones on both): 406 `invalid arg
/// 'x-max-priority' for queue 'q' in vhost '/' of queue type rabbit_quorum_queue`, as
/// RabbitMQ answers. Arguments no type knows are accepted and ignored. Proxy mode leaves this
/// to the upstream, whose version decides what its queue types take.
pub fn check_queue_type_arguments(
    args: &FieldTable,
    queue_type: QueueType,
) -> Result<(), ArgumentError> {
    let taken = equivalence_arguments(queue_type);
    let foreign = args.inner().keys().map(|k| k.as_str()).find(|key| {
        !taken.contains(key)
            && (CLASSIC_EQUIVALENCE_ARGUMENTS.contains(key)
                || QUORUM_EQUIVALENCE_ARGUMENTS.contains(key)
                || STREAM_ONLY_ARGUMENTS.contains(key))
    });
    match foreign {
        Some(key) => Err(unsupported_by(key, queue_type)),
        None => Ok(()),
    }
}

/// A per-message `expiration` property RabbitMQ refuses (channel error 406).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid expiration '{expiration}': {detail}")]
pub struct ExpirationError {
    /// The property as sent.
    pub expiration: String,
    /// RabbitMQ's reason: `no_integer`, `{leftover_string," "}`, `{value_negative,-5}`,
    /// `{value_too_big,N}`.
    pub detail: String,
}

impl ExpirationError {
    /// The full channel.close reply text: `PRECONDITION_FAILED - invalid expiration '...': ...`.
    pub fn reply_text(&self) -> String {
        format!("PRECONDITION_FAILED - {self}")
    }
}

/// Parse a per-message `expiration` (milliseconds) as RabbitMQ does with Erlang's
/// `string:to_integer`: an optional sign, ASCII digits and nothing else, then
/// 0..=[`MAX_EXPIRY_MS`]. So `"+5"` and `"-0"` are accepted like RabbitMQ accepts them;
/// `""`, `" 5"`, `"5 "`, `"-5"` and `"1.5"` are refused.
pub fn parse_expiration(expiration: &str) -> Result<u64, ExpirationError> {
    let error = |detail: String| ExpirationError {
        expiration: expiration.to_string(),
        detail,
    };
    let (negative, unsigned) = match expiration.as_bytes().first() {
        Some(b'+') => (false, &expiration[1..]),
        Some(b'-') => (true, &expiration[1..]),
        _ => (false, expiration),
    };
    let digits_end = unsigned
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(unsigned.len());
    if digits_end == 0 {
        return Err(error("no_integer".to_string()));
    }
    let (digits, rest) = unsigned.split_at(digits_end);
    if !rest.is_empty() {
        return Err(error(format!(
            "{{leftover_string,{}}}",
            erlang_string(rest)
        )));
    }
    let magnitude = digits.trim_start_matches('0');
    let shown = if magnitude.is_empty() { "0" } else { magnitude };
    // A digit string too long for u64 is certainly above the limit.
    let value = magnitude
        .parse::<u64>()
        .unwrap_or(if magnitude.is_empty() { 0 } else { u64::MAX });
    if negative && value != 0 {
        return Err(error(format!("{{value_negative,-{shown}}}")));
    }
    if value > MAX_EXPIRY_MS {
        return Err(error(format!("{{value_too_big,{shown}}}")));
    }
    Ok(value)
}

/// An Erlang term as `~tp` prints a table value (used in equivalence errors).
fn erlang_term(value: &AMQPValue) -> String {
    match value {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::Float(f) => erlang_float(f64::from(*f)),
        AMQPValue::Double(f) => erlang_float(*f),
        AMQPValue::DecimalValue(d) => format!("{{{},{}}}", d.scale, d.value),
        AMQPValue::ShortString(s) => format!("<<\"{}\">>", s.as_str()),
        AMQPValue::LongString(s) => format!("<<\"{}\">>", String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => format!("<<\"{}\">>", String::from_utf8_lossy(b.as_slice())),
        AMQPValue::Timestamp(t) => t.to_string(),
        AMQPValue::Void => "undefined".to_string(),
        AMQPValue::FieldArray(items) => {
            let inner: Vec<String> = items
                .as_slice()
                .iter()
                .map(|v| format!("{{{},{}}}", erlang_type_name(v), erlang_term(v)))
                .collect();
            format!("[{}]", inner.join(","))
        }
        AMQPValue::FieldTable(fields) => {
            let inner: Vec<String> = fields
                .inner()
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{{<<\"{}\">>,{},{}}}",
                        k.as_str(),
                        erlang_type_name(v),
                        erlang_term(v)
                    )
                })
                .collect();
            format!("[{}]", inner.join(","))
        }
        other => amqp_integer(other)
            .map(|n| n.to_string())
            .unwrap_or_default(),
    }
}

fn erlang_float(f: f64) -> String {
    let mut text = format!("{f}");
    if f.is_finite() && !text.contains('.') && !text.contains('e') {
        text.push_str(".0");
    }
    text
}

/// RabbitMQ's `val/1` for one side of a presence mismatch.
pub(crate) fn describe_presence(value: Option<&AMQPValue>) -> String {
    match value {
        None => "none".to_string(),
        Some(v) => {
            let shown = match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                other => erlang_term(other),
            };
            format!("the value '{}' of type '{}'", shown, erlang_type_name(v))
        }
    }
}

/// RabbitMQ's `val/1` for one side of a value mismatch.
pub(crate) fn describe_value(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => format!("'{}'", String::from_utf8_lossy(s.as_bytes())),
        other => format!("'{}'", erlang_term(other)),
    }
}

#[derive(PartialEq)]
enum TypeClass {
    Integer,
    Float,
    Other(&'static str),
}

fn type_class(value: &AMQPValue) -> TypeClass {
    match value {
        AMQPValue::Float(_) | AMQPValue::Double(_) => TypeClass::Float,
        v if amqp_integer(v).is_some() => TypeClass::Integer,
        v => TypeClass::Other(erlang_type_name(v)),
    }
}

/// Equal values where integers of any width compare by value, and float equals double.
fn equivalent_values(existing: &AMQPValue, requested: &AMQPValue) -> bool {
    if existing == requested {
        return true;
    }
    if type_class(existing) != type_class(requested) {
        return false;
    }
    match (existing, requested) {
        (a, b) if amqp_integer(a).is_some() => amqp_integer(a) == amqp_integer(b),
        (a, b) => float_value(a).is_some() && float_value(a) == float_value(b),
    }
}

fn float_value(value: &AMQPValue) -> Option<f64> {
    match value {
        AMQPValue::Float(f) => Some(f64::from(*f)),
        AMQPValue::Double(f) => Some(*f),
        _ => None,
    }
}

/// RabbitMQ's redeclare check over the existing queue's type's list
/// ([`equivalence_arguments`]; its `x-queue-type` gives the type, absent is classic): each
/// must be present in both or in neither, with equal values (an int32 5 equals an int64 5).
/// Other x-arguments are not compared. An absent `x-queue-type` counts as `"classic"` (as in
/// RabbitMQ 3.11+; 3.10 refused that redeclare).
///
/// `Err` holds the reply text after `PRECONDITION_FAILED - `, e.g. `inequivalent arg
/// 'x-dead-letter-exchange' for queue 'q' in vhost '/': received none but current is the
/// value 'dlx' of type 'longstr'`.
pub fn check_equivalent(
    existing: &FieldTable,
    requested: &FieldTable,
    queue: &str,
    vhost: &str,
) -> Result<(), String> {
    let classic = AMQPValue::LongString(QueueType::Classic.as_str().into());
    let quorum = AMQPValue::LongString(QueueType::Quorum.as_str().into());
    let existing_type = if existing.inner().get(ARG_QUEUE_TYPE) == Some(&quorum) {
        QueueType::Quorum
    } else {
        QueueType::Classic
    };
    for &key in equivalence_arguments(existing_type) {
        let mut current = existing.inner().get(key);
        let mut received = requested.inner().get(key);
        if key == ARG_QUEUE_TYPE {
            current = current.or(Some(&classic));
            received = received.or(Some(&classic));
        }
        if let Some(text) = mismatch(current, received) {
            return Err(format!(
                "inequivalent arg '{key}' for queue '{queue}' in vhost '{vhost}': {text}"
            ));
        }
    }
    Ok(())
}

/// RabbitMQ's words for one argument that differs on a redeclare (`received ... but current
/// is ...`), or `None` when both are absent or equivalent.
pub fn mismatch(current: Option<&AMQPValue>, received: Option<&AMQPValue>) -> Option<String> {
    let mut text = String::new();
    match (current, received) {
        (None, None) => return None,
        (Some(c), Some(r)) if equivalent_values(c, r) => return None,
        (Some(c), Some(r)) => {
            let _ = write!(
                text,
                "received {} but current is {}",
                describe_value(r),
                describe_value(c)
            );
        }
        (c, r) => {
            let _ = write!(
                text,
                "received {} but current is {}",
                describe_presence(r),
                describe_presence(c)
            );
        }
    }
    Some(text)
}

/// Retry tiers as a field array of longs (how this service writes `x-retry-delays`).
pub fn delays_value(delays: &[u64]) -> AMQPValue {
    AMQPValue::FieldArray(amq_protocol::types::FieldArray::from(
        delays
            .iter()
            .map(|d| AMQPValue::LongLongInt(i64::try_from(*d).unwrap_or(i64::MAX)))
            .collect::<Vec<_>>(),
    ))
}

/// This service's redeclare check of retry tiers, in both modes: RabbitMQ does not compare
/// an argument it does not know, but a queue has one set of tiers, so a redeclare with other
/// tiers (or none, or tiers where it has none) is refused like an inequivalent argument.
/// Tiers compare by value, whatever the integer widths. `Err` holds the whole text after
/// `PRECONDITION_FAILED - `.
pub fn check_retry_delays_equivalent(
    existing: &FieldTable,
    requested: &FieldTable,
    queue: &str,
    vhost: &str,
) -> Result<(), String> {
    let delays = |table: &FieldTable| {
        table
            .inner()
            .get(ARG_RETRY_DELAYS)
            .and_then(|value| retry_delays_argument(value).ok())
    };
    let (current, received) = (delays(existing), delays(requested));
    if current == received {
        return Ok(());
    }
    let show = |d: &Option<Vec<u64>>| match d {
        Some(d) => describe_value(&delays_value(d)),
        None => "none".to_string(),
    };
    Err(format!(
        "inequivalent arg '{ARG_RETRY_DELAYS}' for queue '{queue}' in vhost '{vhost}': \
         received {} but current is {}",
        show(&received),
        show(&current)
    ))
}

#[cfg(test)]
mod tests;
