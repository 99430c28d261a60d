//! Log output of the real binary: `log.format = "json"` writes one JSON object per line
//! (parseable by log collectors), the default text format does not, and `log.filter` /
//! `RUST_LOG` choose the level.

use crate::common;

use std::time::Duration;

use common::{ServiceProcess, TempDir, free_addresses, process_config, write_atomically};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// Runs the binary with `[log]` set to `log_section`, waits until ready, stops it with
/// SIGTERM and returns every line it wrote (stdout then stderr).
async fn run_and_collect(log_section: &str) -> Vec<String> {
    let dir = TempDir::new("dlx-proxy-logs");
    let (amqp, admin) = free_addresses();
    let path = dir.join("config.toml");
    write_atomically(
        &path,
        &format!("{}\n[log]\n{log_section}\n", process_config(amqp, admin, 1)),
    );
    let mut process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
    process.signal("TERM");
    let status = process
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no exit:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    let stdout = std::fs::read_to_string(&process.stdout_path).unwrap();
    let stderr = std::fs::read_to_string(&process.stderr_path).unwrap();
    stdout
        .lines()
        .chain(stderr.lines())
        .map(str::to_string)
        .collect()
}

fn message(event: &serde_json::Value) -> Option<&str> {
    event
        .get("fields")
        .and_then(|f| f.get("message"))
        .or_else(|| event.get("message"))
        .and_then(|m| m.as_str())
}

#[tokio::test]
async fn json_format_writes_one_json_object_per_line() {
    let lines = run_and_collect("format = \"json\"\nfilter = \"info\"").await;
    assert!(!lines.is_empty(), "no log output at all");
    let mut events = Vec::new();
    for line in lines.iter().filter(|l| !l.trim().is_empty()) {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}\nall:\n{lines:#?}"));
        assert!(event.is_object(), "{line}");
        events.push(event);
    }
    let start = events
        .iter()
        .find(|e| message(e) == Some("starting dlx-proxy"))
        .unwrap_or_else(|| panic!("no start event in {events:#?}"));
    assert_eq!(start["level"], "INFO", "{start}");
    assert!(start.get("timestamp").is_some(), "{start}");
    assert_eq!(start["fields"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(
        events.iter().any(|e| message(e) == Some("shutting down")),
        "no shutdown event in {events:#?}"
    );
    assert!(
        events
            .iter()
            .any(|e| message(e) == Some("dlx-proxy stopped")),
        "no stop event in {events:#?}"
    );
}

#[tokio::test]
async fn text_format_is_the_default_and_not_json() {
    let lines = run_and_collect("filter = \"info\"").await;
    let start = lines
        .iter()
        .find(|l| l.contains("starting dlx-proxy"))
        .unwrap_or_else(|| panic!("no start line in {lines:#?}"));
    assert!(serde_json::from_str::<serde_json::Value>(start).is_err());
    assert!(start.contains("INFO"), "{start}");
}

#[tokio::test]
async fn the_filter_hides_lower_levels() {
    let lines = run_and_collect("format = \"json\"\nfilter = \"warn\"").await;
    for line in lines.iter().filter(|l| !l.trim().is_empty()) {
        let event: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(
            matches!(event["level"].as_str(), Some("WARN") | Some("ERROR")),
            "an event below warn passed the filter: {line}"
        );
    }
}
