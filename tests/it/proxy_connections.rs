//! Proxy mode, the connection itself: refusals from the upstream reach the client with the
//! upstream's own code and text (or, as RabbitMQ does, as a closed socket), frames the proxy
//! judges itself get RabbitMQ's replies, `limits.max_connections`, the negotiated
//! channel_max and `limits.max_consumers_per_channel` are enforced, and loopback-only users
//! (guest) are refused from other addresses. Each case is run against RabbitMQ directly and
//! through the proxy.

use crate::common;
use crate::proxy_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::dl::{amqp_code, amqp_text, try_consumer};
use common::netns::NetNs;
use common::{
    assert_over_connection_limit, encode_method, free_addresses, metric_value, poll,
    wait_local_metric, wait_metric, with_failure_close,
};
use dlx_proxy::amqp::codec::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, put_raw_frame};
use dlx_proxy::config::{Config, Mode};
use lapin::options::{BasicCancelOptions, QueueDeleteOptions};
use lapin::protocol::{AMQPClass, basic, channel};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use proxy_support::*;

fn direct() -> SocketAddr {
    upstream_host().parse().expect("upstream address")
}

/// The error of a lapin connection that must fail.
async fn refused(uri: &str) -> lapin::Error {
    Connection::connect(uri, ConnectionProperties::default())
        .await
        .expect_err("the connection must be refused")
}

/// Asserts that the server closes the connection without sending a frame, in well under the
/// raw client's 15 s read limit (RabbitMQ waits 3 s before it closes a refused handshake).
async fn assert_closed_silently(client: &mut RawClient, what: &str) {
    let started = Instant::now();
    let frame = client.read_frame().await;
    assert!(
        frame.is_none(),
        "{what}: expected a closed socket, got {frame:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{what}: the socket stayed open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_login_and_vhost_refusals_reach_the_client_unchanged() {
    let proxy = TestProxy::start(vec![]).await;
    let missing_vhost = unique("no-such-vhost");
    let uris: [fn(SocketAddr, &str) -> String; 3] = [
        |addr: SocketAddr, _: &str| format!("amqp://guest:wrong@{addr}/%2f"),
        |addr: SocketAddr, _: &str| format!("amqp://nobody-{}:pw@{addr}/%2f", addr.port()),
        |addr: SocketAddr, vhost: &str| format!("amqp://guest:guest@{addr}/{vhost}"),
    ];
    for uri in uris {
        let from_rabbitmq = refused(&uri(direct(), &missing_vhost)).await;
        let through_proxy = refused(&uri(proxy.addr, &missing_vhost)).await;
        assert!(
            matches!(amqp_code(&from_rabbitmq), Some(403 | 530)),
            "{from_rabbitmq:?}"
        );
        assert_eq!(amqp_code(&through_proxy), amqp_code(&from_rabbitmq));
        assert_eq!(amqp_text(&through_proxy), amqp_text(&from_rabbitmq));
    }
    // The exact texts, as RabbitMQ 3.10 words them.
    let err = refused(&format!("amqp://guest:wrong@{}/%2f", proxy.addr)).await;
    assert_eq!(
        (amqp_code(&err), amqp_text(&err).as_str()),
        (
            Some(403),
            "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. \
             For details see the broker logfile."
        )
    );
    let err = refused(&format!(
        "amqp://guest:guest@{}/{missing_vhost}",
        proxy.addr
    ))
    .await;
    assert_eq!(
        (amqp_code(&err), amqp_text(&err)),
        (
            Some(530),
            format!("NOT_ALLOWED - vhost {missing_vhost} not found")
        )
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_the_upstream_ends_without_a_close_ends_the_same_way() {
    let proxy = TestProxy::start(vec![]).await;
    // Without `authentication_failure_close` RabbitMQ only closes the socket on a failed
    // login, and it always does so for an unknown mechanism: no 320 from the proxy either.
    let cases: [(&str, &[u8]); 2] = [("PLAIN", b"\0guest\0wrong"), ("FOO", b"\0guest\0guest")];
    for (mechanism, response) in cases {
        for (name, addr) in [("direct", direct()), ("proxy", proxy.addr)] {
            let mut client = RawClient::connect_no_handshake(addr).await;
            client
                .start_ok(mechanism, response, FieldTable::default())
                .await;
            assert_closed_silently(&mut client, &format!("{mechanism} via {name}")).await;
        }
    }
    // With the capability, a raw client gets RabbitMQ's 403 through the proxy as well.
    let mut texts = Vec::new();
    for addr in [direct(), proxy.addr] {
        let mut client = RawClient::connect_no_handshake(addr).await;
        client
            .start_ok("PLAIN", b"\0guest\0wrong", with_failure_close())
            .await;
        texts.push(client.expect_connection_close().await);
        client.send_close_ok().await;
    }
    assert_eq!(texts[0].0, 403);
    assert_eq!(texts[1], texts[0]);
    proxy.stop().await;
}

/// Opens channel 1, then sends `frames` on it; returns the connection.close that follows.
async fn close_after(addr: SocketAddr, frames: &[u8]) -> (u16, String) {
    let mut client = RawClient::connect(addr).await;
    client.open_channel(1).await;
    client.send_raw(frames).await;
    let close = client.expect_connection_close().await;
    client.send_close_ok().await;
    close
}

fn publish(channel: u16) -> Vec<u8> {
    encode_method(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: unique("nowhere").as_str().into(),
            mandatory: false,
            immediate: false,
        })),
    )
}

