//! `dead_letter.ttl_on_dead_letters`: with `false`, a message that carries an x-death history
//! does not expire (queue or message TTL) in the queue it reached, while fresh messages in
//! that queue still do, even behind a kept dead letter; length limits still drop or
//! dead-letter dead letters. With `true` (the default) dead letters expire as in RabbitMQ.
//! Embedded mode and proxy mode.

use std::time::Duration;

use crate::common;
use crate::proxy_support::{TestProxy, delete_upstream};

use common::dl::*;
use common::*;

/// Source `q` dead-letters into `dlq`, which has a 300 ms TTL and `dlq_extra` arguments, and
/// itself dead-letters (expiry, overflow) into `graveyard`.
async fn topology(
    ch: &lapin::Channel,
    q: &str,
    dlq: &str,
    graveyard: &str,
    dlq_extra: &[(&str, AMQPValue)],
) {
    let mut dlq_args = vec![("x-message-ttl", int(300))];
    dlq_args.extend(dlq_extra.iter().cloned());
    declare_dead_letter_queues(ch, dlq, graveyard, &dlq_args).await;
    declare(ch, q, dead_letter_to(dlq, &[])).await;
}

/// Rejects `payloads` out of `q` (one by one, in order) so they reach the DLQ as dead letters.
async fn dead_letter(ch: &lapin::Channel, q: &str, payloads: &[&str]) {
    publish(ch, q, payloads).await;
    for p in payloads {
        get_and_reject(ch, q, p).await;
    }
}

async fn payloads_in(ch: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(d) = get(ch, queue).await {
        seen.push(payload(&d));
    }
    seen
}

#[tokio::test]
async fn embedded_kept_dead_letters_outlive_the_ttl_while_fresh_messages_expire() {
    let mut config = test_config();
    config.dead_letter.ttl_on_dead_letters = false;
    let b = start_with(config).await;
    let (_conn, ch) = b.channel().await;
    topology(&ch, "q", "dlq", "graveyard", &[]).await;
    dead_letter(&ch, "q", &["dl"]).await;
    // A fresh message behind the kept dead letter (at the head) still expires.
    publish(&ch, "dlq", &["fresh"]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(b.queue_counts("dlq"), Some((1, 0)));
    let graveyard = payloads_in(&ch, "graveyard").await;
    assert_eq!(graveyard, vec!["fresh"]);
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "dl");
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![("q", "rejected", 1)]
    );
}

#[tokio::test]
async fn embedded_dead_letters_expire_by_default() {
    let b = start().await;
    let (_conn, ch) = b.channel().await;
    topology(&ch, "q", "dlq", "graveyard", &[]).await;
    dead_letter(&ch, "q", &["dl"]).await;
    b.wait_counts("dlq", 0, 0).await;
    let d = get_one(&ch, "graveyard").await;
    let deaths = x_death(&d);
    assert_eq!(
        deaths.iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![("dlq", "expired", 1), ("q", "rejected", 1)]
    );
}

#[tokio::test]
async fn embedded_length_limits_still_apply_to_kept_dead_letters() {
    let mut config = test_config();
    config.dead_letter.ttl_on_dead_letters = false;
    let b = start_with(config).await;
    let (_conn, ch) = b.channel().await;
    topology(&ch, "q", "dlq", "graveyard", &[("x-max-length", int(1))]).await;
    dead_letter(&ch, "q", &["a", "b"]).await;
    let d = get_one(&ch, "graveyard").await;
    assert_eq!(payload(&d), "a");
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![("dlq", "maxlen", 1), ("q", "rejected", 1)]
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(payloads_in(&ch, "dlq").await, vec!["b"]);
}

// ------------------------------------------------------------------------------------------
// Proxy mode: the upstream expires everything; the proxy puts captured dead letters back
// ------------------------------------------------------------------------------------------

/// Polls `queue` until a message is there (a kept dead letter may be on its way back into
/// its queue at any moment: captured from the upstream, published again).
async fn first_in(ch: &lapin::Channel, queue: &str) -> Delivery {
    poll(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || get(ch, queue).await,
    )
    .await
    .unwrap_or_else(|| panic!("nothing in {queue}"))
}

struct ProxyTopology {
    q: String,
    dlq: String,
    graveyard: String,
    dlx: String,
}

impl ProxyTopology {
    async fn declare(ch: &lapin::Channel, dlq_extra: &[(&str, AMQPValue)]) -> ProxyTopology {
        let t = ProxyTopology {
            q: unique("kdl-q"),
            dlq: unique("kdl-dlq"),
            graveyard: unique("kdl-graveyard"),
            dlx: String::new(),
        };
        topology(ch, &t.q, &t.dlq, &t.graveyard, dlq_extra).await;
        ProxyTopology {
            dlx: format!("{}_dlx_exchange", t.dlq),
            ..t
        }
    }

    async fn delete(&self, ch: &lapin::Channel) {
        delete_upstream(ch, &[&self.q, &self.dlq, &self.graveyard], &[&self.dlx]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_kept_dead_letters_outlive_the_ttl_while_fresh_messages_expire() {
    let proxy = TestProxy::start_with(vec![], |c| c.dead_letter.ttl_on_dead_letters = false).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let t = ProxyTopology::declare(&ch, &[]).await;
    dead_letter(&ch, &t.q, &["dl"]).await;
    publish(&ch, &t.dlq, &["fresh"]).await;
    let fresh = first_in(&ch, &t.graveyard).await;
    assert_eq!(payload(&fresh), "fresh");
    assert_eq!(
        x_death(&fresh).iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![(t.dlq.as_str(), "expired", 1)]
    );
    // Several TTL periods: the dead letter was expired by the upstream and put back each time.
    proxy
        .wait_counter(
            "dead_letters_kept_total",
            &[("queue", &t.dlq), ("vhost", "/")],
            3.0,
        )
        .await;
    let d = first_in(&ch, &t.dlq).await;
    assert_eq!(payload(&d), "dl");
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![(t.q.as_str(), "rejected", 1)],
        "no x-death entry for the expiries it survived"
    );
    assert!(
        get(&ch, &t.graveyard).await.is_none(),
        "only the fresh message expired"
    );
    t.delete(&ch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_dead_letters_expire_by_default() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let t = ProxyTopology::declare(&ch, &[]).await;
    dead_letter(&ch, &t.q, &["dl"]).await;
    let d = first_in(&ch, &t.graveyard).await;
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![
            (t.dlq.as_str(), "expired", 1),
            (t.q.as_str(), "rejected", 1)
        ]
    );
    assert_eq!(
        proxy.counter(
            "dead_letters_kept_total",
            &[("queue", &t.dlq), ("vhost", "/")]
        ),
        0.0
    );
    t.delete(&ch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_length_limits_still_apply_to_kept_dead_letters() {
    let proxy = TestProxy::start_with(vec![], |c| c.dead_letter.ttl_on_dead_letters = false).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let t = ProxyTopology::declare(&ch, &[("x-max-length", int(1))]).await;
    dead_letter(&ch, &t.q, &["a", "b"]).await;
    let d = first_in(&ch, &t.graveyard).await;
    assert_eq!(payload(&d), "a");
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        vec![(t.dlq.as_str(), "maxlen", 1), (t.q.as_str(), "rejected", 1)]
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(payload(&first_in(&ch, &t.dlq).await), "b");
    t.delete(&ch).await;
}
