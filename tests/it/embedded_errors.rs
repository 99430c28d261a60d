//! Every reply code the embedded broker uses, provoked and asserted: channel errors through
//! lapin, connection errors and malformed input through a raw client.

use crate::common;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic, channel, exchange, queue, tx};
use amq_protocol::types::FieldTable;
use common::dl::{amqp_code, amqp_text, declare, declare_with, publish_refused, try_consumer};
use common::*;
use dlx_proxy::amqp::codec::{FRAME_BODY, FRAME_HEADER, PROTOCOL_HEADER, put_raw_frame};
use lapin::options::*;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};

/// Expects connection.close with `code` on a raw client and answers it; returns its text.
async fn expect_connection_close(c: &mut RawClient, code: u16) -> String {
    let (reply_code, text) = c.expect_connection_close().await;
    assert_eq!(reply_code, code, "reply text: {text}");
    c.send_close_ok().await;
    text
}

#[tokio::test]
async fn wrong_protocol_header_is_answered_with_ours_and_closed() {
    let b = start().await;
    let mut c = RawClient::connect_no_handshake(b.addr).await;
    c.send_raw(b"AMQP\x00\x00\x08\x00").await;
    let got = c.read_to_end().await;
    assert_eq!(got, PROTOCOL_HEADER);
}

#[tokio::test]
async fn reserved_names_are_403() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let err = ch
        .queue_declare(
            "amq.mine".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(403));
    assert!(
        amqp_text(&err).contains("reserved prefix"),
        "{}",
        amqp_text(&err)
    );
    let ch = c.create_channel().await.unwrap();
    let err = ch
        .exchange_declare(
            "amq.mine".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(403));
}

#[tokio::test]
async fn missing_queue_and_exchange_are_404() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let err = ch
        .basic_consume(
            "nope".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(404));
    assert_eq!(amqp_text(&err), "NOT_FOUND - no queue 'nope' in vhost '/'");
    let ch = c.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let err = publish_refused(&ch, "no-exchange", "k", BasicProperties::default()).await;
    assert_eq!(amqp_code(&err), Some(404));
    assert_eq!(
        amqp_text(&err),
        "NOT_FOUND - no exchange 'no-exchange' in vhost '/'"
    );
}

#[tokio::test]
async fn exclusive_queue_of_another_connection_is_405() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("excl");
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    declare_with(&ch, &q, exclusive, FieldTable::default()).await;
    let (_c2, ch2) = b.channel().await;
    let err = ch2
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(405));
}

#[tokio::test]
async fn inequivalent_redeclare_is_406() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("ineq");
    common::dl::declare_durable(&ch, &q, FieldTable::default()).await;
    let err = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(406));
    assert!(
        amqp_text(&err).contains("inequivalent arg 'durable'"),
        "{}",
        amqp_text(&err)
    );
}

#[tokio::test]
async fn unknown_delivery_tag_is_406() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    c.send_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 42,
            multiple: false,
        })),
    )
    .await;
    match c.read_method().await {
        AMQPClass::Channel(channel::AMQPMethod::Close(close)) => {
            assert_eq!(close.reply_code, 406);
            assert_eq!(
                close.reply_text.as_str(),
                "PRECONDITION_FAILED - unknown delivery tag 42"
            );
            assert_eq!((close.class_id, close.method_id), (60, 80));
        }
        other => panic!("expected channel.close, got {other:?}"),
    }
}

