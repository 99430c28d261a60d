//! Proxy mode, retry tiers (`x-retry-delays`): a rejected message waits out its tier's delay
//! in a proxy-owned delay queue on the upstream and comes back to its queue with
//! `x-retry-count` and its x-death history; past the last tier it is dead-lettered. Seen by
//! lapin clients through the proxy, against the reference RabbitMQ; metrics over HTTP from a
//! `dlx-proxy` process, which is also SIGKILLed while messages wait.

use crate::proxy_support;

use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicRejectOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{Channel, Connection};
use proxy_support::fleet::{ProxyProcess, fleet_toml};
use proxy_support::*;
use tokio::sync::mpsc::UnboundedReceiver;

type Deliveries = UnboundedReceiver<Result<Delivery, lapin::Error>>;

/// How late a message may come back after its delay (quorum-queue expiry, the capture
/// consumer and the confirmed publish back, on a loaded test machine).
const LATE: Duration = Duration::from_millis(1500);

fn delays(ms: &[i64]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        ms.iter()
            .map(|d| AMQPValue::LongLongInt(*d))
            .collect::<Vec<_>>(),
    ))
}

/// A queue with retry tiers `ms` dead-lettering into a DLQ through a direct DLX. Returns
/// (queue, dlx, dlq).
async fn tiered(ch: &Channel, ms: &[i64]) -> (String, String, String) {
    tiered_named(ch, unique("tiered"), unique("tiered-dlq"), ms).await
}

async fn tiered_named(
    ch: &Channel,
    q: String,
    dlq: String,
    ms: &[i64],
) -> (String, String, String) {
    let extra = [("x-retry-delays", delays(ms))];
    let dlx = crate::common::dl::declare_dead_letter_queues(ch, &q, &dlq, &extra).await;
    (q, dlx, dlq)
}

/// A proxy, a client connection and channel through it, and a [`tiered`] queue.
struct Setup {
    proxy: TestProxy,
    conn: Connection,
    ch: Channel,
    q: String,
    dlx: String,
    dlq: String,
    ms: Vec<i64>,
}

async fn setup(ms: &[i64]) -> Setup {
    setup_named(unique("tiered"), unique("tiered-dlq"), ms).await
}

async fn setup_named(q: String, dlq: String, ms: &[i64]) -> Setup {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = tiered_named(&ch, q, dlq, ms).await;
    Setup {
        proxy,
        conn,
        ch,
        q,
        dlx,
        dlq,
        ms: ms.to_vec(),
    }
}

impl Setup {
    /// Deletes the queues, the DLX, the capture objects and the delay queues.
    async fn finish(self, more: &[&str]) {
        let ch = self.conn.create_channel().await.unwrap();
        let mut queues = vec![self.q.as_str(), self.dlq.as_str()];
        queues.extend_from_slice(more);
        delete_upstream(&ch, &queues, &[&self.dlx]).await;
        let capture = self.proxy.capture.clone();
        self.proxy.stop().await;
        delete_delay_queues(&capture, &self.ms).await;
    }
}

async fn reject(d: &Delivery) {
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
}

fn manual() -> BasicConsumeOptions {
    BasicConsumeOptions::default()
}

/// Rejects `d`, waits for its return on `rx` and checks it came back after `delay` (within
/// [`LATE`]).
async fn reject_and_wait(d: &Delivery, rx: &mut Deliveries, delay: u64) -> Delivery {
    let start = Instant::now();
    reject(d).await;
    let back = next(rx).await;
    let took = start.elapsed();
    let delay = Duration::from_millis(delay);
    assert!(
        took >= delay && took <= delay + LATE,
        "came back after {took:?}, the delay is {delay:?}"
    );
    back
}

fn retry_count(d: &Delivery) -> Option<AMQPValue> {
    header(d, "x-retry-count").cloned()
}

/// The message's history is one entry {queue, rejected, count}: nothing of a delay queue and
/// no private header.
fn rejected_history(d: &Delivery, queue: &str, count: i64) {
    let deaths = x_death(d);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(field(&deaths[0], "queue"), &ls(queue));
    assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
    assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(count));
    assert_eq!(header(d, "x-dlx-proxy-retry-queue"), None);
}

