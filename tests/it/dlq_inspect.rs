//! Inspecting a dead-letter queue without consuming it (`GET /api/queues/{vhost}/{queue}/
//! messages` and `.../messages/summary`, `dlx-proxy dlq list|summary`), in both modes.
//!
//! Dead letters are made by a reject and by a TTL; the page shows their x-death reason,
//! source queue and count and the body preview, honours `limit`, the summary counts them by
//! reason and source; reads need the admin token; the queue holds as many messages afterwards
//! and a client still gets them all. Embedded mode runs the real binary and its `dlq`
//! subcommands; proxy mode runs the proxy binary in front of a node of this module with the
//! management plugin (the messages come back redelivered there, as documented).

use crate::common;
use crate::proxy_support::fleet::{ProxyProcess, fleet_toml};
use crate::rabbit::{NodeOptions, RabbitNode};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::dl::{dead_letter_to, declare, get, get_and_reject, int, payload, publish};
use common::{TokenService, admin_call, poll, unique};
use lapin::Channel;
use lapin::types::FieldTable;
use serde_json::Value;

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");
const TOKEN: &str = "dlq-inspect-token";

fn messages_path(queue: &str, query: &str) -> String {
    format!("/api/queues/%2F/{queue}/messages{query}")
}

/// Makes three dead letters in `dlq`: "r1" and "r2" rejected from `work`, then "t1" expired
/// from `ttl`.
async fn three_dead_letters(ch: &Channel, work: &str, ttl: &str, dlq: &str) {
    declare(ch, dlq, FieldTable::default()).await;
    declare(ch, work, dead_letter_to(dlq, &[])).await;
    declare(ch, ttl, dead_letter_to(dlq, &[("x-message-ttl", int(100))])).await;
    publish(ch, work, &["r1", "r2"]).await;
    get_and_reject(ch, work, "r1").await;
    get_and_reject(ch, work, "r2").await;
    publish(ch, ttl, &["t1"]).await;
}

/// Polls the page until the queue holds `length` messages; returns that page.
async fn wait_page(admin: SocketAddr, path: &str, length: u64) -> Value {
    let found = poll(
        Duration::from_secs(20),
        Duration::from_millis(100),
        async || {
            let (status, body) = admin_call(admin, "GET", path, None, Some(TOKEN)).await;
            let page: Value = serde_json::from_str(&body).ok()?;
            (status == 200 && page["queue_length"] == length).then_some(page)
        },
    )
    .await;
    found.unwrap_or_else(|| panic!("{path} never showed {length} messages"))
}