/// The client closes a channel while the broker's close of it (an error) is on its way: as in
/// RabbitMQ, the client's close gets a close-ok and the channel stays closing until the
/// client's close-ok to the broker's close; the connection and its other channels go on.
#[tokio::test]
async fn a_channel_close_crossing_the_brokers_is_answered_and_the_connection_stays() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    c.open_channel(2).await;
    let mut both = encode_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 42,
            multiple: false,
        })),
    );
    both.extend(encode_method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    c.send_raw(&both).await;
    let (ch, close) = c
        .method_within(Duration::from_secs(5))
        .await
        .expect("the broker's close");
    assert_eq!(ch, 1);
    match close {
        AMQPClass::Channel(channel::AMQPMethod::Close(close)) => assert_eq!(close.reply_code, 406),
        other => panic!("expected channel.close, got {other:?}"),
    }
    let (ch, ok) = c
        .method_within(Duration::from_secs(5))
        .await
        .expect("close-ok");
    assert_eq!(ch, 1);
    assert!(
        matches!(ok, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
        "expected channel.close-ok, got {ok:?}"
    );
    // The client's answer to the broker's close ends the channel, and nothing else.
    c.send_method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    c.send_method(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 5,
            global: false,
        })),
    )
    .await;
    let (ch, qos_ok) = c
        .method_within(Duration::from_secs(5))
        .await
        .expect("qos-ok");
    assert_eq!(ch, 2);
    assert!(
        matches!(qos_ok, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        "expected basic.qos-ok on the other channel, got {qos_ok:?}"
    );
    c.open_channel(1).await;
}

#[tokio::test]
async fn bad_frame_end_is_501() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    let mut frame = encode_method(
        0,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    let last = frame.len() - 1;
    frame[last] = 0x00;
    c.send_raw(&frame).await;
    expect_connection_close(&mut c, 501).await;
}

#[tokio::test]
async fn oversized_frame_is_501() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    let mut raw = vec![1u8, 0, 1];
    raw.extend_from_slice(&(50_000_000u32).to_be_bytes());
    c.send_raw(&raw).await;
    expect_connection_close(&mut c, 501).await;
}

#[tokio::test]
async fn malformed_method_is_502() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    let mut buf = bytes::BytesMut::new();
    // queue.declare with a truncated argument list.
    put_raw_frame(&mut buf, 1, 1, &[0, 50, 0, 10, 0]);
    c.open_channel(1).await;
    c.send_raw(&buf).await;
    expect_connection_close(&mut c, 502).await;
}

#[tokio::test]
async fn unknown_exchange_type_is_503() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    c.send_method(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "x-weird".into(),
            kind: "no-such-type".into(),
            passive: false,
            durable: false,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
    .await;
    expect_connection_close(&mut c, 503).await;
}

#[tokio::test]
async fn method_on_unopened_channel_is_504() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.send_method(
        7,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
    .await;
    expect_connection_close(&mut c, 504).await;
}

#[tokio::test]
async fn content_without_publish_is_505() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    let mut buf = bytes::BytesMut::new();
    put_raw_frame(&mut buf, FRAME_BODY, 1, b"stray body");
    c.send_raw(&buf).await;
    expect_connection_close(&mut c, 505).await;
}

#[tokio::test]
async fn method_between_header_and_body_is_505() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    c.send_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
        })),
    )
    .await;
    let mut buf = bytes::BytesMut::new();
    let mut header = vec![0, 60, 0, 0];
    header.extend_from_slice(&5u64.to_be_bytes());
    header.extend_from_slice(&[0, 0]);
    put_raw_frame(&mut buf, FRAME_HEADER, 1, &header);
    c.send_raw(&buf).await;
    c.send_method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: true })),
    )
    .await;
    expect_connection_close(&mut c, 505).await;
}

#[tokio::test]
async fn unknown_vhost_is_530() {
    let b = start().await;
    let err = Connection::connect(
        &b.uri_as("guest", "guest", "nope"),
        ConnectionProperties::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
}

#[tokio::test]
async fn tx_select_is_540() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    c.send_method(1, AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})))
        .await;
    expect_connection_close(&mut c, 540).await;
}

