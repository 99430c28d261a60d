//! Proxy mode, queue.declare: the declares the proxy answers itself (invalid arguments,
//! inequivalent redeclares) get the broker's 406 and leave the connection usable, even when
//! the client reuses the channel number at once.

use crate::proxy_support;

use dlx_proxy::proxy::wire::method_frame;
use lapin::ErrorKind;
use lapin::options::QueueDeclareOptions;
use lapin::protocol::{AMQPClass, channel, queue};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use proxy_support::*;

fn channel_open(id: u16) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn channel_close_ok(id: u16) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
}

fn queue_declare(id: u16, name: &str, arguments: FieldTable) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: ShortString::from(name),
            passive: false,
            durable: false,
            exclusive: true,
            auto_delete: false,
            nowait: false,
            arguments,
        })),
    )
}

fn close_code(payload: &[u8]) -> (u16, String) {
    match dlx_proxy::amqp::codec::decode_method(payload) {
        Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
            (close.reply_code, close.reply_text.as_str().to_string())
        }
        Some(AMQPClass::Connection(lapin::protocol::connection::AMQPMethod::Close(close))) => {
            (close.reply_code, close.reply_text.as_str().to_string())
        }
        other => panic!("not a close: {other:?}"),
    }
}

/// A client that answers the proxy's 406 and reopens the same channel number in one write,
/// before the upstream has confirmed the proxy's own channel.close, gets a working channel
/// (RabbitMQ would otherwise see a second channel.open on a channel it is still closing and
/// close the whole connection with 504 CHANNEL_ERROR).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reusing_a_channel_number_right_after_a_refused_declare_works() {
    let proxy = TestProxy::start(vec![]).await;
    let mut client = RawClient::connect_named(proxy.addr, &unique("reuse")).await;
    client.send_raw(&channel_open(1)).await;
    assert_eq!(client.next_method().await.1, (20, 11));
    let invalid = [
        ("x-expires", AMQPValue::LongInt(0)),
        ("x-dead-letter-exchange", AMQPValue::LongInt(42)),
        ("x-message-ttl", AMQPValue::LongInt(-1)),
    ];
    for round in 0..30 {
        let (key, value) = &invalid[round % invalid.len()];
        let name = unique("refused");
        client
            .send_raw(&queue_declare(1, &name, table(&[(key, value.clone())])))
            .await;
        let (ch, ids, payload) = client.next_method().await;
        assert_eq!(
            (ch, ids),
            (1, (20, 40)),
            "round {round}: {:?}",
            close_code(&payload)
        );
        let (code, text) = close_code(&payload);
        assert_eq!(code, 406, "round {round}: {text}");
        assert!(text.contains(&name), "{text}");
        // close-ok, reopen and a valid declare in one write.
        let mut burst = Vec::new();
        burst.extend_from_slice(&channel_close_ok(1));
        burst.extend_from_slice(&channel_open(1));
        let ok_name = unique("after-refusal");
        burst.extend_from_slice(&queue_declare(1, &ok_name, FieldTable::default()));
        client.send_raw(&burst).await;
        let (ch, ids, payload) = client.next_method().await;
        assert_eq!(
            (ch, ids),
            (1, (20, 11)),
            "round {round}: expected channel.open-ok, got {ids:?} {:?}",
            (ids.1 == 40 || ids.1 == 50).then(|| close_code(&payload))
        );
        let (ch, ids, _) = client.next_method().await;
        assert_eq!((ch, ids), (1, (50, 11)), "round {round}: declare-ok");
    }
    proxy.stop().await;
}

/// A queue.declare through lapin that is expected to fail: its reply code and text.
pub(crate) async fn refused(
    ch: &lapin::Channel,
    name: &str,
    options: QueueDeclareOptions,
    arguments: FieldTable,
) -> (u16, String) {
    match ch
        .queue_declare(name.into(), options, arguments)
        .await
        .map(|_| ())
        .map_err(|e| e.kind().clone())
    {
        Err(ErrorKind::ProtocolError(e)) => (e.get_id(), e.get_message().as_str().to_string()),
        other => panic!("expected a channel error declaring {name}, got {other:?}"),
    }
}

