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
//! into the capture exchange, and RabbitMQ's cycle rule would drop them), nor must the delay
//! queues of the retry tiers (`<capture>.retry.<ms>`: a policy's TTL would retry early, its
//! `expires` delete a delay queue with the retries waiting in it, its length limit drop
//! them): in capture mode the upstream pattern is the proxy's pattern behind a lookahead that
//! excludes those names, `^(?!<capture>(?:\.retry\.[0-9]+)?$)[\s\S]*?(?:<pattern>)`, which
//! RabbitMQ's PCRE patterns understand and which matches every other name the original
//! pattern matches.
//!
//! Only names with [`POLICY_PREFIX`] are ever changed or deleted: the user's own policies on
//! the upstream are not the proxy's business. In capture mode a prefixed policy is deleted
//! only when it routes into this proxy's capture exchange, so deployments with different
//! capture names (and different policies) on one vhost leave each other's policies alone.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

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
                    // So are its retry tiers.
                    retry_delays: None,
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

/// `pattern` (unanchored) for every name but `capture` (the capture queue's) and its delay
/// queues (`<capture>.retry.<ms>`, [`crate::proxy::retry_tiers::delay_queue_name`]).
fn excluding(capture: &str, pattern: &str) -> String {
    format!(
        "^(?!{}(?:\\.retry\\.[0-9]+)?$)[\\s\\S]*?(?:{pattern})",
        regex::escape(capture)
    )
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
mod tests;

/// Deletes wait for a grace: a policy is deleted only once every round for
/// `upstream.management_delete_grace_secs` planned its deletion. Instances of one deployment
/// with different policies for a while (a rolling update) then do not delete each other's
/// policies every round. Pure: the caller gives the time.
#[derive(Debug)]
pub struct DeleteGrace {
    grace: Duration,
    /// Since when each (vhost, name) has been planned for deletion, round after round. At
    /// most one entry per prefixed upstream policy of the proxy's.
    since: BTreeMap<(String, String), Instant>,
}

impl DeleteGrace {
    pub fn new(grace: Duration) -> Self {
        DeleteGrace {
            grace,
            since: BTreeMap::new(),
        }
    }

    /// Drops from `actions` (a round's plan for `vhost` at `now`) the deletes whose grace has
    /// not passed; a policy no longer planned for deletion starts again. Returns how many
    /// deletes wait.
    pub fn admit(&mut self, vhost: &str, actions: &mut Vec<SyncAction>, now: Instant) -> usize {
        let planned: BTreeSet<String> = actions
            .iter()
            .filter_map(|a| match a {
                SyncAction::Delete(name) => Some(name.clone()),
                SyncAction::Put(_) => None,
            })
            .collect();
        self.since
            .retain(|(v, name), _| v != vhost || planned.contains(name));
        let mut waiting = 0;
        actions.retain(|a| {
            let SyncAction::Delete(name) = a else {
                return true;
            };
            let key = (vhost.to_string(), name.clone());
            let since = *self.since.entry(key.clone()).or_insert(now);
            // A delete that fails is made again at the next round; one that is made ends
            // the entry ([`DeleteGrace::deleted`]).
            if now.saturating_duration_since(since) >= self.grace {
                true
            } else {
                waiting += 1;
                false
            }
        });
        waiting
    }

    /// `name` was deleted in `vhost`: if another instance puts it back, its deletion waits a
    /// whole grace again.
    pub fn deleted(&mut self, vhost: &str, name: &str) {
        self.since.remove(&(vhost.to_string(), name.to_string()));
    }

    /// A round of `vhost` that did not plan (the management API failed): what was planned
    /// waits a whole grace again, so time without rounds never counts as grace.
    pub fn forget(&mut self, vhost: &str) {
        self.since.retain(|(v, _), _| v != vhost);
    }

    /// Only the vhosts of the round keep their entries.
    pub fn keep_vhosts(&mut self, vhosts: &BTreeSet<String>) {
        self.since.retain(|(v, _), _| vhosts.contains(v));
    }
}
