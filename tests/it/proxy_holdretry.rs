//! Proxy mode, refused dead letters: a dead letter the target refuses (a DLQ at its length
//! limit with `reject-publish` nacks the proxy's publish) is held, not redelivered: the
//! original stays unacked upstream while the proxy retries the publish with backoff, and it
//! lands (and the original is acked) once the DLQ has room. Rejections and captured deaths
//! (TTL expiry) alike; a client whose connection or channel goes away meanwhile gets its
//! original back in the queue.

use crate::proxy_support;

use std::time::Duration;

use crate::common::dl::{amqp_code, amqp_text, try_declare};
use crate::proxy_faults::Relay;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use proxy_support::*;

/// How long the tests watch for redeliveries and retries.
const WATCH: Duration = Duration::from_secs(3);

/// The retries a held dead letter may take in [`WATCH`] (100 ms doubling: about 6).
const HANDFUL: f64 = 10.0;

/// A DLQ that holds one message and refuses more (`reject-publish`), already full, and a
/// source queue dead-lettering into it through the default exchange (`extra`: more source
/// arguments). Returns (source, dlq).
async fn full_dlq_topology(conn: &Connection, extra: &[(&str, AMQPValue)]) -> (String, String) {
    let ch = conn.create_channel().await.unwrap();
    let dlq = unique("held-dlq");
    declare(
        &ch,
        &dlq,
        table(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", ls("reject-publish")),
        ]),
    )
    .await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm =
        crate::common::dl::publish_to(&ch, "", &dlq, b"filler", BasicProperties::default()).await;
    assert!(confirm.is_ack(), "filler: {confirm:?}");
    let q = unique("held-src");
    let mut args = vec![
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls(&dlq)),
    ];
    args.extend(extra.iter().cloned());
    declare(&ch, &q, table(&args)).await;
    (q, dlq)
}

/// A proxy, a client connection and channel that got "m" from the source queue and rejected
/// it; its dead letter is held (the DLQ is full). Returns (proxy, connection, channel, source,
/// dlq).
async fn rejected_and_held() -> (TestProxy, Connection, Channel, String, String) {
    held_behind(TestProxy::start(vec![]).await).await
}

/// [`rejected_and_held`] through `proxy`.
async fn held_behind(proxy: TestProxy) -> (TestProxy, Connection, Channel, String, String) {
    let conn = proxy.connect().await;
    let (q, dlq) = full_dlq_topology(&conn, &[]).await;
    let ch = conn.create_channel().await.unwrap();
    reject_and_hold(&proxy, &ch, &q, "m").await;
    (proxy, conn, ch, q, dlq)
}

/// Publishes `body` to `queue`, gets and rejects it, and waits until its dead letter is held.
async fn reject_and_hold(proxy: &TestProxy, ch: &Channel, queue: &str, body: &str) {
    crate::common::dl::publish(ch, queue, &[body]).await;
    get(ch, queue)
        .await
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    wait_held(proxy, 1.0).await;
}

/// A consumer's receiving end.
type Deliveries =
    tokio::sync::mpsc::UnboundedReceiver<Result<lapin::message::Delivery, lapin::Error>>;

/// Through `conn`: [`full_dlq_topology`], `body` published to the source queue, a consumer
/// (no prefetch limit) that gets it and rejects it, and its dead letter held. Returns (source,
/// dlq, the consumer's channel, the consumer).
async fn consumed_and_held(
    proxy: &TestProxy,
    conn: &Connection,
    body: &str,
) -> (String, String, Channel, Deliveries) {
    let (q, dlq) = full_dlq_topology(conn, &[]).await;
    let ch = conn.create_channel().await.unwrap();
    crate::common::dl::publish(&ch, &q, &[body]).await;
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let first = next(&mut rx).await;
    assert_eq!(payload(&first), body);
    first
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    wait_held(proxy, 1.0).await;
    (q, dlq, ch, rx)
}

fn held(proxy: &TestProxy) -> f64 {
    proxy.counter("dead_letters_held", &[])
}

fn retries(proxy: &TestProxy) -> f64 {
    proxy.counter("dead_letter_retries_total", &[("reason", "nacked")])
}

