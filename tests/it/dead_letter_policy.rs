//! Policies versus queue arguments: RabbitMQ's cases P1–P3 (reference §1.7), the classic-queue
//! precedence table key by key, policy matching (priority, apply-to, vhost), and policies
//! changed at run time (admin API path) or by a configuration reload, applied to existing
//! queues and to messages already queued or unacked.

use crate::common;

use std::time::{Duration, Instant};

use common::dl::*;
use common::dl_policy::{exact, pattern};
use common::*;
use serde_json::json;

/// P1: a policy set later applies to messages already unacked.
#[tokio::test]
async fn dead_letter_policy() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["p1", "p2"]).await;
    let tags = consume(&ch, "q", &["p1", "p2"]).await;
    nack(&ch, tags[0], false, false).await;
    b.wait_counts("q", 0, 1).await;
    consume_empty(&ch, "q").await;
    consume_empty(&ch, "dlq").await;
    b.set_policy(exact(
        "dlx",
        "q",
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    nack(&ch, tags[1], false, false).await;
    b.wait_counts("q", 0, 0).await;
    b.wait_counts("dlq", 1, 0).await;
    consume(&ch, "dlq", &["p2"]).await;
}

/// P2: a policy set first; the queue's arguments win.
#[tokio::test]
async fn dead_letter_override_policy() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    b.set_policy(exact(
        "self",
        "q",
        json!({"dead-letter-exchange": "", "dead-letter-routing-key": "q"}),
    ));
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["p1"]).await;
    get_and_nack(&ch, "q", "p1").await;
    b.wait_counts("dlq", 1, 0).await;
    consume_empty(&ch, "q").await;
}

/// P3: arguments first, the same policy after: the arguments still win.
#[tokio::test]
async fn dead_letter_ignore_policy() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    b.set_policy(exact(
        "self",
        "q",
        json!({"dead-letter-exchange": "", "dead-letter-routing-key": "q"}),
    ));
    publish(&ch, "q", &["p1"]).await;
    get_and_nack(&ch, "q", "p1").await;
    b.wait_counts("dlq", 1, 0).await;
    consume_empty(&ch, "q").await;
}

/// Key by key: the argument's DLX with the policy's routing key.
#[tokio::test]
async fn precedence_dead_letter_keys_merge_key_by_key() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    b.set_policy(exact(
        "p",
        "q",
        json!({"dead-letter-exchange": "elsewhere", "dead-letter-routing-key": "dlq"}),
    ));
    declare(&ch, "q", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    publish(&ch, "q", &["m"]).await;
    get_and_reject(&ch, "q", "m").await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str()),
        ("dlx", "dlq")
    );
}

