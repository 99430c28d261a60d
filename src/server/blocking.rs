//! Publisher blocking under the memory and disk alarms (embedded mode), as RabbitMQ's reader
//! does it.
//!
//! While an alarm is raised (the memory alarm of [`crate::memory`], the disk alarm of
//! [`crate::storage::disk`]), a connection that sends a `basic.publish` is blocked right
//! after that method frame: it gets `connection.blocked` ("low on memory", "low on disk", or
//! both joined by " & " as RabbitMQ writes them) if it announced the `connection.blocked`
//! capability, and its task stops reading the socket, so TCP backpressure holds the publisher
//! (the message's content waits in the socket). Its writer keeps running: deliveries and
//! heartbeats still go out. When every alarm has cleared, `connection.unblocked` is sent and
//! reading resumes. Connections that do not publish while an alarm is raised are never
//! blocked, so consumers keep draining queues.

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable};
use tokio::sync::watch;

use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_METHOD, RawFrame, method_ids, put_method,
};
use crate::broker::write_queue::WriteQueue;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// RabbitMQ's reason text for a memory alarm.
pub const LOW_ON_MEMORY: &str = "low on memory";
/// RabbitMQ's reason text for a disk alarm.
pub const LOW_ON_DISK: &str = "low on disk";

/// basic.publish.
const BASIC_PUBLISH: (u16, u16) = (60, 40);

/// Whether the client properties announce the `connection.blocked` capability.
pub fn wants_blocked_notifications(client_properties: &FieldTable) -> bool {
    has_capability(client_properties, "connection.blocked")
}

/// Whether the client properties announce capability `name` (true in `capabilities`).
pub fn has_capability(client_properties: &FieldTable, name: &str) -> bool {
    let capabilities = client_properties
        .inner()
        .iter()
        .find(|(key, _)| key.as_str() == "capabilities");
    let Some((_, AMQPValue::FieldTable(capabilities))) = capabilities else {
        return false;
    };
    capabilities
        .inner()
        .iter()
        .any(|(key, value)| key.as_str() == name && matches!(value, AMQPValue::Boolean(true)))
}

/// One connection's view of the alarms.
pub struct Throttle {
    memory: watch::Receiver<bool>,
    disk: watch::Receiver<bool>,
    notify: bool,
}

/// Counts a connection as blocked until dropped.
struct BlockedGauge<'a>(&'a Metrics);

impl<'a> BlockedGauge<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        metrics.connection_blocked();
        BlockedGauge(metrics)
    }
}

impl Drop for BlockedGauge<'_> {
    fn drop(&mut self) {
        self.0.connection_unblocked();
    }
}

impl Throttle {
    /// `memory` and `disk` are the alarm states (true = raised); `notify`: the client wants
    /// `connection.blocked` / `connection.unblocked`.
    pub fn new(
        memory: watch::Receiver<bool>,
        disk: watch::Receiver<bool>,
        notify: bool,
    ) -> Throttle {
        Throttle {
            memory,
            disk,
            notify,
        }
    }

    fn raised(&self) -> bool {
        *self.memory.borrow() || *self.disk.borrow()
    }

    /// The `connection.blocked` reason for the alarms raised now.
    fn reason(&self) -> String {
        let mut reasons = Vec::new();
        if *self.memory.borrow() {
            reasons.push(LOW_ON_MEMORY);
        }
        if *self.disk.borrow() {
            reasons.push(LOW_ON_DISK);
        }
        reasons.join(" & ")
    }

    /// Whether `frame`, just handled, is a publish or a frame of a publish's content that
    /// blocks the connection now (a client's content frames are only ever a publish's, so one
    /// that began its publishes before an alarm cannot go on sending their bodies under it).
    pub fn must_block(&self, frame: &RawFrame) -> bool {
        let publishing = match frame.kind {
            FRAME_METHOD => method_ids(&frame.payload) == BASIC_PUBLISH,
            FRAME_HEADER | FRAME_BODY => true,
            _ => false,
        };
        publishing && frame.channel != 0 && self.raised()
    }

    /// Holds the connection until every alarm clears; `false` when shutdown fired first (the
    /// caller closes the connection).
    pub async fn wait_until_clear(
        &mut self,
        write_queue: &WriteQueue,
        metrics: &Metrics,
        shutdown: &mut Shutdown,
    ) -> bool {
        let _blocked = BlockedGauge::new(metrics);
        if self.notify {
            let reason = self.reason();
            write_queue.push(|out| {
                put_method(
                    out,
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
                        reason: reason.into(),
                    })),
                )
            });
        }
        let cleared = loop {
            self.memory.borrow_and_update();
            self.disk.borrow_and_update();
            if !self.raised() {
                break true;
            }
            // An error means an alarm's sender is gone (the service is stopping): stop
            // holding the connection either way.
            tokio::select! {
                result = self.memory.changed() => if result.is_err() { break false },
                result = self.disk.changed() => if result.is_err() { break false },
                _ = shutdown.recv() => break false,
            }
        };
        if cleared && self.notify {
            write_queue.push(|out| {
                put_method(
                    out,
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Unblocked(
                        connection::Unblocked {},
                    )),
                )
            });
        }
        cleared
    }
}

#[cfg(test)]
mod tests;
