//! Unit tests of [`crate::rabbit::args`].

use super::*;
use amq_protocol::types::{DecimalValue, FieldArray, LongString, ShortString};

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

fn s(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text))
}

/// The embedded broker's declare check: the parse, then the queue type's arguments.
fn err_text(entries: &[(&str, AMQPValue)]) -> String {
    let args = table(entries);
    parse_queue_arguments(&args)
        .and_then(|parsed| check_queue_type_arguments(&args, parsed.queue_type))
        .unwrap_err()
        .reply_text("q", "/")
}

/// Arguments no queue type knows, and ones the queue's own type takes, are accepted (RabbitMQ
/// 3.10.8 accepted these); so is this service's `x-delivery-limit` on a classic queue.
#[test]
fn arguments_of_the_queues_own_type_or_of_none_are_accepted() {
    for entries in [
        vec![("x-ha-policy", s("all")), ("x-queue-mode", s("lazy"))],
        vec![("x-queue-master-locator", s("client-local"))],
        vec![("x-delivery-limit", AMQPValue::LongInt(3))],
        vec![
            ("x-queue-type", s("quorum")),
            ("x-max-in-memory-length", AMQPValue::LongInt(5)),
            ("x-quorum-initial-group-size", AMQPValue::LongInt(3)),
            ("x-queue-leader-locator", s("client-local")),
        ],
    ] {
        let args = table(&entries);
        let parsed = parse_queue_arguments(&args).expect("parsed");
        assert_eq!(
            check_queue_type_arguments(&args, parsed.queue_type),
            Ok(()),
            "{entries:?}"
        );
    }
}

#[test]
fn empty_arguments_are_classic_with_nothing_set() {
    let parsed = parse_queue_arguments(&FieldTable::default()).unwrap();
    assert_eq!(parsed, QueueArguments::default());
    assert_eq!(parsed.queue_type, QueueType::Classic);
}

#[test]
fn full_set_of_arguments_is_parsed() {
    let parsed = parse_queue_arguments(&table(&[
        ("x-dead-letter-exchange", s("dlx")),
        ("x-dead-letter-routing-key", s("dlk")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
        ("x-expires", AMQPValue::LongLongInt(60_000)),
        ("x-max-length", AMQPValue::ShortInt(10)),
        ("x-max-length-bytes", AMQPValue::LongUInt(4096)),
        ("x-overflow", s("reject-publish-dlx")),
        ("x-delivery-limit", AMQPValue::ShortShortUInt(3)),
        ("x-consumer-timeout", AMQPValue::LongLongInt(30_000)),
        ("x-single-active-consumer", AMQPValue::Boolean(true)),
        (
            "x-retry-delays",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongInt(1000),
                AMQPValue::LongLongInt(60_000),
            ])),
        ),
        ("x-queue-type", s("classic")),
    ]))
    .unwrap();
    assert_eq!(
        parsed,
        QueueArguments {
            queue_type: QueueType::Classic,
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: Some("dlk".into()),
            dead_letter_strategy: None,
            message_ttl: Some(1000),
            expires: Some(60_000),
            max_length: Some(10),
            max_length_bytes: Some(4096),
            overflow: Some(Overflow::RejectPublishDlx),
            delivery_limit: Some(3),
            consumer_timeout: Some(30_000),
            retry_delays: Some(vec![1000, 60_000]),
            single_active_consumer: true,
        }
    );
}

#[test]
fn every_integer_width_is_accepted() {
    let values = [
        AMQPValue::ShortShortInt(7),
        AMQPValue::ShortShortUInt(7),
        AMQPValue::ShortInt(7),
        AMQPValue::ShortUInt(7),
        AMQPValue::LongInt(7),
        AMQPValue::LongUInt(7),
        AMQPValue::LongLongInt(7),
    ];
    for v in values {
        let parsed = parse_queue_arguments(&table(&[("x-message-ttl", v.clone())])).unwrap();
        assert_eq!(parsed.message_ttl, Some(7), "{v:?}");
    }
}

#[test]
fn message_ttl_bounds() {
    let ok = |n: i64| {
        parse_queue_arguments(&table(&[("x-message-ttl", AMQPValue::LongLongInt(n))]))
            .map(|a| a.message_ttl)
    };
    assert_eq!(ok(0), Ok(Some(0)));
    assert_eq!(ok(1 << 32), Ok(Some(1 << 32)));
    assert_eq!(ok(315_360_000_000), Ok(Some(315_360_000_000)));
    assert_eq!(
        err_text(&[("x-message-ttl", AMQPValue::LongLongInt(315_360_000_001))]),
        "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_too_big,315360000001}"
    );
    assert_eq!(
        err_text(&[("x-message-ttl", AMQPValue::LongInt(-1))]),
        "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}"
    );
}

