//! Brownfield queues through upstream policies (`upstream.management_url`): a queue declared
//! straight on RabbitMQ before the proxy started gets the proxy's TTL and dead-letter target
//! through the upstream policy `<capture name>.<name>`, its messages expire into the capture path
//! and reach the policy's dead-letter queue as a client of the proxy sees them; a policy
//! removed from the TOML file (reload) is deleted upstream, and the user's own policies are
//! never touched. The route goes in once the service connection has created the capture path
//! (at start, no client needed), an admin-API change is mirrored at once, and a refused login
//! is counted without showing the password; the sync runs as the proxy's service user with
//! the `policymaker` tag and only the permissions its capture path needs.
//!
//! Runs its own RabbitMQ node with the management plugin (the shared nodes run none).

use crate::common;
use crate::common::dl_policy::pattern;
use crate::proxy_support::fleet::{ProxyProcess, fleet_toml};
use crate::proxy_support::policy;
use crate::rabbit::{NodeOptions, RabbitNode};

use std::sync::OnceLock;
use std::time::Duration;

use common::dl::{
    assert_first_death, consume_empty, declare_dlx, declare_durable, get, get_and_reject, payload,
    publish, x_death,
};
use common::{admin_call, poll, unique, write_atomically};
use dlx_proxy::proxy::declare::CaptureTag;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde_json::{Value, json};

/// The node of this module, with the management plugin.
fn node() -> &'static RabbitNode {
    static NODE: OnceLock<RabbitNode> = OnceLock::new();
    NODE.get_or_init(|| {
        RabbitNode::start_with(
            "mgmt",
            &NodeOptions {
                plugins: vec!["rabbitmq_management"],
            },
        )
    })
}

/// The policies of vhost "/" as the management API lists them.
async fn upstream_policies(node: &RabbitNode) -> Vec<Value> {
    let (status, body) = node.management_call("GET", "/api/policies/%2F", None).await;
    assert_eq!(status, 200, "GET /api/policies/%2F: {body}");
    serde_json::from_str(&body).expect("policy listing JSON")
}

fn named<'a>(policies: &'a [Value], name: &str) -> Option<&'a Value> {
    policies.iter().find(|p| p["name"] == name)
}

