//! Unit tests of [`crate::proxy::arbiter`].

use super::*;
use crate::policy::PolicyDefinition;
use crate::proxy::declare::{DeadLetterHandling, rewrite_declare};
use crate::rabbit::args::{ARG_MESSAGE_TTL, ARG_RETRY_DELAYS, delays_value};

const CAPTURE: &str = "dlx-proxy.capture";

fn args(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

fn ls(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn declare(arguments: FieldTable) -> queue::Declare {
    queue::Declare {
        queue: ShortString::from("q"),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments,
    }
}

fn check_with(client: FieldTable, policy: Option<&PolicyDefinition>) -> DeclareCheck {
    let handling = DeadLetterHandling::Capture {
        exchange: CAPTURE.into(),
    };
    let rewrite = rewrite_declare(&client, policy, None, &handling).unwrap();
    DeclareCheck::new(&declare(client), "/", &rewrite, CAPTURE)
}

fn check(client: FieldTable) -> DeclareCheck {
    check_with(client, None)
}

fn tag(arguments: FieldTable) -> String {
    let parsed = crate::rabbit::args::parse_queue_arguments(&arguments).unwrap();
    CaptureTag::from_arguments(&parsed)
        .unwrap()
        .encode()
        .unwrap()
}

/// RabbitMQ's refusal of `received` against `current` (its own check).
fn rabbit(current: &FieldTable, received: &FieldTable) -> String {
    format!(
        "PRECONDITION_FAILED - {}",
        check_equivalent(current, received, "q", "/").unwrap_err()
    )
}

fn refused(next: Next) -> String {
    match next {
        Next::Done(Verdict::Refused { code: 406, text }) => text,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn reads_rabbitmq_refusals() {
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'a' in vhost '/': received 'it's' but current is 'b'";
    let found = parse_inequivalent(text, "a", "/").unwrap();
    assert_eq!(found.argument, "x-dead-letter-routing-key");
    assert_eq!(
        current_value(found.comparison, Some(&text_value("it's"))),
        Some(Shown::Value("b".into()))
    );
    assert_eq!(parse_inequivalent(text, "other", "/"), None);
    // Received present, current none (RabbitMQ's presence form).
    assert_eq!(
        current_value(
            "the value 'cap' of type 'longstr' but current is none",
            Some(&text_value("cap"))
        ),
        Some(Shown::Absent)
    );
    // Received none.
    assert_eq!(
        current_value(
            "none but current is the value '1000' of type 'signedint'",
            None
        ),
        Some(Shown::Value("1000".into()))
    );
    // Cut at 255 bytes by RabbitMQ.
    assert_eq!(
        current_value("'a' but current is 'bbbbbb...", Some(&text_value("a"))),
        None
    );
}

fn text_value(s: &str) -> AMQPValue {
    ls(s)
}

#[test]
fn a_match_is_verified_with_the_computed_arguments() {
    let client = args(&[(ARG_DEAD_LETTER_EXCHANGE, ls("dlx"))]);
    let mut check = check(client);
    let request = check.request();
    assert!(!request.passive && !request.nowait && request.durable);
    assert_eq!(
        request.arguments.inner().get(ARG_DEAD_LETTER_EXCHANGE),
        Some(&ls(CAPTURE))
    );
    assert_eq!(
        check.on_declare_ok(),
        Verdict::Verified(request.arguments.clone())
    );
}

#[test]
fn tag_refusals_are_given_in_the_clients_terms() {
    // The queue was declared with DLX dlxA (tag); the client declares without a DLX.
    let first = args(&[(ARG_DEAD_LETTER_EXCHANGE, ls("dlxA"))]);
    let stored = tag(first.clone());
    let mut check = check(FieldTable::default());
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received none but current is the value '{stored}' of type 'longstr'"
    );
    assert_eq!(
        refused(check.on_close(406, &text)),
        rabbit(&first, &FieldTable::default())
    );
    // Another DLX and a routing key: the exchange is named first, as RabbitMQ does.
    let other = args(&[
        (ARG_DEAD_LETTER_EXCHANGE, ls("dlxB")),
        (ARG_DEAD_LETTER_ROUTING_KEY, ls("k")),
    ]);
    let mut check = self::check(other.clone());
    let sent = tag(other.clone());
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received '{sent}' but current is '{stored}'"
    );
    let expected = rabbit(&first, &other);
    assert!(expected.contains("'x-dead-letter-exchange'"), "{expected}");
    assert_eq!(refused(check.on_close(406, &text)), expected);
    // Same DLX, a routing key added.
    let with_key = args(&[
        (ARG_DEAD_LETTER_EXCHANGE, ls("dlxA")),
        (ARG_DEAD_LETTER_ROUTING_KEY, ls("k")),
    ]);
    let mut check = self::check(with_key.clone());
    let sent = tag(with_key.clone());
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received '{sent}' but current is '{stored}'"
    );
    assert_eq!(
        refused(check.on_close(406, &text)),
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received the value 'k' of type 'longstr' but current is none"
    );
    // The client adds a DLX to a queue declared without one (no tag stored).
    let mut check = self::check(first.clone());
    let sent = tag(first.clone());
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received the value '{sent}' of type 'longstr' but current is none"
    );
    assert_eq!(
        refused(check.on_close(406, &text)),
        rabbit(&FieldTable::default(), &first)
    );
}

