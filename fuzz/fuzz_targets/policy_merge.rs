//! Policies (`policy`): validation of configured policies, matching a queue name to the
//! policy that applies, run-time `set`/`clear`, and the key-by-key merge with the queue's
//! own x-arguments into the settings the broker enforces.
//!
//! Checks: no panic (patterns are arbitrary regexes); a refused policy names one of the
//! documented keys; the policy chosen for a queue is, among the policies of its vhost that
//! apply to queues and whose pattern matches, one with the highest priority and the first
//! name among those; the merge takes the argument's exchange, routing key and overflow over
//! the policy's, and the lower of the two limits.
#![no_main]

use arbitrary::Arbitrary;
use dlx_proxy::config::PolicyConfig;
use dlx_proxy::policy::{PolicySet, effective_settings_with_policy};
use dlx_proxy::rabbit::args::{QueueArguments, parse_queue_arguments};
use dlx_proxy_fuzz::{Key, Text, Value, table};
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use std::collections::BTreeMap;

const NAMES: &[&str] = &["a", "b", "c", "d"];
const VHOSTS: &[&str] = &["/", "v", ""];
const PATTERNS: &[&str] = &["", ".*", "^q", "q1$", "^q[12]$", "(", "[", "."];
const APPLY_TO: &[&str] = &["queues", "exchanges", "all", "nothing"];
const DEFINITION_KEYS: &[&str] = &[
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "delivery-limit",
    "ha-mode",
];

fn pick<'a>(list: &[&'a str], i: u8) -> &'a str {
    list[i as usize % list.len()]
}

#[derive(Arbitrary, Debug)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(Text),
    List(Vec<u8>),
}

impl Json {
    fn get(&self) -> serde_json::Value {
        match self {
            Json::Null => serde_json::Value::Null,
            Json::Bool(b) => json!(b),
            Json::Int(n) => json!(n),
            Json::UInt(n) => json!(n),
            Json::Float(f) => json!(f),
            Json::Str(t) => json!(t.get()),
            Json::List(items) => json!(items),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Pattern {
    Known(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
struct Policy {
    name: u8,
    vhost: u8,
    pattern: Pattern,
    apply_to: u8,
    priority: i32,
    definition: Vec<(u8, Json)>,
}

impl Policy {
    fn config(&self) -> PolicyConfig {
        PolicyConfig {
            name: pick(NAMES, self.name).to_string(),
            vhost: pick(VHOSTS, self.vhost).to_string(),
            pattern: match &self.pattern {
                Pattern::Known(i) => pick(PATTERNS, *i).to_string(),
                Pattern::Other(s) => s.chars().take(32).collect(),
            },
            apply_to: pick(APPLY_TO, self.apply_to).to_string(),
            priority: self.priority,
            definition: self
                .definition
                .iter()
                .map(|(k, v)| (pick(DEFINITION_KEYS, *k).to_string(), v.get()))
                .collect::<BTreeMap<_, _>>(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Change {
    Set(Policy),
    Clear(u8, u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    policies: Vec<Policy>,
    changes: Vec<Change>,
    queue: Text,
    vhost: u8,
    arguments: Vec<(Key, Value)>,
    default_delivery_limit: Option<u64>,
}

const ERROR_KEYS: &[&str] = &["name", "vhost", "pattern", "apply_to"];

fn check_choice(set: &PolicySet, vhost: &str, queue: &str, args: &QueueArguments, dl: Option<u64>) {
    let chosen = set.for_queue(vhost, queue);
    let best = set
        .iter()
        .filter(|p| p.vhost == vhost && matches!(p.apply_to.as_str(), "queues" | "all"))
        .filter(|p| p.pattern.is_match(queue))
        .fold(
            None,
            |best: Option<&dlx_proxy::policy::Policy>, p| match best {
                Some(b) if b.priority > p.priority => Some(b),
                Some(b) if b.priority == p.priority && b.name <= p.name => Some(b),
                _ => Some(p),
            },
        );
    assert_eq!(chosen.map(|p| &p.name), best.map(|p| &p.name));

    let merged = effective_settings_with_policy(args, chosen, dl);
    assert_eq!(merged.policy, chosen.map(|p| p.name.clone()));
    let def = chosen.map(|p| p.definition.clone()).unwrap_or_default();
    let lower = |a: Option<u64>, p: Option<u64>| match (a, p) {
        (Some(a), Some(p)) => Some(a.min(p)),
        (a, p) => a.or(p),
    };
    assert_eq!(
        merged.dead_letter_exchange,
        args.dead_letter_exchange
            .clone()
            .or(def.dead_letter_exchange)
    );
    assert_eq!(
        merged.dead_letter_routing_key,
        args.dead_letter_routing_key
            .clone()
            .or(def.dead_letter_routing_key)
    );
    assert_eq!(merged.message_ttl, lower(args.message_ttl, def.message_ttl));
    assert_eq!(merged.expires, lower(args.expires, def.expires));
    assert_eq!(merged.max_length, lower(args.max_length, def.max_length));
    assert_eq!(
        merged.max_length_bytes,
        lower(args.max_length_bytes, def.max_length_bytes)
    );
    assert_eq!(
        merged.overflow,
        args.overflow.or(def.overflow).unwrap_or_default()
    );
    assert_eq!(
        merged.delivery_limit,
        lower(args.delivery_limit, def.delivery_limit).or(dl)
    );
}

fuzz_target!(|input: Input| {
    let configs: Vec<PolicyConfig> = input.policies.iter().map(Policy::config).collect();
    let mut set = match PolicySet::from_configs(&configs) {
        Ok(set) => set,
        Err(err) => {
            assert!(
                ERROR_KEYS.contains(&err.key.as_str()) || err.key.starts_with("definition."),
                "{err}"
            );
            PolicySet::default()
        }
    };
    for change in &input.changes {
        match change {
            Change::Set(policy) => {
                let before = set.len();
                let config = policy.config();
                let existed = set.get(&config.vhost, &config.name).is_some();
                match set.set(&config) {
                    Ok(()) => assert_eq!(set.len(), before + usize::from(!existed)),
                    Err(_) => assert_eq!(set.len(), before),
                }
            }
            Change::Clear(vhost, name) => {
                let (vhost, name) = (pick(VHOSTS, *vhost), pick(NAMES, *name));
                let existed = set.get(vhost, name).is_some();
                assert_eq!(set.clear(vhost, name), existed);
                assert!(set.get(vhost, name).is_none());
            }
        }
    }
    let args = parse_queue_arguments(&table(&input.arguments)).unwrap_or_default();
    let queue = input.queue.get();
    check_choice(
        &set,
        pick(VHOSTS, input.vhost),
        &queue,
        &args,
        input.default_delivery_limit,
    );
});
