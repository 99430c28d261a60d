//! TEMPORARY stub until the dead-letter rules land.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    Rejected,
    Expired,
    MaxLen,
    DeliveryLimit,
}
impl DeadLetterReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Rejected => "rejected",
            Self::Expired => "expired",
            Self::MaxLen => "maxlen",
            Self::DeliveryLimit => "delivery_limit",
        }
    }
}
#[derive(Clone, Debug, Default)]
pub struct DeadLetterOptions {
    pub compat: Compat,
    pub x_death_total: bool,
    pub max_hops: Option<u32>,
}
use amq_protocol::protocol::BasicProperties;
pub struct DeadLetterTarget<'a> {
    pub exchange: &'a str,
    pub routing_key: Option<&'a str>,
}
pub struct DeathEvent<'a> {
    pub queue: &'a str,
    pub reason: DeadLetterReason,
    pub exchange: &'a str,
    pub routing_keys: &'a [String],
    pub now_secs: u64,
    pub trust_existing_history: bool,
}
pub struct DeadLetteredMessage {
    pub properties: BasicProperties,
    pub exchange: String,
    pub routing_keys: Vec<String>,
}
#[derive(Debug)]
pub enum DeadLetterDrop {
    HopLimit,
}
pub fn dead_letter(
    props: &BasicProperties,
    _e: &DeathEvent,
    t: &DeadLetterTarget,
    _o: &DeadLetterOptions,
) -> Result<DeadLetteredMessage, DeadLetterDrop> {
    Ok(DeadLetteredMessage {
        properties: props.clone(),
        exchange: t.exchange.to_string(),
        routing_keys: t
            .routing_key
            .map(|k| vec![k.to_string()])
            .unwrap_or_else(|| _e.routing_keys.to_vec()),
    })
}
pub fn is_cycle(_r: DeadLetterReason, _p: &BasicProperties, _t: &str) -> bool {
    false
}
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compat {
    #[default]
    V3,
    V4,
}
impl std::str::FromStr for Compat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "3" => Ok(Self::V3),
            "4" => Ok(Self::V4),
            _ => Err(s.into()),
        }
    }
}
