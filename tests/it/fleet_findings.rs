//! The findings of issue 12 (proxy mode for fleets) as tests: two or three `dlx-proxy`
//! processes ([`Fleet`]) in front of the 3-node cluster ([`crate::rabbit::cluster`]), each
//! test asserting what the issue says must happen. The ones that fail today are ignored with
//! the part of the fleet work that fixes them; that part's branch removes the `ignore`.
//!
//! Every test holds the shared cluster: [`crate::rabbit::RabbitCluster::steady`], or
//! [`crate::rabbit::RabbitCluster::exclusive`] for the one that kills a node (which it
//! restarts before it returns). Names are unique, so the others run in parallel.

use std::time::Duration;

use lapin::options::{BasicNackOptions, BasicRejectOptions};
use lapin::{Channel, Connection};

use crate::common::dl::{
    AMQPValue, BasicProperties, amqp_code, amqp_text, confirm_select, declare_dlx, declare_durable,
    ls, payload, publish_to, table, try_declare, x_death,
};
use crate::common::{RawClient, poll, unique};
use crate::proxy_support::fleet::{Fleet, wait_count_at};
use crate::proxy_support::{consume, get};
use crate::rabbit::cluster;

/// How long a dead letter may take to land (a capture round trip, retries, a node restart).
const LAND: Duration = Duration::from_secs(30);

/// A connection through fleet member `i` and a channel on it.
async fn open(fleet: &Fleet, i: usize) -> (Connection, Channel) {
    let conn = fleet.proxy(i).connect().await;
    let ch = conn.create_channel().await.expect("channel");
    (conn, ch)
}

/// Any running node of the shared cluster, to look behind the proxies.
fn direct_uri() -> String {
    let cluster = cluster();
    cluster
        .nodes()
        .iter()
        .find(|node| node.beam_pid().is_some())
        .expect("a running node")
        .uri()
}

/// Asserts that `queue` holds `count` messages, as RabbitMQ itself reports it.
async fn assert_upstream_count(queue: &str, count: u32, what: &str) {
    if let Err(last) = wait_count_at(&direct_uri(), queue, count, LAND).await {
        panic!("{what}: {queue} holds {last:?} messages, expected {count}");
    }
}

/// The next message of `queue` (basic.get, no ack), or `None` after `limit`.
async fn try_get(ch: &Channel, queue: &str, limit: Duration) -> Option<lapin::message::Delivery> {
    poll(limit, Duration::from_millis(50), async || {
        ch.basic_get(queue.into(), Default::default())
            .await
            .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
            .map(|message| message.delivery)
    })
    .await
}

/// Takes one message of `queue` straight from RabbitMQ, acks it, and checks its body and its
/// single x-death entry: `(queue, reason, count 1)`.
async fn assert_dead_letter(dlq: &str, body: &str, queue: &str, reason: &str) {
    assert_eq!(take_dead_letter(dlq, queue, reason).await, body);
}

/// Like [`assert_dead_letter`] for a DLQ filled by several consumers at once (the capture
/// queue consumed by every proxy), where the dead letters are not in publishing order:
/// returns the body.
async fn take_dead_letter(dlq: &str, queue: &str, reason: &str) -> String {
    let conn = Connection::connect(&direct_uri(), Default::default())
        .await
        .expect("connect to RabbitMQ");
    let ch = conn.create_channel().await.unwrap();
    let dead = get(&ch, dlq).await;
    let body = payload(&dead);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(deaths[0].qrc(), (queue, reason, 1));
    dead.ack(Default::default()).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
    body
}