/// Gets and acks `count` messages of `queue`, each back from its first tier; their bodies.
async fn take_returned(ch: &Channel, queue: &str, count: usize) -> Vec<String> {
    let mut bodies = Vec::new();
    for _ in 0..count {
        let d = get(ch, queue).await;
        assert_eq!(retry_count(&d), Some(AMQPValue::LongLongInt(1)));
        rejected_history(&d, queue, 1);
        bodies.push(payload(&d));
        d.acker.ack(Default::default()).await.unwrap();
    }
    bodies
}

/// Deletes the delay queues of `capture` for `ms` on the upstream.
async fn delete_delay_queues(capture: &str, ms: &[i64]) {
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    for d in ms {
        let _ = ch
            .queue_delete(
                format!("{capture}.retry.{d}").as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await;
    }
    let _ = upstream.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rejection_waits_its_tier_then_the_last_dead_letters_with_full_history() {
    let setup = setup(&[300, 900]).await;
    let Setup {
        proxy,
        ch,
        q,
        dlx,
        dlq,
        ..
    } = &setup;
    crate::common::dl::publish(ch, q, &["job"]).await;
    let mut rx = consume(ch, q, manual()).await;
    let first = next(&mut rx).await;
    assert_eq!(retry_count(&first), None);

    let second = reject_and_wait(&first, &mut rx, 300).await;
    assert_eq!(payload(&second), "job");
    assert_eq!(retry_count(&second), Some(AMQPValue::LongLongInt(1)));
    rejected_history(&second, q, 1);
    // Back through the default exchange, as embedded mode puts it back.
    assert_eq!(second.exchange.as_str(), "");
    assert_eq!(second.routing_key.as_str(), q);

    let third = reject_and_wait(&second, &mut rx, 900).await;
    assert_eq!(retry_count(&third), Some(AMQPValue::LongLongInt(2)));
    rejected_history(&third, q, 2);

    // Past the last tier: dead-lettered, with every rejection counted.
    reject(&third).await;
    let dead = get(ch, dlq).await;
    assert_eq!(payload(&dead), "job");
    assert_eq!(dead.exchange.as_str(), dlx);
    rejected_history(&dead, q, 3);
    assert_eq!(retry_count(&dead), Some(AMQPValue::LongLongInt(2)));

    proxy.wait_dead_lettered(q, "rejected", 1.0).await;
    let labels = |tier| [("queue", q.as_str()), ("tier", tier), ("vhost", "/")];
    assert_eq!(proxy.counter("retries_total", &labels("1")), 1.0);
    assert_eq!(proxy.counter("retries_total", &labels("2")), 1.0);
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    assert_eq!(proxy.counter("retry_exhausted_total", &queue), 1.0);
    proxy.wait_gauge("retry_held_messages", &queue, 0.0).await;
    setup.finish(&[]).await;
}

/// A queue deleted while its rejected message waits for its tier: the message cannot go back
/// and is counted as dropped for that cause, not as returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_queue_was_deleted_meanwhile_is_counted_as_dropped() {
    let setup = setup(&[1000]).await;
    let Setup { proxy, ch, q, .. } = &setup;
    crate::common::dl::publish(ch, q, &["orphan"]).await;
    let mut rx = consume(ch, q, manual()).await;
    reject(&next(&mut rx).await).await;
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    proxy.wait_gauge("retry_held_messages", &queue, 1.0).await;
    drop(rx);
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    uch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let dropped = [
        ("cause", "queue_deleted"),
        ("queue", q.as_str()),
        ("vhost", "/"),
    ];
    proxy
        .wait_counter("dead_letter_dropped_total", &dropped, 1.0)
        .await;
    proxy.wait_gauge("retry_held_messages", &queue, 0.0).await;
    let outcome = |o| [("outcome", o), ("vhost", "/")];
    assert_eq!(proxy.counter("captured_total", &outcome("returned")), 0.0);
    assert_eq!(proxy.counter("captured_total", &outcome("dropped")), 1.0);
    let _ = upstream.close(200, "done".into()).await;
    setup.finish(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_come_back_in_deadline_order_whatever_their_delays() {
    let setup = setup(&[200, 2500]).await;
    let Setup { ch, q, .. } = &setup;
    crate::common::dl::publish(ch, q, &["slow"]).await;
    let mut rx = consume(ch, q, manual()).await;
    let slow = next(&mut rx).await;
    let slow = reject_and_wait(&slow, &mut rx, 200).await;
    // "slow" now waits 2.5 s (its second tier); "fast", rejected after it, waits 200 ms.
    reject(&slow).await;
    let slow_rejected = Instant::now();
    crate::common::dl::publish(ch, q, &["fast"]).await;
    let fast = next(&mut rx).await;
    assert_eq!(payload(&fast), "fast");
    reject(&fast).await;
    let first_back = next(&mut rx).await;
    assert_eq!(payload(&first_back), "fast", "no head-of-line blocking");
    assert_eq!(retry_count(&first_back), Some(AMQPValue::LongLongInt(1)));
    assert!(slow_rejected.elapsed() < Duration::from_millis(2500));
    let second_back = next(&mut rx).await;
    assert_eq!(payload(&second_back), "slow");
    assert_eq!(retry_count(&second_back), Some(AMQPValue::LongLongInt(2)));
    assert!(slow_rejected.elapsed() >= Duration::from_millis(2500));
    for d in [&first_back, &second_back] {
        d.acker.ack(Default::default()).await.unwrap();
    }
    setup.finish(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_declared_through_one_instance_retries_the_same_through_another() {
    let setup = setup_named(short_unique("rq"), short_unique("rd"), &[300]).await;
    let Setup {
        proxy: a,
        ch: ch_a,
        q,
        dlq,
        ..
    } = &setup;
    let b = TestProxy::instance_of(a, vec![]).await;
    crate::common::dl::publish(ch_a, q, &["job"]).await;

    // B never saw the declare: it reads the tiers back from the upstream queue.
    let conn_b = b.connect().await;
    let ch_b = conn_b.create_channel().await.unwrap();
    let mut rx = consume(&ch_b, q, manual()).await;
    let first = next(&mut rx).await;
    let back = reject_and_wait(&first, &mut rx, 300).await;
    assert_eq!(retry_count(&back), Some(AMQPValue::LongLongInt(1)));
    rejected_history(&back, q, 1);
    reject(&back).await;
    let dead = get(&ch_b, dlq).await;
    rejected_history(&dead, q, 2);
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    // B took the rejections over itself (it read the tiers back; none reached the capture
    // queue of the deployment).
    let exhausted = |p: &TestProxy| p.counter("retry_exhausted_total", &queue);
    assert_eq!((exhausted(a), exhausted(&b)), (0.0, 1.0));
    let tier = [("queue", q.as_str()), ("tier", "1"), ("vhost", "/")];
    assert_eq!(b.counter("retries_total", &tier), 1.0);

    // A redeclare with other tiers is refused by the other instance. (A queue without
    // dead-letter arguments: with them, RabbitMQ's refusal text, which quotes both tags, is
    // cut at 255 bytes and given to the client as it is.)
    let bare = unique("tiered-bare");
    declare(ch_a, &bare, table(&[("x-retry-delays", delays(&[300]))])).await;
    let ch = conn_b.create_channel().await.unwrap();
    let other = table(&[("x-retry-delays", delays(&[300, 600]))]);
    let err = crate::common::dl::try_declare(&ch, &bare, other)
        .await
        .expect_err("other tiers");
    assert_eq!(crate::common::dl::amqp_code(&err), Some(406));
    assert_eq!(
        crate::common::dl::amqp_text(&err),
        format!(
            "PRECONDITION_FAILED - inequivalent arg 'x-retry-delays' for queue '{bare}' in vhost \
             '/': received '[{{long,300}},{{long,600}}]' but current is '[{{long,300}}]'"
        )
    );
    let ch = conn_b.create_channel().await.unwrap();
    let err = crate::common::dl::try_declare(&ch, &bare, FieldTable::default())
        .await
        .expect_err("no tiers");
    assert_eq!(
        crate::common::dl::amqp_text(&err),
        format!(
            "PRECONDITION_FAILED - inequivalent arg 'x-retry-delays' for queue '{bare}' in vhost \
             '/': received none but current is '[{{long,300}}]'"
        )
    );
    // The same tiers are equivalent.
    let ch = conn_b.create_channel().await.unwrap();
    declare(&ch, &bare, table(&[("x-retry-delays", delays(&[300]))])).await;
    b.stop_instance();
    setup.finish(&[&bare]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_held_when_the_proxy_is_killed_come_back_through_its_restart() {
    let capture = unique("retry-capture");
    let mut proxy = ProxyProcess::spawn(&fleet_toml(&[upstream_uri()], &[], &capture, "")).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (q, dlx, dlq) = tiered(&ch, &[1500]).await;
    crate::common::dl::publish(&ch, &q, &["a", "b", "c"]).await;
    let mut rx = consume(&ch, &q, manual()).await;
    for _ in 0..3 {
        reject(&next(&mut rx).await).await;
    }
    let tier = [("queue", q.as_str()), ("tier", "1"), ("vhost", "/")];
    proxy.wait_counter("retries_total", &tier, 3.0).await;
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    proxy.wait_gauge("retry_held_messages", &queue, 3.0).await;

    // Killed while they wait; their delay passes with no proxy running.
    proxy.kill();
    drop(rx);
    let upstream = upstream_connection().await;
    let up = upstream.create_channel().await.unwrap();
    assert_eq!(message_count(&up, &q).await, 0);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(
        message_count(&up, &q).await,
        0,
        "nothing returns without a proxy"
    );

    proxy.restart().await;
    wait_count(&up, &q, 3).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let bodies = take_returned(&ch, &q, 3).await;
    assert_eq!(bodies, ["a", "b", "c"]);
    // Counted at the confirm of each return, which may come after the queue shows it.
    let returned = [("outcome", "returned"), ("vhost", "/")];
    proxy.wait_counter("captured_total", &returned, 3.0).await;
    assert_eq!(proxy.counter("captured_total", &returned).await, 3.0);
    proxy.kill();
    let delay_queue = format!("{capture}.retry.1500");
    delete_upstream(&up, &[&q, &dlq, &capture, &delay_queue], &[&dlx, &capture]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_no_proxy_saw_takes_its_tier_through_the_capture_queue() {
    let setup = setup(&[300]).await;
    let Setup { proxy, q, dlq, .. } = &setup;
    // Consumed and rejected straight on RabbitMQ: the upstream dead-letters it into the
    // capture queue, and the proxy's service connection holds it for its tier.
    let upstream = upstream_connection().await;
    let up = upstream.create_channel().await.unwrap();
    crate::common::dl::publish(&up, q, &["job"]).await;
    let mut rx = consume(&up, q, manual()).await;
    let first = next(&mut rx).await;
    let back = reject_and_wait(&first, &mut rx, 300).await;
    assert_eq!(retry_count(&back), Some(AMQPValue::LongLongInt(1)));
    rejected_history(&back, q, 1);
    reject(&back).await;
    let dead = get(&up, dlq).await;
    rejected_history(&dead, q, 2);
    let held = [("outcome", "held"), ("vhost", "/")];
    assert_eq!(proxy.counter("captured_total", &held), 1.0);
    let returned = [("outcome", "returned"), ("vhost", "/")];
    assert_eq!(proxy.counter("captured_total", &returned), 1.0);
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    assert_eq!(proxy.counter("retry_exhausted_total", &queue), 1.0);
    let _ = upstream.close(200, "done".into()).await;
    setup.finish(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_messages_survive_the_loss_of_their_delay_queue_leaders_node() {
    const WAIT: Duration = Duration::from_secs(60);
    let cluster = crate::rabbit::cluster();
    let mut outage = cluster.exclusive().await;
    let fleet = proxy_support::fleet::Fleet::in_front_of_cluster(2, &[], "").await;
    let q = unique("tiered-cluster");
    let delay_queue = format!("{}.retry.6000", fleet.capture);
    {
        let conn = fleet.proxy(0).connect().await;
        let ch = conn.create_channel().await.unwrap();
        let args = [
            ("x-queue-type", ls("quorum")),
            ("x-retry-delays", delays(&[6000])),
        ];
        crate::common::dl::declare_durable(&ch, &q, table(&args)).await;
        crate::common::dl::publish(&ch, &q, &["a", "b", "c"]).await;
        let mut rx = consume(&ch, &q, manual()).await;
        for _ in 0..3 {
            reject(&next(&mut rx).await).await;
        }
        let tier = [("queue", q.as_str()), ("tier", "1"), ("vhost", "/")];
        fleet
            .proxy(0)
            .wait_counter("retries_total", &tier, 3.0)
            .await;
        let _ = conn.close(200, "done".into()).await;
    }
    // The node leading the delay queue goes while the messages wait in it.
    let home = crate::common::poll(WAIT, Duration::from_millis(200), async || {
        cluster.queue_home("/", &delay_queue)
    })
    .await
    .expect("the delay queue has a leader");
    let waiting = proxy_support::fleet::count_at(&cluster.node(home).uri(), &delay_queue).await;
    assert_eq!(waiting, Some(3), "the messages wait when the node goes");
    outage.kill(home);
    let survivor = cluster.node((home + 1) % 3);
    if let Err(last) = proxy_support::fleet::wait_count_at(&survivor.uri(), &q, 3, WAIT).await {
        panic!("{q} holds {last:?} messages after the node loss, expected 3");
    }
    let (conn, ch) = crate::fleet_cluster::channel_on(survivor).await;
    let mut bodies = take_returned(&ch, &q, 3).await;
    bodies.sort();
    assert_eq!(bodies, ["a", "b", "c"]);
    let _ = conn.close(200, "done".into()).await;
    outage.restore();
    fleet.stop_deleting(&[&q, &delay_queue], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policys_tiers_apply_to_a_queue_declared_without_them() {
    let tiers = policy(
        "tiers",
        "^t-ptiered",
        serde_json::json!({"retry-delays": [300]}),
    );
    let proxy = TestProxy::start(vec![tiers]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ptiered");
    declare(&ch, &q, FieldTable::default()).await;
    crate::common::dl::publish(&ch, &q, &["job"]).await;
    let mut rx = consume(&ch, &q, manual()).await;
    let first = next(&mut rx).await;
    let back = reject_and_wait(&first, &mut rx, 300).await;
    assert_eq!(retry_count(&back), Some(AMQPValue::LongLongInt(1)));
    rejected_history(&back, &q, 1);
    // Past the last tier, without a dead-letter exchange: discarded, as RabbitMQ does.
    reject(&back).await;
    let queue = [("queue", q.as_str()), ("vhost", "/")];
    proxy
        .wait_counter("retry_exhausted_total", &queue, 1.0)
        .await;
    wait_upstream_empty(&q).await;
    let capture = proxy.capture.clone();
    delete_upstream(&ch, &[&q], &[]).await;
    proxy.stop().await;
    delete_delay_queues(&capture, &[300]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_its_full_queue_refuses_back_ends_as_a_publish_to_it_would() {
    for overflow in ["reject-publish-dlx", "reject-publish"] {
        let proxy = TestProxy::start(vec![]).await;
        let conn = proxy.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let q = unique("full-retry");
        let dlq = unique("full-retry-dlq");
        let extra = [
            ("x-retry-delays", delays(&[300])),
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", ls(overflow)),
        ];
        let dlx = crate::common::dl::declare_dead_letter_queues(&ch, &q, &dlq, &extra).await;
        crate::common::dl::publish(&ch, &q, &["returning"]).await;
        reject(&get(&ch, &q).await).await;
        // While it waits out its delay, the queue fills up.
        crate::common::dl::publish(&ch, &q, &["filler"]).await;
        // reject-publish drops the refused return (counted); reject-publish-dlx
        // dead-letters it once, and no copy comes per retry.
        let copies = u32::from(overflow == "reject-publish-dlx");
        let dropped = [
            ("cause", "target_full"),
            ("queue", q.as_str()),
            ("vhost", "/"),
        ];
        let queue = [("queue", q.as_str()), ("vhost", "/")];
        proxy.wait_gauge("retry_held_messages", &queue, 0.0).await;
        wait_count(&ch, &dlq, copies).await;
        let drops = f64::from(1 - copies);
        proxy
            .wait_counter("dead_letter_dropped_total", &dropped, drops)
            .await;
        proxy
            .stays(
                "dead_letter_dropped_total",
                &dropped,
                drops,
                Duration::from_secs(3),
            )
            .await;
        assert_eq!(message_count(&ch, &dlq).await, copies, "{overflow}");
        assert_eq!(message_count(&ch, &q).await, 1, "{overflow}");
        if copies == 1 {
            let dead = get(&ch, &dlq).await;
            assert_eq!(payload(&dead), "returning");
            assert_eq!(field(&x_death(&dead)[0], "reason"), &ls("maxlen"));
        }
        delete_upstream(&ch, &[q.as_str(), dlq.as_str()], &[dlx.as_str()]).await;
        let capture = proxy.capture.clone();
        proxy.stop().await;
        delete_delay_queues(&capture, &[300]).await;
    }
}