/// Polls until `retries(proxy)` and the counter `name{labels}`, which move together while
/// retries go on, read the same on both sides of one read of it (panics after 5 s); returns
/// the value.
async fn settled_equal(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    let equal = crate::common::poll(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || {
            let before = retries(proxy);
            let other = proxy.counter(name, labels);
            (before == other && retries(proxy) == before).then_some(other)
        },
    )
    .await;
    match equal {
        Some(value) => value,
        None => panic!(
            "{name}{labels:?} is {}, dead_letter_retries_total is {}",
            proxy.counter(name, labels),
            retries(proxy)
        ),
    }
}

/// Polls until the held gauge shows `value` (panics after 15 s).
async fn wait_held(proxy: &TestProxy, value: f64) {
    let reached = crate::common::poll(
        Duration::from_secs(15),
        Duration::from_millis(50),
        async || (held(proxy) == value).then_some(()),
    )
    .await;
    assert!(
        reached.is_some(),
        "dead_letters_held is {}, expected {value}\n{}",
        held(proxy),
        proxy.metrics.encode()
    );
}

/// Watches for [`WATCH`]: the dead letter stays held, is retried only a handful of times, and
/// nothing is delivered to `rx` again.
async fn stays_held(proxy: &TestProxy, rx: Option<&mut Deliveries>) {
    let before = retries(proxy);
    match rx {
        Some(rx) => {
            if let Ok(got) = tokio::time::timeout(WATCH, rx.recv()).await {
                panic!("delivered again while held: {got:?}");
            }
        }
        None => tokio::time::sleep(WATCH).await,
    }
    let during = retries(proxy) - before;
    assert!(during >= 1.0, "no retry in {WATCH:?}");
    assert!(
        during <= HANDFUL,
        "{during} retries in {WATCH:?}: a hot loop"
    );
    assert_eq!(held(proxy), 1.0);
    // Each nack counted as a failure and a retry (two counters: read between retries).
    settled_equal(
        proxy,
        "dead_letter_publish_failures_total",
        &[("cause", "nack")],
    )
    .await;
}

async fn purge(ch: &Channel, queue: &str) {
    ch.queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .unwrap();
}

