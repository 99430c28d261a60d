//! Embedded-mode storage across restarts of the real binary: confirmed persistent messages of
//! durable queues survive a clean stop and a SIGKILL (count, order, bodies, headers),
//! transient messages and non-durable queues do not, an unacknowledged delivery comes back
//! redelivered, a dead-letter move is never lost across a SIGKILL, a SIGKILL during consume and
//! ack loses no unacknowledged message, a torn tail only loses the torn record, and storage is
//! on by default (`./data`).

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::dl::{
    AMQPValue, BasicAckOptions, BasicGetOptions, BasicProperties, BasicPublishOptions,
    BasicRejectOptions, Channel, Confirmation, ExchangeDeclareOptions, ExchangeKind, FieldTable,
    QueueBindOptions, QueueDeclareOptions, ShortString, amqp_code, confirm_select, declare_durable,
    int, ls, table,
};
use common::{ServiceProcess, TempDir, free_addresses, process_config, write_atomically};
use lapin::{Connection, ConnectionProperties};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// The binary with `[storage] dir = "data"` in its own directory, restartable on the same
/// ports and files (shared by the other `storage_*` modules).
pub(crate) struct Node {
    pub(crate) dir: TempDir,
    pub(crate) config: std::path::PathBuf,
    pub(crate) amqp: SocketAddr,
    pub(crate) admin: SocketAddr,
    process: Option<ServiceProcess>,
}

impl Node {
    pub(crate) async fn start(tag: &str) -> Node {
        Self::start_with(tag, "").await
    }

    /// Started with `extra` appended to its configuration, right after the `[storage]` keys
    /// (more storage keys, then other sections).
    pub(crate) async fn start_with(tag: &str, extra: &str) -> Node {
        let dir = TempDir::new(tag);
        let (amqp, admin) = free_addresses();
        let config = dir.join("config.toml");
        let mut node = Node {
            dir,
            config,
            amqp,
            admin,
            process: None,
        };
        node.configure(extra);
        node.up().await;
        node
    }

    /// Writes its configuration file with `extra` (a running node reloads it).
    pub(crate) fn configure(&self, extra: &str) {
        let text = format!(
            "{}\n[storage]\ndir = \"data\"\nfsync = \"always\"\n{extra}",
            process_config(self.amqp, self.admin, 0)
        );
        write_atomically(&self.config, &text);
    }

    pub(crate) async fn up(&mut self) {
        self.process = Some(
            ServiceProcess::start(BINARY, self.dir.path(), &self.config, self.amqp, self.admin)
                .await,
        );
    }

    /// The running process's id.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid())
    }

    pub(crate) fn logs(&self) -> String {
        self.process.as_ref().map(|p| p.logs()).unwrap_or_default()
    }

    /// SIGKILL: no shutdown code runs.
    pub(crate) async fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.signal("KILL");
            assert!(p.wait_exit(Duration::from_secs(10)).await.is_some());
        }
    }

    /// SIGTERM and wait for the exit.
    pub(crate) async fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.signal("TERM");
            let status = p.wait_exit(Duration::from_secs(20)).await;
            assert!(status.is_some_and(|s| s.success()), "{}", p.logs());
        }
    }

    pub(crate) async fn channel(&self) -> (Connection, Channel) {
        let uri = format!("amqp://guest:guest@{}/%2f", self.amqp);
        let conn = Connection::connect(&uri, ConnectionProperties::default())
            .await
            .expect("connect");
        let ch = conn.create_channel().await.expect("channel");
        (conn, ch)
    }

    pub(crate) fn segments(&self) -> Vec<std::path::PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(self.dir.join("data").join("segments"))
            .expect("segments dir")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        files
    }
}

pub(crate) fn persistent(i: usize) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from("n"), AMQPValue::LongLongInt(i as i64));
    headers.insert(
        ShortString::from("tag"),
        AMQPValue::LongString(format!("t-{i}").into()),
    );
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Publishes `bodies` with `props` to `queue` with confirms, all in flight at once; every one
/// must be acked.
pub(crate) async fn publish_confirmed(
    ch: &Channel,
    queue: &str,
    bodies: impl Iterator<Item = (String, BasicProperties)>,
) {
    let mut pending = Vec::new();
    for (body, props) in bodies {
        pending.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .expect("publish"),
        );
    }
    for confirm in pending {
        let c = confirm.await.expect("confirm");
        assert!(matches!(c, Confirmation::Ack(_)), "{c:?}");
    }
}

