//! TEMPORARY stub until the dead-letter rules land.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    Rejected,
    Expired,
    MaxLen,
    DeliveryLimit,
}
impl DeadLetterReason { pub fn as_str(&self) -> &'static str { match self { Self::Rejected => "rejected", Self::Expired => "expired", Self::MaxLen => "maxlen", Self::DeliveryLimit => "delivery_limit" } } }
#[derive(Clone, Debug, Default)]
pub struct DeadLetterOptions { pub x_death_total: bool, pub max_hops: Option<u32> }
