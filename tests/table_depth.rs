//! Field tables nested deeper than anything decodes recursively (issue #11): method arguments
//! beyond `limits.max_table_depth` close only the connection that sent them (501
//! FRAME_ERROR), in both modes; the limit's ceiling is safe on a tokio worker's stack.
//!
//! The frames are built by hand (`common::deep`): lapin cannot encode 10 000 levels.

mod common;
mod proxy_support;

use common::deep::{self, table_of_depth};
use lapin::options::BasicGetOptions;
use lapin::types::FieldTable;
use proxy_support::*;

const DEEP: usize = 10_000;
const CEILING: usize = dlx_proxy::amqp::depth::MAX_TABLE_DEPTH_CEILING;

/// Asserts the 501 close that names the limit, answers it, and sees the connection end.
async fn expect_too_deep(client: &mut RawClient, limit: usize) {
    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 501, "{text}");
    assert!(text.starts_with("FRAME_ERROR - cannot decode"), "{text}");
    assert!(
        text.contains(&format!("limits.max_table_depth ({limit})")),
        "{text}"
    );
    client.send_close_ok().await;
    client.expect_end().await;
}

/// A queue holding one message "kept", declared and filled over `ch`.
async fn queue_with_a_message(ch: &lapin::Channel) -> String {
    let q = unique("depth-kept");
    declare(ch, &q, FieldTable::default()).await;
    common::dl::publish(ch, &q, &["kept"]).await;
    q
}

/// The message is still in `q`, and the connection still publishes and gets.
async fn still_works(ch: &lapin::Channel, q: &str) {
    let got = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the queued message is still there");
    assert_eq!(payload(&got), "kept");
    common::dl::publish(ch, q, &["after"]).await;
    let got = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message published afterwards");
    assert_eq!(payload(&got), "after");
}

