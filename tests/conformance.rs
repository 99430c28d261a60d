//! The differential dead-letter harness (../shared/conformance, Python + pika) run against
//! the embedded broker and against the reference RabbitMQ, both compared with the recorded
//! contract. Locally it skips with a message when Python/pika, the harness or RabbitMQ are
//! missing; under CI (CI set) a missing piece fails the test.

mod common;

use std::path::PathBuf;
use std::process::Command;

const SKIP_UNSPECIFIED: &str =
    "client_xdeath_duplicate_entries,quorum_overflow_reject_publish_dlx,quorum_declare_arguments";

/// The admin token of the service under test; the harness's policy command (`dlx-proxy
/// policy`) reads it from the environment it inherits.
const ADMIN_TOKEN: &str = "conformance-harness-admin-token";

fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

fn harness_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("DLX_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/conformance"));
    dir.join("dlx_conformance.py").exists().then_some(dir)
}

fn python_has_pika() -> bool {
    Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Returns the harness directory, or None after printing why the test is skipped.
fn prerequisites() -> Option<PathBuf> {
    let Some(dir) = harness_dir() else {
        assert!(
            !in_ci(),
            "conformance harness not found (../shared/conformance)"
        );
        eprintln!("skipping: conformance harness not found at ../shared/conformance");
        return None;
    };
    if !python_has_pika() {
        assert!(!in_ci(), "python3 with pika is required in CI");
        eprintln!("skipping: python3 with pika 1.4.4 is not installed (pip install pika==1.4.4)");
        return None;
    }
    Some(dir)
}

/// Runs the harness; returns its output and whether it passed.
fn run_harness(dir: &PathBuf, url: &str, policy_cmd: &str, skip: &str) -> (bool, String) {
    let out = Command::new("python3")
        .current_dir(dir)
        .env("RABBITMQ_NODENAME", "rabbit@localhost")
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

fn summary(text: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with("FAIL") || l.starts_with("ERROR") || l.contains(" passed, "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_embedded_broker() {
    let Some(dir) = prerequisites() else { return };
    let mut cfg = common::test_config();
    cfg.listen.admin = "127.0.0.1:0".into();
    cfg.admin.token = ADMIN_TOKEN.into();
    let b = common::start_with(cfg).await;
    let admin = b.service.admin_addr.expect("admin listener");
    let url = format!("amqp://guest:guest@{}/", b.addr);
    let policy_cmd = format!(
        "{} policy --admin {admin} {{op}} {{vhost}} {{name}} {{pattern}} {{definition}} {{priority}} {{apply_to}}",
        env!("CARGO_BIN_EXE_dlx-proxy")
    );
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
async fn conformance_reference_rabbitmq() {
    let Some(dir) = prerequisites() else { return };
    let url = std::env::var("DLX_TEST_RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5673/".into());
    let reachable = std::net::TcpStream::connect(
        url.trim_start_matches("amqp://")
            .rsplit('@')
            .next()
            .unwrap_or("127.0.0.1:5673")
            .trim_end_matches('/')
            .split('/')
            .next()
            .unwrap_or("127.0.0.1:5673"),
    )
    .is_ok();
    if !reachable {
        assert!(
            !in_ci(),
            "RabbitMQ is not reachable at {url} (started by .ci/run)"
        );
        eprintln!("skipping: RabbitMQ not reachable at {url}");
        return;
    }
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
async fn conformance_through_the_proxy() {
    let Some(dir) = prerequisites() else { return };
    let upstream =
        std::env::var("DLX_TEST_RABBITMQ_ADDR").unwrap_or_else(|_| "127.0.0.1:5673".into());
    if std::net::TcpStream::connect(&upstream).is_err() {
        assert!(
            !in_ci(),
            "RabbitMQ is not reachable at {upstream} (started by .ci/run)"
        );
        eprintln!("skipping: RabbitMQ not reachable at {upstream}");
        return;
    }
    let mut cfg = common::test_config();
    cfg.mode = dlx_proxy::config::Mode::Proxy;
    cfg.upstream.url = format!("amqp://{upstream}");
    cfg.listen.admin = "127.0.0.1:0".into();
    cfg.admin.token = ADMIN_TOKEN.into();
    cfg.proxy.capture_name = common::unique("conformance.capture");
    let b = common::start_with(cfg).await;
    let admin = b.service.admin_addr.expect("admin listener");
    let url = format!("amqp://guest:guest@{}/", b.addr);
    let policy_cmd = format!(
        "{} policy --admin {admin} {{op}} {{vhost}} {{name}} {{pattern}} {{definition}} {{priority}} {{apply_to}}",
        env!("CARGO_BIN_EXE_dlx-proxy")
    );
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
