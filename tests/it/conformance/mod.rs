//! The differential dead-letter conformance scenarios, as the project's own tests: a Rust port
//! of the Python harness (`../shared/conformance/dlx_conformance.py`) and its recording,
//! `expected.json` (RabbitMQ 3.10.8's observations with dlx-proxy's deliberate differences
//! applied; same format as the shared file, so the two can be diffed).
//!
//! Each scenario (in `scenarios/`) runs in its own [`ctx::Ctx`]: its own connections, names
//! with a random suffix, publisher confirms, bounded polling, a 10 s limit, cleanup afterwards.
//! Its normalised observation ([`observe`]) is compared with the recording ([`compare`]).
//! Three tests run every scenario against a target ([`target`]): the embedded broker, the
//! reference RabbitMQ node the tests start ([`crate::rabbit::reference`]; proves the recording
//! still matches RabbitMQ), and proxy mode in front of that node. Scenarios run concurrently
//! (they share no names). The scenarios the recording lists as `unspecified` are skipped
//! everywhere, its `deliberate_differences` against RabbitMQ. A failure lists every failing
//! scenario with its differences.
//!
//! `conformance_harness.rs` still runs the Python harness itself (ignored; `.ci/run`).

mod compare;
mod ctx;
mod observe;
pub(crate) mod scenarios;
mod tap;
mod target;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common;
use crate::rabbit;
use scenarios::Scenario;
use target::{PolicyHook, Target};

/// The recording, in the harness's format (`dlx-conformance/1`).
pub(crate) const EXPECTED: &str = include_str!("expected.json");
/// The hard limit on one scenario, as in the harness.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(10);
/// How many scenarios run at once.
const WORKERS: usize = 8;

fn expected() -> Value {
    serde_json::from_str(EXPECTED).expect("expected.json is JSON")
}

/// The keys of one of the recording's top-level objects (`scenarios`, `unspecified`, ...).
fn keys(doc: &Value, field: &str) -> Vec<String> {
    doc[field]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// What one scenario observed, and what went on around it.
struct Run {
    name: &'static str,
    desc: &'static str,
    observation: Value,
    info: Vec<String>,
    cleanup_errors: Vec<String>,
    duration: Duration,
}

async fn run_one(scenario: &Scenario, target: Arc<Target>) -> Run {
    let started = Instant::now();
    let tap = match tap::Tap::start(target.server).await {
        Ok(tap) => tap,
        Err(e) => panic!("the tap for {} could not listen: {e}", scenario.name),
    };
    let mut t = ctx::Ctx::new(target, tap);
    let hook = t.hook.clone();
    let outcome = {
        let steps = (scenario.run)(&mut t);
        tokio::pin!(steps);
        // The limit, plus the time spent in the policy hook.
        loop {
            let spent = Duration::from_millis(hook.spent_millis.load(Ordering::SeqCst));
            let deadline = tokio::time::Instant::from_std(started + SCENARIO_TIMEOUT + spent);
            tokio::select! {
                outcome = &mut steps => break Some(outcome),
                _ = tokio::time::sleep_until(deadline) => {
                    let more = hook.spent_millis.load(Ordering::SeqCst) > spent.as_millis() as u64;
                    if hook.busy.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    } else if !more {
                        break None;
                    }
                }
            }
        }
    };
    match outcome {
        Some(Ok(())) => {}
        Some(Err(failure)) => {
            t.info.push(format!("{failure:?}"));
            t.set("unexpected_error", failure.observation());
        }
        None => t.set(
            "harness_error",
            json!({"error": "scenario-timeout", "limit_s": SCENARIO_TIMEOUT.as_secs_f64()}),
        ),
    }
    let cleanup_errors = t.finish().await;
    let observation = Value::Object(std::mem::take(&mut t.obs));
    let rand = t.rand.clone();
    Run {
        name: scenario.name,
        desc: scenario.desc,
        observation: observe::replace_token(observation, &rand, observe::SUFFIX_TOKEN),
        info: t
            .info
            .iter()
            .map(|line| line.replace(&rand, observe::SUFFIX_TOKEN))
            .collect(),
        cleanup_errors,
        duration: started.elapsed(),
    }
}

