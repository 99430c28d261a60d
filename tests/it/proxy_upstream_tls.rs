//! Proxy mode with an amqps upstream: the TLS listener of the RabbitMQ node the tests start
//! (its certificate for localhost is signed by a CA made at test time).
//!
//! Through a proxy that trusts that CA, a client publishes with confirms, consumes, and rejects
//! a message that the proxy dead-letters itself, over the same TLS connection, with RabbitMQ's
//! x-death. A proxy that cannot verify the upstream (another CA, another server name) refuses
//! every client with connection.close 320 naming the certificate problem, and keeps serving;
//! one without any CA file is not accepted as a configuration. Replacing a wrong CA file with
//! the right one lets the next client through without a restart.

use crate::common;
use crate::proxy_support;

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use common::{TempDir, poll, wait_metric_at_least};
use dlx_proxy::amqp::codec::PROTOCOL_HEADER;
use dlx_proxy::config::{Config, Mode};
use dlx_proxy::metrics::Metrics;
use dlx_proxy::policy::PolicySet;
use dlx_proxy::proxy::ProxyShared;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::protocol::{AMQPClass, connection};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};
use proxy_support::*;

/// The amqps upstream URL, by host name (the certificate names `localhost`).
fn tls_url() -> String {
    format!("amqps://localhost:{}", upstream_tls_port())
}

/// A proxy in front of the amqps listener that trusts `ca_file`.
async fn tls_proxy(ca_file: &Path, server_name: &str) -> TestProxy {
    let ca_file = ca_file.display().to_string();
    let server_name = server_name.to_string();
    TestProxy::start_with(vec![], move |config| {
        config.upstream.url = tls_url();
        config.upstream.tls_ca_file = ca_file;
        config.upstream.tls_server_name = server_name;
    })
    .await
}

/// The `ssl` column of RabbitMQ's connection listing for the connection(s) whose client
/// named itself `connection_name`.
fn upstream_ssl_flags(connection_name: &str) -> Vec<String> {
    let listing = rabbitmqctl(&["list_connections", "-q", "ssl", "client_properties"]);
    assert!(listing.status.success(), "list_connections: {listing:?}");
    String::from_utf8_lossy(&listing.stdout)
        .lines()
        .filter(|line| line.contains(connection_name))
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_consume_and_dead_letter_over_an_amqps_upstream() {
    let ca = upstream_tls_ca();
    let proxy = tls_proxy(&ca, "").await;
    let name = unique("tls-client");
    let conn = Connection::connect(
        &proxy.uri(),
        ConnectionProperties::default().with_connection_name(LongString::from(name.as_str())),
    )
    .await
    .expect("connect through the proxy to the amqps upstream");
    // The proxy's upstream connection is the TLS one (RabbitMQ sees the client's name on it).
    assert_eq!(upstream_ssl_flags(&name), vec!["true".to_string()]);

    let ch = conn.create_channel().await.unwrap();
    let q = unique("tls-q");
    let dlx = unique("tls-dlx");
    let dlq = unique("tls-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_dead_lettering(&ch, &q, &dlx, &dlq).await;

    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_acked(&ch, &q, 5).await;
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    wait_count(&uch, &q, 5).await;

    let mut deliveries = consume(&ch, &q, BasicConsumeOptions::default()).await;
    for i in 0..5 {
        let d = next(&mut deliveries).await;
        assert_eq!(payload(&d), format!("m{i}"));
        assert!(!d.redelivered);
        if i == 3 {
            d.acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
        } else {
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
    }

    // The proxy published the dead letter (confirmed upstream, over TLS) with RabbitMQ's
    // headers, then settled the original.
    let dead = get(&ch, &dlq).await;
    assert_eq!(payload(&dead), "m3");
    assert_eq!(dead.exchange.as_str(), dlx);
    assert_eq!(dead.routing_key.as_str(), dlq);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    let entry = &deaths[0];
    assert_eq!(field(entry, "reason"), &ls("rejected"));
    assert_eq!(field(entry, "queue"), &ls(&q));
    assert_eq!(field(entry, "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(field(entry, "exchange"), &ls(""));
    assert_eq!(
        field(entry, "routing-keys"),
        &AMQPValue::FieldArray(FieldArray::from(vec![ls(&q)]))
    );
    assert_eq!(header(&dead, "x-first-death-reason"), Some(&ls("rejected")));
    dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &q), ("reason", "rejected"), ("vhost", "/")],
            1.0,
        )
        .await;
    assert_eq!(
        proxy.counter_all_labels("dead_letter_publish_failures_total"),
        0.0
    );
    wait_count(&uch, &q, 0).await;
    wait_count(&uch, &dlq, 0).await;

    conn.close(200, "done".into()).await.unwrap();
    delete_upstream(&uch, &[&q, &dlq], &[&dlx]).await;
    upstream.close(200, "done".into()).await.unwrap();
    proxy.stop().await;
}

/// Plays a client's handshake by hand against a proxy whose upstream cannot be verified:
/// returns the product the server announced and the connection.close that follows start-ok,
/// then answers close-ok and checks that the proxy ends the connection.
async fn refused_handshake(proxy: &TestProxy) -> (String, u16, String) {
    let mut client = RawClient::connect_no_handshake(proxy.addr).await;
    client.send_raw(&PROTOCOL_HEADER).await;
    let AMQPClass::Connection(connection::AMQPMethod::Start(start)) = client.read_method().await
    else {
        panic!("expected connection.start");
    };
    let product = match start.server_properties.inner().get("product") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("product: {other:?}"),
    };
    let start_ok = AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
        client_properties: FieldTable::default(),
        mechanism: "PLAIN".into(),
        response: LongString::from("\0guest\0guest"),
        locale: "en_US".into(),
    }));
    client.send_method(0, start_ok).await;
    let AMQPClass::Connection(connection::AMQPMethod::Close(close)) = client.read_method().await
    else {
        panic!("expected connection.close after start-ok");
    };
    client.send_close_ok().await;
    // The proxy ends the connection after close-ok, with nothing after connection.close.
    client.expect_end().await;
    (
        product,
        close.reply_code,
        close.reply_text.as_str().to_string(),
    )
}

