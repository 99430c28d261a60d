//! TEMPORARY stub until the policy module lands.
use crate::broker::args::{Overflow, QueueArguments};
use crate::config::PolicyConfig;
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyDefinition {
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    pub message_ttl: Option<u64>,
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Option<Overflow>,
    pub delivery_limit: Option<u64>,
}
pub struct Policy {
    pub name: String,
    pub definition: PolicyDefinition,
}
#[derive(Debug)]
pub struct PolicyError(String);
impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
#[derive(Default)]
pub struct PolicySet {
    p: Vec<Policy>,
}
impl PolicySet {
    pub fn from_configs(_c: &[PolicyConfig]) -> Result<PolicySet, PolicyError> {
        Ok(PolicySet::default())
    }
    pub fn for_queue(&self, _vhost: &str, _queue: &str) -> Option<&Policy> {
        self.p.first()
    }
    pub fn set(&mut self, _c: &PolicyConfig) -> Result<(), PolicyError> {
        Ok(())
    }
    pub fn clear(&mut self, _v: &str, _n: &str) -> bool {
        false
    }
}
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EffectiveQueueSettings {
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    pub message_ttl: Option<u64>,
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    pub delivery_limit: Option<u64>,
    pub policy: Option<String>,
}
pub fn effective_settings(
    a: &QueueArguments,
    _p: Option<&PolicyDefinition>,
    d: Option<u64>,
) -> EffectiveQueueSettings {
    EffectiveQueueSettings {
        dead_letter_exchange: a.dead_letter_exchange.clone(),
        dead_letter_routing_key: a.dead_letter_routing_key.clone(),
        message_ttl: a.message_ttl,
        expires: a.expires,
        max_length: a.max_length,
        max_length_bytes: a.max_length_bytes,
        overflow: a.overflow.unwrap_or_default(),
        delivery_limit: a.delivery_limit.or(d),
        policy: None,
    }
}
