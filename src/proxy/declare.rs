//! `queue.declare` in proxy mode: validate the client's x-arguments the way the embedded broker
//! does and compute the arguments the upstream queue is declared with, a deterministic function
//! of the client's arguments and the TOML policy, so every proxy instance computes the same.
//!
//! The upstream queue carries every client x-argument natively (TTL, expiry, lengths,
//! overflow, type, priority, `x-delivery-limit` on quorum queues, ...), except the dead-letter
//! target: its dead-letter exchange is the proxy's capture exchange, so everything that dies
//! upstream (expired, maxlen, and rejections the proxy passed through) reaches the proxy, which
//! dead-letters it with the real settings. The client's dead-letter exchange and routing key,
//! and the delivery limit of a classic queue (RabbitMQ 3.10 refuses `x-delivery-limit` on a new
//! classic queue), travel in the upstream queue's dead-letter routing key as a [`CaptureTag`].
//! RabbitMQ stores it and compares it on every redeclare, so the upstream queue itself is the
//! truth every instance reads ([`super::arbiter`] turns RabbitMQ's verdict on it back into
//! the client's terms). Arguments the client did not send are filled from the policy (TTL,
//! expiry, lengths, overflow, a quorum queue's delivery limit), and a policy value lower than
//! the client's replaces it (the lower one applies, as RabbitMQ applies a policy), so they
//! reach the upstream queue; a redeclare does not compare them ([`DeclareRewrite::filled`]).
//!
//! With `proxy.delegate_to_upstream` the merged dead-letter settings are given to the upstream
//! instead and it dead-letters on its own.
//!
//! A queue type the proxy does not take over (a stream, or a type it does not know, which a
//! later RabbitMQ may add) is not rewritten at all ([`passes_through`]): its declare goes
//! upstream as sent, RabbitMQ alone judges it, and no TOML policy applies to it.

use amq_protocol::protocol::queue;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::policy::{EffectiveQueueSettings, PolicyDefinition, effective_settings};
pub use crate::rabbit::args::delays_value;
use crate::rabbit::args::{
    ARG_CONSUMER_TIMEOUT, ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY,
    ARG_DEAD_LETTER_STRATEGY, ARG_DELIVERY_LIMIT, ARG_EXPIRES, ARG_MAX_LENGTH,
    ARG_MAX_LENGTH_BYTES, ARG_MESSAGE_TTL, ARG_OVERFLOW, ARG_QUEUE_TYPE, ARG_RETRY_DELAYS,
    ArgumentError, ArgumentErrorKind, QueueArguments, QueueType, parse_queue_arguments,
};

/// Prefix of a capture tag in an upstream queue's dead-letter routing key.
pub const CAPTURE_TAG_PREFIX: &str = "dlx-proxy:";

/// The client's own dead-letter arguments (and a classic queue's delivery limit), carried
/// through the upstream in the dead-letter routing key.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureTag {
    #[serde(rename = "x", default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_exchange: Option<String>,
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_routing_key: Option<String>,
    /// `x-delivery-limit` of a classic queue (quorum queues carry it natively).
    #[serde(rename = "l", default, skip_serializing_if = "Option::is_none")]
    pub delivery_limit: Option<u64>,
    /// `x-retry-delays` (RabbitMQ stores but never compares an argument it does not know, so
    /// the tag, which it compares, is where every instance reads the queue's tiers).
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub retry_delays: Option<Vec<u64>>,
}

impl CaptureTag {
    /// The tag for these arguments; `None` when there is nothing to carry.
    pub fn from_arguments(args: &QueueArguments) -> Option<CaptureTag> {
        let delivery_limit = args
            .delivery_limit
            .filter(|_| args.queue_type != QueueType::Quorum);
        if args.dead_letter_exchange.is_none()
            && args.dead_letter_routing_key.is_none()
            && delivery_limit.is_none()
            && args.retry_delays.is_none()
        {
            return None;
        }
        Some(CaptureTag {
            dead_letter_exchange: args.dead_letter_exchange.clone(),
            dead_letter_routing_key: args.dead_letter_routing_key.clone(),
            delivery_limit,
            retry_delays: args.retry_delays.clone(),
        })
    }