/// Takes every message of `dlq` straight from RabbitMQ (acking each), checking that each
/// carries the single x-death entry `(queue, reason, count 1)`; returns the bodies in order.
async fn drain(dlq: &str, queue: &str, reason: &str) -> Vec<String> {
    let conn = Connection::connect(&direct_uri(), Default::default())
        .await
        .expect("connect to RabbitMQ");
    let ch = conn.create_channel().await.unwrap();
    let mut bodies = Vec::new();
    while let Some(dead) = try_get(&ch, dlq, Duration::from_millis(500)).await {
        let deaths = x_death(&dead);
        assert_eq!(deaths.len(), 1, "{deaths:?}");
        assert_eq!(deaths[0].qrc(), (queue, reason, 1));
        bodies.push(payload(&dead));
        dead.ack(Default::default()).await.unwrap();
    }
    let _ = conn.close(200, "done".into()).await;
    bodies
}

/// Queue arguments dead-lettering to `dlx` with routing key `dlq`, plus `extra`.
fn dead_lettering(dlx: &str, dlq: &str, extra: &[(&str, AMQPValue)]) -> lapin::types::FieldTable {
    let mut args = vec![
        ("x-dead-letter-exchange", ls(dlx)),
        ("x-dead-letter-routing-key", ls(dlq)),
    ];
    args.extend(extra.iter().cloned());
    table(&args)
}

/// Through `ch`: a direct DLX and its DLQ (`<queue>-dlx`, `<queue>-dlq`, bound with key
/// DLQ), and a classic queue named from `prefix` dead-lettering to them with `extra`
/// arguments. Returns (queue, dlx, dlq).
async fn dead_letter_setup(
    ch: &Channel,
    prefix: &str,
    extra: &[(&str, AMQPValue)],
) -> (String, String, String) {
    let queue = unique(prefix);
    let (dlx, dlq) = (format!("{queue}-dlx"), format!("{queue}-dlq"));
    declare_dlx(ch, &dlx, &dlq).await;
    crate::common::dl::declare(ch, &queue, dead_lettering(&dlx, &dlq, extra)).await;
    (queue, dlx, dlq)
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", ls("quorum"))
}

/// Publishes `count` persistent messages "m0".. to `queue`, each confirmed.
async fn publish_confirmed(ch: &Channel, queue: &str, count: usize) {
    for i in 0..count {
        let confirm = publish_to(
            ch,
            "",
            queue,
            format!("m{i}").as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await;
        assert!(confirm.is_ack(), "publish m{i}: {confirm:?}");
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        multiple: false,
        requeue: true,
    }
}

fn dead_lettered(queue: &str, reason: &'static str) -> [(&'static str, String); 3] {
    [
        ("queue", queue.to_string()),
        ("reason", reason.to_string()),
        ("vhost", "/".to_string()),
    ]
}

async fn fleet_dead_lettered(
    fleet: &Fleet,
    queue: &str,
    reason: &'static str,
    at_least: usize,
) -> f64 {
    let labels = dead_lettered(queue, reason);
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    fleet
        .counter_sum_reaching("dead_lettered_total", &labels, at_least as f64)
        .await
}

// ------------------------------------------------------------------------------------------
// Finding 1: the capture queue is a single point of failure
// ------------------------------------------------------------------------------------------