/// What a client sees from a proxy that cannot verify its upstream, by hand and with lapin;
/// asserted twice to show the proxy keeps serving.
async fn assert_refused(proxy: &TestProxy, certificate_problem: &str) {
    for _ in 0..2 {
        let (product, code, text) = refused_handshake(proxy).await;
        // The proxy answers on its own: no upstream connection was made.
        assert_eq!(product, "dlx-proxy");
        assert_eq!(code, 320, "{text}");
        let expected = format!(
            "CONNECTION_FORCED - upstream localhost:{} unreachable: invalid peer certificate: {certificate_problem}",
            upstream_tls_port()
        );
        assert!(
            text.starts_with(&expected),
            "reply text {text:?} should start with {expected:?}"
        );

        let err = Connection::connect(&proxy.uri(), ConnectionProperties::default())
            .await
            .expect_err("lapin cannot connect through a proxy that refuses its upstream");
        let shown = err.to_string();
        assert!(
            shown.contains("CONNECTION_FORCED") && shown.contains("invalid peer certificate"),
            "lapin error: {shown}"
        );
    }
    // Every refused connection ends (the gauge counts a connection until its task is done).
    let ended = poll(
        Duration::from_secs(15),
        Duration::from_millis(50),
        async || (proxy.counter("connections", &[]) == 0.0).then_some(()),
    )
    .await;
    assert!(
        ended.is_some(),
        "refused connections never ended:\n{}",
        proxy.metrics.encode()
    );
}

/// A scratch directory with `ca.pem`, a CA that signed nothing RabbitMQ presents.
fn unrelated_ca_file() -> (TempDir, std::path::PathBuf) {
    let dir = TempDir::new("tls-other-ca");
    let file = dir.join("ca.pem");
    std::fs::write(&file, unrelated_ca()).unwrap();
    (dir, file)
}

/// A PEM CA that signed nothing RabbitMQ presents.
fn unrelated_ca() -> String {
    crate::common::pki::TestCa::new("an unrelated CA").pem
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_signed_by_another_ca_is_refused() {
    let (_dir, other_ca) = unrelated_ca_file();
    let proxy = tls_proxy(&other_ca, "").await;
    assert_refused(&proxy, "UnknownIssuer").await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_certificate_for_another_name_is_refused() {
    let ca = upstream_tls_ca();
    let proxy = tls_proxy(&ca, "rabbit.example").await;
    assert_refused(&proxy, "certificate not valid for name \"rabbit.example\"").await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amqps_upstream_without_a_ca_file_is_not_a_valid_configuration() {
    let mut config = Config {
        mode: Mode::Proxy,
        ..Config::default()
    };
    config.upstream.url = tls_url();
    let err = config.validate().unwrap_err().to_string();
    assert!(
        err.contains("upstream.tls_ca_file") && err.contains("needs a CA file"),
        "{err}"
    );
    let err = ProxyShared::new(
        &config,
        Arc::new(RwLock::new(PolicySet::from_configs(&[]).unwrap())),
        Metrics::new(10),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("upstream.tls_ca_file is required"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_upstream_ca_file_applies_to_the_next_connection() {
    let ca = upstream_tls_ca();
    let (_dir, ca_file) = unrelated_ca_file();
    let capture = unique("capture");
    let mut config = Config {
        mode: Mode::Proxy,
        ..Config::default()
    };
    config.listen.amqp = "127.0.0.1:0".into();
    config.listen.admin = "127.0.0.1:0".into();
    config.upstream.url = tls_url();
    config.upstream.tls_ca_file = ca_file.display().to_string();
    config.upstream.user = "guest".into();
    config.upstream.password = "guest".into();
    config.proxy.capture_name = capture.clone();
    let service = dlx_proxy::service::start(config)
        .await
        .expect("the proxy starts");
    let uri = format!("amqp://guest:guest@{}/%2f", service.amqp_addr.unwrap());
    let admin = service.admin_addr.unwrap();

    let err = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .expect_err("the upstream is not trusted yet");
    let shown = err.to_string();
    assert!(
        shown.contains("CONNECTION_FORCED") && shown.contains("UnknownIssuer"),
        "lapin error: {shown}"
    );

    // The CA file is replaced (a Secret update, an operator's copy): the next client gets
    // through, over a verified TLS upstream connection.
    std::fs::copy(&ca, &ca_file).unwrap();
    let name = unique("rotated-ca-client");
    let properties =
        || ConnectionProperties::default().with_connection_name(LongString::from(name.as_str()));
    let conn = poll(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || Connection::connect(&uri, properties()).await.ok(),
    )
    .await
    .expect("a client gets through once the CA file is right");
    wait_metric_at_least(
        admin,
        r#"dlx_proxy_tls_reloads_total{result="success"}"#,
        1.0,
    )
    .await;
    assert_eq!(upstream_ssl_flags(&name), vec!["true".to_string()]);
    let ch = conn.create_channel().await.unwrap();
    let q = unique("rotated-ca-q");
    ch.queue_declare(
        q.as_str().into(),
        lapin::options::QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    conn.close(200, "done".into()).await.unwrap();
    service.shutdown().await;
    delete_capture(&capture).await;
}
