//! Capture in a cluster ([`crate::rabbit::cluster`]) behind two `dlx-proxy` processes
//! ([`crate::proxy_support::fleet`]) with `upstream.urls` = every node: the capture queue is a
//! quorum queue, each proxy's service connection fails over to another node when its node
//! dies and subscribes again, and a proxy killed with capture deliveries in hand leaves them to
//! the other. Nothing that died upstream is lost: every message reaches its DLQ with the
//! x-death of its original queue.
//!
//! Source queues are quorum queues:
//! - TTL deaths with `x-dead-letter-strategy = at-least-once` (and `x-overflow =
//!   reject-publish`, which that strategy needs): RabbitMQ dead-letters into the capture
//!   exchange with confirms and retries, so deaths while the capture queue has no leader wait
//!   for the new one;
//! - max-length deaths with `x-overflow = drop-head`: quorum queues do not support
//!   `reject-publish-dlx`, and `reject-publish` refuses the publish instead of dead-lettering,
//!   so drop-head is the one overflow of a quorum queue that dead-letters. RabbitMQ sends those
//!   at-most-once (at-least-once needs reject-publish), so these deaths happen after the
//!   capture queue has a leader again, while the node is still down.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::Channel;

use crate::common::dl::{bind, confirm_select, declare_durable, exchange, int, ls, table, x_death};
use crate::common::{poll, unique};
use crate::fleet_cluster::channel_on;
use crate::proxy_support::fleet::Fleet;
use crate::proxy_support::publish_acked_named;
use crate::rabbit::cluster;

const WAIT: Duration = Duration::from_secs(60);
const EVERY: Duration = Duration::from_millis(200);

/// A direct DLX and its DLQ (durable, with `args`), bound with key `dlq`.
pub(crate) async fn declare_dlq(
    ch: &Channel,
    dlx: &str,
    dlq: &str,
    args: &[(&str, lapin::types::AMQPValue)],
) {
    exchange(ch, dlx, lapin::ExchangeKind::Direct).await;
    declare_durable(ch, dlq, table(args)).await;
    bind(ch, dlq, dlx, dlq).await;
}

/// A quorum source queue dead-lettering to `dlx` with key `dlq`, plus `extra`.
pub(crate) async fn declare_source(
    ch: &Channel,
    queue: &str,
    dlx: &str,
    dlq: &str,
    extra: &[(&str, lapin::types::AMQPValue)],
) {
    let mut args = vec![
        ("x-queue-type", ls("quorum")),
        ("x-dead-letter-exchange", ls(dlx)),
        ("x-dead-letter-routing-key", ls(dlq)),
    ];
    args.extend(extra.iter().cloned());
    declare_durable(ch, queue, table(&args)).await;
}

/// Takes messages from `dlq` until every body of `expected` was seen (acking each), checking
/// each one's newest x-death against `expected[body]` = (queue, reason). Returns how many
/// duplicates came (at-least-once). Panics naming the missing bodies after [`WAIT`].
pub(crate) async fn drain_expecting(
    ch: &Channel,
    dlq: &str,
    expected: &BTreeMap<String, (String, &str)>,
) -> usize {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let started = std::time::Instant::now();
    while seen.len() < expected.len() {
        let got = ch
            .basic_get(dlq.into(), Default::default())
            .await
            .unwrap_or_else(|e| panic!("basic.get {dlq}: {e}"));
        let Some(message) = got else {
            if started.elapsed() > WAIT {
                let missing: Vec<&String> =
                    expected.keys().filter(|b| !seen.contains_key(*b)).collect();
                panic!(
                    "{} of {} dead letters missing from {dlq}: {missing:?}",
                    missing.len(),
                    expected.len()
                );
            }
            tokio::time::sleep(EVERY).await;
            continue;
        };
        let delivery = message.delivery;
        let body = String::from_utf8_lossy(&delivery.data).into_owned();
        let (queue, reason) = expected
            .get(&body)
            .unwrap_or_else(|| panic!("unexpected dead letter {body:?}"));
        let deaths = x_death(&delivery);
        assert_eq!(deaths.len(), 1, "{body}: {deaths:?}");
        assert_eq!(deaths[0].qrc(), (queue.as_str(), *reason, 1), "{body}");
        assert_eq!(deaths[0].exchange, "", "{body}");
        assert_eq!(deaths[0].routing_keys, vec![queue.clone()], "{body}");
        *seen.entry(body).or_default() += 1;
        delivery.ack(Default::default()).await.expect("ack");
    }
    seen.values().map(|n| n - 1).sum()
}