/// Publishes `{prefix}0`..`{prefix}{n-1}` as persistent messages with confirms.
pub(crate) async fn publish_numbered(ch: &Channel, queue: &str, prefix: &str, n: usize) {
    publish_confirmed(
        ch,
        queue,
        (0..n).map(|i| (format!("{prefix}{i}"), persistent(i))),
    )
    .await;
}

/// The distinct bodies found in two queues.
pub(crate) fn distinct_bodies(
    a: &[(String, bool, Option<FieldTable>)],
    b: &[(String, bool, Option<FieldTable>)],
) -> Vec<String> {
    let mut all: Vec<String> = a.iter().chain(b).map(|(body, _, _)| body.clone()).collect();
    all.sort();
    all.dedup();
    all
}

/// Messages in `queue` (passive declare).
pub(crate) use crate::common::dl::message_count as count;

/// Takes every message of `queue` with basic.get and acks it: (body, redelivered, headers).
pub(crate) async fn drain(ch: &Channel, queue: &str) -> Vec<(String, bool, Option<FieldTable>)> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
    {
        out.push((
            String::from_utf8_lossy(&m.delivery.data).into_owned(),
            m.delivery.redelivered,
            m.delivery.properties.headers().clone(),
        ));
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_persistent_messages_survive_sigkill_and_clean_restart() {
    let mut node = Node::start("storage-keep").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "keep", FieldTable::default()).await;
    common::dl::declare(&ch, "temp", FieldTable::default()).await;
    publish_numbered(&ch, "keep", "m-", 1000).await;
    // Transient messages in the durable queue, persistent ones in a non-durable queue.
    publish_confirmed(
        &ch,
        "keep",
        (0..10).map(|i| {
            (
                format!("transient-{i}"),
                BasicProperties::default().with_delivery_mode(1),
            )
        }),
    )
    .await;
    publish_numbered(&ch, "temp", "t-", 10).await;
    assert_eq!(count(&ch, "keep").await, 1010);
    drop(conn);

    let text = common::scrape(node.admin).await;
    let fsyncs = common::metric_value(&text, "dlx_proxy_storage_fsync_seconds_count");
    assert!(
        fsyncs.is_some_and(|n| (1.0..1000.0).contains(&n)),
        "{fsyncs:?}: confirms share fsyncs"
    );
    assert!(
        common::metric_value(&text, "dlx_proxy_storage_bytes").is_some_and(|b| b > 1000.0 * 10.0)
    );

    node.kill().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, "keep").await, 1000, "{}", node.logs());
    let text = common::scrape(node.admin).await;
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_storage_recovered_messages"),
        Some(1000.0)
    );
    // Reading 1000 messages and loading them took some time, and not seconds.
    let took = common::metric_value(&text, "dlx_proxy_storage_recovery_seconds");
    assert!(took.is_some_and(|s| s > 0.0 && s < 5.0), "{took:?}");
    let err = crate::common::dl::passive_declare(&ch, "temp")
        .await
        .expect_err("the non-durable queue is gone");
    assert_eq!(amqp_code(&err), Some(404));

    node.stop().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let got = drain(&ch, "keep").await;
    assert_eq!(got.len(), 1000);
    for (i, (body, redelivered, headers)) in got.into_iter().enumerate() {
        assert_eq!(body, format!("m-{i}"));
        assert!(!redelivered, "message {i} was never delivered");
        let headers = headers.expect("headers kept");
        assert_eq!(
            headers.inner().get("n"),
            Some(&AMQPValue::LongLongInt(i as i64))
        );
        assert_eq!(
            headers.inner().get("tag"),
            Some(&AMQPValue::LongString(format!("t-{i}").into()))
        );
    }

    // The acks were written: after a clean stop the queue is there and empty.
    node.stop().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, "keep").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacked_delivery_comes_back_redelivered_after_sigkill() {
    let mut node = Node::start("storage-redeliver").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "work", FieldTable::default()).await;
    publish_numbered(&ch, "work", "w-", 3).await;
    let first = ch
        .basic_get("work".into(), BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
        .expect("a message");
    assert_eq!(&first.delivery.data[..], b"w-0");
    assert!(!first.delivery.redelivered);
    // The delivered record is written lazily; give the storage thread a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.kill().await;
    drop(conn);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let got = drain(&ch, "work").await;
    let seen: Vec<(&str, bool)> = got.iter().map(|(b, r, _)| (b.as_str(), *r)).collect();
    assert_eq!(seen, vec![("w-0", true), ("w-1", false), ("w-2", false)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_message_is_in_its_source_or_its_dlq_after_sigkill() {
    let mut node = Node::start("storage-dlx").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    ch.exchange_declare(
        "dlx".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare");
    declare_durable(&ch, "dlq", FieldTable::default()).await;
    ch.queue_bind(
        "dlq".into(),
        "dlx".into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    declare_durable(&ch, "src", table(&[("x-dead-letter-exchange", ls("dlx"))])).await;
    const N: usize = 200;
    publish_numbered(&ch, "src", "d-", N).await;
    for _ in 0..N {
        let m = ch
            .basic_get("src".into(), BasicGetOptions { no_ack: false })
            .await
            .expect("basic.get")
            .expect("a message");
        m.delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .expect("reject");
    }
    // SIGKILL right after the last reject left the client.
    node.kill().await;
    drop(conn);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let in_src = drain(&ch, "src").await;
    let in_dlq = drain(&ch, "dlq").await;
    let all = distinct_bodies(&in_src, &in_dlq);
    assert_eq!(all.len(), N, "src {} dlq {}", in_src.len(), in_dlq.len());
    assert!(
        !in_dlq.is_empty(),
        "the dead letters written before the kill are kept"
    );
    for (body, _, headers) in &in_dlq {
        let headers = headers.as_ref().expect("headers");
        let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
            panic!("{body}: no x-death in {headers:?}");
        };
        let Some(AMQPValue::FieldTable(death)) = deaths.as_slice().first() else {
            panic!("{body}: empty x-death");
        };
        assert_eq!(
            death.inner().get("reason"),
            Some(&AMQPValue::LongString("rejected".into()))
        );
    }
    // The durable exchange and its binding came back too.
    confirm_select(&ch).await;
    let c = ch
        .basic_publish(
            "dlx".into(),
            "".into(),
            BasicPublishOptions::default(),
            b"again",
            persistent(0),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(matches!(c, Confirmation::Ack(_)));
    assert_eq!(count(&ch, "dlq").await, 1);
}

/// A node with queue `queue` holding ten confirmed persistent messages `{prefix}0`..`{prefix}9`,
/// stopped cleanly; and its last segment file.
async fn ten_messages_then_stop(queue: &str, prefix: &str) -> (Node, std::path::PathBuf) {
    let mut node = Node::start(&format!("storage-{queue}")).await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, queue, FieldTable::default()).await;
    publish_numbered(&ch, queue, prefix, 10).await;
    drop(conn);
    node.stop().await;
    let last = node.segments().pop().expect("a segment");
    (node, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_cut_and_loses_only_the_torn_record() {
    let (mut node, last) = ten_messages_then_stop("torn", "x-").await;
    let len = std::fs::metadata(&last).expect("segment").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&last)
        .expect("open segment");
    f.set_len(len - 5).expect("truncate");
    drop(f);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let got: Vec<String> = drain(&ch, "torn")
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    let want: Vec<String> = (0..9).map(|i| format!("x-{i}")).collect();
    assert_eq!(got, want);
    let text = common::scrape(node.admin).await;
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_storage_recovered_messages"),
        Some(9.0)
    );
    assert!(
        common::metric_value(&text, "dlx_proxy_storage_recovery_torn_bytes")
            .is_some_and(|b| b > 0.0)
    );
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_storage_recovery_damaged_records"),
        Some(0.0)
    );
    assert!(
        node.logs()
            .contains("torn record at the end of a segment cut off"),
        "{}",
        node.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_confirmed_message_survives_a_sigkill_during_publishing() {
    let mut node = Node::start("storage-midway").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "midway", FieldTable::default()).await;
    // Publishers keep publishing in windows of 50; the kill lands while confirms are
    // outstanding.
    let confirmed = std::sync::Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let publisher = {
        let confirmed = confirmed.clone();
        let ch = ch.clone();
        tokio::spawn(async move {
            for window in 0.. {
                let mut pending = Vec::new();
                for i in window * 50..(window + 1) * 50 {
                    let Ok(confirm) = ch
                        .basic_publish(
                            "".into(),
                            "midway".into(),
                            BasicPublishOptions::default(),
                            format!("p-{i}").as_bytes(),
                            persistent(i),
                        )
                        .await
                    else {
                        return;
                    };
                    pending.push((i, confirm));
                }
                for (i, confirm) in pending {
                    match confirm.await {
                        Ok(Confirmation::Ack(_)) => confirmed.lock().unwrap().push(i),
                        _ => return,
                    }
                }
            }
        })
    };
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while confirmed.lock().unwrap().len() < 500 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    node.kill().await;
    let _ = tokio::time::timeout(Duration::from_secs(5), publisher).await;
    drop(conn);
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(confirmed.len() >= 500, "only {} confirmed", confirmed.len());
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let got: Vec<String> = drain(&ch, "midway")
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    // Every confirmed message is there, in publish order (unconfirmed ones may be too).
    let positions: Vec<usize> = got
        .iter()
        .map(|b| b.trim_start_matches("p-").parse().expect("body p-N"))
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "order kept");
    for i in &confirmed {
        assert!(positions.contains(i), "confirmed message p-{i} lost");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_the_middle_loses_that_message_only_and_is_reported() {
    let (mut node, segment) = ten_messages_then_stop("flip", "body-0").await;
    let mut bytes = std::fs::read(&segment).expect("read segment");
    let at = bytes
        .windows(7)
        .position(|w| w == b"body-04")
        .expect("the fifth body on disk");
    bytes[at + 6] ^= 0x01;
    std::fs::write(&segment, &bytes).expect("write segment");
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let got: Vec<String> = drain(&ch, "flip")
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    let want: Vec<String> = (0..10)
        .filter(|i| *i != 4)
        .map(|i| format!("body-0{i}"))
        .collect();
    assert_eq!(got, want);
    let text = common::scrape(node.admin).await;
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_storage_recovery_damaged_records"),
        Some(1.0)
    );
    assert!(
        node.logs()
            .contains("damaged records skipped during recovery"),
        "{}",
        node.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_length_storm_killed_midway_keeps_every_confirmed_message_somewhere() {
    let mut node = Node::start("storage-maxlen").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "overflow-dlq", FieldTable::default()).await;
    let args = table(&[
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls("overflow-dlq")),
        ("x-max-length", int(10)),
    ]);
    declare_durable(&ch, "overflow", args).await;
    const N: usize = 500;
    // Every publish past the tenth drops the head into the DLQ (drop-head, reason maxlen).
    publish_numbered(&ch, "overflow", "o-", N).await;
    node.kill().await;
    drop(conn);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let in_source = drain(&ch, "overflow").await;
    let in_dlq = drain(&ch, "overflow-dlq").await;
    assert_eq!(
        in_source.len(),
        10,
        "the source keeps its limit after recovery"
    );
    let all = distinct_bodies(&in_source, &in_dlq);
    assert_eq!(
        all.len(),
        N,
        "source {} dlq {}",
        in_source.len(),
        in_dlq.len()
    );
    let newest: Vec<String> = (N - 10..N).map(|i| format!("o-{i}")).collect();
    let source: Vec<String> = in_source.into_iter().map(|(b, _, _)| b).collect();
    assert_eq!(source, newest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_is_on_by_default_in_data_under_the_working_directory() {
    let dir = TempDir::new("storage-default");
    let (amqp, admin) = free_addresses();
    let config = dir.join("config.toml");
    // No [storage] section at all.
    write_atomically(&config, &process_config(amqp, admin, 0));
    let start = || ServiceProcess::start(BINARY, dir.path(), &config, amqp, admin);
    let mut process = start().await;
    let uri = format!("amqp://guest:guest@{amqp}/%2f");
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    confirm_select(&ch).await;
    declare_durable(&ch, "default-on", FieldTable::default()).await;
    publish_numbered(&ch, "default-on", "d-", 3).await;
    drop(conn);
    process.signal("KILL");
    assert!(process.wait_exit(Duration::from_secs(10)).await.is_some());
    assert!(dir.join("data").join("definitions").is_file());
    let _process = start().await;
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let got: Vec<String> = drain(&ch, "default-on")
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    assert_eq!(got, vec!["d-0", "d-1", "d-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_during_consume_and_ack_loses_no_unacknowledged_message() {
    let mut node = Node::start("storage-consume").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "consumed", FieldTable::default()).await;
    const N: usize = 1_000;
    publish_numbered(&ch, "consumed", "c-", N).await;
    ch.basic_qos(50, common::dl::BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = common::dl::consumer(&ch, "consumed", "c").await;
    // Ack until half are acknowledged (each ack sent before it is counted), then kill.
    let mut acked = Vec::new();
    while acked.len() < N / 2 {
        let d = common::dl::next(&mut consumer).await;
        d.ack(BasicAckOptions::default()).await.expect("ack");
        acked.push(String::from_utf8_lossy(&d.data).into_owned());
    }
    node.kill().await;
    drop(conn);
    node.up().await;
    let (_conn, ch) = node.channel().await;
    let left: Vec<String> = drain(&ch, "consumed")
        .await
        .into_iter()
        .map(|(b, _, _)| b)
        .collect();
    // At-least-once: every message not acknowledged is back, in order; acknowledged ones may
    // be too (acks are made durable lazily), never anything twice.
    let positions: Vec<usize> = left
        .iter()
        .map(|b| b.trim_start_matches("c-").parse().expect("body c-N"))
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "order kept, no duplicates"
    );
    for i in 0..N {
        let body = format!("c-{i}");
        assert!(
            positions.contains(&i) || acked.contains(&body),
            "{body} was neither acknowledged nor kept"
        );
    }
    assert!(left.len() >= N - acked.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_returned_past_its_delivery_limit_by_crashes_is_dead_lettered_at_start() {
    let mut node = Node::start("storage-delivery-limit").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "limit-dlq", FieldTable::default()).await;
    let args = table(&[
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls("limit-dlq")),
        ("x-delivery-limit", int(1)),
    ]);
    declare_durable(&ch, "limited", args).await;
    publish_numbered(&ch, "limited", "l-", 1).await;
    drop(conn);
    // Delivered and never settled, twice: each crash returns it once.
    for returned in 1..=2 {
        let (_conn, ch) = node.channel().await;
        assert_eq!(count(&ch, "limit-dlq").await, 0, "returned {returned}");
        let d = common::dl::get_one(&ch, "limited").await;
        assert_eq!(&d.data[..], b"l-0");
        // The delivered record is written lazily; give the storage thread a moment.
        tokio::time::sleep(Duration::from_millis(300)).await;
        node.kill().await;
        node.up().await;
    }
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, "limited").await, 0, "{}", node.logs());
    let d = common::dl::get_one(&ch, "limit-dlq").await;
    assert_eq!(&d.data[..], b"l-0");
    assert_eq!(
        common::dl::x_death(&d)[0].qrc(),
        ("limited", "delivery_limit", 1)
    );
}

/// A durable queue the server named (`amq.gen-…`) is restored with its messages: the
/// reserved `amq.` prefix is refused to clients, not to the broker's own definitions. (The
/// restore was refused with 403, so its confirmed messages stayed on disk, out of reach.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_server_named_queue_is_restored_with_its_messages() {
    let mut node = Node::start("storage-server-named").await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let queue = ch
        .queue_declare("".into(), durable, FieldTable::default())
        .await
        .expect("a server-named durable queue");
    let name = queue.name().to_string();
    assert!(name.starts_with("amq.gen-"), "{name}");
    publish_numbered(&ch, &name, "m-", 3).await;
    drop(conn);
    node.kill().await;
    node.up().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(count(&ch, &name).await, 3, "{}", node.logs());
    let got = drain(&ch, &name).await;
    let bodies: Vec<String> = got.into_iter().map(|(body, _, _)| body).collect();
    assert_eq!(bodies, ["m-0", "m-1", "m-2"]);
    node.stop().await;
}
