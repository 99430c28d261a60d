//! `queue.declare` in proxy mode: validate the client's x-arguments the way the embedded broker
//! does, merge them with the TOML policy key by key, and compute the arguments the upstream
//! queue is declared with.
//!
//! The upstream queue gets the effective TTL and length limits, but never the real dead-letter
//! target: its dead-letter exchange is the proxy's capture exchange, so everything that dies
//! upstream (expired, maxlen, and rejections the proxy did not see) reaches the proxy, which
//! dead-letters it with the real settings. Dead-letter arguments the client gave travel in the
//! upstream queue's dead-letter routing key as a [`CaptureTag`], so any proxy instance that
//! consumes the capture queue knows them. With `proxy.delegate_to_upstream` the merged
//! dead-letter settings are given to the upstream instead and it dead-letters on its own.
//!
//! Because the upstream queue carries the proxy's arguments, not the client's, the upstream
//! cannot tell whether a redeclare is equivalent: the proxy does, with the embedded broker's
//! check, against the [`DeclaredQueue`] it remembered (see [`super::registry`]).

use amq_protocol::protocol::queue;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::policy::{EffectiveQueueSettings, PolicyDefinition, effective_settings};
use crate::rabbit::args::{
    ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY, ARG_DEAD_LETTER_STRATEGY,
    ARG_DELIVERY_LIMIT, ARG_EXPIRES, ARG_MAX_LENGTH, ARG_MAX_LENGTH_BYTES, ARG_MESSAGE_TTL,
    ARG_OVERFLOW, ArgumentError, EQUIVALENCE_ARGUMENTS, QueueArguments, QueueType, amqp_integer,
    check_equivalent, parse_queue_arguments,
};

/// Prefix of a capture tag in an upstream queue's dead-letter routing key.
pub const CAPTURE_TAG_PREFIX: &str = "dlx-proxy:";

/// The client's own dead-letter arguments, carried through the upstream.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureTag {
    #[serde(rename = "x", default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_exchange: Option<String>,
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_routing_key: Option<String>,
}

