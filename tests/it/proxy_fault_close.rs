//! Proxy mode, a broker-forced close: when the operator closes the upstream connection
//! (`rabbitmqctl close_connection`, the same 320 CONNECTION_FORCED as close_all_connections,
//! but limited to this test's connections so other users of the broker are left alone), the
//! client sees 320 with the broker's reason, reconnecting through the proxy works, and
//! confirmed messages are still there.
//!
//! Its own test binary: it must not run next to tests that need their connections.

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{BasicAckOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};
use proxy_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_forced_close_reaches_the_client_and_reconnecting_works() {
    let proxy = TestProxy::start(vec![]).await;
    let name = unique("forced");
    let conn = Connection::connect(
        &proxy.uri(),
        ConnectionProperties::default().with_connection_name(LongString::from(name.as_str())),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = unique("forced-q");
    declare(&ch, &q, FieldTable::default()).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_acked(&ch, &q, 5).await;
    let mut raw = RawClient::connect_named(proxy.addr, &name).await;

    assert_eq!(close_upstream_connection(&name, "test"), 2);
    let (code, text) = raw.expect_connection_close().await;
    assert_eq!(code, 320);
    assert!(text.starts_with("CONNECTION_FORCED"), "{text}");
    assert!(text.contains("test"), "{text}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        ch.basic_get(q.as_str().into(), Default::default())
            .await
            .is_err()
    );
    assert!(!conn.status().connected());

    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for i in 0..5 {
        let d = get(&ch, &q).await;
        assert_eq!(payload(&d), format!("m{i}"));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    consume_empty(&ch, &q).await;
    conn.close(200, "done".into()).await.unwrap();
    proxy.stop().await;
}
