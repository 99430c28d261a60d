//! TEMPORARY stub until the argument validation module lands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    #[default]
    DropHead,
    RejectPublish,
    RejectPublishDlx,
}
use amq_protocol::types::FieldTable;
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
}
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueArguments {
    pub queue_type: QueueType,
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    pub message_ttl: Option<u64>,
    pub expires: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Option<Overflow>,
    pub delivery_limit: Option<u64>,
}
#[derive(Debug)]
pub struct ArgumentError {
    pub argument: String,
    pub detail: String,
}
impl ArgumentError {
    pub fn reply_text(&self, q: &str, v: &str) -> String {
        format!(
            "PRECONDITION_FAILED - invalid arg '{}' for queue '{q}' in vhost '{v}': {}",
            self.argument, self.detail
        )
    }
}
pub fn parse_queue_arguments(_args: &FieldTable) -> Result<QueueArguments, ArgumentError> {
    Ok(QueueArguments::default())
}
pub fn parse_expiration(e: &str) -> Result<u64, String> {
    e.parse().map_err(|_| e.to_string())
}
pub fn check_equivalent(_a: &FieldTable, _b: &FieldTable) -> Result<(), String> {
    Ok(())
}
