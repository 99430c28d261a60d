//! Graceful shutdown of the real binary on a real signal: SIGTERM or SIGINT stops accepting,
//! reports not ready, lets unacknowledged deliveries be settled for up to
//! `shutdown.drain_secs`, then closes every client with 320 CONNECTION_FORCED, releases its
//! ports and exits 0. In both modes: proxied client connections are closed and waited for
//! like the embedded broker's.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, basic};
use common::{
    RawClient, ServiceProcess, TempDir, free_addresses, http, process_config, unique,
    write_atomically,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// The binary on fresh ports with `drain_secs`, ready to serve.
async fn spawn_ready(dir: &TempDir, drain_secs: u64) -> ServiceProcess {
    let (amqp, admin) = free_addresses();
    let config = dir.join("config.toml");
    write_atomically(&config, &process_config(amqp, admin, drain_secs));
    ServiceProcess::start(BINARY, dir.path(), &config, amqp, admin).await
}

/// True if nothing accepts TCP connections on `addr` any more.
async fn refuses_connections(addr: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await,
        Ok(Err(_))
    )
}

/// Both ports can be bound again: the process released them.
fn ports_are_released(process: &ServiceProcess) {
    for addr in [process.amqp, process.admin] {
        std::net::TcpListener::bind(addr)
            .unwrap_or_else(|e| panic!("{addr} still taken after exit: {e}"));
    }
}

/// Declares `queue` and publishes `count` confirmed messages to it, then disconnects.
async fn publish(uri: &str, queue: &str, count: usize) {
    let conn = Connection::connect(uri, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..count {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    ch.close(200, "done".into()).await.unwrap();
    conn.close(200, "done".into()).await.unwrap();
}

/// Opens channel 1 on a raw client and takes one message with basic.get (no_ack = false);
/// returns its delivery tag.
async fn raw_get(client: &mut RawClient, queue: &str) -> u64 {
    client.open_channel(1).await;
    client
        .send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.into(),
                no_ack: false,
            })),
        )
        .await;
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(get_ok)) = client.read_method().await else {
        panic!("expected basic.get-ok");
    };
    let header = client.read_frame().await.expect("content header");
    assert_eq!(header.kind, 2);
    let body = client.read_frame().await.expect("content body");
    assert_eq!(body.kind, 3);
    get_ok.delivery_tag
}

#[tokio::test]
async fn sigterm_closes_clients_with_320_and_exits_0() {
    let dir = TempDir::new("dlx-proxy-term");
    let mut process = spawn_ready(&dir, 5).await;
    let mut client = RawClient::connect(process.amqp).await;
    let started = Instant::now();
    process.signal("TERM");

    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 320, "reply text: {text}");
    assert!(text.starts_with("CONNECTION_FORCED"), "{text}");
    // With nothing in flight the drain does not wait.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed after {:?}",
        started.elapsed()
    );
    // Accepting stopped before clients were closed.
    assert!(
        refuses_connections(process.amqp).await,
        "new AMQP connections are still accepted during shutdown"
    );
    client.send_close_ok().await;

    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit after SIGTERM:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    ports_are_released(&process);
    assert!(
        client.read_frame().await.is_none(),
        "the socket is closed after close-ok"
    );
}