#[test]
fn reference_texts_for_invalid_arguments() {
    // Texts recorded from RabbitMQ 3.10.8 (conformance scenario declare_invalid_arguments).
    let cases: Vec<(Vec<(&str, AMQPValue)>, &str)> = vec![
        (
            vec![("x-message-ttl", s("1000"))],
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': \"expected integer, got longstr\"",
        ),
        (
            vec![("x-message-ttl", AMQPValue::LongInt(-1))],
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}",
        ),
        (
            vec![(
                "x-message-ttl",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 1,
                    value: 15,
                }),
            )],
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': \"expected integer, got decimal\"",
        ),
        (
            vec![("x-max-length", AMQPValue::LongInt(-1))],
            "invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}",
        ),
        (
            vec![("x-max-length", s("10"))],
            "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got longstr\"",
        ),
        (
            vec![("x-max-length-bytes", AMQPValue::LongInt(-1))],
            "invalid arg 'x-max-length-bytes' for queue 'q' in vhost '/': {value_negative,-1}",
        ),
        (
            vec![("x-overflow", s("bogus"))],
            "invalid arg 'x-overflow' for queue 'q' in vhost '/': invalid_overflow",
        ),
        (
            vec![("x-overflow", AMQPValue::LongInt(1))],
            "invalid arg 'x-overflow' for queue 'q' in vhost '/': {unacceptable_type,signedint}",
        ),
        (
            vec![("x-expires", AMQPValue::LongInt(0))],
            "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_zero,0}",
        ),
        (
            vec![("x-expires", AMQPValue::LongInt(-5))],
            "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_negative,-5}",
        ),
        (
            vec![("x-dead-letter-exchange", AMQPValue::LongInt(42))],
            "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'q' in vhost '/'",
        ),
        (
            vec![("x-dead-letter-routing-key", s("k"))],
            "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': routing_key_but_no_dlx_defined",
        ),
        (
            vec![
                ("x-dead-letter-exchange", s("dlx")),
                ("x-dead-letter-routing-key", AMQPValue::LongInt(42)),
            ],
            "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': {unacceptable_type,signedint}",
        ),
        (
            vec![("x-queue-type", s("bogus"))],
            "invalid arg 'x-queue-type' for queue 'q' in vhost '/': \"unsupported queue type 'bogus'\"",
        ),
        (
            vec![("x-dead-letter-strategy", s("at-least-once"))],
            "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/' of queue type rabbit_classic_queue",
        ),
        (
            vec![
                ("x-queue-type", s("quorum")),
                ("x-dead-letter-strategy", s("exactly-once")),
            ],
            "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': invalid_dlx_strategy",
        ),
        (
            vec![
                ("x-queue-type", s("quorum")),
                ("x-dead-letter-strategy", AMQPValue::Boolean(true)),
            ],
            "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': {unacceptable_type,bool}",
        ),
        // RabbitMQ 3.10.8's answers for an argument of another queue type.
        (
            vec![
                ("x-queue-type", s("quorum")),
                ("x-max-priority", AMQPValue::LongInt(3)),
            ],
            "invalid arg 'x-max-priority' for queue 'q' in vhost '/' of queue type rabbit_quorum_queue",
        ),
        (
            vec![("x-queue-type", s("quorum")), ("x-queue-mode", s("lazy"))],
            "invalid arg 'x-queue-mode' for queue 'q' in vhost '/' of queue type rabbit_quorum_queue",
        ),
        (
            vec![("x-queue-type", s("quorum")), ("x-max-age", s("1D"))],
            "invalid arg 'x-max-age' for queue 'q' in vhost '/' of queue type rabbit_quorum_queue",
        ),
        (
            vec![("x-max-in-memory-length", AMQPValue::LongInt(5))],
            "invalid arg 'x-max-in-memory-length' for queue 'q' in vhost '/' of queue type rabbit_classic_queue",
        ),
        (
            vec![("x-queue-leader-locator", s("client-local"))],
            "invalid arg 'x-queue-leader-locator' for queue 'q' in vhost '/' of queue type rabbit_classic_queue",
        ),
        (
            vec![("x-queue-type", AMQPValue::LongInt(1))],
            "invalid arg 'x-queue-type' for queue 'q' in vhost '/': {unacceptable_type,signedint}",
        ),
        (
            vec![("x-max-length", AMQPValue::Double(1.5))],
            "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got double\"",
        ),
        (
            vec![("x-expires", AMQPValue::Float(1.5))],
            "invalid arg 'x-expires' for queue 'q' in vhost '/': \"expected integer, got float\"",
        ),
        (
            vec![("x-message-ttl", AMQPValue::Timestamp(5))],
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': \"expected integer, got timestamp\"",
        ),
        (
            vec![("x-delivery-limit", AMQPValue::LongInt(-1))],
            "invalid arg 'x-delivery-limit' for queue 'q' in vhost '/': {value_negative,-1}",
        ),
        (
            vec![("x-consumer-timeout", AMQPValue::LongInt(-5))],
            "invalid arg 'x-consumer-timeout' for queue 'q' in vhost '/': {value_negative,-5}",
        ),
        (
            vec![("x-consumer-timeout", s("1000"))],
            "invalid arg 'x-consumer-timeout' for queue 'q' in vhost '/': \"expected integer, got longstr\"",
        ),
    ];
    for (args, expected) in cases {
        assert_eq!(
            err_text(&args),
            format!("PRECONDITION_FAILED - {expected}"),
            "{args:?}"
        );
    }
}

