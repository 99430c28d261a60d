//! Proxy mode without instance-local truth: two instances of one proxy deployment
//! ([`TestProxy::instance_of`], standing for two pods or one pod after a restart) in front of
//! the same RabbitMQ reach the same decision whichever of them (or a direct client) declared
//! the queue: redeclares are judged by RabbitMQ and answered with its own 406 texts, rejections
//! an instance cannot decide go through the upstream's capture, and delivery limits count
//! requeues from any instance and consumers that die holding the message.

use crate::proxy_declare::refused;
use crate::proxy_support;

use dlx_proxy::amqp::content::decode_properties;
use lapin::options::{BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use proxy_support::*;

/// RabbitMQ's answer to a direct client that declares a queue with `first` and then redeclares
/// it with `second`, with the queue's name replaced by `name`.
async fn direct_refusal(first: FieldTable, second: FieldTable, name: &str) -> (u16, String) {
    let upstream = upstream_connection().await;
    let q = unique("direct");
    declare(&upstream.create_channel().await.unwrap(), &q, first).await;
    let (code, text) = refused(
        &upstream.create_channel().await.unwrap(),
        &q,
        QueueDeclareOptions::default(),
        second,
    )
    .await;
    delete_upstream(&upstream.create_channel().await.unwrap(), &[&q], &[]).await;
    let _ = upstream.close(200, "bye".into()).await;
    (code, text.replace(&q, name))
}

/// Proxy A declares a queue with a dead-letter exchange and a TTL; proxy B, which never saw
/// that declare, answers every inequivalent redeclare with the code and text RabbitMQ gives a
/// direct client, and accepts the equivalent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_answers_redeclares_as_rabbitmq_does() {
    let a = TestProxy::start(vec![]).await;
    let b = TestProxy::instance_of(&a, vec![]).await;
    let q = unique("arbitrated");
    let original = table(&[
        ("x-dead-letter-exchange", ls("dlxA")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
    ]);
    let a_conn = a.connect().await;
    declare(
        &a_conn.create_channel().await.unwrap(),
        &q,
        original.clone(),
    )
    .await;
    let b_conn = b.connect().await;
    let cases = [
        ("no arguments", FieldTable::default()),
        (
            "DLX omitted",
            table(&[("x-message-ttl", AMQPValue::LongInt(1000))]),
        ),
        (
            "other DLX",
            table(&[
                ("x-dead-letter-exchange", ls("dlxB")),
                ("x-message-ttl", AMQPValue::LongInt(1000)),
            ]),
        ),
        (
            "DLRK added",
            table(&[
                ("x-dead-letter-exchange", ls("dlxA")),
                ("x-dead-letter-routing-key", ls("k")),
                ("x-message-ttl", AMQPValue::LongInt(1000)),
            ]),
        ),
    ];
    for (label, arguments) in cases {
        let expected = direct_refusal(original.clone(), arguments.clone(), &q).await;
        let ch = b_conn.create_channel().await.unwrap();
        let got = refused(&ch, &q, QueueDeclareOptions::default(), arguments).await;
        assert_eq!(got, expected, "{label}");
    }
    assert_eq!(b.counter("verified_queues", &[]), 0.0);
    declare(&b_conn.create_channel().await.unwrap(), &q, original).await;
    assert_eq!(b.counter("verified_queues", &[]), 1.0);
    delete_upstream(&a_conn.create_channel().await.unwrap(), &[&q], &[]).await;
    b.stop_instance();
    a.stop().await;
}

/// Rejects through an instance that never saw the queue declared, and through it again after
/// a restart, all reach the dead-letter queue (the upstream dead-letters them into the capture
/// exchange with the queue's tag, and the capture decides from the tag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejects_through_an_instance_that_did_not_declare_all_reach_the_dlq() {
    let a = TestProxy::start(vec![]).await;
    let q = unique("rejected-via-b");
    let dlx = unique("rejected-dlx");
    let dlq = unique("rejected-dlq");
    let a_conn = a.connect().await;
    let a_ch = a_conn.create_channel().await.unwrap();
    declare_dlx(&a_ch, &dlx, &dlq).await;
    declare(
        &a_ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
        ]),
    )
    .await;
    a_conn.close(200, "bye".into()).await.unwrap();
    let upstream = upstream_connection().await;
    let up = upstream.create_channel().await.unwrap();
    let mut b = TestProxy::instance_of(&a, vec![]).await;
    for round in 1..=2u32 {
        let payloads: Vec<String> = (0..10).map(|i| format!("r{round}-{i}")).collect();
        let refs: Vec<&str> = payloads.iter().map(String::as_str).collect();
        crate::common::dl::publish(&up, &q, &refs).await;
        let conn = b.connect().await;
        // B's client declares the queue its own way first: RabbitMQ's 406, nothing
        // remembered (the instance used to accept it and then discard the dead letters).
        let (code, _) = refused(
            &conn.create_channel().await.unwrap(),
            &q,
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await;
        assert_eq!(code, 406);
        let ch = conn.create_channel().await.unwrap();
        for _ in 0..10 {
            get(&ch, &q)
                .await
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
        }
        wait_count(&up, &dlq, 10 * round).await;
        conn.close(200, "bye".into()).await.unwrap();
        // A restart: a new instance of the same deployment.
        b.stop_instance();
        b = TestProxy::instance_of(&a, vec![]).await;
    }
    let mut seen: Vec<String> = Vec::new();
    for _ in 0..20 {
        seen.push(payload(&get(&up, &dlq).await));
    }
    seen.sort();
    let mut expected: Vec<String> = (1..=2)
        .flat_map(|r| (0..10).map(move |i| format!("r{r}-{i}")))
        .collect();
    expected.sort();
    assert_eq!(seen, expected);
    delete_upstream(&up, &[&q, &dlq], &[&dlx]).await;
    let _ = upstream.close(200, "bye".into()).await;
    b.stop_instance();
    a.stop().await;
}

