//! Proxy mode, the proxy's own service connection per vhost: the capture objects exist before a
//! client's declare can name them, captured messages are dead-lettered with no client
//! connected, the capture queue is a quorum queue, the service connection comes back after the
//! upstream closes it, and client connections cost two upstream channels only.

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions};
use lapin::protocol::basic::AMQPProperties;
use lapin::protocol::{AMQPClass, channel, queue};
use lapin::types::{AMQPValue, FieldTable};
use proxy_support::*;

use crate::common::dl::{amqp_code, amqp_text, try_declare};
use crate::common::encode_method;

/// Publishes one persistent message to `queue` and waits for its confirm.
async fn publish_confirmed(ch: &lapin::Channel, queue: &str, body: &str) {
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            AMQPProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "publish {body}: {confirm:?}");
}

/// How many messages `queue` holds after waiting up to `limit` for `expected` of them.
async fn count_within(ch: &lapin::Channel, queue: &str, expected: u32, limit: Duration) -> u32 {
    let until = tokio::time::Instant::now() + limit;
    loop {
        let now = message_count(ch, queue).await;
        if now >= expected || tokio::time::Instant::now() >= until {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Finding 5: a queue declared right after the proxy started, whose messages die at once,
/// used to lose them now and then: the capture exchange named as its dead-letter exchange was
/// declared on another channel at the same moment, and RabbitMQ silently drops a dead letter
/// whose dead-letter exchange does not exist yet. Each round starts a proxy with a capture
/// exchange of its own (so the capture objects are created in that round) and declares at
/// once; the declare is forwarded only after the capture objects exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_right_after_start_loses_no_dead_letter() {
    const ROUNDS: usize = 15;
    let mut lost = Vec::new();
    let upstream = upstream_connection().await;
    let admin = upstream.create_channel().await.unwrap();
    for round in 0..ROUNDS {
        let q = unique("f5");
        let dlx = unique("f5-dlx");
        let dlq = unique("f5-dlq");
        declare_dlx(&admin, &dlx, &dlq).await;
        let proxy = TestProxy::start(vec![]).await;
        let mut client = RawClient::connect(proxy.addr).await;
        // Declared (nowait) and dead at once (TTL 0, no consumer), pipelined right behind
        // connection.open-ok: as early as a client can.
        let mut frames = encode_method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
        frames.extend(encode_method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: q.as_str().into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: true,
                arguments: table(&[
                    ("x-dead-letter-exchange", ls(&dlx)),
                    ("x-dead-letter-routing-key", ls(&dlq)),
                    ("x-message-ttl", AMQPValue::LongInt(0)),
                ]),
            })),
        ));
        client.send_raw(&frames).await;
        client.publish(1, "", &q, b"m").await;
        let arrived = count_within(&admin, &dlq, 1, Duration::from_secs(5)).await;
        if arrived != 1 {
            lost.push(round);
        }
        drop(client);
        delete_upstream(&admin, &[&q, &dlq], &[&dlx]).await;
        proxy.stop().await;
    }
    assert!(
        lost.is_empty(),
        "dead letters lost in rounds {lost:?} of {ROUNDS}"
    );
}

/// The proxy's service connection of vhost "/" as RabbitMQ names it.
fn service_connection_name(proxy: &TestProxy) -> String {
    format!("dlx-proxy service {} /", proxy.capture)
}

/// The proxy's declare connection of vhost "/" as RabbitMQ names it.
fn declare_connection_name(proxy: &TestProxy) -> String {
    format!("dlx-proxy declares {} /", proxy.capture)
}

/// Waits until the proxy's capture consumer of "/" runs (the gauge says 1).
async fn wait_consuming(proxy: &TestProxy) {
    proxy
        .wait_counter("capture_consumers", &[("vhost", "/")], 1.0)
        .await;
}