    /// The routing-key form, if it fits a short string.
    pub fn encode(&self) -> Option<String> {
        let json = serde_json::to_string(self).ok()?;
        let text = format!("{CAPTURE_TAG_PREFIX}{json}");
        (text.len() <= 255).then_some(text)
    }

    /// Reads a routing key written by [`CaptureTag::encode`].
    pub fn decode(routing_key: &str) -> Option<CaptureTag> {
        let json = routing_key.strip_prefix(CAPTURE_TAG_PREFIX)?;
        serde_json::from_str(json).ok()
    }

    /// The queue arguments it stands for (only the ones it carries are known).
    pub fn to_arguments(&self) -> QueueArguments {
        QueueArguments {
            dead_letter_exchange: self.dead_letter_exchange.clone(),
            dead_letter_routing_key: self.dead_letter_routing_key.clone(),
            delivery_limit: self.delivery_limit,
            retry_delays: self.retry_delays.clone(),
            ..QueueArguments::default()
        }
    }

    /// The client x-arguments it stands for, as RabbitMQ would have stored them (strings as
    /// longstr, the limit as a signed 32-bit integer when it fits).
    pub fn to_field_table(&self) -> FieldTable {
        let mut table = FieldTable::default();
        if let Some(dlx) = &self.dead_letter_exchange {
            put_text(&mut table, ARG_DEAD_LETTER_EXCHANGE, dlx);
        }
        if let Some(key) = &self.dead_letter_routing_key {
            put_text(&mut table, ARG_DEAD_LETTER_ROUTING_KEY, key);
        }
        if let Some(limit) = self.delivery_limit {
            let value = match i32::try_from(limit) {
                Ok(small) => AMQPValue::LongInt(small),
                Err(_) => AMQPValue::LongLongInt(i64::try_from(limit).unwrap_or(i64::MAX)),
            };
            table.insert(ShortString::from(ARG_DELIVERY_LIMIT), value);
        }
        if let Some(delays) = &self.retry_delays {
            table.insert(ShortString::from(ARG_RETRY_DELAYS), delays_value(delays));
        }
        table
    }
}

/// The refusal of retry tiers whose capture tag does not fit the dead-letter routing key
/// (a short string): every instance must read them back from the queue, so they are refused
/// at the declare rather than kept by this instance alone.
fn tiers_do_not_fit() -> ArgumentError {
    ArgumentError {
        argument: ARG_RETRY_DELAYS.to_string(),
        detail: "{too_long,\"the delays with the dead-letter arguments exceed 255 bytes in proxy mode\"}"
            .into(),
        kind: ArgumentErrorKind::InvalidValue,
    }
}

/// The refusal of dead-letter arguments whose capture tag does not fit the dead-letter
/// routing key (a short string): the upstream queue would not record its target.
fn target_does_not_fit() -> ArgumentError {
    ArgumentError {
        argument: ARG_DEAD_LETTER_EXCHANGE.to_string(),
        detail:
            "{too_long,\"the dead-letter exchange and routing key exceed 255 bytes in proxy mode\"}"
                .into(),
        kind: ArgumentErrorKind::InvalidValue,
    }
}

/// Where dead-lettering happens for declared queues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadLetterHandling {
    /// The proxy dead-letters; the upstream queues dead-letter into this capture exchange.
    Capture { exchange: String },
    /// The upstream dead-letters with the merged settings (`proxy.delegate_to_upstream`).
    Delegate,
}

/// The outcome of a valid declare.
#[derive(Clone, Debug, PartialEq)]
pub struct DeclareRewrite {
    /// What the client asked for, parsed.
    pub client_arguments: QueueArguments,
    /// Client arguments merged with the policy.
    pub effective: EffectiveQueueSettings,
    /// The arguments to declare the upstream queue with.
    pub upstream_arguments: FieldTable,
    /// Keys whose value is the policy's (the client did not send them, or a lower policy value
    /// replaced the client's): RabbitMQ never compares policy values, so a redeclare takes the
    /// queue's current value for them.
    pub filled: Vec<&'static str>,
    /// Whether the proxy emulates the delivery limit (classic queues) rather than leaving it to
    /// the upstream (quorum queues count deliveries natively).
    pub proxy_delivery_limit: bool,
}