/// Redeclares through the proxy are compared with the declaration the queue was created with,
/// exactly as the embedded broker (and RabbitMQ) compare them, although the upstream queue
/// carries the proxy's arguments and is declared passively.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inequivalent_redeclares_get_the_brokers_406() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("redeclare");
    let original = table(&[
        ("x-dead-letter-exchange", ls("dlxA")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
    ]);
    declare(&ch, &q, original.clone()).await;
    // Equivalent: the same arguments, an int64 TTL, an argument RabbitMQ does not compare.
    declare(&ch, &q, original.clone()).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls("dlxA")),
            ("x-message-ttl", AMQPValue::LongLongInt(1000)),
            ("x-custom", ls("v")),
        ]),
    )
    .await;
    let prefix = "PRECONDITION_FAILED - inequivalent arg";
    let suffix = format!("for queue '{q}' in vhost '/'");
    let cases: Vec<(&str, QueueDeclareOptions, FieldTable, String)> = vec![
        (
            "different DLX",
            QueueDeclareOptions::default(),
            table(&[
                ("x-dead-letter-exchange", ls("dlxB")),
                ("x-message-ttl", AMQPValue::LongInt(1000)),
            ]),
            format!(
                "{prefix} 'x-dead-letter-exchange' {suffix}: received 'dlxB' but current is 'dlxA'"
            ),
        ),
        (
            "DLX omitted",
            QueueDeclareOptions::default(),
            table(&[("x-message-ttl", AMQPValue::LongInt(1000))]),
            format!(
                "{prefix} 'x-dead-letter-exchange' {suffix}: received none but current is the value 'dlxA' of type 'longstr'"
            ),
        ),
        (
            "no arguments",
            QueueDeclareOptions::default(),
            FieldTable::default(),
            format!(
                "{prefix} 'x-message-ttl' {suffix}: received none but current is the value '1000' of type 'signedint'"
            ),
        ),
        (
            "DLRK added",
            QueueDeclareOptions::default(),
            table(&[
                ("x-dead-letter-exchange", ls("dlxA")),
                ("x-message-ttl", AMQPValue::LongInt(1000)),
                ("x-dead-letter-routing-key", ls("k")),
            ]),
            format!(
                "{prefix} 'x-dead-letter-routing-key' {suffix}: received the value 'k' of type 'longstr' but current is none"
            ),
        ),
        (
            "different TTL",
            QueueDeclareOptions::default(),
            table(&[
                ("x-dead-letter-exchange", ls("dlxA")),
                ("x-message-ttl", AMQPValue::LongInt(2000)),
            ]),
            format!("{prefix} 'x-message-ttl' {suffix}: received '2000' but current is '1000'"),
        ),
        (
            "durable",
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            original.clone(),
            format!("{prefix} 'durable' {suffix}: received 'true' but current is 'false'"),
        ),
    ];
    for (label, options, arguments, expected) in cases {
        // Each on a fresh channel: the refusal closes it.
        let ch = conn.create_channel().await.unwrap();
        let (code, text) = refused(&ch, &q, options, arguments).await;
        assert_eq!((code, text.as_str()), (406, expected.as_str()), "{label}");
    }
    // The queue is untouched: a passive declare works, and it still dead-letters to dlxA
    // (the capture tag on the upstream queue is the original one).
    let ch = conn.create_channel().await.unwrap();
    crate::common::dl::passive_declare(&ch, q.as_str())
        .await
        .unwrap();
    declare(&ch, &q, original).await;
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    proxy.stop().await;
}