/// The check answers RabbitMQ's `refusal` of the tag by declaring again with the queue's own
/// tag `stored`.
fn repeated_with(check: &mut DeclareCheck, refusal: &str, stored: &str) {
    let Next::Declare(again) = check.on_close(406, refusal) else {
        panic!("not repeated");
    };
    assert_eq!(
        again.arguments.inner().get(ARG_DEAD_LETTER_ROUTING_KEY),
        Some(&ls(stored))
    );
}

#[test]
fn a_different_delivery_limit_is_refused_only_after_the_rest_is_compared() {
    let declared = args(&[(ARG_DELIVERY_LIMIT, AMQPValue::LongInt(2))]);
    let stored = tag(declared.clone());
    let client = args(&[(ARG_DELIVERY_LIMIT, AMQPValue::LongInt(3))]);
    let sent = tag(client.clone());
    let refusal = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received '{sent}' but current is '{stored}'"
    );
    // Nothing else differs: the limit's refusal.
    let mut check = check(client.clone());
    repeated_with(&mut check, &refusal, &stored);
    assert_eq!(
        check.on_declare_ok(),
        Verdict::Refused {
            code: 406,
            text: "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received '3' but current is '2'".into()
        }
    );
    // Something compared later differs too: that one is named, as RabbitMQ would.
    let mut check = self::check(client);
    check.on_close(406, &refusal);
    let later = "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received '5' but current is '6'";
    assert_eq!(refused(check.on_close(406, later)), later);
    // The same limit: verified with the queue's own tag.
    let mut check = self::check(declared.clone());
    assert_eq!(
        check.on_declare_ok(),
        Verdict::Verified(check.upstream_arguments().clone())
    );
}

#[test]
fn policy_values_take_the_queues_current_value() {
    let policy = PolicyDefinition {
        message_ttl: Some(500),
        ..PolicyDefinition::default()
    };
    let mut check = check_with(FieldTable::default(), Some(&policy));
    assert_eq!(
        check.request().arguments.inner().get(ARG_MESSAGE_TTL),
        Some(&AMQPValue::LongLongInt(500))
    );
    let Next::Declare(again) = check.on_close(
        406,
        "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '500' but current is '1000'",
    ) else {
        panic!("not repeated");
    };
    assert_eq!(
        again.arguments.inner().get(ARG_MESSAGE_TTL),
        Some(&AMQPValue::LongLongInt(1000))
    );
    // A queue without one: the argument is left out.
    let mut check = check_with(FieldTable::default(), Some(&policy));
    let Next::Declare(again) = check.on_close(
        406,
        "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '500' of type 'long' but current is none",
    ) else {
        panic!("not repeated");
    };
    assert!(again.arguments.inner().get(ARG_MESSAGE_TTL).is_none());
    // A lower policy value replaces the client's: the queue's value is taken too.
    let mut check = check_with(
        args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(2000))]),
        Some(&policy),
    );
    let Next::Declare(again) = check.on_close(
        406,
        "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '500' but current is '1000'",
    ) else {
        panic!("not repeated");
    };
    assert_eq!(
        again.arguments.inner().get(ARG_MESSAGE_TTL),
        Some(&AMQPValue::LongLongInt(1000))
    );
    // A value the client sent itself (lower than the policy's) is RabbitMQ's to judge.
    let mut check = check_with(
        args(&[(ARG_MESSAGE_TTL, AMQPValue::LongInt(200))]),
        Some(&policy),
    );
    assert_eq!(
        check.request().arguments.inner().get(ARG_MESSAGE_TTL),
        Some(&AMQPValue::LongInt(200))
    );
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '200' but current is '1000'";
    assert_eq!(refused(check.on_close(406, text)), text);
}

