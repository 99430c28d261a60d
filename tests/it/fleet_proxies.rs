//! Proxies as processes in front of the cluster ([`crate::proxy_support::fleet`]): two
//! `dlx-proxy` processes sharing one configuration serve the same queues, whichever of them a
//! client uses; a proxy killed with SIGKILL starts again on its ports.

use crate::common::dl::{
    confirm_select, declare_dead_lettering, declare_dlx, declare_durable, ls, payload, table,
    x_death,
};
use crate::common::unique;
use crate::proxy_support::fleet::{Fleet, fleet_toml};
use crate::proxy_support::{get, publish_acked, wait_count};
use crate::rabbit::cluster;

#[tokio::test]
async fn a_message_published_through_one_proxy_is_consumed_through_another() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let queue = unique("fleet-pass");
    let a = fleet.proxy(0).connect().await;
    let ch_a = a.create_channel().await.unwrap();
    declare_durable(&ch_a, &queue, table(&[("x-queue-type", ls("quorum"))])).await;
    confirm_select(&ch_a).await;
    publish_acked(&ch_a, &queue, 3).await;

    let b = fleet.proxy(1).connect().await;
    let ch_b = b.create_channel().await.unwrap();
    for i in 0..3 {
        let delivery = get(&ch_b, &queue).await;
        assert_eq!(payload(&delivery), format!("m{i}"));
        delivery.ack(Default::default()).await.unwrap();
    }
    wait_count(&ch_a, &queue, 0).await;
    fleet.stop_deleting(&[&queue], &[]).await;
}

#[tokio::test]
async fn a_reject_through_one_proxy_dead_letters_to_the_dlx_declared_through_another() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let (queue, dlx, dlq) = (unique("fleet-q"), unique("fleet-dlx"), unique("fleet-dlq"));
    let a = fleet.proxy(0).connect().await;
    let ch_a = a.create_channel().await.unwrap();
    declare_dlx(&ch_a, &dlx, &dlq).await;
    declare_dead_lettering(&ch_a, &queue, &dlx, &dlq).await;
    confirm_select(&ch_a).await;
    publish_acked(&ch_a, &queue, 1).await;

    let b = fleet.proxy(1).connect().await;
    let ch_b = b.create_channel().await.unwrap();
    let delivery = get(&ch_b, &queue).await;
    delivery
        .reject(lapin::options::BasicRejectOptions { requeue: false })
        .await
        .unwrap();

    let dead = get(&ch_a, &dlq).await;
    assert_eq!(payload(&dead), "m0");
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(deaths[0].qrc(), (queue.as_str(), "rejected", 1));
    assert_eq!(deaths[0].exchange, "");
    assert_eq!(deaths[0].routing_keys, vec![queue.clone()]);
    dead.ack(Default::default()).await.unwrap();
    wait_count(&ch_a, &queue, 0).await;

    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

#[tokio::test]
async fn a_killed_proxy_process_restarts_on_its_ports() {
    let _steady = cluster().steady().await;
    let mut fleet = Fleet::in_front_of_cluster(1, &[], "").await;
    let proxy = fleet.proxy_mut(0);
    let conn = proxy.connect().await;
    assert_eq!(proxy.counter("connections", &[]).await, 1.0);
    proxy.kill();
    assert!(!proxy.running());
    // The client's socket was closed by the kernel with the process.
    crate::common::wait_until("the client sees its connection closed", WAIT, async || {
        !conn.status().connected()
    })
    .await;
    proxy.restart().await;
    let again = proxy.connect().await;
    let ch = again.create_channel().await.unwrap();
    crate::common::dl::sync(&ch).await;
    assert_eq!(proxy.counter("connections", &[]).await, 1.0);
    let status = proxy.terminate().await;
    assert!(status.success(), "{status:?}\n{}", proxy.logs());
    fleet.stop().await;
}

#[test]
fn the_fleet_configuration_is_proxy_mode_with_overrides_merged() {
    let policy = crate::proxy_support::policy("p", "^x$", serde_json::json!({"message-ttl": 5}));
    let text = fleet_toml(
        &[
            "amqp://127.0.0.1:1/%2f".into(),
            "amqp://127.0.0.1:2/%2f".into(),
        ],
        &[policy],
        "cap",
        "[proxy]\nconfirm_timeout_secs = 9\n[dead_letter]\nmax_hops = 3\n",
    );
    let config: dlx_proxy::config::Config = toml::from_str(&text).expect(&text);
    assert_eq!(config.mode, dlx_proxy::config::Mode::Proxy);
    // Every node in upstream.urls, in order; the proxy's service user is guest.
    assert_eq!(
        config.upstream.urls,
        ["amqp://127.0.0.1:1/%2f", "amqp://127.0.0.1:2/%2f"]
    );
    assert_eq!(config.upstream.url, "");
    assert_eq!(config.upstream.user, "guest");
    assert_eq!(config.proxy.capture_name, "cap");
    assert_eq!(config.proxy.confirm_timeout_secs, 9);
    assert_eq!(config.dead_letter.max_hops, 3);
    assert_eq!(config.policies.len(), 1);
    assert_eq!(config.policies[0].definition["message-ttl"], 5);
}

const WAIT: std::time::Duration = std::time::Duration::from_secs(15);
