//! The exchange class: exchange.declare, exchange.delete, exchange.bind and exchange.unbind.

use amq_protocol::protocol::{AMQPClass, exchange};

use super::binding::BindingChange;
use super::{ChannelTable, not_from_client};
use crate::amqp::reply::AmqpError;
use crate::broker::auth::Access;
use crate::broker::methods::ExchangeDeclare;
use crate::broker::routing::Destination;
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;

impl ChannelTable {
    /// Handles one method of the exchange class on channel `ch`.
    pub(super) fn exchange_method(
        &mut self,
        method: exchange::AMQPMethod,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        let broker = &ctx.broker;
        let vhost = s.vhost.as_str();
        match method {
            exchange::AMQPMethod::Declare(d) => {
                let name = d.exchange.as_str();
                if !d.passive {
                    self.check(ctx, s, Access::Configure, "exchange", name)?;
                }
                broker.exchange_declare(
                    vhost,
                    &ExchangeDeclare {
                        name,
                        kind: d.kind.as_str(),
                        passive: d.passive,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: &d.arguments,
                    },
                )?;
                if !d.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                            exchange::DeclareOk {},
                        )),
                    );
                }
            }
            exchange::AMQPMethod::Delete(d) => {
                self.check(ctx, s, Access::Configure, "exchange", d.exchange.as_str())?;
                broker.exchange_delete(vhost, d.exchange.as_str(), d.if_unused)?;
                if !d.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                    );
                }
            }
            exchange::AMQPMethod::Bind(b) => self.change_binding(
                ctx,
                s,
                ch,
                BindingChange {
                    bind: true,
                    source: b.source.as_str(),
                    destination: Destination::Exchange(b.destination.to_string()),
                    routing_key: b.routing_key.as_str(),
                    arguments: &b.arguments,
                },
                (!b.nowait).then_some(AMQPClass::Exchange(exchange::AMQPMethod::BindOk(
                    exchange::BindOk {},
                ))),
            )?,
            exchange::AMQPMethod::Unbind(b) => self.change_binding(
                ctx,
                s,
                ch,
                BindingChange {
                    bind: false,
                    source: b.source.as_str(),
                    destination: Destination::Exchange(b.destination.to_string()),
                    routing_key: b.routing_key.as_str(),
                    arguments: &b.arguments,
                },
                (!b.nowait).then_some(AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(
                    exchange::UnbindOk {},
                ))),
            )?,
            _ => return Err(not_from_client()),
        }
        Ok(())
    }
}