/// Runs every scenario but `skip` and compares each with the recording; panics listing every
/// failing scenario with its differences. One worker per target in `targets` (the same
/// server, or one proxy each: see [`scenarios_through_the_proxy`]) takes the next scenario
/// until none is left.
async fn check(targets: Vec<Target>, skip: &[String]) {
    let doc = expected();
    let all = scenarios::all();
    let todo: std::sync::Mutex<VecDeque<&Scenario>> = std::sync::Mutex::new(
        all.iter()
            .filter(|s| !skip.iter().any(|k| k == s.name))
            .collect(),
    );
    let target_name = targets.first().map(|t| t.name).unwrap_or("no target");
    let started = Instant::now();
    let workers = targets.into_iter().map(Arc::new).map(|target| {
        let todo = &todo;
        async move {
            let mut runs = Vec::new();
            loop {
                let next = todo.lock().expect("scenario queue").pop_front();
                let Some(scenario) = next else { break runs };
                runs.push(run_one(scenario, target.clone()).await);
            }
        }
    });
    let runs: Vec<Run> = futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let mut failures = Vec::new();
    let mut cleanup = Vec::new();
    for run in &runs {
        let expected = &doc["scenarios"][run.name]["observation"];
        let diff = compare::deep_diff(expected, &run.observation);
        if !run.cleanup_errors.is_empty() {
            cleanup.push(format!("{}: {}", run.name, run.cleanup_errors.join("; ")));
        }
        if diff.is_empty() {
            continue;
        }
        let mut text = format!(
            "FAIL {} ({:.2}s) -- {}\n",
            run.name,
            run.duration.as_secs_f64(),
            run.desc
        );
        for line in &diff {
            text.push_str(&format!("    {line}\n"));
        }
        for note in run.info.iter().take(6) {
            text.push_str(&format!("    note: {}\n", compare::short(&json!(note))));
        }
        text.push_str(&format!("    actual: {}\n", run.observation));
        failures.push(text);
    }
    assert!(
        failures.is_empty(),
        "{} of {} conformance scenarios failed against the {} ({:.1}s):\n\n{}\n{}",
        failures.len(),
        runs.len(),
        target_name,
        started.elapsed().as_secs_f64(),
        failures.join("\n"),
        if cleanup.is_empty() {
            String::new()
        } else {
            format!("cleanup errors:\n{}", cleanup.join("\n"))
        }
    );
    assert!(
        cleanup.is_empty(),
        "scenarios left topology or policies behind on the {}:\n{}",
        target_name,
        cleanup.join("\n")
    );
}

/// `amqp://guest:guest@addr/%2f`
fn uri(addr: std::net::SocketAddr) -> String {
    format!("amqp://guest:guest@{addr}/%2f")
}

#[test]
fn the_port_has_every_recorded_scenario_once() {
    let mut ported: Vec<&str> = scenarios::all().iter().map(|s| s.name).collect();
    let count = ported.len();
    ported.sort();
    ported.dedup();
    assert_eq!(ported.len(), count, "a scenario is registered twice");
    let doc = expected();
    let mut recorded = keys(&doc, "scenarios");
    recorded.sort();
    assert_eq!(ported, recorded, "ported scenarios vs expected.json");
    assert_eq!(doc["format"], "dlx-conformance/1");
    for skipped in keys(&doc, "unspecified")
        .iter()
        .chain(&keys(&doc, "deliberate_differences"))
    {
        assert!(recorded.contains(skipped), "{skipped} is not a scenario");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_against_the_embedded_broker() {
    let mut cfg = common::test_config();
    cfg.listen.admin = "127.0.0.1:0".into();
    let broker = common::start_with(cfg).await;
    let admin = broker.service.admin_addr.expect("admin listener");
    let targets = (0..WORKERS)
        .map(|_| Target {
            name: "embedded broker",
            uri: uri(broker.addr),
            server: broker.addr,
            username: "guest".into(),
            policy: PolicyHook::Admin(admin),
        })
        .collect();
    check(targets, &keys(&expected(), "unspecified")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_against_the_reference_rabbitmq() {
    let node = tokio::task::spawn_blocking(rabbit::reference)
        .await
        .expect("start the reference node");
    let targets = (0..WORKERS)
        .map(|_| Target {
            name: "reference RabbitMQ",
            uri: node.uri(),
            server: node.amqp,
            username: "guest".into(),
            policy: PolicyHook::RabbitMqCtl,
        })
        .collect();
    // The deliberate differences (dlx-proxy accepts x-delivery-limit on classic queues) are
    // where RabbitMQ differs from the recording on purpose.
    let doc = expected();
    let mut skip = keys(&doc, "unspecified");
    skip.extend(keys(&doc, "deliberate_differences"));
    check(targets, &skip).await;
}

/// One proxy per worker: each proxy has its own capture queue, consumed by every client
/// connection through it, so scenarios sharing a proxy would share captured deaths among
/// their connections and see them in another order (quorum_message_ttl).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_through_the_proxy() {
    let node = tokio::task::spawn_blocking(rabbit::reference)
        .await
        .expect("start the reference node");
    let mut proxies = Vec::new();
    let mut targets = Vec::new();
    for _ in 0..WORKERS {
        let mut cfg = common::test_config();
        cfg.mode = dlx_proxy::config::Mode::Proxy;
        cfg.upstream.url = format!("amqp://{}", node.amqp);
        cfg.listen.admin = "127.0.0.1:0".into();
        let capture = common::unique("conformance.capture");
        cfg.proxy.capture_name = capture.clone();
        let proxy = common::start_with(cfg).await;
        targets.push(Target {
            name: "proxy",
            uri: uri(proxy.addr),
            server: proxy.addr,
            username: "guest".into(),
            policy: PolicyHook::Admin(proxy.service.admin_addr.expect("admin listener")),
        });
        proxies.push((proxy, capture));
    }
    check(targets, &keys(&expected(), "unspecified")).await;
    for (proxy, capture) in proxies {
        proxy.service.shutdown().await;
        crate::proxy_support::delete_capture(&capture).await;
    }
}
