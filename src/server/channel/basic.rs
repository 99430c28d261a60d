//! The basic class: qos, consume, cancel, get, the start of a publish (its content follows in
//! [`super::content`]), ack, reject, nack and recover.

use amq_protocol::protocol::{AMQPClass, basic};

use super::{ChannelTable, exchange_resource, not_from_client};
use crate::amqp::reply::AmqpError;
use crate::broker::auth::Access;
use crate::rabbit::args;
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;
use crate::server::publish::PendingPublish;

impl ChannelTable {
    /// Handles one method of the basic class on channel `ch`.
    pub(super) fn basic_method(
        &mut self,
        method: basic::AMQPMethod,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        let broker = &ctx.broker;
        let vhost = s.vhost.as_str();
        match method {
            basic::AMQPMethod::Qos(q) => {
                broker.qos(s.conn_id, ch, q.prefetch_count, q.global);
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                );
            }
            basic::AMQPMethod::Consume(c) => {
                self.check(ctx, s, Access::Read, "queue", c.queue.as_str())?;
                let priority = match args::consumer_priority(&c.arguments) {
                    Ok(priority) => priority,
                    // RabbitMQ checks the queue first: a missing one is 404.
                    Err(e) if broker.queue_settings(vhost, c.queue.as_str()).is_some() => {
                        return Err(AmqpError::precondition(
                            e.reply_text(c.queue.as_str(), vhost)
                                .trim_start_matches("PRECONDITION_FAILED - "),
                        ));
                    }
                    Err(_) => 0,
                };
                broker.consume(
                    s.conn_id,
                    ch,
                    vhost,
                    c.queue.as_str(),
                    c.consumer_tag.as_str(),
                    c.no_ack,
                    c.exclusive,
                    priority,
                    c.nowait,
                )?;
            }
            basic::AMQPMethod::Cancel(c) => {
                broker.cancel(s.conn_id, ch, c.consumer_tag.as_str());
                if !c.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
            }
            basic::AMQPMethod::Get(g) => {
                self.check(ctx, s, Access::Read, "queue", g.queue.as_str())?;
                broker.get(s.conn_id, ch, vhost, g.queue.as_str(), g.no_ack)?;
            }
            basic::AMQPMethod::Publish(p) => {
                if p.immediate {
                    return Err(AmqpError::not_implemented("immediate=true"));
                }
                self.check(
                    ctx,
                    s,
                    Access::Write,
                    "exchange",
                    exchange_resource(p.exchange.as_str()),
                )?;
                if let Some(local) = self.channels.get_mut(&ch) {
                    local.pending = Some(PendingPublish {
                        exchange: p.exchange.as_str().to_string(),
                        routing_key: p.routing_key.as_str().to_string(),
                        mandatory: p.mandatory,
                        header: None,
                        body: None,
                    });
                }
            }
            basic::AMQPMethod::Ack(a) => {
                broker.ack(s.conn_id, ch, a.delivery_tag, a.multiple)?;
            }
            basic::AMQPMethod::Reject(r) => {
                broker.reject(s.conn_id, ch, r.delivery_tag, false, r.requeue)?;
            }
            basic::AMQPMethod::Nack(n) => {
                broker.reject(s.conn_id, ch, n.delivery_tag, n.multiple, n.requeue)?;
            }
            basic::AMQPMethod::Recover(_) => {
                // recover-ok goes before the redeliveries, as RabbitMQ orders them: clients
                // such as lapin discard deliveries received before it as stale prefetch.
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
                broker.recover(s.conn_id, ch)?;
            }
            basic::AMQPMethod::RecoverAsync(_) => {
                broker.recover(s.conn_id, ch)?;
            }
            _ => return Err(not_from_client()),
        }
        Ok(())
    }
}
