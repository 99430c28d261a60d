//! Content frames of a publish: the content header and body frames after basic.publish are
//! collected (size checked against `limits.max_message_size`), then the message is prepared,
//! published, returned when mandatory and unroutable, and confirmed in confirm mode (through
//! the channel's [`super::confirms`] tracker, so confirms of stored messages are coalesced).

use amq_protocol::protocol::{AMQPClass, basic};

use super::confirm_task::{Completions, settle_now};
use super::{ChannelTable, Flow, Phase, method_frame};
use crate::amqp::codec::{FRAME_HEADER, RawFrame};
use crate::amqp::content::{BodyCollector, parse_content_header};
use crate::amqp::reply::AmqpError;
use crate::broker::delivery::short;
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;
use crate::server::publish::{PendingPublish, prepare};

impl ChannelTable {
    pub(super) fn handle_content(
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
        let (result, durable) = match ctx.broker.publish_durable(
            &s.vhost,
            &p.exchange,
            message,
            prepared.headers.as_ref(),
        ) {
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
        let Some(seq) = confirm_seq else {
            return Flow::Continue;
        };
        let Some(local) = self.channels.get_mut(&ch) else {
            return Flow::Continue;
        };
        match durable {
            // Kept on disk: confirmed once storage says it is stable (nack if it could not
            // be written), coalesced with the others of the same group commit.
            Some(durable) if !result.rejected => {
                let completions = local.completions.get_or_insert_with(|| {
                    Completions::start(local.confirm_gate.clone(), s.write_queue.clone(), ch)
                });
                completions.wait(&local.confirm_gate, seq, durable);
            }
            _ => settle_now(
                &local.confirm_gate,
                &s.write_queue,
                ch,
                seq,
                !result.rejected,
            ),
        }
        Flow::Continue
    }
}
