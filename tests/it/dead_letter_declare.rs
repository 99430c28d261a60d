//! Declaring queues with dead-letter settings: invalid arguments refused with RabbitMQ's 406
//! texts (reference §2.10, probes E9–E11), inequivalent redeclares, the permissions a DLX needs
//! (read on the queue, write on the DLX), and the ways a queue loses messages without
//! dead-lettering them (purge, delete, x-expires, exclusive owner gone).

use crate::common;

use common::dl::*;
use common::*;
use dlx_proxy::config::{PermissionConfig, UserConfig};

async fn declare_err(b: &TestBroker, q: &str, args: FieldTable) -> (Option<u16>, String) {
    let (_c, ch) = b.channel().await;
    let err = ch
        .queue_declare(
            q.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect_err("declare must fail");
    (amqp_code(&err), amqp_text(&err))
}

fn precondition(text: &str) -> (Option<u16>, String) {
    (Some(406), format!("PRECONDITION_FAILED - {text}"))
}

/// E9: a routing key without a DLX.
#[tokio::test]
async fn routing_key_without_dlx_is_406() {
    let b = start().await;
    assert_eq!(
        declare_err(&b, "q", table(&[("x-dead-letter-routing-key", ls("k"))])).await,
        precondition(
            "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': routing_key_but_no_dlx_defined"
        )
    );
}

/// E10: x-dead-letter-strategy on a classic queue; x-delivery-limit is our extension there.
#[tokio::test]
async fn dead_letter_strategy_on_classic_queue_is_406() {
    let b = start().await;
    assert_eq!(
        declare_err(
            &b,
            "q",
            table(&[
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-strategy", ls("at-least-once")),
            ])
        )
        .await,
        precondition(
            "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/' of queue type rabbit_classic_queue"
        )
    );
    let (_c, ch) = b.channel().await;
    declare(&ch, "limited", table(&[("x-delivery-limit", int(3))])).await;
}

/// E11: bad values, with RabbitMQ's reply texts.
#[tokio::test]
async fn invalid_dead_letter_arguments_are_406() {
    let b = start().await;
    let quorum = || ("x-queue-type", ls("quorum"));
    let cases: Vec<(FieldTable, &str)> = vec![
        (
            table(&[
                quorum(),
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-strategy", ls("exactly-once")),
            ]),
            "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': invalid_dlx_strategy",
        ),
        (
            table(&[("x-overflow", ls("drop-tail"))]),
            "invalid arg 'x-overflow' for queue 'q' in vhost '/': invalid_overflow",
        ),
        (
            table(&[("x-message-ttl", int(-1))]),
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}",
        ),
        (
            table(&[("x-message-ttl", AMQPValue::LongLongInt(315_360_000_001))]),
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_too_big,315360000001}",
        ),
        (
            table(&[("x-dead-letter-exchange", int(5))]),
            "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'q' in vhost '/'",
        ),
        (
            table(&[("x-max-length", int(-2))]),
            "invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-2}",
        ),
        (
            table(&[("x-max-length-bytes", ls("big"))]),
            "invalid arg 'x-max-length-bytes' for queue 'q' in vhost '/': \"expected integer, got longstr\"",
        ),
        (
            table(&[("x-expires", int(0))]),
            "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_zero,0}",
        ),
        (
            table(&[
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-routing-key", int(1)),
            ]),
            "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': {unacceptable_type,signedint}",
        ),
    ];
    for (args, text) in cases {
        assert_eq!(declare_err(&b, "q", args).await, precondition(text));
    }
    // Nothing was created.
    assert!(b.queue_counts("q").is_none());
}

