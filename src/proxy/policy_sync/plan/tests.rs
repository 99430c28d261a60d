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

fn capture() -> PolicyOwner {
    PolicyOwner::new(
        "dlx-proxy.capture",
        DeadLetterHandling::Capture {
            exchange: "dlx-proxy.capture".into(),
        },
    )
}

fn delegate(capture_name: &str) -> PolicyOwner {
    PolicyOwner::new(capture_name, DeadLetterHandling::Delegate)
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
    let mirror = &desired["dlx-proxy.capture.ttl"];
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
    let mirror = &desired(&policies, "/", &capture())["dlx-proxy.capture.cap"];
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
    let mirror = &desired(&policies, "/", &delegate("dlx-proxy.capture"))["dlx-proxy.capture.d"];
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
    assert_eq!(names, ["dlx-proxy.capture.q"]);
    let names: Vec<String> = desired(&policies, "v", &capture()).into_keys().collect();
    assert_eq!(names, ["dlx-proxy.capture.other"]);
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
    let mut changed = as_listed(&desired["dlx-proxy.capture.changed"]);
    changed["definition"]["message-ttl"] = json!(20);
    let current = vec![
        as_listed(&desired["dlx-proxy.capture.same"]),
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
            SyncAction::Put(desired["dlx-proxy.capture.changed"].clone()),
            SyncAction::Put(desired["dlx-proxy.capture.new"].clone()),
            SyncAction::Delete("dlx-proxy.gone".into()),
        ]
    );
    // A priority or pattern changed by hand upstream is put back.
    let mut drifted = as_listed(&desired["dlx-proxy.capture.same"]);
    drifted["priority"] = json!(99);
    let only_same: BTreeMap<String, UpstreamPolicy> = desired
        .iter()
        .filter(|(name, _)| *name == "dlx-proxy.capture.same")
        .map(|(name, policy)| (name.clone(), policy.clone()))
        .collect();
    assert_eq!(
        plan(&only_same, &[drifted], &capture()),
        vec![SyncAction::Put(desired["dlx-proxy.capture.same"].clone())]
    );
    assert_eq!(
        plan(
            &only_same,
            &[as_listed(&desired["dlx-proxy.capture.same"])],
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

/// An upstream policy as `GET /api/policies/{vhost}` lists it.
fn listed(name: &str, pattern: &str, definition: Value) -> Value {
    json!({"name": name, "vhost": "/", "pattern": pattern, "apply-to": "queues",
           "priority": 0, "definition": definition})
}

#[test]
fn deployments_with_the_same_policy_names_keep_apart() {
    let policies = set(&[("ttl", "/", "queues", 0, json!({"message-ttl": 1}))]);
    let orders = PolicyOwner::new(
        "orders.capture",
        DeadLetterHandling::Capture {
            exchange: "orders.capture".into(),
        },
    );
    let ours = desired(&policies, "/", &capture());
    let theirs = desired(&policies, "/", &orders);
    assert_eq!(ours.keys().collect::<Vec<_>>(), ["dlx-proxy.capture.ttl"]);
    assert_eq!(theirs.keys().collect::<Vec<_>>(), ["orders.capture.ttl"]);
    // Both upstream: each deployment puts nothing and deletes nothing of the other's, round
    // after round (they overwrote one policy `dlx-proxy.ttl` before).
    let both: Vec<Value> = ours
        .values()
        .chain(theirs.values())
        .map(|p| {
            let mut entry = p.body();
            entry["name"] = json!(p.name);
            entry
        })
        .collect();
    assert_eq!(plan(&ours, &both, &capture()), vec![]);
    assert_eq!(plan(&theirs, &both, &orders), vec![]);
    // Without the policy, each deletes its own only.
    assert_eq!(
        plan(&BTreeMap::new(), &both, &orders),
        vec![SyncAction::Delete("orders.capture.ttl".into())]
    );
}

#[test]
fn a_delegating_deployment_deletes_only_its_own_and_never_a_capturing_ones() {
    let delegating = delegate("billing");
    let policies = set(&[("kept", "/", "queues", 0, json!({"message-ttl": 1}))]);
    let desired = desired(&policies, "/", &delegating);
    assert_eq!(desired.keys().collect::<Vec<_>>(), ["billing.kept"]);
    let current = vec![
        // Its own, no longer in its set.
        listed("billing.gone", "^b$", json!({"dead-letter-exchange": "x"})),
        // Its own under the legacy name of a policy it has: moved to the new name.
        listed("dlx-proxy.kept", "^orders\\.", json!({"message-ttl": 1})),
        // A legacy name it does not have: maybe another deployment's, left alone.
        listed("dlx-proxy.old", "^o$", json!({"dead-letter-exchange": "x"})),
        // A capturing deployment's, under the delegating one's prefix or the legacy one.
        listed(
            "billing.captured",
            &excluding("billing.capture", "^c$"),
            json!({"dead-letter-exchange": "billing.capture"}),
        ),
        listed(
            "dlx-proxy.kept-too",
            &excluding("dlx-proxy.capture", "^orders\\."),
            json!({"dead-letter-exchange": "dlx-proxy.capture"}),
        ),
        // A capturing deployment's of a version that kept out the capture queue only.
        listed(
            "billing.older",
            "^(?!billing\\.capture$)[\\s\\S]*?(?:^c$)",
            json!({"dead-letter-exchange": "billing.capture"}),
        ),
        // Another deployment whose name only starts like this one's.
        listed("billing-eu.gone", "^e$", json!({})),
        listed("users-own", ".*", json!({"message-ttl": 9})),
    ];
    assert_eq!(
        plan(&desired, &current, &delegating),
        vec![
            SyncAction::Put(desired["billing.kept"].clone()),
            SyncAction::Delete("billing.gone".into()),
            SyncAction::Delete("dlx-proxy.kept".into()),
        ]
    );
    // The capturing deployment deletes its own legacy one only: neither the delegating
    // one's nor the user's.
    assert_eq!(
        plan(&BTreeMap::new(), &current, &capture()),
        vec![SyncAction::Delete("dlx-proxy.kept-too".into())]
    );
}

#[test]
fn a_delegating_deployment_never_takes_a_default_named_policy_for_a_legacy_one() {
    // Its policy `capture.ttl` had the legacy name `dlx-proxy.capture.ttl`, which is also
    // the new name of the policy `ttl` of a deployment with the default capture name.
    let delegating = delegate("billing");
    let policies = set(&[("capture.ttl", "/", "queues", 0, json!({"message-ttl": 1}))]);
    let desired = desired(&policies, "/", &delegating);
    let current = vec![listed(
        "dlx-proxy.capture.ttl",
        "^o$",
        json!({"message-ttl": 5}),
    )];
    assert_eq!(
        plan(&desired, &current, &delegating),
        vec![SyncAction::Put(desired["billing.capture.ttl"].clone())]
    );
}

#[test]
fn a_capturing_deployment_takes_over_its_legacy_names() {
    let current = vec![
        listed(
            "dlx-proxy.old",
            &excluding("dlx-proxy.capture", "^o$"),
            json!({"dead-letter-exchange": "dlx-proxy.capture"}),
        ),
        listed(
            "dlx-proxy.other",
            &excluding("their.capture", "^o$"),
            json!({"dead-letter-exchange": "their.capture"}),
        ),
        // Its prefix but not its route (edited by hand): not taken for its own.
        listed("dlx-proxy.capture.edited", "^o$", json!({"message-ttl": 1})),
    ];
    assert_eq!(
        plan(&BTreeMap::new(), &current, &capture()),
        vec![SyncAction::Delete("dlx-proxy.old".into())]
    );
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