#[tokio::test]
async fn bad_password_is_403_access_refused() {
    let b = start().await;
    let err = Connection::connect(
        &b.uri_as("guest", "wrong", "/"),
        ConnectionProperties::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(amqp_code(&err), Some(403), "{err:?}");
}

#[tokio::test]
async fn permissions_are_enforced_per_operation() {
    let mut cfg = test_config();
    cfg.users.push(dlx_proxy::config::UserConfig {
        name: "limited".into(),
        password: "pw".into(),
        password_hash: Default::default(),
        password_file: String::new(),
        loopback_only: false,
        permissions: vec![dlx_proxy::config::PermissionConfig {
            vhost: "/".into(),
            configure: "^mine\\.".into(),
            write: "^mine\\.".into(),
            read: "^mine\\.".into(),
        }],
    });
    let b = start_with(cfg).await;
    let conn = Connection::connect(
        &b.uri_as("limited", "pw", "/"),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, "mine.q", FieldTable::default()).await;
    let err = ch
        .queue_declare(
            "theirs.q".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&err), Some(403));
    assert_eq!(
        amqp_text(&err),
        "ACCESS_REFUSED - access to queue 'theirs.q' in vhost '/' refused for user 'limited'"
    );
    // Publishing to the default exchange needs write on amq.default.
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let err = publish_refused(&ch, "", "mine.q", BasicProperties::default()).await;
    assert_eq!(amqp_code(&err), Some(403));
}

#[tokio::test]
async fn invalid_expiration_closes_the_channel_with_406() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("badexp");
    declare(&ch, &q, FieldTable::default()).await;
    let expiring = BasicProperties::default().with_expiration("soon".into());
    let err = publish_refused(&ch, "", &q, expiring).await;
    assert_eq!(amqp_code(&err), Some(406));
}

