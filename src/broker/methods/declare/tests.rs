//! Unit tests of [`crate::broker::methods::declare`].

use amq_protocol::types::FieldTable;

use super::super::test_support::{
    Client, broker, declare, exchange, long, ready, table, with_queue,
};
use crate::amqp::reply;
use crate::broker::routing::Destination;

#[test]
fn a_redeclare_returns_the_counts_and_refuses_other_flags() {
    let (b, c) = with_queue(&FieldTable::default(), &[b"1", b"2"]);
    let none = FieldTable::default();
    let again = b.queue_declare(c.conn, "/", &declare("q", &none)).unwrap();
    assert_eq!((again.name.as_str(), again.message_count), ("q", 2));
    let mut durable = declare("q", &none);
    durable.durable = true;
    let err = b.queue_declare(c.conn, "/", &durable).unwrap_err();
    assert_eq!(err.code, reply::PRECONDITION_FAILED);
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'"
    );
    let mut passive = declare("nope", &none);
    passive.passive = true;
    let err = b.queue_declare(c.conn, "/", &passive).unwrap_err();
    assert_eq!(err.text, "NOT_FOUND - no queue 'nope' in vhost '/'");
}

#[test]
fn server_named_queues_and_the_reserved_prefix() {
    let b = broker();
    let c = Client::connect(&b);
    let none = FieldTable::default();
    let named = b.queue_declare(c.conn, "/", &declare("", &none)).unwrap();
    assert!(named.name.starts_with("amq.gen-"), "{}", named.name);
    assert_eq!(named.name.len(), "amq.gen-".len() + 22);
    let err = b
        .queue_declare(c.conn, "/", &declare("amq.mine", &none))
        .unwrap_err();
    assert_eq!(err.code, reply::ACCESS_REFUSED);
    assert_eq!(
        err.text,
        "ACCESS_REFUSED - queue name 'amq.mine' contains reserved prefix 'amq.*'"
    );
}

#[test]
fn another_connections_exclusive_queue_is_locked() {
    let b = broker();
    let owner = Client::connect(&b);
    let other = Client::connect(&b);
    let none = FieldTable::default();
    let mut exclusive = declare("mine", &none);
    exclusive.exclusive = true;
    b.queue_declare(owner.conn, "/", &exclusive).unwrap();
    let err = b.queue_declare(other.conn, "/", &exclusive).unwrap_err();
    assert_eq!(err.code, reply::RESOURCE_LOCKED);
    let dest = Destination::Queue("mine".into());
    let err = b
        .bind(other.conn, "/", "amq.direct", dest.clone(), "k", &none)
        .unwrap_err();
    assert_eq!(err.code, reply::RESOURCE_LOCKED);
    b.bind(owner.conn, "/", "amq.direct", dest, "k", &none)
        .unwrap();
}

#[test]
fn the_queue_limit_of_the_vhost_is_enforced() {
    let b = broker();
    let c = Client::connect(&b);
    let none = FieldTable::default();
    for i in 0..8 {
        b.queue_declare(c.conn, "/", &declare(&format!("q{i}"), &none))
            .unwrap();
    }
    let err = b
        .queue_declare(c.conn, "/", &declare("one-more", &none))
        .unwrap_err();
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - queue limit in vhost '/' (8) is reached"
    );
}

#[test]
fn the_exchange_and_binding_limits_of_the_vhost_are_enforced() {
    let b = broker();
    let c = Client::connect(&b);
    let none = FieldTable::default();
    // The default and amq.* exchanges do not count: 8 more can be declared.
    for i in 0..8 {
        b.exchange_declare("/", &exchange(&format!("x{i}"), "topic", &none))
            .unwrap();
    }
    assert_eq!(b.definition_counts(), (0, 8, 0));
    // A redeclare is not a new exchange.
    b.exchange_declare("/", &exchange("x0", "topic", &none))
        .unwrap();
    let err = b
        .exchange_declare("/", &exchange("one-more", "topic", &none))
        .unwrap_err();
    assert_eq!(err.code, reply::PRECONDITION_FAILED);
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - exchange limit in vhost '/' (8) is reached"
    );
    b.exchange_delete("/", "x7", false).unwrap();
    b.exchange_declare("/", &exchange("one-more", "topic", &none))
        .unwrap();

    b.queue_declare(c.conn, "/", &declare("q", &none)).unwrap();
    let queue = || Destination::Queue("q".into());
    for i in 0..4 {
        b.bind(c.conn, "/", "x0", queue(), &format!("k{i}"), &none)
            .unwrap();
        b.bind(c.conn, "/", "x1", queue(), &format!("k{i}"), &none)
            .unwrap();
    }
    assert_eq!(b.definition_counts(), (1, 8, 8));
    // Binding again is a no-op, even at the limit; a new binding is refused.
    b.bind(c.conn, "/", "x0", queue(), "k0", &none).unwrap();
    let err = b.bind(c.conn, "/", "x2", queue(), "k0", &none).unwrap_err();
    assert_eq!(err.code, reply::PRECONDITION_FAILED);
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - binding limit in vhost '/' (8) is reached"
    );
    // Bindings that go with their exchange free their places.
    b.exchange_delete("/", "x1", false).unwrap();
    assert_eq!(b.definition_counts(), (1, 7, 4));
    b.bind(c.conn, "/", "x2", queue(), "k0", &none).unwrap();
    // A reload changes the limits at once.
    b.set_definition_limits(8, 9, 8);
    for name in ["x1", "x7"] {
        b.exchange_declare("/", &exchange(name, "topic", &none))
            .unwrap();
    }
    assert_eq!(b.definition_counts(), (1, 9, 5));
    let err = b
        .exchange_declare("/", &exchange("x8", "topic", &none))
        .unwrap_err();
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - exchange limit in vhost '/' (9) is reached"
    );
}

