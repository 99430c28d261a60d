//! Policies: which one applies to a queue or exchange, and how it merges with the queue's own
//! x-arguments into the settings the broker (or the proxy) enforces.
//!
//! A [`PolicySet`] is built from the `[[policies]]` of the configuration (validated up front,
//! so a bad file is refused at start or reload) and can be changed at run time through the
//! admin API. Matching follows RabbitMQ: the pattern is an unanchored regex on the name, the
//! policy must apply to the kind of entity (`queues`, `exchanges` or `all`) and belong to the
//! same vhost, and the highest priority wins.
//!
//! Equal priorities: RabbitMQ sorts the matching policies by priority with a stable sort over
//! the order its store lists them, which 3.10's Mnesia table leaves unspecified (4.x's Khepri
//! lists small sets by name). We make the choice deterministic: among equal priorities the
//! policy whose name sorts first (bytewise) applies.
//!
//! [`effective_settings`] merges key by key the way RabbitMQ does for classic queues (used here
//! for every queue type): the dead-letter exchange, routing key and overflow of the argument
//! win over the policy; TTLs, length limits, `expires` and the delivery limit take the lower
//! of the two.

use crate::config::PolicyConfig;
use crate::rabbit::args::{MAX_EXPIRY_MS, MAX_RETRY_TIERS, Overflow, QueueArguments};
use regex::Regex;
use serde_json::Value;
use std::collections::BTreeMap;

/// Which entities a policy applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApplyTo {
    Queues,
    Exchanges,
    All,
}

impl ApplyTo {
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::Queues => "queues",
            ApplyTo::Exchanges => "exchanges",
            ApplyTo::All => "all",
        }
    }

    fn covers_queues(self) -> bool {
        matches!(self, ApplyTo::Queues | ApplyTo::All)
    }

    fn covers_exchanges(self) -> bool {
        matches!(self, ApplyTo::Exchanges | ApplyTo::All)
    }
}

/// The dead-letter related keys a policy definition may set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyDefinition {
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    /// Milliseconds.
    pub message_ttl: Option<u64>,
    /// Milliseconds, at least 1.
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Option<Overflow>,
    pub delivery_limit: Option<u64>,
    /// Milliseconds (RabbitMQ 3.12's `consumer-timeout`).
    pub consumer_timeout: Option<u64>,
    /// Milliseconds, one delay per retry tier (this service's `retry-delays`).
    pub retry_delays: Option<Vec<u64>>,
}

/// The definition keys understood, as written in RabbitMQ policies (plus this service's
/// `retry-delays`).
pub const DEFINITION_KEYS: [&str; 10] = [
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "delivery-limit",
    "consumer-timeout",
    "retry-delays",
];

/// A validated policy.
#[derive(Clone, Debug)]
pub struct Policy {
    pub name: String,
    pub vhost: String,
    /// Unanchored, like RabbitMQ's.
    pub pattern: Regex,
    pub apply_to: ApplyTo,
    pub priority: i32,
    pub definition: PolicyDefinition,
}

impl Policy {
    /// Validate one policy as configured.
    pub fn from_config(config: &PolicyConfig) -> Result<Policy, PolicyError> {
        let fail = |key: &str, message: String| PolicyError {
            policy: config.name.clone(),
            key: key.to_string(),
            message,
        };
        if config.name.is_empty() {
            return Err(fail("name", "must not be empty".into()));
        }
        if config.vhost.is_empty() {
            return Err(fail("vhost", "must not be empty".into()));
        }
        if config.pattern.is_empty() {
            return Err(fail(
                "pattern",
                "must not be empty (use \".*\" to match every name)".into(),
            ));
        }
        let pattern = Regex::new(&config.pattern)
            .map_err(|e| fail("pattern", format!("invalid regular expression: {e}")))?;
        let apply_to = match config.apply_to.as_str() {
            "queues" => ApplyTo::Queues,
            "exchanges" => ApplyTo::Exchanges,
            "all" => ApplyTo::All,
            other => {
                return Err(fail(
                    "apply_to",
                    format!("'{other}' is not one of 'queues', 'exchanges', 'all'"),
                ));
            }
        };
        let definition = parse_definition(&config.definition)
            .map_err(|(key, message)| fail(&format!("definition.{key}"), message))?;
        Ok(Policy {
            name: config.name.clone(),
            vhost: config.vhost.clone(),
            pattern,
            apply_to,
            priority: config.priority,
            definition,
        })
    }
}

