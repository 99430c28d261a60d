//! A broker for the unit tests of the method families (and of `server::channel`): vhost `/`,
//! and connections whose write queues the tests read back as decoded frames (no sockets).

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::BytesMut;
use tokio_util::codec::Decoder;

use super::{PublishResult, QueueDeclare};
use crate::amqp::codec::{FRAME_METHOD, FrameCodec, RawFrame, decode_method};
use crate::amqp::content::encode_properties;
use crate::broker::delivery::short;
use crate::broker::message::Message;
use crate::broker::write_queue::WriteQueue;
use crate::broker::{Broker, BrokerOptions};
use crate::metrics::Metrics;
use crate::policy::PolicySet;

/// A broker with one vhost `/` (at most 8 queues, exchanges, bindings and consumers per
/// channel) and no policies.
pub(crate) fn broker() -> Arc<Broker> {
    let options = BrokerOptions {
        dead_letter: Default::default(),
        default_delivery_limit: None,
        max_queues: 8,
        max_exchanges: 8,
        max_bindings: 8,
        max_consumers_per_channel: 8,
        consumer_timeout: None,
        keep_dead_letters: false,
    };
    let policies = PolicySet::from_configs(&[]).expect("no policies");
    Broker::new(&["/".to_string()], policies, options, Metrics::new(100))
}

/// One open connection of user `guest` on vhost `/`, with channel 1 open.
pub(super) struct Client {
    pub conn: u64,
    pub out: Arc<WriteQueue>,
}

impl Client {
    pub fn connect(broker: &Broker) -> Client {
        Client::connect_with_budget(broker, 1 << 20)
    }

    /// As [`Client::connect`], with a write queue of `budget` bytes.
    pub fn connect_with_budget(broker: &Broker, budget: usize) -> Client {
        let out = Arc::new(WriteQueue::new(budget));
        let conn = broker
            .open_connection(out.clone(), 131_072, "guest", "/")
            .expect("vhost / exists");
        broker.open_channel(conn, 1);
        Client { conn, out }
    }

    /// The methods written to the connection since the last call, with their channel
    /// (content header and body frames skipped).
    pub fn methods(&self) -> Vec<(u16, AMQPClass)> {
        sent_methods(&self.out)
    }
}

/// The methods written to `out` since the last call, with their channel (content header and
/// body frames skipped).
pub(crate) fn sent_methods(out: &WriteQueue) -> Vec<(u16, AMQPClass)> {
    read_frames(out.try_batch())
        .into_iter()
        .filter(|frame| frame.kind == FRAME_METHOD)
        .map(|frame| {
            let method = decode_method(&frame.payload).expect("a known method");
            (frame.channel, method)
        })
        .collect()
}

/// The frames in `bytes`, as the frame codec reads them.
pub(crate) fn read_frames(mut bytes: BytesMut) -> Vec<RawFrame> {
    let mut codec = FrameCodec::new(131_072);
    let mut frames = Vec::new();
    while let Some(frame) = codec.decode(&mut bytes).expect("well-formed frames") {
        frames.push(frame);
    }
    frames
}

/// A field table of these entries (queue arguments).
pub(super) fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(short(k), v.clone());
    }
    t
}

/// A long-string argument value.
pub(super) fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

/// A long-long-int argument value.
pub(super) fn long(v: i64) -> AMQPValue {
    AMQPValue::LongLongInt(v)
}

/// A plain queue.declare request.
pub(crate) fn declare<'a>(name: &'a str, arguments: &'a FieldTable) -> QueueDeclare<'a> {
    QueueDeclare {
        name,
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments,
        restored: false,
    }
}

/// A message with no properties published with `key` to `exchange`.
pub(super) fn message(exchange: &str, key: &str, body: &[u8]) -> Arc<Message> {
    let props = encode_properties(&BasicProperties::default());
    Arc::new(Message::new(exchange, &[key], &props, body, None, false))
}

/// Publishes `body` through the default exchange to queue `queue`.
pub(crate) fn publish_to(broker: &Broker, queue: &str, body: &[u8]) -> PublishResult {
    broker
        .publish("/", "", message("", queue, body), None)
        .expect("the default exchange exists")
}

/// Messages ready in `queue` of vhost `/`.
pub(super) fn ready(broker: &Broker, queue: &str) -> usize {
    broker.lock().vhosts["/"].queues[queue].state.len()
}

/// Bodies of the messages ready in `queue`, head first.
pub(super) fn bodies(broker: &Broker, queue: &str) -> Vec<Vec<u8>> {
    broker.lock().vhosts["/"].queues[queue]
        .state
        .iter()
        .map(|e| e.message.body().to_vec())
        .collect()
}

/// An exchange.declare request for a non-durable exchange.
pub(super) fn exchange<'a>(
    name: &'a str,
    kind: &'a str,
    arguments: &'a FieldTable,
) -> super::ExchangeDeclare<'a> {
    super::ExchangeDeclare {
        name,
        kind,
        passive: false,
        durable: false,
        auto_delete: false,
        internal: false,
        arguments,
    }
}

/// A fanout exchange `dlx` with queue `dead` bound to it: the dead-letter target of the tests.
pub(super) fn dead_letter_target(broker: &Broker, conn: u64) {
    let none = FieldTable::default();
    broker
        .exchange_declare("/", &exchange("dlx", "fanout", &none))
        .expect("declare dlx");
    broker
        .queue_declare(conn, "/", &declare("dead", &none))
        .expect("declare dead");
    broker
        .bind(
            conn,
            "/",
            "dlx",
            crate::broker::routing::Destination::Queue("dead".into()),
            "",
            &none,
        )
        .expect("bind dead to dlx");
}

/// A broker, a client, and queue `q` declared with `arguments` holding `messages`.
pub(super) fn with_queue(arguments: &FieldTable, messages: &[&[u8]]) -> (Arc<Broker>, Client) {
    let b = broker();
    let c = Client::connect(&b);
    b.queue_declare(c.conn, "/", &declare("q", arguments))
        .expect("declare q");
    for body in messages {
        publish_to(&b, "q", body);
    }
    (b, c)
}
