//! What the broker keeps: persistent messages of durable queues (their publish waits for
//! storage), nothing else; and a second broker restored from the same directory.

use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::FieldTable;

use crate::amqp::content::encode_properties;
use crate::broker::Broker;
use crate::broker::message::Message;
use crate::broker::methods::test_support::broker;
use crate::broker::methods::{ExchangeDeclare, QueueDeclare};
use crate::broker::routing::Destination;
use crate::broker::write_queue::WriteQueue;
use crate::storage::{Storage, StorageOptions};

fn open(dir: &std::path::Path) -> Arc<Broker> {
    let b = broker();
    let (storage, recovered) = Storage::open(
        StorageOptions {
            dir: dir.to_path_buf(),
            fsync: false,
            segment_size: 1 << 20,
        },
        None,
    )
    .expect("open storage");
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
                consumer_timeout: None,
                keep_dead_letters: false,
            },
            crate::metrics::Metrics::new(100),
        );
        let (storage, recovered) = Storage::open(
            StorageOptions {
                dir: dir.clone(),
                fsync: false,
                segment_size: 1 << 20,
            },
            None,
        )
        .unwrap();
        b.restore(recovered, Arc::new(storage));
        durable_exchange(&b, "other", "y", "fanout");
        b.storage().unwrap().close();
    }
    let b = open(&dir);
    assert_eq!(bodies(&b, "keep"), Some(vec![("p1".to_string(), false)]));
    b.storage().unwrap().close();
    std::fs::remove_dir_all(&dir).unwrap();
}
