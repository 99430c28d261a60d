//! The check channel: a channel of the proxy's own on which it declares a queue (or probes a
//! write permission) so that RabbitMQ judges the declare before any client channel is
//! involved (a refusal closes the channel it happens on).
//!
//! Two kinds: on each client's upstream connection, the permission probe
//! ([`super::permission`]) and the capture-write probe ([`super::capture_write`]: a
//! transaction whose publish is rolled back), and on each vhost's declare connection, the rounds of the declare
//! check ([`super::arbiter`]) and of the read-back ([`super::readback`]) that carry the
//! proxy's own arguments ([`super::service::judge`]).
//!
//! On a client connection it is open only while a check runs: opened with the first declare
//! (the open and the declare go out together), closed by the upstream with a refusal (the
//! proxy answers close-ok and may open it again at once for the next round), or closed by the
//! proxy after a declare-ok. A declare asked for while the proxy's own channel.close is
//! unanswered waits for the close-ok, since RabbitMQ refuses a channel.open on a channel it is
//! still closing. So a client connection costs no upstream channel for this outside a check.
//! One check at a time (client reads pause while one runs). The declare connection keeps it
//! open between declares.
use amq_protocol::protocol::{AMQPClass, basic, channel, queue, tx};
use amq_protocol::types::ShortString;
use bytes::{Bytes, BytesMut};

use super::wire::{WireFrame, method_frame};
use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::amqp::content::put_content;
use crate::amqp::reply;

/// The properties of the write probe's publish: none (a zero property-flags word).
const NO_PROPERTIES: [u8; 2] = [0, 0];

/// What a check asks on the channel.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckRequest {
    /// A queue.declare: answered by declare-ok or a refusal.
    Declare(queue::Declare),
    /// Whether the user may publish to `exchange`: tx.select, an empty basic.publish to it,
    /// tx.rollback (RabbitMQ checks write permission when the publish arrives, before the
    /// transaction buffers it; the rollback discards it). Answered by rollback-ok or a
    /// refusal.
    Write { exchange: ShortString },
}

/// What the check channel heard about the check in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckAnswer {
    /// The check's last method was answered: declare-ok (a declare), rollback-ok (a write
    /// probe).
    DeclareOk,
    /// The upstream closed the channel (the check was refused).
    Refused { code: u16, text: String },
}

/// What a check-channel frame asks of the session.
#[derive(Debug, Default)]
pub struct CheckStep {
    pub write: Option<Bytes>,
    pub answer: Option<CheckAnswer>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Closed,
    /// Open (or opening) with a check in flight.
    Checking,
    /// Open, nothing in flight (only between a check's answer and the proxy's close).
    Idle,
    /// The proxy's channel.close is out.
    Closing,
}

/// The check channel of one upstream connection.
#[derive(Debug)]
pub struct CheckChannel {
    channel: u16,
    state: State,
    /// A check waiting for the close-ok of the previous check's channel.
    queued: Option<CheckRequest>,
}

impl CheckChannel {
    pub fn new(channel: u16) -> Self {
        CheckChannel {
            channel,
            state: State::Closed,
            queued: None,
        }
    }

    pub fn channel(&self) -> u16 {
        self.channel
    }

    /// Whether a declare is in flight or waiting.
    pub fn busy(&self) -> bool {
        self.state == State::Checking || self.queued.is_some()
    }

    /// Sends `declare` (opening the channel first); `None` when it waits for a close-ok.
    pub fn declare(&mut self, declare: queue::Declare) -> Option<Bytes> {
        self.send(CheckRequest::Declare(declare))
    }

    /// Sends `request` (opening the channel first); `None` when it waits for a close-ok.
    pub fn send(&mut self, request: CheckRequest) -> Option<Bytes> {
        match self.state {
            State::Closing => {
                self.queued = Some(request);
                None
            }
            State::Closed => {
                self.state = State::Checking;
                let mut out = BytesMut::new();
                out.extend_from_slice(&method_frame(
                    self.channel,
                    AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
                ));
                self.put_request(&mut out, request);
                Some(out.freeze())
            }
            State::Idle | State::Checking => {
                self.state = State::Checking;
                let mut out = BytesMut::new();
                self.put_request(&mut out, request);
                Some(out.freeze())
            }
        }
    }

