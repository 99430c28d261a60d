//! The pure part of the upstream policy sync: which RabbitMQ policies the proxy's policies
//! stand for, and the `PUT`s and `DELETE`s that turn what the upstream holds into that.
//!
//! Each proxy policy that applies to queues becomes the upstream policy
//! `<capture name>.<name>` (`dlx-proxy.capture.<name>` with the default
//! `proxy.capture_name`; [`PolicyOwner`]) with the same pattern and priority, applying to queues, with the keys
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
//! The capture name in the upstream name keeps deployments that share a vhost (each with its
//! own capture name) apart even where their policies have the same names. Only a
//! deployment's own upstream policies are ever changed or deleted ([`PolicyOwner::owns`]):
//! the user's own policies, and other deployments', are not its business. Names with
//! [`LEGACY_PREFIX`], which versions before the capture name was part of them gave, are
//! taken over: deleted once their grace has passed, the same policy being under its new name.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::super::capture::DEFAULT_CAPTURE_NAME;
use super::super::declare::{CaptureTag, DeadLetterHandling};
use crate::policy::{ApplyTo, Policy, PolicySet};

/// Prefix of the upstream policies of versions that named them `dlx-proxy.<name>`, whatever
/// the capture name.
pub const LEGACY_PREFIX: &str = "dlx-proxy.";

/// The deployment whose upstream policies these are: the instances that share one capture
/// name (`proxy.capture_name`, set even with delegation, where it only names policies) and
/// one policy set.
#[derive(Clone, Debug)]
pub struct PolicyOwner {
    capture_name: String,
    handling: DeadLetterHandling,
}

impl PolicyOwner {
    pub fn new(capture_name: &str, handling: DeadLetterHandling) -> PolicyOwner {
        PolicyOwner {
            capture_name: capture_name.to_string(),
            handling,
        }
    }

    pub fn handling(&self) -> &DeadLetterHandling {
        &self.handling
    }

    /// The upstream name of the proxy policy `name`: `<capture name>.<name>`.
    pub fn upstream_name(&self, name: &str) -> String {
        format!("{}.{name}", self.capture_name)
    }

    /// Whether the upstream policy `name` (`entry`, as listed) is this deployment's, so that
    /// it puts it right or deletes it; `desired` is what the deployment has now.
    ///
    /// - Capturing, a policy is the deployment's when it routes into its capture exchange
    ///   and has its name prefix or [`LEGACY_PREFIX`]: no other deployment's policy routes
    ///   there.
    /// - Delegating, there is no such mark: a policy is the deployment's when it has its
    ///   name prefix, or is the legacy name of one of its policies (but not a name under the
    ///   default capture name, `dlx-proxy.capture.*`: another deployment's new one), and is not
    ///   a capturing deployment's (whose pattern starts by keeping its capture queue out, in
    ///   this version's form or the older `^(?!<capture>$)`).
    pub fn owns(
        &self,
        name: &str,
        entry: &Value,
        desired: &BTreeMap<String, UpstreamPolicy>,
    ) -> bool {
        let prefixed = name
            .strip_prefix(self.capture_name.as_str())
            .is_some_and(|rest| rest.starts_with('.'));
        let dead_letter_exchange = entry["definition"]["dead-letter-exchange"].as_str();
        match &self.handling {
            DeadLetterHandling::Capture { exchange } => {
                (prefixed || name.starts_with(LEGACY_PREFIX))
                    && dead_letter_exchange == Some(exchange.as_str())
            }
            DeadLetterHandling::Delegate => {
                let captures = dead_letter_exchange.is_some_and(|dlx| {
                    let lookahead = format!("^(?!{}", regex::escape(dlx));
                    entry["pattern"]
                        .as_str()
                        .is_some_and(|pattern| pattern.starts_with(&lookahead))
                });
                let defaults = name
                    .strip_prefix(DEFAULT_CAPTURE_NAME)
                    .is_some_and(|rest| rest.starts_with('.'));
                let legacy = !defaults
                    && name
                        .strip_prefix(LEGACY_PREFIX)
                        .is_some_and(|old| desired.contains_key(&self.upstream_name(old)));
                !captures && (prefixed || legacy)
            }
        }
    }
}

/// One policy as the management API takes it (`PUT /api/policies/{vhost}/{name}`).
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamPolicy {
    /// The upstream name ([`PolicyOwner::upstream_name`]).
    pub name: String,
    pub pattern: String,
    pub apply_to: &'static str,
    pub priority: i32,
    pub definition: Map<String, Value>,
}

impl UpstreamPolicy {
    /// The mirror of one proxy policy; `None` for a policy that applies to exchanges only.
    pub fn mirror(policy: &Policy, owner: &PolicyOwner) -> Option<UpstreamPolicy> {
        let handling = &owner.handling;
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
            name: owner.upstream_name(&policy.name),
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

/// The upstream policies of one vhost, by upstream name.
pub fn desired(
    policies: &PolicySet,
    vhost: &str,
    owner: &PolicyOwner,
) -> BTreeMap<String, UpstreamPolicy> {
    policies
        .iter()
        .filter(|policy| policy.vhost == vhost)
        .filter_map(|policy| UpstreamPolicy::mirror(policy, owner))
        .map(|mirror| (mirror.name.clone(), mirror))
        .collect()
}

/// One change to make upstream.
#[derive(Clone, Debug, PartialEq)]
pub enum SyncAction {
    Put(UpstreamPolicy),
    /// An upstream policy of the deployment's ([`PolicyOwner::owns`]) it no longer has.
    Delete(String),
}

/// What turns `current` (the body of `GET /api/policies/{vhost}`: every policy of the vhost,
/// the user's too) into `desired`: a `PUT` for each missing or different policy, a `DELETE`
/// for each policy of `owner`'s ([`PolicyOwner::owns`]) not desired. Entries without a name
/// are ignored.
pub fn plan(
    desired: &BTreeMap<String, UpstreamPolicy>,
    current: &[Value],
    owner: &PolicyOwner,
) -> Vec<SyncAction> {
    let listed: BTreeMap<&str, &Value> = current
        .iter()
        .filter_map(|entry| Some((entry.get("name")?.as_str()?, entry)))
        .collect();
    let mut actions: Vec<SyncAction> = desired
        .values()
        .filter(|policy| {
            !listed
                .get(policy.name.as_str())
                .is_some_and(|entry| policy.is_current(entry))
        })
        .map(|policy| SyncAction::Put(policy.clone()))
        .collect();
    actions.extend(
        listed
            .iter()
            .filter(|(name, _)| !desired.contains_key(**name))
            .filter(|(name, entry)| owner.owns(name, entry, desired))
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
    /// most one entry per upstream policy of the deployment's.
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
