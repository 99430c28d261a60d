//! Proxy mode, plain forwarding: what an unchanged client sees through the proxy is what it
//! would see talking to RabbitMQ directly (publish, consume, get, confirms, qos, errors).

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::protocol::{AMQPClass, connection};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ErrorKind};
use proxy_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_get_and_consume_pass_through() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("plain");
    declare(&ch, &q, FieldTable::default()).await;

    let props = BasicProperties::default()
        .with_message_id("m-1".into())
        .with_priority(3)
        .with_headers(table(&[("zz", AMQPValue::LongInt(1)), ("aa", ls("x"))]));
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"hello",
        props.clone(),
    )
    .await
    .unwrap();
    let got = get(&ch, &q).await;
    assert_eq!(payload(&got), "hello");
    assert_eq!(got.properties.message_id(), props.message_id());
    assert_eq!(got.properties.priority(), &Some(3));
    assert_eq!(header(&got, "zz"), Some(&AMQPValue::LongInt(1)));
    got.acker.ack(BasicAckOptions::default()).await.unwrap();

    // A body larger than one frame, through a consumer.
    let big = vec![7u8; 300_000];
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        &big,
        AMQPProperties::default(),
    )
    .await
    .unwrap();
    let d = next(&mut rx).await;
    assert_eq!(d.data, big);
    assert!(!d.redelivered);
    d.acker.ack(BasicAckOptions::default()).await.unwrap();

    wait_upstream_empty(&q).await;
    conn.close(200, "bye".into()).await.unwrap();
    proxy.stop().await;
}