#[tokio::test]
async fn sigint_shuts_down_like_sigterm() {
    let dir = TempDir::new("dlx-proxy-int");
    let mut process = spawn_ready(&dir, 5).await;
    let conn = Connection::connect(
        &format!("amqp://guest:guest@{}/%2f", process.amqp),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    assert!(conn.status().connected());
    process.signal("INT");
    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit after SIGINT:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    ports_are_released(&process);
    // lapin saw the server close the connection.
    assert!(
        common::eventually(|| !conn.status().connected()).await,
        "lapin still thinks it is connected"
    );
}

#[tokio::test]
async fn the_drain_lets_unacked_deliveries_be_settled_first() {
    let dir = TempDir::new("dlx-proxy-drain");
    let mut process = spawn_ready(&dir, 20).await;
    let queue = unique("drain");
    publish(
        &format!("amqp://guest:guest@{}/%2f", process.amqp),
        &queue,
        1,
    )
    .await;

    let mut consumer = RawClient::connect(process.amqp).await;
    let tag = raw_get(&mut consumer, &queue).await;
    let started = Instant::now();
    process.signal("TERM");

    // Draining: not ready, not accepting, but the open connection still works.
    let mut not_ready = false;
    for _ in 0..100 {
        if http(process.admin, "GET", "/readyz").await.0 == 503 {
            not_ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(not_ready, "/readyz did not turn 503 during the drain");
    assert_eq!(http(process.admin, "GET", "/healthz").await.0, 200);
    assert!(
        refuses_connections(process.amqp).await,
        "new AMQP connections are still accepted during the drain"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        process.child.try_wait().unwrap(),
        None,
        "exited while a delivery was unacknowledged:\n{}",
        process.logs()
    );

    // Settling the last delivery ends the drain at once.
    consumer
        .send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: tag,
                multiple: false,
            })),
        )
        .await;
    let (code, _) = consumer.expect_connection_close().await;
    assert_eq!(code, 320);
    consumer.send_close_ok().await;
    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit after the drain:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the drain ran to its limit ({:?}) although nothing was in flight",
        started.elapsed()
    );
    ports_are_released(&process);
}

#[tokio::test]
async fn the_drain_ends_at_drain_secs_when_deliveries_stay_unacked() {
    let dir = TempDir::new("dlx-proxy-drain-limit");
    let drain = 2;
    let mut process = spawn_ready(&dir, drain).await;
    let queue = unique("stuck");
    publish(
        &format!("amqp://guest:guest@{}/%2f", process.amqp),
        &queue,
        1,
    )
    .await;
    let mut consumer = RawClient::connect(process.amqp).await;
    raw_get(&mut consumer, &queue).await;

    let started = Instant::now();
    process.signal("TERM");
    let (code, _) = consumer.expect_connection_close().await;
    let closed_after = started.elapsed();
    assert_eq!(code, 320);
    assert!(
        closed_after >= Duration::from_millis(drain * 1000 - 300),
        "closed after {closed_after:?}, before the drain time"
    );
    consumer.send_close_ok().await;
    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit after the drain:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    assert!(
        started.elapsed() < Duration::from_secs(drain + 6),
        "took {:?}",
        started.elapsed()
    );
    ports_are_released(&process);
}

#[tokio::test]
async fn in_process_shutdown_closes_clients_and_stops_the_admin_server() {
    let mut config = common::test_config();
    config.listen.admin = "127.0.0.1:0".into();
    config.shutdown.drain_secs = 1;
    let broker = common::start_with(config).await;
    let admin = broker.service.admin_addr.unwrap();
    let amqp = broker.addr;
    assert_eq!(http(admin, "GET", "/readyz").await, (200, "ready".into()));
    let mut client = RawClient::connect(amqp).await;
    let readiness = broker.service.readiness.clone();
    let shutdown = tokio::spawn(broker.service.shutdown());
    let (code, _) = client.expect_connection_close().await;
    assert_eq!(code, 320);
    assert!(!readiness.is_ready());
    client.send_close_ok().await;
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown finishes")
        .unwrap();
    assert!(refuses_connections(amqp).await);
    assert!(refuses_connections(admin).await);
}

#[tokio::test]
async fn a_second_signal_cuts_the_drain_short() {
    let dir = TempDir::new("dlx-proxy-second-signal");
    let mut process = spawn_ready(&dir, 30).await;
    let queue = unique("impatient");
    publish(
        &format!("amqp://guest:guest@{}/%2f", process.amqp),
        &queue,
        1,
    )
    .await;
    let mut consumer = RawClient::connect(process.amqp).await;
    raw_get(&mut consumer, &queue).await;
    process.signal("TERM");
    // Wait until the drain is under way (readiness off), then ask again.
    for _ in 0..100 {
        if http(process.admin, "GET", "/readyz").await.0 == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(process.child.try_wait().unwrap(), None);
    let started = Instant::now();
    process.signal("INT");
    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit after the second signal:\n{}", process.logs()));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    assert!(
        process.logs().contains("second signal during shutdown"),
        "{}",
        process.logs()
    );
    ports_are_released(&process);
}

