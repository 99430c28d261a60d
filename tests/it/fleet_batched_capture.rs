//! A proxy killed (SIGKILL) in the middle of a batched capture run: thousands of TTL deaths
//! arrive in the capture queue at once, the proxy holds up to `proxy.capture_prefetch` of them
//! with their dead letters in flight and acks confirmed runs with `multiple` acks; the kill
//! lands while the DLQ is part full. Started again, the proxy takes back what the upstream
//! requeued, and every message reaches the DLQ (duplicates allowed: at-least-once), each with
//! the x-death of its original queue.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;

use crate::common::dl::{confirm_select, declare_durable, int, ls, table};
use crate::common::{poll, unique};
use crate::fleet_capture::{declare_dlq, drain_expecting};
use crate::fleet_cluster::channel_on;
use crate::proxy_support::fleet::{Fleet, count_at};
use crate::rabbit;

const COUNT: usize = 6000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_mid_batch_loses_no_captured_dead_letter() {
    let node = rabbit::reference();
    let mut fleet = Fleet::start(1, &[node.uri()], &[], "[proxy]\ncapture_prefetch = 500\n").await;
    let source = unique("fb-src");
    let (dlx, dlq) = (unique("fb-dlx"), unique("fb-dlq"));
    {
        let conn = fleet.proxy(0).connect().await;
        let ch = conn.create_channel().await.unwrap();
        declare_dlq(&ch, &dlx, &dlq, &[]).await;
        // A classic source queue (it expires messages at their deadline; a quorum queue of
        // 3.10 only when it looks at its head): every message expires 2 s after its publish,
        // and the publishes below take less than that, so the deaths come as one burst.
        declare_durable(
            &ch,
            &source,
            table(&[
                ("x-dead-letter-exchange", ls(&dlx)),
                ("x-dead-letter-routing-key", ls(&dlq)),
                ("x-message-ttl", int(2000)),
            ]),
        )
        .await;
        let _ = conn.close(200, "done".into()).await;
    }
    // Published to RabbitMQ directly, confirms pipelined.
    let (c, ch) = channel_on(node).await;
    confirm_select(&ch).await;
    let mut confirms = Vec::with_capacity(COUNT);
    for i in 0..COUNT {
        let confirm = ch
            .basic_publish(
                "".into(),
                source.as_str().into(),
                BasicPublishOptions::default(),
                format!("k{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .expect("publish");
        confirms.push(confirm);
    }
    for confirm in confirms {
        assert!(confirm.await.expect("confirm").is_ack());
    }
    // Kill the proxy once part of the burst is in the DLQ while it holds capture deliveries.
    let uri = node.uri();
    let proxy = fleet.proxy(0);
    let (at_kill, unacked) = poll(
        Duration::from_secs(60),
        Duration::from_millis(10),
        async || {
            let unacked = proxy.counter("capture_unacked", &[("vhost", "/")]).await;
            let in_dlq = count_at(&uri, &dlq).await? as usize;
            (in_dlq >= COUNT / 10 && unacked >= 1.0).then_some((in_dlq, unacked))
        },
    )
    .await
    .expect("dead letters reach the DLQ through the proxy, some in hand");
    fleet.proxy_mut(0).kill();
    assert!(
        at_kill < COUNT,
        "the run was over before the kill ({at_kill} of {COUNT} in the DLQ)"
    );
    fleet.proxy_mut(0).restart().await;

    let expected: BTreeMap<String, (String, &str)> = (0..COUNT)
        .map(|i| (format!("k{i}"), (source.clone(), "expired")))
        .collect();
    let duplicates = drain_expecting(&ch, &dlq, &expected).await;
    eprintln!(
        "killed with {at_kill} of {COUNT} in the DLQ and {unacked} capture deliveries unacked; \
         {duplicates} duplicates"
    );
    // The capture queue is empty again: nothing is left behind unacked.
    let proxy = fleet.proxy(0);
    let settled = poll(
        Duration::from_secs(30),
        Duration::from_millis(200),
        async || (proxy.counter("capture_unacked", &[("vhost", "/")]).await == 0.0).then_some(()),
    )
    .await;
    assert!(settled.is_some(), "{}", proxy.metrics_text().await);
    let _ = c.close(200, "done".into()).await;
    fleet.stop_deleting(&[&source, &dlq], &[&dlx]).await;
}