/// message-ttl: the lower wins (probe: policy 100000, argument 50 → 50).
#[tokio::test]
async fn precedence_message_ttl_lower_wins() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    b.set_policy(pattern(
        "ttl",
        "^q",
        0,
        json!({"message-ttl": 100000, "dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    declare(&ch, "q-arg-low", table(&[("x-message-ttl", int(50))])).await;
    let t0 = Instant::now();
    publish(&ch, "q-arg-low", &["a"]).await;
    b.wait_counts("dlq", 1, 0).await;
    assert!(t0.elapsed() < Duration::from_secs(2));
    b.set_policy(pattern(
        "ttl",
        "^q",
        0,
        json!({"message-ttl": 30, "dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    declare(
        &ch,
        "q-policy-low",
        table(&[("x-message-ttl", int(100_000))]),
    )
    .await;
    publish(&ch, "q-policy-low", &["b"]).await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "dlq", &["a", "b"]).await;
}

/// max-length and max-length-bytes: the lower wins.
#[tokio::test]
async fn precedence_max_length_lower_wins() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    b.set_policy(pattern("len", "^q", 0, json!({"max-length": 1})));
    declare(&ch, "q-len", table(&[("x-max-length", int(5))])).await;
    publish(&ch, "q-len", &["1", "2", "3"]).await;
    b.wait_counts("q-len", 1, 0).await;
    b.set_policy(pattern("len", "^q", 0, json!({"max-length-bytes": 1000})));
    declare(&ch, "q-bytes", table(&[("x-max-length-bytes", int(100))])).await;
    let body = "x".repeat(80);
    publish(&ch, "q-bytes", &[&body, &body]).await;
    b.wait_counts("q-bytes", 1, 0).await;
    // And the policy's when it is the lower one.
    b.set_policy(pattern("len", "^q", 0, json!({"max-length": 2})));
    declare(&ch, "q-policy", table(&[("x-max-length", int(10))])).await;
    publish(&ch, "q-policy", &["1", "2", "3"]).await;
    b.wait_counts("q-policy", 2, 0).await;
}

/// overflow: the argument wins over the policy (classic queues).
#[tokio::test]
async fn precedence_overflow_argument_wins() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    b.set_policy(exact(
        "ovf",
        "q",
        json!({"overflow": "drop-head", "max-length": 1}),
    ));
    declare(&ch, "q", table(&[("x-overflow", ls("reject-publish"))])).await;
    let a = publish_to(&ch, "", "q", b"1", BasicProperties::default()).await;
    let n = publish_to(&ch, "", "q", b"2", BasicProperties::default()).await;
    assert!(matches!(a, Confirmation::Ack(None)), "{a:?}");
    assert!(matches!(n, Confirmation::Nack(_)), "{n:?}");
    consume(&ch, "q", &["1"]).await;
    // Without the argument the policy's overflow applies.
    declare(&ch, "q2", FieldTable::default()).await;
    b.set_policy(exact(
        "ovf2",
        "q2",
        json!({"overflow": "reject-publish", "max-length": 1}),
    ));
    publish_to(&ch, "", "q2", b"1", BasicProperties::default()).await;
    let n = publish_to(&ch, "", "q2", b"2", BasicProperties::default()).await;
    assert!(matches!(n, Confirmation::Nack(_)), "{n:?}");
}

/// expires: the lower wins; an expiring queue never dead-letters its messages.
#[tokio::test]
async fn precedence_expires_lower_wins_and_never_dead_letters() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    b.set_policy(exact("exp", "q", json!({"expires": 50})));
    declare(
        &ch,
        "q",
        table(&[
            ("x-expires", int(100_000)),
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    publish(&ch, "q", &["m1", "m2"]).await;
    let gone = eventually(|| b.queue_counts("q").is_none()).await;
    assert!(gone, "queue expired after 50 ms");
    let ch = c.create_channel().await.unwrap();
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "expired"), 0);
}

/// Among matching policies the highest priority applies; ties go to the first name; policies
/// for exchanges or another vhost do not apply to queues of "/".
#[tokio::test]
async fn policy_matching_priority_apply_to_and_vhost() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    for (x, q) in [("dlx-a", "dlq-a"), ("dlx-b", "dlq-b"), ("dlx-c", "dlq-c")] {
        exchange(&ch, x, ExchangeKind::Fanout).await;
        declare(&ch, q, FieldTable::default()).await;
        bind(&ch, q, x, "").await;
    }
    b.set_policy(pattern(
        "low",
        "^work",
        1,
        json!({"dead-letter-exchange": "dlx-a"}),
    ));
    b.set_policy(pattern(
        "high",
        "^work\\.",
        5,
        json!({"dead-letter-exchange": "dlx-b"}),
    ));
    b.set_policy(pattern(
        "a-tie",
        "^work\\.",
        5,
        json!({"dead-letter-exchange": "dlx-c"}),
    ));
    let mut exchanges_only = pattern("xonly", ".*", 100, json!({"dead-letter-exchange": "dlx-a"}));
    exchanges_only.apply_to = "exchanges".into();
    b.set_policy(exchanges_only);
    let mut other_vhost = pattern("vh", ".*", 100, json!({"dead-letter-exchange": "dlx-a"}));
    other_vhost.vhost = "elsewhere".into();
    b.set_policy(other_vhost);
    declare(&ch, "work.1", FieldTable::default()).await;
    declare(&ch, "workx", FieldTable::default()).await;
    for q in ["work.1", "workx"] {
        publish(&ch, q, &[q]).await;
        let t = consume(&ch, q, &[q]).await[0];
        reject(&ch, t, false).await;
    }
    // work.1: priority 5, tie between "a-tie" and "high" → "a-tie" (sorts first) → dlx-c.
    consume(&ch, "dlq-c", &["work.1"]).await;
    // workx: only "low" matches → dlx-a.
    consume(&ch, "dlq-a", &["workx"]).await;
    consume_empty(&ch, "dlq-b").await;
}

/// A message-ttl policy applied to a queue that already holds messages expires them relative
/// to when they were enqueued. Deliberate difference: RabbitMQ 3.10.8 (probed) computes expiry
/// only at enqueue, so messages queued before the policy never expire (and block the expiry
/// of newer ones behind them); here the new TTL applies to them too.
#[tokio::test]
async fn runtime_policy_ttl_applies_to_queued_messages() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["old1", "old2"]).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    b.set_policy(exact(
        "ttl",
        "q",
        json!({"message-ttl": 50, "dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    // Already older than 50 ms: dead-lettered as soon as the policy applies.
    consume(&ch, "dlq", &["old1", "old2"]).await;
    let d = {
        publish(&ch, "q", &["new"]).await;
        b.wait_counts("dlq", 1, 2).await;
        get_one(&ch, "dlq").await
    };
    assert_eq!(payload(&d), "new");
    assert_eq!(x_death(&d)[0].qrc(), ("q", "expired", 1));
}

/// A max-length policy applied at run time dead-letters the surplus head at once.
#[tokio::test]
async fn runtime_policy_max_length_applies_to_queued_messages() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["1", "2", "3"]).await;
    b.set_policy(exact(
        "len",
        "q",
        json!({"max-length": 1, "dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    b.wait_counts("q", 1, 0).await;
    consume(&ch, "dlq", &["1", "2"]).await;
    let d = get_one(&ch, "q").await;
    assert_eq!(payload(&d), "3");
}

/// Clearing a policy removes its DLX from existing queues.
#[tokio::test]
async fn runtime_policy_cleared_stops_dead_lettering() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    b.set_policy(exact(
        "dlx",
        "q",
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    declare(&ch, "q", FieldTable::default()).await;
    publish(&ch, "q", &["a", "b"]).await;
    let tags = consume(&ch, "q", &["a", "b"]).await;
    reject(&ch, tags[0], false).await;
    b.wait_counts("dlq", 1, 0).await;
    assert!(b.clear_policy("dlx"));
    reject(&ch, tags[1], false).await;
    b.wait_counts("q", 0, 0).await;
    b.stays_counts("dlq", 1, 0, 50).await;
}

/// A configuration reload replaces the file's policies for existing queues; a runtime policy
/// of the same name overrides the file's.
#[tokio::test]
async fn reload_applies_policies_to_existing_queues() {
    let mut cfg = test_config();
    cfg.policies = vec![exact(
        "from-file",
        "q",
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    )];
    let b = start_with(cfg.clone()).await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare(&ch, "dlq2", FieldTable::default()).await;
    bind(&ch, "dlq2", "dlx", "dlq2").await;
    declare(&ch, "q", FieldTable::default()).await;
    let reject_one = |body: &'static str| {
        let ch = ch.clone();
        async move {
            publish(&ch, "q", &[body]).await;
            let t = consume(&ch, "q", &[body]).await[0];
            reject(&ch, t, false).await;
        }
    };
    reject_one("1").await;
    consume(&ch, "dlq", &["1"]).await;
    // Reload with a changed definition.
    cfg.policies = vec![exact(
        "from-file",
        "q",
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq2"}),
    )];
    b.service.reload(&cfg).unwrap();
    reject_one("2").await;
    consume(&ch, "dlq2", &["2"]).await;
    // A runtime policy with the same name wins over the file's.
    b.set_policy(exact(
        "from-file",
        "q",
        json!({"dead-letter-exchange": "dlx", "dead-letter-routing-key": "dlq"}),
    ));
    reject_one("3").await;
    consume(&ch, "dlq", &["3"]).await;
    // Reload without policies: the runtime one stays.
    cfg.policies.clear();
    b.service.reload(&cfg).unwrap();
    reject_one("4").await;
    consume(&ch, "dlq", &["4"]).await;
    b.clear_policy("from-file");
    reject_one("5").await;
    b.wait_counts("q", 0, 0).await;
    consume_empty(&ch, "dlq").await;
    consume_empty(&ch, "dlq2").await;
}

/// An invalid policy is refused and changes nothing.
#[tokio::test]
async fn invalid_policy_is_refused_and_changes_nothing() {
    use dlx_proxy::admin::PolicyControl;
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    let bad = exact("bad", "q", json!({"message-ttl": -1}));
    assert!(b.service.policies.set_policy(bad).is_err());
    let bad = exact("bad", "q", json!({"overflow": "drop-tail"}));
    assert!(b.service.policies.set_policy(bad).is_err());
    publish(&ch, "q", &["m"]).await;
    b.stays_counts("q", 1, 0, 30).await;
}