/// A burst of mixed sizes (frames gathered into one write, frames between the small and the
/// largest read size, and bodies split over several frames) through a proxy that busy-polls:
/// every message is confirmed and arrives once, in order, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_polling_proxy_forwards_a_burst_of_mixed_sizes_in_order() {
    let proxy = TestProxy::start_with(vec![], |config| config.proxy.busy_poll_us = 2_000).await;
    let conn = proxy.connect().await;
    let (ch, q) = confirming_channel(&conn, "burst").await;
    let sizes = [100usize, 20_000, 70_000, 300_000];
    let body = |i: usize| -> Vec<u8> {
        let size = sizes[i % sizes.len()];
        (0..size).map(|n| ((n + i * 31) % 251) as u8).collect()
    };
    let count = 120;
    let mut confirms = Vec::new();
    for i in 0..count {
        confirms.push(
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &body(i),
                AMQPProperties::default().with_message_id(i.to_string().into()),
            )
            .await
            .unwrap(),
        );
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
    ch.basic_qos(20, BasicQosOptions::default()).await.unwrap();
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    for i in 0..count {
        let d = next(&mut rx).await;
        assert_eq!(
            d.properties.message_id().as_ref().map(|id| id.as_str()),
            Some(i.to_string().as_str()),
            "in publish order"
        );
        assert!(d.data == body(i), "body of message {i} arrives intact");
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    wait_upstream_empty(&q).await;
    conn.close(200, "bye".into()).await.unwrap();
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_and_qos_keep_their_numbers() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let (ch, q) = confirming_channel(&conn, "confirm").await;
    publish_acked(&ch, &q, 50).await;
    // Unroutable mandatory publish: returned, then acked.
    let confirm = ch
        .basic_publish(
            "".into(),
            unique("nowhere").as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            b"lost",
            AMQPProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    assert!(confirm.take_message().is_some());

    // Prefetch 5: exactly five arrive until acks are sent.
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut rx = consume(&cch, &q, BasicConsumeOptions::default()).await;
    let mut first = Vec::new();
    for _ in 0..5 {
        first.push(next(&mut rx).await);
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(300), rx.recv())
            .await
            .is_err()
    );
    let tags: Vec<u64> = first.iter().map(|d| d.delivery_tag).collect();
    assert_eq!(tags, vec![1, 2, 3, 4, 5]);
    first[4]
        .acker
        .ack(BasicAckOptions { multiple: true })
        .await
        .unwrap();
    let mut seen = 5;
    while seen < 50 {
        let d = next(&mut rx).await;
        assert_eq!(payload(&d), format!("m{seen}"));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
        seen += 1;
    }
    wait_upstream_empty(&q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sees_two_channels_fewer_and_upstream_errors_pass_through() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let direct = upstream_connection().await;
    assert_eq!(
        conn.configuration().channel_max() + 2,
        direct.configuration().channel_max()
    );
    // A channel error from the upstream reaches the client unchanged.
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .queue_declare(
            unique("missing").as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    match err.kind() {
        ErrorKind::ProtocolError(e) => assert_eq!(e.get_id(), 404),
        other => panic!("expected 404, got {other:?}"),
    }
    // The connection still works on another channel.
    let ch2 = conn.create_channel().await.unwrap();
    let q = unique("after-error");
    declare(&ch2, &q, FieldTable::default()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_queue_arguments_get_the_brokers_406_and_the_channel_stays_usable() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("bad-args");
    let err = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            table(&[("x-dead-letter-routing-key", ls("k"))]),
        )
        .await
        .unwrap_err();
    match err.kind() {
        ErrorKind::ProtocolError(e) => {
            assert_eq!(e.get_id(), 406);
            assert_eq!(
                e.get_message().as_str(),
                format!(
                    "PRECONDITION_FAILED - invalid arg 'x-dead-letter-routing-key' for queue '{q}' in vhost '/': routing_key_but_no_dlx_defined"
                )
            );
        }
        other => panic!("expected 406, got {other:?}"),
    }
    // New channels (including a reused number) work, and the queue was never created.
    for _ in 0..3 {
        let ch = conn.create_channel().await.unwrap();
        let ok = unique("ok");
        declare(&ch, &ok, FieldTable::default()).await;
        ch.close(200, "bye".into()).await.unwrap();
    }
    let uch = upstream_connection().await.create_channel().await.unwrap();
    let missing = crate::common::dl::passive_declare(&uch, q.as_str()).await;
    assert!(missing.is_err());
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_the_connection_with_frame_error() {
    let proxy = TestProxy::start(vec![]).await;
    let mut client = RawClient::connect_no_handshake(proxy.addr).await;
    client.send_raw(b"AMQP\x00\x00\x09\x01").await;
    // Read connection.start, then send a frame with an unknown type.
    let start = client.read_method().await;
    assert!(
        matches!(
            start,
            AMQPClass::Connection(connection::AMQPMethod::Start(_))
        ),
        "expected connection.start, got {start:?}"
    );
    client.send_raw(&[9, 0, 0, 0, 0, 0, 0, 0xce]).await;
    // connection.close (10, 50) with reply code 501 arrives.
    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 501, "{text}");

    // A wrong protocol header gets ours back.
    let mut client = RawClient::connect_no_handshake(proxy.addr).await;
    client.send_raw(b"AMQP\x01\x01\x00\x0a").await;
    assert_eq!(client.read_to_end().await, b"AMQP\x00\x00\x09\x01");
    proxy.stop().await;
}

/// Before tune-ok a client's frames may be at most 8192 bytes (RabbitMQ 4.1's initial
/// frame_max): a larger start-ok is refused by the proxy itself with 501, where it read up to
/// the full `limits.frame_max` from a client that had not authenticated yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_ok_over_the_initial_frame_max_is_501() {
    let proxy = TestProxy::start(vec![]).await;
    let mut client = RawClient::connect_no_handshake(proxy.addr).await;
    let mut response = b"\0guest\0".to_vec();
    response.resize(9_000, b'x');
    client
        .start_ok("PLAIN", &response, FieldTable::default())
        .await;
    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 501, "{text}");
    assert!(text.contains("frame_max 8192"), "{text}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_reported_as_320() {
    // No RabbitMQ needed: the upstream port is closed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let mut config = dlx_proxy::config::Config {
        mode: dlx_proxy::config::Mode::Proxy,
        ..Default::default()
    };
    config.upstream.url = format!("amqp://127.0.0.1:{port}");
    config.upstream.connect_timeout_secs = 1;
    let shared = dlx_proxy::proxy::ProxyShared::new(
        &config,
        std::sync::Arc::new(std::sync::RwLock::new(
            dlx_proxy::policy::PolicySet::from_configs(&[]).unwrap(),
        )),
        dlx_proxy::metrics::Metrics::new(10),
    )
    .unwrap();
    assert!(!shared.upstream_reachable().await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let trigger = dlx_proxy::shutdown::ShutdownTrigger::new();
    tokio::spawn(dlx_proxy::proxy::serve(
        listener,
        shared,
        trigger.subscribe(),
    ));
    let err = Connection::connect(
        &format!("amqp://guest:guest@{addr}/%2f"),
        ConnectionProperties::default(),
    )
    .await
    .unwrap_err();
    let text = format!("{err:?}");
    assert!(
        text.contains("320") || text.contains("CONNECTION_FORCED"),
        "{text}"
    );
    trigger.trigger();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_get_with_auto_ack_and_redelivery_flags() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("get");
    declare(&ch, &q, FieldTable::default()).await;
    for p in ["a", "b"] {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            p.as_bytes(),
            AMQPProperties::default(),
        )
        .await
        .unwrap();
    }
    wait_count(&ch, &q, 2).await;
    let a = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(payload(&a.delivery), "a");
    let b = get(&ch, &q).await;
    b.acker
        .nack(lapin::options::BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();
    let again = get(&ch, &q).await;
    assert_eq!(payload(&again), "b");
    assert!(again.redelivered);
    again.acker.ack(BasicAckOptions::default()).await.unwrap();
    consume_empty(&ch, &q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_authenticates_the_client() {
    let proxy = TestProxy::start(vec![]).await;
    let err = Connection::connect(
        &format!("amqp://guest:wrong@{}/%2f", proxy.addr),
        ConnectionProperties::default(),
    )
    .await
    .unwrap_err();
    let text = format!("{err:?}");
    assert!(
        text.contains("403") || text.contains("ACCESS_REFUSED"),
        "{text}"
    );
    let err = Connection::connect(
        &format!(
            "amqp://guest:guest@{}/{}",
            proxy.addr,
            unique("no-such-vhost")
        ),
        ConnectionProperties::default(),
    )
    .await
    .unwrap_err();
    let text = format!("{err:?}");
    assert!(
        text.contains("530") || text.contains("NOT_ALLOWED"),
        "{text}"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_an_idle_connection_alive() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = Connection::connect(
        &format!("amqp://guest:guest@{}/%2f?heartbeat=1", proxy.addr),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    assert_eq!(conn.configuration().heartbeat(), 1);
    let ch = conn.create_channel().await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let q = unique("idle");
    declare(&ch, &q, FieldTable::default()).await;
    assert!(conn.status().connected());
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_clients_with_320() {
    let proxy = TestProxy::start(vec![]).await;
    let mut raw = RawClient::connect_named(proxy.addr, &unique("shutdown")).await;
    proxy.trigger_shutdown();
    let (code, text) = raw.expect_connection_close().await;
    assert_eq!(code, 320);
    assert!(text.contains("shutting down"), "{text}");
    proxy.stop().await;
}

/// More basic.gets than the proxy lets wait for their answers, sent in one write before any
/// answer is read: the proxy pauses reading the client at its limit and resumes as answers
/// come back, so every get is answered, in order, and the connection goes on working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_may_pipeline_more_gets_than_the_proxy_lets_wait() {
    const GETS: usize = 6000;
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("pipelined-gets");
    declare(&ch, &q, FieldTable::default()).await;

    let mut raw = RawClient::connect_named(proxy.addr, &unique("pipelined-gets")).await;
    raw.open_channel(1).await;
    let get = crate::common::encode_method(
        1,
        AMQPClass::Basic(lapin::protocol::basic::AMQPMethod::Get(
            lapin::protocol::basic::Get {
                queue: q.as_str().into(),
                no_ack: false,
            },
        )),
    );
    raw.send_raw(&get.repeat(GETS)).await;
    for n in 0..GETS {
        let (channel, ids, _) = raw.next_method().await;
        assert_eq!((channel, ids), (1, (60, 72)), "answer {n}: basic.get-empty");
    }
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"after",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    crate::common::wait_until(
        "the message to be queued",
        Duration::from_secs(10),
        async || message_count(&ch, &q).await == 1,
    )
    .await;
    raw.send_raw(&get).await;
    let (channel, ids, _) = raw.next_method().await;
    assert_eq!(
        (channel, ids),
        (1, (60, 71)),
        "basic.get-ok after the burst"
    );
    proxy.stop().await;
}