/// The node hosting the capture queue dies while `published` confirmed persistent messages
/// die (`reason`, from the queue argument `limit`) on a quorum queue living elsewhere; once the
/// node is back, every death is in the DLQ and `remain` messages are still in the queue.
async fn deaths_while_the_capture_node_is_down(
    limit: (&str, AMQPValue),
    reason: &'static str,
    published: usize,
    remain: u32,
) {
    let cluster = cluster();
    let mut outage = cluster.exclusive().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    // Client connections on both proxies: the capture exists once a proxy served one.
    let (_c0, _ch0) = open(&fleet, 0).await;
    let (_c1, _ch1) = open(&fleet, 1).await;
    let home = poll(LAND, Duration::from_millis(200), async || {
        cluster.queue_home("/", &fleet.capture)
    })
    .await
    .expect("the capture queue exists");
    // The quorum queue, its DLQ and the publisher live away from the capture's node.
    let via = if home == 0 { 1 } else { 0 };
    let (_conn, ch) = open(&fleet, via).await;
    let (queue, dlx, dlq) = (unique("f1-q"), unique("f1-dlx"), unique("f1-dlq"));
    crate::common::dl::exchange(&ch, &dlx, lapin::ExchangeKind::Direct).await;
    declare_durable(&ch, &dlq, table(&[quorum()])).await;
    crate::common::dl::bind(&ch, &dlq, &dlx, &dlq).await;
    declare_durable(&ch, &queue, dead_lettering(&dlx, &dlq, &[quorum(), limit])).await;
    confirm_select(&ch).await;

    outage.kill(home);
    publish_confirmed(&ch, &queue, published).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    outage.restart(home);

    let dead = published - remain as usize;
    wait_at_least(&dlq, dead as u32, "0 confirmed messages lost").await;
    assert_upstream_count(&queue, remain, "the queue keeps the rest").await;
    // At least once: a dead letter may arrive twice, none may be missing.
    let bodies = drain(&dlq, &queue, reason).await;
    let distinct: std::collections::BTreeSet<&String> = bodies.iter().collect();
    let expected: Vec<String> = (0..dead).map(|i| format!("m{i}")).collect();
    assert_eq!(
        distinct,
        expected.iter().collect(),
        "dead letters (with duplicates: {bodies:?})"
    );
    assert!(fleet_dead_lettered(&fleet, &queue, reason, dead).await >= dead as f64);
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
    outage.restore();
}

#[tokio::test]
async fn f1_ttl_deaths_survive_the_loss_of_the_capture_queues_node() {
    let ttl = ("x-message-ttl", AMQPValue::LongInt(1000));
    deaths_while_the_capture_node_is_down(ttl, "expired", 20, 0).await;
}

#[tokio::test]
#[ignore = "fleet: RabbitMQ dead-letters drop-head deaths of quorum queues at most once (its at-least-once strategy needs reject-publish), so deaths while the capture queue elects a new leader are lost inside RabbitMQ (fleet_capture covers deaths after the election); the proxy cannot drop heads itself on top of reject-publish: the nack of a publish routed to several queues does not say which queue was full"]
async fn f1_max_length_deaths_survive_the_loss_of_the_capture_queues_node() {
    let max_length = ("x-max-length", AMQPValue::LongInt(5));
    deaths_while_the_capture_node_is_down(max_length, "maxlen", 25, 5).await;
}

// ------------------------------------------------------------------------------------------
// Finding 2: instances disagree, an instance's memory beats what is stored on the queue
// ------------------------------------------------------------------------------------------

#[tokio::test]
async fn f2_a_contradicting_redeclare_gets_406_from_every_instance() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let ttl = ("x-message-ttl", AMQPValue::LongInt(60_000));
    let (queue, dlx, dlq) = dead_letter_setup(&ch_a, "f2-q", &[ttl]).await;

    // What RabbitMQ itself answers a client that declares the queue without arguments.
    let direct = Connection::connect(&direct_uri(), Default::default())
        .await
        .expect("connect to RabbitMQ");
    let refused = try_declare(&direct.create_channel().await.unwrap(), &queue, table(&[]))
        .await
        .expect_err("RabbitMQ refuses the declare");
    let _ = direct.close(200, "done".into()).await;
    let rabbit_text = amqp_text(&refused);
    assert_eq!(amqp_code(&refused), Some(406), "{rabbit_text}");
    // "... inequivalent arg 'x-…' for queue '…' in vhost '/'": the value's rendering may differ.
    let (rabbit_prefix, _) = rabbit_text
        .split_once(": received")
        .unwrap_or_else(|| panic!("RabbitMQ's text: {rabbit_text}"));

    let mut answers = Vec::new();
    for i in 0..2 {
        let (_conn, ch) = open(&fleet, i).await;
        let err = try_declare(&ch, &queue, table(&[]))
            .await
            .expect_err("a declare without the queue's arguments is refused");
        answers.push((i, amqp_code(&err), amqp_text(&err)));
    }
    for (i, code, text) in &answers {
        assert_eq!(*code, Some(406), "proxy {i}: {text}");
        assert!(
            text.starts_with(rabbit_prefix),
            "proxy {i}: {text}\nRabbitMQ: {rabbit_text}"
        );
    }
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