/// What the proxy remembers never outlives the queue: a queue deleted behind the proxy's back
/// (or an exclusive queue gone with its connection) is declared anew with new arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_that_is_gone_is_declared_anew_with_other_arguments() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("recreated");
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls("a"))])).await;
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    uch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    declare(&ch, &q, table(&[("x-dead-letter-exchange", ls("b"))])).await;
    // Now "b" is what the queue was declared with.
    let ch = conn.create_channel().await.unwrap();
    let (code, text) = refused(
        &ch,
        &q,
        QueueDeclareOptions::default(),
        table(&[("x-dead-letter-exchange", ls("a"))]),
    )
    .await;
    assert_eq!(code, 406, "{text}");
    assert!(text.contains("received 'a' but current is 'b'"), "{text}");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();

    // Exclusive queues go with their connection.
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..QueueDeclareOptions::default()
    };
    let e = unique("exclusive");
    let first = proxy.connect().await;
    let first_ch = first.create_channel().await.unwrap();
    first_ch
        .queue_declare(
            e.as_str().into(),
            exclusive,
            table(&[("x-message-ttl", AMQPValue::LongInt(1000))]),
        )
        .await
        .unwrap();
    first.close(200, "bye".into()).await.unwrap();
    let second = proxy.connect().await;
    let second_ch = second.create_channel().await.unwrap();
    second_ch
        .queue_declare(
            e.as_str().into(),
            exclusive,
            table(&[("x-message-ttl", AMQPValue::LongInt(5000))]),
        )
        .await
        .expect("a new exclusive queue of the same name");
    second.close(200, "bye".into()).await.unwrap();
    let _ = upstream.close(200, "bye".into()).await;
    proxy.stop().await;
}

/// A proxy instance that did not see a queue declared (a restart, another pod) gives the
/// same 406 as the instance that did: RabbitMQ compares the queue's own arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_refuses_what_the_queue_was_not_declared_with() {
    let first = TestProxy::start(vec![]).await;
    let q = unique("two-instances");
    let dlx_a = table(&[("x-dead-letter-exchange", ls("a"))]);
    let dlx_b = table(&[("x-dead-letter-exchange", ls("b"))]);
    let conn = first.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, &q, dlx_a.clone()).await;
    conn.close(200, "bye".into()).await.unwrap();

    let second = TestProxy::instance_of(&first, vec![]).await;
    first.stop_instance();
    let conn = second.connect().await;
    let (code, text) = refused(
        &conn.create_channel().await.unwrap(),
        &q,
        QueueDeclareOptions::default(),
        dlx_b,
    )
    .await;
    assert_eq!(code, 406, "{text}");
    assert!(text.contains("received 'b' but current is 'a'"), "{text}");
    declare(&conn.create_channel().await.unwrap(), &q, dlx_a.clone()).await;
    conn.create_channel()
        .await
        .unwrap()
        .queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    second.stop().await;
}

/// Dead-letter arguments too long for the capture tag (each name fits, both together do not)
/// are refused with 406 naming the argument: the upstream queue could not record its target,
/// so an instance that did not see the declare would discard what dies in it. The queue is
/// not created, and the connection stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_target_the_upstream_cannot_record_is_refused() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let q = unique("long-target");
    let long = table(&[
        ("x-dead-letter-exchange", ls(&"x".repeat(130))),
        ("x-dead-letter-routing-key", ls(&"k".repeat(130))),
    ]);
    let ch = conn.create_channel().await.unwrap();
    let (code, text) = refused(&ch, &q, QueueDeclareOptions::default(), long).await;
    assert_eq!(code, 406, "{text}");
    let expected = format!(
        "PRECONDITION_FAILED - invalid arg 'x-dead-letter-exchange' for queue '{q}' in vhost '/': {{too_long,"
    );
    assert!(text.starts_with(&expected), "{text}");
    let ch = conn.create_channel().await.unwrap();
    let (code, _) = refused(
        &ch,
        &q,
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await;
    assert_eq!(code, 404, "not created");
    proxy.stop().await;
}
