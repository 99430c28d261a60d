//! Unit tests of [`crate::proxy::policy_sync::plan`].

use super::*;
use crate::config::PolicyConfig;

fn set(policies: &[(&str, &str, &str, i32, Value)]) -> PolicySet {
    let configs: Vec<PolicyConfig> = policies
        .iter()
        .map(
            |(name, vhost, apply_to, priority, definition)| PolicyConfig {
                name: name.to_string(),
                vhost: vhost.to_string(),
                pattern: "^orders\\.".into(),
                apply_to: apply_to.to_string(),
                priority: *priority,
                definition: serde_json::from_value(definition.clone()).unwrap(),
            },
        )
        .collect();
    PolicySet::from_configs(&configs).unwrap()
}

fn capture() -> DeadLetterHandling {
    DeadLetterHandling::Capture {
        exchange: "dlx-proxy.capture".into(),
    }
}

#[test]
fn limits_are_mirrored_and_the_target_becomes_the_capture_route() {
    let policies = set(&[(
        "ttl",
        "/",
        "queues",
        7,
        json!({
            "message-ttl": 1000, "expires": 60000, "max-length": 10,
            "max-length-bytes": 4096, "overflow": "reject-publish-dlx",
            "delivery-limit": 3, "dead-letter-exchange": "dlx",
            "dead-letter-routing-key": "dead"
        }),
    )]);
    let desired = desired(&policies, "/", &capture());
    let mirror = &desired["dlx-proxy.ttl"];
    assert_eq!(
        mirror.pattern,
        "^(?!dlx\\-proxy\\.capture(?:\\.retry\\.[0-9]+)?$)[\\s\\S]*?(?:^orders\\.)"
    );
    assert_eq!(mirror.priority, 7);
    assert_eq!(mirror.apply_to, "queues");
    let tag = CaptureTag {
        dead_letter_exchange: Some("dlx".into()),
        dead_letter_routing_key: Some("dead".into()),
        delivery_limit: None,
        retry_delays: None,
    };
    assert_eq!(
        Value::Object(mirror.definition.clone()),
        json!({
            "message-ttl": 1000, "expires": 60000, "max-length": 10,
            "max-length-bytes": 4096, "overflow": "reject-publish-dlx",
            "delivery-limit": 3, "dead-letter-exchange": "dlx-proxy.capture",
            "dead-letter-routing-key": tag.encode().unwrap()
        })
    );
    assert_eq!(
        CaptureTag::decode(
            mirror.definition["dead-letter-routing-key"]
                .as_str()
                .unwrap()
        ),
        Some(tag)
    );
    assert_eq!(
        mirror.body(),
        json!({
            "pattern": mirror.pattern, "apply-to": "queues", "priority": 7,
            "definition": mirror.definition
        })
    );
}

#[test]
fn without_a_dead_letter_exchange_deaths_still_reach_the_capture_exchange_untagged() {
    let policies = set(&[("cap", "/", "all", 0, json!({"max-length": 5}))]);
    let mirror = &desired(&policies, "/", &capture())["dlx-proxy.cap"];
    assert_eq!(mirror.apply_to, "queues");
    assert_eq!(
        Value::Object(mirror.definition.clone()),
        json!({"max-length": 5, "dead-letter-exchange": "dlx-proxy.capture"})
    );
}

#[test]
fn delegation_gives_the_upstream_the_policy_target() {
    let policies = set(&[(
        "d",
        "/",
        "queues",
        0,
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "k", "message-ttl": 5}),
    )]);
    let mirror = &desired(&policies, "/", &DeadLetterHandling::Delegate)["dlx-proxy.d"];
    // No capture queue to keep out: the pattern as it is.
    assert_eq!(mirror.pattern, "^orders\\.");
    assert_eq!(
        Value::Object(mirror.definition.clone()),
        json!({"message-ttl": 5, "dead-letter-exchange": "dlx", "dead-letter-routing-key": "k"})
    );
}

