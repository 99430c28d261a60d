//! The pure part of the upstream policy sync: which RabbitMQ policies the proxy's policies
//! stand for, and the `PUT`s and `DELETE`s that turn what the upstream holds into that.
//!
//! Each proxy policy that applies to queues becomes the upstream policy
//! `dlx-proxy.<name>` with the same pattern and priority, applying to queues, with the keys
//! the upstream must enforce itself (`message-ttl`, `expires`, `max-length`,
//! `max-length-bytes`, `overflow`, `delivery-limit`) and the dead-letter target of a queue
//! declared through the proxy ([`super::super::declare::rewrite_declare`]): the capture
//! exchange, with the policy's own dead-letter exchange and routing key as a [`CaptureTag`]
//! in `dead-letter-routing-key`. With `proxy.delegate_to_upstream` the policy's own target is
//! given instead. Policies that apply to exchanges only are not mirrored (none of the keys
//! means anything to an exchange), and `all` becomes `queues`: an upstream policy that also
//! matched exchanges would hide the user's exchange policies of lower priority.
//!
//! The capture queue must never get such a policy (its messages would expire or overflow
//! into the capture exchange, and RabbitMQ's cycle rule would drop them): in capture mode the
//! upstream pattern is the proxy's pattern behind a lookahead that excludes the capture
//! queue's name, `^(?!<capture>$)[\s\S]*?(?:<pattern>)`, which RabbitMQ's PCRE patterns
//! understand and which matches every other name the original pattern matches.
//!
//! Only names with [`POLICY_PREFIX`] are ever changed or deleted: the user's own policies on
//! the upstream are not the proxy's business. In capture mode a prefixed policy is deleted
//! only when it routes into this proxy's capture exchange, so deployments with different
//! capture names (and different policies) on one vhost leave each other's policies alone.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::super::declare::{CaptureTag, DeadLetterHandling};
use crate::policy::{ApplyTo, Policy, PolicySet};

/// Prefix of every upstream policy the proxy owns.
pub const POLICY_PREFIX: &str = "dlx-proxy.";

/// One policy as the management API takes it (`PUT /api/policies/{vhost}/{name}`).
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamPolicy {
    /// The upstream name, [`POLICY_PREFIX`] included.
    pub name: String,
    pub pattern: String,
    pub apply_to: &'static str,
    pub priority: i32,
    pub definition: Map<String, Value>,
}

impl UpstreamPolicy {
    /// The mirror of one proxy policy; `None` for a policy that applies to exchanges only.
    pub fn mirror(policy: &Policy, handling: &DeadLetterHandling) -> Option<UpstreamPolicy> {
        if policy.apply_to == ApplyTo::Exchanges {
            return None;
        }
        let d = &policy.definition;
        let mut definition = Map::new();
        let mut number = |key: &str, value: Option<u64>| {
            if let Some(value) = value {
                definition.insert(key.to_string(), json!(value));
            }
        };
        number("message-ttl", d.message_ttl);
        number("expires", d.expires);
        number("max-length", d.max_length);
        number("max-length-bytes", d.max_length_bytes);
        number("delivery-limit", d.delivery_limit);
        if let Some(overflow) = d.overflow {
            definition.insert("overflow".into(), json!(overflow.as_str()));
        }
        match handling {
            DeadLetterHandling::Capture { exchange } => {
                definition.insert("dead-letter-exchange".into(), json!(exchange));
                let tag = CaptureTag {
                    dead_letter_exchange: d.dead_letter_exchange.clone(),
                    dead_letter_routing_key: d.dead_letter_routing_key.clone(),
                    // A policy's delivery limit is read from the TOML policy itself.
                    delivery_limit: None,
                };
                // A tag too long for a routing key is left out: the capture consumer then
                // reads the proxy's policy, as for a queue declared without dead-letter
                // arguments.
                if tag.dead_letter_exchange.is_some()
                    && let Some(tag) = tag.encode()
                {
                    definition.insert("dead-letter-routing-key".into(), json!(tag));
                }
            }
            DeadLetterHandling::Delegate => {
                if let Some(dlx) = &d.dead_letter_exchange {
                    definition.insert("dead-letter-exchange".into(), json!(dlx));
                    if let Some(key) = &d.dead_letter_routing_key {
                        definition.insert("dead-letter-routing-key".into(), json!(key));
                    }
                }
            }
        }
        let pattern = match handling {
            DeadLetterHandling::Capture { exchange } => {
                excluding(exchange, policy.pattern.as_str())
            }
            DeadLetterHandling::Delegate => policy.pattern.as_str().to_string(),
        };
        Some(UpstreamPolicy {
            name: format!("{POLICY_PREFIX}{}", policy.name),
            pattern,
            apply_to: "queues",
            priority: policy.priority,
            definition,
        })
    }

