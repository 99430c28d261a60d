//! Unit tests of [`crate::policy`].

use super::*;
use serde_json::json;

fn config(name: &str, pattern: &str, priority: i32, definition: Value) -> PolicyConfig {
    let Value::Object(map) = definition else {
        panic!("definition must be an object");
    };
    PolicyConfig {
        name: name.into(),
        vhost: "/".into(),
        pattern: pattern.into(),
        apply_to: "queues".into(),
        priority,
        definition: map.into_iter().collect(),
    }
}

fn dlx(name: &str) -> Value {
    json!({ "dead-letter-exchange": name })
}

#[test]
fn every_definition_key_is_parsed() {
    let set = PolicySet::from_configs(&[config(
        "all-keys",
        ".*",
        0,
        json!({
            "dead-letter-exchange": "dlx",
            "dead-letter-routing-key": "dlk",
            "message-ttl": 60000,
            "expires": 1,
            "max-length": 0,
            "max-length-bytes": 1024,
            "overflow": "reject-publish",
            "delivery-limit": 16,
            "consumer-timeout": 30000,
            "retry-delays": [1000, 10000]
        }),
    )])
    .unwrap();
    let policy = set.for_queue("/", "anything").unwrap();
    assert_eq!(
        policy.definition,
        PolicyDefinition {
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: Some("dlk".into()),
            message_ttl: Some(60000),
            expires: Some(1),
            max_length: Some(0),
            max_length_bytes: Some(1024),
            overflow: Some(Overflow::RejectPublish),
            delivery_limit: Some(16),
            consumer_timeout: Some(30000),
            retry_delays: Some(vec![1000, 10000]),
        }
    );
    assert_eq!(policy.apply_to, ApplyTo::Queues);
}

#[test]
fn invalid_definitions_name_policy_and_key() {
    let cases = [
        (
            json!({"message-ttl": -1}),
            "definition.message-ttl",
            "expected a non-negative integer",
        ),
        (
            json!({"consumer-timeout": -1}),
            "definition.consumer-timeout",
            "expected a non-negative integer",
        ),
        (
            json!({"message-ttl": "1000"}),
            "definition.message-ttl",
            "expected a non-negative integer",
        ),
        (
            json!({"message-ttl": 1.5}),
            "definition.message-ttl",
            "expected a non-negative integer",
        ),
        (
            json!({"message-ttl": 315_360_000_001_u64}),
            "definition.message-ttl",
            "must be at most 315360000000 (ten years in ms)",
        ),
        (
            json!({"expires": 0}),
            "definition.expires",
            "expected a positive integer",
        ),
        (
            json!({"max-length": -5}),
            "definition.max-length",
            "expected a non-negative integer",
        ),
        (
            json!({"max-length-bytes": true}),
            "definition.max-length-bytes",
            "expected a non-negative integer",
        ),
        (
            json!({"delivery-limit": -1}),
            "definition.delivery-limit",
            "expected a non-negative integer",
        ),
        (
            json!({"overflow": "drop-tail"}),
            "definition.overflow",
            "expected 'drop-head', 'reject-publish' or 'reject-publish-dlx'",
        ),
        (
            json!({"dead-letter-exchange": 42}),
            "definition.dead-letter-exchange",
            "expected a string",
        ),
        (
            json!({"dead-letter-routing-key": null}),
            "definition.dead-letter-routing-key",
            "expected a string",
        ),
    ];
    for (definition, key, message) in cases {
        let err =
            PolicySet::from_configs(&[config("dlx-all", ".*", 0, definition.clone())]).unwrap_err();
        assert_eq!(err.policy, "dlx-all", "{definition}");
        assert_eq!(err.key, key, "{definition}");
        assert_eq!(err.message, message, "{definition}");
    }
    let err = PolicySet::from_configs(&[config("dlx-all", ".*", 0, json!({"message-ttl": -1}))])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy 'dlx-all': key 'definition.message-ttl': expected a non-negative integer"
    );
}

#[test]
fn unknown_and_empty_definitions_are_refused() {
    let err =
        PolicySet::from_configs(&[config("p", ".*", 0, json!({"ha-mode": "all"}))]).unwrap_err();
    assert_eq!(err.key, "definition.ha-mode");
    assert!(
        err.message.starts_with("unknown policy key"),
        "{}",
        err.message
    );
    let err = PolicySet::from_configs(&[config("p", ".*", 0, json!({}))]).unwrap_err();
    assert_eq!(err.key, "definition.*");
}