/// The `x-delivery-count` of three deliveries of a message requeued twice.
fn counted_twice() -> Vec<Option<AMQPValue>> {
    vec![
        None,
        Some(AMQPValue::LongLongInt(1)),
        Some(AMQPValue::LongLongInt(2)),
    ]
}

/// Gets the message `body` from `q` once on each channel in turn and requeues it; the
/// `x-delivery-count` of each delivery.
async fn requeue_through(
    channels: &[&lapin::Channel],
    q: &str,
    body: &str,
) -> Vec<Option<AMQPValue>> {
    let requeue = lapin::options::BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    let mut counts = Vec::new();
    for ch in channels {
        let d = get(ch, q).await;
        assert_eq!(payload(&d), body);
        counts.push(header(&d, "x-delivery-count").cloned());
        d.acker.nack(requeue).await.unwrap();
    }
    counts
}

/// The death record of the message in `dlq` (which must hold exactly it).
async fn delivery_limit_death(ch: &lapin::Channel, dlq: &str, q: &str, body: &str) {
    let dead = get(ch, dlq).await;
    assert_eq!(payload(&dead), body);
    let deaths = x_death(&dead);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(field(&deaths[0], "reason"), &ls("delivery_limit"));
    assert_eq!(field(&deaths[0], "queue"), &ls(q));
}

/// x-delivery-limit 2 on a classic queue: requeues alternating between two instances are all
/// counted (dead-lettered after the third delivery), and so are requeues through the second
/// instance alone, which declared the queue itself but never saw the first declare, and
/// through a third whose clients never declared it at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_delivery_limits_count_requeues_through_any_instance() {
    let a = TestProxy::start(vec![]).await;
    let b = TestProxy::instance_of(&a, vec![]).await;
    // Short names: the read-back below reads the capture tag out of a RabbitMQ reply text,
    // which RabbitMQ cuts at 255 bytes.
    let q = short_unique("q");
    let dlx = short_unique("x");
    let dlq = short_unique("d");
    let arguments = table(&[
        ("x-delivery-limit", AMQPValue::LongInt(2)),
        ("x-dead-letter-exchange", ls(&dlx)),
        ("x-dead-letter-routing-key", ls(&dlq)),
    ]);
    let a_conn = a.connect().await;
    let a_ch = a_conn.create_channel().await.unwrap();
    declare_dlx(&a_ch, &dlx, &dlq).await;
    declare(&a_ch, &q, arguments.clone()).await;
    let b_conn = b.connect().await;
    let b_ch = b_conn.create_channel().await.unwrap();
    declare(&b_ch, &q, arguments).await;

    crate::common::dl::publish(&a_ch, &q, &["alternating"]).await;
    let counts = requeue_through(&[&a_ch, &b_ch, &a_ch], &q, "alternating").await;
    assert_eq!(counts, counted_twice());
    delivery_limit_death(&a_ch, &dlq, &q, "alternating").await;
    consume_empty(&a_ch, &q).await;

    crate::common::dl::publish(&a_ch, &q, &["b-alone"]).await;
    let counts = requeue_through(&[&b_ch, &b_ch, &b_ch], &q, "b-alone").await;
    assert_eq!(counts, counted_twice());
    delivery_limit_death(&b_ch, &dlq, &q, "b-alone").await;
    consume_empty(&b_ch, &q).await;

    // An instance whose clients never declared the queue (a restart): it reads the queue's
    // settings back from the upstream at the first basic.get, then counts the same.
    let c = TestProxy::instance_of(&a, vec![]).await;
    let c_conn = c.connect().await;
    let c_ch = c_conn.create_channel().await.unwrap();
    crate::common::dl::publish(&a_ch, &q, &["c-alone"]).await;
    let counts = requeue_through(&[&c_ch, &c_ch, &c_ch], &q, "c-alone").await;
    assert_eq!(counts, counted_twice());
    // The queue, and the dead-letter queue read back at the get from it.
    delivery_limit_death(&c_ch, &dlq, &q, "c-alone").await;
    assert_eq!(c.counter("verified_queues", &[]), 2.0);
    delete_upstream(&a_ch, &[&q, &dlq], &[&dlx]).await;
    c.stop_instance();
    b.stop_instance();
    a.stop().await;
}

