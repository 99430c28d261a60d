//! Redriving a dead-letter queue (`POST /api/redrive`, `dlx-proxy redrive`) in embedded mode,
//! against the real binary with lapin: dead letters from two source queues each go back to
//! their own source, the reason filter leaves the others in place, `--to` sends them to one
//! queue, `--dry-run` changes nothing, the redriven message carries `x-redriven-count` (a
//! long-long) and its x-death history; the rate limit is honoured (measured), a job is
//! cancelled (Ctrl-C in the CLI) and resumed with nothing lost or doubled; and with storage, a
//! SIGKILL in the middle of a redrive leaves every message in the dead-letter queue or the
//! target after the restart. In proxy mode (`proxy_*`, the binary in front of the reference
//! node) the same requests move the messages upstream: to their sources, `--to`, by filter,
//! dry-run, a missing target (`no_queue`, the message stays), more skipped messages than a
//! consumer's window, cancel and resume with none lost or doubled, and a SIGKILL of the proxy
//! mid-pass leaving every message in the dead-letter queue or its target.

use crate::common;
use crate::proxy_support::fleet::{ProxyProcess, fleet_toml};
use crate::storage_restart::{Node, count, drain, publish_confirmed};

use std::path::Path;
use std::time::{Duration, Instant};

use common::dl::{
    AMQPValue, BasicProperties, BasicRejectOptions, Channel, FieldTable, confirm_select,
    dead_letter_to, declare, declare_durable, get_and_reject, get_one, header, int, payload,
    publish, x_death,
};
use common::{TokenService, admin_call, metric_value, scrape, series, unique};
use serde_json::Value;

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");
const TOKEN: &str = "redrive-token";