    /// Closes the channel when nothing is in flight (after a check).
    pub fn close(&mut self) -> Option<Bytes> {
        if self.state != State::Idle {
            return None;
        }
        self.state = State::Closing;
        Some(method_frame(
            self.channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: reply::REPLY_SUCCESS,
                reply_text: ShortString::from("declare checked"),
                class_id: 0,
                method_id: 0,
            })),
        ))
    }

    fn put_request(&self, out: &mut BytesMut, request: CheckRequest) {
        let method = |method| method_frame(self.channel, method);
        match request {
            CheckRequest::Declare(declare) => {
                out.extend_from_slice(&method(AMQPClass::Queue(queue::AMQPMethod::Declare(
                    declare,
                ))));
            }
            CheckRequest::Write { exchange } => {
                out.extend_from_slice(&method(AMQPClass::Tx(tx::AMQPMethod::Select(
                    tx::Select {},
                ))));
                out.extend_from_slice(&method(AMQPClass::Basic(basic::AMQPMethod::Publish(
                    basic::Publish {
                        exchange,
                        routing_key: ShortString::from(""),
                        mandatory: false,
                        immediate: false,
                    },
                ))));
                // An empty body: the header frame alone (frame_max does not matter).
                put_content(out, self.channel, &NO_PROPERTIES, &[], usize::MAX);
                out.extend_from_slice(&method(AMQPClass::Tx(tx::AMQPMethod::Rollback(
                    tx::Rollback {},
                ))));
            }
        }
    }

    pub fn on_frame(&mut self, frame: &WireFrame) -> CheckStep {
        let mut step = CheckStep::default();
        if frame.kind != FRAME_METHOD {
            return step;
        }
        match decode_method(frame.payload()) {
            Some(
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))
                | AMQPClass::Tx(tx::AMQPMethod::RollbackOk(_)),
            ) if self.state == State::Checking => {
                self.state = State::Idle;
                step.answer = Some(CheckAnswer::DeclareOk);
            }
            Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                step.write = Some(method_frame(
                    self.channel,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                ));
                if self.state == State::Checking {
                    step.answer = Some(CheckAnswer::Refused {
                        code: close.reply_code,
                        text: close.reply_text.as_str().to_string(),
                    });
                }
                self.state = State::Closed;
                self.send_queued(&mut step);
            }
            Some(AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
                if self.state == State::Closing =>
            {
                self.state = State::Closed;
                self.send_queued(&mut step);
            }
            _ => {}
        }
        step
    }

    fn send_queued(&mut self, step: &mut CheckStep) {
        if let Some(request) = self.queued.take()
            && let Some(bytes) = self.send(request)
        {
            let mut out = BytesMut::new();
            if let Some(first) = step.write.take() {
                out.extend_from_slice(&first);
            }
            out.extend_from_slice(&bytes);
            step.write = Some(out.freeze());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::wire::WireCodec;
    use amq_protocol::types::FieldTable;
    use tokio_util::codec::Decoder;

    fn frame(bytes: Bytes) -> WireFrame {
        let mut buf = BytesMut::from(&bytes[..]);
        WireCodec::new(4096).decode(&mut buf).unwrap().unwrap()
    }

    fn ids(bytes: &Bytes) -> Vec<(u16, (u16, u16))> {
        let mut buf = BytesMut::from(&bytes[..]);
        let mut codec = WireCodec::new(4096);
        std::iter::from_fn(|| codec.decode(&mut buf).unwrap())
            .map(|f| (f.channel, f.method_ids()))
            .collect()
    }

    fn declare() -> queue::Declare {
        queue::Declare {
            queue: ShortString::from("q"),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        }
    }

    fn upstream(method: AMQPClass) -> WireFrame {
        frame(method_frame(7, method))
    }

    #[test]
    fn opens_for_a_check_and_closes_after_it() {
        let mut check = CheckChannel::new(7);
        let out = check.declare(declare()).unwrap();
        assert_eq!(ids(&out), vec![(7, (20, 10)), (7, (50, 10))]);
        assert!(check.busy());
        let open_ok = upstream(AMQPClass::Channel(channel::AMQPMethod::OpenOk(
            channel::OpenOk {},
        )));
        assert!(check.on_frame(&open_ok).answer.is_none());
        let ok = upstream(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
            queue::DeclareOk {
                queue: ShortString::from("q"),
                message_count: 0,
                consumer_count: 0,
            },
        )));
        assert_eq!(check.on_frame(&ok).answer, Some(CheckAnswer::DeclareOk));
        let close = check.close().unwrap();
        assert_eq!(ids(&close), vec![(7, (20, 40))]);
        // The next check waits for the close-ok, then reopens.
        assert!(check.declare(declare()).is_none());
        assert!(check.busy());
        let close_ok = upstream(AMQPClass::Channel(channel::AMQPMethod::CloseOk(
            channel::CloseOk {},
        )));
        let step = check.on_frame(&close_ok);
        assert_eq!(
            ids(&step.write.unwrap()),
            vec![(7, (20, 10)), (7, (50, 10))]
        );
    }

    #[test]
    fn a_refusal_is_answered_and_the_next_round_reopens_at_once() {
        let mut check = CheckChannel::new(7);
        check.declare(declare()).unwrap();
        let close = upstream(AMQPClass::Channel(channel::AMQPMethod::Close(
            channel::Close {
                reply_code: 406,
                reply_text: ShortString::from("PRECONDITION_FAILED - x"),
                class_id: 50,
                method_id: 10,
            },
        )));
        let step = check.on_frame(&close);
        assert_eq!(
            step.answer,
            Some(CheckAnswer::Refused {
                code: 406,
                text: "PRECONDITION_FAILED - x".into()
            })
        );
        assert_eq!(ids(&step.write.unwrap()), vec![(7, (20, 41))]);
        assert!(!check.busy());
        assert!(check.close().is_none(), "already closed");
        let again = check.declare(declare()).unwrap();
        assert_eq!(ids(&again), vec![(7, (20, 10)), (7, (50, 10))]);
    }

    #[test]
    fn a_write_probe_publishes_in_a_transaction_and_rolls_back() {
        let mut check = CheckChannel::new(7);
        let out = check
            .send(CheckRequest::Write {
                exchange: ShortString::from("dlx-proxy.capture"),
            })
            .unwrap();
        let mut buf = BytesMut::from(&out[..]);
        let mut codec = WireCodec::new(4096);
        let frames: Vec<WireFrame> =
            std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).collect();
        let kinds: Vec<(u8, (u16, u16))> =
            frames.iter().map(|f| (f.kind, f.method_ids())).collect();
        assert_eq!(
            kinds,
            vec![
                (FRAME_METHOD, (20, 10)),
                (FRAME_METHOD, (90, 10)),
                (FRAME_METHOD, (60, 40)),
                (crate::amqp::codec::FRAME_HEADER, (0, 0)),
                (FRAME_METHOD, (90, 30)),
            ]
        );
        let Some(AMQPClass::Basic(basic::AMQPMethod::Publish(publish))) =
            decode_method(frames[2].payload())
        else {
            panic!("not a publish");
        };
        assert_eq!(publish.exchange.as_str(), "dlx-proxy.capture");
        assert!(!publish.mandatory);
        assert_eq!(
            crate::proxy::wire::content_body_size(frames[3].payload()),
            Some(0)
        );
        assert!(frames.iter().all(|f| f.channel == 7));
        // select-ok says nothing yet; rollback-ok answers.
        let select_ok = upstream(AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
        assert!(check.on_frame(&select_ok).answer.is_none());
        let rollback_ok = upstream(AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})));
        assert_eq!(
            check.on_frame(&rollback_ok).answer,
            Some(CheckAnswer::DeclareOk)
        );
        assert_eq!(ids(&check.close().unwrap()), vec![(7, (20, 40))]);
        // A refused write probe closes the channel; the next declare reopens it.
        let mut check = CheckChannel::new(7);
        check
            .send(CheckRequest::Write {
                exchange: ShortString::from("x"),
            })
            .unwrap();
        let close = upstream(AMQPClass::Channel(channel::AMQPMethod::Close(
            channel::Close {
                reply_code: 403,
                reply_text: ShortString::from("ACCESS_REFUSED - x"),
                class_id: 60,
                method_id: 40,
            },
        )));
        let step = check.on_frame(&close);
        assert_eq!(
            step.answer,
            Some(CheckAnswer::Refused {
                code: 403,
                text: "ACCESS_REFUSED - x".into()
            })
        );
        assert_eq!(ids(&check.declare(declare()).unwrap())[0], (7, (20, 10)));
    }
}