/// The dead letter that landed once the DLQ had room: its body and its one x-death entry.
async fn landed(ch: &Channel, dlq: &str, body: &str, queue: &str, reason: &str) {
    wait_count(ch, dlq, 1).await;
    let dead = get(ch, dlq).await;
    assert_eq!(payload(&dead), body);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(field(&deaths[0], "queue"), &ls(queue));
    assert_eq!(field(&deaths[0], "reason"), &ls(reason));
    assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(header(&dead, "x-first-death-reason"), Some(&ls(reason)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_message_refused_by_a_full_dlq_is_held_until_it_has_room() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let (q, dlq, ch, mut rx) = consumed_and_held(&proxy, &conn, "m").await;
    // Held: not redelivered, retried a handful of times, the original unacked upstream.
    stays_held(&proxy, Some(&mut rx)).await;
    // A channel that only nacks is recycled after every third nack in a row (RabbitMQ 3.10
    // can leave a channel nacking for good after a node loss); the retries go on across the
    // new channels.
    let nacks = proxy.counter("dead_letter_publish_failures_total", &[("cause", "nack")]);
    assert!(nacks >= 3.0, "{nacks} nacks in {WATCH:?}");
    let reopens = proxy.counter("publisher_channel_reopens_total", &[("cause", "nacks")]);
    assert!(
        reopens >= (nacks / 3.0).floor() - 1.0 && reopens <= (nacks / 3.0).floor(),
        "{reopens} reopens after {nacks} nacks"
    );
    assert_eq!(
        proxy.counter("publisher_channel_reopens_total", &[("cause", "closed")]),
        0.0
    );
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    assert_eq!(message_count(&uch, &q).await, 0);
    assert_eq!(message_count(&uch, &dlq).await, 1);
    assert!(
        proxy.counter("inflight_deliveries", &[]) >= 1.0,
        "a held dead letter counts as in flight"
    );

    // The DLQ drains: the dead letter lands with its x-death, the original is acked.
    purge(&uch, &dlq).await;
    landed(&uch, &dlq, "m", &q, "rejected").await;
    wait_held(&proxy, 0.0).await;
    // Counted at the confirm, just after the held gauge drops.
    proxy.wait_dead_lettered(&q, "rejected", 1.0).await;
    // Acked, not merely unacked: closing the consumer's channel brings nothing back.
    ch.close(200, "done".into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(message_count(&uch, &q).await, 0);
    proxy.wait_gauge("inflight_deliveries", &[], 0.0).await;
    delete_upstream(&uch, &[&q, &dlq], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_message_refused_by_a_full_dlq_is_held_until_it_has_room() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let (q, dlq) = full_dlq_topology(&conn, &[("x-message-ttl", AMQPValue::LongInt(1))]).await;
    let ch = conn.create_channel().await.unwrap();
    crate::common::dl::publish(&ch, &q, &["t"]).await;
    // The upstream expires it into the capture queue; the vhost's service connection takes
    // it and its publish to the full DLQ is nacked: held, retried with backoff.
    wait_held(&proxy, 1.0).await;
    stays_held(&proxy, None).await;
    // Refused on the service connection: each refusal counted as a captured message held
    // for another publish, none given back.
    let retried = settled_equal(
        &proxy,
        "captured_total",
        &[("outcome", "retried"), ("vhost", "/")],
    )
    .await;
    assert!(retried >= 1.0, "{retried}");
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    assert_eq!(message_count(&uch, &q).await, 0);
    assert_eq!(message_count(&uch, &dlq).await, 1);
    // Held unacked by the service connection, not requeued to the capture queue.
    assert_eq!(message_count(&uch, &proxy.capture).await, 0);

    purge(&uch, &dlq).await;
    landed(&uch, &dlq, "t", &q, "expired").await;
    wait_held(&proxy, 0.0).await;
    // The capture delivery was acked: nothing comes back when the client connection goes.
    conn.close(200, "done".into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(message_count(&uch, &proxy.capture).await, 0);
    assert_eq!(message_count(&uch, &dlq).await, 0);
    delete_upstream(&uch, &[&q, &dlq], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_its_dead_letter_is_held_gets_the_original_requeued() {
    let (proxy, conn, _ch, q, dlq) = rejected_and_held().await;
    conn.close(200, "bye".into()).await.unwrap();

    // Nothing lost: the upstream requeued the original, which the proxy never acked.
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    wait_count(&uch, &q, 1).await;
    wait_held(&proxy, 0.0).await;
    // Reported when the client session ends, after the held gauge drops.
    proxy.wait_gauge("inflight_deliveries", &[], 0.0).await;
    let back = get(&uch, &q).await;
    assert_eq!(payload(&back), "m");
    assert!(back.redelivered);
    let filler = get(&uch, &dlq).await;
    assert_eq!(payload(&filler), "filler");
    delete_upstream(&uch, &[&q, &dlq], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_channel_of_a_held_dead_letter_requeues_the_original() {
    let (proxy, conn, ch, q, dlq) = rejected_and_held().await;
    // The close is answered at once (it does not wait for the DLQ to drain).
    tokio::time::timeout(Duration::from_secs(2), ch.close(200, "done".into()))
        .await
        .expect("channel.close answered while a dead letter is held")
        .unwrap();
    wait_held(&proxy, 0.0).await;
    let other = conn.create_channel().await.unwrap();
    wait_count(&other, &q, 1).await;
    let back = get(&other, &q).await;
    assert_eq!(payload(&back), "m");
    assert!(back.redelivered);
    assert_eq!(message_count(&other, &dlq).await, 1);
    delete_upstream(&other, &[&q, &dlq], &[]).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_lost_while_a_dead_letter_is_held_requeues_the_original() {
    let relay = Relay::start("127.0.0.1:0", upstream_host()).await;
    let relay_addr = relay.addr;
    let proxy = TestProxy::start_with(vec![], |config| {
        config.upstream.url = format!("amqp://{relay_addr}");
    })
    .await;
    let (proxy, _conn, ch, q, dlq) = held_behind(proxy).await;
    relay.cut();
    // The client is told (320) and the hold ends; the upstream requeues the original, which
    // the proxy never acked.
    wait_held(&proxy, 0.0).await;
    assert!(
        ch.basic_get(q.as_str().into(), Default::default())
            .await
            .is_err()
    );
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    wait_count(&uch, &q, 1).await;
    let back = get(&uch, &q).await;
    assert_eq!(payload(&back), "m");
    assert!(back.redelivered);
    assert_eq!(message_count(&uch, &dlq).await, 1);
    proxy.wait_gauge("inflight_deliveries", &[], 0.0).await;
    delete_upstream(&uch, &[&q, &dlq], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_dead_letters_count_against_the_bound_without_pausing_reads() {
    // One held dead letter (a body just under the bound, so it is kept with its content)
    // fills a 1 KiB bound with its x-death; retries no sooner than 4 s.
    let proxy = TestProxy::start_with(vec![], |config| {
        config.proxy.max_inflight_bytes = 1024;
        config.proxy.retry_initial_ms = 4000;
        config.proxy.retry_max_ms = 4000;
    })
    .await;
    let conn = proxy.connect().await;
    let (q, dlq) = full_dlq_topology(&conn, &[]).await;
    let ch = conn.create_channel().await.unwrap();
    let plain = unique("held-plain");
    declare(&ch, &plain, FieldTable::default()).await;
    let mut plain_rx = consume(&ch, &plain, BasicConsumeOptions::default()).await;
    let big = "b".repeat(1000);
    reject_and_hold(&proxy, &ch, &q, &big).await;
    assert!(proxy.counter("inflight_bytes", &[]) >= 1024.0);

    // The client holds nothing, so reads go on: a message for the other consumer arrives
    // at once, long before the retry...
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    crate::common::dl::publish(&uch, &plain, &["x"]).await;
    let x = tokio::time::timeout(Duration::from_millis(1500), plain_rx.recv())
        .await
        .expect("delivered while a held dead letter fills the bound")
        .expect("consumer open")
        .expect("delivery");
    assert_eq!(payload(&x), "x");
    // ...and one of the dead-lettering queue is kept as its tag only (the bound is full).
    crate::common::dl::publish(&uch, &q, &["y"]).await;
    let y = get(&ch, &q).await;
    assert_eq!(payload(&y), "y");
    assert_eq!(proxy.counter("deliveries_kept_tag_only_total", &[]), 1.0);
    y.acker.ack(BasicAckOptions::default()).await.unwrap();

    // The DLQ drains, the retry lands, the hold ends.
    purge(&uch, &dlq).await;
    landed(&uch, &dlq, &big, &q, "rejected").await;
    wait_held(&proxy, 0.0).await;
    delete_upstream(&uch, &[&q, &dlq, &plain], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_exchange_refused_to_the_user_is_published_by_the_service_user() {
    // RabbitMQ dead-letters as the broker, without checking the user's permissions; the proxy
    // publishes with the client's first, and on a 403 hands the dead letter to its service
    // connection. One carrying a user_id stays held on the client's connection (the service
    // user would need the impersonator tag) until an operator grants write access.
    let user = unique("held-user");
    let password = unique("held-pw");
    let rabbit_user = RabbitUser::create_with(&user, &password, "^(?!t-locked-)");
    let proxy = TestProxy::start(vec![]).await;
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    // `unique` names start with "t-": the user may write anything but this exchange.
    let locked = unique("locked-dlx");
    assert!(locked.starts_with("t-locked-"));
    let dlq = unique("held-dlq");
    declare_dlx(&uch, &locked, &dlq).await;
    let conn = lapin::Connection::connect(
        &format!("amqp://{user}:{password}@{}/%2f", proxy.addr),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = unique("held-src");
    // RabbitMQ refuses the user a queue whose dead-letter exchange it may not write to (so
    // does the proxy): the administrator declares it, through the proxy.
    let admin = proxy.connect().await;
    let ach = admin.create_channel().await.unwrap();
    declare_dead_lettering(&ach, &q, &locked, &dlq).await;
    let refused = try_declare(
        &ch,
        &unique("held-refused"),
        table(&[("x-dead-letter-exchange", ls(&locked))]),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert_eq!(amqp_code(&refused), Some(403), "{}", amqp_text(&refused));
    let ch = conn.create_channel().await.unwrap();

    crate::common::dl::publish(&ch, &q, &["m"]).await;
    crate::common::dl::get_and_reject(&ch, &q, "m").await;
    landed(&uch, &dlq, "m", &q, "rejected").await;
    assert_eq!(proxy.counter("dead_letters_by_service_total", &[]), 1.0);
    assert_eq!(
        proxy.counter("dead_letter_retries_total", &[("reason", "access_refused")]),
        0.0
    );
    wait_held(&proxy, 0.0).await;
    assert_eq!(message_count(&uch, &q).await, 0);

    // Stamped with the user's id: held until the user may publish it.
    // Confirmed before the get, which runs on another channel.
    let confirm_ch = conn.create_channel().await.unwrap();
    confirm_ch
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    confirm_ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"u",
            BasicProperties::default().with_user_id(user.as_str().into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    crate::common::dl::get_and_reject(&ch, &q, "u").await;
    wait_held(&proxy, 1.0).await;
    proxy
        .wait_counter(
            "dead_letter_retries_total",
            &[("reason", "access_refused")],
            2.0,
        )
        .await;
    assert_eq!(message_count(&uch, &dlq).await, 0);
    assert_eq!(proxy.counter("dead_letters_by_service_total", &[]), 1.0);
    rabbit_user.set_write(".*");
    landed(&uch, &dlq, "u", &q, "rejected").await;
    wait_held(&proxy, 0.0).await;
    delete_upstream(&uch, &[&q, &dlq], &[&locked]).await;
    let _ = conn.close(200, "done".into()).await;
    let _ = admin.close(200, "done".into()).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}

/// A consumer without a prefetch limit goes on receiving while a dead letter of its
/// connection is held (its DLQ full): the proxy reads the upstream for the retries' confirms,
/// which come behind the deliveries. What it keeps stops at twice `proxy.max_inflight_bytes`:
/// past the bound, deliveries are kept as their tag only. A rejection of one of those goes
/// upstream as sent and still lands in the DLQ, through the capture route, with its x-death.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_read_past_the_inflight_bound_for_a_held_retry_are_kept_as_tags() {
    const BOUND: usize = 64 * 1024;
    const COUNT: usize = 300;
    let proxy = TestProxy::start_with(vec![], |config| {
        config.proxy.max_inflight_bytes = BOUND;
        config.proxy.retry_max_ms = 400;
    })
    .await;
    let conn = proxy.connect().await;
    let (q, dlq, _ch, mut rx) = consumed_and_held(&proxy, &conn, "held").await;

    // 300 messages of 1 KiB, 4.7 times the bound, which the client receives and holds: about
    // 55 are kept with their content, the rest (read for the retries' confirms) as tags.
    let bodies: Vec<String> = (0..COUNT)
        .map(|i| format!("{i:04}{}", "x".repeat(1020)))
        .collect();
    let publisher = conn.create_channel().await.unwrap();
    for body in &bodies {
        publisher
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
    }
    let mut received = Vec::new();
    let mut peak = 0.0f64;
    let watch = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < watch {
        peak = peak.max(proxy.counter("inflight_bytes", &[]));
        while let Ok(delivery) = rx.try_recv() {
            received.push(delivery.expect("delivery"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        peak >= BOUND as f64 && peak < (2 * BOUND + 2048) as f64,
        "kept bytes peaked at {peak}, bound {BOUND}"
    );
    assert!(
        proxy.counter("deliveries_kept_tag_only_total", &[]) >= 1.0,
        "{}",
        proxy.metrics.encode()
    );
    assert_eq!(held(&proxy), 1.0);

    // The DLQ drains (a consumer takes what lands); the client rejects everything it holds
    // and what comes next. Every message lands once, with one x-death entry.
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    purge(&uch, &dlq).await;
    let mut dead = consume(
        &uch,
        &dlq,
        BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        },
    )
    .await;
    let mut rejected = 0;
    let mut landed = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while landed.len() < COUNT + 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {} landed, {rejected} rejected\n{}",
            landed.len(),
            COUNT + 1,
            proxy.metrics.encode()
        );
        for delivery in received.drain(..) {
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
            rejected += 1;
        }
        while let Ok(delivery) = rx.try_recv() {
            received.push(delivery.expect("delivery"));
        }
        while let Ok(d) = dead.try_recv() {
            let d = d.expect("dead letter");
            let deaths = x_death(&d);
            assert_eq!(deaths.len(), 1, "{deaths:?}");
            assert_eq!(field(&deaths[0], "queue"), &ls(&q));
            assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
            assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
            let body = payload(&d);
            assert!(
                body == "held" || bodies.contains(&body),
                "unknown body {body:.16}"
            );
            landed.insert(body);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(rejected, COUNT);
    wait_held(&proxy, 0.0).await;
    assert_eq!(message_count(&uch, &q).await, 0);
    delete_upstream(&uch, &[&q, &dlq], &[]).await;
    let _ = upstream.close(200, "done".into()).await;
    proxy.stop().await;
}
