//! Channel handling for one connection: the channel state machine, content assembly and the
//! mapping of every AMQP method to a permission check and a broker operation.
//!
//! Channel errors close the channel (`channel.close`, the broker requeues its unacked
//! deliveries); connection errors are returned as [`Flow::CloseConnection`].

use std::collections::HashMap;

use amq_protocol::protocol::{
    AMQPClass, basic, channel as chan, confirm, connection, exchange, queue, tx,
};
use bytes::BytesMut;

use super::ServerContext;
use super::connection_context::ConnectionContext;
use super::publish::{PendingPublish, prepare};
use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, MethodError, RawFrame,
    decode_method_within, method_ids, put_basic_ack, put_basic_nack, put_method,
};
use crate::amqp::content::{BodyCollector, parse_content_header};
use crate::amqp::reply::AmqpError;
use crate::broker::auth::Access;
use crate::broker::delivery::short;
use crate::broker::methods::{ExchangeDeclare, QueueDeclare};
use crate::broker::routing::Destination;

/// What the connection loop does next.
pub enum Flow {
    Continue,
    CloseConnection(AmqpError),
    /// The client closed the connection (close-ok sent).
    Closed,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    Open,
    /// We sent channel.close and wait for close-ok; everything else is dropped.
    Closing,
}

/// One exchange.bind / exchange.unbind / queue.bind / queue.unbind, as the broker sees it.
struct BindingChange<'a> {
    /// Add (`true`) or remove the binding.
    bind: bool,
    source: &'a str,
    destination: Destination,
    routing_key: &'a str,
    arguments: &'a amq_protocol::types::FieldTable,
}

#[derive(Debug)]
struct ChannelLocal {
    phase: Phase,
    pending: Option<PendingPublish>,
    confirm: bool,
    publish_seq: u64,
}

/// The channels of one connection.
pub struct ChannelTable {
    channels: HashMap<u16, ChannelLocal>,
    max_message_size: u64,
    max_table_depth: usize,
}

fn method_frame(out: &mut BytesMut, channel: u16, m: AMQPClass) {
    put_method(out, channel, m);
}

/// The resource name RabbitMQ checks permissions against for an exchange.
fn exchange_resource(name: &str) -> &str {
    if name.is_empty() { "amq.default" } else { name }
}

impl ChannelTable {
    /// Channels of a connection with these limits (`limits.max_message_size` and
    /// `limits.max_table_depth`).
    pub fn new(limits: &crate::config::LimitsConfig) -> Self {
        ChannelTable {
            channels: HashMap::new(),
            max_message_size: limits.max_message_size,
            max_table_depth: limits.max_table_depth,
        }
    }

    /// Channels open and not closing (the ones still counted in the channel gauge).
    pub fn open_channels(&self) -> usize {
        self.channels
            .values()
            .filter(|c| c.phase == Phase::Open)
            .count()
    }

    /// Handles one frame.
    pub fn handle(&mut self, frame: RawFrame, s: &ConnectionContext, ctx: &ServerContext) -> Flow {
        match frame.kind {
            FRAME_HEARTBEAT => {
                if frame.channel != 0 {
                    return Flow::CloseConnection(AmqpError::frame_error(
                        "heartbeat frame on a non-zero channel",
                    ));
                }
                Flow::Continue
            }
            FRAME_METHOD => self.handle_method(frame, s, ctx),
            FRAME_HEADER | FRAME_BODY => self.handle_content(frame, s, ctx),
            _ => Flow::CloseConnection(AmqpError::frame_error("unknown frame type")),
        }
    }

