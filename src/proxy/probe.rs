//! The queue probe: before the proxy declares a queue with its own upstream arguments it asks,
//! on a channel of its own, whether the queue already exists (a passive declare).
//!
//! Why: the upstream queue of a queue declared through the proxy carries the proxy's
//! arguments (the capture exchange, merged limits). A queue that already exists upstream,
//! declared before the proxy was deployed or with other arguments, would refuse that declare
//! as inequivalent (406). An existing queue is therefore declared passively for the client:
//! it gets its declare-ok with the message and consumer counts, as from RabbitMQ, after the
//! proxy compared the declare with the one it remembers for the queue (see
//! [`super::declare::DeclaredQueue`]). A passive declare of a missing queue closes the channel
//! (404), so the probe has a channel of its own, reopened after every "no".

use amq_protocol::protocol::{AMQPClass, channel, queue};
use amq_protocol::types::{FieldTable, ShortString};
use bytes::{Bytes, BytesMut};

use super::wire::{WireFrame, method_frame};
use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::amqp::reply::NOT_FOUND;

/// What the probe found out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeAnswer {
    Exists,
    Missing,
    /// The upstream refused the question (e.g. permissions): declare as usual.
    Unknown,
}

/// What a probe-channel frame asks of the session.
#[derive(Debug, Default)]
pub struct ProbeStep {
    pub write: Option<Bytes>,
    pub answer: Option<ProbeAnswer>,
}

/// The probe channel.
#[derive(Debug)]
pub struct QueueProbe {
    channel: u16,
    busy: bool,
}

impl QueueProbe {
    pub fn new(channel: u16) -> Self {
        QueueProbe {
            channel,
            busy: false,
        }
    }

    pub fn channel(&self) -> u16 {
        self.channel
    }

    pub fn open_frames(&self) -> Bytes {
        method_frame(
            self.channel,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
    }

    /// The passive declare for `queue`, unless a question is already out.
    pub fn ask(&mut self, queue: &ShortString) -> Option<Bytes> {
        if self.busy {
            return None;
        }
        self.busy = true;
        Some(method_frame(
            self.channel,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue.clone(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ))
    }

    pub fn on_frame(&mut self, frame: &WireFrame) -> ProbeStep {
        let mut step = ProbeStep::default();
        if frame.kind != FRAME_METHOD {
            return step;
        }
        match decode_method(&frame.payload) {
            Some(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))) if self.busy => {
                self.busy = false;
                step.answer = Some(ProbeAnswer::Exists);
            }
            Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                let mut out = BytesMut::new();
                out.extend_from_slice(&method_frame(
                    self.channel,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                ));
                out.extend_from_slice(&self.open_frames());
                step.write = Some(out.freeze());
                if self.busy {
                    self.busy = false;
                    step.answer = Some(if close.reply_code == NOT_FOUND {
                        ProbeAnswer::Missing
                    } else {
                        ProbeAnswer::Unknown
                    });
                }
            }
            _ => {}
        }
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::wire::WireCodec;
    use tokio_util::codec::Decoder;

    fn frame(bytes: Bytes) -> WireFrame {
        let mut buf = BytesMut::from(&bytes[..]);
        WireCodec::new(4096).decode(&mut buf).unwrap().unwrap()
    }

    #[test]
    fn answers_exists_missing_and_reopens_after_a_no() {
        let mut probe = QueueProbe::new(7);
        let q = ShortString::from("q");
        assert!(probe.ask(&q).is_some());
        assert!(probe.ask(&q).is_none(), "one question at a time");
        let ok = frame(method_frame(
            7,
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: q.clone(),
                message_count: 0,
                consumer_count: 0,
            })),
        ));
        assert_eq!(probe.on_frame(&ok).answer, Some(ProbeAnswer::Exists));
        probe.ask(&q).unwrap();
        let close = frame(method_frame(
            7,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 404,
                reply_text: ShortString::from("NOT_FOUND - no queue 'q' in vhost '/'"),
                class_id: 50,
                method_id: 10,
            })),
        ));
        let step = probe.on_frame(&close);
        assert_eq!(step.answer, Some(ProbeAnswer::Missing));
        let write = step.write.unwrap();
        let mut buf = BytesMut::from(&write[..]);
        let mut codec = WireCodec::new(4096);
        let ids: Vec<_> = std::iter::from_fn(|| codec.decode(&mut buf).unwrap())
            .map(|f| f.method_ids())
            .collect();
        assert_eq!(ids, vec![(20, 41), (20, 10)]);
        assert!(probe.ask(&q).is_some());
    }
}
