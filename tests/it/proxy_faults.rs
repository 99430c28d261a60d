//! Proxy mode, bounds and faults: kept deliveries stay under `proxy.max_inflight_bytes`
//! without losing anything, a vanished client's deliveries go back to their queue, a vanished
//! upstream is reported as 320 and reconnecting works. Refused dead-letter publishes are in
//! `proxy_holdretry`.

use crate::proxy_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use proxy_support::*;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A TCP relay that can be cut, to make a peer vanish without a goodbye.
pub(crate) struct Relay {
    pub(crate) addr: std::net::SocketAddr,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Relay {
    pub(crate) async fn start(listen: &str, target: String) -> Relay {
        let listener = TcpListener::bind(listen).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let spawned = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                spawned.lock().unwrap().push(task);
            }
        });
        Relay {
            addr,
            tasks,
            accept,
        }
    }

    pub(crate) fn cut(self) {
        self.accept.abort();
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

async fn publish_confirmed(ch: &lapin::Channel, queue: &str, payloads: &[String]) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for p in payloads {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                p.as_bytes(),
                AMQPProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_deliveries_are_bounded_and_nothing_is_lost() {
    let proxy = TestProxy::start_with(vec![], |config| {
        config.proxy.max_inflight_bytes = 8 * 1024;
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("bounded");
    // Content is kept for queues that can dead-letter, so give this one a dead-letter exchange.
    declare(
        &ch,
        &q,
        table(&[("x-dead-letter-exchange", ls(&unique("bounded-dlx")))]),
    )
    .await;
    let payloads: Vec<String> = (0..300)
        .map(|i| format!("{i:04}{}", "x".repeat(996)))
        .collect();
    publish_confirmed(&ch, &q, &payloads).await;

    let cch = conn.create_channel().await.unwrap();
    let mut rx = consume(&cch, &q, BasicConsumeOptions::default()).await;
    // Without acks, the proxy stops reading deliveries near the bound.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut held = Vec::new();
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
        held.push(d);
    }
    assert!(!held.is_empty());
    assert!(
        held.len() <= 10,
        "{} deliveries held past an 8 KiB bound",
        held.len()
    );
    assert!(proxy.counter("inflight_bytes", &[]) <= 8.0 * 1024.0 + 1200.0);
    // Acking frees room: everything arrives, in order.
    let mut received = 0usize;
    for d in held.drain(..) {
        assert_eq!(payload(&d), payloads[received]);
        received += 1;
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    while received < payloads.len() {
        let d = next(&mut rx).await;
        assert_eq!(payload(&d), payloads[received]);
        received += 1;
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    wait_upstream_empty(&q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_deliveries_that_can_dead_letter_keep_their_content() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let plain = unique("tags-only");
    let dead = unique("with-content");
    let dlx = unique("with-content-dlx");
    let dlq = unique("with-content-dlq");
    declare(&ch, &plain, FieldTable::default()).await;
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_dead_lettering(&ch, &dead, &dlx, &dlq).await;
    let payloads: Vec<String> = (0..4).map(|i| format!("{i}{}", "y".repeat(999))).collect();
    publish_confirmed(&ch, &plain, &payloads).await;
    publish_confirmed(&ch, &dead, &payloads).await;

    // Both queues are consumed on one channel, so their delivery tags interleave.
    let cch = conn.create_channel().await.unwrap();
    let mut plain_rx = consume(&cch, &plain, BasicConsumeOptions::default()).await;
    let mut dead_rx = consume(&cch, &dead, BasicConsumeOptions::default()).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(next(&mut plain_rx).await);
        held.push(next(&mut dead_rx).await);
    }
    proxy.wait_counter("inflight_deliveries", &[], 8.0).await;
    // The plain queue's deliveries are kept as tags only; the other queue's with their
    // properties (2 bytes: no property set), body and routing key, to dead-letter them.
    let overhead = dlx_proxy::proxy::inflight::KEPT_OVERHEAD;
    let expected = 4 * overhead + 4 * (overhead + 2 + 1000 + dead.len());
    proxy
        .wait_gauge("inflight_bytes", &[], expected as f64)
        .await;

    // One nack for all eight: the plain queue's go back to the upstream natively (and are
    // dropped there: no dead-letter exchange), the others are dead-lettered by the proxy.
    let last = held.iter().max_by_key(|d| d.delivery_tag).unwrap();
    last.acker
        .nack(BasicNackOptions {
            multiple: true,
            requeue: false,
        })
        .await
        .unwrap();
    for expected in &payloads {
        let d = get(&ch, &dlq).await;
        assert_eq!(&payload(&d), expected);
        let deaths = x_death(&d);
        assert_eq!(deaths.len(), 1);
        assert_eq!(field(&deaths[0], "queue"), &ls(&dead));
        assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
        assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    consume_empty(&ch, &dlq).await;
    let uch = upstream_connection().await.create_channel().await.unwrap();
    wait_count(&uch, &plain, 0).await;
    wait_count(&uch, &dead, 0).await;
    // Gauges reported after the frames that settle: waited for, never read once.
    proxy.wait_gauge("inflight_deliveries", &[], 0.0).await;
    proxy.wait_gauge("inflight_bytes", &[], 0.0).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_policy_loaded_mid_delivery_applies_to_both_deliveries() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("late-policy");
    let dlx = unique("late-policy-dlx");
    let dlq = unique("late-policy-dlq");
    // Declared through the proxy: what the upstream dead-letters comes back to the proxy.
    declare(&ch, &q, FieldTable::default()).await;
    declare_dlx(&ch, &dlx, &dlq).await;
    publish_confirmed(&ch, &q, &["early".to_string(), "late".to_string()]).await;

    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut rx = consume(&cch, &q, BasicConsumeOptions::default()).await;
    let early = next(&mut rx).await;
    assert_eq!(payload(&early), "early");
    // No dead-letter exchange yet: the delivery is kept as a tag only.
    let overhead = dlx_proxy::proxy::inflight::KEPT_OVERHEAD as f64;
    proxy.wait_gauge("inflight_deliveries", &[], 1.0).await;
    proxy.wait_gauge("inflight_bytes", &[], overhead).await;

    proxy.set_policies(&[policy(
        "late",
        &format!("^{q}$"),
        serde_json::json!({"dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
    )]);
    // Rejected after the policy appeared: the upstream dead-letters it into the capture queue
    // and the proxy dead-letters it with the new policy.
    early
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    // The next delivery of the same consumer is kept with its content (the cached decision
    // was taken again) and dead-lettered by the proxy itself.
    let late = next(&mut rx).await;
    assert_eq!(payload(&late), "late");
    // The early one's release and the late one's charge are reported after the frames.
    proxy.wait_gauge("inflight_deliveries", &[], 1.0).await;
    let content = 2.0 + 4.0 + q.len() as f64;
    proxy
        .wait_gauge("inflight_bytes", &[], overhead + content)
        .await;
    late.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();

    let mut dead = Vec::new();
    for _ in 0..2 {
        let d = get(&ch, &dlq).await;
        let deaths = x_death(&d);
        assert_eq!(deaths.len(), 1, "one death, no trace of the capture hop");
        assert_eq!(field(&deaths[0], "queue"), &ls(&q));
        assert_eq!(field(&deaths[0], "reason"), &ls("rejected"));
        assert_eq!(field(&deaths[0], "count"), &AMQPValue::LongLongInt(1));
        dead.push(payload(&d));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    dead.sort();
    assert_eq!(dead, vec!["early".to_string(), "late".to_string()]);
    consume_empty(&ch, &dlq).await;
    wait_upstream_empty(&q).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_client_gives_its_unacked_deliveries_back() {
    let proxy = TestProxy::start(vec![]).await;
    let q = unique("vanish");
    let setup = proxy.connect().await;
    let sch = setup.create_channel().await.unwrap();
    declare(&sch, &q, FieldTable::default()).await;
    let payloads: Vec<String> = (0..3).map(|i| format!("m{i}")).collect();
    publish_confirmed(&sch, &q, &payloads).await;

    let relay = Relay::start("127.0.0.1:0", proxy.addr.to_string()).await;
    let doomed = Connection::connect(
        &format!("amqp://guest:guest@{}/%2f", relay.addr),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let dch = doomed.create_channel().await.unwrap();
    let mut rx = consume(&dch, &q, BasicConsumeOptions::default()).await;
    for _ in 0..3 {
        next(&mut rx).await;
    }
    relay.cut();

    let survivor = proxy.connect().await;
    let ch = survivor.create_channel().await.unwrap();
    let mut rx = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let d = next(&mut rx).await;
        assert!(d.redelivered);
        bodies.push(payload(&d));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    bodies.sort();
    assert_eq!(bodies, payloads);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_upstream_is_reported_as_320_and_reconnecting_works() {
    let relay = Relay::start("127.0.0.1:0", upstream_host()).await;
    let relay_addr = relay.addr;
    let proxy = TestProxy::start_with(vec![], |config| {
        config.upstream.url = format!("amqp://{relay_addr}");
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("upstream-gone");
    declare(&ch, &q, FieldTable::default()).await;
    let payloads: Vec<String> = (0..5).map(|i| format!("keep{i}")).collect();
    publish_confirmed(&ch, &q, &payloads).await;
    let mut raw = RawClient::connect_named(proxy.addr, &unique("raw")).await;
    relay.cut();
    let (code, text) = raw.expect_connection_close().await;
    assert_eq!(code, 320);
    assert!(text.starts_with("CONNECTION_FORCED - upstream"), "{text}");
    // The lapin client notices too: its operations fail.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        ch.basic_get(q.as_str().into(), Default::default())
            .await
            .is_err()
    );

    // The upstream is back (same address): a new connection works and the confirmed
    // messages are still there.
    let relay = Relay::start(&relay_addr.to_string(), upstream_host()).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut bodies = Vec::new();
    for _ in 0..5 {
        let d = get(&ch, &q).await;
        bodies.push(payload(&d));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    bodies.sort();
    assert_eq!(bodies, payloads);
    relay.cut();
    proxy.stop().await;
}
