//! Least-privilege application users through proxy mode (issue 18): a user who may touch only
//! its own objects, and nothing of the proxy's (no permission at all on the capture exchange
//! or queue), gets through the proxy exactly what RabbitMQ gives it directly: the same
//! accepted declares, the same 403s with RabbitMQ's texts naming the user's own objects, and
//! dead-lettering into its own DLQ. The proxy's own declares run as its service user.

use crate::proxy_support;

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use proxy_support::fleet;
use proxy_support::*;

use crate::common::dl::{
    amqp_code, amqp_text, broker_close, consumer, get_one, nack, next, publish, publish_to, reject,
    x_death,
};

const PASSWORD: &str = "least-privilege-pw";

/// A restricted user and the prefix of its objects: it may configure and read `P-*` (and the
/// server-named `amq.gen-*`), and write only `P-allowed*`, `P-forbidden-dlx*` and the
/// default exchange. Nothing else, so nothing of the proxy's.
struct Limited {
    user: String,
    prefix: String,
    _rabbit: RabbitUser,
}

impl Limited {
    fn new(tag: &str) -> Limited {
        let user = unique(&format!("limited-{tag}"));
        let prefix = format!("{}-", unique(tag));
        let rabbit = RabbitUser::create_with(&user, PASSWORD, "^$");
        let p = regex_escape(&prefix);
        rabbit.set_permissions(
            &format!("^({p}|amq\\.gen-).*"),
            &format!("^({p}allowed|{p}forbidden-dlx|amq\\.default).*"),
            &format!("^({p}|amq\\.gen-).*"),
        );
        Limited {
            user,
            prefix,
            _rabbit: rabbit,
        }
    }

    fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    /// Adds write permission on the exchange `capture` (and nothing else) to the user's.
    fn grant_write(&self, capture: &str) {
        let p = regex_escape(&self.prefix);
        self._rabbit.set_permissions(
            &format!("^({p}|amq\\.gen-).*"),
            &format!(
                "^(({p}allowed|{p}forbidden-dlx|amq\\.default).*|{})$",
                regex_escape(capture)
            ),
            &format!("^({p}|amq\\.gen-).*"),
        );
    }

    async fn connect(&self, host: &str) -> Connection {
        let url = format!("amqp://{}:{PASSWORD}@{host}/%2f", self.user);
        Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("{} connects to {host}: {e}", self.user))
    }
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = ".^$*+?()[]{}|\\".contains(c);
            escape.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// The two ways in: RabbitMQ directly and through the proxy.