/// Finding 7: expired and overflowing messages are dead-lettered while no client connection
/// is open anywhere: the proxy's own service connection consumes the capture queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_and_max_length_deaths_are_dead_lettered_with_no_client_connected() {
    let proxy = TestProxy::start(vec![]).await;
    let q_ttl = unique("nc-ttl");
    let q_len = unique("nc-len");
    let dlx = unique("nc-dlx");
    let dlq = unique("nc-dlq");
    {
        let conn = proxy.connect().await;
        let ch = conn.create_channel().await.unwrap();
        declare_dlx(&ch, &dlx, &dlq).await;
        let dead_letter = |extra: (&str, AMQPValue)| {
            table(&[
                ("x-dead-letter-exchange", ls(&dlx)),
                ("x-dead-letter-routing-key", ls(&dlq)),
                extra,
            ])
        };
        declare(
            &ch,
            &q_ttl,
            dead_letter(("x-message-ttl", AMQPValue::LongInt(300))),
        )
        .await;
        declare(
            &ch,
            &q_len,
            dead_letter(("x-max-length", AMQPValue::LongInt(1))),
        )
        .await;
        conn.close(200, "done".into()).await.unwrap();
    }
    wait_consuming(&proxy).await;
    let closed = crate::common::poll(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || (proxy.counter("connections", &[]) == 0.0).then_some(()),
    )
    .await;
    assert!(closed.is_some(), "no client connection is open");
    // Published straight to RabbitMQ: nobody is connected through the proxy.
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..3 {
        publish_confirmed(&ch, &q_ttl, &format!("ttl{i}")).await;
        publish_confirmed(&ch, &q_len, &format!("len{i}")).await;
    }
    wait_count(&ch, &dlq, 5).await;
    let mut reasons = Vec::new();
    for _ in 0..5 {
        let dead = get(&ch, &dlq).await;
        let deaths = x_death(&dead);
        assert_eq!(deaths.len(), 1, "{deaths:?}");
        let queue = field(&deaths[0], "queue").clone();
        let reason = field(&deaths[0], "reason").clone();
        reasons.push((payload(&dead), queue, reason));
        dead.ack(lapin::options::BasicAckOptions::default())
            .await
            .unwrap();
    }
    reasons.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        reasons,
        vec![
            ("len0".to_string(), ls(&q_len), ls("maxlen")),
            ("len1".to_string(), ls(&q_len), ls("maxlen")),
            ("ttl0".to_string(), ls(&q_ttl), ls("expired")),
            ("ttl1".to_string(), ls(&q_ttl), ls("expired")),
            ("ttl2".to_string(), ls(&q_ttl), ls("expired")),
        ]
    );
    proxy
        .wait_counter(
            "captured_total",
            &[("outcome", "dead_lettered"), ("vhost", "/")],
            5.0,
        )
        .await;
    delete_upstream(&ch, &[&q_ttl, &q_len, &dlq], &[&dlx]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

/// The capture queue is a quorum queue (replicated; finding 1), created by the proxy's own
/// connection before any client connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capture_queue_is_a_quorum_queue() {
    let proxy = TestProxy::start(vec![]).await;
    wait_consuming(&proxy).await;
    let listing = rabbitmqctl(&["list_queues", "-q", "--no-table-headers", "name", "type"]);
    let text = String::from_utf8_lossy(&listing.stdout);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(proxy.capture.as_str()))
        .unwrap_or_else(|| panic!("capture queue not listed:\n{text}"));
    assert_eq!(line.split_whitespace().nth(1), Some("quorum"), "{line}");
    proxy.stop().await;
}

/// The declare connection (the service user's connection that makes the declares carrying
/// the proxy's arguments) is closed by an operator: it comes back, counted, and the next
/// client declare is checked on it as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_declare_connection_comes_back_after_close_connection() {
    let proxy = TestProxy::start(vec![]).await;
    wait_consuming(&proxy).await;
    let name = declare_connection_name(&proxy);
    let closed = crate::common::poll(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || (close_upstream_connection(&name, "test closes it") == 1).then_some(()),
    )
    .await;
    assert!(closed.is_some(), "no upstream connection named {name}");
    proxy
        .wait_counter("service_reconnects_total", &[("vhost", "/")], 1.0)
        .await;
    proxy
        .wait_gauge("declare_connections", &[("vhost", "/")], 1.0)
        .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("after-declare-close");
    let dlx = unique("after-declare-close-dlx");
    let dlq = unique("after-declare-close-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_dead_lettering(&ch, &q, &dlx, &dlq).await;
    // Declared through the check: a rejection of it is the proxy's and lands in the DLQ.
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_confirmed(&ch, &q, "rejected").await;
    let got = get(&ch, &q).await;
    ch.basic_reject(got.delivery_tag, BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "rejected");
    assert_eq!(
        crate::common::dl::x_death(&dead)[0].qrc(),
        (q.as_str(), "rejected", 1)
    );
    assert_eq!(proxy.counter("service_declares_refused_total", &[]), 0.0);
    delete_upstream(&ch, &[&q, &dlq], &[&dlx]).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// An operator (or a node going down) closes the service connection: it comes back, counted,
/// subscribes again, and what dies afterwards is still dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_connection_comes_back_after_close_connection() {
    let proxy = TestProxy::start(vec![]).await;
    wait_consuming(&proxy).await;
    assert_eq!(
        proxy.counter("service_reconnects_total", &[("vhost", "/")]),
        0.0
    );
    let name = service_connection_name(&proxy);
    assert_eq!(close_upstream_connection(&name, "test closes it"), 1);
    proxy
        .wait_counter("service_reconnects_total", &[("vhost", "/")], 1.0)
        .await;
    wait_consuming(&proxy).await;
    // Subscribed again: a death now is dead-lettered.
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("after-close");
    let dlx = unique("after-close-dlx");
    let dlq = unique("after-close-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
            ("x-message-ttl", AMQPValue::LongInt(0)),
        ]),
    )
    .await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_confirmed(&ch, &q, "late").await;
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "late");
    assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("expired"));
    delete_upstream(&ch, &[&q, &dlq], &[&dlx]).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// Finding 9: a client connection costs one upstream channel besides its own (the dead-letter
