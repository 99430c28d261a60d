//! The original differential dead-letter harness (../shared/conformance, Python + pika) run
//! against the embedded broker, against the reference RabbitMQ node the tests start, and
//! through proxy mode, each compared with the shared recording: an extra CI check beside the
//! Rust port of the same scenarios in `conformance/`, which a plain `cargo test` runs.
//!
//! The harness lives outside this repository, so these tests are ignored by a plain
//! `cargo test`; `.ci/run` runs them with `--ignored`, where a missing harness, Python or pika
//! fails them.

use crate::common;
use crate::rabbit;

use std::path::PathBuf;
use std::process::Command;

const SKIP_UNSPECIFIED: &str =
    "client_xdeath_duplicate_entries,quorum_overflow_reject_publish_dlx,quorum_declare_arguments";

/// The admin token of the service under test; the harness's policy command (`dlx-proxy
/// policy`) reads it from the environment it inherits.
const ADMIN_TOKEN: &str = "conformance-harness-admin-token";

/// The harness directory: `$DLX_CONFORMANCE_DIR`, or `../shared/conformance` beside the
/// repository. Panics when it or python3 with pika is missing.
fn harness_dir() -> PathBuf {
    let dir = std::env::var_os("DLX_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/conformance"));
    assert!(
        dir.join("dlx_conformance.py").exists(),
        "conformance harness not found at {} (set DLX_CONFORMANCE_DIR)",
        dir.display()
    );
    let pika = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        pika,
        "python3 with pika is required (pip install pika==1.4.4)"
    );
    dir
}

/// The harness's `--policy-cmd` for `dlx-proxy policy` at `admin`. The harness fills every
/// placeholder for both ops (shell-quoted) and runs the line with `sh -c`; a `case` on the op
/// passes `clear` only the name and vhost, so each subcommand gets exactly its own arguments.
fn policy_cmd(admin: std::net::SocketAddr) -> String {
    let program = format!(
        "'{}' policy --admin {admin}",
        env!("CARGO_BIN_EXE_dlx-proxy").replace('\'', r"'\''")
    );
    format!(
        "case {{op}} in \
         set) {program} set {{name}} {{pattern}} {{definition}} --vhost {{vhost}} \
         --priority {{priority}} --apply-to {{apply_to}} ;; \
         clear) {program} clear {{name}} --vhost {{vhost}} ;; \
         *) echo \"unknown policy op {{op}}\" >&2; exit 2 ;; esac"
    )
}

/// Runs the harness; returns its output and whether it passed.
fn run_harness(dir: &PathBuf, url: &str, policy_cmd: &str, skip: &str) -> (bool, String) {
    // The "rabbitmqctl" policy preset calls `rabbitmqctl` from PATH: the reference node's own.
    let path = std::env::join_paths(std::iter::once(rabbit::reference().ctl_dir()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("PATH");
    let out = Command::new("python3")
        .current_dir(dir)
        .env("PATH", path)
        .env("DLX_PROXY_ADMIN__TOKEN", ADMIN_TOKEN)
        .args([
            "dlx_conformance.py",
            "--url",
            url,
            "--compare",
            "expected.json",
            "--policy-cmd",
            policy_cmd,
            "--skip",
            skip,
        ])
        .output()
        .expect("run python3");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The Python harness's scenario names (`--list`, first column).
fn harness_scenarios(dir: &PathBuf) -> Vec<String> {
    let out = Command::new("python3")
        .current_dir(dir)
        .args(["dlx_conformance.py", "--list"])
        .output()
        .expect("run python3");
    assert!(out.status.success(), "--list failed: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
#[ignore = "needs ../shared/conformance and python3 with pika; .ci/run runs it with --ignored"]
fn conformance_port_matches_the_harness_and_its_recording() {
    let dir = harness_dir();
    let mut listed = harness_scenarios(&dir);
    listed.sort();
    let mut ported: Vec<String> = crate::conformance::scenarios::all()
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    ported.sort();
    assert_eq!(
        ported, listed,
        "the port's scenarios vs dlx_conformance.py --list"
    );
    let shared: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected.json")).expect("read the shared recording"),
    )
    .expect("the shared recording is JSON");
    let ours: serde_json::Value =
        serde_json::from_str(crate::conformance::EXPECTED).expect("expected.json is JSON");
    assert!(
        ours == shared,
        "tests/it/conformance/expected.json differs from {}; diff them and copy the newer one",
        dir.join("expected.json").display()
    );
}

fn summary(text: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with("FAIL") || l.starts_with("ERROR") || l.contains(" passed, "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs ../shared/conformance and python3 with pika; .ci/run runs it with --ignored"]
async fn conformance_embedded_broker() {
    let dir = harness_dir();
    let mut cfg = common::test_config();
    cfg.listen.admin = "127.0.0.1:0".into();
    cfg.admin.token = ADMIN_TOKEN.into();
    let b = common::start_with(cfg).await;
    let admin = b.service.admin_addr.expect("admin listener");
    let url = format!("amqp://guest:guest@{}/", b.addr);
    let policy_cmd = policy_cmd(admin);
    let (ok, text) =
        tokio::task::spawn_blocking(move || run_harness(&dir, &url, &policy_cmd, SKIP_UNSPECIFIED))
            .await
            .expect("harness task");
    assert!(
        ok,
        "conformance failures against the embedded broker:\n{}\n\n{text}",
        summary(&text)
    );
    assert!(text.contains(" passed, 0 failed"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs ../shared/conformance and python3 with pika; .ci/run runs it with --ignored"]
async fn conformance_reference_rabbitmq() {
    let dir = harness_dir();
    let url = format!("amqp://guest:guest@{}/", rabbit::reference().amqp);
    // declare_invalid_arguments differs on purpose (we accept x-delivery-limit on classic
    // queues), so the reference run skips it.
    let skip = format!("{SKIP_UNSPECIFIED},declare_invalid_arguments");
    let (ok, text) =
        tokio::task::spawn_blocking(move || run_harness(&dir, &url, "rabbitmqctl", &skip))
            .await
            .expect("harness task");
    assert!(
        ok,
        "the recording no longer matches RabbitMQ:\n{}\n\n{text}",
        summary(&text)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs ../shared/conformance and python3 with pika; .ci/run runs it with --ignored"]
async fn conformance_through_the_proxy() {
    let dir = harness_dir();
    let upstream = rabbit::reference().amqp;
    let mut cfg = common::test_config();
    cfg.mode = dlx_proxy::config::Mode::Proxy;
    cfg.upstream.url = format!("amqp://{upstream}");
    cfg.upstream.user = "guest".into();
    cfg.upstream.password = "guest".into();
    cfg.listen.admin = "127.0.0.1:0".into();
    cfg.admin.token = ADMIN_TOKEN.into();
    cfg.proxy.capture_name = common::unique("conformance.capture");
    let b = common::start_with(cfg).await;
    let admin = b.service.admin_addr.expect("admin listener");
    let url = format!("amqp://guest:guest@{}/", b.addr);
    let policy_cmd = policy_cmd(admin);
    let (ok, text) =
        tokio::task::spawn_blocking(move || run_harness(&dir, &url, &policy_cmd, SKIP_UNSPECIFIED))
            .await
            .expect("harness task");
    assert!(
        ok,
        "conformance failures through the proxy:\n{}\n\n{text}",
        summary(&text)
    );
}