    /// The request body of `PUT /api/policies/{vhost}/{name}`.
    pub fn body(&self) -> Value {
        json!({
            "pattern": self.pattern,
            "apply-to": self.apply_to,
            "priority": self.priority,
            "definition": self.definition,
        })
    }

    /// Whether `current` (an entry of `GET /api/policies/{vhost}`) already says the same.
    fn is_current(&self, current: &Value) -> bool {
        current.get("pattern").and_then(Value::as_str) == Some(self.pattern.as_str())
            && current.get("apply-to").and_then(Value::as_str) == Some(self.apply_to)
            && current.get("priority").and_then(Value::as_i64) == Some(i64::from(self.priority))
            && current.get("definition").and_then(Value::as_object) == Some(&self.definition)
    }
}

/// `pattern` (unanchored) for every name but `capture` (the capture queue's).
fn excluding(capture: &str, pattern: &str) -> String {
    format!("^(?!{}$)[\\s\\S]*?(?:{pattern})", regex::escape(capture))
}

/// The capture exchange `handling` routes into: the mark of this proxy's upstream policies.
fn owner(handling: &DeadLetterHandling) -> Option<&str> {
    match handling {
        DeadLetterHandling::Capture { exchange } => Some(exchange),
        DeadLetterHandling::Delegate => None,
    }
}

/// The upstream policies of one vhost, by upstream name.
pub fn desired(
    policies: &PolicySet,
    vhost: &str,
    handling: &DeadLetterHandling,
) -> BTreeMap<String, UpstreamPolicy> {
    policies
        .iter()
        .filter(|policy| policy.vhost == vhost)
        .filter_map(|policy| UpstreamPolicy::mirror(policy, handling))
        .map(|mirror| (mirror.name.clone(), mirror))
        .collect()
}

/// One change to make upstream.
#[derive(Clone, Debug, PartialEq)]
pub enum SyncAction {
    Put(UpstreamPolicy),
    /// An upstream policy with [`POLICY_PREFIX`] the proxy no longer has.
    Delete(String),
}

/// What turns `current` (the body of `GET /api/policies/{vhost}`: every policy of the vhost,
/// the user's too) into `desired`: a `PUT` for each missing or different policy, a `DELETE`
/// for each prefixed policy of this proxy (`handling`'s capture exchange as dead-letter
/// exchange; with delegation every prefixed one) not desired. Entries without a name are
/// ignored.
pub fn plan(
    desired: &BTreeMap<String, UpstreamPolicy>,
    current: &[Value],
    handling: &DeadLetterHandling,
) -> Vec<SyncAction> {
    let owner = owner(handling);
    let owned: BTreeMap<&str, &Value> = current
        .iter()
        .filter_map(|entry| Some((entry.get("name")?.as_str()?, entry)))
        .filter(|(name, _)| name.starts_with(POLICY_PREFIX))
        .collect();
    let mut actions: Vec<SyncAction> = desired
        .values()
        .filter(|policy| {
            !owned
                .get(policy.name.as_str())
                .is_some_and(|entry| policy.is_current(entry))
        })
        .map(|policy| SyncAction::Put(policy.clone()))
        .collect();
    actions.extend(
        owned
            .iter()
            .filter(|(name, _)| !desired.contains_key(**name))
            .filter(|(_, entry)| {
                owner.is_none_or(|owner| {
                    entry["definition"]["dead-letter-exchange"].as_str() == Some(owner)
                })
            })
            .map(|(name, _)| SyncAction::Delete(name.to_string())),
    );
    actions
}

#[cfg(test)]
mod tests {
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
            "^(?!dlx\\-proxy\\.capture$)[\\s\\S]*?(?:^orders\\.)"
        );
        assert_eq!(mirror.priority, 7);
        assert_eq!(mirror.apply_to, "queues");
        let tag = CaptureTag {
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: Some("dead".into()),
            delivery_limit: None,
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
    fn the_capture_queue_is_kept_out_of_every_pattern() {
        // The upstream pattern (PCRE) is not the regex crate's (no lookahead); what it must
        // match is spelled out: the original's matches, minus the capture queue.
        assert_eq!(
            excluding("dlx-proxy.capture", ".*"),
            "^(?!dlx\\-proxy\\.capture$)[\\s\\S]*?(?:.*)"
        );
        assert_eq!(excluding("c", "a|^b$"), "^(?!c$)[\\s\\S]*?(?:a|^b$)");
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
}