/// publisher); the declare-check channel is open only while a check runs, and there is no
/// capture consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connection_uses_one_extra_upstream_channel() {
    let proxy = TestProxy::start(vec![]).await;
    let name = unique("two-channels");
    let mut client = RawClient::connect_named(proxy.addr, &name).await;
    client.open_channel(1).await;
    let channels = || {
        let listing = rabbitmqctl(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "channels",
            "client_properties",
        ]);
        String::from_utf8_lossy(&listing.stdout)
            .lines()
            .find(|l| l.contains(&name))
            .and_then(|l| l.split_whitespace().next()?.parse::<u32>().ok())
    };
    // The proxy's channels open right after connection.open-ok; give RabbitMQ's statistics
    // (emitted every few seconds) time to show them.
    let settled = crate::common::poll(
        Duration::from_secs(15),
        Duration::from_millis(250),
        async || (channels() == Some(2)).then_some(()),
    )
    .await;
    assert!(settled.is_some(), "upstream channels: {:?}", channels());
    drop(client);
    proxy.stop().await;
}

/// `/readyz` waits for the capture consumer and the declare connection of every vhost in
/// `proxy.vhosts`: a vhost the service user cannot open yet keeps the proxy not ready (both
/// connections retry with backoff, counted), and it becomes ready once the vhost exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_capture_consumers_of_configured_vhosts() {
    use dlx_proxy::config::{Config, Mode};
    let vhost = unique("ready-vhost");
    let capture = unique("ready-capture");
    let (amqp, admin) = crate::common::free_addresses();
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
    config.proxy.vhosts = vec!["/".into(), vhost.clone()];
    let service = dlx_proxy::service::start(config)
        .await
        .expect("proxy starts");
    let retried = format!("dlx_proxy_service_reconnects_total{{vhost=\"{vhost}\"}}");
    crate::common::wait_metric_at_least(admin, &retried, 2.0).await;
    assert_eq!(
        crate::common::http(admin, "GET", "/readyz").await.0,
        503,
        "not ready while {vhost} has no capture consumer"
    );
    let consuming = |v: &str| format!("dlx_proxy_capture_consumers{{vhost=\"{v}\"}}");
    let declaring = |v: &str| format!("dlx_proxy_declare_connections{{vhost=\"{v}\"}}");
    crate::common::wait_metric(admin, &consuming("/"), 1.0).await;
    crate::common::wait_metric(admin, &declaring("/"), 1.0).await;
    let text = crate::common::scrape(admin).await;
    assert_eq!(
        crate::common::metric_value(&text, &consuming(&vhost)),
        Some(0.0)
    );
    assert_eq!(
        crate::common::metric_value(&text, &declaring(&vhost)),
        Some(0.0)
    );
    let ctl = |args: &[&str]| {
        let out = rabbitmqctl(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    ctl(&["add_vhost", &vhost]);
    ctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    // The next attempt comes within the backoff cap (5 s).
    crate::common::wait_until(
        "the new vhost's capture consumer",
        Duration::from_secs(15),
        async || {
            let text = crate::common::scrape(admin).await;
            crate::common::metric_value(&text, &consuming(&vhost)) == Some(1.0)
                && crate::common::metric_value(&text, &declaring(&vhost)) == Some(1.0)
        },
    )
    .await;
    crate::common::wait_until("/readyz 200", Duration::from_secs(10), async || {
        crate::common::http(admin, "GET", "/readyz").await.0 == 200
    })
    .await;
    service.shutdown().await;
    ctl(&["delete_vhost", &vhost]);
    delete_capture(&capture).await;
}

/// A service user that cannot open the vhost never gets the capture objects declared: a
/// client's declare (every queue declared through the proxy dead-letters into the capture
/// exchange upstream) waits `proxy.capture_ready_timeout_secs`, then the client connection is
/// closed with 320; no queue is created whose dead letters would be dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_is_refused_with_320_while_capture_cannot_get_ready() {
    let user = unique("no-perm-service");
    let created = rabbitmqctl(&["add_user", &user, "pw"]);
    assert!(created.status.success(), "add_user: {created:?}");
    let service_user = user.clone();
    let proxy = TestProxy::start_with(vec![], move |config| {
        config.upstream.user = service_user;
        config.upstream.password = "pw".into();
        config.proxy.capture_ready_timeout_secs = 1;
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("held");
    let started = std::time::Instant::now();
    let err = try_declare(
        &ch,
        &q,
        table(&[("x-dead-letter-exchange", ls("some-dlx"))]),
    )
    .await
    .expect_err("refused");
    let waited = started.elapsed();
    assert_eq!(amqp_code(&err), Some(320), "{err:?}");
    let text = amqp_text(&err);
    assert!(
        text.starts_with("CONNECTION_FORCED - dead-letter capture for vhost '/' is unavailable"),
        "{text}"
    );
    assert!(waited >= Duration::from_secs(1), "{waited:?}");
    assert!(
        proxy.counter("service_reconnects_total", &[("vhost", "/")]) >= 1.0,
        "the service connection keeps trying"
    );
    // The held queue was never declared upstream.
    let upstream = upstream_connection().await;
    let admin = upstream.create_channel().await.unwrap();
    let probe = admin
        .queue_declare(
            q.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(probe.is_err(), "{q} must not exist upstream");
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
    let _ = rabbitmqctl(&["delete_user", &user]);
}

/// A captured message keeps its `user_id`: the service user republishes it as a dead letter,
/// which RabbitMQ allows for another user's id only with the `impersonator` tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_user_id_is_kept_by_an_impersonating_service_user() {
    let user = unique("impersonator-service");
    let ctl = |args: &[&str]| {
        let out = rabbitmqctl(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    ctl(&["add_user", &user, "pw"]);
    ctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    ctl(&["set_user_tags", &user, "impersonator"]);
    let service_user = user.clone();
    let proxy = TestProxy::start_with(vec![], move |config| {
        config.upstream.user = service_user;
        config.upstream.password = "pw".into();
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("uid");
    let dlx = unique("uid-dlx");
    let dlq = unique("uid-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
            ("x-message-ttl", AMQPValue::LongInt(0)),
        ]),
    )
    .await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // The client (guest) stamps its own user id; RabbitMQ checks it against guest.
    let confirm = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"stamped",
            AMQPProperties::default().with_user_id("guest".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "stamped");
    assert_eq!(
        dead.properties.user_id().as_ref().map(|u| u.as_str()),
        Some("guest")
    );
    assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("expired"));
    delete_upstream(&ch, &[&q, &dlq], &[&dlx]).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
    let _ = rabbitmqctl(&["delete_user", &user]);
}

/// A quorum queue declared with at-least-once dead-lettering keeps that strategy upstream
/// (RabbitMQ then dead-letters into the capture exchange with confirms and retries), and its
/// expired messages reach the client's dead-letter queue through the capture path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_quorum_queues_keep_their_strategy_upstream() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("alo");
    let dlx = unique("alo-dlx");
    let dlq = unique("alo-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    crate::common::dl::declare_durable(
        &ch,
        &q,
        table(&[
            ("x-queue-type", ls("quorum")),
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
            ("x-dead-letter-strategy", ls("at-least-once")),
            ("x-overflow", ls("reject-publish")),
            ("x-message-ttl", AMQPValue::LongInt(50)),
        ]),
    )
    .await;
    let listing = rabbitmqctl(&[
        "list_queues",
        "-q",
        "--no-table-headers",
        "name",
        "arguments",
    ]);
    let text = String::from_utf8_lossy(&listing.stdout);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(q.as_str()))
        .unwrap_or_else(|| panic!("{q} not listed:\n{text}"));
    assert!(line.contains("at-least-once"), "{line}");
    assert!(line.contains(&proxy.capture), "{line}");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..3 {
        publish_confirmed(&ch, &q, &format!("alo{i}")).await;
    }
    wait_count(&ch, &dlq, 3).await;
    let dead = get(&ch, &dlq).await;
    let deaths = x_death(&dead);
    assert_eq!(field(&deaths[0], "reason"), &ls("expired"));
    assert_eq!(field(&deaths[0], "queue"), &ls(&q));
    // Everything expired out of the source queue and was dead-lettered.
    wait_count(&ch, &q, 0).await;
    delete_upstream(&ch, &[&q, &dlq], &[&dlx]).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
}