#[test]
fn accepted_edge_values() {
    // From the same recording: these declares succeed.
    let dlx_default = parse_queue_arguments(&table(&[("x-dead-letter-exchange", s(""))])).unwrap();
    assert_eq!(dlx_default.dead_letter_exchange.as_deref(), Some(""));
    let zero_len =
        parse_queue_arguments(&table(&[("x-max-length", AMQPValue::LongInt(0))])).unwrap();
    assert_eq!(zero_len.max_length, Some(0));
    let zero_bytes =
        parse_queue_arguments(&table(&[("x-max-length-bytes", AMQPValue::LongInt(0))])).unwrap();
    assert_eq!(zero_bytes.max_length_bytes, Some(0));
    let limit_on_classic =
        parse_queue_arguments(&table(&[("x-delivery-limit", AMQPValue::LongInt(5))])).unwrap();
    assert_eq!(limit_on_classic.delivery_limit, Some(5));
    let expires_one =
        parse_queue_arguments(&table(&[("x-expires", AMQPValue::LongInt(1))])).unwrap();
    assert_eq!(expires_one.expires, Some(1));
}

#[test]
fn stream_queues_are_refused_with_a_clear_detail() {
    assert_eq!(
        err_text(&[("x-queue-type", s("stream"))]),
        "PRECONDITION_FAILED - invalid arg 'x-queue-type' for queue 'q' in vhost '/': \"stream queues are not supported\""
    );
}

#[test]
fn quorum_queue_with_strategy() {
    let parsed = parse_queue_arguments(&table(&[
        ("x-queue-type", s("quorum")),
        ("x-dead-letter-exchange", s("dlx")),
        ("x-dead-letter-strategy", s("at-least-once")),
        ("x-overflow", s("reject-publish")),
    ]))
    .unwrap();
    assert_eq!(parsed.queue_type, QueueType::Quorum);
    assert_eq!(
        parsed.dead_letter_strategy,
        Some(DeadLetterStrategy::AtLeastOnce)
    );
    assert_eq!(parsed.overflow, Some(Overflow::RejectPublish));
    // RabbitMQ accepts a strategy without a DLX on quorum queues (with a warning).
    let no_dlx = parse_queue_arguments(&table(&[
        ("x-queue-type", s("quorum")),
        ("x-dead-letter-strategy", s("at-most-once")),
    ]))
    .unwrap();
    assert_eq!(
        no_dlx.dead_letter_strategy,
        Some(DeadLetterStrategy::AtMostOnce)
    );
}

#[test]
fn classic_strategy_error_comes_after_value_errors() {
    // RabbitMQ validates values before refusing arguments of another queue type.
    let err = parse_queue_arguments(&table(&[
        ("x-dead-letter-strategy", s("at-least-once")),
        ("x-message-ttl", AMQPValue::LongInt(-1)),
    ]))
    .unwrap_err();
    assert_eq!(err.argument, "x-message-ttl");
}