#[test]
fn structural_errors_are_refused() {
    let err = PolicySet::from_configs(&[config("", ".*", 0, dlx("d"))]).unwrap_err();
    assert_eq!(err.key, "name");
    let err = PolicySet::from_configs(&[config("p", "(", 0, dlx("d"))]).unwrap_err();
    assert_eq!(err.key, "pattern");
    let err = PolicySet::from_configs(&[config("p", "", 0, dlx("d"))]).unwrap_err();
    assert_eq!(err.key, "pattern");
    let mut bad_apply = config("p", ".*", 0, dlx("d"));
    bad_apply.apply_to = "bindings".into();
    let err = PolicySet::from_configs(&[bad_apply]).unwrap_err();
    assert_eq!(err.key, "apply_to");
    let mut no_vhost = config("p", ".*", 0, dlx("d"));
    no_vhost.vhost = String::new();
    assert_eq!(
        PolicySet::from_configs(&[no_vhost]).unwrap_err().key,
        "vhost"
    );
}

#[test]
fn duplicate_names_are_refused_per_vhost() {
    let a = config("p", ".*", 0, dlx("a"));
    let b = config("p", ".*", 1, dlx("b"));
    let err = PolicySet::from_configs(&[a.clone(), b]).unwrap_err();
    assert_eq!(err.key, "name");
    assert_eq!(err.message, "defined twice in vhost '/'");
    let mut other_vhost = a.clone();
    other_vhost.vhost = "v2".into();
    let set = PolicySet::from_configs(&[a, other_vhost]).unwrap();
    assert_eq!(set.len(), 2);
}

#[test]
fn pattern_is_an_unanchored_regex() {
    let set = PolicySet::from_configs(&[config("p", "orders\\.", 0, dlx("d"))]).unwrap();
    assert!(set.for_queue("/", "orders.created").is_some());
    assert!(set.for_queue("/", "eu.orders.created").is_some());
    assert!(set.for_queue("/", "ordersXcreated").is_none());
    let anchored = PolicySet::from_configs(&[config("p", "^orders$", 0, dlx("d"))]).unwrap();
    assert!(anchored.for_queue("/", "orders").is_some());
    assert!(anchored.for_queue("/", "orders2").is_none());
}

#[test]
fn highest_priority_wins_and_ties_go_to_the_first_name() {
    let set = PolicySet::from_configs(&[
        config("zeta", ".*", 5, dlx("z")),
        config("alpha", ".*", 1, dlx("a")),
        config("beta", ".*", 5, dlx("b")),
        config("narrow", "^special$", 9, dlx("n")),
    ])
    .unwrap();
    assert_eq!(set.for_queue("/", "q").unwrap().name, "beta");
    assert_eq!(set.for_queue("/", "special").unwrap().name, "narrow");
    let negative = PolicySet::from_configs(&[
        config("low", ".*", -10, dlx("l")),
        config("lower", ".*", -20, dlx("m")),
    ])
    .unwrap();
    assert_eq!(negative.for_queue("/", "q").unwrap().name, "low");
}

#[test]
fn apply_to_and_vhost_filter_matches() {
    let mut exchanges = config("ex", ".*", 10, dlx("e"));
    exchanges.apply_to = "exchanges".into();
    let mut all = config("all", ".*", 0, dlx("a"));
    all.apply_to = "all".into();
    let queues = config("qs", ".*", 5, dlx("q"));
    let mut elsewhere = config("elsewhere", ".*", 100, dlx("x"));
    elsewhere.vhost = "other".into();
    let set = PolicySet::from_configs(&[exchanges, all, queues, elsewhere]).unwrap();
    assert_eq!(set.for_queue("/", "q").unwrap().name, "qs");
    assert_eq!(set.for_exchange("/", "x").unwrap().name, "ex");
    assert_eq!(set.for_queue("other", "q").unwrap().name, "elsewhere");
    assert!(set.for_queue("missing", "q").is_none());
    let only_all = PolicySet::from_configs(&[{
        let mut c = config("all", ".*", 0, dlx("a"));
        c.apply_to = "all".into();
        c
    }])
    .unwrap();
    assert_eq!(only_all.for_exchange("/", "x").unwrap().name, "all");
    assert_eq!(only_all.for_queue("/", "q").unwrap().name, "all");
}