fn targets(proxy: &TestProxy) -> [(&'static str, String); 2] {
    [
        ("direct", upstream_host()),
        ("proxy", proxy.addr.to_string()),
    ]
}

fn dlx_args(dlx: &str) -> FieldTable {
    table(&[("x-dead-letter-exchange", ls(dlx))])
}

async fn declare_as(
    ch: &Channel,
    queue: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> Result<lapin::Queue, (u16, String)> {
    ch.queue_declare(queue.into(), options, args)
        .await
        .map_err(|e| (amqp_code(&e).unwrap_or(0), amqp_text(&e)))
}

/// Whether `queue` exists upstream (a passive declare as the administrator).
async fn exists(queue: &str) -> bool {
    fleet::count_at(&upstream_uri(), queue).await.is_some()
}

/// `dlx`, a fanout exchange, and `dlq` bound to it, declared by the administrator.
async fn fanout_dlx(admin: &Channel, dlx: &str, dlq: &str) {
    exchange(admin, dlx, ExchangeKind::Fanout).await;
    declare(admin, dlq, FieldTable::default()).await;
    bind(admin, dlq, dlx, "").await;
}

/// The administrator's channel on RabbitMQ directly.
async fn admin() -> (Connection, Channel) {
    let conn = upstream_connection().await;
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_with_a_writable_dlx_is_accepted_and_an_unwritable_one_gets_rabbitmqs_403() {
    let proxy = TestProxy::start(vec![]).await;
    let limited = Limited::new("decl");
    let dlx = limited.name("forbidden-dlx");
    let other_dlx = limited.name("other-dlx");
    let mut refusals = Vec::new();
    for (label, host) in targets(&proxy) {
        let conn = limited.connect(&host).await;
        let ch = conn.create_channel().await.unwrap();
        let q = limited.name(&format!("allowed.{label}"));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let ok = declare_as(&ch, &q, durable, dlx_args(&dlx))
            .await
            .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        assert_eq!(ok.name().as_str(), q, "{label}");
        // Declared again (the queue exists now): the same answer.
        declare_as(&ch, &q, durable, dlx_args(&dlx))
            .await
            .unwrap_or_else(|e| panic!("{label}, again: {e:?}"));
        assert!(exists(&q).await, "{label}");
        let refused_q = limited.name(&format!("allowed.refused.{label}"));
        let refused = declare_as(&ch, &refused_q, durable, dlx_args(&other_dlx))
            .await
            .map(|q| q.name().to_string())
            .expect_err("no write permission on the dead-letter exchange");
        assert!(!exists(&refused_q).await, "{label}: nothing is created");
        refusals.push(refused);
        let _ = conn.close(200, "done".into()).await;
    }
    let expected = (
        403,
        format!(
            "ACCESS_REFUSED - access to exchange '{other_dlx}' in vhost '/' refused for user '{}'",
            limited.user
        ),
    );
    assert_eq!(refusals[0], expected, "directly");
    assert_eq!(refusals[1], expected, "through the proxy, byte for byte");
    let (conn, ch) = admin().await;
    let direct_q = limited.name("allowed.direct");
    let proxy_q = limited.name("allowed.proxy");
    delete_upstream(&ch, &[&direct_q, &proxy_q], &[]).await;
    let _ = conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// The probe the proxy sends on the client's connection, tried on RabbitMQ directly: it is
/// refused with 406 past the permission checks and creates nothing, and without permission
/// its 403 is the text the client's own declare gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_permission_probe_creates_nothing_and_refuses_as_the_declare_would() {
    use dlx_proxy::proxy::permission::probe;
    let limited = Limited::new("probe");
    let conn = limited.connect(&upstream_host()).await;
    let probe_args = |name: &str, dlx: &str| {
        let declare = lapin::protocol::queue::Declare {
            queue: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: dlx_args(dlx),
        };
        probe(&declare).arguments
    };
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let q = limited.name("allowed.probe");
    let dlx = limited.name("forbidden-dlx");
    let ch = conn.create_channel().await.unwrap();
    let (code, text) = declare_as(&ch, &q, durable, probe_args(&q, &dlx))
        .await
        .map(|_| ())
        .expect_err("the probe is always refused");
    assert_eq!(code, 406, "{text}");
    assert!(!exists(&q).await, "the probe created {q}");
    // The same on a queue that exists (RabbitMQ compares it and refuses).
    let ch = conn.create_channel().await.unwrap();
    declare_as(&ch, &q, durable, dlx_args(&dlx)).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let (code, _) = declare_as(&ch, &q, durable, probe_args(&q, &dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(code, 406);
    // No write on the dead-letter exchange: the probe's refusal is the declare's.
    let other_dlx = limited.name("other-dlx");
    let fresh = limited.name("allowed.probe2");
    let ch = conn.create_channel().await.unwrap();
    let probed = declare_as(&ch, &fresh, durable, probe_args(&fresh, &other_dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    let ch = conn.create_channel().await.unwrap();
    let declared = declare_as(&ch, &fresh, durable, dlx_args(&other_dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(probed.0, 403);
    assert_eq!(probed, declared);
    assert!(!exists(&fresh).await);
    // A queue that exists (the administrator's) with a dead-letter exchange the user may not
    // write to: RabbitMQ 3.10 checks that exchange only when it creates a queue, so the user's
    // redeclare is accepted, and the probe is refused at the comparison (406: permitted).
    let existing = limited.name("allowed.existing");
    let (admin_conn, admin_ch) = admin().await;
    declare_as(&admin_ch, &existing, durable, dlx_args(&other_dlx))
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    declare_as(&ch, &existing, durable, dlx_args(&other_dlx))
        .await
        .expect("a redeclare is not checked on the dead-letter exchange");
    let (code, _) = declare_as(&ch, &existing, durable, probe_args(&existing, &other_dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(code, 406);
    delete_upstream(&admin_ch, &[&existing], &[]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    // No configure permission: the same 403 too.
    let foreign = unique("not-limited");
    let ch = conn.create_channel().await.unwrap();
    let probed = declare_as(&ch, &foreign, durable, probe_args(&foreign, &dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    let ch = conn.create_channel().await.unwrap();
    let declared = declare_as(&ch, &foreign, durable, dlx_args(&dlx))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(probed.0, 403);
    assert_eq!(probed, declared);
    let _ = conn.close(200, "done".into()).await;
    let (conn, ch) = admin().await;
    delete_upstream(&ch, &[&q], &[]).await;
    let _ = conn.close(200, "done".into()).await;
}

/// Dead-lettering for a user with no permission on anything of the proxy's: rejected,
/// expired, overflowed and over the delivery limit, each lands in the user's DLQ with the
/// x-death a direct client gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restricted_users_dead_letters_land_in_its_dlq() {
    let proxy = TestProxy::start(vec![]).await;
    let limited = Limited::new("dl");
    let dlx = limited.name("forbidden-dlx");
    let dlq = limited.name("allowed.dlq");
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &dlx, &dlq).await;
    let mut dead = consumer(&admin_ch, &dlq, "dlq-reader").await;

    let conn = limited.connect(&proxy.addr.to_string()).await;
    let ch = conn.create_channel().await.unwrap();
    let with = |extra: &[(&str, AMQPValue)]| {
        let mut args = dlx_args(&dlx);
        for (k, v) in extra {
            args.insert((*k).into(), v.clone());
        }
        args
    };
    let rejected = limited.name("allowed.rejected");
    let expired = limited.name("allowed.expired");
    let overflowed = limited.name("allowed.maxlen");
    let limited_q = limited.name("allowed.limit");
    declare(&ch, &rejected, with(&[])).await;
    declare(
        &ch,
        &expired,
        with(&[("x-message-ttl", AMQPValue::LongInt(0))]),
    )
    .await;
    declare(
        &ch,
        &overflowed,
        with(&[("x-max-length", AMQPValue::LongInt(1))]),
    )
    .await;
    declare(
        &ch,
        &limited_q,
        with(&[("x-delivery-limit", AMQPValue::LongInt(0))]),
    )
    .await;

    publish(&ch, &rejected, &["r"]).await;
    let d = get_one(&ch, &rejected).await;
    reject(&ch, d.delivery_tag, false).await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "r");
    assert_eq!(x_death(&got)[0].qrc(), (rejected.as_str(), "rejected", 1));

    publish(&ch, &expired, &["e"]).await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "e");
    assert_eq!(x_death(&got)[0].qrc(), (expired.as_str(), "expired", 1));

    publish(&ch, &overflowed, &["m1", "m2"]).await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "m1");
    assert_eq!(x_death(&got)[0].qrc(), (overflowed.as_str(), "maxlen", 1));

    publish(&ch, &limited_q, &["l"]).await;
    let d = get_one(&ch, &limited_q).await;
    nack(&ch, d.delivery_tag, false, true).await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "l");
    assert_eq!(
        x_death(&got)[0].qrc(),
        (limited_q.as_str(), "delivery_limit", 1)
    );
    assert_eq!(
        x_death(&got)[0].exchange,
        "",
        "published to the default exchange"
    );

    let _ = conn.close(200, "done".into()).await;
    delete_upstream(
        &admin_ch,
        &[&rejected, &expired, &overflowed, &limited_q, &dlq],
        &[&dlx],
    )
    .await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// basic.consume without read permission: RabbitMQ's 403, the same through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consume_without_read_permission_gets_rabbitmqs_403() {
    let proxy = TestProxy::start(vec![]).await;
    let limited = Limited::new("read");
    let secret = unique("secret");
    let (admin_conn, admin_ch) = admin().await;
    declare(&admin_ch, &secret, FieldTable::default()).await;
    let mut refusals = Vec::new();
    for (label, host) in targets(&proxy) {
        let conn = limited.connect(&host).await;
        let ch = conn.create_channel().await.unwrap();
        let err = ch
            .basic_consume(
                secret.as_str().into(),
                "c".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map(|_| ())
            .expect_err(label);
        refusals.push((amqp_code(&err), amqp_text(&err)));
        let _ = conn.close(200, "done".into()).await;
    }
    assert_eq!(
        refusals[0],
        (
            Some(403),
            format!(
                "ACCESS_REFUSED - access to queue '{secret}' in vhost '/' refused for user '{}'",
                limited.user
            )
        )
    );
    assert_eq!(refusals[1], refusals[0]);
    delete_upstream(&admin_ch, &[&secret], &[]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// Server-named, exclusive and auto-delete queues of a restricted user behave as for a
/// direct client: declared, named, and an auto-delete queue goes with its last consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_named_exclusive_and_auto_delete_queues_work_as_directly() {
    let proxy = TestProxy::start(vec![]).await;
    let limited = Limited::new("own");
    let dlx = limited.name("forbidden-dlx");
    for (label, host) in targets(&proxy) {
        let conn = limited.connect(&host).await;
        let ch = conn.create_channel().await.unwrap();
        let named = declare_as(
            &ch,
            "",
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            dlx_args(&dlx),
        )
        .await
        .unwrap_or_else(|e| panic!("{label}: server-named {e:?}"));
        assert!(named.name().as_str().starts_with("amq.gen-"), "{label}");
        // Server-named and not exclusive (it expires a second after its last use).
        let mut args = dlx_args(&dlx);
        args.insert("x-expires".into(), AMQPValue::LongInt(1000));
        let shared = declare_as(&ch, "", QueueDeclareOptions::default(), args)
            .await
            .unwrap_or_else(|e| panic!("{label}: server-named, shared {e:?}"));
        assert!(shared.name().as_str().starts_with("amq.gen-"), "{label}");
        assert!(exists(shared.name().as_str()).await, "{label}");
        let exclusive = limited.name(&format!("allowed.excl.{label}"));
        declare_as(
            &ch,
            &exclusive,
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            dlx_args(&dlx),
        )
        .await
        .unwrap_or_else(|e| panic!("{label}: exclusive {e:?}"));
        // An exclusive queue with a dead-letter exchange the user may not write to: 403, as
        // RabbitMQ says it.
        let (code, text) = declare_as(
            &ch,
            &limited.name(&format!("allowed.excl2.{label}")),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            dlx_args(&limited.name("other-dlx")),
        )
        .await
        .map(|_| ())
        .unwrap_err();
        assert_eq!(code, 403, "{label}: {text}");
        assert!(text.contains(&limited.name("other-dlx")), "{label}: {text}");
        let ch = conn.create_channel().await.unwrap();
        let auto = limited.name(&format!("allowed.auto.{label}"));
        declare_as(
            &ch,
            &auto,
            QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            dlx_args(&dlx),
        )
        .await
        .unwrap_or_else(|e| panic!("{label}: auto-delete {e:?}"));
        assert!(exists(&auto).await, "{label}: declared, not consumed yet");
        let consumer = ch
            .basic_consume(
                auto.as_str().into(),
                "auto".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        ch.basic_cancel(
            consumer.tag().as_str().into(),
            BasicCancelOptions::default(),
        )
        .await
        .unwrap();
        crate::common::wait_until(
            "the auto-delete queue is gone with its consumer",
            std::time::Duration::from_secs(10),
            async || !exists(&auto).await,
        )
        .await;
        let _ = conn.close(200, "done".into()).await;
    }
    proxy.stop().await;
}

/// A dead letter carries the user_id the original had, and nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_the_user_id_of_its_original() {
    let proxy = TestProxy::start(vec![]).await;
    let limited = Limited::new("uid");
    let dlx = limited.name("forbidden-dlx");
    let dlq = limited.name("allowed.uid-dlq");
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &dlx, &dlq).await;
    let mut dead = consumer(&admin_ch, &dlq, "uid-reader").await;
    let conn = limited.connect(&proxy.addr.to_string()).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = limited.name("allowed.uid");
    declare(&ch, &q, dlx_args(&dlx)).await;
    for (body, user_id) in [("stamped", Some(limited.user.as_str())), ("plain", None)] {
        let mut props = AMQPProperties::default();
        if let Some(id) = user_id {
            props = props.with_user_id(id.into());
        }
        assert!(
            publish_to(&ch, "", &q, body.as_bytes(), props)
                .await
                .is_ack()
        );
        let d = get_one(&ch, &q).await;
        reject(&ch, d.delivery_tag, false).await;
        let got = next(&mut dead).await;
        assert_eq!(payload(&got), body);
        assert_eq!(
            got.properties.user_id().as_ref().map(|u| u.as_str()),
            user_id
        );
        assert_eq!(x_death(&got)[0].qrc(), (q.as_str(), "rejected", 1));
    }
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(&admin_ch, &[&q, &dlq], &[&dlx]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// The service user publishes captured dead letters; one carrying another user's `user_id`
/// needs the `impersonator` tag. Without it the dead letter is held (not lost), counted under
/// its own cause, and lands once the tag is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_user_id_without_the_impersonator_tag_is_held_until_the_tag_is_given() {
    let service = unique("svc-no-impersonator");
    let service_user = RabbitUser::create(&service, PASSWORD);
    let name = service.clone();
    let proxy = TestProxy::start_with(vec![], move |config| {
        config.upstream.user = name;
        config.upstream.password = PASSWORD.into();
    })
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("uid-ttl");
    let dlx = unique("uid-ttl-dlx");
    let dlq = unique("uid-ttl-dlq");
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &dlx, &dlq).await;
    declare(
        &ch,
        &q,
        table(&[
            ("x-dead-letter-exchange", ls(&dlx)),
            ("x-message-ttl", AMQPValue::LongInt(0)),
        ]),
    )
    .await;
    // guest stamps its own id; it expires upstream and is captured.
    let stamped = AMQPProperties::default().with_user_id("guest".into());
    assert!(publish_to(&ch, "", &q, b"stamped", stamped).await.is_ack());
    proxy
        .wait_counter(
            "dead_letter_publish_failures_total",
            &[("cause", "user_id_refused")],
            2.0,
        )
        .await;
    assert_eq!(proxy.counter("dead_letters_held", &[]), 1.0);
    assert_eq!(fleet::count_at(&upstream_uri(), &dlq).await, Some(0));
    let tagged = rabbitmqctl(&["set_user_tags", &service, "impersonator"]);
    assert!(tagged.status.success(), "{tagged:?}");
    // RabbitMQ reads a user's tags when it logs in: the service connection logs in again (an
    // operator closes it; the proxy reconnects at once and the capture queue redelivers).
    let name = format!("dlx-proxy service {} /", proxy.capture);
    assert_eq!(close_upstream_connection(&name, "tags changed"), 1);
    let mut dead = consumer(&admin_ch, &dlq, "uid-ttl-reader").await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "stamped");
    assert_eq!(
        got.properties.user_id().as_ref().map(|u| u.as_str()),
        Some("guest")
    );
    assert_eq!(x_death(&got)[0].qrc(), (q.as_str(), "expired", 1));
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(&admin_ch, &[&q, &dlq], &[&dlx]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
    drop(service_user);
}

/// A TOML policy's dead-letter exchange is the proxy's to apply, as a RabbitMQ policy is the
/// broker's: a restricted user needs no write permission on it, neither to declare an
/// exclusive queue under the policy nor for its rejections to land there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_dead_letter_exchange_needs_no_permission_of_the_user() {
    let limited = Limited::new("pol");
    let dlx = limited.name("policy-dlx");
    let dlq = limited.name("allowed.policy-dlq");
    let pattern = format!("^{}allowed\\.pol", regex_escape(&limited.prefix));
    let proxy = TestProxy::start(vec![policy(
        "least-privilege-dlx",
        &pattern,
        serde_json::json!({ "dead-letter-exchange": dlx }),
    )])
    .await;
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &dlx, &dlq).await;
    let mut dead = consumer(&admin_ch, &dlq, "policy-reader").await;
    let conn = limited.connect(&proxy.addr.to_string()).await;
    let ch = conn.create_channel().await.unwrap();
    for (label, exclusive) in [("shared", false), ("excl", true)] {
        let q = limited.name(&format!("allowed.pol.{label}"));
        declare_as(
            &ch,
            &q,
            QueueDeclareOptions {
                exclusive,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        publish(&ch, &q, &[label]).await;
        let d = get_one(&ch, &q).await;
        reject(&ch, d.delivery_tag, false).await;
        let got = next(&mut dead).await;
        assert_eq!(payload(&got), label);
        assert_eq!(x_death(&got)[0].qrc(), (q.as_str(), "rejected", 1));
    }
    assert_eq!(proxy.counter("dead_letters_by_service_total", &[]), 2.0);
    let shared_q = limited.name("allowed.pol.shared");
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(&admin_ch, &[&shared_q, &dlq], &[&dlx]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// What the capture-write probe relies on, in RabbitMQ itself: a basic.publish inside a
/// transaction is refused with 403 at once when the user may not write the exchange (the
/// channel closes, naming it), and a permitted one is discarded by tx.rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_checks_write_permission_on_a_publish_in_a_transaction_and_rolls_it_back() {
    let limited = Limited::new("txw");
    let writable = limited.name("allowed.tx-x");
    let forbidden = limited.name("other-x");
    let queue = limited.name("allowed.tx-q");
    let (admin_conn, admin_ch) = admin().await;
    for x in [&writable, &forbidden] {
        exchange(&admin_ch, x, ExchangeKind::Fanout).await;
    }
    declare(&admin_ch, &queue, FieldTable::default()).await;
    bind(&admin_ch, &queue, &writable, "").await;
    bind(&admin_ch, &queue, &forbidden, "").await;
    let conn = limited.connect(&upstream_host()).await;
    let ch = conn.create_channel().await.unwrap();
    ch.tx_select().await.unwrap();
    publish_to(
        &ch,
        &writable,
        "",
        b"rolled back",
        AMQPProperties::default(),
    )
    .await;
    ch.tx_rollback().await.unwrap();
    assert_eq!(message_count(&admin_ch, &queue).await, 0, "nothing routed");
    // RabbitMQ's channel.close can reach lapin before the rollback is sent; the reason is
    // then on the connection's events.
    let mut events = Box::pin(conn.events_listener());
    let _ = ch
        .basic_publish(
            forbidden.as_str().into(),
            "".into(),
            BasicPublishOptions::default(),
            b"refused",
            AMQPProperties::default(),
        )
        .await;
    let err = ch.tx_rollback().await.unwrap_err();
    let err = broker_close(&mut events, err).await;
    assert_eq!(amqp_code(&err), Some(403), "{err}");
    let text = amqp_text(&err);
    assert!(text.contains(&forbidden), "{text}");
    assert_eq!(message_count(&admin_ch, &queue).await, 0);
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(&admin_ch, &[&queue], &[&writable, &forbidden]).await;
    let _ = admin_conn.close(200, "done".into()).await;
}

/// Own queues (exclusive, server-named: RPC reply queues, temporary subscriber queues) of a
/// user who may write the capture exchange, guest or an application user granted it, get the
/// proxy's dead-lettering: an exclusive queue under a TOML policy giving TTL and dead-letter
/// exchange, and a server-named exclusive one with its own (a TOML policy cannot name a
/// server-named queue, whose name is unknown when it is declared). Their expired messages
/// land in the DLQ with the proxy's x-death, captured by the proxy. The probe that found this
/// out published nothing: the only captured messages are the expired ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_queues_of_a_user_who_may_write_the_capture_exchange_dead_letter_through_the_proxy() {
    let limited = Limited::new("capw");
    let dlx = limited.name("allowed.own-dlx");
    let dlq = limited.name("allowed.own-dlq");
    let pattern = format!("^{}allowed\\.own-excl", regex_escape(&limited.prefix));
    let proxy = TestProxy::start(vec![policy(
        "own-queues",
        &pattern,
        serde_json::json!({ "dead-letter-exchange": dlx, "message-ttl": 200 }),
    )])
    .await;
    limited.grant_write(&proxy.capture);
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &dlx, &dlq).await;
    let mut dead = consumer(&admin_ch, &dlq, "own-reader").await;
    let guest = proxy.connect().await;
    let granted = limited.connect(&proxy.addr.to_string()).await;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let mut own_args = dlx_args(&dlx);
    own_args.insert("x-message-ttl".into(), AMQPValue::LongInt(200));
    for (label, conn) in [("guest", &guest), ("granted", &granted)] {
        let ch = conn.create_channel().await.unwrap();
        let named = limited.name(&format!("allowed.own-excl.{label}"));
        declare_as(&ch, &named, exclusive, FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        publish(&ch, &named, &[label]).await;
        let got = next(&mut dead).await;
        assert_eq!(payload(&got), label);
        assert_eq!(x_death(&got)[0].qrc(), (named.as_str(), "expired", 1));
        // A second own queue on the same connection, server-named: the answer is kept.
        let q = declare_as(&ch, "", exclusive, own_args.clone())
            .await
            .unwrap_or_else(|e| panic!("{label}, server-named: {e:?}"));
        let q = q.name().as_str().to_string();
        assert!(q.starts_with("amq.gen-"), "{q}");
        publish(&ch, &q, &[label]).await;
        let got = next(&mut dead).await;
        assert_eq!(payload(&got), label);
        assert_eq!(
            x_death(&got)[0].qrc(),
            (q.as_str(), "expired", 1),
            "{label}"
        );
    }
    // The capture exchange in place of the queue's own dead-letter exchange grants nothing:
    // one the user may not write is still refused with RabbitMQ's 403 naming it.
    let ch = granted.create_channel().await.unwrap();
    let other = limited.name("other-dlx");
    let (code, text) = declare_as(&ch, "", exclusive, dlx_args(&other))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(code, 403, "{text}");
    assert!(
        text.contains(&other) && !text.contains(&proxy.capture),
        "{text}"
    );
    proxy
        .wait_counter(
            "captured_total",
            &[("outcome", "dead_lettered"), ("vhost", "/")],
            4.0,
        )
        .await;
    for outcome in ["dropped", "discarded"] {
        let labels = [("outcome", outcome), ("vhost", "/")];
        assert_eq!(proxy.counter("captured_total", &labels), 0.0, "{outcome}");
    }
    assert_eq!(message_count(&admin_ch, &proxy.capture).await, 0);
    for conn in [guest, granted] {
        assert!(conn.status().connected());
        let _ = conn.close(200, "done".into()).await;
    }
    delete_upstream(&admin_ch, &[&dlq], &[&dlx]).await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// The same own queue of a restricted user who may not write the capture exchange: the
/// declare works as directly (the probe's 403 never reaches the client), the policy's
/// dead-letter settings do not apply, and the queue's own dead-letter exchange and TTL
/// dead-letter natively (nothing is captured).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_queues_of_a_user_who_may_not_write_the_capture_exchange_dead_letter_natively() {
    let limited = Limited::new("capn");
    let own_dlx = limited.name("forbidden-dlx");
    let own_dlq = limited.name("allowed.own-native-dlq");
    let policy_dlx = limited.name("allowed.policy-native-dlx");
    let policy_dlq = limited.name("allowed.policy-native-dlq");
    let pattern = format!("^{}allowed\\.own-excl", regex_escape(&limited.prefix));
    let proxy = TestProxy::start(vec![policy(
        "own-queues",
        &pattern,
        serde_json::json!({ "dead-letter-exchange": policy_dlx, "message-ttl": 100 }),
    )])
    .await;
    let (admin_conn, admin_ch) = admin().await;
    fanout_dlx(&admin_ch, &own_dlx, &own_dlq).await;
    fanout_dlx(&admin_ch, &policy_dlx, &policy_dlq).await;
    let mut dead = consumer(&admin_ch, &own_dlq, "own-native-reader").await;
    let conn = limited.connect(&proxy.addr.to_string()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = dlx_args(&own_dlx);
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(100));
    let q = declare_as(
        &ch,
        "",
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declared as directly");
    let q = q.name().as_str().to_string();
    publish(&ch, &q, &["native"]).await;
    let got = next(&mut dead).await;
    assert_eq!(payload(&got), "native");
    assert_eq!(x_death(&got)[0].qrc(), (q.as_str(), "expired", 1));
    // An exclusive queue under the policy: its TTL applies, its dead-letter exchange does not
    // (RabbitMQ would check the user's write permission on it): the expired message is
    // discarded natively.
    let named = limited.name("allowed.own-excl.native");
    declare_as(
        &ch,
        &named,
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declared as directly");
    publish(&ch, &named, &["discarded"]).await;
    wait_count(&ch, &named, 0).await;
    assert_eq!(
        message_count(&admin_ch, &policy_dlq).await,
        0,
        "no policy DLX"
    );
    // A capture would be counted at its confirm, after the DLQ shows it.
    for outcome in ["dead_lettered", "dropped", "discarded"] {
        let labels = [("outcome", outcome), ("vhost", "/")];
        proxy
            .stays(
                "captured_total",
                &labels,
                0.0,
                std::time::Duration::from_millis(300),
            )
            .await;
    }
    assert!(conn.status().connected());
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(
        &admin_ch,
        &[&own_dlq, &policy_dlq],
        &[&own_dlx, &policy_dlx],
    )
    .await;
    let _ = admin_conn.close(200, "done".into()).await;
    proxy.stop().await;
}

/// A user who may write only its own exchange (not `amq.default`) consumes and publishes on
/// one connection and requeues on a classic queue whose delivery limit the proxy counts: the
/// republish with `x-delivery-count` + 1 is refused to its user, so the service user makes it
/// (RabbitMQ requeues without a permission check); the message comes back counted and is
/// dead-lettered past the limit. (RabbitMQ's 403 names the default exchange `amq.default`,
/// which the proxy did not match: the requeue was held and retried for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeues_of_a_user_without_the_default_exchange_count_against_the_limit() {
    let proxy = TestProxy::start(vec![]).await;
    let prefix = format!("{}-", unique("no-default"));
    let user = unique("no-default-user");
    let rabbit = RabbitUser::create_with(&user, PASSWORD, "^$");
    let p = regex_escape(&prefix);
    rabbit.set_permissions("^$", &format!("^{p}x$"), &format!("^{p}.*"));
    let (q, dlq, x) = (
        format!("{prefix}q"),
        format!("{prefix}dlq"),
        format!("{prefix}x"),
    );
    // Declared through the proxy by the administrator: the proxy counts the limit.
    let admin = proxy.connect().await;
    let ach = admin.create_channel().await.unwrap();
    let dlx = unique("no-default-dlx");
    declare_dlx(&ach, &dlx, &dlq).await;
    let limited = table(&[
        ("x-dead-letter-exchange", ls(&dlx)),
        ("x-dead-letter-routing-key", ls(&dlq)),
        ("x-delivery-limit", AMQPValue::LongInt(1)),
    ]);
    declare(&ach, &q, limited).await;
    exchange(&ach, &x, ExchangeKind::Fanout).await;
    bind(&ach, &q, &x, "").await;

    let url = format!("amqp://{user}:{PASSWORD}@{}/%2f", proxy.addr);
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("the user connects");
    let ch = conn.create_channel().await.unwrap();
    // It publishes on this connection: its requeues are published on it too.
    publish_to(&ch, &x, "", b"m", AMQPProperties::default()).await;
    let first = get(&ch, &q).await;
    assert_eq!(header(&first, "x-delivery-count"), None);
    nack(&ch, first.delivery_tag, false, true).await;
    let second = get(&ch, &q).await;
    assert_eq!(
        header(&second, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    nack(&ch, second.delivery_tag, false, true).await;
    let dead = get(&ach, &dlq).await;
    assert_eq!(x_death(&dead)[0].qrc(), (q.as_str(), "delivery_limit", 1));
    proxy.wait_dead_lettered(&q, "delivery_limit", 1.0).await;
    assert!(conn.status().connected());
    let _ = conn.close(200, "done".into()).await;
    delete_upstream(&ach, &[&q, &dlq], &[&dlx, &x]).await;
    let _ = admin.close(200, "done".into()).await;
    proxy.stop().await;
}
