//! Proxy work in flight: a publish on the proxy's channel that must be confirmed before the
//! message it replaces is settled upstream.

use std::sync::Arc;
use std::time::Instant;

use crate::deadletter::DeadLetterReason;

/// Whose message the operation settles once its publish is confirmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A delivery on a client channel (settled with basic.ack / requeued with basic.nack on
    /// that channel, if it is still the same opening of the channel).
    Client {
        channel: u16,
        channel_id: u64,
        tag: u64,
    },
    /// A capture delivery on a service connection (settled on its capture channel, if the
    /// consumer is still the one of that epoch).
    Capture { tag: u64, epoch: u64 },
}

/// What the publish is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The message died; the publish goes to its dead-letter exchange.
    DeadLetter(DeadLetterReason),
    /// A requeue on a queue with a delivery limit; the publish goes back to the queue.
    Requeue,
}

/// One operation.
#[derive(Clone, Debug)]
pub struct Op {
    pub origin: Origin,
    pub purpose: Purpose,
    /// The queue the message died in (or is requeued to).
    pub queue: Arc<str>,
    /// When the proxy learned of the death or requeue.
    pub started: Instant,
}

/// How the original message is settled once the operation ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Remove it from its queue (the replacement is confirmed, or it is dropped on purpose).
    Ack,
    /// Put it back (the replacement was not confirmed): it will be delivered again.
    Requeue,
}