/// Redeclaring with other dead-letter arguments is 406 (inequivalent arg); the same ones (an
/// int32 TTL equal to an int64 one) are fine.
#[tokio::test]
async fn redeclare_inequivalent_dead_letter_arguments_is_406() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "q",
        table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-message-ttl", int(1000)),
        ]),
    )
    .await;
    declare(
        &ch,
        "q",
        table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-message-ttl", AMQPValue::LongLongInt(1000)),
        ]),
    )
    .await;
    let redeclare = |args: FieldTable| {
        let b = &b;
        async move {
            let (_c, ch) = b.channel().await;
            let err = try_declare(&ch, "q", args).await.expect_err("inequivalent");
            (amqp_code(&err), amqp_text(&err))
        }
    };
    assert_eq!(
        redeclare(table(&[("x-message-ttl", int(1000))])).await,
        precondition(
            "inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received none but current is the value 'dlx' of type 'longstr'"
        )
    );
    assert_eq!(
        redeclare(table(&[
            ("x-dead-letter-exchange", ls("other")),
            ("x-message-ttl", int(1000)),
        ]))
        .await,
        precondition(
            "inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received 'other' but current is 'dlx'"
        )
    );
    assert_eq!(
        redeclare(table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-message-ttl", int(5)),
        ]))
        .await,
        precondition(
            "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '5' but current is '1000'"
        )
    );
    assert_eq!(
        redeclare(table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-message-ttl", int(1000)),
            ("x-dead-letter-routing-key", ls("k")),
        ]))
        .await,
        precondition(
            "inequivalent arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': received the value 'k' of type 'longstr' but current is none"
        )
    );
    // A policy does not make a redeclare inequivalent.
    b.set_policy(common::dl_policy::exact(
        "p",
        "q",
        serde_json::json!({"dead-letter-exchange": "elsewhere", "message-ttl": 5}),
    ));
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "q",
        table(&[
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-message-ttl", int(1000)),
        ]),
    )
    .await;
}

/// The other arguments RabbitMQ 3.10 compares on redeclare, in the existing queue's type's
/// order (texts as RabbitMQ 3.10.8 answered them): `x-single-active-consumer` and
/// `x-queue-mode` on a classic queue; on a quorum queue `x-delivery-limit` before
/// `x-message-ttl`, and `x-max-priority` not at all (a new quorum queue refuses it).
#[tokio::test]
async fn redeclare_compares_the_queue_types_arguments_in_rabbitmqs_order() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let redeclare = |q: &'static str, args: FieldTable| declare_err(&b, q, args);
    let sac = |on: bool| ("x-single-active-consumer", AMQPValue::Boolean(on));
    declare_durable(&ch, "s1", table(&[sac(true)])).await;
    assert_eq!(
        redeclare("s1", table(&[sac(false)])).await,
        precondition(
            "inequivalent arg 'x-single-active-consumer' for queue 's1' in vhost '/': received 'false' but current is 'true'"
        )
    );
    assert_eq!(
        redeclare("s1", table(&[])).await,
        precondition(
            "inequivalent arg 'x-single-active-consumer' for queue 's1' in vhost '/': received none but current is the value 'true' of type 'bool'"
        )
    );
    declare_durable(&ch, "s5", table(&[("x-queue-mode", ls("lazy"))])).await;
    assert_eq!(
        redeclare("s5", table(&[])).await,
        precondition(
            "inequivalent arg 'x-queue-mode' for queue 's5' in vhost '/': received none but current is the value 'lazy' of type 'longstr'"
        )
    );

    let quorum = || ("x-queue-type", ls("quorum"));
    let limited = || {
        vec![
            quorum(),
            ("x-message-ttl", int(5)),
            ("x-delivery-limit", int(3)),
        ]
    };
    declare_durable(&ch, "qq", table(&limited())).await;
    assert_eq!(
        redeclare("qq", table(&[quorum()])).await,
        precondition(
            "inequivalent arg 'x-delivery-limit' for queue 'qq' in vhost '/': received none but current is the value '3' of type 'signedint'"
        )
    );
    let mut with_priority = limited();
    with_priority.push(("x-max-priority", int(4)));
    declare_durable(&ch, "qq", table(&with_priority)).await;
    // A new quorum queue does not take it at all.
    assert_eq!(
        declare_err(&b, "qp", table(&[quorum(), ("x-max-priority", int(3))])).await,
        precondition(
            "invalid arg 'x-max-priority' for queue 'qp' in vhost '/' of queue type rabbit_quorum_queue"
        )
    );
}

fn limited_user() -> UserConfig {
    UserConfig {
        name: "limited".into(),
        password: "pw".into(),
        password_hash: Default::default(),
        password_file: String::new(),
        loopback_only: false,
        permissions: vec![PermissionConfig {
            vhost: "/".into(),
            configure: ".*".into(),
            write: "^(allowed-dlx|amq\\.default|readable)$".into(),
            read: "^readable$".into(),
        }],
    }
}