#[test]
fn only_queue_policies_of_the_vhost_are_mirrored() {
    let policies = set(&[
        ("q", "/", "queues", 0, json!({"message-ttl": 1})),
        ("x", "/", "exchanges", 0, json!({"message-ttl": 1})),
        ("other", "v", "queues", 0, json!({"message-ttl": 1})),
    ]);
    let names: Vec<String> = desired(&policies, "/", &capture()).into_keys().collect();
    assert_eq!(names, ["dlx-proxy.q"]);
    let names: Vec<String> = desired(&policies, "v", &capture()).into_keys().collect();
    assert_eq!(names, ["dlx-proxy.other"]);
}

#[test]
fn the_plan_puts_what_differs_and_deletes_only_prefixed_leftovers() {
    let policies = set(&[
        ("same", "/", "queues", 1, json!({"message-ttl": 1})),
        ("changed", "/", "queues", 1, json!({"message-ttl": 2})),
        ("new", "/", "queues", 1, json!({"message-ttl": 3})),
    ]);
    let desired = desired(&policies, "/", &capture());
    let as_listed = |policy: &UpstreamPolicy| {
        let mut entry = policy.body();
        entry["name"] = json!(policy.name);
        entry["vhost"] = json!("/");
        entry
    };
    let mut changed = as_listed(&desired["dlx-proxy.changed"]);
    changed["definition"]["message-ttl"] = json!(20);
    let current = vec![
        as_listed(&desired["dlx-proxy.same"]),
        changed,
        json!({"name": "dlx-proxy.gone", "pattern": ".*", "apply-to": "queues",
               "priority": 0, "definition": {"message-ttl": 9,
               "dead-letter-exchange": "dlx-proxy.capture"}}),
        // Another deployment's (another capture exchange): left alone.
        json!({"name": "dlx-proxy.theirs", "pattern": ".*", "apply-to": "queues",
               "priority": 0, "definition": {"dead-letter-exchange": "their.capture"}}),
        json!({"name": "users-own", "pattern": ".*", "apply-to": "queues",
               "priority": 0, "definition": {"message-ttl": 9}}),
        json!({"pattern": "no name"}),
    ];
    assert_eq!(
        plan(&desired, &current, &capture()),
        vec![
            SyncAction::Put(desired["dlx-proxy.changed"].clone()),
            SyncAction::Put(desired["dlx-proxy.new"].clone()),
            SyncAction::Delete("dlx-proxy.gone".into()),
        ]
    );
    // A priority or pattern changed by hand upstream is put back.
    let mut drifted = as_listed(&desired["dlx-proxy.same"]);
    drifted["priority"] = json!(99);
    let only_same: BTreeMap<String, UpstreamPolicy> = desired
        .iter()
        .filter(|(name, _)| *name == "dlx-proxy.same")
        .map(|(name, policy)| (name.clone(), policy.clone()))
        .collect();
    assert_eq!(
        plan(&only_same, &[drifted], &capture()),
        vec![SyncAction::Put(desired["dlx-proxy.same"].clone())]
    );
    assert_eq!(
        plan(
            &only_same,
            &[as_listed(&desired["dlx-proxy.same"])],
            &capture()
        ),
        vec![]
    );
}

#[test]
fn the_capture_queue_and_its_delay_queues_are_kept_out_of_every_pattern() {
    // The upstream pattern (PCRE) is not the regex crate's (no lookahead); what it must
    // match is spelled out: the original's matches, minus the capture queue and the delay
    // queues of the retry tiers (RabbitMQ itself applies it in the integration test).
    assert_eq!(
        excluding("dlx-proxy.capture", ".*"),
        "^(?!dlx\\-proxy\\.capture(?:\\.retry\\.[0-9]+)?$)[\\s\\S]*?(?:.*)"
    );
    assert_eq!(
        excluding("c", "a|^b$"),
        "^(?!c(?:\\.retry\\.[0-9]+)?$)[\\s\\S]*?(?:a|^b$)"
    );
    // The delay queue names the lookahead stands for.
    let delay = crate::proxy::retry_tiers::delay_queue_name("c", 1000).unwrap();
    assert_eq!(delay, "c.retry.1000");
    assert!(crate::proxy::retry_tiers::is_delay_queue("c", &delay));
}