/// A consumer that takes the message and dies (its TCP connection dropped without a close),
/// again and again: the message is dead-lettered with reason delivery_limit after limit + 1
/// deliveries, on a classic queue (the proxy counts the return while it closes the upstream
/// connection) and on a quorum queue (RabbitMQ counts it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_consumer_reaches_the_delivery_limit() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let dlx = unique("crash-dlx");
    let dlq = unique("crash-dlq");
    declare_dlx(&ch, &dlx, &dlq).await;
    for queue_type in ["classic", "quorum"] {
        let q = unique(&format!("crash-{queue_type}"));
        let arguments = table(&[
            ("x-queue-type", ls(queue_type)),
            ("x-delivery-limit", AMQPValue::LongInt(2)),
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
        ]);
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .unwrap();
        crate::common::dl::publish(&ch, &q, &["poison"]).await;
        let mut counts = Vec::new();
        for _ in 0..3 {
            let mut client = RawClient::connect(proxy.addr).await;
            client.open_channel(1).await;
            client.consume(1, &q, false).await;
            let delivery = client.next_delivery().await;
            assert_eq!(delivery.body, b"poison", "{queue_type}");
            let props = decode_properties(&delivery.properties).unwrap();
            counts.push(
                props
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("x-delivery-count").cloned()),
            );
            // Crash: the socket goes without a close, the message unacked.
            drop(client);
        }
        delivery_limit_death(&ch, &dlq, &q, "poison").await;
        consume_empty(&ch, &q).await;
        if queue_type == "classic" {
            assert_eq!(counts, counted_twice());
        } else {
            assert_eq!(counts.len(), 3, "{counts:?}");
        }
        delete_upstream(&ch, &[&q], &[]).await;
    }
    delete_upstream(&ch, &[&dlq], &[&dlx]).await;
    proxy.stop().await;
}

/// A queue declared directly on RabbitMQ with its own dead-letter exchange (brownfield): a
/// declare through the proxy with the same arguments is accepted, one with other arguments
/// gets RabbitMQ's own 406, and its rejections are dead-lettered by RabbitMQ itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brownfield_queues_are_judged_and_dead_lettered_by_rabbitmq() {
    let proxy = TestProxy::start(vec![]).await;
    let upstream = upstream_connection().await;
    let up = upstream.create_channel().await.unwrap();
    let q = unique("brownfield");
    let dlx = unique("brownfield-dlx");
    let dlq = unique("brownfield-dlq");
    declare_dlx(&up, &dlx, &dlq).await;
    let own = table(&[
        ("x-dead-letter-exchange", ls(&dlx)),
        ("x-dead-letter-routing-key", ls(&dlq)),
    ]);
    declare(&up, &q, own.clone()).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, &q, own.clone()).await;
    for other in [
        FieldTable::default(),
        table(&[("x-dead-letter-exchange", ls("elsewhere"))]),
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-dead-letter-routing-key", ls(&dlq)),
            ("x-message-ttl", AMQPValue::LongInt(5)),
        ]),
    ] {
        let expected = direct_refusal(own.clone(), other.clone(), &q).await;
        let got = refused(
            &conn.create_channel().await.unwrap(),
            &q,
            QueueDeclareOptions::default(),
            other,
        )
        .await;
        assert_eq!(got, expected);
    }
    crate::common::dl::publish(&ch, &q, &["old"]).await;
    get(&ch, &q)
        .await
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&up, &dlq).await;
    assert_eq!(payload(&dead), "old");
    let deaths = x_death(&dead);
    assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
    // RabbitMQ dead-lettered it: the proxy published nothing (it would count it at its
    // confirm, after the DLQ shows it).
    let rejected = [
        ("queue", q.as_str()),
        ("reason", "rejected"),
        ("vhost", "/"),
    ];
    proxy
        .stays(
            "dead_lettered_total",
            &rejected,
            0.0,
            std::time::Duration::from_millis(500),
        )
        .await;
    delete_upstream(&up, &[&q, &dlq], &[&dlx]).await;
    let _ = upstream.close(200, "bye".into()).await;
    proxy.stop().await;
}

