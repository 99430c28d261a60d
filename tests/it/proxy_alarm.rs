//! Proxy mode under a RabbitMQ resource alarm, on a node of the test's own (an alarm stops
//! every publisher of its node, so the shared reference node is not used).
//!
//! RabbitMQ blocks a connection only once it publishes while an alarm is in effect, and then
//! reads nothing more from it until the alarm clears: not the publishes, and not the acks
//! either. So RabbitMQ advises separate connections for publishing and consuming, and a
//! consumer keeps draining queues during an alarm, which is what ends a memory alarm. The
//! proxy must not undo that by publishing a consumer's dead letters on the consumer's own
//! connection: a consume-only connection's dead letters go through the vhost's service
//! connection. That one is blocked in turn, and while it is, its confirm deadlines stand
//! still: the dead letter is published once, not again on every timeout. A connection that
//! publishes is blocked whoever publishes on it; its dead letters go on it as before, with
//! their confirm deadlines stopped between RabbitMQ's connection.blocked and
//! connection.unblocked, which the client hears too. A client's close waits for its dead
//! letters at most the confirm timeout, not the whole alarm.

use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicQosOptions, BasicRejectOptions};

use crate::common::dl::{consumer, get_one, next};
use crate::common::poll;
use crate::proxy_support::*;
use crate::rabbit::RabbitNode;