#[test]
fn set_replaces_and_clear_removes() {
    let mut set = PolicySet::default();
    assert!(set.is_empty());
    set.set(&config("p", ".*", 0, dlx("first"))).unwrap();
    set.set(&config("p", ".*", 0, dlx("second"))).unwrap();
    assert_eq!(set.len(), 1);
    assert_eq!(
        set.for_queue("/", "q")
            .unwrap()
            .definition
            .dead_letter_exchange
            .as_deref(),
        Some("second")
    );
    // An invalid update leaves the old policy in place.
    assert!(
        set.set(&config("p", ".*", 0, json!({"message-ttl": "x"})))
            .is_err()
    );
    assert_eq!(
        set.get("/", "p")
            .unwrap()
            .definition
            .dead_letter_exchange
            .as_deref(),
        Some("second")
    );
    assert!(!set.clear("/", "absent"));
    assert!(!set.clear("nope", "p"));
    assert!(set.clear("/", "p"));
    assert!(set.is_empty());
    assert!(set.for_queue("/", "q").is_none());
}

#[test]
fn iter_is_ordered_by_vhost_then_name() {
    let mut b = config("b", ".*", 0, dlx("d"));
    b.vhost = "v".into();
    let set = PolicySet::from_configs(&[
        b,
        config("z", ".*", 0, dlx("d")),
        config("a", ".*", 0, dlx("d")),
    ])
    .unwrap();
    let names: Vec<(&str, &str)> = set
        .iter()
        .map(|p| (p.vhost.as_str(), p.name.as_str()))
        .collect();
    assert_eq!(names, vec![("/", "a"), ("/", "z"), ("v", "b")]);
}

#[test]
fn precedence_table() {
    // reference §1.7: classic queues (our rule for every type).
    let args = QueueArguments {
        dead_letter_exchange: Some("arg-dlx".into()),
        dead_letter_routing_key: Some("arg-dlk".into()),
        message_ttl: Some(50),
        expires: Some(10_000),
        max_length: Some(100),
        max_length_bytes: Some(5_000),
        overflow: Some(Overflow::RejectPublish),
        delivery_limit: Some(7),
        consumer_timeout: Some(9_000),
        retry_delays: Some(vec![5]),
        ..QueueArguments::default()
    };
    let policy = PolicyDefinition {
        dead_letter_exchange: Some("pol-dlx".into()),
        dead_letter_routing_key: Some("pol-dlk".into()),
        message_ttl: Some(100_000),
        expires: Some(5_000),
        max_length: Some(10),
        max_length_bytes: Some(50_000),
        overflow: Some(Overflow::RejectPublishDlx),
        delivery_limit: Some(3),
        consumer_timeout: Some(4_000),
        retry_delays: Some(vec![100, 200]),
    };
    let merged = effective_settings(&args, Some(&policy), Some(20));
    assert_eq!(
        merged,
        EffectiveQueueSettings {
            dead_letter_exchange: Some("arg-dlx".into()),
            dead_letter_routing_key: Some("arg-dlk".into()),
            message_ttl: Some(50),
            expires: Some(5_000),
            max_length: Some(10),
            max_length_bytes: Some(5_000),
            overflow: Overflow::RejectPublish,
            delivery_limit: Some(3),
            consumer_timeout: Some(4_000),
            retry_delays: Some(vec![5]),
            policy: None,
        }
    );
}

#[test]
fn policy_fills_what_arguments_leave_out() {
    let policy = PolicyDefinition {
        dead_letter_exchange: Some("pol-dlx".into()),
        dead_letter_routing_key: Some("pol-dlk".into()),
        message_ttl: Some(1000),
        overflow: Some(Overflow::RejectPublishDlx),
        delivery_limit: Some(4),
        ..PolicyDefinition::default()
    };
    let merged = effective_settings(&QueueArguments::default(), Some(&policy), Some(20));
    assert_eq!(merged.dead_letter_exchange.as_deref(), Some("pol-dlx"));
    assert_eq!(merged.dead_letter_routing_key.as_deref(), Some("pol-dlk"));
    assert_eq!(merged.message_ttl, Some(1000));
    assert_eq!(merged.overflow, Overflow::RejectPublishDlx);
    assert_eq!(merged.delivery_limit, Some(4));
    assert_eq!(merged.expires, None);
    assert_eq!(merged.max_length, None);
}