/// Runs `dlx-proxy redrive ARGS --config FILE`: (exit code, stdout, stderr).
fn cli(config: &Path, args: &[&str]) -> (i32, String, String) {
    let output = std::process::Command::new(BINARY)
        .arg("redrive")
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run dlx-proxy redrive");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The CLI's `--format json` answer, asserting exit 0.
fn cli_json(config: &Path, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--format", "json"]);
    let (code, out, err) = cli(config, &all);
    assert_eq!(code, 0, "redrive {args:?}: {err}\n{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `POST /api/redrive` with `body`: (status, answer).
async fn post(admin: std::net::SocketAddr, body: Value) -> (u16, Value) {
    let (status, text) = admin_call(
        admin,
        "POST",
        "/api/redrive",
        Some(&body.to_string()),
        Some(TOKEN),
    )
    .await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Polls job `id` until it is no longer running; its status.
async fn wait_job(admin: std::net::SocketAddr, id: u64) -> Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, text) =
            admin_call(admin, "GET", &format!("/api/redrive/{id}"), None, None).await;
        assert_eq!(status, 200, "{text}");
        let job: Value = serde_json::from_str(&text).unwrap();
        if job["state"] != "running" {
            return job;
        }
        assert!(Instant::now() < until, "job {id} still running: {job:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `queue` holds `n` messages.
async fn wait_count(ch: &Channel, queue: &str, n: u32) {
    let until = Instant::now() + Duration::from_secs(10);
    while count(ch, queue).await != n {
        assert!(
            Instant::now() < until,
            "{queue} never held {n} (has {})",
            count(ch, queue).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fills `dlq` with `n` dead letters (`{prefix}{i}`, expired at once from `source`, a queue
/// with TTL 0 dead-lettering to it).
async fn expired_into(ch: &Channel, source: &str, dlq: &str, prefix: &str, n: usize) {
    declare(ch, dlq, FieldTable::default()).await;
    declare(
        ch,
        source,
        dead_letter_to(dlq, &[("x-message-ttl", int(0))]),
    )
    .await;
    let bodies: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
    let refs: Vec<&str> = bodies.iter().map(String::as_str).collect();
    publish(ch, source, &refs).await;
    wait_count(ch, dlq, n as u32).await;
}

/// The redrive metrics both modes export: `redriven_total` by target queue,
/// `redrive_skipped_total` and `redrive_failed_total{cause}` of the source queue.
async fn assert_redrive_metrics(
    admin: std::net::SocketAddr,
    moved: &[(&str, f64)],
    (source, skipped): (&str, f64),
    failed: &[(&str, f64)],
) {
    let metrics = scrape(admin).await;
    let value = |name: &str, labels: &[(&str, &str)]| metric_value(&metrics, &series(name, labels));
    for (queue, n) in moved {
        assert_eq!(
            value(
                "dlx_proxy_redriven_total",
                &[("queue", queue), ("vhost", "/")]
            ),
            Some(*n),
            "moved to {queue}\n{metrics}"
        );
    }
    assert_eq!(
        value(
            "dlx_proxy_redrive_skipped_total",
            &[("queue", source), ("vhost", "/")]
        ),
        Some(skipped),
        "{metrics}"
    );
    for (cause, n) in failed {
        assert_eq!(
            value(
                "dlx_proxy_redrive_failed_total",
                &[("cause", cause), ("queue", source), ("vhost", "/")]
            ),
            Some(*n),
            "{metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_redrive_to_sources_by_filter_and_to_one_queue() {
    let service = TokenService::start(BINARY, "dlx-proxy-redrive", TOKEN).await;
    let (ch, config, admin) = (&service.ch, &service.config, service.process.admin);
    let (work, other, ttl, dlq, park) = (
        unique("work"),
        unique("other"),
        unique("ttl"),
        unique("dlq"),
        unique("park"),
    );
    declare(ch, &dlq, FieldTable::default()).await;
    declare(ch, &work, dead_letter_to(&dlq, &[])).await;
    declare(ch, &other, dead_letter_to(&dlq, &[])).await;
    declare(ch, &ttl, dead_letter_to(&dlq, &[("x-message-ttl", int(0))])).await;
    declare(ch, &park, FieldTable::default()).await;
    publish(ch, &work, &["w1", "w2"]).await;
    publish(ch, &other, &["o1"]).await;
    get_and_reject(ch, &work, "w1").await;
    get_and_reject(ch, &other, "o1").await;
    publish(ch, &ttl, &["t1"]).await;
    get_and_reject(ch, &work, "w2").await;
    wait_count(ch, &dlq, 4).await;

    // A dry run counts what would move and where, and moves nothing.
    let dry = cli_json(
        config,
        &["--from", &dlq, "--filter", "reason=rejected", "--dry-run"],
    );
    assert_eq!(dry["state"], "done", "{dry:#}");
    assert_eq!(
        (dry["moved"].as_u64(), dry["skipped"].as_u64()),
        (Some(3), Some(1)),
        "{dry:#}"
    );
    assert_eq!(dry["by_target"][&work], 2);
    assert_eq!(dry["by_target"][&other], 1);
    for (queue, n) in [(&dlq, 4), (&work, 0), (&other, 0)] {
        assert_eq!(count(ch, queue).await, n, "{queue} after the dry run");
    }

    // The rejected ones go back, each to its own source; the expired one stays.
    let (code, out, err) = cli(config, &["--from", &dlq, "--filter", "reason=rejected"]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(
        out.contains("moved 3, skipped by filter 1, failed 0, examined 4"),
        "{out}"
    );
    assert!(
        out.contains(&format!("by target queue:\n  {other}\t1\n  {work}\t2\n"))
            || out.contains(&format!("by target queue:\n  {work}\t2\n  {other}\t1\n")),
        "{out}"
    );
    assert_eq!(count(ch, &dlq).await, 1);
    let w1 = get_one(ch, &work).await;
    assert_eq!(payload(&w1), "w1");
    assert_eq!(
        header(&w1, "x-redriven-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    let deaths = x_death(&w1);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), (work.as_str(), "rejected", 1));
    assert_eq!(
        w1.routing_key.as_str(),
        work,
        "published to the source queue's name"
    );
    assert_eq!(payload(&get_one(ch, &work).await), "w2");
    let o1 = get_one(ch, &other).await;
    assert_eq!(payload(&o1), "o1");
    assert_eq!(x_death(&o1)[0].qrc(), (other.as_str(), "rejected", 1));

    // Rejected again and redriven again: the history counts both deaths, the header 2.
    o1.reject(BasicRejectOptions { requeue: false })
        .await
        .expect("reject");
    wait_count(ch, &dlq, 2).await;
    let again = cli_json(config, &["--from", &dlq, "--filter", "reason=rejected"]);
    assert_eq!(again["moved"], 1, "{again:#}");
    let o1 = get_one(ch, &other).await;
    assert_eq!(
        header(&o1, "x-redriven-count"),
        Some(&AMQPValue::LongLongInt(2))
    );
    assert_eq!(x_death(&o1)[0].qrc(), (other.as_str(), "rejected", 2));

    // --to: the expired one goes to the named queue, its history intact.
    let to = cli_json(config, &["--from", &dlq, "--to", &park]);
    assert_eq!(
        (to["moved"].as_u64(), to["by_target"][&park].as_u64()),
        (Some(1), Some(1))
    );
    let t1 = get_one(ch, &park).await;
    assert_eq!(payload(&t1), "t1");
    assert_eq!(x_death(&t1)[0].qrc(), (ttl.as_str(), "expired", 1));
    assert_eq!(count(ch, &dlq).await, 0);

    // Metrics by target queue; writes need the token; a missing queue is a 404.
    assert_redrive_metrics(
        admin,
        &[(&work, 2.0), (&other, 2.0), (&park, 1.0)],
        (&dlq, 2.0),
        &[],
    )
    .await;
    let body = serde_json::json!({"from": dlq}).to_string();
    let (status, _) = admin_call(admin, "POST", "/api/redrive", Some(&body), None).await;
    assert_eq!(status, 401);
    let (status, answer) = post(admin, serde_json::json!({"from": unique("none")})).await;
    assert_eq!(status, 404, "{answer}");
    let (status, answer) = post(
        admin,
        serde_json::json!({"from": dlq, "filter": ["reason=old"]}),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    // A missing target is counted as failed and the message stays.
    publish(ch, &work, &["w3"]).await;
    get_and_reject(ch, &work, "w3").await;
    wait_count(ch, &dlq, 1).await;
    let failed = cli_json(config, &["--from", &dlq, "--to", &unique("missing")]);
    assert_eq!(
        (failed["failed"].as_u64(), failed["moved"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(failed["failed_by_cause"]["no_queue"], 1);
    assert_eq!(count(ch, &dlq).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_redrive_rate_limit_cancel_and_resume() {
    let service = TokenService::start(BINARY, "dlx-proxy-redrive-rate", TOKEN).await;
    let (ch, config, admin) = (&service.ch, &service.config, service.process.admin);
    let (source, dlq, target) = (unique("src"), unique("dlq"), unique("target"));
    declare(ch, &target, FieldTable::default()).await;
    expired_into(ch, &source, &dlq, "m", 41).await;

    // 41 messages at 20/s take at least 2 s (the bucket starts with one token).
    let started = Instant::now();
    let (status, job) = post(
        admin,
        serde_json::json!({"from": dlq, "to": target, "rate": 20, "max": 41}),
    )
    .await;
    assert_eq!(status, 201, "{job:#}");
    let id = job["id"].as_u64().unwrap();
    // One job per queue at a time.
    let (status, busy) = post(admin, serde_json::json!({"from": dlq, "to": target})).await;
    assert_eq!(status, 409, "{busy}");
    assert!(
        busy.as_str()
            .unwrap()
            .contains(&format!("redrive job {id} is running")),
        "{busy}"
    );
    let done = wait_job(admin, id).await;
    let took = started.elapsed();
    assert_eq!(
        (done["state"].as_str(), done["moved"].as_u64()),
        (Some("done"), Some(41)),
        "{done:#}"
    );
    assert!(
        took >= Duration::from_millis(1900),
        "41 at 20/s took {took:?}"
    );
    assert!(took < Duration::from_secs(6), "41 at 20/s took {took:?}");
    assert!(done["rate"].as_f64().unwrap() <= 22.0, "{done:#}");
    assert_eq!(count(ch, &target).await, 41);
    assert_eq!(count(ch, &dlq).await, 0);

    // Ctrl-C in the CLI cancels the job; a resume moves the rest: nothing lost or doubled.
    let (dlq2, target2) = (unique("dlq2"), unique("target2"));
    declare(ch, &target2, FieldTable::default()).await;
    expired_into(ch, &unique("src2"), &dlq2, "n", 200).await;
    let child = std::process::Command::new(BINARY)
        .args([
            "redrive", "--from", &dlq2, "--to", &target2, "--rate", "100/s", "--config",
        ])
        .arg(config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn redrive");
    // Interrupted once the job has moved some (the CLI is following it by then).
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = admin_call(admin, "GET", "/api/redrive", None, None).await;
        let jobs: Value = serde_json::from_str(&text).unwrap();
        let moved = jobs
            .as_array()
            .unwrap()
            .iter()
            .find(|job| job["request"]["from"] == dlq2.as_str())
            .and_then(|job| job["moved"].as_u64());
        if moved.is_some_and(|n| n >= 20) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the CLI's job never got going: {jobs:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{out}\n{err}");
    assert!(out.contains(": cancelled in "), "{out}\n{err}");
    let id: u64 = out
        .strip_prefix("redrive job ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no job id in {out}"));
    let cancelled = wait_job(admin, id).await;
    let moved = cancelled["moved"].as_u64().unwrap();
    assert!(moved > 0 && moved < 200, "{cancelled:#}");
    assert_eq!(count(ch, &target2).await as u64, moved);
    assert_eq!(count(ch, &dlq2).await as u64, 200 - moved);

    let resumed = cli_json(config, &["--resume", &id.to_string()]);
    assert_eq!(resumed["resumes"], id, "{resumed:#}");
    assert_eq!(resumed["state"], "done");
    assert_eq!(
        resumed["moved"].as_u64().unwrap(),
        200 - moved,
        "{resumed:#}"
    );
    assert_eq!(count(ch, &dlq2).await, 0);
    let mut bodies: Vec<String> = drain(ch, &target2)
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    assert_eq!(bodies.len(), 200);
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), 200, "no message doubled");
    let metrics = scrape(admin).await;
    assert_eq!(
        metric_value(&metrics, "dlx_proxy_redrive_jobs_running"),
        Some(0.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_redrive_loses_nothing_across_a_sigkill() {
    let mut node = Node::start_with(
        "dlx-proxy-redrive-kill",
        &format!("\n[admin]\ntoken = {TOKEN:?}\n"),
    )
    .await;
    const N: usize = 3000;
    {
        let (_conn, ch) = node.channel().await;
        declare_durable(&ch, "dlq", FieldTable::default()).await;
        declare_durable(&ch, "target", FieldTable::default()).await;
        confirm_select(&ch).await;
        publish_confirmed(
            &ch,
            "dlq",
            (0..N).map(|i| {
                (
                    format!("k{i}"),
                    BasicProperties::default().with_delivery_mode(2),
                )
            }),
        )
        .await;
        let (status, job) = post(
            node.admin,
            serde_json::json!({"from": "dlq", "to": "target", "rate": 2000}),
        )
        .await;
        assert_eq!(status, 201, "{job}");
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    node.kill().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let (in_dlq, in_target) = (count(&ch, "dlq").await, count(&ch, "target").await);
    assert!(
        in_dlq > 0 && in_target > 0,
        "killed mid-redrive: {in_dlq} + {in_target}"
    );
    let dlq = drain(&ch, "dlq").await;
    let target = drain(&ch, "target").await;
    let all = crate::storage_restart::distinct_bodies(&dlq, &target);
    assert_eq!(
        all.len(),
        N,
        "every message in the DLQ or the target\n{}",
        node.logs()
    );
    assert_eq!(dlq.len() + target.len(), N, "none in both");
    for (_, _, headers) in &target {
        let redriven = headers
            .as_ref()
            .and_then(|h| h.inner().get("x-redriven-count").cloned());
        assert_eq!(redriven, Some(AMQPValue::LongLongInt(1)));
    }
}

/// The binary in proxy mode in front of the reference node, with the admin token.
async fn proxy_service() -> ProxyProcess {
    let overrides = format!("[admin]\ntoken = {TOKEN:?}\n");
    ProxyProcess::spawn(&fleet_toml(
        &[crate::rabbit::reference().uri()],
        &[],
        &unique("capture"),
        &overrides,
    ))
    .await
}

/// Starts a job with `body` and waits for its end; its final status.
async fn run_job(admin: std::net::SocketAddr, body: Value) -> Value {
    let (status, job) = post(admin, body.clone()).await;
    assert_eq!(status, 201, "{body}: {job:#}");
    wait_job(admin, job["id"].as_u64().unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_redrive_to_sources_by_filter_to_one_queue_and_a_missing_target() {
    let proxy = proxy_service().await;
    let admin = proxy.admin;
    let conn = proxy.connect().await;
    let ch = &conn.create_channel().await.unwrap();
    let (work, other, ttl, dlq, park) = (
        unique("work"),
        unique("other"),
        unique("ttl"),
        unique("dlq"),
        unique("park"),
    );
    declare(ch, &dlq, FieldTable::default()).await;
    declare(ch, &work, dead_letter_to(&dlq, &[])).await;
    declare(ch, &other, dead_letter_to(&dlq, &[])).await;
    declare(ch, &ttl, dead_letter_to(&dlq, &[("x-message-ttl", int(0))])).await;
    declare(ch, &park, FieldTable::default()).await;
    publish(ch, &work, &["w1", "w2"]).await;
    publish(ch, &other, &["o1"]).await;
    get_and_reject(ch, &work, "w1").await;
    get_and_reject(ch, &other, "o1").await;
    publish(ch, &ttl, &["t1"]).await;
    wait_count(ch, &dlq, 3).await;
    get_and_reject(ch, &work, "w2").await;
    wait_count(ch, &dlq, 4).await;

    // A dry run counts what would move and where, and moves nothing.
    let dry = run_job(
        admin,
        serde_json::json!({"from": dlq, "filter": ["reason=rejected"], "dry_run": true}),
    )
    .await;
    assert_eq!(dry["state"], "done", "{dry:#}");
    assert_eq!(
        (
            dry["moved"].as_u64(),
            dry["skipped"].as_u64(),
            dry["total"].as_u64()
        ),
        (Some(3), Some(1), Some(4)),
        "{dry:#}"
    );
    assert_eq!(dry["by_target"][&work], 2);
    assert_eq!(dry["by_target"][&other], 1);
    for (queue, n) in [(&dlq, 4), (&work, 0), (&other, 0)] {
        assert_eq!(count(ch, queue).await, n, "{queue} after the dry run");
    }

    // The rejected ones go back, each to its own source (the CLI against proxy mode); the
    // expired one stays.
    let (code, out, err) = cli(
        proxy.config_path(),
        &["--from", &dlq, "--filter", "reason=rejected"],
    );
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(
        out.contains("moved 3, skipped by filter 1, failed 0, examined 4"),
        "{out}"
    );
    assert_eq!(count(ch, &dlq).await, 1);
    let w1 = get_one(ch, &work).await;
    assert_eq!(payload(&w1), "w1");
    assert_eq!(
        header(&w1, "x-redriven-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    let deaths = x_death(&w1);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), (work.as_str(), "rejected", 1));
    assert_eq!(
        w1.routing_key.as_str(),
        work,
        "published to the source's name"
    );
    assert_eq!(payload(&get_one(ch, &work).await), "w2");
    let o1 = get_one(ch, &other).await;
    assert_eq!(payload(&o1), "o1");

    // Rejected again and redriven again: the history counts both deaths, the header 2.
    o1.reject(BasicRejectOptions { requeue: false })
        .await
        .expect("reject");
    wait_count(ch, &dlq, 2).await;
    let again = run_job(
        admin,
        serde_json::json!({"from": dlq, "filter": ["reason=rejected"]}),
    )
    .await;
    assert_eq!(again["moved"], 1, "{again:#}");
    let o1 = get_one(ch, &other).await;
    assert_eq!(
        header(&o1, "x-redriven-count"),
        Some(&AMQPValue::LongLongInt(2))
    );
    assert_eq!(x_death(&o1)[0].qrc(), (other.as_str(), "rejected", 2));

    // A missing target: failed as no_queue, the message stays in the dead-letter queue.
    let failed = run_job(
        admin,
        serde_json::json!({"from": dlq, "to": unique("missing")}),
    )
    .await;
    assert_eq!(
        (failed["failed"].as_u64(), failed["moved"].as_u64()),
        (Some(1), Some(0)),
        "{failed:#}"
    );
    assert_eq!(failed["failed_by_cause"]["no_queue"], 1);
    assert_eq!(count(ch, &dlq).await, 1);

    // --to: the expired one goes to the named queue, its history intact.
    let to = run_job(admin, serde_json::json!({"from": dlq, "to": park})).await;
    assert_eq!(
        (to["moved"].as_u64(), to["by_target"][&park].as_u64()),
        (Some(1), Some(1)),
        "{to:#}"
    );
    let t1 = get_one(ch, &park).await;
    assert_eq!(payload(&t1), "t1");
    assert_eq!(x_death(&t1)[0].qrc(), (ttl.as_str(), "expired", 1));
    assert_eq!(count(ch, &dlq).await, 0);

    // Metrics as in embedded mode; a missing queue is a 404.
    assert_redrive_metrics(
        admin,
        &[(&work, 2.0), (&park, 1.0)],
        (&dlq, 2.0),
        &[("no_queue", 1.0)],
    )
    .await;
    let (status, answer) = post(admin, serde_json::json!({"from": unique("none")})).await;
    assert_eq!(status, 404, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_redrive_skips_past_a_window_then_cancel_and_resume_lose_nothing() {
    let proxy = proxy_service().await;
    let admin = proxy.admin;
    let conn = proxy.connect().await;
    let ch = &conn.create_channel().await.unwrap();
    let (dlq, target) = (unique("dlq"), unique("target"));
    declare(ch, &target, FieldTable::default()).await;
    const N: usize = 600;
    expired_into(ch, &unique("src"), &dlq, "n", N).await;

    // More messages left out than a consumer's window (256): the pass still sees them all
    // and gives them all back.
    let skipped = run_job(
        admin,
        serde_json::json!({"from": dlq, "filter": ["reason=rejected"]}),
    )
    .await;
    assert_eq!(
        (
            skipped["state"].as_str(),
            skipped["skipped"].as_u64(),
            skipped["examined"].as_u64()
        ),
        (Some("done"), Some(N as u64), Some(N as u64)),
        "{skipped:#}"
    );
    wait_count(ch, &dlq, N as u32).await;

    // Cancelled midway, then resumed: every message once in the target, none lost.
    let (status, job) = post(
        admin,
        serde_json::json!({"from": dlq, "to": target, "rate": 200}),
    )
    .await;
    assert_eq!(status, 201, "{job:#}");
    let id = job["id"].as_u64().unwrap();
    let (status, busy) = post(admin, serde_json::json!({"from": dlq, "to": target})).await;
    assert_eq!(status, 409, "{busy}");
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = admin_call(admin, "GET", &format!("/api/redrive/{id}"), None, None).await;
        let now: Value = serde_json::from_str(&text).unwrap();
        if now["moved"].as_u64().is_some_and(|n| n >= 50) {
            break;
        }
        assert!(Instant::now() < until, "never got going: {now:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = admin_call(
        admin,
        "DELETE",
        &format!("/api/redrive/{id}"),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 202);
    let cancelled = wait_job(admin, id).await;
    assert_eq!(cancelled["state"], "cancelled", "{cancelled:#}");
    let moved = cancelled["moved"].as_u64().unwrap();
    assert!(moved > 0 && moved < N as u64, "{cancelled:#}");
    wait_count(ch, &target, moved as u32).await;
    wait_count(ch, &dlq, (N as u64 - moved) as u32).await;

    let (status, resumed) = admin_call(
        admin,
        "POST",
        &format!("/api/redrive/{id}/resume"),
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 201, "{resumed}");
    let resumed: Value = serde_json::from_str(&resumed).unwrap();
    let resumed = wait_job(admin, resumed["id"].as_u64().unwrap()).await;
    assert_eq!(resumed["resumes"], id, "{resumed:#}");
    assert_eq!(resumed["state"], "done", "{resumed:#}");
    assert_eq!(
        resumed["moved"].as_u64(),
        Some(N as u64 - moved),
        "{resumed:#}"
    );
    // The rate limit holds in proxy mode too: N messages at R/s take at least (N - 1)/R s.
    let left = (N as u64 - moved) as f64;
    assert!(
        resumed["elapsed_secs"].as_f64().unwrap() >= (left - 1.0) / 200.0 * 0.95,
        "{resumed:#}"
    );
    assert!(resumed["rate"].as_f64().unwrap() <= 220.0, "{resumed:#}");
    assert_eq!(count(ch, &dlq).await, 0);
    let mut bodies: Vec<String> = drain(ch, &target)
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    // Skipped messages went back at their place, and what a cancel left too: the target got
    // them in the dead-letter queue's order.
    let in_order: Vec<String> = (0..N).map(|i| format!("n{i}")).collect();
    assert_eq!(bodies, in_order, "in order");
    assert_eq!(bodies.len(), N);
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), N, "no message doubled");
    let metrics = scrape(admin).await;
    assert_eq!(
        metric_value(&metrics, "dlx_proxy_redrive_jobs_running"),
        Some(0.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_redrive_loses_nothing_when_the_proxy_is_killed() {
    let mut proxy = proxy_service().await;
    let (dlq, target) = (unique("dlq"), unique("target"));
    const N: usize = 400;
    {
        let conn = proxy.connect().await;
        let ch = &conn.create_channel().await.unwrap();
        declare(ch, &target, FieldTable::default()).await;
        expired_into(ch, &unique("src"), &dlq, "k", N).await;
        let (status, job) = post(
            proxy.admin,
            serde_json::json!({"from": dlq, "to": target, "rate": 200}),
        )
        .await;
        assert_eq!(status, 201, "{job:#}");
        let until = Instant::now() + Duration::from_secs(20);
        while count(ch, &target).await < 40 {
            assert!(Instant::now() < until, "the job never got going");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // SIGKILL mid-pass: the upstream requeues every delivery the job had not acked.
    proxy.kill();
    let upstream = lapin::Connection::connect(
        &crate::rabbit::reference().uri(),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("connect to the upstream");
    let ch = &upstream.create_channel().await.unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while (count(ch, &dlq).await + count(ch, &target).await) < N as u32 {
        assert!(Instant::now() < until, "messages missing after the kill");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (in_dlq, in_target) = (drain(ch, &dlq).await, drain(ch, &target).await);
    assert!(
        !in_dlq.is_empty() && !in_target.is_empty(),
        "killed mid-redrive: {} + {}",
        in_dlq.len(),
        in_target.len()
    );
    let all = crate::storage_restart::distinct_bodies(&in_dlq, &in_target);
    assert_eq!(all.len(), N, "every message in the DLQ or the target");
    // At least once: a duplicate only for a confirmed publish whose ack did not get out
    // (at most the window of 256 unacked deliveries).
    assert!(
        in_dlq.len() + in_target.len() <= N + 256,
        "{} + {}",
        in_dlq.len(),
        in_target.len()
    );
}
