//! What the broker keeps: persistent messages of durable queues (their publish waits for
//! storage), nothing else; and a second broker restored from the same directory.

use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable};

use crate::amqp::content::encode_properties;
use crate::broker::Broker;
use crate::broker::message::Message;
use crate::broker::methods::test_support::broker;
use crate::broker::methods::{ExchangeDeclare, QueueDeclare};
use crate::broker::routing::Destination;
use crate::broker::write_queue::WriteQueue;
use crate::storage::{Storage, StorageOptions};

/// Storage on `dir` (no fsync, 1 MiB segments, a 64 MiB paging budget) and what it
/// recovered.
fn open_storage(dir: &std::path::Path) -> (Storage, crate::storage::Recovered) {
    open_storage_with(dir, 64 << 20)
}

fn open_storage_with(
    dir: &std::path::Path,
    paging_budget: u64,
) -> (Storage, crate::storage::Recovered) {
    Storage::open(
        StorageOptions {
            dir: dir.to_path_buf(),
            fsync: false,
            segment_size: 1 << 20,
            paging_budget,
        },
        None,
    )
    .expect("open storage")
}

fn open(dir: &std::path::Path) -> Arc<Broker> {
    open_with(dir, 64 << 20)
}

fn open_with(dir: &std::path::Path, paging_budget: u64) -> Arc<Broker> {
    let b = broker();
    let (storage, recovered) = open_storage_with(dir, paging_budget);
    b.restore(recovered, Arc::new(storage));
    b
}

fn message(key: &str, body: &str, mode: u8) -> Arc<Message> {
    let props = encode_properties(&BasicProperties::default().with_delivery_mode(mode));
    Arc::new(Message::new(
        "",
        &[key],
        &props,
        body.as_bytes(),
        None,
        false,
    ))
}

fn declare(b: &Broker, conn: u64, name: &str, durable: bool, args: &FieldTable) {
    b.queue_declare(
        conn,
        "/",
        &QueueDeclare {
            name,
            passive: false,
            durable,
            exclusive: false,
            auto_delete: false,
            arguments: args,
            restored: false,
        },
    )
    .expect("declare");
}