/// Whether a (non-passive) queue.declare with these client arguments goes upstream untouched:
/// its `x-queue-type` names a type the proxy does not take over (`stream`, or any value other
/// than `classic` and `quorum`). RabbitMQ answers it (declare-ok, or its own 406 for a type it
/// does not know either); the proxy validates nothing, merges no policy, and never dead-letters
/// or counts deliveries of such a queue (RabbitMQ does not dead-letter from streams).
/// A value that is not a long string is not passed: the broker's validation refuses it, as
/// RabbitMQ does.
pub fn passes_through(client: &FieldTable) -> bool {
    match client.inner().get(ARG_QUEUE_TYPE) {
        Some(AMQPValue::LongString(kind)) => !matches!(kind.as_bytes(), b"classic" | b"quorum"),
        _ => false,
    }
}

/// Validates and rewrites the arguments of a (non-passive) queue.declare.
pub fn rewrite_declare(
    client: &FieldTable,
    policy: Option<&PolicyDefinition>,
    default_delivery_limit: Option<u64>,
    handling: &DeadLetterHandling,
) -> Result<DeclareRewrite, ArgumentError> {
    let parsed = parse_queue_arguments(client)?;
    let effective = effective_settings(&parsed, policy, default_delivery_limit);
    let quorum = parsed.queue_type == QueueType::Quorum;
    let mut upstream = FieldTable::default();
    for (key, value) in client {
        let proxy_owned = match key.as_str() {
            ARG_DEAD_LETTER_EXCHANGE | ARG_DEAD_LETTER_ROUTING_KEY => true,
            // The proxy enforces it (and counts the attempt); a 3.12+ upstream must not
            // close the channel first.
            ARG_CONSUMER_TIMEOUT => true,
            // RabbitMQ 3.10 refuses it on a new classic queue: it goes into the tag.
            ARG_DELIVERY_LIMIT => !quorum,
            // Only quorum queues accept it; the proxy dead-letters anyway.
            ARG_DEAD_LETTER_STRATEGY => *handling != DeadLetterHandling::Delegate && !quorum,
            // The proxy holds and returns retried messages; the delays go into the tag.
            ARG_RETRY_DELAYS => *handling != DeadLetterHandling::Delegate,
            _ => false,
        };
        if !proxy_owned {
            upstream.insert(key.clone(), value.clone());
        }
    }
    // The policy's values: for the arguments the client did not give, and where a policy
    // value is lower than the client's (the lower one applies, as with a RabbitMQ policy).
    let mut filled = Vec::new();
    let mut fill =
        |upstream: &mut FieldTable, key: &'static str, given: Option<u64>, value: Option<u64>| {
            let Some(value) = value else {
                return;
            };
            let sent = client.inner().contains_key(key);
            if sent && given.is_some_and(|given| given <= value) {
                return;
            }
            let number = i64::try_from(value).unwrap_or(i64::MAX);
            upstream.insert(ShortString::from(key), AMQPValue::LongLongInt(number));
            filled.push(key);
        };
    fill(
        &mut upstream,
        ARG_MESSAGE_TTL,
        parsed.message_ttl,
        effective.message_ttl,
    );
    fill(
        &mut upstream,
        ARG_EXPIRES,
        parsed.expires,
        effective.expires,
    );
    fill(
        &mut upstream,
        ARG_MAX_LENGTH,
        parsed.max_length,
        effective.max_length,
    );
    fill(
        &mut upstream,
        ARG_MAX_LENGTH_BYTES,
        parsed.max_length_bytes,
        effective.max_length_bytes,
    );
    if quorum {
        fill(
            &mut upstream,
            ARG_DELIVERY_LIMIT,
            parsed.delivery_limit,
            effective.delivery_limit,
        );
    }
    if !client.inner().contains_key(ARG_OVERFLOW) && policy.is_some_and(|p| p.overflow.is_some()) {
        put_text(&mut upstream, ARG_OVERFLOW, effective.overflow.as_str());
        filled.push(ARG_OVERFLOW);
    }
    match handling {
        DeadLetterHandling::Capture { exchange } => {
            put_text(&mut upstream, ARG_DEAD_LETTER_EXCHANGE, exchange);
            if let Some(tag) = CaptureTag::from_arguments(&parsed) {
                match tag.encode() {
                    Some(tag) => put_text(&mut upstream, ARG_DEAD_LETTER_ROUTING_KEY, &tag),
                    None if tag.retry_delays.is_some() => return Err(tiers_do_not_fit()),
                    // Nowhere upstream would hold the target: an instance that did not see
                    // this declare (or this one after a restart) could not dead-letter.
                    None => return Err(target_does_not_fit()),
                }
            }
        }
        DeadLetterHandling::Delegate => {
            if let Some(dlx) = &effective.dead_letter_exchange {
                put_text(&mut upstream, ARG_DEAD_LETTER_EXCHANGE, dlx);
                if let Some(key) = &effective.dead_letter_routing_key {
                    put_text(&mut upstream, ARG_DEAD_LETTER_ROUTING_KEY, key);
                }
            }
        }
    }
    // The dead-letter strategy stays the upstream's own in both modes: a quorum queue with
    // `at-least-once` (and reject-publish) dead-letters into the capture exchange with
    // confirms and retries, so its deaths survive the loss of the capture queue's leader.
    if let Some(strategy) = client.inner().get(ARG_DEAD_LETTER_STRATEGY) {
        upstream.insert(
            ShortString::from(ARG_DEAD_LETTER_STRATEGY),
            strategy.clone(),
        );
    }
    let proxy_delivery_limit =
        !quorum && effective.delivery_limit.is_some() && *handling != DeadLetterHandling::Delegate;
    Ok(DeclareRewrite {
        client_arguments: parsed,
        effective,
        upstream_arguments: upstream,
        filled,
        proxy_delivery_limit,
    })
}