#[tokio::test]
async fn proxy_mode_sigterm_closes_proxied_clients_with_320_within_the_drain_time() {
    use crate::proxy_support::fleet::{ProxyProcess, fleet_toml};
    let drain = 5;
    let config = fleet_toml(
        &[crate::rabbit::reference().uri()],
        &[],
        &unique("term-capture"),
        &format!("[shutdown]\ndrain_secs = {drain}\n"),
    );
    let mut proxy = ProxyProcess::spawn(&config).await;
    // A client through the proxy, with a channel open upstream.
    let mut client = RawClient::connect(proxy.amqp).await;
    client.open_channel(1).await;
    let started = Instant::now();
    proxy.signal("TERM");

    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 320, "reply text: {text}\n{}", proxy.logs());
    assert!(text.starts_with("CONNECTION_FORCED"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "nothing was in flight, yet the client was closed after {:?}",
        started.elapsed()
    );
    assert!(
        refuses_connections(proxy.amqp).await,
        "the proxy still accepts connections during shutdown"
    );
    client.send_close_ok().await;
    let status = proxy
        .wait_exit(Duration::from_secs(drain))
        .await
        .unwrap_or_else(|| panic!("no exit within drain_secs:\n{}", proxy.logs()));
    assert_eq!(status.code(), Some(0), "{}", proxy.logs());
    assert!(
        client.read_frame().await.is_none(),
        "the socket is closed after close-ok"
    );
    for addr in [proxy.amqp, proxy.admin] {
        std::net::TcpListener::bind(addr)
            .unwrap_or_else(|e| panic!("{addr} still taken after exit: {e}"));
    }
}

/// A rolling update: the proxy gets SIGTERM while a consumer (a connection that never
/// published) holds a delivery of a classic queue with a delivery limit. The drain ends with
/// it unsettled, and closing the client connection returns it counted (`x-delivery-count`
/// 1): the return is published by the vhost's service connection, which stops only after
/// the client connections. It is in its queue once, counted, after the proxy exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_sigterm_counts_a_consumers_unsettled_delivery_against_the_limit() {
    use crate::common::dl::{consumer, next, publish};
    use crate::proxy_support::fleet::{ProxyProcess, fleet_toml};
    use crate::proxy_support::{declare, get, header, payload, table};
    use lapin::types::AMQPValue;
    let reference = crate::rabbit::reference().uri();
    let config = fleet_toml(
        std::slice::from_ref(&reference),
        &[],
        &unique("term-count"),
        "[shutdown]\ndrain_secs = 1\n",
    );
    let mut proxy = ProxyProcess::spawn(&config).await;
    let q = unique("term-limited");
    let publisher = proxy.connect().await;
    let pch = publisher.create_channel().await.unwrap();
    declare(
        &pch,
        &q,
        table(&[("x-delivery-limit", AMQPValue::LongInt(5))]),
    )
    .await;
    publish(&pch, &q, &["held"]).await;
    let _ = publisher.close(200, "published".into()).await;

    let holder = proxy.connect().await;
    let hch = holder.create_channel().await.unwrap();
    let mut deliveries = consumer(&hch, &q, "term-holder").await;
    assert_eq!(payload(&next(&mut deliveries).await), "held");
    proxy.signal("TERM");
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit:\n{}", proxy.logs()));
    assert_eq!(status.code(), Some(0), "{}", proxy.logs());

    let direct = Connection::connect(&reference, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = direct.create_channel().await.unwrap();
    let back = get(&ch, &q).await;
    assert_eq!(payload(&back), "held");
    assert_eq!(
        header(&back, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1)),
        "{}",
        proxy.logs()
    );
    assert!(
        crate::common::dl::get(&ch, &q).await.is_none(),
        "returned once"
    );
    let _ = ch
        .queue_delete(
            q.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await;
    let _ = direct.close(200, "done".into()).await;
}
