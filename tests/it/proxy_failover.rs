//! Proxy mode with several upstream nodes (`upstream.urls`): two independent RabbitMQ nodes
//! of the test's own (failing over client connections needs no cluster), the proxy run as the
//! service with its admin server. Node A is killed (SIGKILL): its clients get 320
//! CONNECTION_FORCED from the proxy, reconnect at once through the same proxy and land on
//! node B, where publishing and getting work, while `/readyz` stays 200. Node B's
//! application stopped too: `/readyz` turns 503 and new clients are refused with 320 naming
//! both nodes, counted per node; B started again, `/readyz` is 200 again. Every number is
//! read over HTTP.

use crate::common::dl::{amqp_code, amqp_text};
use crate::common::{self, free_addresses, http, metric_value, poll};
use crate::proxy_support::*;
use crate::rabbit::RabbitNode;

use std::net::SocketAddr;
use std::time::Duration;

use dlx_proxy::config::{Config, Mode};
use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::{Connection, ConnectionProperties, Event};

/// The two nodes, started side by side.
async fn two_nodes() -> (RabbitNode, RabbitNode) {
    let a = tokio::task::spawn_blocking(|| RabbitNode::start("fo-a"));
    let b = tokio::task::spawn_blocking(|| RabbitNode::start("fo-b"));
    (a.await.unwrap(), b.await.unwrap())
}

fn attempts(address: SocketAddr, result: &str) -> String {
    format!(
        "dlx_proxy_upstream_connect_attempts_total{{result=\"{result}\",upstream=\"{address}\"}}"
    )
}

/// The value of `series` in the proxy's `/metrics` over HTTP.
async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let text = common::scrape(admin).await;
    metric_value(&text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"))
}

/// Polls `/readyz` until it answers `status` (panics after 30 s: a bound for a loaded machine,
/// not a timing requirement).
async fn wait_readyz(admin: SocketAddr, status: u16) {
    let reached = poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || (http(admin, "GET", "/readyz").await.0 == status).then_some(()),
    )
    .await;
    assert!(reached.is_some(), "/readyz never answered {status}");
}

/// The reply code and text of the connection.close that ends `events` (panics after 30 s).
async fn closed_with(
    events: &mut (impl futures_util::Stream<Item = Event> + Unpin),
) -> (Option<u16>, String) {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.next()).await {
            Ok(Some(Event::Error(err))) => return (amqp_code(&err), amqp_text(&err)),
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the connection's events ended without an error"),
            Err(_) => panic!("the connection was not closed within 30 s"),
        }
    }
}

/// Stops a node at once: SIGKILL to its Erlang VM (no connection.close to anyone).
fn kill(node: &RabbitNode) {
    let pid = std::fs::read_to_string(node.dir.join("pid")).expect("the node's pid file");
    let status = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -KILL {pid}");
}

