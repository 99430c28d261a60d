//! Proxy work in flight: a publish on the proxy's channel that must be confirmed before the
//! message it replaces is settled upstream. An operation whose publish is refused is held and
//! published again ([`super::retry`]), so it keeps its message.

use std::sync::Arc;
use std::time::Instant;

use super::inflight::KEPT_OVERHEAD;
use super::publisher::OutgoingMessage;
use super::retry::RetryReason;
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
    /// A dead letter the upstream expired, put back into its queue unchanged
    /// (`dead_letter.ttl_on_dead_letters = false`).
    KeepDeadLetter,
    /// A rejection on a queue with retry tiers: the publish goes to the delay queue of
    /// `delay_ms` ([`super::retry_tiers`]), through the vhost's service connection.
    RetryHold { tier: u64, delay_ms: u64 },
    /// A message whose delay passed, published back into its queue.
    RetryReturn,
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
    /// The publish (kept to publish it again if it is refused).
    pub message: OutgoingMessage,
    /// How many publishes of it were refused so far (0: the first is in flight).
    pub refusals: u32,
    /// Bytes charged against the client connection's inflight bound, from its first publish
    /// until it ends (0: not charged; a service connection's operations never are).
    pub charged: usize,
    /// Which connection publishes it (see `intercept`).
    pub route: Route,
    /// The service connection took it once to spare a consumer's connection (counted then).
    pub spared: bool,
}

/// Which upstream connection publishes an operation of a client session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The proxy's publisher channel on the client's connection.
    Client,
    /// The vhost's service connection, because it must: the client's user was refused the
    /// dead-letter exchange, or the message goes to a retry tier's delay queue.
    Service,
    /// The vhost's service connection, only to keep a consumer's connection a consumer's
    /// (a resource alarm blocks a connection that publishes): back to the client's
    /// connection when the service connection cannot take it.
    SparingConsumer,
}

impl Route {
    /// Whether the vhost's service connection publishes it.
    pub fn is_service(self) -> bool {
        self != Route::Client
    }
}

impl Op {
    /// A new operation for a first publish.
    pub fn new(
        origin: Origin,
        purpose: Purpose,
        queue: Arc<str>,
        message: OutgoingMessage,
        started: Instant,
    ) -> Op {
        Op {
            origin,
            purpose,
            queue,
            started,
            message,
            refusals: 0,
            charged: 0,
            route: Route::Client,
            spared: false,
        }
    }

    /// Its publish was refused (once more): counts the refusal and logs it (the first at warn
    /// level, later ones at debug); returns the retry attempt number (1 after the first).
    pub fn note_refusal(&mut self, reason: RetryReason) -> u32 {
        self.refusals = self.refusals.saturating_add(1);
        if self.refusals == 1 {
            tracing::warn!(
                queue = &*self.queue,
                exchange = %self.message.exchange,
                reason = reason.as_str(),
                "dead-letter publish refused; the message is held and retried"
            );
        } else {
            tracing::debug!(
                queue = &*self.queue,
                reason = reason.as_str(),
                refusals = self.refusals,
                "dead-letter publish refused again"
            );
        }
        self.refusals
    }

    /// Whether it is counted in the held gauge (`dead_letters_held`): it was refused at least
    /// once, and each refusal that is not given up holds it.
    pub fn is_held(&self) -> bool {
        self.refusals > 0
    }

    /// What keeping it costs: its properties, body and names plus the per-delivery overhead
    /// (as a kept delivery is charged).
    pub fn charge(&self) -> usize {
        self.message.raw_properties.len()
            + self.message.body.len()
            + self.message.exchange.len()
            + self.message.routing_key.len()
            + KEPT_OVERHEAD
    }
}

/// How the original message is settled once the operation ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Remove it from its queue (the replacement is confirmed, or it is dropped on purpose).
    Ack,
    /// Put it back (the replacement was not confirmed): it will be delivered again.
    Requeue,
}