/// An empty scratch directory for storage.
fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("dlx-broker-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A connection of `guest` on vhost `/` with channel 1 open.
fn connect(b: &Broker) -> u64 {
    let conn = b
        .open_connection(Arc::new(WriteQueue::new(1 << 20)), 131_072, "guest", "/")
        .expect("vhost / exists");
    b.open_channel(conn, 1);
    conn
}

fn durable_exchange(b: &Broker, vhost: &str, name: &str, kind: &str) {
    b.exchange_declare(
        vhost,
        &ExchangeDeclare {
            name,
            kind,
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: &FieldTable::default(),
        },
    )
    .expect("exchange.declare");
}

fn bodies(b: &Broker, queue: &str) -> Option<Vec<(String, bool)>> {
    let st = b.lock();
    let q = st.vhosts["/"].queues.get(queue)?;
    Some(
        q.state
            .iter()
            .map(|e| {
                (
                    String::from_utf8_lossy(e.message.body()).into_owned(),
                    e.redelivered,
                )
            })
            .collect(),
    )
}

#[test]
fn persistent_messages_of_durable_queues_are_kept_and_restored() {
    let dir = scratch("store");
    let none = FieldTable::default();
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "keep", true, &none);
        declare(&b, conn, "temp", false, &none);
        durable_exchange(&b, "/", "x", "topic");
        b.bind(
            conn,
            "/",
            "x",
            Destination::Queue("keep".into()),
            "k.#",
            &none,
        )
        .unwrap();
        let (r, durable) = b
            .publish_durable("/", "", message("keep", "p1", 2), None)
            .unwrap();
        assert!(r.routed);
        assert_eq!(
            durable.expect("kept: the confirm waits").blocking_recv(),
            Ok(true)
        );
        let (_, durable) = b
            .publish_durable("/", "", message("keep", "t1", 1), None)
            .unwrap();
        assert!(durable.is_none(), "transient: not stored");
        let (_, durable) = b
            .publish_durable("/", "", message("temp", "p2", 2), None)
            .unwrap();
        assert!(durable.is_none(), "non-durable queue: not stored");
        b.publish("/", "", message("keep", "p3", 2), None).unwrap();
        b.publish("/", "", message("keep", "p4", 2), None).unwrap();
        // p1 delivered and left unacked; p3 delivered and acked.
        b.get(conn, 1, "/", "keep", false).unwrap();
        b.get(conn, 1, "/", "keep", false).unwrap();
        b.get(conn, 1, "/", "keep", false).unwrap();
        b.ack(conn, 1, 3, false).unwrap();
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(
        bodies(&b, "keep"),
        Some(vec![("p1".to_string(), true), ("p4".to_string(), false)])
    );
    assert_eq!(bodies(&b, "temp"), None);
    let st = b.lock();
    let bindings: Vec<_> = st.vhosts["/"].exchanges["x"].bindings.bindings().collect();
    assert_eq!(bindings.len(), 1);
    assert_eq!(bindings[0].routing_key, "k.#");
    assert!(st.vhosts["/"].exchanges["x"].durable);
    drop(st);
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn definitions_of_a_vhost_missing_from_the_config_are_kept_with_their_messages() {
    let dir = scratch("vhost");
    let none = FieldTable::default();
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "keep", true, &none);
        let (_, durable) = b
            .publish_durable("/", "", message("keep", "p1", 2), None)
            .unwrap();
        assert_eq!(durable.unwrap().blocking_recv(), Ok(true));
        b.storage().unwrap().close();
    }
    {
        // Started once without vhost "/": nothing to restore it into, nothing forgotten.
        let b = Broker::new(
            &["other".to_string()],
            crate::policy::PolicySet::from_configs(&[]).unwrap(),
            crate::broker::BrokerOptions {
                dead_letter: Default::default(),
                default_delivery_limit: None,
                max_queues: 8,
                max_exchanges: 8,
                max_bindings: 8,
                max_consumers_per_channel: 8,
                consumer_timeout: None,
                keep_dead_letters: false,
            },
            crate::metrics::Metrics::new(100),
        );
        let (storage, recovered) = open_storage(&dir);
        b.restore(recovered, Arc::new(storage));
        durable_exchange(&b, "other", "y", "fanout");
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(bodies(&b, "keep"), Some(vec![("p1".to_string(), false)]));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Stores queue `src` (TTL `ttl_ms`, dead-lettering to `dlq`) and `dlq`, and in `src` one
/// persistent message per `(body, age in ms)`, written as if published that long ago.
fn stored_with_ages(dir: &std::path::Path, ttl_ms: i64, messages: &[(&str, u64)]) {
    use crate::storage::definitions::QueueDef;
    use crate::storage::{Definitions, Record, Target};
    use amq_protocol::types::{AMQPValue, ShortString};

    let (s, _) = open_storage(dir);
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-message-ttl"),
        AMQPValue::LongLongInt(ttl_ms),
    );
    args.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        ShortString::from("x-dead-letter-routing-key"),
        AMQPValue::LongString("dlq".into()),
    );
    let def = |name: &str, id: u64, arguments: FieldTable| QueueDef {
        vhost: "/".into(),
        name: name.into(),
        id,
        auto_delete: false,
        arguments,
    };
    s.definitions(Definitions {
        queues: vec![def("src", 1, args), def("dlq", 2, FieldTable::default())],
        ..Definitions::default()
    });
    let wall_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (body, age) in messages {
        s.append(Record::Publish {
            targets: vec![Target {
                queue: 1,
                id: s.next_id(),
                delivered: false,
            }],
            remove: None,
            message: message("src", body, 2),
            at: Some(wall_now - age),
            held_until: None,
        });
    }
    s.close();
}

