//! The dead-letter rules, free of any I/O: how a dying message is rewritten for its
//! dead-letter exchange ([`dead_letter`]) and which target queues must not receive it because
//! they would close an automatic loop ([`is_cycle`]).
//!
//! Both modes call these: the embedded broker when a queue rejects, expires or overflows a
//! message, the proxy when it takes over dead-lettering from the upstream broker. The caller
//! routes the rewritten message through the DLX, runs [`is_cycle`] for each target queue and
//! publishes to the others (in embedded mode: [`crate::broker::dead_letter_routing`]).
//!
//! The semantics are RabbitMQ 3.10–3.12's ([`Compat::V3`], the default) without 3.10.8's
//! ordering bug: `x-death` stays newest first and the other entries keep their order.
//! [`Compat::V4`] gives RabbitMQ 3.13+/4.x's differences: the `CC` header is kept when a
//! dead-letter routing key replaces the keys, `x-last-death-*` headers are written, and the
//! history on a message a client published is not trusted.

use crate::amqp::content::header_map;
use crate::config::DeadLetterConfig;
use crate::rabbit::args::{UnknownValue, amqp_integer};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

pub const X_DEATH: &str = "x-death";
pub const X_FIRST_DEATH_REASON: &str = "x-first-death-reason";
pub const X_FIRST_DEATH_QUEUE: &str = "x-first-death-queue";
pub const X_FIRST_DEATH_EXCHANGE: &str = "x-first-death-exchange";
pub const X_LAST_DEATH_REASON: &str = "x-last-death-reason";
pub const X_LAST_DEATH_QUEUE: &str = "x-last-death-queue";
pub const X_LAST_DEATH_EXCHANGE: &str = "x-last-death-exchange";
/// Opt-in counter of every death of a message ([`DeadLetterOptions::x_death_total`]).
pub const X_DEATH_TOTAL: &str = "x-death-total";
pub const X_DELIVERY_COUNT: &str = "x-delivery-count";
pub const HEADER_CC: &str = "CC";
pub const HEADER_BCC: &str = "BCC";

/// Why a message died; written as the x-death `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// basic.reject / basic.nack with requeue=false.
    Rejected,
    /// Queue or per-message TTL.
    Expired,
    /// max-length / max-length-bytes (drop-head or reject-publish-dlx).
    MaxLen,
    /// Redelivered more often than the delivery limit allows.
    DeliveryLimit,
}

impl DeadLetterReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Rejected => "rejected",
            DeadLetterReason::Expired => "expired",
            DeadLetterReason::MaxLen => "maxlen",
            DeadLetterReason::DeliveryLimit => "delivery_limit",
        }
    }

    /// Every reason (metric label values).
    pub fn all() -> [DeadLetterReason; 4] {
        [
            DeadLetterReason::Rejected,
            DeadLetterReason::Expired,
            DeadLetterReason::MaxLen,
            DeadLetterReason::DeliveryLimit,
        ]
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeadLetterReason {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeadLetterReason::all()
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownValue(s.to_string()))
    }
}

/// Which RabbitMQ generation's dead-letter semantics to reproduce (`dead_letter.compat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compat {
    /// RabbitMQ 3.10–3.12 (documented semantics).
    #[default]
    V3,
    /// RabbitMQ 3.13+/4.x: CC kept with a DLRK, `x-last-death-*`, client history ignored.
    V4,
}

impl FromStr for Compat {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "3" => Ok(Compat::V3),
            "4" => Ok(Compat::V4),
            other => Err(UnknownValue(other.to_string())),
        }
    }
}

/// Service-wide switches for the rewrite.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterOptions {
    pub compat: Compat,
    /// Add or increment an `x-death-total` header (int64) on every death.
    pub x_death_total: bool,
    /// Drop a message whose deaths (the sum of the x-death counts, this one included)
    /// exceed this number.
    pub max_hops: Option<u32>,
}

impl DeadLetterOptions {
    /// From `[dead_letter]` (`max_hops = 0` means no limit).
    pub fn from_config(config: &DeadLetterConfig) -> Result<Self, UnknownValue> {
        Ok(DeadLetterOptions {
            compat: config.compat.parse()?,
            x_death_total: config.x_death_total,
            max_hops: (config.max_hops > 0).then_some(config.max_hops),
        })
    }
}

