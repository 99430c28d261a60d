//! Channel handling for one connection: the channel state machine (open, closing, closed), the
//! dispatch of each channel method to the handler of its class, and channel errors.
//!
//! One file per method class, each a handler of one `match` over that class's methods:
//! `exchange`, `queue`, `basic`, `confirm`; the bindings of exchange and queue share
//! `binding`, and the content frames of a publish go to `content`. Publisher confirms are
//! tracked and coalesced by `confirms` and written by `confirm_task`. Each handler checks
//! permissions and calls the broker operation ([`crate::broker::methods`]).
//!
//! Channel errors close the channel (`channel.close`, the broker requeues its unacked
//! deliveries); connection errors are returned as [`Flow::CloseConnection`].

mod basic;
mod binding;
mod confirm;
mod confirm_task;
mod confirms;
mod content;
mod exchange;
mod queue;

use std::collections::HashMap;

use amq_protocol::protocol::{AMQPClass, channel as chan, connection, tx};
use bytes::BytesMut;

use super::ServerContext;
use super::connection_context::ConnectionContext;
use super::publish::PendingPublish;
use crate::amqp::codec::{
    FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, MethodError, RawFrame,
    decode_method_within, method_ids, put_method,
};
use crate::amqp::reply::AmqpError;
use crate::broker::auth::Access;
use crate::broker::delivery::short;

/// What the connection loop does next.
pub enum Flow {
    Continue,
    CloseConnection(AmqpError),
    /// The client sent connection.close: the caller unregisters the connection (its
    /// consumers and unacked deliveries) and only then answers close-ok, so that nothing is
    /// delivered behind a close the client has sent (it discards it: a no-ack delivery
    /// would be lost).
    ClientClose,
    /// The connection is over (a close-ok from the client).
    Closed,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    Open,
    /// We sent channel.close and wait for close-ok; everything else is dropped.
    Closing,
}

#[derive(Debug)]
struct ChannelLocal {
    phase: Phase,
    pending: Option<PendingPublish>,
    confirm: bool,
    publish_seq: u64,
    /// The channel's unconfirmed publishes, open while confirms may still be written: they
    /// are written under this lock only if the channel was not closed meanwhile, so none
    /// reaches a closed channel or a new one with the same number.
    confirm_gate: confirm_task::ConfirmGate,
    /// The task confirming persistent publishes once stored (started by the first one).
    completions: Option<confirm_task::Completions>,
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
                if !frame.payload.is_empty() {
                    // RabbitMQ accepts only an empty heartbeat; anything else is an unknown
                    // frame to it.
                    return Flow::CloseConnection(AmqpError::frame_error(
                        "heartbeat frame with a payload",
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
                        confirm_gate: confirm_task::new_gate(),
                        completions: None,
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
            // The client's close crossed ours (an error we sent): answered, and the channel
            // stays closing until the client's close-ok to ours, as RabbitMQ's reader does.
            (AMQPClass::Channel(chan::AMQPMethod::Close(_)), Some(local))
                if local.phase == Phase::Closing =>
            {
                s.write_queue.push(|o| {
                    method_frame(
                        o,
                        ch,
                        AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                    )
                });
                return Flow::Continue;
            }
            (AMQPClass::Channel(chan::AMQPMethod::Close(_)), Some(_)) => {
                if let Some(local) = self.channels.remove(&ch) {
                    confirm_task::close_gate(&local.confirm_gate);
                }
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

    /// Closes an open channel with a channel error that did not come from a client method
    /// (a consumer timeout): channel.close to the client, its deliveries requeued. A channel
    /// that is not open (gone, or already closing) is left alone.
    pub fn close_on_error(
        &mut self,
        ch: u16,
        err: AmqpError,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) {
        if self
            .channels
            .get(&ch)
            .is_some_and(|local| local.phase == Phase::Open)
        {
            self.fail(ch, err, s, ctx);
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
            confirm_task::close_gate(&local.confirm_gate);
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
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => Flow::ClientClose,
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

    fn reply(s: &ConnectionContext, ch: u16, m: AMQPClass) {
        s.write_queue.push(|o| method_frame(o, ch, m));
    }

    /// Hands a channel method to the handler of its class.
    fn channel_method(
        &mut self,
        method: AMQPClass,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        match method {
            AMQPClass::Channel(m) => self.channel_class_method(m, ch, s, ctx),
            AMQPClass::Exchange(m) => self.exchange_method(m, ch, s, ctx),
            AMQPClass::Queue(m) => self.queue_method(m, ch, s, ctx),
            AMQPClass::Basic(m) => self.basic_method(m, ch, s, ctx),
            AMQPClass::Confirm(m) => self.confirm_method(m, ch, s),
            AMQPClass::Tx(
                tx::AMQPMethod::Select(_) | tx::AMQPMethod::Commit(_) | tx::AMQPMethod::Rollback(_),
            ) => Err(AmqpError::not_implemented("transactions are not supported")),
            AMQPClass::Access(_) => Err(AmqpError::not_implemented(
                "access.request is not supported",
            )),
            _ => Err(not_from_client()),
        }
    }

    /// channel.flow (channel.open and channel.close are handled with the channel's life).
    fn channel_class_method(
        &mut self,
        method: chan::AMQPMethod,
        ch: u16,
        s: &ConnectionContext,
        ctx: &ServerContext,
    ) -> Result<(), AmqpError> {
        match method {
            chan::AMQPMethod::Flow(f) => {
                ctx.broker.channel_flow(s.conn_id, ch, f.active);
                Self::reply(
                    s,
                    ch,
                    AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk { active: f.active })),
                );
                Ok(())
            }
            chan::AMQPMethod::FlowOk(_) | chan::AMQPMethod::CloseOk(_) => Ok(()),
            _ => Err(not_from_client()),
        }
    }
}

/// The reply to a method a client must not send (a server method, or one of another class
/// on this path).
fn not_from_client() -> AmqpError {
    AmqpError::command_invalid("method not allowed from a client")
}

#[cfg(test)]
mod tests;
