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
use crate::rabbit::args::{MAX_EXPIRY_MS, Overflow, QueueArguments};
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
}

/// The definition keys understood, as written in RabbitMQ policies.
pub const DEFINITION_KEYS: [&str; 8] = [
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "delivery-limit",
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
    /// Name of the applied policy.
    pub policy: Option<String>,
}

fn lower(argument: Option<u64>, policy: Option<u64>) -> Option<u64> {
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
mod tests {
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
                "delivery-limit": 16
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
            let err = PolicySet::from_configs(&[config("dlx-all", ".*", 0, definition.clone())])
                .unwrap_err();
            assert_eq!(err.policy, "dlx-all", "{definition}");
            assert_eq!(err.key, key, "{definition}");
            assert_eq!(err.message, message, "{definition}");
        }
        let err =
            PolicySet::from_configs(&[config("dlx-all", ".*", 0, json!({"message-ttl": -1}))])
                .unwrap_err();
        assert_eq!(
            err.to_string(),
            "policy 'dlx-all': key 'definition.message-ttl': expected a non-negative integer"
        );
    }

    #[test]
    fn unknown_and_empty_definitions_are_refused() {
        let err = PolicySet::from_configs(&[config("p", ".*", 0, json!({"ha-mode": "all"}))])
            .unwrap_err();
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
                policy: None,
            }
        );
    }

    #[test]
    fn settings_with_policy_record_its_name() {
        let set =
            PolicySet::from_configs(&[config("dlx-all", ".*", 0, json!({"message-ttl": 100}))])
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
}