#[test]
fn dlx_type_is_checked_before_everything_else() {
    let err = parse_queue_arguments(&table(&[
        ("x-dead-letter-exchange", AMQPValue::LongInt(1)),
        ("x-queue-type", s("bogus")),
        ("x-message-ttl", AMQPValue::LongInt(-1)),
    ]))
    .unwrap_err();
    assert_eq!(err.kind, ArgumentErrorKind::InvalidType);
    assert_eq!(err.argument, "x-dead-letter-exchange");
    assert_eq!(err.detail, "signedint");
}

#[test]
fn unknown_arguments_are_ignored() {
    let parsed = parse_queue_arguments(&table(&[
        ("x-something-else", AMQPValue::Boolean(true)),
        ("x-max-priority", AMQPValue::LongInt(10)),
        ("plain", s("x")),
    ]))
    .unwrap();
    assert_eq!(parsed, QueueArguments::default());
}

#[test]
fn display_names_the_argument() {
    let err =
        parse_queue_arguments(&table(&[("x-message-ttl", AMQPValue::LongInt(-1))])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid arg 'x-message-ttl': {value_negative,-1}"
    );
    assert_eq!(err.reply_code(), 406);
}

#[test]
fn overflow_and_strategy_round_trip() {
    for o in [
        Overflow::DropHead,
        Overflow::RejectPublish,
        Overflow::RejectPublishDlx,
    ] {
        assert_eq!(o.as_str().parse::<Overflow>(), Ok(o));
    }
    assert!("drop-tail".parse::<Overflow>().is_err());
    for d in [
        DeadLetterStrategy::AtMostOnce,
        DeadLetterStrategy::AtLeastOnce,
    ] {
        assert_eq!(d.as_str().parse::<DeadLetterStrategy>(), Ok(d));
    }
    assert!("exactly-once".parse::<DeadLetterStrategy>().is_err());
    assert_eq!(Overflow::default(), Overflow::DropHead);
}

#[test]
fn expiration_parsing() {
    assert_eq!(parse_expiration("0"), Ok(0));
    assert_eq!(parse_expiration("60000"), Ok(60_000));
    assert_eq!(parse_expiration("4294967296"), Ok(4_294_967_296));
    assert_eq!(parse_expiration("315360000000"), Ok(315_360_000_000));
    assert_eq!(parse_expiration("007"), Ok(7));
    // Erlang's string:to_integer takes a sign.
    assert_eq!(parse_expiration("+5"), Ok(5));
    assert_eq!(parse_expiration("-0"), Ok(0));
    let detail = |e: &str| parse_expiration(e).unwrap_err().detail;
    assert_eq!(detail(""), "no_integer");
    assert_eq!(detail(" 5"), "no_integer");
    assert_eq!(detail("+"), "no_integer");
    assert_eq!(detail("abc"), "no_integer");
    assert_eq!(detail("5 "), "{leftover_string,\" \"}");
    assert_eq!(detail("1.5"), "{leftover_string,\".5\"}");
    assert_eq!(detail("-5"), "{value_negative,-5}");
    assert_eq!(detail("315360000001"), "{value_too_big,315360000001}");
    assert_eq!(
        detail("99999999999999999999999"),
        "{value_too_big,99999999999999999999999}"
    );
    assert_eq!(
        parse_expiration("5 ").unwrap_err().reply_text(),
        "PRECONDITION_FAILED - invalid expiration '5 ': {leftover_string,\" \"}"
    );
}