#[test]
fn the_check_is_bounded() {
    let policy = PolicyDefinition {
        message_ttl: Some(500),
        ..PolicyDefinition::default()
    };
    let mut check = check_with(FieldTable::default(), Some(&policy));
    let refusal = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '500' but current is '500'";
    let mut rounds = 1;
    loop {
        match check.on_close(406, refusal) {
            Next::Declare(_) => rounds += 1,
            Next::Done(verdict) => {
                assert_eq!(verdict, Verdict::Undecided);
                break;
            }
        }
        assert!(rounds <= MAX_ROUNDS);
    }
    assert_eq!(rounds, MAX_ROUNDS);
}

#[test]
fn queues_not_declared_through_a_proxy_are_upstream_owned() {
    let mut check = check(args(&[(ARG_DEAD_LETTER_EXCHANGE, ls("dlx"))]));
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received the value '{CAPTURE}' of type 'longstr' but current is none"
    );
    assert_eq!(
        check.on_close(406, &text),
        Next::Done(Verdict::UpstreamOwned)
    );
    let mut check = self::check(FieldTable::default());
    let text = format!(
        "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received '{CAPTURE}' but current is 'own-dlx'"
    );
    assert_eq!(
        check.on_close(406, &text),
        Next::Done(Verdict::UpstreamOwned)
    );
}

#[test]
fn flags_and_other_refusals_pass_through() {
    let mut check = check(FieldTable::default());
    let text = "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'";
    assert_eq!(refused(check.on_close(406, text)), text);
    let mut check = self::check(FieldTable::default());
    assert_eq!(
        check.on_close(
            405,
            "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'q' in vhost '/'"
        ),
        Next::Done(Verdict::Undecided)
    );
}

#[test]
fn other_retry_tiers_are_refused_after_the_rest_is_compared() {
    let delays = |ms: &[u64]| args(&[(ARG_RETRY_DELAYS, delays_value(ms))]);
    let stored = tag(delays(&[300]));
    for (client, received) in [
        (delays(&[300, 600]), "'[{long,300},{long,600}]'"),
        (FieldTable::default(), "none"),
    ] {
        let sent = match CaptureTag::from_arguments(
            &crate::rabbit::args::parse_queue_arguments(&client).unwrap(),
        ) {
            Some(tag) => format!("'{}'", tag.encode().unwrap()),
            None => "none".into(),
        };
        let refusal = format!(
            "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received {sent} but current is '{stored}'"
        );
        let mut check = check(client);
        repeated_with(&mut check, &refusal, &stored);
        assert_eq!(
            check.on_declare_ok(),
            Verdict::Refused {
                code: 406,
                text: format!(
                    "PRECONDITION_FAILED - inequivalent arg 'x-retry-delays' for queue 'q' in vhost '/': received {received} but current is '[{{long,300}}]'"
                )
            }
        );
    }
    // The same tiers: verified.
    let mut check = check(delays(&[300]));
    assert_eq!(
        check.on_declare_ok(),
        Verdict::Verified(check.upstream_arguments().clone())
    );
}
