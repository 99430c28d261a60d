//! Messages as the broker stores them.
//!
//! A [`Message`] is immutable once published and shared (`Arc`) by every queue it was routed
//! to. Its properties are kept as the publisher's raw bytes and decoded only when a rule needs
//! to look inside, which keeps a queued 100-byte message small and delivers it byte for byte.

use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use bytes::Bytes;

use crate::amqp::content::{ContentError, decode_properties};

/// A published (or dead-lettered) message.
#[derive(Debug)]
pub struct Message {
    /// The exchange it was last published or dead-lettered to ("" = default exchange).
    pub exchange: Box<str>,
    /// All keys it was routed with: the publish key first, then CC keys, then BCC keys.
    pub routing_keys: Box<[Box<str>]>,
    /// Property flags and list, as they go on the wire (BCC already removed).
    pub raw_properties: Bytes,
    pub body: Bytes,
    /// Per-message TTL from the `expiration` property, in milliseconds.
    pub expiration_ms: Option<u64>,
    /// True once the broker itself dead-lettered this message (its x-death is ours).
    pub dead_lettered: bool,
}

impl Message {
    /// The routing key delivered to consumers (the publish key).
    pub fn routing_key(&self) -> &str {
        self.routing_keys.first().map_or("", |k| k)
    }

    pub fn properties(&self) -> Result<BasicProperties, ContentError> {
        decode_properties(&self.raw_properties)
    }

    /// Body bytes, the unit of max-length-bytes.
    pub fn body_len(&self) -> u64 {
        self.body.len() as u64
    }

    pub fn routing_keys_vec(&self) -> Vec<String> {
        self.routing_keys.iter().map(|k| k.to_string()).collect()
    }
}

/// A message inside one queue, with that queue's bookkeeping.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    pub message: Arc<Message>,
    /// Position in the queue's publish order; requeued messages go back to their position.
    pub seq: u64,
    /// Milliseconds since the broker's epoch when it entered the queue.
    pub enqueued_at: u64,
    /// Absolute expiry (broker milliseconds), the lower of queue and message TTL.
    pub expires_at: Option<u64>,
    /// How many times it was returned to the queue (x-delivery-count).
    pub delivery_count: u32,
    pub redelivered: bool,
}

impl QueuedMessage {
    pub fn body_len(&self) -> u64 {
        self.message.body_len()
    }
}