#[test]
fn messages_whose_ttl_ran_out_while_stopped_are_dead_lettered_at_start() {
    let dir = scratch("ttl");
    stored_with_ages(
        &dir,
        10_000,
        &[("old-1", 60_000), ("old-2", 11_000), ("young", 4_000)],
    );
    let b = open(&dir);
    assert_eq!(bodies(&b, "src"), Some(vec![("young".to_string(), false)]));
    assert_eq!(
        bodies(&b, "dlq"),
        Some(vec![
            ("old-1".to_string(), false),
            ("old-2".to_string(), false)
        ])
    );
    let now = b.now();
    let st = b.lock();
    let dlq = &st.vhosts["/"].queues["dlq"];
    for e in dlq.state.iter() {
        let props = e.message.properties().expect("properties");
        let deaths = crate::deadletter::x_death_entries(&props);
        assert_eq!(deaths.len(), 1);
        assert_eq!(deaths[0].reason, "expired");
        assert_eq!(deaths[0].queue, "src");
    }
    // The young one keeps its deadline: 10 s after it was published, 4 s ago.
    let left = st.vhosts["/"].queues["src"]
        .state
        .iter()
        .next()
        .and_then(|e| e.expires_at)
        .expect("a deadline")
        - now;
    assert!((5_000..=6_100).contains(&left), "expires in {left} ms");
    drop(st);
    b.storage().unwrap().close();
    // The deaths were written: a second start finds the same.
    let b = open(&dir);
    assert_eq!(bodies(&b, "dlq").map(|d| d.len()), Some(2));
    assert_eq!(bodies(&b, "src").map(|d| d.len()), Some(1));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_held_retry_is_held_again_after_a_restart_until_its_due_time() {
    use amq_protocol::types::{AMQPValue, FieldArray};
    let dir = scratch("retry");
    let tiers = |ms: i64| {
        let mut args = FieldTable::default();
        args.insert(
            "x-retry-delays".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongLongInt(ms)])),
        );
        args
    };
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "long", true, &tiers(60_000));
        declare(&b, conn, "short", true, &tiers(1));
        for q in ["long", "short"] {
            b.publish("/", "", message(q, q, 2), None).unwrap();
            b.get(conn, 1, "/", q, false).unwrap();
        }
        b.reject(conn, 1, 1, false, false).unwrap();
        b.reject(conn, 1, 2, false, false).unwrap();
        assert_eq!(bodies(&b, "long"), Some(vec![]));
        b.storage().unwrap().close();
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    let b = open(&dir);
    let due = |q: &str| b.lock().vhosts["/"].queues[q].retry_hold.next_due();
    // Not returned at start: the one past its due time comes back with the queue's timer.
    assert_eq!(bodies(&b, "short"), Some(vec![]));
    assert!(due("short").is_some_and(|d| d <= b.now()));
    let long = due("long").expect("still held");
    assert!(
        long > b.now() + 55_000 && long <= b.now() + 60_000,
        "due {long}, now {}",
        b.now()
    );
    b.run_timers();
    assert_eq!(
        bodies(&b, "short"),
        Some(vec![("short".to_string(), false)])
    );
    assert_eq!(bodies(&b, "long"), Some(vec![]));
    let st = b.lock();
    let back = st.vhosts["/"].queues["short"].state.iter().next().unwrap();
    assert_eq!(back.message.routing_key(), "short");
    let props = back.message.properties().unwrap();
    assert_eq!(
        props
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .get("x-retry-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    drop(st);
    b.storage().unwrap().close();
    // The return was written too: a third start has it queued, not held.
    let b = open(&dir);
    let due = |q: &str| b.lock().vhosts["/"].queues[q].retry_hold.next_due();
    assert_eq!(
        bodies(&b, "short"),
        Some(vec![("short".to_string(), false)])
    );
    assert!(due("short").is_none());
    assert!(due("long").is_some());
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_queue_declared_after_a_restart_never_gets_the_messages_of_a_deleted_one() {
    let dir = scratch("reuse");
    let none = FieldTable::default();
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "jobs", true, &none);
        for body in ["old1", "old2", "old3"] {
            let (_, durable) = b
                .publish_durable("/", "", message("jobs", body, 2), None)
                .unwrap();
            assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        }
        assert_eq!(b.queue_delete(conn, "/", "jobs", false, false), Ok(3));
        b.storage().unwrap().close();
    }
    {
        // The log still holds the deleted queue's messages; the snapshot has no queue.
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "jobs", true, &none);
        declare(&b, conn, "other", true, &none);
        assert_eq!(bodies(&b, "jobs"), Some(vec![]));
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(bodies(&b, "jobs"), Some(vec![]));
    assert_eq!(bodies(&b, "other"), Some(vec![]));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reject_publish_queue_keeps_every_confirmed_message_across_a_restart() {
    let dir = scratch("rejectpub");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(2));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "limited", true, &args);
        let stored = |body: &str| {
            let (r, durable) = b
                .publish_durable("/", "", message("limited", body, 2), None)
                .unwrap();
            assert!(r.routed, "{body} refused");
            assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        };
        stored("m1");
        stored("m2");
        // m1 delivered and not settled: one ready, so m3 is accepted.
        b.get(conn, 1, "/", "limited", false).unwrap();
        stored("m3");
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(
        bodies(&b, "limited"),
        Some(vec![
            ("m1".to_string(), true),
            ("m2".to_string(), false),
            ("m3".to_string(), false)
        ])
    );
    b.storage().unwrap().close();
    // And nothing was removed for good.
    let b = open(&dir);
    assert_eq!(bodies(&b, "limited").map(|v| v.len()), Some(3));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A dead letter that a full `reject-publish-dlx` target refuses and dead-letters onward is