#[test]
fn equivalence_accepts_same_arguments_and_integer_widths() {
    let existing = table(&[
        ("x-dead-letter-exchange", s("dlx")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
    ]);
    assert_eq!(check_equivalent(&existing, &existing, "q", "/"), Ok(()));
    let wider = table(&[
        ("x-dead-letter-exchange", s("dlx")),
        ("x-message-ttl", AMQPValue::LongLongInt(1000)),
    ]);
    assert_eq!(check_equivalent(&existing, &wider, "q", "/"), Ok(()));
    let unsigned = table(&[
        ("x-dead-letter-exchange", s("dlx")),
        ("x-message-ttl", AMQPValue::ShortUInt(1000)),
        ("x-unrelated", AMQPValue::Boolean(true)),
    ]);
    assert_eq!(check_equivalent(&existing, &unsigned, "q", "/"), Ok(()));
}

#[test]
fn equivalence_reference_texts() {
    // Texts recorded from RabbitMQ 3.10.8 (conformance scenario redeclare_different_dlx).
    let current = table(&[
        ("x-dead-letter-exchange", s("dlxA")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
    ]);
    let check =
        |requested: FieldTable| check_equivalent(&current, &requested, "src", "/").unwrap_err();
    assert_eq!(
        check(table(&[
            ("x-dead-letter-exchange", s("dlxB")),
            ("x-message-ttl", AMQPValue::LongInt(1000)),
        ])),
        "inequivalent arg 'x-dead-letter-exchange' for queue 'src' in vhost '/': received 'dlxB' but current is 'dlxA'"
    );
    assert_eq!(
        check(table(&[("x-message-ttl", AMQPValue::LongInt(1000))])),
        "inequivalent arg 'x-dead-letter-exchange' for queue 'src' in vhost '/': received none but current is the value 'dlxA' of type 'longstr'"
    );
    assert_eq!(
        check(FieldTable::default()),
        "inequivalent arg 'x-message-ttl' for queue 'src' in vhost '/': received none but current is the value '1000' of type 'signedint'"
    );
    assert_eq!(
        check(table(&[
            ("x-dead-letter-exchange", s("dlxA")),
            ("x-dead-letter-routing-key", s("k")),
            ("x-message-ttl", AMQPValue::LongInt(1000)),
        ])),
        "inequivalent arg 'x-dead-letter-routing-key' for queue 'src' in vhost '/': received the value 'k' of type 'longstr' but current is none"
    );
    assert_eq!(
        check(table(&[
            ("x-dead-letter-exchange", s("dlxA")),
            ("x-message-ttl", AMQPValue::LongInt(2000)),
        ])),
        "inequivalent arg 'x-message-ttl' for queue 'src' in vhost '/': received '2000' but current is '1000'"
    );
}

#[test]
fn equivalence_different_type_classes_differ() {
    let current = table(&[("x-max-length", AMQPValue::LongInt(5))]);
    let requested = table(&[("x-max-length", s("5"))]);
    assert_eq!(
        check_equivalent(&current, &requested, "q", "v").unwrap_err(),
        "inequivalent arg 'x-max-length' for queue 'q' in vhost 'v': received '5' but current is '5'"
    );
    let float_current = table(&[("x-max-priority", AMQPValue::Float(1.5))]);
    let double_requested = table(&[("x-max-priority", AMQPValue::Double(1.5))]);
    assert_eq!(
        check_equivalent(&float_current, &double_requested, "q", "/"),
        Ok(())
    );
    let double_other = table(&[("x-max-priority", AMQPValue::Double(2.0))]);
    assert_eq!(
        check_equivalent(&float_current, &double_other, "q", "/").unwrap_err(),
        "inequivalent arg 'x-max-priority' for queue 'q' in vhost '/': received '2.0' but current is '1.5'"
    );
}

#[test]
fn equivalence_covers_every_listed_argument() {
    for (queue_type, keys) in [
        ("classic", &CLASSIC_EQUIVALENCE_ARGUMENTS[..]),
        ("quorum", &QUORUM_EQUIVALENCE_ARGUMENTS[..]),
    ] {
        for &key in keys {
            if key == ARG_QUEUE_TYPE {
                continue;
            }
            let current = table(&[
                (key, AMQPValue::LongInt(1)),
                ("x-queue-type", s(queue_type)),
            ]);
            let requested = table(&[("x-queue-type", s(queue_type))]);
            let err = check_equivalent(&current, &requested, "q", "/").unwrap_err();
            assert!(
                err.starts_with(&format!("inequivalent arg '{key}'")),
                "{err}"
            );
        }
    }
}

/// The texts RabbitMQ 3.10.8 answered for these redeclares.
#[test]
fn equivalence_compares_single_active_consumer_and_the_queue_mode() {
    let on = table(&[("x-single-active-consumer", AMQPValue::Boolean(true))]);
    let off = table(&[("x-single-active-consumer", AMQPValue::Boolean(false))]);
    let none = FieldTable::default();
    assert_eq!(
        check_equivalent(&on, &off, "s1", "/").unwrap_err(),
        "inequivalent arg 'x-single-active-consumer' for queue 's1' in vhost '/': received 'false' but current is 'true'"
    );
    assert_eq!(
        check_equivalent(&on, &none, "s2", "/").unwrap_err(),
        "inequivalent arg 'x-single-active-consumer' for queue 's2' in vhost '/': received none but current is the value 'true' of type 'bool'"
    );
    assert_eq!(
        check_equivalent(&none, &off, "s3", "/").unwrap_err(),
        "inequivalent arg 'x-single-active-consumer' for queue 's3' in vhost '/': received the value 'false' of type 'bool' but current is none"
    );
    let lazy = table(&[("x-queue-mode", s("lazy"))]);
    assert_eq!(
        check_equivalent(&lazy, &none, "s5", "/").unwrap_err(),
        "inequivalent arg 'x-queue-mode' for queue 's5' in vhost '/': received none but current is the value 'lazy' of type 'longstr'"
    );
    // An argument no queue type compares is not compared.
    let ha = table(&[("x-ha-policy", s("all"))]);
    assert_eq!(check_equivalent(&ha, &none, "q", "/"), Ok(()));
}

/// A quorum queue is compared over the quorum list, in its order, as RabbitMQ 3.10.8 does.
#[test]
fn equivalence_of_a_quorum_queue_follows_the_quorum_list() {
    let quorum = || ("x-queue-type", s("quorum"));
    let current = table(&[
        quorum(),
        ("x-message-ttl", AMQPValue::LongInt(5)),
        ("x-delivery-limit", AMQPValue::LongInt(3)),
    ]);
    let requested = table(&[quorum()]);
    assert_eq!(
        check_equivalent(&current, &requested, "q", "/").unwrap_err(),
        "inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received none but current is the value '3' of type 'signedint'"
    );
    // Not in the quorum list: a quorum queue is redeclared with it (RabbitMQ: declare-ok).
    let with_priority = table(&[quorum(), ("x-max-priority", AMQPValue::LongInt(3))]);
    assert_eq!(
        check_equivalent(&requested, &with_priority, "q", "/"),
        Ok(())
    );
    // The dead-letter exchange comes before the queue type in the quorum list.
    let with_dlx = table(&[quorum(), ("x-dead-letter-exchange", s("d"))]);
    let classic = table(&[("x-queue-type", s("classic"))]);
    assert_eq!(
        check_equivalent(&with_dlx, &classic, "b1", "/").unwrap_err(),
        "inequivalent arg 'x-dead-letter-exchange' for queue 'b1' in vhost '/': received none but current is the value 'd' of type 'longstr'"
    );
}

#[test]
fn equivalence_queue_type_absent_means_classic() {
    let none = FieldTable::default();
    let classic = table(&[("x-queue-type", s("classic"))]);
    let quorum = table(&[("x-queue-type", s("quorum"))]);
    assert_eq!(check_equivalent(&none, &classic, "q", "/"), Ok(()));
    assert_eq!(check_equivalent(&classic, &none, "q", "/"), Ok(()));
    assert_eq!(
        check_equivalent(&none, &quorum, "q", "/").unwrap_err(),
        "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received 'quorum' but current is 'classic'"
    );
}

#[test]
fn equivalence_nested_values_print_as_erlang_terms() {
    let current = table(&[(
        "x-overflow",
        AMQPValue::FieldArray(FieldArray::from(vec![s("a")])),
    )]);
    let err = check_equivalent(&current, &FieldTable::default(), "q", "/").unwrap_err();
    assert_eq!(
        err,
        "inequivalent arg 'x-overflow' for queue 'q' in vhost '/': received none but current is the value '[{longstr,<<\"a\">>}]' of type 'array'"
    );
}

#[test]
fn retry_delays_must_be_an_array_of_1_to_32_delays() {
    let reply = |value: AMQPValue| {
        parse_queue_arguments(&table(&[("x-retry-delays", value)]))
            .unwrap_err()
            .reply_text("q", "/")
    };
    let array = |items: Vec<AMQPValue>| AMQPValue::FieldArray(FieldArray::from(items));
    assert_eq!(
        reply(AMQPValue::LongInt(1000)),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': {unacceptable_type,signedint}"
    );
    assert_eq!(
        reply(array(vec![])),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': \"expected 1 to 32 delays, got 0\""
    );
    assert_eq!(
        reply(array(vec![AMQPValue::LongInt(1); 33])),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': \"expected 1 to 32 delays, got 33\""
    );
    assert_eq!(
        reply(array(vec![AMQPValue::LongInt(10), AMQPValue::LongInt(-5)])),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': {value_negative,-5}"
    );
    assert_eq!(
        reply(array(vec![s("1000")])),
        "PRECONDITION_FAILED - invalid arg 'x-retry-delays' for queue 'q' in vhost '/': \"expected integer, got longstr\""
    );
}
