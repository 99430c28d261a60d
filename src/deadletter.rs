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

use crate::config::DeadLetterConfig;
use crate::rabbit::args::{UnknownValue, amqp_integer};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use std::collections::BTreeMap;
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
fn group_by_queue_and_reason(entries: &[AMQPValue]) -> Vec<AMQPValue> {
    let mut grouped = Vec::with_capacity(entries.len());
    let mut seen: Vec<(Option<&AMQPValue>, Option<&AMQPValue>)> = Vec::new();
    for entry in entries {
        let AMQPValue::FieldTable(table) = entry else {
            grouped.push(entry.clone());
            continue;
        };
        let group = entry_key(table);
        if seen.contains(&group) {
            continue;
        }
        seen.push(group);
        let mut table = table.clone();
        if !table.contains_key("count") {
            let duplicates = entries
                .iter()
                .filter(|e| matches!(e, AMQPValue::FieldTable(t) if entry_key(t) == group))
                .count();
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

/// Sum of the integer counts of the table entries.
fn total_deaths(history: &[AMQPValue]) -> i64 {
    history
        .iter()
        .filter_map(|e| match e {
            AMQPValue::FieldTable(t) => t.inner().get("count").and_then(amqp_integer),
            _ => None,
        })
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
    let mut headers: BTreeMap<ShortString, AMQPValue> = props
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();

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
        Some(AMQPValue::FieldArray(entries)) => {
            record_in_history(entries.as_slice(), event, new_entry)
        }
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
    if reason == DeadLetterReason::Rejected {
        return false;
    }
    let Some(AMQPValue::FieldArray(entries)) = rewritten
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(X_DEATH))
    else {
        return false;
    };
    let target = long_string(target_queue);
    let rejected = long_string(DeadLetterReason::Rejected.as_str());
    for entry in entries.as_slice() {
        let AMQPValue::FieldTable(table) = entry else {
            return false;
        };
        if table.inner().get("reason") == Some(&rejected) {
            return false;
        }
        if table.inner().get("queue") == Some(&target) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_700_000_000;

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|k| k.to_string()).collect()
    }

    fn array(items: &[&str]) -> AMQPValue {
        AMQPValue::FieldArray(FieldArray::from(
            items.iter().map(|k| long_string(k)).collect::<Vec<_>>(),
        ))
    }

    fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(key(k), v);
        }
        t
    }

    fn with_headers(entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
        BasicProperties::default().with_headers(table(entries))
    }

    fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
        props.headers().as_ref().and_then(|h| h.inner().get(name))
    }

    fn header_names(props: &BasicProperties) -> Vec<String> {
        props
            .headers()
            .as_ref()
            .map(|h| h.inner().keys().map(|k| k.as_str().to_string()).collect())
            .unwrap_or_default()
    }

    fn raw_x_death(props: &BasicProperties) -> Vec<AMQPValue> {
        match header(props, X_DEATH) {
            Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
            other => panic!("x-death is {other:?}"),
        }
    }

    /// (queue, reason, count) of each entry, newest first.
    fn summary(props: &BasicProperties) -> Vec<(String, String, i64)> {
        x_death_entries(props)
            .into_iter()
            .map(|e| (e.queue, e.reason, e.count))
            .collect()
    }

    fn entry(queue: &str, reason: &str, count: i64) -> (String, String, i64) {
        (queue.to_string(), reason.to_string(), count)
    }

    struct Death<'a> {
        queue: &'a str,
        reason: DeadLetterReason,
        exchange: &'a str,
        routing_keys: Vec<String>,
        now: u64,
        dlx: &'a str,
        dlrk: Option<&'a str>,
    }

    fn die_with(
        props: &BasicProperties,
        d: &Death,
        opts: &DeadLetterOptions,
        trusted: bool,
    ) -> Result<DeadLetteredMessage, DeadLetterDrop> {
        dead_letter(
            props,
            &DeathEvent {
                queue: d.queue,
                reason: d.reason,
                exchange: d.exchange,
                routing_keys: &d.routing_keys,
                now_secs: d.now,
                trust_existing_history: trusted,
            },
            &DeadLetterTarget {
                exchange: d.dlx,
                routing_key: d.dlrk,
            },
            opts,
        )
    }

    fn die(props: &BasicProperties, d: &Death) -> DeadLetteredMessage {
        die_with(props, d, &DeadLetterOptions::default(), true).unwrap()
    }

    /// A death of a message that arrived at `queue` through `exchange` with key `rk`.
    fn death<'a>(
        queue: &'a str,
        reason: DeadLetterReason,
        exchange: &'a str,
        rk: &str,
        dlx: &'a str,
        dlrk: Option<&'a str>,
    ) -> Death<'a> {
        Death {
            queue,
            reason,
            exchange,
            routing_keys: keys(&[rk]),
            now: T0,
            dlx,
            dlrk,
        }
    }

    /// Follow one dead-lettering into the next queue: the next death's exchange and keys are
    /// the ones the dead-lettered message was routed with.
    fn hop<'a>(
        prev: &'a DeadLetteredMessage,
        queue: &'a str,
        reason: DeadLetterReason,
        dlx: &'a str,
        dlrk: Option<&'a str>,
        now: u64,
    ) -> Death<'a> {
        Death {
            queue,
            reason,
            exchange: &prev.exchange,
            routing_keys: prev.routing_keys.clone(),
            now,
            dlx,
            dlrk,
        }
    }

    use DeadLetterReason::{Expired, MaxLen, Rejected};

    #[test]
    fn reasons_and_compat_parse() {
        let names: Vec<&str> = DeadLetterReason::all().iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["rejected", "expired", "maxlen", "delivery_limit"]);
        for r in DeadLetterReason::all() {
            assert_eq!(r.to_string().parse::<DeadLetterReason>(), Ok(r));
        }
        assert_eq!("3".parse::<Compat>(), Ok(Compat::V3));
        assert_eq!("4".parse::<Compat>(), Ok(Compat::V4));
        assert!("5".parse::<Compat>().is_err());
        assert_eq!(Compat::default(), Compat::V3);
    }

    #[test]
    fn options_from_config() {
        let mut config = DeadLetterConfig::default();
        assert_eq!(
            DeadLetterOptions::from_config(&config),
            Ok(DeadLetterOptions::default())
        );
        config.compat = "4".into();
        config.max_hops = 16;
        config.x_death_total = true;
        assert_eq!(
            DeadLetterOptions::from_config(&config),
            Ok(DeadLetterOptions {
                compat: Compat::V4,
                x_death_total: true,
                max_hops: Some(16)
            })
        );
        config.compat = "3.10".into();
        assert!(DeadLetterOptions::from_config(&config).is_err());
    }

    #[test]
    fn h1_first_death_writes_one_typed_entry() {
        let out = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "dlx", Some("dlq")),
        );
        assert_eq!(out.exchange, "dlx");
        assert_eq!(out.routing_keys, keys(&["dlq"]));
        let entries = raw_x_death(&out.properties);
        assert_eq!(entries.len(), 1);
        let expected = table(vec![
            ("count", AMQPValue::LongLongInt(1)),
            ("reason", long_string("rejected")),
            ("queue", long_string("q")),
            ("time", AMQPValue::Timestamp(T0)),
            ("exchange", long_string("")),
            ("routing-keys", array(&["q"])),
        ]);
        assert_eq!(entries[0], AMQPValue::FieldTable(expected));
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_QUEUE),
            Some(&long_string("q"))
        );
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_EXCHANGE),
            Some(&long_string(""))
        );
        assert_eq!(
            header_names(&out.properties),
            [
                "x-death",
                "x-first-death-exchange",
                "x-first-death-queue",
                "x-first-death-reason"
            ]
        );
    }

    #[test]
    fn h2_e3_self_loop_increments_one_entry_and_keeps_its_time() {
        let first = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
        );
        assert_eq!(first.routing_keys, keys(&["q"]));
        let second = die(
            &first.properties,
            &hop(&first, "q", Rejected, "", None, T0 + 30),
        );
        let entries = x_death_entries(&second.properties);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].count, 2);
        assert_eq!(entries[0].time, T0, "time is the first death's");
        let AMQPValue::FieldTable(raw) = &raw_x_death(&second.properties)[0] else {
            panic!("not a table");
        };
        assert_eq!(raw.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
        assert_eq!(raw.inner().get("time"), Some(&AMQPValue::Timestamp(T0)));
        assert_eq!(
            header(&second.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
    }

    #[test]
    fn h3_new_entries_go_first() {
        let at_q = die(
            &BasicProperties::default(),
            &death("Q", Rejected, "", "Q", "", Some("Dlx1")),
        );
        let at_dlx1 = die(
            &at_q.properties,
            &hop(&at_q, "Dlx1", Rejected, "", Some("Dlx2"), T0 + 1),
        );
        assert_eq!(
            summary(&at_dlx1.properties),
            [entry("Dlx1", "rejected", 1), entry("Q", "rejected", 1)]
        );
        assert_eq!(
            header(&at_dlx1.properties, X_FIRST_DEATH_QUEUE),
            Some(&long_string("Q"))
        );
    }

    #[test]
    fn e4_chain_of_rejections_stays_in_recency_order() {
        // 3.10.8 gives [c2, c0, c1] here; the spec (and 3.13.3+) gives [c2, c1, c0].
        let mut msg = die(
            &BasicProperties::default(),
            &death("c0", Rejected, "", "c0", "", Some("c1")),
        );
        msg = die(
            &msg.properties,
            &hop(&msg, "c1", Rejected, "", Some("c2"), T0),
        );
        msg = die(
            &msg.properties,
            &hop(&msg, "c2", Rejected, "", Some("c3"), T0),
        );
        assert_eq!(
            summary(&msg.properties),
            [
                entry("c2", "rejected", 1),
                entry("c1", "rejected", 1),
                entry("c0", "rejected", 1)
            ]
        );
    }

    #[test]
    fn e5_c2_reject_expire_expire_loop_is_never_dropped() {
        // b (reject, DLRK a2) -> a2 (TTL, DLRK a3) -> a3 (TTL, DLRK b) -> b ...
        let mut msg = die(
            &BasicProperties::default(),
            &death("b", Rejected, "", "b", "", Some("a2")),
        );
        for round in 0..3u64 {
            let now = T0 + round * 10;
            assert!(!is_cycle(Rejected, &msg.properties, "a2"));
            msg = die(
                &msg.properties,
                &hop(&msg, "a2", Expired, "", Some("a3"), now + 1),
            );
            assert!(
                !is_cycle(Expired, &msg.properties, "a3"),
                "round {round}: a3 wrongly dropped"
            );
            msg = die(
                &msg.properties,
                &hop(&msg, "a3", Expired, "", Some("b"), now + 2),
            );
            assert!(
                !is_cycle(Expired, &msg.properties, "b"),
                "round {round}: b wrongly dropped"
            );
            if round == 0 {
                assert_eq!(
                    summary(&msg.properties),
                    [
                        entry("a3", "expired", 1),
                        entry("a2", "expired", 1),
                        entry("b", "rejected", 1)
                    ]
                );
            }
            msg = die(
                &msg.properties,
                &hop(&msg, "b", Rejected, "", Some("a2"), now + 3),
            );
        }
        assert_eq!(
            summary(&msg.properties),
            [
                entry("b", "rejected", 4),
                entry("a3", "expired", 3),
                entry("a2", "expired", 3)
            ]
        );
    }

    #[test]
    fn e1_dlrk_replaces_keys_removes_cc_and_keeps_other_properties() {
        let props = BasicProperties::default()
            .with_headers(table(vec![
                ("zz", AMQPValue::LongInt(1)),
                ("aa", long_string("x")),
                ("CC", array(&["k"])),
            ]))
            .with_message_id("mid".into())
            .with_priority(3)
            .with_timestamp(12345);
        let out = die(
            &props,
            &death("src", Rejected, "ex", "src", "dlx", Some("dlrk")),
        );
        assert_eq!(out.exchange, "dlx");
        assert_eq!(out.routing_keys, keys(&["dlrk"]));
        assert_eq!(
            header_names(&out.properties),
            [
                "aa",
                "x-death",
                "x-first-death-exchange",
                "x-first-death-queue",
                "x-first-death-reason",
                "zz"
            ]
        );
        assert_eq!(
            x_death_entries(&out.properties)[0].routing_keys,
            keys(&["src", "k"])
        );
        assert_eq!(
            out.properties.message_id().as_ref().map(|m| m.as_str()),
            Some("mid")
        );
        assert_eq!(*out.properties.priority(), Some(3));
        assert_eq!(*out.properties.timestamp(), Some(12345));
        assert_eq!(*out.properties.expiration(), None);
        assert_eq!(header(&out.properties, "zz"), Some(&AMQPValue::LongInt(1)));
    }

    #[test]
    fn e2_x7_without_dlrk_all_keys_route_and_bcc_is_dropped() {
        let props = BasicProperties::default()
            .with_headers(table(vec![
                ("CC", array(&["cc1key"])),
                ("BCC", array(&["bcckey"])),
            ]))
            .with_expiration("50".into());
        let d = Death {
            queue: "src",
            reason: Expired,
            exchange: "ex",
            routing_keys: keys(&["src", "cc1key", "bcckey"]),
            now: T0,
            dlx: "dlx",
            dlrk: None,
        };
        let out = die(&props, &d);
        assert_eq!(
            out.routing_keys,
            keys(&["src", "cc1key", "bcckey"]),
            "BCC keys still route"
        );
        assert_eq!(
            header(&out.properties, "CC"),
            Some(&array(&["cc1key"])),
            "CC kept without a DLRK"
        );
        assert_eq!(header(&out.properties, "BCC"), None);
        let e = &x_death_entries(&out.properties)[0];
        assert_eq!(
            e.routing_keys,
            keys(&["src", "cc1key"]),
            "x-death excludes BCC"
        );
        assert_eq!(e.original_expiration.as_deref(), Some("50"));
        assert_eq!(*out.properties.expiration(), None);
    }

    #[test]
    fn h8_routing_keys_are_publish_key_then_cc_in_header_order() {
        let props = with_headers(vec![
            ("CC", array(&["cc 2", "cc 1"])),
            ("BCC", array(&["bcc 1"])),
        ]);
        let d = Death {
            queue: "q1",
            reason: Expired,
            exchange: "",
            routing_keys: keys(&["q1", "cc 2", "cc 1", "bcc 1"]),
            now: T0,
            dlx: "",
            dlrk: Some("q2"),
        };
        let out = die(&props, &d);
        assert_eq!(
            x_death_entries(&out.properties)[0].routing_keys,
            keys(&["q1", "cc 2", "cc 1"])
        );
    }

    #[test]
    fn x5_x6_cc_header_with_and_without_dlrk() {
        let props = with_headers(vec![("CC", array(&["dlq"]))]);
        let routed = keys(&["q", "dlq"]);
        let no_dlrk = Death {
            queue: "q",
            reason: Rejected,
            exchange: "",
            routing_keys: routed.clone(),
            now: T0,
            dlx: "dlx",
            dlrk: None,
        };
        let out = die(&props, &no_dlrk);
        assert_eq!(header(&out.properties, "CC"), Some(&array(&["dlq"])));
        assert_eq!(out.routing_keys, routed);

        let with_dlrk = Death {
            dlrk: Some("dlq"),
            ..no_dlrk
        };
        let v3 = die(&props, &with_dlrk);
        assert_eq!(
            header(&v3.properties, "CC"),
            None,
            "3.10 removes CC with a DLRK"
        );
        assert_eq!(
            x_death_entries(&v3.properties)[0].routing_keys,
            keys(&["q", "dlq"])
        );

        let v4_opts = DeadLetterOptions {
            compat: Compat::V4,
            ..DeadLetterOptions::default()
        };
        let v4 = die_with(&props, &with_dlrk, &v4_opts, true).unwrap();
        assert_eq!(
            header(&v4.properties, "CC"),
            Some(&array(&["dlq"])),
            "3.13+ keeps CC"
        );
        assert_eq!(v4.routing_keys, keys(&["dlq"]));
    }

    #[test]
    fn expiration_is_removed_on_every_death_and_recorded_once() {
        for reason in DeadLetterReason::all() {
            let props = BasicProperties::default().with_expiration("60000".into());
            let out = die(&props, &death("q", reason, "", "q", "dlx", None));
            assert_eq!(*out.properties.expiration(), None, "{reason}");
            assert_eq!(
                x_death_entries(&out.properties)[0]
                    .original_expiration
                    .as_deref(),
                Some("60000"),
                "{reason}"
            );
        }
        let zero = BasicProperties::default().with_expiration("0".into());
        let out = die(&zero, &death("q", Rejected, "", "q", "dlx", None));
        assert_eq!(
            x_death_entries(&out.properties)[0]
                .original_expiration
                .as_deref(),
            Some("0")
        );
        // Queue TTL alone: no original-expiration.
        let out = die(
            &BasicProperties::default(),
            &death("q", Expired, "", "q", "dlx", None),
        );
        let AMQPValue::FieldTable(raw) = &raw_x_death(&out.properties)[0] else {
            panic!("not a table");
        };
        assert!(!raw.contains_key("original-expiration"));
    }

    #[test]
    fn incremented_entry_keeps_its_fields_and_gets_no_new_expiration() {
        // conformance scenario client_xdeath_matching_entry
        let old = table(vec![
            ("count", AMQPValue::LongInt(5)),
            ("reason", long_string("rejected")),
            ("queue", long_string("src")),
            ("time", AMQPValue::Timestamp(1_577_836_800)),
            ("exchange", long_string("old-ex")),
            ("routing-keys", array(&["old-rk"])),
            ("original-expiration", long_string("999")),
        ]);
        let other = table(vec![
            ("count", AMQPValue::LongLongInt(2)),
            ("reason", long_string("expired")),
            ("queue", long_string("other")),
            ("time", AMQPValue::Timestamp(1_577_836_800)),
            ("exchange", long_string("e1")),
            ("routing-keys", array(&["k1"])),
        ]);
        let props = BasicProperties::default()
            .with_headers(table(vec![
                (
                    X_DEATH,
                    AMQPValue::FieldArray(FieldArray::from(vec![
                        AMQPValue::FieldTable(other.clone()),
                        AMQPValue::FieldTable(old.clone()),
                    ])),
                ),
                (X_FIRST_DEATH_QUEUE, long_string("client-set")),
            ]))
            .with_expiration("123".into());
        let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
        let mut incremented = old.clone();
        incremented.insert(key("count"), AMQPValue::LongLongInt(6));
        assert_eq!(
            raw_x_death(&out.properties),
            [
                AMQPValue::FieldTable(incremented),
                AMQPValue::FieldTable(other)
            ]
        );
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_QUEUE),
            Some(&long_string("client-set"))
        );
        assert_eq!(header(&out.properties, X_FIRST_DEATH_REASON), None);
        assert_eq!(header(&out.properties, X_FIRST_DEATH_EXCHANGE), None);
        assert_eq!(*out.properties.expiration(), None);
    }

    #[test]
    fn matching_ignores_the_exchange() {
        let first = die(
            &BasicProperties::default(),
            &death("q", Expired, "ex1", "q", "dlx", None),
        );
        let second = die(
            &first.properties,
            &death("q", Expired, "ex2", "other", "dlx", None),
        );
        let entries = x_death_entries(&second.properties);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].count, 2);
        assert_eq!(entries[0].exchange, "ex1");
        assert_eq!(entries[0].routing_keys, keys(&["q"]));
    }

    #[test]
    fn same_queue_other_reason_is_a_new_entry() {
        let first = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
        );
        let second = die(&first.properties, &death("q", Expired, "", "q", "", None));
        assert_eq!(
            summary(&second.properties),
            [entry("q", "expired", 1), entry("q", "rejected", 1)]
        );
    }

    #[test]
    fn client_history_for_another_queue_is_continued() {
        // conformance scenario client_xdeath_unrelated
        let client = table(vec![
            ("count", AMQPValue::LongLongInt(3)),
            ("reason", long_string("expired")),
            ("queue", long_string("elsewhere")),
            ("time", AMQPValue::Timestamp(1_577_836_800)),
            ("exchange", long_string("old-ex")),
            ("routing-keys", array(&["old-rk"])),
        ]);
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(
                client.clone(),
            )])),
        )]);
        let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
        let entries = raw_x_death(&out.properties);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1], AMQPValue::FieldTable(client));
        assert_eq!(summary(&out.properties)[0], entry("src", "rejected", 1));
        assert_eq!(
            header_names(&out.properties),
            ["x-death"],
            "no x-first-death-* when x-death existed"
        );
    }

    #[test]
    fn client_x_first_death_without_x_death_is_overwritten() {
        let props = with_headers(vec![(X_FIRST_DEATH_REASON, long_string("client"))]);
        let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_QUEUE),
            Some(&long_string("src"))
        );
        assert_eq!(
            header(&out.properties, X_FIRST_DEATH_EXCHANGE),
            Some(&long_string("x"))
        );
    }

    #[test]
    fn e6_republished_history_is_continued_with_first_death_kept() {
        let at_r0 = die(
            &BasicProperties::default(),
            &death("r0", Rejected, "", "r0", "", Some("dlx")),
        );
        // The client republishes the received headers to r0, which now has a TTL.
        let republished =
            BasicProperties::default().with_headers(at_r0.properties.headers().clone().unwrap());
        let expired = die(
            &republished,
            &death("r0", Expired, "", "r0", "", Some("dlx")),
        );
        assert_eq!(
            summary(&expired.properties),
            [entry("r0", "expired", 1), entry("r0", "rejected", 1)]
        );
        assert_eq!(
            header(&expired.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
    }

    #[test]
    fn e7_non_array_x_death_is_replaced_without_first_death() {
        let props = with_headers(vec![(X_DEATH, long_string("garbage"))]);
        let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
        assert_eq!(summary(&out.properties), [entry("q", "rejected", 1)]);
        assert_eq!(header_names(&out.properties), ["x-death"]);
    }

    #[test]
    fn e8_two_hops_record_each_exchange_and_keys() {
        let at_q1 = die(
            &BasicProperties::default(),
            &death("q1", Rejected, "", "q1", "p4_d1", Some("k2")),
        );
        let at_q2 = die(
            &at_q1.properties,
            &hop(&at_q1, "q2", Rejected, "", Some("q3"), T0 + 1),
        );
        assert_eq!(at_q2.exchange, "");
        assert_eq!(at_q2.routing_keys, keys(&["q3"]));
        let entries = x_death_entries(&at_q2.properties);
        assert_eq!(entries.len(), 2);
        assert_eq!(
            (entries[0].queue.as_str(), entries[0].exchange.as_str()),
            ("q2", "p4_d1")
        );
        assert_eq!(entries[0].routing_keys, keys(&["k2"]));
        assert_eq!(
            (entries[1].queue.as_str(), entries[1].exchange.as_str()),
            ("q1", "")
        );
        assert_eq!(entries[1].routing_keys, keys(&["q1"]));
    }

    #[test]
    fn legacy_duplicates_are_collapsed_in_order_and_missing_counts_filled() {
        let dup = |count: Option<i64>, exchange: &str| {
            let mut t = table(vec![
                ("reason", long_string("expired")),
                ("queue", long_string("other")),
                ("exchange", long_string(exchange)),
            ]);
            if let Some(c) = count {
                t.insert(key("count"), AMQPValue::LongLongInt(c));
            }
            AMQPValue::FieldTable(t)
        };
        let third = AMQPValue::FieldTable(table(vec![
            ("reason", long_string("maxlen")),
            ("queue", long_string("third")),
        ]));
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![
                dup(Some(2), "e1"),
                dup(Some(7), "e2"),
                third,
            ])),
        )]);
        let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
        assert_eq!(
            summary(&out.properties),
            [
                entry("src", "rejected", 1),
                entry("other", "expired", 2),
                entry("third", "maxlen", 1)
            ]
        );
        assert_eq!(
            x_death_entries(&out.properties)[1].exchange,
            "e1",
            "the first duplicate stays"
        );
        let AMQPValue::FieldTable(t) = &raw_x_death(&out.properties)[2] else {
            panic!("not a table");
        };
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(1)));
        // Two duplicates without counts group into one entry of count 2.
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![dup(None, "a"), dup(None, "b")])),
        )]);
        let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
        assert_eq!(summary(&out.properties)[1], entry("other", "expired", 2));
    }

    #[test]
    fn matching_entry_without_count_counts_as_one() {
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
                ("reason", long_string("rejected")),
                ("queue", long_string("q")),
            ]))])),
        )]);
        let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
        let AMQPValue::FieldTable(t) = &raw_x_death(&out.properties)[0] else {
            panic!("not a table");
        };
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
    }

    #[test]
    fn non_table_elements_are_kept_in_place() {
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![
                long_string("note"),
                AMQPValue::FieldTable(
                    XDeathEntry {
                        queue: "q".into(),
                        reason: "expired".into(),
                        time: 1,
                        exchange: String::new(),
                        routing_keys: keys(&["q"]),
                        count: 1,
                        original_expiration: None,
                    }
                    .to_field_table(),
                ),
                AMQPValue::LongInt(7),
            ])),
        )]);
        let out = die(&props, &death("q", Expired, "", "q", "", None));
        let raw = raw_x_death(&out.properties);
        assert_eq!(raw.len(), 3);
        assert!(matches!(&raw[0], AMQPValue::FieldTable(_)));
        assert_eq!(raw[1], long_string("note"));
        assert_eq!(raw[2], AMQPValue::LongInt(7));
        assert_eq!(summary(&out.properties), [entry("q", "expired", 2)]);
    }

    #[test]
    fn delivery_count_header_is_removed() {
        let props = with_headers(vec![
            (X_DELIVERY_COUNT, AMQPValue::LongLongInt(3)),
            ("keep", long_string("y")),
        ]);
        let out = die(
            &props,
            &death("q", DeadLetterReason::DeliveryLimit, "", "q", "dlx", None),
        );
        assert_eq!(header(&out.properties, X_DELIVERY_COUNT), None);
        assert_eq!(header(&out.properties, "keep"), Some(&long_string("y")));
        assert_eq!(summary(&out.properties), [entry("q", "delivery_limit", 1)]);
    }

    #[test]
    fn every_property_but_expiration_survives() {
        let props = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_content_encoding("gzip".into())
            .with_headers(table(vec![("h", AMQPValue::Boolean(true))]))
            .with_delivery_mode(2)
            .with_priority(5)
            .with_correlation_id("cid".into())
            .with_reply_to("rt".into())
            .with_expiration("60000".into())
            .with_message_id("mid".into())
            .with_timestamp(1_700_000_000)
            .with_type("t1".into())
            .with_user_id("guest".into())
            .with_app_id("app".into())
            .with_cluster_id("cl".into());
        let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
        let expected = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_content_encoding("gzip".into())
            .with_headers(out.properties.headers().clone().unwrap())
            .with_delivery_mode(2)
            .with_priority(5)
            .with_correlation_id("cid".into())
            .with_reply_to("rt".into())
            .with_message_id("mid".into())
            .with_timestamp(1_700_000_000)
            .with_type("t1".into())
            .with_user_id("guest".into())
            .with_app_id("app".into())
            .with_cluster_id("cl".into());
        assert_eq!(out.properties, expected);
        assert_eq!(
            header(&out.properties, "h"),
            Some(&AMQPValue::Boolean(true))
        );
    }

    #[test]
    fn v4_second_death_after_dlrk_records_only_the_keys_routed_with() {
        let opts = DeadLetterOptions {
            compat: Compat::V4,
            ..DeadLetterOptions::default()
        };
        let props = with_headers(vec![("CC", array(&["cc 1", "cc 2"]))]);
        let first_death = Death {
            queue: "q1",
            reason: Expired,
            exchange: "",
            routing_keys: keys(&["q1", "cc 1", "cc 2"]),
            now: T0,
            dlx: "",
            dlrk: Some("q2"),
        };
        let first = die_with(&props, &first_death, &opts, false).unwrap();
        assert_eq!(
            x_death_entries(&first.properties)[0].routing_keys,
            keys(&["q1", "cc 1", "cc 2"])
        );
        assert_eq!(
            header(&first.properties, "CC"),
            Some(&array(&["cc 1", "cc 2"]))
        );
        let second = die_with(
            &first.properties,
            &hop(&first, "q2", Expired, "", Some("q3"), T0 + 1),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            x_death_entries(&second.properties)[0].routing_keys,
            keys(&["q2"]),
            "the kept CC header is not among the keys the message was routed with"
        );
    }

    #[test]
    fn v4_writes_last_death_on_every_death() {
        let opts = DeadLetterOptions {
            compat: Compat::V4,
            ..DeadLetterOptions::default()
        };
        let first = die_with(
            &BasicProperties::default(),
            &death("q1", Expired, "", "q1", "", Some("q2")),
            &opts,
            false,
        )
        .unwrap();
        for (name, value) in [
            (X_FIRST_DEATH_REASON, "expired"),
            (X_FIRST_DEATH_QUEUE, "q1"),
            (X_LAST_DEATH_REASON, "expired"),
            (X_LAST_DEATH_QUEUE, "q1"),
        ] {
            assert_eq!(
                header(&first.properties, name),
                Some(&long_string(value)),
                "{name}"
            );
        }
        let second = die_with(
            &first.properties,
            &hop(&first, "q2", Rejected, "", Some("q3"), T0 + 1),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            header(&second.properties, X_FIRST_DEATH_QUEUE),
            Some(&long_string("q1"))
        );
        assert_eq!(
            header(&second.properties, X_LAST_DEATH_QUEUE),
            Some(&long_string("q2"))
        );
        assert_eq!(
            header(&second.properties, X_LAST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
        assert_eq!(
            header(&second.properties, X_LAST_DEATH_EXCHANGE),
            Some(&long_string(""))
        );
        assert_eq!(
            summary(&second.properties),
            [entry("q2", "rejected", 1), entry("q1", "expired", 1)]
        );
        // 3.10 has no x-last-death-*.
        let v3 = die(
            &BasicProperties::default(),
            &death("q1", Expired, "", "q1", "", None),
        );
        assert_eq!(header(&v3.properties, X_LAST_DEATH_QUEUE), None);
    }

    #[test]
    fn h4b_v4_ignores_a_client_history() {
        let opts = DeadLetterOptions {
            compat: Compat::V4,
            ..DeadLetterOptions::default()
        };
        let at_r0 = die_with(
            &BasicProperties::default(),
            &death("r0", Rejected, "", "r0", "", Some("dlx")),
            &opts,
            false,
        )
        .unwrap();
        let republished =
            BasicProperties::default().with_headers(at_r0.properties.headers().clone().unwrap());
        let untrusted = die_with(
            &republished,
            &death("r0", Expired, "", "r0", "", Some("dlx")),
            &opts,
            false,
        )
        .unwrap();
        assert_eq!(summary(&untrusted.properties), [entry("r0", "expired", 1)]);
        assert_eq!(
            header(&untrusted.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("expired"))
        );
        // The same message dead-lettered again by the broker itself is continued.
        let trusted = die_with(
            &republished,
            &death("r0", Expired, "", "r0", "", Some("dlx")),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            summary(&trusted.properties),
            [entry("r0", "expired", 1), entry("r0", "rejected", 1)]
        );
        assert_eq!(
            header(&trusted.properties, X_FIRST_DEATH_REASON),
            Some(&long_string("rejected"))
        );
        // V3 ignores the flag: the history is always continued.
        let v3 = die_with(
            &republished,
            &death("r0", Expired, "", "r0", "", Some("dlx")),
            &DeadLetterOptions::default(),
            false,
        )
        .unwrap();
        assert_eq!(summary(&v3.properties).len(), 2);
    }

    #[test]
    fn x_death_total_counts_every_death() {
        let opts = DeadLetterOptions {
            x_death_total: true,
            ..DeadLetterOptions::default()
        };
        let first = die_with(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            header(&first.properties, X_DEATH_TOTAL),
            Some(&AMQPValue::LongLongInt(1))
        );
        let second = die_with(
            &first.properties,
            &death("p", Expired, "", "p", "", None),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            header(&second.properties, X_DEATH_TOTAL),
            Some(&AMQPValue::LongLongInt(2))
        );
        let from_int32 = with_headers(vec![(X_DEATH_TOTAL, AMQPValue::LongInt(9))]);
        let out = die_with(
            &from_int32,
            &death("q", Rejected, "", "q", "", None),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            header(&out.properties, X_DEATH_TOTAL),
            Some(&AMQPValue::LongLongInt(10))
        );
        // Off by default.
        let off = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
        );
        assert_eq!(header(&off.properties, X_DEATH_TOTAL), None);
        // V4 with an untrusted history starts again.
        let v4 = DeadLetterOptions {
            compat: Compat::V4,
            x_death_total: true,
            max_hops: None,
        };
        let reset = die_with(
            &from_int32,
            &death("q", Rejected, "", "q", "", None),
            &v4,
            false,
        )
        .unwrap();
        assert_eq!(
            header(&reset.properties, X_DEATH_TOTAL),
            Some(&AMQPValue::LongLongInt(1))
        );
    }

    #[test]
    fn hop_limit_drops_past_max_hops() {
        let opts = DeadLetterOptions {
            max_hops: Some(2),
            ..DeadLetterOptions::default()
        };
        let first = die_with(
            &BasicProperties::default(),
            &death("a", Rejected, "", "a", "", None),
            &opts,
            true,
        )
        .unwrap();
        let second = die_with(
            &first.properties,
            &death("b", Rejected, "", "b", "", None),
            &opts,
            true,
        )
        .unwrap();
        assert_eq!(
            die_with(
                &second.properties,
                &death("a", Rejected, "", "a", "", None),
                &opts,
                true
            ),
            Err(DeadLetterDrop::HopLimit)
        );
        assert_eq!(DeadLetterDrop::HopLimit.cause(), "hop_limit");
        // Counts of every entry add up, including a client's.
        let client = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
                ("reason", long_string("expired")),
                ("queue", long_string("x")),
                ("count", AMQPValue::LongInt(2)),
            ]))])),
        )]);
        assert!(
            die_with(
                &client,
                &death("q", Rejected, "", "q", "", None),
                &opts,
                true
            )
            .is_err()
        );
        let no_limit = DeadLetterOptions::default();
        assert!(
            die_with(
                &second.properties,
                &death("a", Rejected, "", "a", "", None),
                &no_limit,
                true
            )
            .is_ok()
        );
    }

    #[test]
    fn empty_routing_keys_record_only_cc() {
        let props = with_headers(vec![("CC", array(&["c"]))]);
        let d = Death {
            queue: "q",
            reason: Expired,
            exchange: "",
            routing_keys: Vec::new(),
            now: T0,
            dlx: "dlx",
            dlrk: None,
        };
        let out = die(&props, &d);
        assert!(out.routing_keys.is_empty());
        assert_eq!(
            x_death_entries(&out.properties)[0].routing_keys,
            keys(&["c"])
        );
    }

    #[test]
    fn t4_m4_self_loops_without_rejection_are_cycles() {
        for reason in [Expired, MaxLen] {
            let out = die(
                &BasicProperties::default(),
                &death("q", reason, "", "q", "", None),
            );
            assert_eq!(out.routing_keys, keys(&["q"]));
            assert!(is_cycle(reason, &out.properties, "q"), "{reason}");
        }
    }

    #[test]
    fn c1_rejections_never_cycle() {
        let first = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
        );
        assert!(!is_cycle(Rejected, &first.properties, "q"));
        let second = die(&first.properties, &death("q", Rejected, "", "q", "", None));
        assert!(!is_cycle(Rejected, &second.properties, "q"));
    }

    #[test]
    fn fanout_partial_cycle_is_decided_per_target() {
        let out = die(
            &BasicProperties::default(),
            &death("p4_self", Expired, "", "p4_self", "p4_fan", None),
        );
        assert!(is_cycle(Expired, &out.properties, "p4_self"));
        assert!(!is_cycle(Expired, &out.properties, "p4_other"));
    }

    #[test]
    fn ttl_self_loop_is_dropped_despite_an_earlier_rejection() {
        let rejected = die(
            &BasicProperties::default(),
            &death("q", Rejected, "", "q", "", None),
        );
        let expired = die(
            &rejected.properties,
            &death("q", Expired, "", "q", "", None),
        );
        assert!(is_cycle(Expired, &expired.properties, "q"));
    }

    #[test]
    fn reject_then_ttl_loop_between_two_queues_is_kept() {
        // a (reject) -> b (TTL) -> a: the walk from the newest entry to a's passes a rejection.
        let at_a = die(
            &BasicProperties::default(),
            &death("a", Rejected, "", "a", "", Some("b")),
        );
        let at_b = die(
            &at_a.properties,
            &hop(&at_a, "b", Expired, "", Some("a"), T0),
        );
        assert!(!is_cycle(Expired, &at_b.properties, "a"));
        // A two-queue TTL loop is cut where it closes.
        let ttl_a = die(
            &BasicProperties::default(),
            &death("a", Expired, "", "a", "", Some("b")),
        );
        assert!(!is_cycle(Expired, &ttl_a.properties, "b"));
        let ttl_b = die(
            &ttl_a.properties,
            &hop(&ttl_a, "b", Expired, "", Some("a"), T0),
        );
        assert!(is_cycle(Expired, &ttl_b.properties, "a"));
    }

    #[test]
    fn cycle_edge_cases() {
        assert!(!is_cycle(Expired, &BasicProperties::default(), "q"));
        assert!(!is_cycle(
            Expired,
            &with_headers(vec![(X_DEATH, long_string("x"))]),
            "q"
        ));
        // A non-table element before the target's entry: not automatic.
        let entry_q = AMQPValue::FieldTable(table(vec![
            ("queue", long_string("q")),
            ("reason", long_string("expired")),
        ]));
        let odd_first = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongInt(1),
                entry_q.clone(),
            ])),
        )]);
        assert!(!is_cycle(Expired, &odd_first, "q"));
        // A non-table element after the target's entry does not matter.
        let odd_last = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![entry_q, AMQPValue::LongInt(1)])),
        )]);
        assert!(is_cycle(Expired, &odd_last, "q"));
        // The target's own entry being a rejection: no cycle.
        let rejected_q = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
                ("queue", long_string("q")),
                ("reason", long_string("rejected")),
            ]))])),
        )]);
        assert!(!is_cycle(MaxLen, &rejected_q, "q"));
    }

    #[test]
    fn x_death_entry_round_trip_and_decoding() {
        let e = XDeathEntry {
            queue: "q".into(),
            reason: "expired".into(),
            time: T0,
            exchange: "ex".into(),
            routing_keys: keys(&["a", "b"]),
            count: 3,
            original_expiration: Some("10".into()),
        };
        let t = e.to_field_table();
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(t.inner().get("time"), Some(&AMQPValue::Timestamp(T0)));
        assert_eq!(
            t.inner().get("original-expiration"),
            Some(&long_string("10"))
        );
        assert_eq!(XDeathEntry::from_field_table(&t), Some(e.clone()));
        let without = XDeathEntry {
            original_expiration: None,
            ..e
        };
        assert!(!without.to_field_table().contains_key("original-expiration"));
        // Lenient decoding of a client's table.
        let sparse = table(vec![
            ("queue", long_string("q")),
            ("reason", long_string("maxlen")),
            ("time", AMQPValue::LongLongInt(5)),
        ]);
        let decoded = XDeathEntry::from_field_table(&sparse).unwrap();
        assert_eq!(
            (decoded.count, decoded.time, decoded.exchange.as_str()),
            (1, 5, "")
        );
        assert_eq!(
            XDeathEntry::from_field_table(&table(vec![("queue", long_string("q"))])),
            None
        );
        // x_death_entries skips what it cannot decode.
        let props = with_headers(vec![(
            X_DEATH,
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongInt(1),
                AMQPValue::FieldTable(sparse),
                AMQPValue::FieldTable(table(vec![])),
            ])),
        )]);
        assert_eq!(x_death_entries(&props).len(), 1);
        assert!(x_death_entries(&BasicProperties::default()).is_empty());
    }
}
