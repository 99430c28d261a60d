//! The check channel: a channel of the proxy's own on which it declares a queue so that
//! RabbitMQ judges the declare before any client channel is involved (a refusal closes the
//! channel it happens on).
//!
//! Two kinds: on each client's upstream connection, the permission probe
//! ([`super::permission`]), and on each vhost's service connection, the rounds of the declare
//! check ([`super::arbiter`]) and of the read-back ([`super::readback`]) that carry the
//! proxy's own arguments ([`super::service::judge`]).
//!
//! On a client connection it is open only while a check runs: opened with the first declare
//! (the open and the declare go out together), closed by the upstream with a refusal (the
//! proxy answers close-ok and may open it again at once for the next round), or closed by the
//! proxy after a declare-ok. A declare asked for while the proxy's own channel.close is
//! unanswered waits for the close-ok, since RabbitMQ refuses a channel.open on a channel it is
//! still closing. So a client connection costs no upstream channel for this outside a check.
//! One check at a time (client reads pause while one runs). The service connection keeps it
//! open between declares.
use amq_protocol::protocol::{AMQPClass, channel, queue};
use amq_protocol::types::ShortString;
use bytes::{Bytes, BytesMut};

use super::wire::{WireFrame, method_frame};
use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::amqp::reply;

/// What the check channel heard about the declare in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckAnswer {
    DeclareOk,
    /// The upstream closed the channel (the declare was refused).
    Refused {
        code: u16,
        text: String,
    },
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
    /// Open (or opening) with a declare in flight.
    Declaring,
    /// Open, nothing in flight (only between a declare-ok and the proxy's close).
    Idle,
    /// The proxy's channel.close is out.
    Closing,
}

/// The check channel of one upstream connection.
#[derive(Debug)]
pub struct CheckChannel {
    channel: u16,
    state: State,
    /// A declare waiting for the close-ok of the previous check's channel.
    queued: Option<queue::Declare>,
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
        self.state == State::Declaring || self.queued.is_some()
    }

    /// Sends `declare` (opening the channel first); `None` when it waits for a close-ok.
    pub fn declare(&mut self, declare: queue::Declare) -> Option<Bytes> {
        match self.state {
            State::Closing => {
                self.queued = Some(declare);
                None
            }
            State::Closed => {
                self.state = State::Declaring;
                let mut out = BytesMut::new();
                out.extend_from_slice(&method_frame(
                    self.channel,
                    AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
                ));
                out.extend_from_slice(&self.declare_frame(declare));
                Some(out.freeze())
            }
            State::Idle | State::Declaring => {
                self.state = State::Declaring;
                Some(self.declare_frame(declare))
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

    fn declare_frame(&self, declare: queue::Declare) -> Bytes {
        method_frame(
            self.channel,
            AMQPClass::Queue(queue::AMQPMethod::Declare(declare)),
        )
    }

    pub fn on_frame(&mut self, frame: &WireFrame) -> CheckStep {
        let mut step = CheckStep::default();
        if frame.kind != FRAME_METHOD {
            return step;
        }
        match decode_method(&frame.payload) {
            Some(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))
                if self.state == State::Declaring =>
            {
                self.state = State::Idle;
                step.answer = Some(CheckAnswer::DeclareOk);
            }
            Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                step.write = Some(method_frame(
                    self.channel,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                ));
                if self.state == State::Declaring {
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
        if let Some(declare) = self.queued.take()
            && let Some(bytes) = self.declare(declare)
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
}
