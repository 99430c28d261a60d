//! The declare channel of a vhost's declare connection (`declare_task.rs`): the queue.declares
//! that client sessions of the vhost have RabbitMQ judge *as the proxy's service identity*,
//! because they carry the proxy's own upstream arguments (the capture exchange as dead-letter
//! exchange, the [`CaptureTag`](crate::proxy::declare::CaptureTag) as routing key) on which
//! application users need no permission.
//!
//! A session sends a [`DeclareRequest`] through the vhost's bounded queue
//! ([`super::ServiceHandle::declares`]) and waits for the [`CheckAnswer`] on its oneshot:
//! the rounds of the declare check ([`crate::proxy::arbiter`]; a declare-ok creates the
//! queue, so the queue is created by the service identity too) and of the read-back
//! ([`crate::proxy::readback`]). One declare is in flight at a time on channel
//! [`DECLARE_CHANNEL`], which stays open between declares and is reopened after a refusal
//! closed it ([`CheckChannel`]). The task takes the next request only when this one is
//! answered, so the queue's capacity is the bound. A session that stopped waiting (its
//! oneshot dropped) is skipped; a connection lost with a declare in flight drops its oneshot,
//! and the session gives up on the declare (320, the client reconnects).

use amq_protocol::protocol::queue;
use bytes::Bytes;
use tokio::sync::oneshot;

use crate::proxy::probe::{CheckAnswer, CheckChannel};
use crate::proxy::wire::WireFrame;

/// The declare connection's channel for judged declares.
pub const DECLARE_CHANNEL: u16 = 3;
/// Declares waiting for a vhost's declare connection (one per session at most).
pub const DECLARE_QUEUE: usize = 1024;

/// One declare a session has the declare connection make.
#[derive(Debug)]
pub struct DeclareRequest {
    pub declare: queue::Declare,
    pub answer: oneshot::Sender<CheckAnswer>,
}

/// The declare channel of one declare connection.
#[derive(Debug)]
pub struct Judge {
    channel: CheckChannel,
    waiting: Option<oneshot::Sender<CheckAnswer>>,
}

impl Default for Judge {
    fn default() -> Self {
        Judge {
            channel: CheckChannel::new(DECLARE_CHANNEL),
            waiting: None,
        }
    }
}

impl Judge {
    /// Whether a new request may start (none in flight).
    pub fn ready(&self) -> bool {
        self.waiting.is_none()
    }

    /// Starts `request`: the bytes to write (the channel opened first when needed). A request
    /// whose session stopped waiting is dropped.
    pub fn start(&mut self, request: DeclareRequest) -> Option<Bytes> {
        if request.answer.is_closed() {
            return None;
        }
        self.waiting = Some(request.answer);
        self.channel.declare(request.declare)
    }

    /// A frame on [`DECLARE_CHANNEL`]: the answer goes to the waiting session; the bytes
    /// returned (a close-ok, a reopen) to the upstream.
    pub fn on_frame(&mut self, frame: &WireFrame) -> Option<Bytes> {
        let step = self.channel.on_frame(frame);
        if let Some(answer) = step.answer
            && let Some(waiting) = self.waiting.take()
        {
            // The session may have gone meanwhile; nothing else to do then.
            let _ = waiting.send(answer);
        }
        step.write
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::wire::{WireCodec, method_frame};
    use amq_protocol::protocol::{AMQPClass, channel};
    use amq_protocol::types::{FieldTable, ShortString};
    use bytes::BytesMut;
    use tokio_util::codec::Decoder;

    fn ids(bytes: &Bytes) -> Vec<(u16, (u16, u16))> {
        let mut buf = BytesMut::from(&bytes[..]);
        let mut codec = WireCodec::new(4096);
        std::iter::from_fn(|| codec.decode(&mut buf).unwrap())
            .map(|f| (f.channel, f.method_ids()))
            .collect()
    }

    fn frame(method: AMQPClass) -> WireFrame {
        let mut buf = BytesMut::from(&method_frame(DECLARE_CHANNEL, method)[..]);
        WireCodec::new(4096).decode(&mut buf).unwrap().unwrap()
    }

    fn request() -> (DeclareRequest, oneshot::Receiver<CheckAnswer>) {
        let (answer, rx) = oneshot::channel();
        let declare = queue::Declare {
            queue: ShortString::from("q"),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        };
        (DeclareRequest { declare, answer }, rx)
    }

    #[test]
    fn answers_go_to_the_waiting_session_and_the_channel_stays_open() {
        let mut judge = Judge::default();
        let (req, mut rx) = request();
        let out = judge.start(req).unwrap();
        assert_eq!(
            ids(&out),
            vec![(DECLARE_CHANNEL, (20, 10)), (DECLARE_CHANNEL, (50, 10))]
        );
        assert!(!judge.ready());
        let ok = frame(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
            queue::DeclareOk {
                queue: ShortString::from("q"),
                message_count: 0,
                consumer_count: 0,
            },
        )));
        assert!(judge.on_frame(&ok).is_none());
        assert_eq!(rx.try_recv().unwrap(), CheckAnswer::DeclareOk);
        assert!(judge.ready());
        // The next declare goes on the open channel.
        let (req, mut rx) = request();
        assert_eq!(
            ids(&judge.start(req).unwrap()),
            vec![(DECLARE_CHANNEL, (50, 10))]
        );
        let close = frame(AMQPClass::Channel(channel::AMQPMethod::Close(
            channel::Close {
                reply_code: 403,
                reply_text: ShortString::from("ACCESS_REFUSED - x"),
                class_id: 50,
                method_id: 10,
            },
        )));
        let out = judge.on_frame(&close).unwrap();
        assert_eq!(ids(&out), vec![(DECLARE_CHANNEL, (20, 41))]);
        assert_eq!(
            rx.try_recv().unwrap(),
            CheckAnswer::Refused {
                code: 403,
                text: "ACCESS_REFUSED - x".into()
            }
        );
        // After a refusal the channel is opened again for the next one.
        let (req, _rx) = request();
        assert_eq!(
            ids(&judge.start(req).unwrap()),
            vec![(DECLARE_CHANNEL, (20, 10)), (DECLARE_CHANNEL, (50, 10))]
        );
    }

    #[test]
    fn a_request_nobody_waits_for_is_skipped() {
        let mut judge = Judge::default();
        let (req, rx) = request();
        drop(rx);
        assert!(judge.start(req).is_none());
        assert!(judge.ready());
    }
}