fn parse_definition(
    definition: &BTreeMap<String, Value>,
) -> Result<PolicyDefinition, (String, String)> {
    if definition.is_empty() {
        return Err((
            "*".to_string(),
            format!("is empty (keys: {})", DEFINITION_KEYS.join(", ")),
        ));
    }
    let mut parsed = PolicyDefinition::default();
    for (key, value) in definition {
        let err = |message: &str| (key.clone(), message.to_string());
        let text = || {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| err("expected a string"))
        };
        let non_negative = || {
            value
                .as_u64()
                .ok_or_else(|| err("expected a non-negative integer"))
        };
        match key.as_str() {
            "dead-letter-exchange" => {
                let name = text()?;
                if name.len() > 255 {
                    return Err(err("exchange names are at most 255 bytes"));
                }
                parsed.dead_letter_exchange = Some(name);
            }
            "dead-letter-routing-key" => {
                let routing_key = text()?;
                if routing_key.len() > 255 {
                    return Err(err("routing keys are at most 255 bytes"));
                }
                parsed.dead_letter_routing_key = Some(routing_key);
            }
            "message-ttl" => {
                let ttl = non_negative()?;
                if ttl > MAX_EXPIRY_MS {
                    return Err(err("must be at most 315360000000 (ten years in ms)"));
                }
                parsed.message_ttl = Some(ttl);
            }
            "expires" => {
                let expires = value
                    .as_u64()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| err("expected a positive integer"))?;
                if expires > MAX_EXPIRY_MS {
                    return Err(err("must be at most 315360000000 (ten years in ms)"));
                }
                parsed.expires = Some(expires);
            }
            "max-length" => parsed.max_length = Some(non_negative()?),
            "max-length-bytes" => parsed.max_length_bytes = Some(non_negative()?),
            "overflow" => {
                let mode = text()?;
                parsed.overflow = Some(mode.parse::<Overflow>().map_err(|_| {
                    err("expected 'drop-head', 'reject-publish' or 'reject-publish-dlx'")
                })?);
            }
            "delivery-limit" => parsed.delivery_limit = Some(non_negative()?),
            "consumer-timeout" => parsed.consumer_timeout = Some(non_negative()?),
            "retry-delays" => {
                let delays = value
                    .as_array()
                    .filter(|a| !a.is_empty() && a.len() <= MAX_RETRY_TIERS)
                    .ok_or_else(|| {
                        err(&format!(
                            "expected an array of 1 to {MAX_RETRY_TIERS} delays in ms"
                        ))
                    })?;
                let delays = delays
                    .iter()
                    .map(|d| d.as_u64().filter(|d| *d <= MAX_EXPIRY_MS))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| {
                        err("each delay must be an integer from 0 to 315360000000 (ms)")
                    })?;
                parsed.retry_delays = Some(delays);
            }
            _ => {
                return Err(err(&format!(
                    "unknown policy key (supported: {})",
                    DEFINITION_KEYS.join(", ")
                )));
            }
        }
    }
    Ok(parsed)
}

/// A policy refused at load or at `set`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("policy '{policy}': key '{key}': {message}")]
pub struct PolicyError {
    /// The policy's name (may be empty when the name is what is wrong).
    pub policy: String,
    /// The offending key: `name`, `vhost`, `pattern`, `apply_to` or `definition.<key>`.
    pub key: String,
    pub message: String,
}

/// Every policy, indexed by vhost then name.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    by_vhost: BTreeMap<String, BTreeMap<String, Policy>>,
    /// Changes whenever the set is built or changed, so a decision taken from it can be
    /// cached and recognised as stale ([`PolicySet::revision`]).
    revision: u64,
}