/// moved in two records (out of its queue into the target, then out of the target into the
/// next one); the first must put it somewhere. Here the second record is torn, as a crash
/// between the two leaves it: the message is found in the full target, not lost. (The first
/// record only removed it from its queue.)
#[test]
fn a_dead_letter_refused_by_a_reject_publish_dlx_target_survives_a_crash_between_its_moves() {
    let dir = scratch("refusedmove");
    let text = |v: &str| AMQPValue::LongString(v.into());
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "q3", true, &FieldTable::default());
        let mut full = FieldTable::default();
        full.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
        full.insert("x-overflow".into(), text("reject-publish-dlx"));
        full.insert("x-dead-letter-exchange".into(), text(""));
        full.insert("x-dead-letter-routing-key".into(), text("q3"));
        declare(&b, conn, "q2", true, &full);
        let mut source = FieldTable::default();
        source.insert("x-dead-letter-exchange".into(), text(""));
        source.insert("x-dead-letter-routing-key".into(), text("q2"));
        declare(&b, conn, "q1", true, &source);
        for (queue, body) in [("q2", "old"), ("q1", "a")] {
            let (r, durable) = b
                .publish_durable("/", "", message(queue, body, 2), None)
                .unwrap();
            assert!(r.routed);
            assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        }
        b.get(conn, 1, "/", "q1", false).unwrap();
        b.reject(conn, 1, 1, false, false).unwrap();
        assert_eq!(bodies(&b, "q3").map(|v| v.len()), Some(1), "moved on to q3");
        b.storage().unwrap().close();
    }
    // The onward move (the log's last record) torn off.
    let last = crate::storage::segment::list(&dir)
        .unwrap()
        .pop()
        .expect("a segment");
    let path = crate::storage::segment::segment_path(&dir, last);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let b = open(&dir);
    let names = |queue: &str| -> Vec<String> {
        bodies(&b, queue)
            .unwrap_or_default()
            .into_iter()
            .map(|(body, _)| body)
            .collect()
    };
    assert_eq!(names("q1"), Vec::<String>::new());
    assert_eq!(
        names("q3"),
        Vec::<String>::new(),
        "the onward record is torn"
    );
    assert_eq!(
        names("q2"),
        ["old", "a"],
        "the refused copy in the full target"
    );
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_redrive_pass_moves_past_a_message_it_cannot_read_back() {
    use crate::broker::methods::{BatchLimits, RedriveCursor};
    let dir = scratch("unreadable");
    let none = FieldTable::default();
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "dlq", true, &none);
        declare(&b, conn, "work", true, &none);
        for body in ["first-1", "second-2", "broken-3"] {
            let (_, durable) = b
                .publish_durable("/", "", message("dlq", body, 2), None)
                .unwrap();
            assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        }
        b.storage().unwrap().close();
    }
    // Loaded paged out (recovery keeps no content), then the last message's record is
    // damaged on disk: it can no longer be read back.
    let b = open_with(&dir, 0);
    let segment = crate::storage::segment::segment_path(&dir, 0);
    let mut bytes = std::fs::read(&segment).unwrap();
    let at = bytes
        .windows(8)
        .position(|w| w == b"broken-3")
        .expect("the body on disk");
    bytes[at] ^= 0xFF;
    std::fs::write(&segment, &bytes).unwrap();
    let (end, len) = b.redrive_start("/", "dlq").unwrap();
    assert_eq!(len, 3);
    let plan = crate::redrive::plan::Plan {
        to: Some("work".into()),
        reasons: Vec::new(),
    };
    let batch = b
        .redrive_batch(
            "/",
            "dlq",
            &plan,
            RedriveCursor {
                after: None,
                end: end.unwrap(),
            },
            BatchLimits {
                examine: 100,
                moves: 100,
                dry_run: false,
            },
        )
        .unwrap();
    assert_eq!(batch.moved, vec!["work".to_string(), "work".to_string()]);
    assert_eq!(batch.failed, vec!["unreadable"]);
    assert!(
        batch.done,
        "the pass ends instead of waiting on the unreadable message"
    );
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A paged message whose read fails with an error that may pass (here the segment file is
/// briefly a directory: EISDIR) stays queued, not lost: the consumer gets nothing meanwhile,
/// and the queue's timer reads it again and delivers it once the file is back.
#[test]
fn a_paged_message_unreadable_for_a_moment_is_delivered_once_it_can_be_read() {
    let dir = scratch("reread");
    store_backlog(&dir, "q", 2);
    let b = open_with(&dir, 0);
    let paging = b.paging().unwrap().clone();
    assert_eq!(paging.stats().paged_messages, 2);
    let unblock = block_segment(&dir);
    let out = consume_no_ack(&b, "q");
    assert_eq!(deliveries(&out), 0, "nothing readable to deliver");
    assert_eq!(b.lock().vhosts["/"].queues["q"].state.len(), 2);
    assert_eq!(paging.stats().page_in_retries, 1);
    assert_eq!(paging.stats().page_in_failures, 0);

    unblock();
    std::thread::sleep(std::time::Duration::from_millis(
        crate::broker::paging::READ_RETRY_FIRST_MS + 50,
    ));
    b.run_timers();
    assert_eq!(deliveries(&out), 2, "both delivered after the read");
    assert_eq!(b.lock().vhosts["/"].queues["q"].state.len(), 0);
    assert_eq!(paging.stats().page_in_failures, 0);
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The head a consumer waits behind could not be read, and its TTL runs out before the next
/// read: the timer's expiry reads it (it dies) and the consumer gets the next message then.
#[test]
fn a_consumer_behind_an_unreadable_head_that_expires_gets_the_next_message() {
    let dir = scratch("reread-expire");
    {
        let b = open(&dir);
        let conn = connect(&b);
        declare(&b, conn, "q", true, &FieldTable::default());
        let props = encode_properties(
            &BasicProperties::default()
                .with_delivery_mode(2)
                .with_expiration("1500".into()),
        );
        let short_lived = Arc::new(Message::new("", &["q"], &props, b"m0", Some(1500), false));
        for m in [short_lived, message("q", "m1", 2)] {
            let (_, durable) = b.publish_durable("/", "", m, None).unwrap();
            assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        }
        b.storage().unwrap().close();
    }
    let b = open_with(&dir, 0);
    let unblock = block_segment(&dir);
    let out = consume_no_ack(&b, "q");
    assert_eq!(deliveries(&out), 0);
    unblock();
    std::thread::sleep(std::time::Duration::from_millis(1600));
    b.run_timers();
    assert_eq!(deliveries(&out), 1, "m1, once m0 expired");
    assert_eq!(b.lock().vhosts["/"].queues["q"].state.len(), 0);
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A stored queue with an argument its type does not take (one an earlier version accepted)
/// is restored, not refused: only clients' declares are checked for it.
#[test]
fn a_stored_queue_with_an_argument_of_another_type_is_restored() {
    let dir = scratch("foreign-arg");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-max-priority".into(), AMQPValue::LongInt(5));
    {
        let b = open(&dir);
        let conn = connect(&b);
        let client = QueueDeclare {
            name: "old",
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: &args,
            restored: false,
        };
        assert!(
            b.queue_declare(conn, "/", &client).is_err(),
            "refused to clients"
        );
        // As an earlier version stored it.
        b.queue_declare(
            conn,
            "/",
            &QueueDeclare {
                restored: true,
                ..client
            },
        )
        .expect("declare");
        let (_, durable) = b
            .publish_durable("/", "", message("old", "kept", 2), None)
            .unwrap();
        assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(bodies(&b, "old"), Some(vec![("kept".to_string(), false)]));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Makes the first segment of `dir` unreadable for now (a directory in its place: reads fail
/// with EISDIR, an error that may pass); the returned function puts it back.
fn block_segment(dir: &std::path::Path) -> impl FnOnce() {
    let segment = crate::storage::segment::segment_path(dir, 0);
    let aside = dir.join("aside");
    std::fs::rename(&segment, &aside).unwrap();
    std::fs::create_dir(&segment).unwrap();
    move || {
        std::fs::remove_dir(&segment).unwrap();
        std::fs::rename(&aside, &segment).unwrap();
    }
}

/// A new connection consuming `queue` without acks; its deliveries are written to the
/// returned queue.
fn consume_no_ack(b: &Broker, queue: &str) -> Arc<WriteQueue> {
    let out = Arc::new(WriteQueue::new(1 << 20));
    let conn = b
        .open_connection(out.clone(), 131_072, "guest", "/")
        .expect("vhost / exists");
    b.open_channel(conn, 1);
    b.consume(conn, 1, "/", queue, "c", true, false, 0, false)
        .unwrap();
    out
}

/// The basic.deliver methods written to `out` since the last call.
fn deliveries(out: &WriteQueue) -> usize {
    crate::broker::methods::test_support::sent_methods(out)
        .into_iter()
        .filter(|(_, m)| {
            matches!(
                m,
                amq_protocol::protocol::AMQPClass::Basic(
                    amq_protocol::protocol::basic::AMQPMethod::Deliver(_)
                )
            )
        })
        .count()
}

#[test]
fn a_purge_of_paged_messages_reads_none_back_and_removes_them_for_good() {
    let dir = scratch("purge");
    store_backlog(&dir, "backlog", 50);
    {
        // Back paged out; the purge takes them without reading their contents.
        let b = open_with(&dir, 0);
        let conn = connect(&b);
        let paging = b.paging().unwrap().clone();
        assert_eq!(paging.stats().paged_messages, 50);
        assert_eq!(b.queue_purge(conn, "/", "backlog"), Ok(50));
        assert_eq!(paging.stats().page_ins, 0);
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(bodies(&b, "backlog"), Some(vec![]));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An inspection of a paged-out queue reads each message back from storage (outside the
/// broker lock) and leaves the queue as it was: still paged, nothing paged in.
#[test]
fn an_inspection_of_paged_messages_shows_them_in_order_and_pages_none_in() {
    let dir = scratch("inspect");
    store_backlog(&dir, "dlq", 300);
    let b = open_with(&dir, 0);
    let paging = b.paging().unwrap().clone();
    assert_eq!(paging.stats().paged_messages, 300);
    let inspector = crate::dlq_inspect::Inspector::Broker(b.clone());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let page = runtime
        .block_on(inspector.page("/", "dlq", crate::dlq_view::MAX_LIMIT))
        .unwrap();
    let shown: Vec<String> = page
        .messages
        .iter()
        .map(|m| m.body_preview.clone())
        .collect();
    let expected: Vec<String> = (0..300).map(|i| format!("m{i}")).collect();
    assert_eq!(shown, expected);
    let summary = runtime.block_on(inspector.summary("/", "dlq")).unwrap();
    assert_eq!((summary.inspected, summary.truncated), (300, false));
    assert_eq!(paging.stats().paged_messages, 300);
    assert_eq!(paging.stats().page_ins, 0);
    assert_eq!(bodies(&b, "dlq").map(|b| b.len()), Some(300));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Stores durable queue `queue` with `count` confirmed persistent messages `m0`, `m1`, ...
fn store_backlog(dir: &std::path::Path, queue: &str, count: usize) {
    let b = open(dir);
    let conn = connect(&b);
    declare(&b, conn, queue, true, &FieldTable::default());
    for i in 0..count {
        let (_, durable) = b
            .publish_durable("/", "", message(queue, &format!("m{i}"), 2), None)
            .unwrap();
        assert_eq!(durable.expect("stored").blocking_recv(), Ok(true));
    }
    b.storage().unwrap().close();
}