/// Sends 10 000 levels of tables, then of arrays, in queue.declare arguments on fresh raw
/// connections to `addr`, and a start-ok with 10 000 levels of client properties.
async fn refuse_deep_methods(addr: std::net::SocketAddr, limit: usize, start_ok: bool) {
    for kind in [b'F', b'A'] {
        let mut client = RawClient::connect(addr).await;
        client.open_channel(1).await;
        let arguments = table_of_depth(kind, DEEP);
        client
            .send_raw(&deep::queue_declare(1, &unique("deep"), &arguments))
            .await;
        expect_too_deep(&mut client, limit).await;
    }
    if start_ok {
        let mut client = RawClient::connect_no_handshake(addr).await;
        client
            .send_raw(&dlx_proxy::amqp::codec::PROTOCOL_HEADER)
            .await;
        client.expect_method(10, 10).await;
        client
            .send_raw(&deep::start_ok(&table_of_depth(b'F', DEEP)))
            .await;
        expect_too_deep(&mut client, limit).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_deep_method_arguments_close_only_that_connection() {
    let broker = common::start().await;
    let (_conn, ch) = broker.channel().await;
    let q = queue_with_a_message(&ch).await;
    refuse_deep_methods(broker.addr, 64, true).await;
    still_works(&ch, &q).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_deep_method_arguments_close_only_that_connection() {
    require_upstream!();
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue_with_a_message(&ch).await;
    // queue.declare is decoded by the proxy (start-ok passes through to RabbitMQ).
    refuse_deep_methods(proxy.addr, 64, false).await;
    // basic.consume is decoded by the proxy too.
    let mut client = RawClient::connect(proxy.addr).await;
    client.open_channel(1).await;
    let consume = deep::method_with_table(
        1,
        (60, 20),
        &deep::fields(true, &[&q, ""], Some(0)),
        &table_of_depth(b'A', DEEP),
    );
    client.send_raw(&consume).await;
    expect_too_deep(&mut client, 64).await;
    still_works(&ch, &q).await;
    let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    proxy.stop().await;
}

/// Declares `q` with arguments `depth` deep (tables and arrays) and expects declare-ok.
async fn declare_ok(client: &mut RawClient, q: &str, kind: u8, depth: usize) {
    client
        .send_raw(&deep::queue_declare(1, q, &table_of_depth(kind, depth)))
        .await;
    client.expect_method(50, 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_limit_accepts_its_depth_and_refuses_one_more() {
    let mut config = common::test_config();
    config.limits.max_table_depth = 5;
    let broker = common::start_with(config).await;
    let mut client = RawClient::connect(broker.addr).await;
    client.open_channel(1).await;
    declare_ok(&mut client, &unique("five"), b'F', 5).await;
    declare_ok(&mut client, &unique("five"), b'A', 5).await;
    client
        .send_raw(&deep::queue_declare(
            1,
            &unique("six"),
            &table_of_depth(b'A', 6),
        ))
        .await;
    expect_too_deep(&mut client, 5).await;
}

/// Every method that carries a table, with arguments exactly `depth` deep, on one channel:
/// queue.declare twice (the redeclare compares the arguments), exchange.declare (headers),
/// queue.bind and queue.unbind, basic.consume. Each must be answered.
async fn every_table_method_at(
    client: &mut RawClient,
    depth: usize,
    prefix: &str,
) -> (String, String) {
    let q = unique(prefix);
    let x = unique(prefix);
    for kind in [b'F', b'A'] {
        let args = table_of_depth(kind, depth);
        let q = format!("{q}-{}", kind as char);
        declare_ok(client, &q, kind, depth).await;
        declare_ok(client, &q, kind, depth).await;
        let x = format!("{x}-{}", kind as char);
        let declare_x = deep::method_with_table(
            1,
            (40, 10),
            &deep::fields(true, &[&x, "headers"], Some(0)),
            &args,
        );
        client.send_raw(&declare_x).await;
        client.expect_method(40, 11).await;
        let bind = deep::method_with_table(
            1,
            (50, 20),
            &deep::fields(true, &[&q, &x, "rk"], Some(0)),
            &args,
        );
        client.send_raw(&bind).await;
        client.expect_method(50, 21).await;
        let unbind = deep::method_with_table(
            1,
            (50, 50),
            &deep::fields(true, &[&q, &x, "rk"], None),
            &args,
        );
        client.send_raw(&unbind).await;
        client.expect_method(50, 51).await;
        let consume = deep::method_with_table(
            1,
            (60, 20),
            &deep::fields(true, &[&q, &format!("deep-{}", kind as char)], Some(0)),
            &args,
        );
        client.send_raw(&consume).await;
        client.expect_method(60, 21).await;
    }
    (q, x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_table_depth_ceiling_is_safe_on_a_worker_stack() {
    // Embedded: the broker's tasks run on this runtime's workers (2 MiB stacks).
    let mut config = common::test_config();
    config.limits.max_table_depth = CEILING;
    let broker = common::start_with(config).await;
    let mut client = RawClient::connect(broker.addr).await;
    client.open_channel(1).await;
    every_table_method_at(&mut client, CEILING, "ceiling").await;
    // Closing the connection drops every stored deep value.
    drop(client);
    let (_conn, ch) = broker.channel().await;
    let q = queue_with_a_message(&ch).await;
    still_works(&ch, &q).await;

    // Proxy: the proxy decodes, merges and re-encodes queue.declare and decodes basic.consume.
    if !proxy_support::upstream_available().await {
        return;
    }
    let proxy = TestProxy::start_with(vec![], |c| c.limits.max_table_depth = CEILING).await;
    let mut client = RawClient::connect(proxy.addr).await;
    client.open_channel(1).await;
    let (q, x) = every_table_method_at(&mut client, CEILING, "ceiling-proxy").await;
    drop(client);
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    for kind in ['F', 'A'] {
        let _ = ch
            .queue_delete(format!("{q}-{kind}").as_str().into(), Default::default())
            .await;
        let _ = ch
            .exchange_delete(format!("{x}-{kind}").as_str().into(), Default::default())
            .await;
    }
    proxy.stop().await;
}