#[test]
fn routing_key_and_exchange_merge_independently() {
    // A DLX from the argument with a DLRK from the policy: both apply.
    let args = QueueArguments {
        dead_letter_exchange: Some("arg-dlx".into()),
        ..QueueArguments::default()
    };
    let policy = PolicyDefinition {
        dead_letter_routing_key: Some("pol-dlk".into()),
        ..PolicyDefinition::default()
    };
    let merged = effective_settings(&args, Some(&policy), None);
    assert_eq!(merged.dead_letter_exchange.as_deref(), Some("arg-dlx"));
    assert_eq!(merged.dead_letter_routing_key.as_deref(), Some("pol-dlk"));
    // An empty-string DLX argument (the default exchange) still wins over the policy.
    let default_exchange = QueueArguments {
        dead_letter_exchange: Some(String::new()),
        ..QueueArguments::default()
    };
    let policy = PolicyDefinition {
        dead_letter_exchange: Some("pol-dlx".into()),
        ..PolicyDefinition::default()
    };
    let merged = effective_settings(&default_exchange, Some(&policy), None);
    assert_eq!(merged.dead_letter_exchange.as_deref(), Some(""));
}

#[test]
fn default_delivery_limit_only_when_neither_sets_one() {
    let none = effective_settings(&QueueArguments::default(), None, Some(16));
    assert_eq!(none.delivery_limit, Some(16));
    let higher_arg = QueueArguments {
        delivery_limit: Some(50),
        ..QueueArguments::default()
    };
    assert_eq!(
        effective_settings(&higher_arg, None, Some(16)).delivery_limit,
        Some(50)
    );
    let policy = PolicyDefinition {
        delivery_limit: Some(40),
        ..PolicyDefinition::default()
    };
    assert_eq!(
        effective_settings(&QueueArguments::default(), Some(&policy), Some(16)).delivery_limit,
        Some(40)
    );
    assert_eq!(
        effective_settings(&QueueArguments::default(), None, None).delivery_limit,
        None
    );
}

#[test]
fn no_policy_no_arguments_gives_defaults() {
    let merged = effective_settings(&QueueArguments::default(), None, None);
    assert_eq!(
        merged,
        EffectiveQueueSettings {
            dead_letter_exchange: None,
            dead_letter_routing_key: None,
            message_ttl: None,
            expires: None,
            max_length: None,
            max_length_bytes: None,
            overflow: Overflow::DropHead,
            delivery_limit: None,
            consumer_timeout: None,
            retry_delays: None,
            policy: None,
        }
    );
}

#[test]
fn settings_with_policy_record_its_name() {
    let set = PolicySet::from_configs(&[config("dlx-all", ".*", 0, json!({"message-ttl": 100}))])
        .unwrap();
    let args = QueueArguments {
        message_ttl: Some(5000),
        ..QueueArguments::default()
    };
    let merged = effective_settings_with_policy(&args, set.for_queue("/", "q"), None);
    assert_eq!(merged.policy.as_deref(), Some("dlx-all"));
    assert_eq!(merged.message_ttl, Some(100));
    let without = effective_settings_with_policy(&args, None, None);
    assert_eq!(without.policy, None);
    assert_eq!(without.message_ttl, Some(5000));
}

#[test]
fn retry_delays_come_from_the_policy_when_the_queue_has_none() {
    let policy = PolicyDefinition {
        retry_delays: Some(vec![1000, 60_000]),
        ..PolicyDefinition::default()
    };
    let merged = effective_settings(&QueueArguments::default(), Some(&policy), None);
    assert_eq!(merged.retry_delays, Some(vec![1000, 60_000]));
}

#[test]
fn invalid_retry_delays_name_the_key() {
    for definition in [
        json!({"retry-delays": []}),
        json!({"retry-delays": 1000}),
        json!({"retry-delays": [1000, -1]}),
        json!({"retry-delays": [315360000001u64]}),
        json!({"retry-delays": vec![1; 33]}),
    ] {
        let err = PolicySet::from_configs(&[config("p", ".*", 0, definition.clone())])
            .expect_err(&definition.to_string());
        assert_eq!(err.key, "definition.retry-delays", "{definition}");
    }
}
