//! The fleet test infrastructure itself: the shared 3-node RabbitMQ cluster
//! ([`crate::rabbit::cluster`]) is one cluster, serves a quorum queue from every node, tells
//! where a queue lives, and survives a SIGKILLed node that it restarts and takes back.

use lapin::{Channel, Connection, ConnectionProperties};

use crate::common::dl::{confirm_select, declare_durable, ls, table};
use crate::common::{poll, unique};
use crate::proxy_support::fleet::{count_at, wait_count_at};
use crate::proxy_support::{get, publish_acked};
use crate::rabbit::{RabbitNode, cluster};

const WAIT: std::time::Duration = std::time::Duration::from_secs(30);
const EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// A connection straight to `node` and a channel on it.
pub(crate) async fn channel_on(node: &RabbitNode) -> (Connection, Channel) {
    let conn = Connection::connect(&node.uri(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", node.name));
    let ch = conn.create_channel().await.expect("channel");
    (conn, ch)
}

/// Waits until `node` reports `count` messages in `queue`.
async fn wait_count_on(node: &RabbitNode, queue: &str, count: u32) {
    if let Err(last) = wait_count_at(&node.uri(), queue, count, WAIT).await {
        panic!(
            "{} reports {last:?} messages in {queue}, expected {count}",
            node.name
        );
    }
}

/// Takes every message of `queue` with basic.get and acks it; returns the bodies.
async fn drain(ch: &Channel, queue: &str, count: usize) -> Vec<String> {
    let mut bodies = Vec::new();
    for _ in 0..count {
        let delivery = get(ch, queue).await;
        bodies.push(String::from_utf8_lossy(&delivery.data).into_owned());
        delivery.ack(Default::default()).await.expect("ack");
    }
    bodies
}

fn expected_bodies(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("m{i}")).collect()
}

async fn declare_quorum(ch: &Channel, queue: &str) {
    declare_durable(ch, queue, table(&[("x-queue-type", ls("quorum"))])).await;
}

#[tokio::test]
async fn three_nodes_serve_a_quorum_queue_from_every_node() {
    let cluster = cluster();
    let _steady = cluster.steady().await;
    let mut names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    names.sort();
    assert_eq!(names.len(), 3);
    for node in cluster.nodes() {
        let (mut members, mut running) = node.cluster_nodes().expect("cluster_status");
        members.sort();
        running.sort();
        assert_eq!((&members, &running), (&names, &names), "{}", node.name);
    }

    let queue = unique("fleet-quorum");
    let (c0, ch0) = channel_on(cluster.node(0)).await;
    declare_quorum(&ch0, &queue).await;
    let home = cluster.queue_home("/", &queue);
    assert!(matches!(home, Some(0..=2)), "leader of {queue}: {home:?}");

    let (c2, ch2) = channel_on(cluster.node(2)).await;
    confirm_select(&ch2).await;
    publish_acked(&ch2, &queue, 5).await;
    let (c1, ch1) = channel_on(cluster.node(1)).await;
    assert_eq!(drain(&ch1, &queue, 5).await, expected_bodies(5));
    wait_count_on(cluster.node(2), &queue, 0).await;

    // A classic queue lives on the node it was declared on.
    let classic = unique("fleet-classic");
    declare_durable(&ch2, &classic, table(&[])).await;
    assert_eq!(cluster.queue_home("/", &classic), Some(2));
    assert_eq!(cluster.queue_home("/", "no-such-queue"), None);

    ch0.queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    ch0.queue_delete(classic.as_str().into(), Default::default())
        .await
        .unwrap();
    for conn in [c0, c1, c2] {
        let _ = conn.close(200, "done".into()).await;
    }
}

#[tokio::test]
async fn killed_leader_node_restarts_and_the_quorum_queue_keeps_its_messages() {
    let cluster = cluster();
    let mut outage = cluster.exclusive().await;
    let queue = unique("fleet-kill");
    let (c0, ch0) = channel_on(cluster.node(0)).await;
    declare_quorum(&ch0, &queue).await;
    confirm_select(&ch0).await;
    publish_acked(&ch0, &queue, 10).await;
    let _ = c0.close(200, "done".into()).await;

    let home = cluster.queue_home("/", &queue).expect("leader");
    outage.kill(home);
    assert_eq!(count_at(&cluster.node(home).uri(), &queue).await, None);
    let survivor = cluster.node((home + 1) % 3);
    // The two remaining members elect a leader and still hold every confirmed message.
    wait_count_on(survivor, &queue, 10).await;
    let new_home = poll(WAIT, EVERY, async || cluster.queue_home("/", &queue)).await;
    assert!(
        new_home.is_some_and(|h| h != home),
        "new leader {new_home:?}"
    );

    outage.restart(home);
    let restarted = cluster.node(home);
    let (members, running) = restarted.cluster_nodes().expect("cluster_status");
    assert_eq!(
        (members.len(), running.len()),
        (3, 3),
        "{members:?} {running:?}"
    );
    wait_count_on(restarted, &queue, 10).await;
    let (c, ch) = channel_on(restarted).await;
    assert_eq!(drain(&ch, &queue, 10).await, expected_bodies(10));
    ch.queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = c.close(200, "done".into()).await;
    outage.restore();
}