/// The source queue's effective dead-letter exchange and routing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadLetterTarget<'a> {
    pub exchange: &'a str,
    pub routing_key: Option<&'a str>,
}

/// One death of one message.
#[derive(Clone, Copy, Debug)]
pub struct DeathEvent<'a> {
    /// Source queue name (no vhost).
    pub queue: &'a str,
    pub reason: DeadLetterReason,
    /// Exchange the message was last published or dead-lettered to (`""` = default).
    pub exchange: &'a str,
    /// Every key it was routed with: the publish key first, then the CC keys, then the BCC
    /// keys.
    pub routing_keys: &'a [String],
    /// Wall clock, seconds since the epoch.
    pub now_secs: u64,
    /// [`Compat::V4`] only: `false` for a message a client published, whose `x-death`,
    /// `x-first-death-*`, `x-last-death-*` (and `x-death-total`) are then ignored and
    /// overwritten. Ignored by [`Compat::V3`], which always continues the history.
    pub trust_existing_history: bool,
}

/// The message to publish to the dead-letter exchange.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetteredMessage {
    pub properties: BasicProperties,
    /// The dead-letter exchange.
    pub exchange: String,
    /// Keys to route with: `[DLRK]` when one is set, else every original key (BCC included).
    /// The first one is the routing key of the delivery.
    pub routing_keys: Vec<String>,
}

/// Why a message is not dead-lettered at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeadLetterDrop {
    #[error("the message has been dead-lettered more often than the hop limit allows")]
    HopLimit,
}

impl DeadLetterDrop {
    /// The `cause` label of `dead_letter_dropped_total`.
    pub fn cause(self) -> &'static str {
        match self {
            DeadLetterDrop::HopLimit => "hop_limit",
        }
    }
}

/// One decoded x-death entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XDeathEntry {
    pub queue: String,
    pub reason: String,
    /// Seconds; the first death for this {queue, reason}.
    pub time: u64,
    pub exchange: String,
    pub routing_keys: Vec<String>,
    pub count: i64,
    pub original_expiration: Option<String>,
}

fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text))
}

fn key(name: &str) -> ShortString {
    ShortString::from(name)
}

/// Text of a longstr (or shortstr) value.
fn text_of(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

impl XDeathEntry {
    /// The wire form: count `l`, reason/queue/exchange `S`, time `T`, routing-keys `A` of `S`,
    /// original-expiration `S` when set.
    pub fn to_field_table(&self) -> FieldTable {
        let mut table = FieldTable::default();
        table.insert(key("count"), AMQPValue::LongLongInt(self.count));
        table.insert(key("reason"), long_string(&self.reason));
        table.insert(key("queue"), long_string(&self.queue));
        table.insert(key("time"), AMQPValue::Timestamp(self.time));
        table.insert(key("exchange"), long_string(&self.exchange));
        let keys: Vec<AMQPValue> = self.routing_keys.iter().map(|k| long_string(k)).collect();
        table.insert(
            key("routing-keys"),
            AMQPValue::FieldArray(FieldArray::from(keys)),
        );
        if let Some(expiration) = &self.original_expiration {
            table.insert(key("original-expiration"), long_string(expiration));
        }
        table
    }

    /// Decode an entry leniently (it may come from a client): `queue` and `reason` are
    /// required; a missing count reads as 1, a missing time as 0, missing strings as empty.
    pub fn from_field_table(table: &FieldTable) -> Option<XDeathEntry> {
        let fields = table.inner();
        let string = |name: &str| fields.get(name).and_then(text_of);
        Some(XDeathEntry {
            queue: string("queue")?,
            reason: string("reason")?,
            time: match fields.get("time") {
                Some(AMQPValue::Timestamp(t)) => *t,
                Some(other) => amqp_integer(other)
                    .and_then(|n| u64::try_from(n).ok())
                    .unwrap_or(0),
                None => 0,
            },
            exchange: string("exchange").unwrap_or_default(),
            routing_keys: match fields.get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => {
                    keys.as_slice().iter().filter_map(text_of).collect()
                }
                _ => Vec::new(),
            },
            count: fields.get("count").and_then(amqp_integer).unwrap_or(1),
            original_expiration: string("original-expiration"),
        })
    }
}