#[test]
fn exchange_redeclare_reserved_names_and_delete_if_unused() {
    let b = broker();
    let c = Client::connect(&b);
    let none = FieldTable::default();
    b.exchange_declare("/", &exchange("x", "direct", &none))
        .unwrap();
    let err = b
        .exchange_declare("/", &exchange("x", "fanout", &none))
        .unwrap_err();
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'fanout' but current is 'direct'"
    );
    let err = b
        .exchange_declare("/", &exchange("amq.mine", "direct", &none))
        .unwrap_err();
    assert_eq!(err.code, reply::ACCESS_REFUSED);
    let err = b
        .exchange_declare("/", &exchange("y", "nope", &none))
        .unwrap_err();
    assert_eq!(err.code, reply::COMMAND_INVALID);
    b.queue_declare(c.conn, "/", &declare("q", &none)).unwrap();
    b.bind(c.conn, "/", "x", Destination::Queue("q".into()), "k", &none)
        .unwrap();
    let err = b.exchange_delete("/", "x", true).unwrap_err();
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - exchange 'x' in vhost '/' in use"
    );
    b.exchange_delete("/", "x", false).unwrap();
    let err = b.publish(
        "/",
        "x",
        super::super::test_support::message("x", "k", b""),
        None,
    );
    assert_eq!(err.unwrap_err().code, reply::NOT_FOUND);
}

#[test]
fn an_auto_delete_exchange_goes_with_its_last_binding() {
    let b = broker();
    let c = Client::connect(&b);
    let none = FieldTable::default();
    let mut auto = exchange("x", "direct", &none);
    auto.auto_delete = true;
    b.exchange_declare("/", &auto).unwrap();
    b.queue_declare(c.conn, "/", &declare("q", &none)).unwrap();
    let dest = Destination::Queue("q".into());
    b.bind(c.conn, "/", "x", dest.clone(), "k", &none).unwrap();
    let routed = b
        .publish(
            "/",
            "x",
            super::super::test_support::message("x", "k", b"1"),
            None,
        )
        .unwrap();
    assert!(routed.routed);
    assert_eq!(ready(&b, "q"), 1);
    b.unbind(c.conn, "/", "x", dest, "k", &none).unwrap();
    let mut passive = exchange("x", "direct", &none);
    passive.passive = true;
    let err = b.exchange_declare("/", &passive).unwrap_err();
    assert_eq!(err.text, "NOT_FOUND - no exchange 'x' in vhost '/'");
}

#[test]
fn purge_and_delete_if_empty() {
    let (b, c) = with_queue(&FieldTable::default(), &[b"1"]);
    let err = b.queue_delete(c.conn, "/", "q", false, true).unwrap_err();
    assert_eq!(
        err.text,
        "PRECONDITION_FAILED - queue 'q' in vhost '/' is not empty"
    );
    assert_eq!(b.queue_purge(c.conn, "/", "q").unwrap(), 1);
    assert_eq!(b.queue_delete(c.conn, "/", "q", false, true).unwrap(), 0);
    assert!(b.queue_settings("/", "q").is_none());
}

#[test]
fn deleted_queues_leave_no_more_timer_entries_than_the_live_queues_bound() {
    let b = broker();
    let c = Client::connect(&b);
    let expires = table(&[("x-expires", long(2_000_000_000))]);
    b.queue_declare(c.conn, "/", &declare("kept", &expires))
        .unwrap();
    for i in 0..1000 {
        let name = format!("q{i}");
        b.queue_declare(c.conn, "/", &declare(&name, &expires))
            .unwrap();
        b.queue_delete(c.conn, "/", &name, false, false).unwrap();
    }
    let st = b.lock();
    assert!(st.timers.len() <= 2 + 64 + 1, "{} entries", st.timers.len());
    assert!(
        st.timers.iter().any(|entry| entry.0.2 == "kept"),
        "the live queue keeps its deadline"
    );
}