#[test]
fn with_delegation_every_leftover_with_the_prefix_is_deleted() {
    let current = vec![
        json!({"name": "dlx-proxy.old", "definition": {"dead-letter-exchange": "x"}}),
        json!({"name": "mine", "definition": {}}),
    ];
    assert_eq!(
        plan(&BTreeMap::new(), &current, &DeadLetterHandling::Delegate),
        vec![SyncAction::Delete("dlx-proxy.old".into())]
    );
    assert_eq!(plan(&BTreeMap::new(), &current, &capture()), vec![]);
}

#[test]
fn deletes_wait_until_every_round_of_the_grace_planned_them() {
    use std::time::{Duration, Instant};
    let delete = |name: &str| SyncAction::Delete(name.to_string());
    let mut grace = DeleteGrace::new(Duration::from_secs(600));
    let start = Instant::now();
    let at = |secs| start + Duration::from_secs(secs);
    let mut actions = vec![delete("dlx-proxy.a"), delete("dlx-proxy.b")];
    assert_eq!(grace.admit("/", &mut actions, at(0)), 2);
    assert!(actions.is_empty());
    // b is wanted again for a while (another instance has it: a rolling update).
    let mut actions = vec![delete("dlx-proxy.a")];
    assert_eq!(grace.admit("/", &mut actions, at(300)), 1);
    let mut actions = vec![delete("dlx-proxy.a"), delete("dlx-proxy.b")];
    assert_eq!(grace.admit("/", &mut actions, at(600)), 1);
    assert_eq!(actions, vec![delete("dlx-proxy.a")], "a: 600 s of rounds");
    // The same name in another vhost has a grace of its own.
    let mut other = vec![delete("dlx-proxy.a")];
    assert_eq!(grace.admit("v", &mut other, at(600)), 1);
    // A delete that failed is made again at the next round; b waits its own 600 s.
    let mut actions = vec![delete("dlx-proxy.a"), delete("dlx-proxy.b")];
    assert_eq!(grace.admit("/", &mut actions, at(1199)), 1);
    assert_eq!(actions, vec![delete("dlx-proxy.a")]);
    let mut actions = vec![delete("dlx-proxy.b")];
    assert_eq!(grace.admit("/", &mut actions, at(1200)), 0);
    assert_eq!(actions, vec![delete("dlx-proxy.b")]);
    // Puts are never held back, and a grace of 0 deletes at once.
    let mut none = DeleteGrace::new(Duration::ZERO);
    let mut actions = vec![delete("dlx-proxy.c")];
    assert_eq!(none.admit("/", &mut actions, at(0)), 0);
    assert_eq!(actions.len(), 1);
}

#[test]
fn a_policy_put_back_after_its_delete_waits_a_whole_grace_again() {
    use std::collections::BTreeSet;
    use std::time::{Duration, Instant};
    let delete = |name: &str| SyncAction::Delete(name.to_string());
    let mut grace = DeleteGrace::new(Duration::from_secs(600));
    let start = Instant::now();
    let at = |secs| start + Duration::from_secs(secs);
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(grace.admit("/", &mut actions, at(0)), 1);
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(grace.admit("/", &mut actions, at(600)), 0);
    grace.deleted("/", "dlx-proxy.p");
    // Another instance (a rollout longer than the grace) put it back at once.
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(
        grace.admit("/", &mut actions, at(630)),
        1,
        "not every round"
    );
    // Rounds that failed before planning do not count as grace.
    grace.forget("/");
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(grace.admit("/", &mut actions, at(1300)), 1);
    // Nor do vhosts that left the rounds keep what they had.
    grace.keep_vhosts(&BTreeSet::new());
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(grace.admit("/", &mut actions, at(1950)), 1);
    let mut actions = vec![delete("dlx-proxy.p")];
    assert_eq!(grace.admit("/", &mut actions, at(2550)), 0);
}