#[tokio::test]
async fn f2_every_reject_through_an_instance_that_was_told_no_dlx_is_dead_lettered() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let ttl = ("x-message-ttl", AMQPValue::LongInt(60_000));
    let (queue, dlx, dlq) = dead_letter_setup(&ch_a, "f2r-q", &[ttl]).await;
    // Proxy B is told the queue has no arguments (refused or not, it must not matter).
    let (b, ch_b) = open(&fleet, 1).await;
    let _ = try_declare(&ch_b, &queue, table(&[])).await;
    let ch_b = b.create_channel().await.unwrap();

    confirm_select(&ch_a).await;
    publish_confirmed(&ch_a, &queue, 10).await;
    for _ in 0..10 {
        let delivery = get(&ch_b, &queue).await;
        delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    assert_upstream_count(&dlq, 10, "10 of 10 rejects dead-lettered").await;
    assert_upstream_count(&queue, 0, "every message settled").await;
    // Passed through B, the rejects come back through the capture queue, which both proxies
    // consume: the DLQ holds them in no particular order.
    let body = take_dead_letter(&dlq, &queue, "rejected").await;
    assert!(
        (0..10).any(|i| body == format!("m{i}")),
        "dead letter {body:?}"
    );
    assert_eq!(
        fleet_dead_lettered(&fleet, &queue, "rejected", 10).await,
        10.0
    );
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

// ------------------------------------------------------------------------------------------
// Finding 3: delivery limits work only on the instance that saw the declare
// ------------------------------------------------------------------------------------------

/// A classic queue with `x-delivery-limit` 2 and a DLX, declared through proxy 0, holding one
/// message "m0". Returns (queue, dlx, dlq).
///
/// The names are short on purpose: an instance that did not see the declare reads the queue's
/// settings back from RabbitMQ's reply texts, which RabbitMQ cuts at 255 bytes; with long
/// queue and dead-letter names that read-back fails and the instance passes requeues through
/// uncounted (a documented limit, docs/semantics.md, lifted by `upstream.management_url`:
/// proxy_upstream_policies.rs tests that).
async fn limited_queue(fleet: &Fleet, prefix: &str) -> (String, String, String) {
    limited_queue_with(fleet, prefix, &[]).await
}

/// [`limited_queue`] with `extra` arguments (a quorum queue: `quorum()`).
async fn limited_queue_with(
    fleet: &Fleet,
    prefix: &str,
    extra: &[(&str, AMQPValue)],
) -> (String, String, String) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let (_a, ch) = open(fleet, 0).await;
    let mut arguments = vec![("x-delivery-limit", AMQPValue::LongInt(2))];
    arguments.extend(extra.iter().cloned());
    let n = N.fetch_add(1, Ordering::Relaxed);
    let queue = format!("{prefix}-{}-{n}", std::process::id());
    let (dlx, dlq) = (format!("{queue}-x"), format!("{queue}-q"));
    declare_dlx(&ch, &dlx, &dlq).await;
    crate::common::dl::declare_durable(&ch, &queue, dead_lettering(&dlx, &dlq, &arguments)).await;
    confirm_select(&ch).await;
    publish_confirmed(&ch, &queue, 1).await;
    (queue, dlx, dlq)
}

/// Gets and requeues the message of `queue` through `channels` in turn until it stops coming
/// (or 10 times); returns how often it was delivered.
async fn requeue_until_gone(channels: &[&Channel], queue: &str) -> usize {
    let mut deliveries = 0;
    while deliveries < 10 {
        let ch = channels[deliveries % channels.len()];
        let Some(delivery) = try_get(ch, queue, Duration::from_secs(3)).await else {
            break;
        };
        deliveries += 1;
        delivery.nack(requeue()).await.unwrap();
    }
    deliveries
}

