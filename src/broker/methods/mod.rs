//! The client's AMQP methods as operations on the broker state, one file per method family:
//! `declare` (exchanges, queues, bindings), `publish` (route and enqueue), `deliver`
//! (consume, get, dispatch to consumers), `settle` (ack, reject, nack, recover), `retry`
//! (rejections held for a retry tier and returned when due), `redrive` (moving dead letters
//! back, for [`crate::redrive`]), plus the
//! channel and connection `lifecycle` and the `upkeep` of timers, depth gauges and
//! policies. (Proxy mode's `proxy::ops` is something else: its publishes awaiting a confirm.)
//!
//! Each public method takes the broker lock once, validates like RabbitMQ (same reply codes
//! and texts), changes state, and writes any resulting deliveries into the write queues.
//! Permission checks happen in the server layer before these are called. The unit tests drive
//! a [`crate::broker::Broker`] directly and read what it wrote into a connection's write
//! queue (no sockets).

mod declare;
mod deliver;
mod lifecycle;
mod publish;
mod redrive;
mod retry;
mod settle;
#[cfg(test)]
pub(crate) mod test_support;
mod upkeep;

pub use declare::{DeclaredQueue, ExchangeDeclare, QueueDeclare};
pub use publish::PublishResult;
pub use redrive::{BatchLimits, RedriveBatch, RedriveCursor};
pub(crate) use upkeep::{on_ack_timers, on_timer};

use super::queue::QueueLimits;
use super::vhost::Queue;
use crate::amqp::reply::AmqpError;
use crate::policy::EffectiveQueueSettings;

fn no_vhost(vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no vhost '{vhost}'"))
}

fn no_queue(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no queue '{name}' in vhost '{vhost}'"))
}

fn no_exchange(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no exchange '{name}' in vhost '{vhost}'"))
}

fn locked(name: &str, vhost: &str) -> AmqpError {
    AmqpError::resource_locked(format!(
        "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
    ))
}

fn unknown_tag(tag: u64) -> AmqpError {
    AmqpError::precondition(format!("unknown delivery tag {tag}"))
}

/// Limits a queue enforces from its effective settings (`keep_dead_letters`:
/// `dead_letter.ttl_on_dead_letters = false`).
pub fn queue_limits(s: &EffectiveQueueSettings, keep_dead_letters: bool) -> QueueLimits {
    QueueLimits {
        keep_dead_letters,
        message_ttl: s.message_ttl,
        max_length: s.max_length,
        max_length_bytes: s.max_length_bytes,
        overflow: s.overflow,
        delivery_limit: s.delivery_limit,
    }
}

fn check_exclusive(q: &Queue, conn: u64, vhost: &str) -> Result<(), AmqpError> {
    match q.exclusive_owner {
        Some(owner) if owner != conn => Err(locked(&q.name, vhost)),
        _ => Ok(()),
    }
}