impl CaptureTag {
    /// The tag for these arguments; `None` when the client gave no dead-letter arguments.
    pub fn from_arguments(args: &QueueArguments) -> Option<CaptureTag> {
        if args.dead_letter_exchange.is_none() && args.dead_letter_routing_key.is_none() {
            return None;
        }
        Some(CaptureTag {
            dead_letter_exchange: args.dead_letter_exchange.clone(),
            dead_letter_routing_key: args.dead_letter_routing_key.clone(),
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

    /// The queue arguments it stands for (only the dead-letter ones are known).
    pub fn to_arguments(&self) -> QueueArguments {
        QueueArguments {
            dead_letter_exchange: self.dead_letter_exchange.clone(),
            dead_letter_routing_key: self.dead_letter_routing_key.clone(),
            ..QueueArguments::default()
        }
    }
}

/// How a client declared a queue: what the dead-letter rules read, and what a redeclare is
/// compared with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeclaredQueue {
    /// The client's arguments, parsed.
    pub arguments: QueueArguments,
    /// The client's x-arguments a redeclare is compared on (RabbitMQ's list), as sent.
    pub compared: FieldTable,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
}

impl DeclaredQueue {
    /// What to remember of a valid declare.
    pub fn new(declare: &queue::Declare, arguments: QueueArguments) -> DeclaredQueue {
        let mut compared = FieldTable::default();
        for (key, value) in &declare.arguments {
            if EQUIVALENCE_ARGUMENTS.contains(&key.as_str()) {
                compared.insert(key.clone(), value.clone());
            }
        }
        DeclaredQueue {
            arguments,
            compared,
            durable: declare.durable,
            exclusive: declare.exclusive,
            auto_delete: declare.auto_delete,
        }
    }

    /// The embedded broker's redeclare check, in its order: durable, exclusive, auto-delete,
    /// then the x-arguments ([`check_equivalent`]). `Err` holds the reply text after
    /// `PRECONDITION_FAILED - `.
    pub fn check_redeclare(&self, declare: &queue::Declare, vhost: &str) -> Result<(), String> {
        let name = declare.queue.as_str();
        let flags = [
            ("durable", declare.durable, self.durable),
            ("exclusive", declare.exclusive, self.exclusive),
            ("auto_delete", declare.auto_delete, self.auto_delete),
        ];
        if let Some((flag, received, current)) = flags.into_iter().find(|(_, r, c)| r != c) {
            return Err(format!(
                "inequivalent arg '{flag}' for queue '{name}' in vhost '{vhost}': received '{received}' but current is '{current}'"
            ));
        }
        check_equivalent(&self.compared, &declare.arguments, name, vhost)
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
    /// Whether the proxy emulates the delivery limit (classic queues) rather than leaving it to
    /// the upstream (quorum queues count deliveries natively).
    pub proxy_delivery_limit: bool,
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
    let mut upstream = FieldTable::default();
    for (key, value) in client {
        if matches!(
            key.as_str(),
            ARG_DEAD_LETTER_EXCHANGE
                | ARG_DEAD_LETTER_ROUTING_KEY
                | ARG_DEAD_LETTER_STRATEGY
                | ARG_DELIVERY_LIMIT
                | ARG_MESSAGE_TTL
                | ARG_EXPIRES
                | ARG_MAX_LENGTH
                | ARG_MAX_LENGTH_BYTES
                | ARG_OVERFLOW
        ) {
            continue;
        }
        upstream.insert(key.clone(), value.clone());
    }
    put_number(
        &mut upstream,
        client,
        ARG_MESSAGE_TTL,
        effective.message_ttl,
    );
    put_number(&mut upstream, client, ARG_EXPIRES, effective.expires);
    put_number(&mut upstream, client, ARG_MAX_LENGTH, effective.max_length);
    put_number(
        &mut upstream,
        client,
        ARG_MAX_LENGTH_BYTES,
        effective.max_length_bytes,
    );
    if parsed.overflow.is_some() || policy.is_some_and(|p| p.overflow.is_some()) {
        put_text(&mut upstream, ARG_OVERFLOW, effective.overflow.as_str());
    }
    let quorum = parsed.queue_type == QueueType::Quorum;
    if quorum {
        put_number(
            &mut upstream,
            client,
            ARG_DELIVERY_LIMIT,
            effective.delivery_limit,
        );
    }
    match handling {
        DeadLetterHandling::Capture { exchange } => {
            put_text(&mut upstream, ARG_DEAD_LETTER_EXCHANGE, exchange);
            if let Some(tag) = CaptureTag::from_arguments(&parsed).and_then(|t| t.encode()) {
                put_text(&mut upstream, ARG_DEAD_LETTER_ROUTING_KEY, &tag);
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
        proxy_delivery_limit,
    })
}

/// Sets a numeric argument, keeping the client's own value (and type) when it is the effective
/// one, so redeclares stay equivalent.
fn put_number(upstream: &mut FieldTable, client: &FieldTable, key: &str, value: Option<u64>) {
    let Some(value) = value else {
        return;
    };
    if let Some(original) = client.inner().get(key)
        && amqp_integer(original) == i64::try_from(value).ok()
    {
        upstream.insert(ShortString::from(key), original.clone());
        return;
    }
    let number = i64::try_from(value).unwrap_or(i64::MAX);
    upstream.insert(ShortString::from(key), AMQPValue::LongLongInt(number));
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
    fn policy_limits_reach_the_upstream_and_the_lower_wins() {
        let policy = PolicyDefinition {
            dead_letter_exchange: Some("pdlx".into()),
            message_ttl: Some(500),
            max_length: Some(10),
            overflow: Some(Overflow::RejectPublishDlx),
            ..PolicyDefinition::default()
        };
        let client = args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(1000))]);
        let rewrite = rewrite_declare(&client, Some(&policy), None, &capture()).unwrap();
        let up = rewrite.upstream_arguments.inner();
        assert_eq!(up.get(ARG_MESSAGE_TTL), Some(&AMQPValue::LongLongInt(500)));
        assert_eq!(up.get(ARG_MAX_LENGTH), Some(&AMQPValue::LongLongInt(10)));
        assert_eq!(up.get(ARG_OVERFLOW), Some(&text("reject-publish-dlx")));
        // No client dead-letter arguments: no tag, the policy is read when a message dies.
        assert!(up.get(ARG_DEAD_LETTER_ROUTING_KEY).is_none());
        assert_eq!(
            rewrite.effective.dead_letter_exchange.as_deref(),
            Some("pdlx")
        );
    }

    #[test]
    fn delivery_limit_is_emulated_on_classic_and_native_on_quorum() {
        let client = args(&[(ARG_DELIVERY_LIMIT, AMQPValue::LongInt(2))]);
        let rewrite = rewrite_declare(&client, None, None, &capture()).unwrap();
        assert!(rewrite.proxy_delivery_limit);
        assert!(
            rewrite
                .upstream_arguments
                .inner()
                .get(ARG_DELIVERY_LIMIT)
                .is_none()
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
        let rewrite = rewrite_declare(&FieldTable::default(), None, Some(3), &capture()).unwrap();
        assert!(rewrite.proxy_delivery_limit);
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
    fn invalid_arguments_are_refused_like_the_broker() {
        let client = args(&[(ARG_DEAD_LETTER_ROUTING_KEY, text("k"))]);
        let err = rewrite_declare(&client, None, None, &capture()).unwrap_err();
        assert_eq!(err.reply_code(), 406);
        assert!(
            err.reply_text("q", "/")
                .contains("routing_key_but_no_dlx_defined")
        );
    }

    fn declare_of(name: &str, arguments: FieldTable) -> queue::Declare {
        queue::Declare {
            queue: ShortString::from(name),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }
    }

    fn declared(arguments: FieldTable) -> DeclaredQueue {
        let declare = declare_of("src", arguments);
        let parsed = parse_queue_arguments(&declare.arguments).unwrap();
        DeclaredQueue::new(&declare, parsed)
    }

    #[test]
    fn a_declared_queue_keeps_only_the_compared_arguments_as_sent() {
        let queue = declared(args(&[
            (ARG_DEAD_LETTER_EXCHANGE, text("dlx")),
            (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
            ("x-single-active-consumer", AMQPValue::Boolean(true)),
            ("x-custom", text("v")),
        ]));
        assert_eq!(
            queue.compared,
            args(&[
                (ARG_DEAD_LETTER_EXCHANGE, text("dlx")),
                (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
            ])
        );
        assert_eq!(queue.arguments.message_ttl, Some(1000));
        assert!(queue.durable && !queue.exclusive && !queue.auto_delete);
    }

    #[test]
    fn redeclares_are_compared_like_the_embedded_broker() {
        let original = args(&[
            (ARG_DEAD_LETTER_EXCHANGE, text("dlxA")),
            (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
        ]);
        let queue = declared(original.clone());
        let check =
            |arguments: FieldTable| queue.check_redeclare(&declare_of("src", arguments), "/");
        assert_eq!(check(original.clone()), Ok(()));
        // An int64 TTL equals an int32 one; arguments RabbitMQ does not compare are ignored.
        assert_eq!(
            check(args(&[
                (ARG_DEAD_LETTER_EXCHANGE, text("dlxA")),
                (ARG_MESSAGE_TTL, AMQPValue::LongLongInt(1000)),
                ("x-custom", text("v")),
            ])),
            Ok(())
        );
        assert_eq!(
            check(args(&[
                (ARG_DEAD_LETTER_EXCHANGE, text("dlxB")),
                (ARG_MESSAGE_TTL, AMQPValue::LongInt(1000)),
            ])),
            Err("inequivalent arg 'x-dead-letter-exchange' for queue 'src' in vhost '/': received 'dlxB' but current is 'dlxA'".into())
        );
        assert_eq!(
            check(args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(1000))])),
            Err("inequivalent arg 'x-dead-letter-exchange' for queue 'src' in vhost '/': received none but current is the value 'dlxA' of type 'longstr'".into())
        );
        assert_eq!(
            check(FieldTable::default()),
            Err("inequivalent arg 'x-message-ttl' for queue 'src' in vhost '/': received none but current is the value '1000' of type 'signedint'".into())
        );
        let mut with_key = original.clone();
        with_key.insert(ARG_DEAD_LETTER_ROUTING_KEY.into(), text("k"));
        assert_eq!(
            check(with_key),
            Err("inequivalent arg 'x-dead-letter-routing-key' for queue 'src' in vhost '/': received the value 'k' of type 'longstr' but current is none".into())
        );
        assert_eq!(
            check(args(&[
                (ARG_DEAD_LETTER_EXCHANGE, text("dlxA")),
                (ARG_MESSAGE_TTL, AMQPValue::LongInt(2000)),
            ])),
            Err("inequivalent arg 'x-message-ttl' for queue 'src' in vhost '/': received '2000' but current is '1000'".into())
        );
    }

    #[test]
    fn redeclares_compare_the_flags_first() {
        let queue = declared(args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(1000))]));
        let mut declare = declare_of("src", FieldTable::default());
        declare.durable = false;
        assert_eq!(
            queue.check_redeclare(&declare, "v"),
            Err("inequivalent arg 'durable' for queue 'src' in vhost 'v': received 'false' but current is 'true'".into())
        );
        let mut declare = declare_of("src", args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(1000))]));
        declare.auto_delete = true;
        assert_eq!(
            queue.check_redeclare(&declare, "v"),
            Err("inequivalent arg 'auto_delete' for queue 'src' in vhost 'v': received 'true' but current is 'false'".into())
        );
    }

    #[test]
    fn long_tags_do_not_fit() {
        let tag = CaptureTag {
            dead_letter_exchange: Some("x".repeat(250)),
            dead_letter_routing_key: None,
        };
        assert!(tag.encode().is_none());
        let short = CaptureTag {
            dead_letter_exchange: Some(String::new()),
            dead_letter_routing_key: Some("q\"1".into()),
        };
        assert_eq!(CaptureTag::decode(&short.encode().unwrap()), Some(short));
        assert_eq!(CaptureTag::decode("plain-key"), None);
    }
}