/// A delivery limit of 2: the third delivery's requeue dead-letters the message.
async fn assert_died_of_the_limit(
    fleet: Fleet,
    deliveries: usize,
    names: (String, String, String),
) {
    let (queue, dlx, dlq) = names;
    assert_eq!(deliveries, 3, "deliveries with x-delivery-limit 2");
    assert_upstream_count(&dlq, 1, "dead-lettered at the limit").await;
    assert_dead_letter(&dlq, "m0", &queue, "delivery_limit").await;
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

#[tokio::test]
async fn f3_requeues_through_alternating_instances_count_against_the_limit() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let names = limited_queue(&fleet, "f3a").await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let (_b, ch_b) = open(&fleet, 1).await;
    let deliveries = requeue_until_gone(&[&ch_a, &ch_b], &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

/// The fleet dead-lettered one message of `queue` as `delivery_limit`, and none came through
/// the capture queue: the instance that handled the last return dead-lettered it itself.
async fn assert_dead_lettered_in_one_hop(fleet: &Fleet, queue: &str) {
    assert_eq!(
        fleet_dead_lettered(fleet, queue, "delivery_limit", 1).await,
        1.0
    );
    let captured = [("outcome", "dead_lettered"), ("vhost", "/")];
    assert_eq!(fleet.counter_sum("captured_total", &captured).await, 0.0);
}

/// A quorum queue counts the returns itself; whichever instance handles the requeue RabbitMQ
/// would dead-letter on return dead-letters it in one hop (none goes through the capture).
#[tokio::test]
async fn f3_quorum_requeues_through_alternating_instances_die_at_the_limit_in_one_hop() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let names = limited_queue_with(&fleet, "f3q", &[quorum()]).await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let (_b, ch_b) = open(&fleet, 1).await;
    let deliveries = requeue_until_gone(&[&ch_a, &ch_b], &names.0).await;
    assert_dead_lettered_in_one_hop(&fleet, &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

#[tokio::test]
async fn f3_an_instance_that_did_not_see_the_declare_applies_the_limit() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let names = limited_queue(&fleet, "f3o").await;
    let (_b, ch_b) = open(&fleet, 1).await;
    let deliveries = requeue_until_gone(&[&ch_b], &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

#[tokio::test]
async fn f3_the_limit_survives_a_restart_of_the_instance_that_saw_the_declare() {
    let _steady = cluster().steady().await;
    let mut fleet = Fleet::in_front_of_cluster(1, &[], "").await;
    let names = limited_queue(&fleet, "f3r").await;
    fleet.proxy_mut(0).kill();
    fleet.proxy_mut(0).restart().await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let deliveries = requeue_until_gone(&[&ch_a], &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

// ------------------------------------------------------------------------------------------
// Finding 4: a consumer that dies holding the message is never counted
// ------------------------------------------------------------------------------------------

/// Consumers through the fleet's proxies in turn take the message of `queue` and crash (the
/// socket closes, nothing is settled) until it stops coming (or 10 times); returns how often
/// it was delivered.
async fn crash_until_gone(fleet: &Fleet, queue: &str) -> usize {
    let mut deliveries = 0;
    while deliveries < 10 {
        let proxy = fleet.proxy(deliveries % fleet.proxies.len());
        let mut client = RawClient::connect(proxy.amqp).await;
        client.open_channel(1).await;
        client.consume(1, queue, false).await;
        let delivered = tokio::time::timeout(Duration::from_secs(3), client.next_delivery()).await;
        drop(client);
        match delivered {
            Ok(delivery) => assert_eq!(delivery.body, b"m0"),
            Err(_) => break,
        }
        deliveries += 1;
    }
    deliveries
}

#[tokio::test]
async fn f4_consumers_that_die_holding_the_message_count_against_the_limit() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let names = limited_queue(&fleet, "f4c").await;
    let deliveries = crash_until_gone(&fleet, &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

/// The same on a quorum queue, which counts the returns itself: the connection that dies
/// holding the delivery RabbitMQ would dead-letter on its return has it dead-lettered by its
/// proxy before the upstream connection closes.
#[tokio::test]
async fn f4_consumers_that_die_holding_a_quorum_message_count_against_its_limit() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let names = limited_queue_with(&fleet, "f4q", &[quorum()]).await;
    let deliveries = crash_until_gone(&fleet, &names.0).await;
    assert_dead_lettered_in_one_hop(&fleet, &names.0).await;
    assert_died_of_the_limit(fleet, deliveries, names).await;
}

#[tokio::test]
async fn f4_consumers_that_die_count_against_a_policy_delivery_limit() {
    let _steady = cluster().steady().await;
    let queue = unique("f4-policy");
    let (dlx, dlq) = (format!("{queue}-dlx"), format!("{queue}-dlq"));
    let limit = crate::proxy_support::policy(
        "f4-limit",
        &format!("^{queue}$"),
        serde_json::json!({
            "delivery-limit": 2,
            "dead-letter-exchange": dlx,
            "dead-letter-routing-key": dlq,
        }),
    );
    let fleet = Fleet::in_front_of_cluster(2, &[limit], "").await;
    let (_a, ch) = open(&fleet, 0).await;
    declare_dlx(&ch, &dlx, &dlq).await;
    crate::common::dl::declare(&ch, &queue, table(&[])).await;
    confirm_select(&ch).await;
    publish_confirmed(&ch, &queue, 1).await;
    let deliveries = crash_until_gone(&fleet, &queue).await;
    assert_died_of_the_limit(fleet, deliveries, (queue, dlx, dlq)).await;
}

// ------------------------------------------------------------------------------------------
// Finding 5: intermittent silent loss right after the capture was created
// ------------------------------------------------------------------------------------------

// Not reproduced here (0 lost in 10 attempts, twice, also with proxy B connected before the
// capture existed): it runs as a guard, and part 3 (capture) owns the cause.
#[tokio::test]
async fn f5_a_reject_passed_through_right_after_the_capture_was_created_is_never_lost() {
    let _steady = cluster().steady().await;
    const ATTEMPTS: usize = 10;
    let mut lost = Vec::new();
    for attempt in 0..ATTEMPTS {
        // A new fleet each time: a capture exchange and queue created just now.
        let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
        let (_a, ch_a) = open(&fleet, 0).await;
        let (queue, dlx, dlq) = dead_letter_setup(&ch_a, "f5-q", &[]).await;
        confirm_select(&ch_a).await;
        publish_confirmed(&ch_a, &queue, 1).await;
        // Proxy B did not see the declare: it passes the reject through to RabbitMQ.
        let (_b, ch_b) = open(&fleet, 1).await;
        get(&ch_b, &queue)
            .await
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
        let landed = wait_count_at(&direct_uri(), &dlq, 1, Duration::from_secs(10)).await;
        if landed.is_err() {
            lost.push(attempt);
        }
        fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
    }
    assert!(lost.is_empty(), "lost in attempts {lost:?} of {ATTEMPTS}");
}

// ------------------------------------------------------------------------------------------
// Finding 6: a DLQ that refuses a dead letter causes a hot loop
// ------------------------------------------------------------------------------------------

#[tokio::test]
async fn f6_a_dead_letter_the_dlq_refuses_is_held_then_lands_when_the_dlq_drains() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(1, &[], "").await;
    let queue = unique("f6-q");
    let (dlx, dlq) = (format!("{queue}-dlx"), format!("{queue}-dlq"));
    let (_a, ch) = open(&fleet, 0).await;
    crate::common::dl::exchange(&ch, &dlx, lapin::ExchangeKind::Direct).await;
    let full = [
        ("x-max-length", AMQPValue::LongInt(1)),
        ("x-overflow", ls("reject-publish")),
    ];
    crate::common::dl::declare(&ch, &dlq, table(&full)).await;
    crate::common::dl::bind(&ch, &dlq, &dlx, &dlq).await;
    crate::common::dl::declare(&ch, &queue, dead_lettering(&dlx, &dlq, &[])).await;
    confirm_select(&ch).await;
    publish_confirmed(&ch, &dlq, 1).await; // the DLQ is full: "m0" sits in it
    publish_confirmed(&ch, &queue, 1).await;

    // The application rejects the message whenever it gets it.
    let (_c, consumer) = open(&fleet, 0).await;
    let mut deliveries = consume(&consumer, &queue, Default::default()).await;
    let mut delivered = 0;
    let watch = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(Ok(delivery))) = tokio::time::timeout_at(watch, deliveries.recv()).await {
        delivered += 1;
        delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    assert!(
        (1..=5).contains(&delivered),
        "{delivered} deliveries in 3 s while the DLQ refuses (held, not redelivered)"
    );
    assert!(
        fleet
            .proxy(0)
            .counter("dead_letter_publish_failures_total", &[("cause", "nack")])
            .await
            >= 1.0
    );

    // The DLQ drains: the held dead letter lands, once.
    let conn = Connection::connect(&direct_uri(), Default::default())
        .await
        .unwrap();
    let direct = conn.create_channel().await.unwrap();
    get(&direct, &dlq)
        .await
        .ack(Default::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    assert_upstream_count(&dlq, 1, "the held dead letter lands").await;
    assert_dead_letter(&dlq, "m0", &queue, "rejected").await;
    assert_upstream_count(&queue, 0, "the original is settled").await;
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

// ------------------------------------------------------------------------------------------
// Finding 7: dead-lettering waits for application connections
// ------------------------------------------------------------------------------------------

#[tokio::test]
async fn f7_expired_messages_are_dead_lettered_with_no_client_connected() {
    let _steady = cluster().steady().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let (conn, ch) = open(&fleet, 0).await;
    let ttl = ("x-message-ttl", AMQPValue::LongInt(1500));
    let (queue, dlx, dlq) = dead_letter_setup(&ch, "f7-q", &[ttl]).await;
    confirm_select(&ch).await;
    publish_confirmed(&ch, &queue, 5).await;
    conn.close(200, "done".into()).await.unwrap();
    // No application is connected to any proxy while the messages expire.
    assert_upstream_count(&dlq, 5, "5 expired messages dead-lettered").await;
    assert_upstream_count(&queue, 0, "every message expired").await;
    // Both proxies' service connections consume the capture queue: any order.
    let body = take_dead_letter(&dlq, &queue, "expired").await;
    assert!(
        (0..5).any(|i| body == format!("m{i}")),
        "dead letter {body:?}"
    );
    assert_eq!(fleet_dead_lettered(&fleet, &queue, "expired", 5).await, 5.0);
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

// ------------------------------------------------------------------------------------------
// The failure scenarios beyond the findings
// ------------------------------------------------------------------------------------------

/// Waits until RabbitMQ reports at least `count` messages in `queue` (duplicates are allowed:
/// dead-lettering is at least once); returns the count.
async fn wait_at_least(queue: &str, count: u32, what: &str) -> u32 {
    let reached = poll(LAND, Duration::from_millis(200), async || {
        crate::proxy_support::fleet::count_at(&direct_uri(), queue)
            .await
            .filter(|n| *n >= count)
    })
    .await;
    match reached {
        Some(n) => n,
        None => panic!(
            "{what}: {queue} holds {:?} messages, expected at least {count}",
            crate::proxy_support::fleet::count_at(&direct_uri(), queue).await
        ),
    }
}

#[tokio::test]
async fn killing_a_proxy_with_a_capture_backlog_loses_no_dead_letter() {
    let _steady = cluster().steady().await;
    let mut fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    // An application stays connected to proxy B throughout.
    let (_b, _ch_b) = open(&fleet, 1).await;
    let (_a, ch_a) = open(&fleet, 0).await;
    let ttl = ("x-message-ttl", AMQPValue::LongInt(2000));
    let (queue, dlx, dlq) = dead_letter_setup(&ch_a, "backlog-q", &[ttl]).await;
    confirm_select(&ch_a).await;
    publish_confirmed(&ch_a, &queue, 200).await;
    // The messages expire into the capture together; proxy A dies while they are handled.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    fleet.proxy_mut(0).kill();
    let landed = wait_at_least(&dlq, 200, "0 of 200 dead letters lost").await;
    assert_upstream_count(&queue, 0, "every message expired").await;
    assert_upstream_count(&fleet.capture, 0, "the capture backlog is worked off").await;
    assert!(
        landed <= 200 + 64,
        "{landed} dead letters: more than a prefetch duplicated"
    );
    fleet.stop_deleting(&[&queue, &dlq], &[&dlx]).await;
}

/// How long a publish of [`killing_the_node_under_a_proxy_loses_no_confirmed_message`] may
/// keep being refused after the node is killed (measured in 5 runs on a 2-core machine with a
/// load of 6 to 7.5: one or two nacks, then confirmed on a new channel within 0.3 s).
const REFUSED_BUDGET: Duration = Duration::from_secs(30);

/// RabbitMQ (3.10) nacks the publishes of a channel whose first publish to the quorum queue
/// came while the queue's record still named the killed leader (about the first 0.3 to 0.7
/// s): that channel's queue client asks the dead node for the machine version, takes
/// `nodedown` as a refusal and asks it again at every publish, for as long as the channel
/// lives (157 of 157 publishes over 40 s nacked, straight to RabbitMQ as through the proxy,
/// which relays them). A new channel reads the record again: a publisher reopens its channel
/// after a nack and sends the message again there.
#[tokio::test]
async fn killing_the_node_under_a_proxy_loses_no_confirmed_message() {
    let cluster = cluster();
    let mut outage = cluster.exclusive().await;
    // Proxy 0 lists node 0 first: that is the node it uses.
    let fleet = Fleet::in_front_of_cluster(1, &[], "").await;
    let queue = unique("node-loss-q");
    let (_conn, ch) = open(&fleet, 0).await;
    declare_durable(&ch, &queue, table(&[quorum()])).await;
    confirm_select(&ch).await;
    publish_confirmed(&ch, &queue, 50).await;

    outage.kill(0);
    // The client's connection ends; it reconnects through the same proxy at once and goes on.
    let again = poll(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || {
            let conn = lapin::Connection::connect(&fleet.proxy(0).uri(), Default::default())
                .await
                .ok()?;
            let ch = conn.create_channel().await.ok()?;
            Some((conn, ch))
        },
    )
    .await;
    let (again, mut ch) = again.expect("a new connection through the proxy within 10 s");
    confirm_select(&ch).await;
    for i in 50..100 {
        let refused_since = std::time::Instant::now();
        loop {
            let confirm = publish_to(
                &ch,
                "",
                &queue,
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await;
            if confirm.is_ack() {
                break;
            }
            assert!(
                refused_since.elapsed() < REFUSED_BUDGET,
                "publish m{i} still refused after {REFUSED_BUDGET:?}: {confirm:?}"
            );
            let _ = ch.close(200, "nacked".into()).await;
            ch = again.create_channel().await.expect("a new channel");
            confirm_select(&ch).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    outage.restart(0);
    assert_upstream_count(&queue, 100, "0 of 100 confirmed messages lost").await;
    fleet.stop_deleting(&[&queue], &[]).await;
    outage.restore();
}