/// Raises (`on`) or clears the node's memory alarm, and waits until the node reports it so.
fn memory_alarm(node: &RabbitNode, on: bool) {
    let watermark = if on { "0.00001" } else { "0.4" };
    let set = node.ctl(&["set_vm_memory_high_watermark", watermark]);
    assert!(set.status.success(), "{set:?}");
    for _ in 0..60 {
        let alarms = node.ctl(&["eval", "rabbit_alarm:get_alarms()."]);
        let text = String::from_utf8_lossy(&alarms.stdout);
        if text.contains("memory") == on {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("the memory alarm did not turn {on}");
}

/// Ready and unacked messages of `queue` as the node counts them (without AMQP, which an
/// alarm may block). Blocking: rabbitmqctl takes about a second.
fn counts(node: &RabbitNode, queue: &str) -> Option<(u64, u64)> {
    let out = node.ctl(&[
        "list_queues",
        "--quiet",
        "--no-table-headers",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            (fields.next() == Some(queue)).then_some(())?;
            Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
        })
}

/// Polls until `queue` holds `ready` ready and `unacked` unacked messages (panics after 20 s).
async fn wait_counts(node: &RabbitNode, queue: &str, ready: u64, unacked: u64) {
    let reached = poll(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let now = tokio::task::block_in_place(|| counts(node, queue));
            (now == Some((ready, unacked))).then_some(())
        },
    )
    .await;
    assert!(
        reached.is_some(),
        "{queue}: expected {ready} ready / {unacked} unacked, the node counts {:?}",
        counts(node, queue)
    );
}

/// A node of the test's own (`tag`) and a proxy in front of it whose confirm deadline is
/// short enough that a blocked confirm would time out, and be retried, many times.
async fn node_and_proxy(tag: &'static str) -> (RabbitNode, TestProxy) {
    let node = tokio::task::spawn_blocking(move || RabbitNode::start(tag))
        .await
        .unwrap();
    let url = format!("amqp://{}", node.amqp);
    let proxy = TestProxy::start_with(vec![], |c| {
        c.upstream.url = url;
        c.proxy.confirm_timeout_secs = 1;
        c.proxy.retry_initial_ms = 100;
        c.proxy.retry_max_ms = 200;
    })
    .await;
    proxy
        .wait_gauge("capture_consumers", &[("vhost", "/")], 1.0)
        .await;
    (node, proxy)
}

/// A connection through `proxy` and a channel on it that declared a queue dead-lettering
/// into a DLQ (through a direct exchange): (connection, channel, DLQ, queue).
async fn dead_lettering_queue(
    proxy: &TestProxy,
) -> (lapin::Connection, lapin::Channel, String, String) {
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (dlx, dlq, q) = (unique("alarm-dlx"), unique("alarm-dlq"), unique("alarm-q"));
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_dead_lettering(&ch, &q, &dlx, &dlq).await;
    (conn, ch, dlq, q)
}

/// Raises the node's memory alarm, rejects delivery `tag` on `ch` (without requeue) and waits
/// until RabbitMQ blocks the `connection` ("client" or "service") its dead letter went on.
async fn reject_during_alarm(
    node: &RabbitNode,
    proxy: &TestProxy,
    ch: &lapin::Channel,
    tag: u64,
    connection: &str,
) {
    tokio::task::block_in_place(|| memory_alarm(node, true));
    ch.basic_reject(tag, BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    proxy
        .wait_gauge(
            "upstream_connections_blocked",
            &[("connection", connection)],
            1.0,
        )
        .await;
}

/// A consume-only connection whose dead letter waits on the blocked service connection.
struct Blocked {
    /// The connection that declared and published, and its channel.
    admin: lapin::Connection,
    ach: lapin::Channel,
    dlq: String,
    q: String,
    /// The consumer's connection and channel.
    conn: lapin::Connection,
    ch: lapin::Channel,
}

/// A dead-lettering queue with one message, which a consume-only connection receives and
/// rejects during a memory alarm: its dead letter goes out on the service connection, which
/// RabbitMQ then blocks.
async fn consumer_dead_letter_blocked(node: &RabbitNode, proxy: &TestProxy) -> Blocked {
    let (admin, ach, dlq, q) = dead_lettering_queue(proxy).await;
    crate::common::dl::publish(&ach, &q, &["dead"]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut deliveries = consumer(&ch, &q, "alarm-rejecter").await;
    let tag = next(&mut deliveries).await.delivery_tag;
    reject_during_alarm(node, proxy, &ch, tag, "service").await;
    Blocked {
        admin,
        ach,
        dlq,
        q,
        conn,
        ch,
    }
}

/// The dead letter was published once: two seconds after it landed no copy from a
/// timed-out confirm follows, and no confirm timed out; then [`landed_once`].
async fn published_once(
    node: &RabbitNode,
    proxy: &TestProxy,
    ch: &lapin::Channel,
    dlq: &str,
    q: &str,
) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = tokio::task::block_in_place(|| counts(node, dlq));
    assert_eq!(after, Some((1, 0)), "published once");
    landed_once(ch, dlq, q).await;
    assert_eq!(
        proxy.counter("dead_letter_retries_total", &[("reason", "timeout")]),
        0.0
    );
}

/// The one dead letter in `dlq`: "dead", rejected in `q` once.
async fn landed_once(ch: &lapin::Channel, dlq: &str, q: &str) {
    let dead = get_one(ch, dlq).await;
    assert_eq!(payload(&dead), "dead");
    let death = &x_death(&dead)[0];
    assert_eq!(field(death, "queue"), &ls(q));
    assert_eq!(field(death, "reason"), &ls("rejected"));
    assert_eq!(
        field(death, "count"),
        &lapin::types::AMQPValue::LongLongInt(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_rejects_during_an_alarm_goes_on_acking_and_its_dead_letter_lands_once() {
    let (node, proxy) = node_and_proxy("alarm-c").await;
    let (admin, ach, dlq, q) = dead_lettering_queue(&proxy).await;
    crate::common::dl::publish(&ach, &q, &["dead", "ok-1", "ok-2"]).await;

    // A consume-only connection: it never publishes.
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut deliveries = consumer(&ch, &q, "alarm-consumer").await;
    let mut tags = Vec::new();
    for expected in ["dead", "ok-1", "ok-2"] {
        let d = next(&mut deliveries).await;
        assert_eq!(payload(&d), expected);
        tags.push(d.delivery_tag);
    }

    tokio::task::block_in_place(|| memory_alarm(&node, true));
    ch.basic_reject(tags[0], BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    // After the dead letter went out: RabbitMQ reads a blocked connection no further.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ch.basic_ack(tags[1], BasicAckOptions::default())
        .await
        .unwrap();
    // The ack reached RabbitMQ: "dead" stays unacked until its dead letter is confirmed.
    wait_counts(&node, &q, 0, 2).await;
    let during = tokio::task::block_in_place(|| counts(&node, &dlq));
    assert_eq!(during, Some((0, 0)), "published during the alarm");
    proxy
        .wait_gauge(
            "upstream_connections_blocked",
            &[("connection", "service")],
            1.0,
        )
        .await;
    // Several confirm timeouts' worth of alarm.
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| memory_alarm(&node, false));

    wait_counts(&node, &dlq, 1, 0).await;
    wait_counts(&node, &q, 0, 1).await;
    ch.basic_ack(tags[2], BasicAckOptions::default())
        .await
        .unwrap();
    wait_counts(&node, &q, 0, 0).await;
    proxy
        .wait_gauge(
            "upstream_connections_blocked",
            &[("connection", "service")],
            0.0,
        )
        .await;
    published_once(&node, &proxy, &ach, &dlq, &q).await;
    let _ = conn.close(200, "done".into()).await;
    let _ = admin.close(200, "done".into()).await;
    proxy.stop().await;
}

/// A connection that publishes is blocked by the alarm whoever publishes on it: the proxy's
/// dead letter goes on it as before, RabbitMQ's connection.blocked reaches the client (lapin
/// asks for it), and the dead letter's confirm deadline waits for the connection.unblocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publishers_dead_letter_during_an_alarm_waits_for_the_unblock_and_lands_once() {
    let (node, proxy) = node_and_proxy("alarm-p").await;
    let (conn, ch, dlq, q) = dead_lettering_queue(&proxy).await;
    crate::common::dl::publish(&ch, &q, &["dead"]).await;
    let tag = get_one(&ch, &q).await.delivery_tag;

    reject_during_alarm(&node, &proxy, &ch, tag, "client").await;
    let told = poll(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || conn.status().blocked().then_some(()),
    )
    .await;
    assert!(told.is_some(), "the client hears connection.blocked");
    // Several confirm timeouts' worth of alarm.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = tokio::task::block_in_place(|| counts(&node, &dlq));
    assert_eq!(during, Some((0, 0)), "published during the alarm");
    tokio::task::block_in_place(|| memory_alarm(&node, false));

    wait_counts(&node, &dlq, 1, 0).await;
    wait_counts(&node, &q, 0, 0).await;
    proxy
        .wait_gauge(
            "upstream_connections_blocked",
            &[("connection", "client")],
            0.0,
        )
        .await;
    assert!(!conn.status().blocked(), "and connection.unblocked");
    published_once(&node, &proxy, &ch, &dlq, &q).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// A consumer that closes its channel during an alarm, with a dead letter stuck on the
/// blocked service connection: the close waits `proxy.confirm_timeout_secs` at most, not the
/// alarm out. The original goes back to its queue; the dead letter lands too once the alarm
/// clears (a duplicate, never a loss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_closing_during_an_alarm_is_not_held_until_it_clears() {
    let (node, proxy) = node_and_proxy("alarm-x").await;
    let Blocked {
        admin,
        ach,
        dlq,
        q,
        conn,
        ch,
    } = consumer_dead_letter_blocked(&node, &proxy).await;
    tokio::time::timeout(Duration::from_secs(5), ch.close(200, "bye".into()))
        .await
        .expect("channel.close answered during the alarm")
        .unwrap();
    wait_counts(&node, &q, 1, 0).await;
    tokio::task::block_in_place(|| memory_alarm(&node, false));
    wait_counts(&node, &dlq, 1, 0).await;
    landed_once(&ach, &dlq, &q).await;
    let _ = conn.close(200, "done".into()).await;
    let _ = admin.close(200, "done".into()).await;
    proxy.stop().await;
}

/// An application that starts during an alarm declares its queue through the proxy while the
/// service connection is blocked (a consumer's dead letter went out on it): the declare check
/// goes on the declare connection, which never publishes and so is never blocked, and the
/// client gets its declare-ok at once, as it would from RabbitMQ directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_declared_while_the_service_connection_is_blocked_is_answered() {
    let (node, proxy) = node_and_proxy("alarm-d").await;
    let Blocked {
        admin,
        ach,
        dlq,
        q,
        conn,
        ch: _ch,
    } = consumer_dead_letter_blocked(&node, &proxy).await;

    let late = proxy.connect().await;
    let lch = late.create_channel().await.unwrap();
    let (late_dlx, late_q) = (unique("alarm-late-dlx"), unique("alarm-late-q"));
    // Under proxy.capture_ready_timeout_secs (10 s), after which a declare the proxy could
    // not have checked ends in 320.
    tokio::time::timeout(
        Duration::from_secs(5),
        declare_dead_lettering(&lch, &late_q, &late_dlx, "k"),
    )
    .await
    .expect("queue.declare answered during the alarm");
    assert_eq!(
        tokio::task::block_in_place(|| counts(&node, &late_q)),
        Some((0, 0))
    );
    assert_eq!(proxy.counter("service_declares_refused_total", &[]), 0.0);

    tokio::task::block_in_place(|| memory_alarm(&node, false));
    wait_counts(&node, &dlq, 1, 0).await;
    landed_once(&ach, &dlq, &q).await;
    let _ = late.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    let _ = admin.close(200, "done".into()).await;
    proxy.stop().await;
}