/// The gauge `dlx_proxy_capture_consumers{vhost="/"}` of every proxy reaches 1, and a proxy
/// whose service connection was on the killed node `lost` (proxy i dials node i first)
/// counted a reconnect. A proxy on a surviving node may keep its consumer: RabbitMQ moves a
/// quorum queue's consumers to the new leader without cancelling them.
async fn wait_consumers_back(fleet: &Fleet, lost: usize) {
    for (i, proxy) in fleet.proxies.iter().enumerate() {
        if i == lost {
            proxy
                .wait_counter("service_reconnects_total", &[("vhost", "/")], 1.0)
                .await;
        }
        let back = poll(WAIT, EVERY, async || {
            (proxy.counter("capture_consumers", &[("vhost", "/")]).await == 1.0).then_some(())
        })
        .await;
        assert!(
            back.is_some(),
            "capture consumer not back\n{}",
            proxy.logs()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_capture_leader_node_loses_no_ttl_or_length_death() {
    let cluster = cluster();
    let mut outage = cluster.exclusive().await;
    let fleet = Fleet::in_front_of_cluster(2, &[], "").await;
    let ttl_q = unique("fc-ttl");
    let len_q = unique("fc-len");
    let (dlx, dlq) = (unique("fc-dlx"), unique("fc-dlq"));
    {
        // Declared through the proxy: the upstream queues dead-letter into the capture
        // exchange, tagged with the client's DLX and key.
        let conn = fleet.proxy(0).connect().await;
        let ch = conn.create_channel().await.unwrap();
        // A quorum DLQ, so it survives the node loss.
        declare_dlq(&ch, &dlx, &dlq, &[("x-queue-type", ls("quorum"))]).await;
        declare_source(
            &ch,
            &ttl_q,
            &dlx,
            &dlq,
            &[
                ("x-message-ttl", int(3000)),
                ("x-dead-letter-strategy", ls("at-least-once")),
                ("x-overflow", ls("reject-publish")),
            ],
        )
        .await;
        declare_source(
            &ch,
            &len_q,
            &dlx,
            &dlq,
            &[("x-max-length", int(5)), ("x-overflow", ls("drop-head"))],
        )
        .await;
        let _ = conn.close(200, "done".into()).await;
    }
    let home = poll(WAIT, EVERY, async || {
        cluster.queue_home("/", &fleet.capture)
    })
    .await
    .expect("the capture queue has a leader");
    let survivor = cluster.node((home + 1) % 3);

    // TTL deaths: published now, they expire while the capture leader's node is down. The
    // messages are published straight to a surviving node: the deaths happen upstream
    // whoever published, and a client of the proxy on the killed node would only get its 320.
    let (c, ch) = channel_on(survivor).await;
    confirm_select(&ch).await;
    const TTL_COUNT: usize = 40;
    publish_acked_named(&ch, &ttl_q, "t", TTL_COUNT).await;
    outage.kill(home);

    // The capture queue elects a new leader; the service connections of both proxies lost
    // their node or their consumer and come back on a live node.
    let new_home = poll(WAIT, EVERY, async || {
        cluster
            .queue_home("/", &fleet.capture)
            .filter(|&h| h != home)
    })
    .await;
    assert!(new_home.is_some(), "no new capture leader");
    wait_consumers_back(&fleet, home).await;

    // Max-length deaths (drop-head) with the node still down.
    const LEN_COUNT: usize = 25;
    let (c2, ch2) = channel_on(survivor).await;
    confirm_select(&ch2).await;
    publish_acked_named(&ch2, &len_q, "l", LEN_COUNT).await;

    let mut expected: BTreeMap<String, (String, &str)> = BTreeMap::new();
    for i in 0..TTL_COUNT {
        expected.insert(format!("t{i}"), (ttl_q.clone(), "expired"));
    }
    // The first LEN_COUNT - 5 were dropped from the head.
    for i in 0..LEN_COUNT - 5 {
        expected.insert(format!("l{i}"), (len_q.clone(), "maxlen"));
    }
    let duplicates = drain_expecting(&ch2, &dlq, &expected).await;
    // Every death was dead-lettered by a proxy (counted by reason), none dropped.
    // Counted at each dead letter's confirm, which may come after the DLQ shows it.
    let expired = fleet
        .counter_sum_reaching(
            "dead_lettered_total",
            &[("queue", &ttl_q), ("reason", "expired"), ("vhost", "/")],
            TTL_COUNT as f64,
        )
        .await;
    let maxlen = fleet
        .counter_sum_reaching(
            "dead_lettered_total",
            &[("queue", &len_q), ("reason", "maxlen"), ("vhost", "/")],
            (LEN_COUNT - 5) as f64,
        )
        .await;
    assert!(
        expired >= TTL_COUNT as f64 && maxlen >= (LEN_COUNT - 5) as f64,
        "dead-lettered: expired {expired}, maxlen {maxlen}; duplicates {duplicates}"
    );
    let _ = c.close(200, "done".into()).await;
    let _ = c2.close(200, "done".into()).await;
    outage.restore();
    fleet.stop_deleting(&[&ttl_q, &len_q, &dlq], &[&dlx]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_with_a_capture_backlog_leaves_it_to_the_other() {
    let cluster = cluster();
    let _steady = cluster.steady().await;
    // Short retries, so the drain at the end is quick.
    let mut fleet = Fleet::in_front_of_cluster(
        2,
        &[],
        "[proxy]\nretry_initial_ms = 50\nretry_max_ms = 300\n",
    )
    .await;
    let source = unique("fc-src");
    let (dlx, dlq) = (unique("fc-bdlx"), unique("fc-bdlq"));
    {
        let conn = fleet.proxy(0).connect().await;
        let ch = conn.create_channel().await.unwrap();
        // A DLQ that takes one message at a time (a classic queue: a quorum queue applies
        // its length limit with a delay): the captured dead letters are refused and held by
        // the proxy that took them, unacked in the capture queue.
        declare_dlq(
            &ch,
            &dlx,
            &dlq,
            &[
                ("x-max-length", int(1)),
                ("x-overflow", ls("reject-publish")),
            ],
        )
        .await;
        declare_source(
            &ch,
            &source,
            &dlx,
            &dlq,
            &[
                ("x-message-ttl", int(200)),
                ("x-dead-letter-strategy", ls("at-least-once")),
                ("x-overflow", ls("reject-publish")),
            ],
        )
        .await;
        let _ = conn.close(200, "done".into()).await;
    }
    // Only proxy 0 consumes the capture queue while the backlog builds.
    fleet.proxy_mut(1).kill();
    let (c, ch) = channel_on(cluster.node(0)).await;
    confirm_select(&ch).await;
    const COUNT: usize = 20;
    publish_acked_named(&ch, &source, "b", COUNT).await;
    // One lands in the DLQ, the rest are held by proxy 0.
    let proxy = fleet.proxy(0);
    let held = poll(WAIT, EVERY, async || {
        let held = proxy.counter("dead_letters_held", &[]).await;
        let landed = proxy
            .counter(
                "dead_lettered_total",
                &[("queue", &source), ("reason", "expired"), ("vhost", "/")],
            )
            .await;
        (held >= 1.0 && held + landed == COUNT as f64).then_some(held)
    })
    .await;
    assert!(
        held.is_some(),
        "proxy 0 holds no backlog\n{}",
        proxy.metrics_text().await
    );
    assert!(
        proxy
            .counter("dead_letter_retries_total", &[("reason", "nacked")])
            .await
            >= 1.0
    );

    // SIGKILL: its capture deliveries go back to the capture queue; proxy 1 starts again and
    // takes them.
    fleet.proxy_mut(0).kill();
    fleet.proxy_mut(1).restart().await;
    let mut expected: BTreeMap<String, (String, &str)> = BTreeMap::new();
    for i in 0..COUNT {
        expected.insert(format!("b{i}"), (source.clone(), "expired"));
    }
    let duplicates = drain_expecting(&ch, &dlq, &expected).await;
    let proxy = fleet.proxy(1);
    let held = held.expect("held") as usize;
    let expired = [
        ("queue", source.as_str()),
        ("reason", "expired"),
        ("vhost", "/"),
    ];
    // Counted at each dead letter's confirm, which may come after the DLQ shows it.
    proxy
        .wait_counter("dead_lettered_total", &expired, held as f64)
        .await;
    let confirmed = proxy.counter("dead_lettered_total", &expired).await;
    // Proxy 1 dead-lettered what proxy 0 held (and any duplicates).
    assert!(
        confirmed >= held as f64,
        "proxy 1 dead-lettered {confirmed} of the {held} held; duplicates {duplicates}"
    );
    let _ = c.close(200, "done".into()).await;
    // Proxy 0 stays down; the fleet's cleanup kills what runs.
    fleet.stop_deleting(&[&source, &dlq], &[&dlx]).await;
}