/// The channels RabbitMQ counts on the upstream connection of the client named `name`.
fn upstream_channels(name: &str) -> Option<u32> {
    let listing = rabbitmqctl(&["list_connections", "-q", "channels", "client_properties"]);
    let text = String::from_utf8_lossy(&listing.stdout);
    let line = text.lines().find(|l| l.contains(name))?;
    line.split_whitespace().next()?.parse().ok()
}

/// The declare check opens the proxy's check channel only while it runs: after a checked
/// declare the upstream connection has the client's channel and the proxy's publisher channel,
/// no more (the capture consumer is on the service connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_channel_is_closed_after_the_check() {
    use lapin::protocol::{AMQPClass, queue};
    let proxy = TestProxy::start(vec![]).await;
    let name = unique("check-channel");
    let mut client = RawClient::connect_named(proxy.addr, &name).await;
    client.open_channel(1).await;
    let q = unique("checked");
    client
        .send_method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: q.as_str().into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: table(&[("x-dead-letter-exchange", ls("dlx"))]),
            })),
        )
        .await;
    client.expect_method(50, 11).await;
    let settled = crate::common::poll(
        std::time::Duration::from_secs(15),
        std::time::Duration::from_millis(100),
        async || (upstream_channels(&name) == Some(2)).then_some(()),
    )
    .await;
    assert!(
        settled.is_some(),
        "upstream channels: {:?}",
        upstream_channels(&name)
    );
    let upstream = upstream_connection().await;
    delete_upstream(&upstream.create_channel().await.unwrap(), &[&q], &[]).await;
    let _ = upstream.close(200, "bye".into()).await;
    proxy.stop().await;
}

/// Instance A verified a queue; it is deleted and declared anew with another dead-letter
/// target through instance B. After `proxy.verified_queue_max_age_secs`, A's next get reads
/// the queue back, and a rejection through A reaches the new target (A decided from what it
/// had verified until the queue was deleted through it, which never happened). Names short
/// enough for the read-back (without the management API, long ones keep A's decision).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_declared_anew_through_another_instance_is_read_back_once_stale() {
    let names = [
        short_unique("q"),
        short_unique("ox"),
        short_unique("oq"),
        short_unique("nx"),
        short_unique("nq"),
    ];
    let a = TestProxy::start_with(vec![], |config| {
        config.proxy.verified_queue_max_age_secs = 1;
    })
    .await;
    let b = TestProxy::instance_of(&a, vec![]).await;
    let [q, old_dlx, old_dlq, new_dlx, new_dlq] = names;
    let with_target = |dlx: &str, dlq: &str| {
        table(&[
            ("x-dead-letter-exchange", ls(dlx)),
            ("x-dead-letter-routing-key", ls(dlq)),
        ])
    };
    let a_conn = a.connect().await;
    let a_ch = a_conn.create_channel().await.unwrap();
    declare_dlx(&a_ch, &old_dlx, &old_dlq).await;
    declare_dlx(&a_ch, &new_dlx, &new_dlq).await;
    declare(&a_ch, &q, with_target(&old_dlx, &old_dlq)).await;
    let b_conn = b.connect().await;
    let b_ch = b_conn.create_channel().await.unwrap();
    b_ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    declare(&b_ch, &q, with_target(&new_dlx, &new_dlq)).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

    crate::common::dl::publish(&a_ch, &q, &["m"]).await;
    get(&a_ch, &q)
        .await
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&a_ch, &new_dlq).await;
    let deaths = x_death(&dead);
    assert_eq!(field(&deaths[0], "queue"), &ls(&q));
    assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
    consume_empty(&a_ch, &old_dlq).await;
    let ch = a_conn.create_channel().await.unwrap();
    let queues = [q.as_str(), old_dlq.as_str(), new_dlq.as_str()];
    delete_upstream(&ch, &queues, &[&old_dlx, &new_dlx]).await;
    b.stop_instance();
    a.stop().await;
}
