//! Unit tests of [`crate::server::channel`]: frames in, through the dispatch to each class's
//! handler and the broker, and the methods written back to the connection (no sockets).

use std::sync::Arc;

use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel as chan, confirm, exchange, queue, tx,
};
use amq_protocol::types::FieldTable;
use bytes::BytesMut;

use super::{ChannelTable, Flow};
use crate::amqp::codec::{RawFrame, put_method};
use crate::amqp::content::{encode_properties, put_content};
use crate::amqp::reply;
use crate::broker::auth::UserDb;
use crate::broker::delivery::short;
use crate::broker::methods::test_support::{broker, read_frames, sent_methods};
use crate::broker::write_queue::WriteQueue;
use crate::config::{LimitsConfig, PermissionConfig, UserConfig};
use crate::server::ServerContext;
use crate::server::connection_context::ConnectionContext;

/// A connection of user `u` on vhost `/` that may configure only names starting with `own`.
fn connection() -> (ChannelTable, ConnectionContext, Arc<ServerContext>) {
    let user = UserConfig {
        name: "u".into(),
        password: "p".into(),
        password_hash: Default::default(),
        password_file: String::new(),
        loopback_only: false,
        permissions: vec![PermissionConfig {
            vhost: "/".into(),
            configure: "^own".into(),
            write: ".*".into(),
            read: ".*".into(),
        }],
    };
    let users = UserDb::from_config(&[user]).expect("valid user");
    let limits = LimitsConfig::default();
    let ctx = ServerContext::new(broker(), users, limits.clone());
    let write_queue = Arc::new(WriteQueue::new(1 << 20));
    let conn_id = ctx
        .broker
        .open_connection(write_queue.clone(), 131_072, "u", "/")
        .expect("vhost / exists");
    let conn = ConnectionContext {
        conn_id,
        peer: "127.0.0.1:5672".parse().expect("an address"),
        user: "u".into(),
        vhost: "/".into(),
        frame_max: 131_072,
        channel_max: 16,
        heartbeat: 0,
        write_queue,
        blocked_notifications: false,
    };
    (ChannelTable::new(&limits), conn, ctx)
}

/// The frames `write` produces, as the frame codec reads them.
fn frames(write: impl FnOnce(&mut BytesMut)) -> Vec<RawFrame> {
    let mut bytes = BytesMut::new();
    write(&mut bytes);
    read_frames(bytes)
}

/// Sends one method on `ch`; the connection error it caused, if any.
fn send(
    table: &mut ChannelTable,
    conn: &ConnectionContext,
    ctx: &ServerContext,
    ch: u16,
    method: AMQPClass,
) -> Option<reply::AmqpError> {
    let mut error = None;
    for frame in frames(|b| put_method(b, ch, method)) {
        match table.handle(frame, conn, ctx) {
            Flow::Continue => {}
            Flow::CloseConnection(err) => error = Some(err),
            Flow::ClientClose | Flow::Closed => panic!("the connection closed"),
        }
    }
    error
}

fn open(table: &mut ChannelTable, conn: &ConnectionContext, ctx: &ServerContext, ch: u16) {
    let open = AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {}));
    assert!(send(table, conn, ctx, ch, open).is_none());
    assert!(matches!(
        &sent_methods(&conn.write_queue)[..],
        [(c, AMQPClass::Channel(chan::AMQPMethod::OpenOk(_)))] if *c == ch
    ));
}