/// The decoded `x-death` history, newest first. Elements that are not tables or lack a
/// queue or reason are skipped; a header that is not an array gives an empty history.
pub fn x_death_entries(props: &BasicProperties) -> Vec<XDeathEntry> {
    match props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(X_DEATH))
    {
        Some(AMQPValue::FieldArray(entries)) => entries
            .as_slice()
            .iter()
            .filter_map(|entry| match entry {
                AMQPValue::FieldTable(table) => XDeathEntry::from_field_table(table),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The routing keys in a `CC`/`BCC`-style header value: the longstr entries of an array, in
/// order (RabbitMQ ignores every other shape). Shared by the broker and the proxy.
pub fn routing_key_list(value: Option<&AMQPValue>) -> Vec<String> {
    match value {
        Some(AMQPValue::FieldArray(keys)) => keys
            .as_slice()
            .iter()
            .filter_map(|k| match k {
                AMQPValue::LongString(s) => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The longstr keys of a `CC` header, in header order.
fn cc_keys(headers: &BTreeMap<ShortString, AMQPValue>) -> Vec<String> {
    routing_key_list(headers.get(HEADER_CC))
}

/// The {queue, reason} an entry is grouped by: the raw values, as RabbitMQ compares them.
fn entry_key(table: &FieldTable) -> (Option<&AMQPValue>, Option<&AMQPValue>) {
    (table.inner().get("queue"), table.inner().get("reason"))
}

/// RabbitMQ's legacy `group_by_queue_and_reason`, without its order reversal: a repeated
/// {queue, reason} table is dropped (the first one stays) and a table without a count gets
/// one equal to the number of its duplicates. Other elements are kept as they are.
///
/// Linear in the entries (a publisher can send thousands): each {queue, reason} is compared
/// by its values' debug form (type and value, as equality compares them).
fn group_by_queue_and_reason(entries: &[AMQPValue]) -> Vec<AMQPValue> {
    let group_of = |table: &FieldTable| {
        let (queue, reason) = entry_key(table);
        (format!("{queue:?}"), format!("{reason:?}"))
    };
    let mut duplicates: HashMap<(String, String), usize> = HashMap::new();
    for entry in entries {
        if let AMQPValue::FieldTable(table) = entry {
            *duplicates.entry(group_of(table)).or_default() += 1;
        }
    }
    let mut grouped = Vec::with_capacity(entries.len());
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for entry in entries {
        let AMQPValue::FieldTable(table) = entry else {
            grouped.push(entry.clone());
            continue;
        };
        let group = group_of(table);
        if seen.contains(&group) {
            continue;
        }
        let duplicates = duplicates.get(&group).copied().unwrap_or(1);
        seen.insert(group);
        let mut table = table.clone();
        if !table.contains_key("count") {
            table.insert(
                key("count"),
                AMQPValue::LongLongInt(i64::try_from(duplicates).unwrap_or(i64::MAX)),
            );
        }
        grouped.push(AMQPValue::FieldTable(table));
    }
    grouped
}

/// Record this death in an existing history: the {queue, reason} entry has its count
/// incremented (as int64) and moves to the front, keeping its other fields; otherwise the
/// new entry is prepended. The other elements keep their order.
fn record_in_history(
    entries: &[AMQPValue],
    event: &DeathEvent,
    new_entry: FieldTable,
    hop_limit: bool,
) -> Vec<AMQPValue> {
    let mut history = group_by_queue_and_reason(entries);
    let queue = long_string(event.queue);
    let reason = long_string(event.reason.as_str());
    let matching = history.iter().position(
        |e| matches!(e, AMQPValue::FieldTable(t) if entry_key(t) == (Some(&queue), Some(&reason))),
    );
    let front = match matching.map(|i| history.remove(i)) {
        Some(AMQPValue::FieldTable(mut table)) => {
            let count = table
                .inner()
                .get("count")
                .and_then(amqp_integer)
                .unwrap_or(1);
            // Under a hop limit a negative count (a client's) starts again from 0: counting up
            // from it would keep the limit away for as many deaths. Otherwise it is counted up
            // as RabbitMQ does.
            let count = if hop_limit { count.max(0) } else { count };
            table.insert(
                key("count"),
                AMQPValue::LongLongInt(count.saturating_add(1)),
            );
            table
        }
        _ => new_entry,
    };
    history.insert(0, AMQPValue::FieldTable(front));
    history
}

/// Sum of the integer counts of the table entries, each taken as at least 0 (a negative count
/// a client wrote must not lift the hop limit for its message).
fn total_deaths(history: &[AMQPValue]) -> i64 {
    history
        .iter()
        .filter_map(|e| match e {
            AMQPValue::FieldTable(t) => t.inner().get("count").and_then(amqp_integer),
            _ => None,
        })
        .map(|count| count.max(0))
        .fold(0i64, i64::saturating_add)
}

/// The properties with new headers and without `expiration`; everything else unchanged.
fn rebuild_properties(props: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let mut out = BasicProperties::default().with_headers(headers);
    if let Some(v) = props.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = props.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = props.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = props.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = props.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = props.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = props.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = props.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = props.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = props.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = props.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = props.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// Rewrite a dying message for its dead-letter exchange.
///
/// - routing keys: `[DLRK]` when the target has one, else every key of `event.routing_keys`
///   (BCC keys included);
/// - `x-death`: the {queue, reason} entry is incremented and moved to the front, or a new
///   entry (count 1, `time` = now, `exchange`, `routing-keys` = publish key + CC header keys,
///   `original-expiration` when the message had an expiration) is prepended; without any
///   `x-death` header, `x-first-death-*` are also set; a non-array `x-death` is replaced by a
///   fresh one-entry array (no `x-first-death-*`);
/// - `expiration`, `BCC` and `x-delivery-count` are removed; `CC` is removed when a DLRK is
///   used ([`Compat::V3`] only);
/// - [`Compat::V4`]: `x-last-death-*` on every death, and a fresh history when
///   `event.trust_existing_history` is false;
/// - options: `x-death-total`, and [`DeadLetterDrop::HopLimit`] past `max_hops` deaths.
pub fn dead_letter(
    props: &BasicProperties,
    event: &DeathEvent,
    target: &DeadLetterTarget,
    opts: &DeadLetterOptions,
) -> Result<DeadLetteredMessage, DeadLetterDrop> {
    let mut headers: BTreeMap<ShortString, AMQPValue> = header_map(props);

    if opts.compat == Compat::V4 && !event.trust_existing_history {
        for name in [
            X_DEATH,
            X_FIRST_DEATH_REASON,
            X_FIRST_DEATH_QUEUE,
            X_FIRST_DEATH_EXCHANGE,
            X_LAST_DEATH_REASON,
            X_LAST_DEATH_QUEUE,
            X_LAST_DEATH_EXCHANGE,
            X_DEATH_TOTAL,
        ] {
            headers.remove(name);
        }
    }

    let mut death_routing_keys: Vec<String> = event.routing_keys.iter().take(1).cloned().collect();
    match opts.compat {
        Compat::V3 => death_routing_keys.extend(cc_keys(&headers)),
        // 3.13+ records the keys the message was routed with (minus BCC): a CC header kept
        // from before a DLRK death is no longer among them.
        Compat::V4 => death_routing_keys.extend(
            cc_keys(&headers)
                .into_iter()
                .filter(|k| event.routing_keys.iter().skip(1).any(|r| r == k)),
        ),
    }
    let new_entry = XDeathEntry {
        queue: event.queue.to_string(),
        reason: event.reason.as_str().to_string(),
        time: event.now_secs,
        exchange: event.exchange.to_string(),
        routing_keys: death_routing_keys,
        count: 1,
        original_expiration: props.expiration().as_ref().map(|e| e.as_str().to_string()),
    }
    .to_field_table();

    let history = match headers.remove(X_DEATH) {
        None => {
            headers.insert(
                key(X_FIRST_DEATH_REASON),
                long_string(event.reason.as_str()),
            );
            headers.insert(key(X_FIRST_DEATH_QUEUE), long_string(event.queue));
            headers.insert(key(X_FIRST_DEATH_EXCHANGE), long_string(event.exchange));
            vec![AMQPValue::FieldTable(new_entry)]
        }
        Some(AMQPValue::FieldArray(entries)) => record_in_history(
            entries.as_slice(),
            event,
            new_entry,
            opts.max_hops.is_some(),
        ),
        Some(_) => vec![AMQPValue::FieldTable(new_entry)],
    };
    let deaths = total_deaths(&history);
    headers.insert(
        key(X_DEATH),
        AMQPValue::FieldArray(FieldArray::from(history)),
    );

    if opts.compat == Compat::V4 {
        headers.insert(key(X_LAST_DEATH_REASON), long_string(event.reason.as_str()));
        headers.insert(key(X_LAST_DEATH_QUEUE), long_string(event.queue));
        headers.insert(key(X_LAST_DEATH_EXCHANGE), long_string(event.exchange));
    }
    if opts.x_death_total {
        let previous = headers
            .get(X_DEATH_TOTAL)
            .and_then(amqp_integer)
            .unwrap_or(0);
        headers.insert(
            key(X_DEATH_TOTAL),
            AMQPValue::LongLongInt(previous.saturating_add(1)),
        );
    }
    if let Some(max_hops) = opts.max_hops
        && deaths > i64::from(max_hops)
    {
        return Err(DeadLetterDrop::HopLimit);
    }

    if target.routing_key.is_some() && opts.compat == Compat::V3 {
        headers.remove(HEADER_CC);
    }
    headers.remove(HEADER_BCC);
    headers.remove(X_DELIVERY_COUNT);

    let routing_keys = match target.routing_key {
        Some(routing_key) => vec![routing_key.to_string()],
        None => event.routing_keys.to_vec(),
    };
    Ok(DeadLetteredMessage {
        properties: rebuild_properties(props, FieldTable::from(headers)),
        exchange: target.exchange.to_string(),
        routing_keys,
    })
}

/// Whether delivering the rewritten message to `target_queue` would close a fully automatic
/// loop, in which case that copy is dropped (other target queues still get theirs).
///
/// RabbitMQ's rule: a `rejected` death never drops. Otherwise walk `x-death` newest first up
/// to the first entry for `target_queue`; no such entry → no cycle; it is a cycle iff every
/// entry walked, that one included, is a table whose reason is not `rejected`. Anything that
/// is not a table on the way means a client wrote the history: not a cycle.
pub fn is_cycle(reason: DeadLetterReason, rewritten: &BasicProperties, target_queue: &str) -> bool {
    CycleQueues::of(reason, rewritten).contains(target_queue)
}

/// The queues [`is_cycle`] is true for, found in one walk of the history (a dead letter with
/// many target queues or keys is judged in time linear in keys plus history).
#[derive(Debug, Default)]
pub struct CycleQueues<'a> {
    queues: std::collections::HashSet<&'a [u8]>,
}

impl<'a> CycleQueues<'a> {
    /// The queue of every entry walked before the first `rejected` entry or the first entry
    /// that is not a table (none for a `rejected` death).
    pub fn of(reason: DeadLetterReason, rewritten: &'a BasicProperties) -> Self {
        let mut found = CycleQueues::default();
        if reason == DeadLetterReason::Rejected {
            return found;
        }
        let Some(AMQPValue::FieldArray(entries)) = rewritten
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(X_DEATH))
        else {
            return found;
        };
        let rejected = long_string(DeadLetterReason::Rejected.as_str());
        for entry in entries.as_slice() {
            let AMQPValue::FieldTable(table) = entry else {
                break;
            };
            if table.inner().get("reason") == Some(&rejected) {
                break;
            }
            if let Some(AMQPValue::LongString(queue)) = table.inner().get("queue") {
                found.queues.insert(queue.as_bytes());
            }
        }
        found
    }

    /// Whether a dead letter to `queue` is a cycle.
    pub fn contains(&self, queue: &str) -> bool {
        self.queues.contains(queue.as_bytes())
    }
}

pub mod retry;

#[cfg(test)]
mod tests;