/// Declaring a queue with a DLX needs read on the queue and write on the DLX (403 otherwise);
/// without a DLX configure is enough.
#[tokio::test]
async fn declaring_with_a_dlx_needs_read_on_queue_and_write_on_dlx() {
    let mut cfg = test_config();
    cfg.users.push(limited_user());
    let b = start_with(cfg).await;
    let conn = lapin::Connection::connect(
        &b.uri_as("limited", "pw", "/"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let dlx = |name: &str| table(&[("x-dead-letter-exchange", ls(name))]);
    let attempt = |q: &'static str, args: FieldTable| {
        let conn = &conn;
        async move {
            let ch = conn.create_channel().await.unwrap();
            try_declare(&ch, q, args)
                .await
                .map(|_| ())
                .map_err(|e| (amqp_code(&e), amqp_text(&e)))
        }
    };
    // The default exchange as DLX is checked as write on amq.default.
    assert_eq!(attempt("readable", dlx("")).await, Ok(()));
    // Permissions are checked before equivalence: 403, not 406.
    assert_eq!(
        attempt("readable", dlx("forbidden-dlx")).await,
        Err((
            Some(403),
            "ACCESS_REFUSED - access to exchange 'forbidden-dlx' in vhost '/' refused for user 'limited'"
                .to_string()
        ))
    );
    assert_eq!(
        attempt("unreadable", dlx("allowed-dlx")).await,
        Err((
            Some(403),
            "ACCESS_REFUSED - access to queue 'unreadable' in vhost '/' refused for user 'limited'"
                .to_string()
        ))
    );
    assert!(
        b.queue_counts("unreadable").is_none(),
        "refused: not created"
    );
    // Without a DLX, configure is enough.
    assert_eq!(attempt("unreadable", FieldTable::default()).await, Ok(()));
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete("readable".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    assert_eq!(attempt("readable", dlx("allowed-dlx")).await, Ok(()));
}

/// queue.purge never dead-letters.
#[tokio::test]
async fn purge_never_dead_letters() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["1", "2", "3"]).await;
    let n = ch
        .queue_purge("q".into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert_eq!(n, 3);
    b.stays_counts("dlq", 0, 0, 30).await;
    assert_eq!(b.dead_lettered("q", "rejected"), 0);
}

/// queue.delete never dead-letters, neither ready nor unacked messages (settling those later
/// does nothing).
#[tokio::test]
async fn delete_never_dead_letters() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-message-ttl", int(100_000))]).await;
    publish(&ch, "q", &["1", "2", "3"]).await;
    let t = consume(&ch, "q", &["1"]).await[0];
    let (_c2, ch2) = b.channel().await;
    let n = ch2
        .queue_delete("q".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    assert_eq!(n, 2);
    reject(&ch, t, false).await;
    b.stays_counts("dlq", 0, 0, 30).await;
    for reason in ["rejected", "expired", "maxlen"] {
        assert_eq!(b.dead_lettered("q", reason), 0);
    }
}

/// A queue that expires (x-expires) is deleted without dead-lettering its messages.
#[tokio::test]
async fn queue_expiry_never_dead_letters() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-expires", int(50))]).await;
    publish(&ch, "q", &["1", "2"]).await;
    let gone = eventually(|| b.queue_counts("q").is_none()).await;
    assert!(gone);
    b.stays_counts("dlq", 0, 0, 30).await;
}

/// An exclusive queue deleted with its connection does not dead-letter.
#[tokio::test]
async fn exclusive_queue_deleted_with_connection_never_dead_letters() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    {
        let (c2, ch2) = b.channel().await;
        ch2.queue_declare(
            "excl".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            table(&[
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-routing-key", ls("dlq")),
            ]),
        )
        .await
        .unwrap();
        publish(&ch2, "excl", &["1", "2"]).await;
        get_one(&ch2, "excl").await;
        c2.close(200, "bye".into()).await.unwrap();
    }
    let gone = eventually(|| b.queue_counts("excl").is_none()).await;
    assert!(gone);
    b.stays_counts("dlq", 0, 0, 30).await;
}