/// The upstream declare for a client's declare: the client's flags with other arguments.
pub fn upstream_declare(client: &queue::Declare, arguments: FieldTable) -> queue::Declare {
    queue::Declare {
        arguments,
        ..client.clone()
    }
}

/// Gives delegated upstream arguments the client's own dead-letter exchange and routing key,
/// as it sent them, in place of the merged ones (a policy's never goes into a declare there):
/// for queues only the client's connection can declare (exclusive, server-named), so that
/// RabbitMQ checks exactly the permissions it checks for a direct client.
pub fn keep_own_dead_letter_arguments(upstream: &mut FieldTable, client: &FieldTable) {
    let targets = [ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY];
    let mut kept = FieldTable::default();
    for (key, value) in &*upstream {
        if !targets.contains(&key.as_str()) {
            kept.insert(key.clone(), value.clone());
        }
    }
    for (key, value) in client {
        if targets.contains(&key.as_str()) {
            kept.insert(key.clone(), value.clone());
        }
    }
    *upstream = kept;
}

fn put_text(upstream: &mut FieldTable, key: &str, value: &str) {
    upstream.insert(
        ShortString::from(key),
        AMQPValue::LongString(LongString::from(value)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rabbit::args::Overflow;

    fn args(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    fn capture() -> DeadLetterHandling {
        DeadLetterHandling::Capture {
            exchange: "dlx-proxy.capture".into(),
        }
    }

    #[test]
    fn dead_letter_arguments_go_to_the_capture_tag() {
        let client = args(&[
            (ARG_DEAD_LETTER_EXCHANGE, text("dlx")),
            (ARG_DEAD_LETTER_ROUTING_KEY, text("dlq")),
            (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
            ("x-max-priority", AMQPValue::ShortShortUInt(5)),
        ]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        let up = rewrite.upstream_arguments.inner();
        assert_eq!(
            up.get(ARG_DEAD_LETTER_EXCHANGE),
            Some(&text("dlx-proxy.capture"))
        );
        let Some(AMQPValue::LongString(tag)) = up.get(ARG_DEAD_LETTER_ROUTING_KEY) else {
            panic!("no tag");
        };
        let tag = CaptureTag::decode(&String::from_utf8_lossy(tag.as_bytes())).unwrap();
        assert_eq!(tag.dead_letter_exchange.as_deref(), Some("dlx"));
        assert_eq!(tag.dead_letter_routing_key.as_deref(), Some("dlq"));
        assert_eq!(up.get(ARG_MESSAGE_TTL), Some(&AMQPValue::LongInt(1000)));
        assert_eq!(
            up.get("x-max-priority"),
            Some(&AMQPValue::ShortShortUInt(5))
        );
        assert_eq!(
            rewrite.effective.dead_letter_exchange.as_deref(),
            Some("dlx")
        );
    }

    #[test]
    fn the_dead_letter_strategy_stays_on_the_upstream_queue() {
        let client = args(&[
            ("x-queue-type", text("quorum")),
            (ARG_DEAD_LETTER_EXCHANGE, text("dlx")),
            (ARG_DEAD_LETTER_STRATEGY, text("at-least-once")),
            (ARG_OVERFLOW, text("reject-publish")),
        ]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        let up = rewrite.upstream_arguments.inner();
        assert_eq!(
            up.get(ARG_DEAD_LETTER_STRATEGY),
            Some(&text("at-least-once"))
        );
        assert_eq!(up.get(ARG_OVERFLOW), Some(&text("reject-publish")));
        assert_eq!(
            up.get(ARG_DEAD_LETTER_EXCHANGE),
            Some(&text("dlx-proxy.capture"))
        );
    }

    #[test]
    fn client_arguments_go_natively_and_the_policy_fills_or_lowers_the_rest() {
        let policy = PolicyDefinition {
            dead_letter_exchange: Some("pdlx".into()),
            message_ttl: Some(500),
            max_length: Some(10),
            expires: Some(90_000),
            overflow: Some(Overflow::RejectPublishDlx),
            ..PolicyDefinition::default()
        };
        let client = args(&[
            (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
            (ARG_EXPIRES, AMQPValue::LongInt(60_000)),
        ]);
        let rewrite = rewrite_declare(&client, Some(&policy), None, &capture()).unwrap();
        let up = rewrite.upstream_arguments.inner();
        // The lower policy TTL applies; the client's lower expiry goes as sent.
        assert_eq!(up.get(ARG_MESSAGE_TTL), Some(&AMQPValue::LongLongInt(500)));
        assert_eq!(up.get(ARG_EXPIRES), Some(&AMQPValue::LongInt(60_000)));
        assert_eq!(up.get(ARG_MAX_LENGTH), Some(&AMQPValue::LongLongInt(10)));
        assert_eq!(up.get(ARG_OVERFLOW), Some(&text("reject-publish-dlx")));
        assert_eq!(
            rewrite.filled,
            vec![ARG_MESSAGE_TTL, ARG_MAX_LENGTH, ARG_OVERFLOW]
        );
        // No client dead-letter arguments: no tag, the policy is read when a message dies.
        assert!(up.get(ARG_DEAD_LETTER_ROUTING_KEY).is_none());
        assert_eq!(
            rewrite.effective.dead_letter_exchange.as_deref(),
            Some("pdlx")
        );
    }

    #[test]
    fn delivery_limit_is_in_the_tag_on_classic_and_native_on_quorum() {
        let client = args(&[(ARG_DELIVERY_LIMIT, AMQPValue::LongInt(2))]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        assert!(rewrite.proxy_delivery_limit);
        let up = rewrite.upstream_arguments.inner();
        assert!(up.get(ARG_DELIVERY_LIMIT).is_none());
        let Some(AMQPValue::LongString(tag)) = up.get(ARG_DEAD_LETTER_ROUTING_KEY) else {
            panic!("no tag");
        };
        let tag = CaptureTag::decode(&String::from_utf8_lossy(tag.as_bytes())).unwrap();
        assert_eq!(tag.delivery_limit, Some(2));
        assert_eq!(tag.dead_letter_exchange, None);
        assert_eq!(
            tag.to_field_table(),
            args(&[(ARG_DELIVERY_LIMIT, AMQPValue::LongInt(2))])
        );
        let client = args(&[
            (ARG_DELIVERY_LIMIT, AMQPValue::LongInt(2)),
            ("x-queue-type", text("quorum")),
        ]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        assert!(!rewrite.proxy_delivery_limit);
        assert_eq!(
            rewrite.upstream_arguments.inner().get(ARG_DELIVERY_LIMIT),
            Some(&AMQPValue::LongInt(2))
        );
        assert!(
            rewrite
                .upstream_arguments
                .inner()
                .get(ARG_DEAD_LETTER_ROUTING_KEY)
                .is_none()
        );
        // A default limit is the proxy's configuration, not the queue's: no tag.
        let rewrite = rewrite_declare(&FieldTable::default(), None, Some(3), &capture()).unwrap();
        assert!(rewrite.proxy_delivery_limit);
        assert!(
            rewrite
                .upstream_arguments
                .inner()
                .get(ARG_DEAD_LETTER_ROUTING_KEY)
                .is_none()
        );
    }

    #[test]
    fn delegation_gives_the_upstream_the_merged_target() {
        let policy = PolicyDefinition {
            dead_letter_exchange: Some("pdlx".into()),
            dead_letter_routing_key: Some("k".into()),
            ..PolicyDefinition::default()
        };
        let rewrite = rewrite_declare(
            &FieldTable::default(),
            Some(&policy),
            None,
            &DeadLetterHandling::Delegate,
        )
        .unwrap();
        let up = rewrite.upstream_arguments.inner();
        assert_eq!(up.get(ARG_DEAD_LETTER_EXCHANGE), Some(&text("pdlx")));
        assert_eq!(up.get(ARG_DEAD_LETTER_ROUTING_KEY), Some(&text("k")));
    }

    #[test]
    fn a_queue_of_the_clients_own_keeps_its_own_target_not_the_policys() {
        let policy = PolicyDefinition {
            dead_letter_exchange: Some("pdlx".into()),
            dead_letter_routing_key: Some("k".into()),
            ..PolicyDefinition::default()
        };
        for (client, expected) in [
            (FieldTable::default(), None),
            (
                args(&[(ARG_DEAD_LETTER_EXCHANGE, text("own"))]),
                Some(text("own")),
            ),
        ] {
            let mut rewrite =
                rewrite_declare(&client, Some(&policy), None, &DeadLetterHandling::Delegate)
                    .unwrap();
            keep_own_dead_letter_arguments(&mut rewrite.upstream_arguments, &client);
            let up = rewrite.upstream_arguments.inner();
            assert_eq!(up.get(ARG_DEAD_LETTER_EXCHANGE), expected.as_ref());
            assert_eq!(up.get(ARG_DEAD_LETTER_ROUTING_KEY), None);
            // The proxy still knows the merged target (for the rejections it takes over).
            assert_eq!(
                rewrite.effective.dead_letter_exchange.as_deref(),
                Some(if expected.is_some() { "own" } else { "pdlx" })
            );
        }
    }

    #[test]
    fn invalid_arguments_are_refused_like_the_broker() {
        let client = args(&[(ARG_DEAD_LETTER_ROUTING_KEY, text("k"))]);
        let err = rewrite_declare(&client, None, None, &capture()).unwrap_err();
        assert_eq!(err.reply_code(), 406);
        assert!(
            err.reply_text("q", "/")
                .contains("routing_key_but_no_dlx_defined")
        );
    }

    #[test]
    fn streams_and_unknown_queue_types_pass_through() {
        let kind =
            |v: AMQPValue| args(&[(ARG_QUEUE_TYPE, v), (ARG_DEAD_LETTER_EXCHANGE, text("d"))]);
        assert!(passes_through(&kind(text("stream"))));
        assert!(passes_through(&kind(text("some-future-type"))));
        assert!(passes_through(&kind(text(""))));
        assert!(!passes_through(&kind(text("classic"))));
        assert!(!passes_through(&kind(text("quorum"))));
        assert!(!passes_through(&kind(AMQPValue::LongInt(1))));
        assert!(!passes_through(&args(&[(
            ARG_DEAD_LETTER_EXCHANGE,
            text("d")
        )])));
    }

    #[test]
    fn retry_delays_travel_in_the_tag_and_are_refused_when_it_does_not_fit() {
        let client = args(&[(ARG_RETRY_DELAYS, delays_value(&[300, 900]))]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        let up = rewrite.upstream_arguments.inner();
        assert!(up.get(ARG_RETRY_DELAYS).is_none());
        let Some(AMQPValue::LongString(tag)) = up.get(ARG_DEAD_LETTER_ROUTING_KEY) else {
            panic!("no tag");
        };
        let tag = CaptureTag::decode(&String::from_utf8_lossy(tag.as_bytes())).unwrap();
        assert_eq!(tag.retry_delays, Some(vec![300, 900]));
        assert_eq!(tag.to_arguments().retry_delays, Some(vec![300, 900]));
        assert_eq!(
            parse_queue_arguments(&tag.to_field_table())
                .unwrap()
                .retry_delays,
            Some(vec![300, 900])
        );
        // 32 delays of ten digits do not fit 255 bytes.
        let long = args(&[(ARG_RETRY_DELAYS, delays_value(&[4_000_000_000; 32]))]);
        let err = rewrite_declare(&long, None, None, &capture()).unwrap_err();
        assert_eq!(err.reply_code(), 406);
        assert!(
            err.reply_text("q", "/")
                .contains("x-retry-delays' for queue 'q' in vhost '/': {too_long,")
        );
        // Delegated, the upstream keeps it as sent (the proxy retries nothing there).
        let rewrite = rewrite_declare(&client, None, None, &DeadLetterHandling::Delegate).unwrap();
        assert!(
            rewrite
                .upstream_arguments
                .inner()
                .get(ARG_RETRY_DELAYS)
                .is_some()
        );
    }

    #[test]
    fn a_dead_letter_target_too_long_for_a_tag_is_refused_with_406() {
        // Each name fits a short string; together they do not fit one tag.
        let long = args(&[
            (ARG_DEAD_LETTER_EXCHANGE, text(&"x".repeat(130))),
            (ARG_DEAD_LETTER_ROUTING_KEY, text(&"k".repeat(130))),
        ]);
        let err = rewrite_declare(&long, None, None, &capture()).unwrap_err();
        assert_eq!(err.reply_code(), 406);
        let reply = err.reply_text("q", "/");
        assert!(
            reply.contains(
                "invalid arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': {too_long,"
            ),
            "{reply}"
        );
        // Delegated, the upstream keeps the names as sent.
        assert!(rewrite_declare(&long, None, None, &DeadLetterHandling::Delegate).is_ok());
        // Just short enough: kept in the tag.
        let fits = args(&[
            (ARG_DEAD_LETTER_EXCHANGE, text(&"x".repeat(100))),
            (ARG_DEAD_LETTER_ROUTING_KEY, text(&"k".repeat(100))),
        ]);
        assert!(rewrite_declare(&fits, None, None, &capture()).is_ok());
    }

    #[test]
    fn long_tags_do_not_fit() {
        let tag = CaptureTag {
            dead_letter_exchange: Some("x".repeat(250)),
            ..CaptureTag::default()
        };
        assert!(tag.encode().is_none());
        let short = CaptureTag {
            dead_letter_exchange: Some(String::new()),
            dead_letter_routing_key: Some("q\"1".into()),
            delivery_limit: Some(2),
            retry_delays: Some(vec![300, 900]),
        };
        assert_eq!(CaptureTag::decode(&short.encode().unwrap()), Some(short));
        assert_eq!(CaptureTag::decode("plain-key"), None);
    }
}