/// Polls the upstream's policies until `check` accepts them (panics after 20 s).
async fn wait_policies(
    node: &RabbitNode,
    what: &str,
    check: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let found = poll(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let policies = upstream_policies(node).await;
            check(&policies).then_some(policies)
        },
    )
    .await;
    match found {
        Some(policies) => policies,
        None => panic!(
            "{what}: upstream policies are {:#?}",
            upstream_policies(node).await
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_older_than_the_proxy_dead_letters_through_the_upstream_policy() {
    let node = node();
    let queue = unique("legacy");
    let dlx = unique("legacy-dlx");
    let dlq = unique("legacy-dlq");

    // Before the proxy: a queue declared straight on RabbitMQ, with messages, and a policy of
    // the user's own.
    let direct = Connection::connect(&node.uri(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let ch = direct.create_channel().await.unwrap();
    declare_durable(&ch, &queue, FieldTable::default()).await;
    declare_dlx(&ch, &dlx, &dlq).await;
    publish(&ch, &queue, &["old-1", "old-2"]).await;
    let users_own = json!({"pattern": "^users-own\\.", "apply-to": "queues", "priority": 3,
                           "definition": {"max-length": 7}});
    let (status, body) = node
        .management_call(
            "PUT",
            "/api/policies/%2F/users-own",
            Some(&users_own.to_string()),
        )
        .await;
    assert!(
        matches!(status, 201 | 204),
        "PUT users-own: {status} {body}"
    );

    // The proxy starts with a TTL + DLX policy for that queue.
    let capture = unique("capture");
    // And a policy for every queue, of a lower priority: the capture queue must not get it.
    let exact = format!("^{}$", regex::escape(&queue));
    let policies = vec![
        pattern(
            "legacy-ttl",
            &exact,
            5,
            json!({"message-ttl": 300, "dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
        ),
        pattern("broad", ".*", 0, json!({"max-length": 100000})),
    ];
    let toml = fleet_toml(
        &[node.uri()],
        &policies,
        &capture,
        &management_toml(node, "guest", "guest"),
    );
    let proxy = ProxyProcess::spawn(&toml).await;
    // A client of the proxy: its connection creates and consumes the capture path.
    let client = proxy.connect().await;
    let client_ch = client.create_channel().await.unwrap();

    let (ttl_name, broad_name) = (format!("{capture}.legacy-ttl"), format!("{capture}.broad"));
    let listed = wait_policies(node, "legacy-ttl put", |p| {
        named(p, &ttl_name).is_some() && named(p, &broad_name).is_some()
    })
    .await;
    let mirror = named(&listed, &ttl_name).unwrap();
    let keep_out = format!(
        "^(?!{}(?:\\.retry\\.[0-9]+)?$)[\\s\\S]*?",
        regex::escape(&capture)
    );
    assert_eq!(mirror["pattern"], format!("{keep_out}(?:{exact})"));
    assert_eq!(mirror["apply-to"], "queues");
    assert_eq!(mirror["priority"], 5);
    // A delay queue of the retry tiers (the proxy declares them when a tier is used; made
    // here as such a name).
    let delay = format!("{capture}.retry.1000");
    declare_durable(&ch, &delay, FieldTable::default()).await;
    // RabbitMQ reads the patterns as meant: the broad one reaches the DLQ (a queue it never
    // saw declared), not the capture queue nor the delay queue; the old queue gets the
    // higher priority.
    let expected = [
        (dlq.as_str(), json!(broad_name)),
        (capture.as_str(), Value::Null),
        (delay.as_str(), Value::Null),
        (queue.as_str(), json!(ttl_name)),
    ];
    let policy_of = async |name: &str| {
        // The listing's `policy` column follows the statistics, seconds behind.
        let (_, body) = node
            .management_call("GET", "/api/queues/%2F?columns=name,policy", None)
            .await;
        let queues: Vec<Value> = serde_json::from_str(&body).unwrap_or_default();
        // None while the queue is not listed.
        let found = queues.into_iter().find(|q| q["name"] == name);
        found.map(|q| q["policy"].clone())
    };
    let applied = poll(
        Duration::from_secs(20),
        Duration::from_millis(500),
        async || {
            for (name, policy) in &expected {
                if policy_of(name).await.as_ref() != Some(policy) {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    if applied.is_none() {
        let (_, body) = node
            .management_call("GET", "/api/queues/%2F?columns=name,policy", None)
            .await;
        panic!("expected {expected:?}, the upstream's queues: {body}");
    }
    let definition = &mirror["definition"];
    assert_eq!(definition["message-ttl"], 300);
    assert_eq!(definition["dead-letter-exchange"], capture.as_str());
    let tag = CaptureTag::decode(definition["dead-letter-routing-key"].as_str().unwrap());
    assert_eq!(
        tag,
        Some(CaptureTag {
            dead_letter_exchange: Some(dlx.clone()),
            dead_letter_routing_key: Some(dlq.clone()),
            delivery_limit: None,
            retry_delays: None,
        })
    );
    assert_eq!(
        named(&listed, "users-own").unwrap()["definition"],
        users_own["definition"]
    );

    // The messages already there keep what they had when they were enqueued (RabbitMQ fixes
    // a message's expiry then) and, in a classic queue, would hold back every expiry behind
    // them: a client of the proxy rejects them, and they are dead-lettered by the policy.
    get_and_reject(&client_ch, &queue, "old-1").await;
    get_and_reject(&client_ch, &queue, "old-2").await;
    // Messages published straight to the old queue from now on expire upstream, into the
    // capture path, and the proxy dead-letters them as the policy says.
    publish(&ch, &queue, &["new-1", "new-2"]).await;

    // The client sees all four in the DLQ as RabbitMQ would have dead-lettered them itself.
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while seen.len() < 4 && std::time::Instant::now() < deadline {
        match get(&client_ch, &dlq).await {
            Some(d) => {
                let body = payload(&d);
                let reason = if body.starts_with("old") {
                    "rejected"
                } else {
                    "expired"
                };
                let deaths = x_death(&d);
                assert_eq!(deaths.len(), 1, "{body}: {deaths:?}");
                assert_eq!(deaths[0].qrc(), (queue.as_str(), reason, 1), "{body}");
                assert_eq!(deaths[0].exchange, "");
                assert_eq!(deaths[0].routing_keys, vec![queue.clone()]);
                assert_first_death(&d, reason, &queue, "");
                assert_eq!(d.routing_key.as_str(), dlq, "{body}");
                seen.push(body);
            }
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    seen.sort();
    if seen.len() < 4 {
        let columns = "name,messages,policy,effective_policy_definition";
        let (_, queues) = node
            .management_call("GET", &format!("/api/queues/%2F?columns={columns}"), None)
            .await;
        panic!(
            "dead letters seen: {seen:?}\nupstream queues: {queues}\n{}",
            proxy.logs()
        );
    }
    assert_eq!(seen, ["new-1", "new-2", "old-1", "old-2"]);
    // Nothing left in the old queue.
    consume_empty(&client_ch, &queue).await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &queue), ("reason", "rejected"), ("vhost", "/")],
            2.0,
        )
        .await;
    proxy
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &queue), ("reason", "expired"), ("vhost", "/")],
            2.0,
        )
        .await;
    proxy.wait_gauge("upstream_policies_synced", &[], 2.0).await;

    // The policy removed from the file: the reload deletes it upstream; the user's stays.
    remove_policies(&proxy);
    let listed = wait_policies(node, "legacy-ttl deleted", |p| {
        named(p, &ttl_name).is_none() && named(p, &broad_name).is_none()
    })
    .await;
    let users = named(&listed, "users-own").expect("the user's policy is untouched");
    assert_eq!(users["definition"], users_own["definition"]);
    assert_eq!(users["priority"], 3);
    proxy.wait_gauge("upstream_policies_synced", &[], 0.0).await;
    assert!(
        proxy
            .counter("upstream_policy_sync_total", &[("result", "success")])
            .await
            >= 2.0
    );

    let _ = node
        .management_call("DELETE", "/api/policies/%2F/users-own", None)
        .await;
    client.close(200, "bye".into()).await.ok();
    direct.close(200, "bye".into()).await.ok();
}

/// Rewrites `proxy`'s configuration file without its policies (the file watch reloads it).
fn remove_policies(proxy: &ProxyProcess) {
    let mut config: toml::Table = std::fs::read_to_string(proxy.config_path())
        .unwrap()
        .parse()
        .unwrap();
    config.remove("policies");
    write_atomically(proxy.config_path(), &toml::to_string(&config).unwrap());
}

/// The `[upstream]` keys of a proxy syncing its policies with `node` every second as `user`,
/// deleting what it lacks at once.
fn management_toml(node: &RabbitNode, user: &str, password: &str) -> String {
    let management = node.management.expect("management listener");
    format!(
        "[upstream]\nmanagement_url = \"http://{management}\"\n\
         management_sync_interval_secs = 1\nmanagement_delete_grace_secs = 0\n\
         user = \"{user}\"\npassword = \"{password}\"\n"
    )
}

/// The proxy's service user as docs/deploy.md asks for it: the `policymaker` tag (for the
/// management API) and, in vhost "/", configure and read on the capture name and write on the
/// capture queue and the dead-letter exchange `dlx` (its service connection owns the capture
/// path and publishes the dead letters).
async fn least_privileged_user(node: &RabbitNode, user: &str, password: &str, capture: &str) {
    let body = json!({"password": password, "tags": "policymaker"}).to_string();
    let (status, text) = node
        .management_call("PUT", &format!("/api/users/{user}"), Some(&body))
        .await;
    assert!(matches!(status, 201 | 204), "PUT user: {status} {text}");
    let capture = regex::escape(capture);
    let body = json!({
        "configure": format!("^{capture}$"),
        "write": format!("^({capture}|dlx)$"),
        "read": format!("^{capture}$"),
    })
    .to_string();
    let (status, text) = node
        .management_call("PUT", &format!("/api/permissions/%2F/{user}"), Some(&body))
        .await;
    assert!(
        matches!(status, 201 | 204),
        "PUT permissions: {status} {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sync_routes_into_the_capture_follows_the_admin_api_and_counts_failures() {
    let node = node();
    let queue = unique("early");
    let policies = vec![policy(
        "early-ttl",
        &format!("^{}$", regex::escape(&queue)),
        json!({"message-ttl": 1000, "dead-letter-exchange": "dlx"}),
    )];
    let capture = unique("capture");
    let (early, added_name) = (format!("{capture}.early-ttl"), format!("{capture}.added"));
    least_privileged_user(node, "dlx-sync", "sync-pw", &capture).await;
    let toml = fleet_toml(
        &[node.uri()],
        &policies,
        &capture,
        &management_toml(node, "dlx-sync", "sync-pw"),
    );
    // The service connection declares the capture path at start (no client needed), and the
    // sync puts the policy with the route into it.
    let proxy = ProxyProcess::spawn(&toml).await;
    wait_policies(node, "early-ttl put", |p| named(p, &early).is_some()).await;
    proxy
        .wait_counter("upstream_policies_synced", &[], 1.0)
        .await;
    let mut proxy = proxy;
    proxy.kill();

    // A change through the admin API reaches the upstream at once (this proxy's periodic
    // round is an hour away); its removal too.
    let token = "admin-t0ken";
    let hourly = fleet_toml(
        &[node.uri()],
        &policies,
        &capture,
        &format!(
            "{}management_sync_interval_secs = 3600\n[admin]\ntoken = \"{token}\"\n",
            management_toml(node, "dlx-sync", "sync-pw")
                .replace("management_sync_interval_secs = 1\n", "")
        ),
    );
    let hourly = ProxyProcess::spawn(&hourly).await;
    let added = json!({"pattern": "^added$", "definition": {"max-length": 3}}).to_string();
    let (status, text) = admin_call(
        hourly.admin,
        "PUT",
        "/api/policies/%2F/added",
        Some(&added),
        Some(token),
    )
    .await;
    assert!(
        matches!(status, 200 | 201 | 204),
        "admin PUT: {status} {text}"
    );
    let listed = wait_policies(node, "added put", |p| named(p, &added_name).is_some()).await;
    assert_eq!(
        named(&listed, &added_name).unwrap()["definition"],
        json!({"max-length": 3, "dead-letter-exchange": capture})
    );
    let (status, text) = admin_call(
        hourly.admin,
        "DELETE",
        "/api/policies/%2F/added",
        None,
        Some(token),
    )
    .await;
    assert!(matches!(status, 200 | 204), "admin DELETE: {status} {text}");
    wait_policies(node, "added deleted", |p| {
        named(p, &added_name).is_none() && named(p, &early).is_some()
    })
    .await;
    drop(hourly);

    // A wrong password: every round fails, is counted, and the password is never shown. (The
    // proxy delegates dead-lettering here, so it is ready without a service connection, which
    // the wrong password would keep down.)
    let wrong = fleet_toml(
        &[node.uri()],
        &[],
        &capture,
        &format!(
            "{}[proxy]\ndelegate_to_upstream = true\n",
            management_toml(node, "dlx-sync", "wrong-secret")
        ),
    );
    let refused = ProxyProcess::spawn(&wrong).await;
    refused
        .wait_counter("upstream_policy_sync_total", &[("result", "failure")], 2.0)
        .await;
    assert_eq!(
        refused
            .counter("upstream_policy_sync_total", &[("result", "success")])
            .await,
        0.0
    );
    let logs = refused.logs();
    assert!(logs.contains("401"), "{logs}");
    assert!(!logs.contains("wrong-secret"), "{logs}");
    // The policy of the first proxy is left alone by a proxy that cannot reach the API.
    assert!(named(&upstream_policies(node).await, &early).is_some());
}

/// Gets the one message of `queue` through `ch` and requeues it until it stops coming (or 10
/// times); returns how often it was delivered.
async fn requeue_until_gone(ch: &lapin::Channel, queue: &str) -> usize {
    let mut deliveries = 0;
    while deliveries < 10 {
        let Some(delivery) = common::dl::get(ch, queue).await else {
            // A requeue or a dead letter may still be on its way.
            tokio::time::sleep(Duration::from_millis(300)).await;
            match common::dl::get(ch, queue).await {
                Some(delivery) => {
                    deliveries += 1;
                    common::dl::nack(ch, delivery.delivery_tag, false, true).await;
                    continue;
                }
                None => break,
            }
        };
        deliveries += 1;
        common::dl::nack(ch, delivery.delivery_tag, false, true).await;
    }
    deliveries
}

/// A classic queue with x-delivery-limit 2 whose names are too long for RabbitMQ's reply texts
/// (cut at 255 bytes), declared through `declaring` and holding one message "m"; requeued
/// through `counting` until it stops coming. Returns (deliveries, DLQ message count).
async fn long_named_limit(declaring: &ProxyProcess, counting: &ProxyProcess) -> (usize, u32) {
    let queue = format!("{}-{}", unique("long-limit"), "q".repeat(150));
    let dlx = format!("{}-{}", unique("long-dlx"), "x".repeat(120));
    let dlq = unique("long-dlq");
    let a = declaring.connect().await;
    let ch = a.create_channel().await.unwrap();
    declare_dlx(&ch, &dlx, &dlq).await;
    let args = common::dl::table(&[
        ("x-dead-letter-exchange", common::dl::ls(&dlx)),
        ("x-dead-letter-routing-key", common::dl::ls(&dlq)),
        ("x-delivery-limit", lapin::types::AMQPValue::LongInt(2)),
    ]);
    common::dl::declare(&ch, &queue, args).await;
    publish(&ch, &queue, &["m"]).await;
    let b = counting.connect().await;
    let ch_b = b.create_channel().await.unwrap();
    let deliveries = requeue_until_gone(&ch_b, &queue).await;
    let dead = poll(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let n = crate::proxy_support::message_count(&ch, &dlq).await;
            (n > 0).then_some(n)
        },
    )
    .await
    .unwrap_or(0);
    if dead > 0 {
        let letter = get(&ch, &dlq).await.expect("the dead letter");
        assert_eq!(payload(&letter), "m");
        assert_first_death(&letter, "delivery_limit", &queue, "");
    }
    let _ = a.close(200, "done".into()).await;
    let _ = b.close(200, "done".into()).await;
    (deliveries, dead)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_did_not_see_the_declare_reads_long_names_from_the_management_api() {
    let node = node();
    let capture = unique("capture");
    let plain = ProxyProcess::spawn(&fleet_toml(&[node.uri()], &[], &capture, "")).await;
    let other_plain = ProxyProcess::spawn(&fleet_toml(&[node.uri()], &[], &capture, "")).await;
    let with_api = ProxyProcess::spawn(&fleet_toml(
        &[node.uri()],
        &[],
        &capture,
        &management_toml(node, "guest", "guest"),
    ))
    .await;
    // The reply texts cannot carry these names: an instance reading the queue back through
    // them alone passes the requeues through uncounted (the documented limit without the API).
    let (deliveries, dead) = long_named_limit(&plain, &other_plain).await;
    assert_eq!((deliveries, dead), (10, 0), "without the management API");
    // With the management API the instance that did not see the declare reads the limit.
    let (deliveries, dead) = long_named_limit(&plain, &with_api).await;
    assert_eq!(
        (deliveries, dead),
        (3, 1),
        "x-delivery-limit 2: the third requeue dead-letters"
    );
    drop((plain, other_plain, with_api));
}

/// Two instances of one deployment with different policies for a while (a rolling update):
/// the old one, without the new policy, leaves it upstream round after round for
/// `upstream.management_delete_grace_secs` instead of deleting it at every round (which took
/// the capture route off the queues it covers until the new one put it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_a_policy_leaves_it_to_the_others_for_the_grace() {
    let node = node();
    let capture = unique("capture");
    let queue = unique("rolling");
    let rolling = format!("{capture}.rolling-ttl");
    let policies = vec![policy(
        "rolling-ttl",
        &format!("^{}$", regex::escape(&queue)),
        json!({"message-ttl": 1000}),
    )];
    let keys = management_toml(node, "guest", "guest");
    // The new instance puts the policy, then stops (so that it cannot put it back).
    let new = ProxyProcess::spawn(&fleet_toml(&[node.uri()], &policies, &capture, &keys)).await;
    wait_policies(node, "rolling-ttl put", |p| named(p, &rolling).is_some()).await;
    drop(new);
    // The old instance: no such policy, the default grace (600 s), a round every second.
    let old_keys = keys.replace("management_delete_grace_secs = 0\n", "");
    let old = ProxyProcess::spawn(&fleet_toml(&[node.uri()], &[], &capture, &old_keys)).await;
    let rounds = poll(
        Duration::from_secs(20),
        Duration::from_millis(250),
        async || {
            let done = old
                .counter("upstream_policy_sync_total", &[("result", "success")])
                .await;
            (done >= 4.0).then_some(())
        },
    )
    .await;
    assert!(
        rounds.is_some(),
        "the old instance made no rounds:\n{}",
        old.logs()
    );
    assert!(
        named(&upstream_policies(node).await, &rolling).is_some(),
        "deleted by the instance without it:\n{}",
        old.logs()
    );
    drop(old);
    let (status, text) = node
        .management_call("DELETE", &format!("/api/policies/%2F/{rolling}"), None)
        .await;
    assert!(matches!(status, 200 | 204), "DELETE: {status} {text}");
}

/// [`management_toml`] as guest, deleting what the proxy lacks after `grace_secs`.
fn management_toml_with_grace(node: &RabbitNode, grace_secs: u64) -> String {
    management_toml(node, "guest", "guest").replace(
        "management_delete_grace_secs = 0\n",
        &format!("management_delete_grace_secs = {grace_secs}\n"),
    )
}

/// Whether upstream policy `name` of `vhost` comes to be listed (`present`) or unlisted
/// within 20 s.
async fn policy_listed(node: &RabbitNode, vhost: &str, name: &str, present: bool) -> bool {
    poll(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let (status, body) = node
                .management_call("GET", &format!("/api/policies/{vhost}"), None)
                .await;
            assert_eq!(status, 200, "GET policies: {body}");
            let listing: Vec<Value> = serde_json::from_str(&body).expect("policy listing JSON");
            (named(&listing, name).is_some() == present).then_some(())
        },
    )
    .await
    .is_some()
}

/// A vhost of its own on `node`, where guest may do everything.
async fn scratch_vhost(node: &RabbitNode, prefix: &str) -> String {
    let vhost = unique(prefix);
    let (status, text) = node
        .management_call("PUT", &format!("/api/vhosts/{vhost}"), Some("{}"))
        .await;
    assert!(matches!(status, 201 | 204), "PUT vhost: {status} {text}");
    let all = json!({"configure": ".*", "write": ".*", "read": ".*"}).to_string();
    let (status, text) = node
        .management_call(
            "PUT",
            &format!("/api/permissions/{vhost}/guest"),
            Some(&all),
        )
        .await;
    assert!(
        matches!(status, 201 | 204),
        "PUT permissions: {status} {text}"
    );
    vhost
}

/// A policy of a served vhost (`proxy.vhosts`) removed from the config while the proxy was
/// down: the restarted proxy, which never put it, deletes it after the grace. (Only vhost
/// "/" and the vhosts of current policies were reconciled, so it stayed for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_removed_while_the_proxy_was_down_is_deleted_in_every_served_vhost() {
    let node = node();
    let vhost = scratch_vhost(node, "served-vhost").await;
    let mut elsewhere = policy("elsewhere", "^q$", json!({"max-length": 5}));
    elsewhere.vhost = vhost.clone();
    let keys = management_toml_with_grace(node, 2);
    let capture = unique("capture");
    let upstream_name = format!("{capture}.elsewhere");
    // A vhost policies may name, served by a service connection from the start.
    let overrides = format!(
        "vhosts = [\"/\", {vhost:?}]\n{keys}[proxy]\ndelegate_to_upstream = true\n\
         vhosts = [\"/\", {vhost:?}]\n"
    );
    let first = ProxyProcess::spawn(&fleet_toml(
        &[node.uri()],
        &[elsewhere],
        &capture,
        &overrides,
    ))
    .await;
    assert!(
        policy_listed(node, &vhost, &upstream_name, true).await,
        "not put:\n{}",
        first.logs()
    );
    drop(first);
    let restarted =
        ProxyProcess::spawn(&fleet_toml(&[node.uri()], &[], &capture, &overrides)).await;
    assert!(
        policy_listed(node, &vhost, &upstream_name, false).await,
        "not deleted:\n{}",
        restarted.logs()
    );
    drop(restarted);
    let _ = node
        .management_call("DELETE", &format!("/api/vhosts/{vhost}"), None)
        .await;
}

/// A policy of a vhost the proxy does not serve, removed from the file: its deletion waits
/// for the grace, and the vhost stays reconciled until it is made (it was dropped from the
/// rounds while the delete waited, so the policy stayed upstream for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_policy_of_another_vhost_is_deleted_after_the_grace() {
    let node = node();
    let vhost = scratch_vhost(node, "grace-vhost").await;
    let mut elsewhere = policy("elsewhere", "^q$", json!({"max-length": 5}));
    elsewhere.vhost = vhost.clone();
    // Dead-lettering delegated: the policy needs no capture exchange in that vhost.
    let keys = management_toml_with_grace(node, 2);
    let capture = unique("capture");
    let upstream_name = format!("{capture}.elsewhere");
    let toml = fleet_toml(
        &[node.uri()],
        &[elsewhere],
        &capture,
        &format!("vhosts = [\"/\", {vhost:?}]\n{keys}[proxy]\ndelegate_to_upstream = true\n"),
    );
    let proxy = ProxyProcess::spawn(&toml).await;
    assert!(
        policy_listed(node, &vhost, &upstream_name, true).await,
        "not put:\n{}",
        proxy.logs()
    );

    remove_policies(&proxy);
    assert!(
        policy_listed(node, &vhost, &upstream_name, false).await,
        "not deleted:\n{}",
        proxy.logs()
    );
    drop(proxy);
    let _ = node
        .management_call("DELETE", &format!("/api/vhosts/{vhost}"), None)
        .await;
}

/// Three deployments share vhost "/", each with a policy named `ttl`: two capture (each with
/// its own capture name) and one delegates. Each keeps its own upstream policy round after
/// round, and what expires in a queue of the second is dead-lettered through that
/// deployment's capture path. (All three were one upstream policy `dlx-proxy.ttl` before,
/// overwritten at every round, and the delegating deployment deleted the others'.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_sharing_a_vhost_keep_their_policies_of_the_same_name_apart() {
    let node = node();
    let keys = management_toml(node, "guest", "guest");
    let queues = [unique("share-a"), unique("share-b"), unique("share-c")];
    let names = [
        unique("capture-a"),
        unique("capture-b"),
        unique("delegating"),
    ];
    let (dlx, dlq) = (unique("share-dlx"), unique("share-dlq"));
    // Above the priority-0 `.*` policy of another test of this node.
    let ttl = |queue: &str, definition: Value| {
        pattern(
            "ttl",
            &format!("^{}$", regex::escape(queue)),
            10,
            definition,
        )
    };
    let definitions = [
        json!({"message-ttl": 60000}),
        json!({"message-ttl": 300, "dead-letter-exchange": dlx, "dead-letter-routing-key": dlq}),
        json!({"max-length": 5}),
    ];
    let mut proxies = Vec::new();
    for (i, definition) in definitions.iter().enumerate() {
        let extra = if i == 2 {
            "[proxy]\ndelegate_to_upstream = true\n"
        } else {
            ""
        };
        let toml = fleet_toml(
            &[node.uri()],
            &[ttl(&queues[i], definition.clone())],
            &names[i],
            &format!("{keys}{extra}"),
        );
        proxies.push(ProxyProcess::spawn(&toml).await);
    }
    let upstream: Vec<String> = names.iter().map(|name| format!("{name}.ttl")).collect();
    wait_policies(node, "three ttl policies", |p| {
        upstream.iter().all(|name| named(p, name).is_some())
    })
    .await;
    // Three more rounds of each deployment: nothing is overwritten or deleted.
    for proxy in &proxies {
        let success = [("result", "success")];
        let done = proxy.counter("upstream_policy_sync_total", &success).await;
        proxy
            .wait_counter("upstream_policy_sync_total", &success, done + 3.0)
            .await;
    }
    let listed = upstream_policies(node).await;
    for (i, name) in upstream.iter().enumerate() {
        let Some(found) = named(&listed, name) else {
            panic!("{name} is gone: {listed:#?}");
        };
        let dead_letter_exchange = &found["definition"]["dead-letter-exchange"];
        match i {
            2 => assert_eq!(found["definition"], definitions[2], "{name}"),
            _ => assert_eq!(dead_letter_exchange, &json!(names[i]), "{name}"),
        }
    }

    // Straight to RabbitMQ: a message expires in the second deployment's queue and reaches
    // the policy's dead-letter queue through that deployment's capture path.
    let direct = Connection::connect(&node.uri(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let ch = direct.create_channel().await.unwrap();
    declare_dlx(&ch, &dlx, &dlq).await;
    declare_durable(&ch, &queues[1], FieldTable::default()).await;
    publish(&ch, &queues[1], &["shared"]).await;
    let dead = poll(
        Duration::from_secs(15),
        Duration::from_millis(200),
        async || get(&ch, &dlq).await,
    )
    .await;
    let Some(dead) = dead else {
        panic!("no dead letter:\n{}", proxies[1].logs());
    };
    assert_eq!(payload(&dead), "shared");
    assert_eq!(x_death(&dead)[0].qrc(), (queues[1].as_str(), "expired", 1));
    proxies[1]
        .wait_counter(
            "dead_lettered_total",
            &[("queue", &queues[1]), ("reason", "expired"), ("vhost", "/")],
            1.0,
        )
        .await;

    drop(proxies);
    for name in &upstream {
        let _ = node
            .management_call("DELETE", &format!("/api/policies/%2F/{name}"), None)
            .await;
    }
    direct.close(200, "bye".into()).await.ok();
}
