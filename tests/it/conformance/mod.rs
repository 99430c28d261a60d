//! The differential dead-letter conformance scenarios, as the project's own tests: a Rust port
//! of the Python harness (`../shared/conformance/dlx_conformance.py`) and its recording,
//! `expected.json` (RabbitMQ 3.10.8's observations with dlx-proxy's deliberate differences
//! applied; same format as the shared file, so the two can be diffed).
//!
//! Each scenario (in `scenarios/`) runs in its own [`ctx::Ctx`]: its own connections (through
//! its own [`tap`], which records each delivery's raw header), names with a random suffix,
//! publisher confirms, bounded polling, a 10 s limit, cleanup afterwards. Its normalised
//! observation ([`observe`]) is compared with the recording ([`compare`]) by the [`runner`].
//! Three tests run every scenario against a target ([`target`]): the embedded broker, the
//! reference RabbitMQ node the tests start ([`crate::rabbit::reference`]; proves the recording
//! still matches RabbitMQ), and proxy mode in front of that node, eight scenarios at a time
//! (they share no names). The scenarios the recording lists as `unspecified` are skipped
//! everywhere, its `deliberate_differences` against RabbitMQ. A failure lists every failing
//! scenario with its differences.
//!
//! `conformance_harness.rs` still runs the Python harness itself (ignored; `.ci/run`).

mod compare;
mod ctx;
mod observe;
mod receive;
mod runner;
pub(crate) mod scenarios;
mod tap;
mod target;

use serde_json::Value;

use crate::common;
use crate::rabbit;
use runner::check;
use target::{PolicyHook, Target};

/// The recording, in the harness's format (`dlx-conformance/1`).
pub(crate) const EXPECTED: &str = include_str!("expected.json");
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
    cfg.admin.token = target::ADMIN_TOKEN.into();
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
        cfg.upstream.user = "guest".into();
        cfg.upstream.password = "guest".into();
        cfg.listen.admin = "127.0.0.1:0".into();
        cfg.admin.token = target::ADMIN_TOKEN.into();
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