    fn handle_method(
        &mut self,
        frame: RawFrame,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Flow {
        let (class_id, method_id) = method_ids(&frame.payload);
        let method = match decode_method_within(&frame.payload, self.max_table_depth) {
            Ok(method) => method,
            Err(MethodError::Malformed)
                if !matches!(class_id, 10 | 20 | 30 | 40 | 50 | 60 | 85 | 90) =>
            {
                return Flow::CloseConnection(
                    AmqpError::not_implemented(format!(
                        "unknown method class {class_id} method {method_id}"
                    ))
                    .on_method(class_id, method_id),
                );
            }
            Err(err) => return Flow::CloseConnection(err.to_amqp_error(class_id, method_id)),
        };
        let ch = frame.channel;
        if ch == 0 {
            return self.connection_method(method, s, class_id, method_id);
        }
        // Channel lifecycle.
        match (&method, self.channels.get(&ch)) {
            (AMQPClass::Channel(chan::AMQPMethod::Open(_)), None)
                if s.channel_max != 0 && self.channels.len() >= usize::from(s.channel_max) =>
            {
                // As RabbitMQ: the number of open channels is limited, not their numbers.
                return Flow::CloseConnection(AmqpError::not_allowed(format!(
                    "number of channels opened ({}) has reached the negotiated channel_max ({})",
                    self.channels.len(),
                    s.channel_max
                )));
            }
            (AMQPClass::Channel(chan::AMQPMethod::Open(_)), None) => {
                self.channels.insert(
                    ch,
                    ChannelLocal {
                        phase: Phase::Open,
                        pending: None,
                        confirm: false,
                        publish_seq: 0,
                    },
                );
                ctx.broker.open_channel(s.conn_id, ch);
                ctx.broker.metrics.channel_opened();
                s.write_queue.push(|o| {
                    method_frame(
                        o,
                        ch,
                        AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {})),
                    )
                });
                return Flow::Continue;
            }
            (AMQPClass::Channel(chan::AMQPMethod::Open(_)), Some(_)) => {
                return Flow::CloseConnection(
                    AmqpError::channel_error(format!("second 'channel.open' seen on channel {ch}"))
                        .on_method(class_id, method_id),
                );
            }
            (_, None) => {
                return Flow::CloseConnection(
                    AmqpError::channel_error(format!("expected 'channel.open' on channel {ch}"))
                        .on_method(class_id, method_id),
                );
            }
            (AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)), Some(local))
                if local.phase == Phase::Closing =>
            {
                self.channels.remove(&ch);
                return Flow::Continue;
            }
            (AMQPClass::Channel(chan::AMQPMethod::Close(_)), Some(_)) => {
                self.channels.remove(&ch);
                ctx.broker.close_channel(s.conn_id, ch);
                ctx.broker.metrics.channels_closed(1);
                s.write_queue.push(|o| {
                    method_frame(
                        o,
                        ch,
                        AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                    )
                });
                return Flow::Continue;
            }
            (_, Some(local)) if local.phase == Phase::Closing => return Flow::Continue,
            (_, Some(local)) if local.pending.is_some() => {
                return Flow::CloseConnection(
                    AmqpError::unexpected_frame(format!(
                        "expected content header for class 60, got non content header frame instead on channel {ch}"
                    ))
                    .on_method(class_id, method_id),
                );
            }
            _ => {}
        }
        match self.channel_method(method, ch, s, ctx) {
            Ok(()) => Flow::Continue,
            Err(err) => self.fail(ch, err.on_method(class_id, method_id), s, ctx),
        }
    }

    /// Applies an error: a channel error closes the channel, others the connection.
    fn fail(
        &mut self,
        ch: u16,
        err: AmqpError,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Flow {
        if err.is_connection_error() {
            return Flow::CloseConnection(err);
        }
        if let Some(local) = self.channels.get_mut(&ch) {
            local.phase = Phase::Closing;
            local.pending = None;
        }
        ctx.broker.close_channel(s.conn_id, ch);
        ctx.broker.metrics.channels_closed(1);
        s.write_queue.push(|o| {
            method_frame(
                o,
                ch,
                AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
                    reply_code: err.code,
                    reply_text: short(err.short_text()),
                    class_id: err.class_id,
                    method_id: err.method_id,
                })),
            )
        });
        Flow::Continue
    }

    fn connection_method(&mut self, m: AMQPClass, s: &ConnectionContext, c: u16, mid: u16) -> Flow {
        match m {
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                s.write_queue.push(|o| {
                    method_frame(
                        o,
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    )
                });
                Flow::Closed
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => Flow::Closed,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(_)) => {
                s.write_queue.push(|o| {
                    method_frame(
                        o,
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                            connection::UpdateSecretOk {},
                        )),
                    )
                });
                Flow::Continue
            }
            AMQPClass::Connection(connection::AMQPMethod::Blocked(_))
            | AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => Flow::Continue,
            _ => Flow::CloseConnection(
                AmqpError::command_invalid("unexpected method on channel 0").on_method(c, mid),
            ),
        }
    }

    fn check(
        &self,
        ctx: &ServerContext,
        s: &ConnectionContext,
        access: Access,
        kind: &str,
        name: &str,
    ) -> Result<(), AmqpError> {
        if ctx.users().check(&s.user, &s.vhost, access, name) {
            return Ok(());
        }
        let _ = access;
        Err(AmqpError::access_refused(format!(
            "access to {kind} '{name}' in vhost '{}' refused for user '{}'",
            s.vhost, s.user
        )))
    }

    /// queue.bind/unbind and exchange.bind/unbind: write on the destination, read on the
    /// source, then the broker operation.
    #[allow(clippy::too_many_arguments)]
    /// Checks permissions, adds or removes a binding, and sends `ok` (unless nowait).
    fn change_binding(
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
        let vhost = &s.vhost;
        if bind {
            ctx.broker.bind(
                s.conn_id,
                vhost,
                source,
                destination,
                routing_key,
                arguments,
            )?;
        } else {
            ctx.broker.unbind(
                s.conn_id,
                vhost,
                source,
                destination,
                routing_key,
                arguments,
            )?;
        }
        if let Some(ok) = ok {
            Self::reply(s, ch, ok);
        }
        Ok(())
    }

    fn reply(s: &ConnectionContext, ch: u16, m: AMQPClass) {
        s.write_queue.push(|o| method_frame(o, ch, m));
    }

    fn channel_method(
        &mut self,
        method: AMQPClass,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        let broker = &ctx.broker;
        let vhost = s.vhost.as_str();
        match method {
            AMQPClass::Channel(chan::AMQPMethod::Flow(f)) => {
                broker.channel_flow(s.conn_id, ch, f.active);
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk { active: f.active })),
                );
            }
            AMQPClass::Channel(chan::AMQPMethod::FlowOk(_)) => {}
            AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => {}
            AMQPClass::Access(_) => {
                return Err(AmqpError::not_implemented(
                    "access.request is not supported",
                ));
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => {
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
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(d)) => {
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
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(b)) => self.change_binding(
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
            AMQPClass::Exchange(exchange::AMQPMethod::Unbind(b)) => self.change_binding(
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
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => {
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
            AMQPClass::Queue(queue::AMQPMethod::Bind(b)) => self.change_binding(
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
            AMQPClass::Queue(queue::AMQPMethod::Unbind(b)) => self.change_binding(
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
            AMQPClass::Queue(queue::AMQPMethod::Purge(p)) => {
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
            AMQPClass::Queue(queue::AMQPMethod::Delete(d)) => {
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
            AMQPClass::Basic(basic::AMQPMethod::Qos(q)) => {
                broker.qos(s.conn_id, ch, q.prefetch_count, q.global);
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                );
            }
            AMQPClass::Basic(basic::AMQPMethod::Consume(c)) => {
                self.check(ctx, s, Access::Read, "queue", c.queue.as_str())?;
                let priority = consumer_priority(&c.arguments);
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
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
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
            AMQPClass::Basic(basic::AMQPMethod::Get(g)) => {
                self.check(ctx, s, Access::Read, "queue", g.queue.as_str())?;
                broker.get(s.conn_id, ch, vhost, g.queue.as_str(), g.no_ack)?;
            }
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => {
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
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                broker.ack(s.conn_id, ch, a.delivery_tag, a.multiple)?;
            }
            AMQPClass::Basic(basic::AMQPMethod::Reject(r)) => {
                broker.reject(s.conn_id, ch, r.delivery_tag, false, r.requeue)?;
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                broker.reject(s.conn_id, ch, n.delivery_tag, n.multiple, n.requeue)?;
            }
            AMQPClass::Basic(basic::AMQPMethod::Recover(_)) => {
                // recover-ok goes before the redeliveries, as RabbitMQ orders them: clients
                // such as lapin discard deliveries received before it as stale prefetch.
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
                broker.recover(s.conn_id, ch)?;
            }
            AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(_)) => {
                broker.recover(s.conn_id, ch)?;
            }
            AMQPClass::Confirm(confirm::AMQPMethod::Select(sel)) => {
                if let Some(local) = self.channels.get_mut(&ch) {
                    local.confirm = true;
                }
                if !sel.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
            }
            AMQPClass::Tx(tx::AMQPMethod::Select(_))
            | AMQPClass::Tx(tx::AMQPMethod::Commit(_))
            | AMQPClass::Tx(tx::AMQPMethod::Rollback(_)) => {
                return Err(AmqpError::not_implemented("transactions are not supported"));
            }
            _ => {
                return Err(AmqpError::command_invalid(
                    "method not allowed from a client",
                ));
            }
        }
        Ok(())
    }

    fn handle_content(
        &mut self,
        frame: RawFrame,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Flow {
        let ch = frame.channel;
        let Some(local) = self.channels.get_mut(&ch) else {
            return Flow::CloseConnection(AmqpError::channel_error(format!(
                "expected 'channel.open' on channel {ch}"
            )));
        };
        if local.phase == Phase::Closing {
            return Flow::Continue;
        }
        let Some(pending) = local.pending.as_mut() else {
            return Flow::CloseConnection(AmqpError::unexpected_frame(format!(
                "unexpected content frame on channel {ch}"
            )));
        };
        if frame.kind == FRAME_HEADER {
            if pending.header.is_some() {
                return Flow::CloseConnection(AmqpError::unexpected_frame("second content header"));
            }
            let header = match parse_content_header(&frame.payload) {
                Ok(h) => h,
                Err(e) => {
                    return Flow::CloseConnection(AmqpError::syntax_error(e.to_string()));
                }
            };
            if header.class_id != crate::amqp::content::BASIC_CLASS_ID {
                return Flow::CloseConnection(AmqpError::unexpected_frame(
                    "content header for a class other than basic",
                ));
            }
            if header.body_size > self.max_message_size {
                let err = AmqpError::precondition(format!(
                    "message size {} is larger than configured max size {}",
                    header.body_size, self.max_message_size
                ))
                .on_method(60, 40);
                return self.fail(ch, err, s, ctx);
            }
            pending.body = Some(BodyCollector::new(header.body_size));
            pending.header = Some(header);
        } else {
            let Some(body) = pending.body.as_mut() else {
                return Flow::CloseConnection(AmqpError::unexpected_frame(
                    "content body before content header",
                ));
            };
            if body.push(frame.payload).is_err() {
                return Flow::CloseConnection(AmqpError::frame_error(
                    "content body larger than the size in the content header",
                ));
            }
        }
        let complete = pending.body.as_ref().is_some_and(|b| b.is_complete());
        if complete && let Some(p) = local.pending.take() {
            return self.finish_publish(ch, p, s, ctx);
        }
        Flow::Continue
    }

    fn finish_publish(
        &mut self,
        ch: u16,
        p: PendingPublish,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Flow {
        let (Some(header), Some(body)) = (p.header, p.body) else {
            return Flow::Continue;
        };
        let confirm_seq = match self.channels.get_mut(&ch) {
            Some(local) if local.confirm => {
                local.publish_seq += 1;
                Some(local.publish_seq)
            }
            _ => None,
        };
        let prepared = match prepare(&p.exchange, &p.routing_key, header, body.finish(), &s.user) {
            Ok(m) => m,
            Err(e) => return self.fail(ch, e.on_method(60, 40), s, ctx),
        };
        let message = std::sync::Arc::new(prepared.message);
        let returnable = p.mandatory.then(|| message.clone());
        let result =
            match ctx
                .broker
                .publish(&s.vhost, &p.exchange, message, prepared.headers.as_ref())
            {
                Ok(r) => r,
                Err(e) => return self.fail(ch, e.on_method(60, 40), s, ctx),
            };
        if !result.routed
            && let Some(returned) = returnable
        {
            let frame_max = s.frame_max;
            s.write_queue.push(|o| {
                method_frame(
                    o,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                        reply_code: crate::amqp::reply::NO_ROUTE,
                        reply_text: short("NO_ROUTE"),
                        exchange: short(&p.exchange),
                        routing_key: short(&p.routing_key),
                    })),
                );
                crate::amqp::content::put_content(
                    o,
                    ch,
                    returned.raw_properties(),
                    returned.body(),
                    frame_max,
                );
            });
        }
        if let Some(seq) = confirm_seq {
            s.write_queue.push(|o| {
                if result.rejected {
                    put_basic_nack(o, ch, seq, false, false)
                } else {
                    put_basic_ack(o, ch, seq, false)
                }
            });
        }
        Flow::Continue
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

fn consumer_priority(args: &amq_protocol::types::FieldTable) -> i32 {
    use amq_protocol::types::AMQPValue;
    match args.inner().get("x-priority") {
        Some(AMQPValue::LongInt(v)) => *v,
        Some(AMQPValue::ShortInt(v)) => *v as i32,
        Some(AMQPValue::LongLongInt(v)) => (*v).clamp(i32::MIN as i64, i32::MAX as i64) as i32,
        _ => 0,
    }
}