fn queue_declare(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: short(name),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

#[test]
fn a_method_before_channel_open_closes_the_connection() {
    let (mut table, conn, ctx) = connection();
    let err = send(&mut table, &conn, &ctx, 1, queue_declare("own-q")).expect("an error");
    assert_eq!(err.code, reply::CHANNEL_ERROR);
    assert_eq!(
        err.text,
        "CHANNEL_ERROR - expected 'channel.open' on channel 1"
    );
    assert_eq!((err.class_id, err.method_id), (50, 10));
}

#[test]
fn each_class_reaches_its_handler() {
    let (mut table, conn, ctx) = connection();
    open(&mut table, &conn, &ctx, 1);
    let declare_exchange = AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: short("own-x"),
        kind: short("direct"),
        passive: false,
        durable: false,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::default(),
    }));
    let bind = AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
        queue: short("own-q"),
        exchange: short("own-x"),
        routing_key: short("k"),
        nowait: false,
        arguments: FieldTable::default(),
    }));
    let select = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
        nowait: false,
    }));
    for method in [declare_exchange, queue_declare("own-q"), bind, select] {
        assert!(send(&mut table, &conn, &ctx, 1, method).is_none());
    }
    let sent = sent_methods(&conn.write_queue);
    assert!(
        matches!(
            &sent[..],
            [
                (1, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))),
                (1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))),
                (1, AMQPClass::Queue(queue::AMQPMethod::BindOk(_))),
                (1, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
            ] if ok.queue.as_str() == "own-q"
        ),
        "{sent:?}"
    );

    // basic.publish, then its content: routed through own-x and confirmed with seq 1.
    let publish = AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
        exchange: short("own-x"),
        routing_key: short("k"),
        mandatory: false,
        immediate: false,
    }));
    assert!(send(&mut table, &conn, &ctx, 1, publish).is_none());
    let props = encode_properties(&BasicProperties::default());
    for frame in frames(|b| put_content(b, 1, &props, b"hello", 131_072)) {
        assert!(matches!(table.handle(frame, &conn, &ctx), Flow::Continue));
    }
    let get = AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: short("own-q"),
        no_ack: true,
    }));
    assert!(send(&mut table, &conn, &ctx, 1, get).is_none());
    let sent = sent_methods(&conn.write_queue);
    assert!(
        matches!(
            &sent[..],
            [
                (1, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))),
                (1, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok))),
            ] if ack.delivery_tag == 1 && !ack.multiple && ok.message_count == 0
        ),
        "{sent:?}"
    );
}

#[test]
fn a_refused_permission_closes_only_the_channel() {
    let (mut table, conn, ctx) = connection();
    open(&mut table, &conn, &ctx, 1);
    assert!(send(&mut table, &conn, &ctx, 1, queue_declare("theirs")).is_none());
    let sent = sent_methods(&conn.write_queue);
    let [(1, AMQPClass::Channel(chan::AMQPMethod::Close(close)))] = &sent[..] else {
        panic!("{sent:?}");
    };
    assert_eq!(close.reply_code, reply::ACCESS_REFUSED);
    assert_eq!(
        close.reply_text.as_str(),
        "ACCESS_REFUSED - access to queue 'theirs' in vhost '/' refused for user 'u'"
    );
    assert_eq!((close.class_id, close.method_id), (50, 10));
    // Until close-ok, the channel ignores what else arrives; then it can be opened again.
    assert!(send(&mut table, &conn, &ctx, 1, queue_declare("own-q")).is_none());
    assert!(sent_methods(&conn.write_queue).is_empty());
    let close_ok = AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {}));
    assert!(send(&mut table, &conn, &ctx, 1, close_ok).is_none());
    open(&mut table, &conn, &ctx, 1);
}

#[test]
fn transactions_and_server_methods_close_the_connection() {
    let (mut table, conn, ctx) = connection();
    open(&mut table, &conn, &ctx, 1);
    let select = AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {}));
    let err = send(&mut table, &conn, &ctx, 1, select).expect("an error");
    assert_eq!(err.code, reply::NOT_IMPLEMENTED);
    assert_eq!((err.class_id, err.method_id), (90, 10));
    for method in [
        AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
        AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
        AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {})),
    ] {
        let err = send(&mut table, &conn, &ctx, 1, method).expect("an error");
        assert_eq!(err.code, reply::COMMAND_INVALID);
        assert_eq!(
            err.text,
            "COMMAND_INVALID - method not allowed from a client"
        );
    }
}
