//! The queue class: queue.declare (with the permissions its dead-letter exchange needs),
//! queue.bind, queue.unbind, queue.purge and queue.delete.

use amq_protocol::protocol::{AMQPClass, queue};

use super::binding::BindingChange;
use super::{ChannelTable, exchange_resource, not_from_client};
use crate::amqp::reply::AmqpError;
use crate::broker::auth::Access;
use crate::broker::delivery::short;
use crate::broker::methods::QueueDeclare;
use crate::broker::routing::Destination;
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;

impl ChannelTable {
    /// Handles one method of the queue class on channel `ch`.
    pub(super) fn queue_method(
        &mut self,
        method: queue::AMQPMethod,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        let broker = &ctx.broker;
        let vhost = s.vhost.as_str();
        match method {
            queue::AMQPMethod::Declare(d) => {
                let name = d.queue.as_str();
                if !d.passive {
                    if !name.is_empty() {
                        self.check(ctx, s, Access::Configure, "queue", name)?;
                    }
                    if let Some(dlx) = dead_letter_exchange_argument(&d.arguments) {
                        if !name.is_empty() {
                            self.check(ctx, s, Access::Read, "queue", name)?;
                        }
                        self.check(ctx, s, Access::Write, "exchange", exchange_resource(&dlx))?;
                    }
                }
                let out = broker.queue_declare(
                    s.conn_id,
                    vhost,
                    &QueueDeclare {
                        name,
                        passive: d.passive,
                        durable: d.durable,
                        exclusive: d.exclusive,
                        auto_delete: d.auto_delete,
                        arguments: &d.arguments,
                        restored: false,
                    },
                )?;
                if !d.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                            queue: short(&out.name),
                            message_count: out.message_count,
                            consumer_count: out.consumer_count,
                        })),
                    );
                }
            }
            queue::AMQPMethod::Bind(b) => self.change_binding(
                ctx,
                s,
                ch,
                BindingChange {
                    bind: true,
                    source: b.exchange.as_str(),
                    destination: Destination::Queue(b.queue.to_string()),
                    routing_key: b.routing_key.as_str(),
                    arguments: &b.arguments,
                },
                (!b.nowait).then_some(AMQPClass::Queue(queue::AMQPMethod::BindOk(
                    queue::BindOk {},
                ))),
            )?,
            // queue.unbind has no nowait flag: unbind-ok always follows.
            queue::AMQPMethod::Unbind(b) => self.change_binding(
                ctx,
                s,
                ch,
                BindingChange {
                    bind: false,
                    source: b.exchange.as_str(),
                    destination: Destination::Queue(b.queue.to_string()),
                    routing_key: b.routing_key.as_str(),
                    arguments: &b.arguments,
                },
                Some(AMQPClass::Queue(queue::AMQPMethod::UnbindOk(
                    queue::UnbindOk {},
                ))),
            )?,
            queue::AMQPMethod::Purge(p) => {
                self.check(ctx, s, Access::Read, "queue", p.queue.as_str())?;
                let n = broker.queue_purge(s.conn_id, vhost, p.queue.as_str())?;
                if !p.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                            message_count: n,
                        })),
                    );
                }
            }
            queue::AMQPMethod::Delete(d) => {
                self.check(ctx, s, Access::Configure, "queue", d.queue.as_str())?;
                let n = broker.queue_delete(
                    s.conn_id,
                    vhost,
                    d.queue.as_str(),
                    d.if_unused,
                    d.if_empty,
                )?;
                if !d.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                            message_count: n,
                        })),
                    );
                }
            }
            _ => return Err(not_from_client()),
        }
        Ok(())
    }
}

/// The `x-dead-letter-exchange` argument when it is a string (validation reports other types).
fn dead_letter_exchange_argument(args: &amq_protocol::types::FieldTable) -> Option<String> {
    use amq_protocol::types::AMQPValue;
    match args.inner().get("x-dead-letter-exchange") {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    }
}