#[tokio::test]
async fn garbage_after_the_handshake_never_panics_the_server() {
    let b = start().await;
    for seed in 0u8..20 {
        let mut c = RawClient::connect(b.addr).await;
        let junk: Vec<u8> = (0..200u32)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        c.send_raw(&junk).await;
        let _ = c.read_to_end().await;
    }
    // Still serving.
    let (_c, ch) = b.channel().await;
    declare(&ch, "still-alive", FieldTable::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_max_connections_are_refused_with_530_and_counted() {
    let (_, admin) = free_addresses();
    let mut config = test_config();
    config.limits.max_connections = 2;
    config.listen.admin = admin.to_string();
    let b = start_with(config.clone()).await;
    let first = b.connect().await;
    let second = b.connect().await;
    let err = Connection::connect(&b.uri(), ConnectionProperties::default())
        .await
        .expect_err("a third connection is over limits.max_connections");
    assert_over_connection_limit(&err, admin, 2).await;
    // A reload raises the limit at once...
    config.limits.max_connections = 3;
    b.service.reload(&config).unwrap();
    let extra = b.connect().await;
    // ...and lowering it closes nothing: the slots go as connections end.
    config.limits.max_connections = 2;
    b.service.reload(&config).unwrap();
    extra.close(200, "bye".into()).await.unwrap();
    // A closed connection frees its slot.
    first.close(200, "bye".into()).await.unwrap();
    let third = poll(
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            Connection::connect(&b.uri(), ConnectionProperties::default())
                .await
                .ok()
        },
    )
    .await
    .expect("a slot is free again");
    wait_metric(admin, "dlx_proxy_connections", 2.0).await;
    let err = Connection::connect(&b.uri(), ConnectionProperties::default())
        .await
        .expect_err("still at the lowered limit");
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
    third.close(200, "bye".into()).await.unwrap();
    second.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn a_channel_over_the_negotiated_channel_max_is_530_as_rabbitmq() {
    let b = start().await;
    let mut c = RawClient::connect_with_channel_max(b.addr, 2).await;
    // RabbitMQ limits how many channels are open, not their numbers.
    c.open_channel(1).await;
    c.open_channel(7).await;
    c.send_method(
        3,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await;
    let text = expect_connection_close(&mut c, 530).await;
    assert_eq!(
        text,
        "NOT_ALLOWED - number of channels opened (2) has reached the negotiated channel_max (2)"
    );
}

/// The consumers gauge, as the broker's metrics show it now.
fn consumers_gauge(b: &TestBroker) -> Option<f64> {
    metric_value(&b.metrics_text(), "dlx_proxy_consumers")
}

/// A new server-named queue.
async fn server_named_queue(ch: &lapin::Channel) -> String {
    let queue = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    queue.name().to_string()
}

/// A server-named queue with `count` consumers on `ch`, tagged `prefix` and a number.
async fn queue_with_consumers(
    ch: &lapin::Channel,
    prefix: &str,
    count: usize,
) -> (String, Vec<lapin::Consumer>) {
    let queue = server_named_queue(ch).await;
    let mut consumers = Vec::new();
    for n in 0..count {
        let tag = format!("{prefix}{n}");
        consumers.push(try_consumer(ch, &queue, &tag).await.unwrap());
    }
    (queue, consumers)
}

#[tokio::test]
async fn a_consumer_over_max_consumers_per_channel_is_530_as_rabbitmq() {
    let mut config = test_config();
    config.limits.max_consumers_per_channel = 8;
    let b = start_with(config).await;
    let (c, ch) = b.channel().await;
    let (queue, mut consumers) = queue_with_consumers(&ch, "c", 8).await;
    let queue = queue.as_str();
    assert_eq!(consumers_gauge(&b), Some(8.0));
    // A cancelled consumer frees its place, and another channel has places of its own.
    ch.basic_cancel("c0".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    assert_eq!(consumers_gauge(&b), Some(7.0));
    consumers.push(try_consumer(&ch, queue, "c8").await.unwrap());
    let other = c.create_channel().await.unwrap();
    consumers.push(try_consumer(&other, queue, "o0").await.unwrap());
    assert_eq!(consumers_gauge(&b), Some(9.0));
    // A tag in use is refused for that, even at the limit.
    let err = try_consumer(&ch, queue, "c1").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "NOT_ALLOWED - attempt to reuse consumer tag 'c1'"
    );
    wait_local_metric(&b.service.metrics, "dlx_proxy_consumers", 0.0).await;
    drop(consumers);

    // A new consumer past the limit closes the connection.
    let (_c, ch) = b.channel().await;
    let (queue, _consumers) = queue_with_consumers(&ch, "d", 8).await;
    let queue = queue.as_str();
    assert_eq!(consumers_gauge(&b), Some(8.0));
    let err = try_consumer(&ch, queue, "d8").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "NOT_ALLOWED - reached maximum (8) of consumers per channel"
    );
    // Its consumers ended with it.
    wait_local_metric(&b.service.metrics, "dlx_proxy_consumers", 0.0).await;
}

#[tokio::test]
async fn consumers_of_a_deleted_queue_leave_the_consumers_gauge() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let declared = server_named_queue(&ch).await;
    let queue = declared.as_str();
    let _a = try_consumer(&ch, queue, "a").await.unwrap();
    let _b = try_consumer(&ch, queue, "b").await.unwrap();
    assert_eq!(consumers_gauge(&b), Some(2.0));
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    assert_eq!(consumers_gauge(&b), Some(0.0));
    // A closed channel takes its consumers with it.
    let declared = server_named_queue(&ch).await;
    let _c = try_consumer(&ch, &declared, "c").await.unwrap();
    assert_eq!(consumers_gauge(&b), Some(1.0));
    ch.close(200, "bye".into()).await.unwrap();
    wait_local_metric(&b.service.metrics, "dlx_proxy_consumers", 0.0).await;
}

#[tokio::test]
async fn exchanges_and_bindings_over_their_vhost_limits_are_406_and_gauged() {
    let mut config = test_config();
    config.limits.max_exchanges = 2;
    config.limits.max_bindings = 2;
    let b = start_with(config.clone()).await;
    let (c, ch) = b.channel().await;
    let declare_exchange = async |ch: &lapin::Channel, name: &str| {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
    };
    for name in ["x1", "x2"] {
        declare_exchange(&ch, name).await.unwrap();
    }
    let err = declare_exchange(&ch, "x3").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(406), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - exchange limit in vhost '/' (2) is reached"
    );

    let ch = c.create_channel().await.unwrap();
    let queue = server_named_queue(&ch).await;
    let bind = async |ch: &lapin::Channel, exchange: &str, key: &str| {
        ch.queue_bind(
            queue.as_str().into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    };
    bind(&ch, "x1", "a").await.unwrap();
    bind(&ch, "x2", "a").await.unwrap();
    // The same binding again is no new one.
    bind(&ch, "x1", "a").await.unwrap();
    let err = bind(&ch, "x1", "b").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(406), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "PRECONDITION_FAILED - binding limit in vhost '/' (2) is reached"
    );
    let text = b.metrics_text();
    assert_eq!(metric_value(&text, "dlx_proxy_queues"), Some(1.0));
    assert_eq!(metric_value(&text, "dlx_proxy_exchanges"), Some(2.0));
    assert_eq!(metric_value(&text, "dlx_proxy_bindings"), Some(2.0));

    // A reload raises the limits for the next declares.
    config.limits.max_exchanges = 3;
    config.limits.max_bindings = 3;
    b.service.reload(&config).unwrap();
    let ch = c.create_channel().await.unwrap();
    declare_exchange(&ch, "x3").await.unwrap();
    bind(&ch, "x3", "a").await.unwrap();
    let text = b.metrics_text();
    assert_eq!(metric_value(&text, "dlx_proxy_exchanges"), Some(3.0));
    assert_eq!(metric_value(&text, "dlx_proxy_bindings"), Some(3.0));
    // Deleting the exchange takes its binding with it.
    ch.exchange_delete("x3".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let text = b.metrics_text();
    assert_eq!(metric_value(&text, "dlx_proxy_exchanges"), Some(2.0));
    assert_eq!(metric_value(&text, "dlx_proxy_bindings"), Some(2.0));
}

#[tokio::test]
async fn a_heartbeat_with_a_payload_is_501() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.send_raw(&[8, 0, 0, 0, 0, 0, 4, 0xDE, 0xAD, 0xBE, 0xEF, 0xCE])
        .await;
    let text = expect_connection_close(&mut c, 501).await;
    assert!(text.contains("heartbeat"), "reply text: {text}");
}

