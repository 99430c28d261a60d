//! exchange.bind/unbind and queue.bind/unbind share one path: write permission on the
//! destination, read permission on the source, then the broker operation.

use amq_protocol::protocol::AMQPClass;

use super::{ChannelTable, exchange_resource};
use crate::amqp::reply::AmqpError;
use crate::broker::Broker;
use crate::broker::auth::Access;
use crate::broker::routing::Destination;
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;

/// One exchange.bind / exchange.unbind / queue.bind / queue.unbind, as the broker sees it.
pub(super) struct BindingChange<'a> {
    /// Add (`true`) or remove the binding.
    pub bind: bool,
    pub source: &'a str,
    pub destination: Destination,
    pub routing_key: &'a str,
    pub arguments: &'a amq_protocol::types::FieldTable,
}

impl ChannelTable {
    /// Checks permissions, adds or removes a binding, and sends `ok` (unless nowait).
    pub(super) fn change_binding(
        &self,
        ctx: &ServerContext,
        s: &ConnectionContext,
        ch: u16,
        change: BindingChange<'_>,
        ok: Option<AMQPClass>,
    ) -> Result<(), AmqpError> {
        let BindingChange {
            bind,
            source,
            destination,
            routing_key,
            arguments,
        } = change;
        let (kind, name) = match &destination {
            Destination::Queue(q) => ("queue", q.as_str()),
            Destination::Exchange(x) => ("exchange", x.as_str()),
        };
        self.check(ctx, s, Access::Write, kind, name)?;
        self.check(ctx, s, Access::Read, "exchange", exchange_resource(source))?;
        let change = if bind { Broker::bind } else { Broker::unbind };
        change(
            &ctx.broker,
            s.conn_id,
            &s.vhost,
            source,
            destination,
            routing_key,
            arguments,
        )?;
        if let Some(ok) = ok {
            Self::reply(s, ch, ok);
        }
        Ok(())
    }
}