/// The checks both modes share, on a page of `limit=2` and on the summary.
async fn check_page_and_summary(admin: SocketAddr, dlq: &str, work: &str, ttl: &str) {
    let page = wait_page(admin, &messages_path(dlq, "?limit=2"), 3).await;
    let messages = page["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2, "limit=2: {page:#}");
    assert_eq!(page["limit"], 2);
    let bodies: Vec<&str> = messages
        .iter()
        .map(|m| m["body_preview"].as_str().unwrap())
        .collect();
    assert_eq!(bodies, ["r1", "r2"], "{page:#}");
    for m in messages {
        let death = &m["x_death"][0];
        assert_eq!(death["queue"], work, "{m:#}");
        assert_eq!(death["reason"], "rejected", "{m:#}");
        assert_eq!(death["count"], 1, "{m:#}");
        assert_eq!(death["routing-keys"][0], work, "{m:#}");
        assert!(death["time"].as_i64().unwrap() > 1_700_000_000, "{m:#}");
        assert_eq!(m["body_size"], 2);
        assert_eq!(m["body_truncated"], false);
        assert!(m["headers"].get("x-death").is_some(), "{m:#}");
    }

    // The default page holds all three; the third expired.
    let page = wait_page(admin, &messages_path(dlq, ""), 3).await;
    let third = &page["messages"][2];
    assert_eq!(third["body_preview"], "t1", "{page:#}");
    assert_eq!(third["x_death"][0]["reason"], "expired");
    assert_eq!(third["x_death"][0]["queue"], ttl);

    let (status, body) = admin_call(
        admin,
        "GET",
        &messages_path(dlq, "/summary"),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let summary: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(summary["inspected"], 3, "{summary:#}");
    assert_eq!(summary["truncated"], false);
    assert_eq!(
        summary["by_reason"],
        serde_json::json!({"rejected": 2, "expired": 1})
    );
    let mut by_source = BTreeMap::new();
    by_source.insert(work.to_string(), 2);
    by_source.insert(ttl.to_string(), 1);
    assert_eq!(summary["by_source_queue"], serde_json::json!(by_source));

    // Reads of message contents need the token; a limit above the maximum is refused.
    for token in [None, Some("wrong")] {
        for path in [messages_path(dlq, ""), messages_path(dlq, "/summary")] {
            let (status, body) = admin_call(admin, "GET", &path, None, token).await;
            assert_eq!(status, 401, "{path} with {token:?}: {body}");
            assert!(!body.contains("r1"), "{body}");
        }
    }
    let (status, body) = admin_call(
        admin,
        "GET",
        &messages_path(dlq, "?limit=1001"),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("from 1 to 1000"), "{body}");
    let (status, _) = admin_call(
        admin,
        "GET",
        &messages_path(&unique("missing"), ""),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 404);
}

/// Gets every message of `queue` (acked); returns (body, redelivered) in order.
async fn drain(ch: &Channel, queue: &str) -> Vec<(String, bool)> {
    let mut got = Vec::new();
    while let Some(d) = get(ch, queue).await {
        got.push((payload(&d), d.redelivered));
        d.ack(Default::default()).await.unwrap();
    }
    got
}

/// Runs `dlx-proxy dlq ARGS --config FILE`; returns stdout, asserting success.
fn cli(config: &std::path::Path, args: &[&str]) -> String {
    let output = std::process::Command::new(BINARY)
        .arg("dlq")
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run dlx-proxy dlq");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "dlq {args:?}: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_inspection_reads_the_queue_in_place() {
    let service = TokenService::start(BINARY, "dlx-proxy-dlq-inspect", TOKEN).await;
    let (ch, path, admin) = (&service.ch, &service.config, service.process.admin);
    let (work, ttl, dlq) = (unique("work"), unique("ttl"), unique("dlq"));
    three_dead_letters(ch, &work, &ttl, &dlq).await;

    check_page_and_summary(admin, &dlq, &work, &ttl).await;

    // The CLI finds the address and token in the same configuration file.
    let listed = cli(
        path,
        &["list", "--vhost", "/", "--queue", &dlq, "--limit", "1"],
    );
    assert!(
        listed.starts_with(&format!(
            "queue {dlq:?} in vhost \"/\": 3 messages, showing 1\n"
        )),
        "{listed}"
    );
    assert!(
        listed.contains(&format!(
            "x-death queue={work} reason=rejected count=1 exchange=\"\" routing-keys={work}"
        )),
        "{listed}"
    );
    assert!(listed.contains("body (string): r1\n"), "{listed}");
    assert!(!listed.contains("r2"), "limit 1: {listed}");
    let summary = cli(path, &["summary", "--queue", &dlq]);
    assert!(summary.contains("3 messages, 3 inspected\n"), "{summary}");
    assert!(
        summary.contains("by reason:\n  expired\t1\n  rejected\t2\n"),
        "{summary}"
    );
    assert!(summary.contains(&format!("  {work}\t2\n")), "{summary}");
    let json: Value =
        serde_json::from_str(&cli(path, &["list", "--queue", &dlq, "--format", "json"]))
            .expect("JSON");
    assert_eq!(
        json["messages"][0]["headers"]["x-death"]["type"], "array",
        "{json:#}"
    );

    // Nothing was delivered: all three are still there, in order, never redelivered.
    assert_eq!(
        drain(ch, &dlq).await,
        [
            ("r1".to_string(), false),
            ("r2".to_string(), false),
            ("t1".to_string(), false)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_inspection_reads_through_the_management_api() {
    let node = RabbitNode::start_with(
        "dlqi",
        &NodeOptions {
            plugins: vec!["rabbitmq_management"],
        },
    );
    let management = node.management.expect("management listener");
    let overrides = format!(
        "[upstream]\nmanagement_url = \"http://{management}\"\n\n[admin]\ntoken = {TOKEN:?}\n"
    );
    let proxy = ProxyProcess::spawn(&fleet_toml(
        &[node.uri()],
        &[],
        &unique("capture"),
        &overrides,
    ))
    .await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (work, ttl, dlq) = (unique("work"), unique("ttl"), unique("dlq"));
    three_dead_letters(&ch, &work, &ttl, &dlq).await;

    check_page_and_summary(proxy.admin, &dlq, &work, &ttl).await;

    // The messages were requeued upstream: all three are still there, redelivered.
    let mut got = drain(&ch, &dlq).await;
    got.sort();
    assert_eq!(
        got,
        [
            ("r1".to_string(), true),
            ("r2".to_string(), true),
            ("t1".to_string(), true)
        ]
    );
}