fn queue_names(node: &RabbitNode) -> String {
    let output = node.ctl(&["-q", "list_queues", "name"]);
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_fail_over_to_the_next_node_and_readyz_follows_reachability() {
    let (a, b) = two_nodes().await;
    let (amqp, admin) = free_addresses();
    let mut config = Config {
        mode: Mode::Proxy,
        ..Config::default()
    };
    config.listen.amqp = amqp.to_string();
    config.listen.admin = admin.to_string();
    config.upstream.urls = vec![format!("amqp://{}", a.amqp), format!("amqp://{}", b.amqp)];
    // A refused dial fails at once whatever this is; it bounds a live node's greeting, which
    // takes seconds on a machine loaded with other nodes.
    config.upstream.connect_timeout_secs = 15;
    config.proxy.capture_name = unique("capture");
    // Client connections only: the service connections dial through the same pool and
    // would add their own attempts to the counts below (their failover is in
    // fleet_capture.rs).
    config.proxy.delegate_to_upstream = true;
    let service = dlx_proxy::service::start(config)
        .await
        .expect("proxy starts");
    wait_readyz(admin, 200).await;
    let uri = format!("amqp://guest:guest@{amqp}/%2f");
    let connect = async || Connection::connect(&uri, ConnectionProperties::default()).await;

    // The first node in the list serves the first client.
    let conn = connect().await.expect("connect through the proxy");
    let mut events = Box::pin(conn.events_listener());
    let (ch, q) = confirming_channel(&conn, "fo-a-q").await;
    publish_acked(&ch, &q, 1).await;
    assert!(queue_names(&a).contains(&q), "{q} is not on node A");
    assert_eq!(metric(admin, &attempts(a.amqp, "success")).await, 1.0);
    assert_eq!(metric(admin, &attempts(b.amqp, "success")).await, 0.0);
    assert_eq!(metric(admin, "dlx_proxy_upstream_reachable").await, 1.0);

    // Node A dies: the client is told with 320 and a reason.
    kill(&a);
    let (code, text) = closed_with(&mut events).await;
    assert_eq!(code, Some(320), "{text}");
    assert!(
        text.starts_with("CONNECTION_FORCED - upstream connection"),
        "{text}"
    );

    // An immediate reconnect through the same proxy lands on node B and works.
    let conn = connect()
        .await
        .expect("reconnect at once through the proxy");
    let mut events = Box::pin(conn.events_listener());
    let (ch, q) = confirming_channel(&conn, "fo-b-q").await;
    publish_acked(&ch, &q, 3).await;
    for i in 0..3 {
        let delivery = get(&ch, &q).await;
        assert_eq!(payload(&delivery), format!("m{i}"));
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    assert!(queue_names(&b).contains(&q), "{q} is not on node B");
    assert_eq!(metric(admin, &attempts(b.amqp, "success")).await, 1.0);
    assert_eq!(metric(admin, &attempts(a.amqp, "success")).await, 1.0);
    // One node is left: the proxy stays ready throughout.
    for _ in 0..10 {
        assert_eq!(http(admin, "GET", "/readyz").await, (200, "ready".into()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(metric(admin, "dlx_proxy_upstream_reachable").await, 1.0);

    // Node B's application stops too: its 320 reaches the client as RabbitMQ sent it, and
    // with no node left the proxy is not ready (no client needs to try first).
    let stopped = b.ctl(&["stop_app"]);
    assert!(stopped.status.success(), "{stopped:?}");
    let (code, text) = closed_with(&mut events).await;
    assert_eq!(code, Some(320), "{text}");
    wait_readyz(admin, 503).await;
    assert_eq!(
        http(admin, "GET", "/readyz").await,
        (503, "not ready".into())
    );
    assert_eq!(metric(admin, "dlx_proxy_upstream_reachable").await, 0.0);

    // A client is refused as with one upstream: 320 naming each node in the order dialled;
    // one attempt each.
    let failures_a = metric(admin, &attempts(a.amqp, "failure")).await;
    let failures_b = metric(admin, &attempts(b.amqp, "failure")).await;
    let err = connect().await.expect_err("no upstream to connect to");
    let shown = err.to_string();
    // Node B worked last, so it is dialled first.
    let names_both = shown.contains(&format!(
        "CONNECTION_FORCED - upstream {} unreachable: ",
        b.amqp
    )) && shown.contains(&format!("; upstream {} unreachable: ", a.amqp));
    assert!(names_both, "lapin error: {shown}");
    assert_eq!(
        metric(admin, &attempts(a.amqp, "failure")).await,
        failures_a + 1.0
    );
    assert_eq!(
        metric(admin, &attempts(b.amqp, "failure")).await,
        failures_b + 1.0
    );
    assert_eq!(
        metric(
            admin,
            r#"dlx_proxy_connections_refused_total{reason="upstream_unreachable"}"#
        )
        .await,
        1.0
    );

    // Node B back: ready again within the check interval, and clients connect.
    let started = b.ctl(&["start_app"]);
    assert!(started.status.success(), "{started:?}");
    wait_readyz(admin, 200).await;
    assert_eq!(metric(admin, "dlx_proxy_upstream_reachable").await, 1.0);
    let conn = connect().await.expect("connect after node B came back");
    let (ch, q) = confirming_channel(&conn, "fo-back-q").await;
    publish_acked(&ch, &q, 1).await;
    assert_eq!(payload(&get(&ch, &q).await), "m0");
    conn.close(200, "bye".into()).await.unwrap();

    // The reachability check ends with the shutdown signal; shutdown completes.
    tokio::time::timeout(Duration::from_secs(30), service.shutdown())
        .await
        .expect("shutdown completes");
}

/// A listener that accepts connections and closes them at once, as a node going down does
/// while its listening socket still lives; returns its address and how many it accepted.
async fn node_going_down() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(socket);
        }
    });
    (address, accepted)
}

/// The first node accepts connections but closes them before greeting (a node going down):
/// a client connecting through the proxy is not dropped but served by the next node, and the
/// next client does not dial the dying node again (it backs off like a refused one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_closes_before_its_greeting_is_skipped_for_the_next_one() {
    let (dying, accepted) = node_going_down().await;
    let proxy = TestProxy::start_with(vec![], |config| {
        config.upstream.url = String::new();
        config.upstream.urls = vec![
            format!("amqp://{dying}"),
            format!("amqp://{}", upstream_host()),
        ];
        // Client connections only: the service connections dial the same pool.
        config.proxy.delegate_to_upstream = true;
    })
    .await;
    for round in 0..2 {
        let conn = proxy.connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let (queue, _) = ch
            .queue_declare(
                "".into(),
                lapin::options::QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .map(|q| (q.name().to_string(), ()))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(queue.starts_with("amq.gen-"), "{queue}");
        let _ = conn.close(200, "done".into()).await;
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the dying node is dialled once, then skipped"
    );
    let dying = dying.to_string();
    for (result, count) in [("failure", 1.0), ("success", 0.0)] {
        let labels = [("result", result), ("upstream", dying.as_str())];
        let value = proxy.counter("upstream_connect_attempts_total", &labels);
        assert_eq!(value, count, "{result} attempts of the dying node");
    }
    let node = upstream_host();
    let reached = [("result", "success"), ("upstream", node.as_str())];
    assert_eq!(
        proxy.counter("upstream_connect_attempts_total", &reached),
        2.0
    );
    proxy.stop().await;
}