fn content_header(channel: u16, body_size: u64) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&60u16.to_be_bytes());
    payload.extend_from_slice(&0u16.to_be_bytes());
    payload.extend_from_slice(&body_size.to_be_bytes());
    payload.extend_from_slice(&0u16.to_be_bytes());
    let mut frame = BytesMut::new();
    put_raw_frame(&mut frame, FRAME_HEADER, channel, &payload);
    frame.to_vec()
}

fn channel_close(channel: u16) -> Vec<u8> {
    encode_method(
        channel,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_out_of_order_get_rabbitmqs_replies_through_the_proxy() {
    let proxy = TestProxy::start(vec![]).await;
    let mut body = BytesMut::new();
    put_raw_frame(&mut body, FRAME_BODY, 1, b"abc");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // The proxy judges these two itself (it tracks each publish's content).
        (
            "a method where a content header is due",
            [publish(1), channel_close(1)].concat(),
        ),
        (
            "a method where a content body is due",
            [publish(1), content_header(1, 10), channel_close(1)].concat(),
        ),
        // These go upstream, which answers.
        (
            "a header where a body is due",
            [publish(1), content_header(1, 10), content_header(1, 10)].concat(),
        ),
        ("a body without a publish", body.to_vec()),
        (
            "a second channel.open",
            encode_method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            ),
        ),
    ];
    for (what, frames) in cases {
        let from_rabbitmq = close_after(direct(), &frames).await;
        let through_proxy = close_after(proxy.addr, &frames).await;
        assert!(
            matches!(from_rabbitmq.0, 504 | 505),
            "{what}: {from_rabbitmq:?}"
        );
        assert_eq!(through_proxy, from_rabbitmq, "{what}");
    }
    // An unknown method: RabbitMQ drops the connection without a word; the proxy, which must
    // read the ids, says 540.
    let unknown = [0, 60, 0, 99];
    let mut frame = BytesMut::new();
    put_raw_frame(&mut frame, FRAME_METHOD, 1, &unknown);
    assert_eq!(
        close_after(proxy.addr, &frame).await,
        (
            540,
            "NOT_IMPLEMENTED - unknown method class 60 method 99".to_string()
        )
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_over_channel_max_is_refused_as_rabbitmq_does() {
    let proxy = TestProxy::start_with(vec![], |config| config.limits.channel_max = 2).await;
    // limits.channel_max caps what the client is offered.
    let conn = proxy.connect().await;
    assert_eq!(conn.configuration().channel_max(), 2);
    conn.close(200, "bye".into()).await.unwrap();
    let mut closes = Vec::new();
    for addr in [direct(), proxy.addr] {
        let mut client = RawClient::connect_with_channel_max(addr, 2).await;
        client.open_channel(1).await;
        client.open_channel(2).await;
        client
            .send_method(
                3,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )
            .await;
        closes.push(client.expect_connection_close().await);
        client.send_close_ok().await;
    }
    assert_eq!(
        closes[0],
        (
            530,
            "NOT_ALLOWED - number of channels opened (2) has reached the negotiated \
             channel_max (2)"
                .to_string()
        )
    );
    assert_eq!(closes[1], closes[0]);
    // RabbitMQ limits the number of channels, not their numbers; the proxy needs the numbers
    // above channel_max for itself, so it refuses one there even while few are open.
    let mut client = RawClient::connect_with_channel_max(proxy.addr, 2).await;
    client
        .send_method(
            7,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
    assert_eq!(
        client.expect_connection_close().await,
        (
            530,
            "NOT_ALLOWED - channel number 7 is above the negotiated channel_max (2)".to_string()
        )
    );
    client.send_close_ok().await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_admits_n_refuses_one_more_and_frees_a_closed_slot() {
    let (amqp, admin) = free_addresses();
    let capture = unique("capture");
    let mut config = Config {
        mode: Mode::Proxy,
        ..Config::default()
    };
    config.listen.amqp = amqp.to_string();
    config.listen.admin = admin.to_string();
    config.upstream.url = format!("amqp://{}", upstream_host());
    config.upstream.user = "guest".into();
    config.upstream.password = "guest".into();
    config.proxy.capture_name = capture.clone();
    config.limits.max_connections = 2;
    let service = dlx_proxy::service::start(config)
        .await
        .expect("proxy starts");
    let uri = format!("amqp://guest:guest@{amqp}/%2f");
    let connect = async || Connection::connect(&uri, ConnectionProperties::default()).await;
    let first = connect().await.expect("first connection");
    let second = connect().await.expect("second connection");
    let err = connect().await.expect_err("a third is over the limit");
    assert_over_connection_limit(&err, admin, 2).await;
    let text = common::scrape(admin).await;
    assert_eq!(
        metric_value(
            &text,
            r#"dlx_proxy_connections_refused_total{reason="loopback_only"}"#
        ),
        Some(0.0)
    );
    // A closed connection frees its slot (once its task has ended).
    first.close(200, "bye".into()).await.unwrap();
    let third = poll(
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || connect().await.ok(),
    )
    .await
    .expect("the closed connection's slot is free again");
    wait_metric(admin, "dlx_proxy_connections", 2.0).await;
    third.close(200, "bye".into()).await.unwrap();
    second.close(200, "bye".into()).await.unwrap();
    service.shutdown().await;
    delete_capture(&capture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and iproute2 for a network namespace; .ci/run runs it with --ignored"]
async fn guest_is_refused_from_a_non_loopback_address_and_welcome_on_loopback() {
    // On loopback guest connects through the proxy, as to RabbitMQ.
    let local = TestProxy::start(vec![]).await;
    let conn = local.connect().await;
    conn.close(200, "bye".into()).await.unwrap();
    local.stop().await;

    let netns = NetNs::create();
    let listen = SocketAddr::from((netns.host_addr, 0));
    let proxy = TestProxy::start_listening(listen, vec![], |_| {}).await;
    // A client announcing authentication_failure_close gets RabbitMQ's 403.
    let mut client = RawClient::over(netns.connect(proxy.addr));
    client
        .start_ok("PLAIN", b"\0guest\0guest", with_failure_close())
        .await;
    assert_eq!(
        client.expect_connection_close().await,
        (
            403,
            "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. \
             For details see the broker logfile."
                .to_string()
        )
    );
    client.send_close_ok().await;
    assert!(client.read_frame().await.is_none());
    // Other clients see the socket close, as RabbitMQ gives them.
    let mut client = RawClient::over(netns.connect(proxy.addr));
    client
        .start_ok("PLAIN", b"\0guest\0guest", FieldTable::default())
        .await;
    assert_closed_silently(&mut client, "guest without the capability").await;
    assert_eq!(
        proxy.counter("connections_refused_total", &[("reason", "loopback_only")]),
        2.0
    );
    proxy.stop().await;

    // With proxy.loopback_users empty the rule is off: the same client gets in.
    let open =
        TestProxy::start_listening(listen, vec![], |config| config.proxy.loopback_users.clear())
            .await;
    let mut client = RawClient::connect_over(netns.connect(open.addr)).await;
    client.open_channel(1).await;
    assert_eq!(
        open.counter("connections_refused_total", &[("reason", "loopback_only")]),
        0.0
    );
    drop(client);
    open.stop().await;
}

/// The proxy's consumers gauge now.
fn consumers_gauge(proxy: &TestProxy) -> Option<f64> {
    metric_value(&proxy.metrics.encode(), "dlx_proxy_consumers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_over_max_consumers_per_channel_is_530_through_the_proxy() {
    let proxy = TestProxy::start_with(vec![], |config| {
        config.limits.max_consumers_per_channel = 8;
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let queue = unique("consumers");
    declare(&ch, &queue, FieldTable::default()).await;
    let mut consumers = Vec::new();
    for n in 0..8 {
        consumers.push(try_consumer(&ch, &queue, &format!("c{n}")).await.unwrap());
    }
    assert_eq!(consumers_gauge(&proxy), Some(8.0));
    // A consumer cancelled with nowait gets no cancel-ok, yet frees its place at once.
    ch.basic_cancel("c0".into(), BasicCancelOptions { nowait: true })
        .await
        .unwrap();
    wait_local_metric(&proxy.metrics, "dlx_proxy_consumers", 7.0).await;
    consumers.push(try_consumer(&ch, &queue, "c8").await.unwrap());
    // The upstream cancelling consumers (their queue deleted) ends them as well.
    let other = conn.create_channel().await.unwrap();
    let doomed = unique("consumers-doomed");
    declare(&other, &doomed, FieldTable::default()).await;
    let _doomed = try_consumer(&other, &doomed, "o0").await.unwrap();
    assert_eq!(consumers_gauge(&proxy), Some(9.0));
    other
        .queue_delete(doomed.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    wait_local_metric(&proxy.metrics, "dlx_proxy_consumers", 8.0).await;
    // At the limit, a tag in use is still RabbitMQ's to refuse, with its own words.
    let err = try_consumer(&ch, &queue, "c1").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "NOT_ALLOWED - attempt to reuse consumer tag 'c1'"
    );
    wait_local_metric(&proxy.metrics, "dlx_proxy_consumers", 0.0).await;
    drop(consumers);

    // A new consumer past the limit closes the connection, as RabbitMQ's
    // consumer_max_per_channel does.
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumers = Vec::new();
    for n in 0..8 {
        consumers.push(try_consumer(&ch, &queue, &format!("d{n}")).await.unwrap());
    }
    let err = try_consumer(&ch, &queue, "d8").await.unwrap_err();
    assert_eq!(amqp_code(&err), Some(530), "{err:?}");
    assert_eq!(
        amqp_text(&err),
        "NOT_ALLOWED - reached maximum (8) of consumers per channel"
    );
    wait_local_metric(&proxy.metrics, "dlx_proxy_consumers", 0.0).await;
    // The upstream let go of them too: the queue has no consumer left.
    let direct = Connection::connect(&upstream_uri(), ConnectionProperties::default())
        .await
        .unwrap();
    let check = direct.create_channel().await.unwrap();
    let left = poll(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || {
            let declared = crate::common::dl::passive_declare(&check, queue.as_str())
                .await
                .ok()?;
            (declared.consumer_count() == 0).then_some(())
        },
    )
    .await;
    assert!(
        left.is_some(),
        "the upstream still has consumers on {queue}"
    );
    check
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    drop(consumers);
}

/// A raw client past start-ok (guest), and the tune it was offered.
async fn logged_in_to_tune(addr: SocketAddr) -> (RawClient, lapin::protocol::connection::Tune) {
    use lapin::protocol::connection;
    let mut client = RawClient::connect_no_handshake(addr).await;
    client
        .start_ok("PLAIN", b"\0guest\0guest", FieldTable::default())
        .await;
    let AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) = client.read_method().await
    else {
        panic!("expected connection.tune");
    };
    (client, tune)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tune_ok_asking_for_larger_frames_than_offered_ends_the_connection() {
    use lapin::protocol::connection;
    let proxy = TestProxy::start(vec![]).await;
    for (name, addr) in [("direct", direct()), ("proxy", proxy.addr)] {
        let (mut client, tune) = logged_in_to_tune(addr).await;
        assert_eq!(tune.frame_max, 131072);
        let tune_ok = connection::TuneOk {
            channel_max: tune.channel_max,
            frame_max: u32::MAX,
            heartbeat: 0,
        };
        let mut bytes = common::encode_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
        );
        // A frame announcing nearly 4 GiB right behind it: the proxy must not take the
        // tune-ok's frame size for its reads.
        bytes.extend_from_slice(&[FRAME_METHOD, 0, 1, 0xFF, 0xFF, 0xFF, 0xF7]);
        bytes.extend_from_slice(&[0u8; 4096]);
        client.send_raw(&bytes).await;
        // RabbitMQ ends the connection without a close; so does the proxy.
        assert_closed_silently(&mut client, name).await;
    }
    proxy.stop().await;

    // limits.frame_max below RabbitMQ's: the client is offered the proxy's limit, asking
    // for RabbitMQ's size is refused, and a client that takes the offer works.
    let proxy = TestProxy::start_with(vec![], |config| config.limits.frame_max = 65536).await;
    let (mut client, tune) = logged_in_to_tune(proxy.addr).await;
    assert_eq!(tune.frame_max, 65536);
    let tune_ok = connection::TuneOk {
        channel_max: tune.channel_max,
        frame_max: 131072,
        heartbeat: 0,
    };
    client
        .send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
        )
        .await;
    assert_closed_silently(&mut client, "frame_max above the proxy's limit").await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("frame-limit");
    declare(&ch, &q, FieldTable::default()).await;
    let body = vec![7u8; 200_000];
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        Default::default(),
        &body,
        Default::default(),
    )
    .await
    .unwrap();
    let got = ch
        .basic_get(
            q.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the message");
    assert_eq!(got.delivery.data, body);
    proxy.stop().await;
}