/// Source of [`PolicySet::revision`] values (0 is the empty default set).
static NEXT_POLICY_REVISION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_policy_revision() -> u64 {
    NEXT_POLICY_REVISION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl PolicySet {
    /// Validate every policy; refuses duplicates of (vhost, name).
    pub fn from_configs(configs: &[PolicyConfig]) -> Result<PolicySet, PolicyError> {
        let mut set = PolicySet {
            revision: next_policy_revision(),
            ..PolicySet::default()
        };
        for config in configs {
            let policy = Policy::from_config(config)?;
            let names = set.by_vhost.entry(policy.vhost.clone()).or_default();
            if names.contains_key(&policy.name) {
                return Err(PolicyError {
                    policy: policy.name.clone(),
                    key: "name".into(),
                    message: format!("defined twice in vhost '{}'", policy.vhost),
                });
            }
            names.insert(policy.name.clone(), policy);
        }
        Ok(set)
    }

    fn best_match(
        &self,
        vhost: &str,
        name: &str,
        applies: impl Fn(ApplyTo) -> bool,
    ) -> Option<&Policy> {
        let mut best: Option<&Policy> = None;
        // Names iterate in ascending order: a later policy replaces the best only with a
        // strictly higher priority, so ties go to the first name.
        for policy in self.by_vhost.get(vhost)?.values() {
            if applies(policy.apply_to)
                && best.is_none_or(|b| policy.priority > b.priority)
                && policy.pattern.is_match(name)
            {
                best = Some(policy);
            }
        }
        best
    }

    /// Differs between any two sets with different contents (and usually between any two
    /// sets): what a decision cached from this set is checked against.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The policy that applies to a queue, if any.
    pub fn for_queue(&self, vhost: &str, queue: &str) -> Option<&Policy> {
        self.best_match(vhost, queue, ApplyTo::covers_queues)
    }

    /// The policy that applies to an exchange, if any.
    pub fn for_exchange(&self, vhost: &str, exchange: &str) -> Option<&Policy> {
        self.best_match(vhost, exchange, ApplyTo::covers_exchanges)
    }

    /// Add or replace a policy (admin API). Nothing changes when it is invalid.
    pub fn set(&mut self, config: &PolicyConfig) -> Result<(), PolicyError> {
        let policy = Policy::from_config(config)?;
        self.by_vhost
            .entry(policy.vhost.clone())
            .or_default()
            .insert(policy.name.clone(), policy);
        self.revision = next_policy_revision();
        Ok(())
    }

    /// Remove a policy; `false` when there was none.
    pub fn clear(&mut self, vhost: &str, name: &str) -> bool {
        let Some(names) = self.by_vhost.get_mut(vhost) else {
            return false;
        };
        let removed = names.remove(name).is_some();
        self.revision = next_policy_revision();
        if names.is_empty() {
            self.by_vhost.remove(vhost);
        }
        removed
    }

    pub fn get(&self, vhost: &str, name: &str) -> Option<&Policy> {
        self.by_vhost.get(vhost)?.get(name)
    }

    pub fn len(&self) -> usize {
        self.by_vhost.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_vhost.is_empty()
    }

    /// Every policy, ordered by vhost then name.
    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.by_vhost.values().flat_map(BTreeMap::values)
    }
}

/// What a queue enforces once its arguments and its policy are merged.
#[derive(Clone, Debug, PartialEq)]
pub struct EffectiveQueueSettings {
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    pub message_ttl: Option<u64>,
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    pub delivery_limit: Option<u64>,
    /// Milliseconds, the lower of `x-consumer-timeout` and the policy's `consumer-timeout`
    /// (`limits.consumer_timeout` is applied on top where deliveries are tracked).
    pub consumer_timeout: Option<u64>,
    /// Milliseconds per retry tier: `x-retry-delays` wins over the policy's `retry-delays`
    /// (a list, not a limit, so not the lower of the two).
    pub retry_delays: Option<Vec<u64>>,
    /// Name of the applied policy.
    pub policy: Option<String>,
}

/// The lower of two optional limits (either alone when the other is absent): how an argument
/// meets a policy, and how a queue's consumer timeout meets `limits.consumer_timeout`.
pub fn lower(argument: Option<u64>, policy: Option<u64>) -> Option<u64> {
    match (argument, policy) {
        (Some(a), Some(p)) => Some(a.min(p)),
        (a, p) => a.or(p),
    }
}

/// Merge a queue's arguments with a policy definition, key by key (RabbitMQ's rules for
/// classic queues). `default_delivery_limit` applies only when neither sets a limit. The
/// `policy` field is left `None`: see [`effective_settings_with_policy`].
pub fn effective_settings(
    args: &QueueArguments,
    policy: Option<&PolicyDefinition>,
    default_delivery_limit: Option<u64>,
) -> EffectiveQueueSettings {
    let empty = PolicyDefinition::default();
    let p = policy.unwrap_or(&empty);
    EffectiveQueueSettings {
        dead_letter_exchange: args
            .dead_letter_exchange
            .clone()
            .or_else(|| p.dead_letter_exchange.clone()),
        dead_letter_routing_key: args
            .dead_letter_routing_key
            .clone()
            .or_else(|| p.dead_letter_routing_key.clone()),
        message_ttl: lower(args.message_ttl, p.message_ttl),
        expires: lower(args.expires, p.expires),
        max_length: lower(args.max_length, p.max_length),
        max_length_bytes: lower(args.max_length_bytes, p.max_length_bytes),
        overflow: args.overflow.or(p.overflow).unwrap_or_default(),
        delivery_limit: lower(args.delivery_limit, p.delivery_limit).or(default_delivery_limit),
        consumer_timeout: lower(args.consumer_timeout, p.consumer_timeout),
        retry_delays: args.retry_delays.clone().or_else(|| p.retry_delays.clone()),
        policy: None,
    }
}

/// [`effective_settings`] with the applied policy's name recorded.
pub fn effective_settings_with_policy(
    args: &QueueArguments,
    policy: Option<&Policy>,
    default_delivery_limit: Option<u64>,
) -> EffectiveQueueSettings {
    let mut settings =
        effective_settings(args, policy.map(|p| &p.definition), default_delivery_limit);
    settings.policy = policy.map(|p| p.name.clone());
    settings
}

#[cfg(test)]
mod tests;