#[tokio::test]
async fn heartbeats_do_not_extend_the_handshake_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut config = test_config();
    config.limits.handshake_timeout_secs = 1;
    let b = start_with(config).await;
    let mut stream = tokio::net::TcpStream::connect(b.addr).await.unwrap();
    stream.write_all(&PROTOCOL_HEADER).await.unwrap();
    // A client that never answers connection.start but keeps sending heartbeats.
    let started = std::time::Instant::now();
    let mut buf = [0u8; 4096];
    let closed_after = loop {
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "still open after {:?}",
            started.elapsed()
        );
        if stream
            .write_all(&[8, 0, 0, 0, 0, 0, 0, 0xCE])
            .await
            .is_err()
        {
            break started.elapsed();
        }
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break started.elapsed(),
            Ok(Ok(_)) | Err(_) => {}
        }
    };
    assert!(
        closed_after >= Duration::from_millis(900),
        "closed before the deadline: {closed_after:?}"
    );
}

/// Before its connection is tuned a client's frames may be at most 8192 bytes (RabbitMQ 4.1's
/// initial frame_max, room for a JWT in the SASL response): a larger start-ok is 501, where
/// the server used to take a frame of the full `limits.frame_max` from a client that had not
/// authenticated. A response that fits is read (and here refused as a wrong password).
#[tokio::test]
async fn a_frame_over_the_initial_frame_max_before_tuning_is_501() {
    let b = start().await;
    let mut fits = RawClient::connect_no_handshake(b.addr).await;
    let mut response = b"\0guest\0".to_vec();
    response.resize(7_000, b'x');
    fits.start_ok("PLAIN", &response, FieldTable::default())
        .await;
    let (code, text) = fits.expect_connection_close().await;
    assert_eq!(code, 403, "{text}");

    let mut large = RawClient::connect_no_handshake(b.addr).await;
    response.resize(9_000, b'x');
    large
        .start_ok("PLAIN", &response, FieldTable::default())
        .await;
    let (code, text) = large.expect_connection_close().await;
    assert_eq!(code, 501, "{text}");
    assert!(text.contains("FRAME_ERROR"), "{text}");
}
