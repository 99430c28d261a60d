//! Dead-lettering on overflow (`maxlen`): drop-head and reject-publish-dlx, after RabbitMQ's
//! cases M1–M4 and the extra overflow facts (reference §1.4), E12 and E15 for quorum queues,
//! and what the publisher sees (confirm ack / nack).

use crate::common;

use common::dl::*;
use common::*;

/// M1: drop-head keeps the newest; the older ones are dead-lettered in order.
#[tokio::test]
async fn dead_letter_max_length_drop_head() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length", int(1))]).await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 1, 0).await;
    consume(&ch, "q", &["p3"]).await;
    consume_empty(&ch, "q").await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "dlq", &["p1", "p2"]).await;
    assert_eq!(b.dead_lettered("q", "maxlen"), 2);
}

/// M2: reject-publish-dlx keeps the old message and dead-letters the new ones.
#[tokio::test]
async fn dead_letter_max_length_reject_publish_dlx() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(
        &ch,
        "q",
        "dlq",
        &[
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish-dlx")),
        ],
    )
    .await;
    publish(&ch, "q", &["p1", "p2", "p3"]).await;
    b.wait_counts("q", 1, 0).await;
    consume(&ch, "q", &["p1"]).await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "dlq", &["p2", "p3"]).await;
    assert_eq!(b.dead_lettered("q", "maxlen"), 2);
}

/// M2 with confirms (probe 3.10.8): ack, nack, nack (no basic.return, even when mandatory);
/// the DLQ gets the refused two with reason `maxlen`, routed by the DLRK.
#[tokio::test]
async fn reject_publish_dlx_confirms_ack_nack_nack() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    let dlx = declare_dead_letter_queues(
        &ch,
        "q",
        "dlq",
        &[
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish-dlx")),
        ],
    )
    .await;
    // Mandatory publishes: a refused message was routed, so it is nacked, never returned.
    let mut seen = Vec::new();
    for p in ["r0", "r1", "r2"] {
        let c = ch
            .basic_publish(
                "".into(),
                "q".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                p.as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        seen.push(c);
    }
    assert!(matches!(seen[0], Confirmation::Ack(None)), "{:?}", seen[0]);
    assert!(matches!(seen[1], Confirmation::Nack(None)), "{:?}", seen[1]);
    assert!(matches!(seen[2], Confirmation::Nack(None)), "{:?}", seen[2]);
    for p in ["r1", "r2"] {
        let d = get_one(&ch, "dlq").await;
        assert_eq!(payload(&d), p);
        assert_eq!(d.exchange.as_str(), dlx);
        assert_eq!(d.routing_key.as_str(), "dlq");
        let deaths = x_death(&d);
        assert_eq!(deaths.len(), 1);
        assert_eq!(deaths[0].qrc(), ("q", "maxlen", 1));
        assert_eq!(deaths[0].routing_keys, ["q"]);
        assert_first_death(&d, "maxlen", "q", "");
    }
    consume(&ch, "q", &["r0"]).await;
}

/// M3: one x-death table with reason `maxlen`.
#[tokio::test]
async fn dead_letter_headers_reason_maxlen() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length", int(1))]).await;
    publish(&ch, "q", &["p1", "p2"]).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p1");
    let deaths = x_death(&d);
    assert_eq!(deaths.len(), 1);
    assert_eq!(deaths[0].qrc(), ("q", "maxlen", 1));
    assert_eq!(deaths[0].original_expiration, None);
}

/// M4: a drop-head self-loop through the default exchange drops the head as a cycle.
#[tokio::test]
async fn dead_letter_routing_key_cycle_max_length() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[("x-max-length", int(1))])).await;
    publish(&ch, "q", &["p1", "p2"]).await;
    b.wait_counts("q", 1, 0).await;
    let t = consume(&ch, "q", &["p2"]).await[0];
    ack(&ch, t, false).await;
    b.wait_counts("q", 0, 0).await;
    assert_eq!(b.dead_lettered("q", "maxlen"), 1);
    assert_eq!(b.dropped("q", "cycle"), 1);
}

/// Bytes limit (probe 3.10.8): 100 bytes with 80-byte bodies keeps only the newest; the
/// older are dead-lettered as `maxlen`.
#[tokio::test]
async fn max_length_bytes_dead_letters_older_messages() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length-bytes", int(100))]).await;
    let bodies: Vec<String> = (1..=3).map(|i| format!("{i}").repeat(80)).collect();
    for body in &bodies {
        publish_to(&ch, "", "q", body.as_bytes(), BasicProperties::default()).await;
    }
    b.wait_counts("q", 1, 0).await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "q", &[&bodies[2]]).await;
    for body in &bodies[..2] {
        let d = get_one(&ch, "dlq").await;
        assert_eq!(&payload(&d), body);
        assert_eq!(x_death(&d)[0].reason, "maxlen");
    }
}

/// Bytes count only the bodies of ready messages: an unacked message does not count.
#[tokio::test]
async fn max_length_bytes_counts_ready_bodies_only() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length-bytes", int(100))]).await;
    let body = "x".repeat(80);
    let headers = table(&[("big-header", ls(&"h".repeat(500)))]);
    publish_headers(&ch, "q", &body, headers).await;
    // Headers do not count: 80 body bytes fit.
    b.wait_counts("q", 1, 0).await;
    let _held = get_one(&ch, "q").await;
    publish_to(&ch, "", "q", body.as_bytes(), BasicProperties::default()).await;
    b.wait_counts("q", 1, 1).await;
    b.wait_counts("dlq", 0, 0).await;
}

/// A message bigger than the bytes limit on its own is dead-lettered on arrival.
#[tokio::test]
async fn max_length_bytes_message_larger_than_limit_dies_itself() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length-bytes", int(100))]).await;
    publish(&ch, "q", &["small"]).await;
    publish_to(&ch, "", "q", &[b'L'; 150], BasicProperties::default()).await;
    b.wait_counts("q", 0, 0).await;
    b.wait_counts("dlq", 2, 0).await;
    consume(&ch, "dlq", &["small", &"L".repeat(150)]).await;
}

/// Under drop-head, a requeue into a full queue dead-letters the (requeued) head.
#[tokio::test]
async fn drop_head_after_requeue_dead_letters_the_head() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length", int(1))]).await;
    publish(&ch, "q", &["p1"]).await;
    let t = consume(&ch, "q", &["p1"]).await[0];
    publish(&ch, "q", &["p2"]).await;
    b.wait_counts("q", 1, 1).await;
    nack(&ch, t, false, true).await;
    b.wait_counts("dlq", 1, 0).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "p1");
    assert_eq!(x_death(&d)[0].reason, "maxlen");
    consume(&ch, "q", &["p2"]).await;
}

/// reject-publish (no -dlx) never dead-letters: the publisher gets a nack, the DLQ nothing.
#[tokio::test]
async fn reject_publish_does_not_dead_letter() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    declare_dead_letter_queues(
        &ch,
        "q",
        "dlq",
        &[
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish")),
        ],
    )
    .await;
    let a = publish_to(&ch, "", "q", b"1", BasicProperties::default()).await;
    let n = publish_to(&ch, "", "q", b"2", BasicProperties::default()).await;
    assert!(matches!(a, Confirmation::Ack(None)), "{a:?}");
    assert!(matches!(n, Confirmation::Nack(_)), "{n:?}");
    consume_empty(&ch, "dlq").await;
    assert_eq!(b.dead_lettered("q", "maxlen"), 0);
}

/// x-max-length = 0 with drop-head: every message dies on arrival (dead-lettered, never kept).
#[tokio::test]
async fn max_length_zero_dead_letters_every_message() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length", int(0))]).await;
    publish(&ch, "q", &["a", "b"]).await;
    b.wait_counts("q", 0, 0).await;
    consume(&ch, "dlq", &["a", "b"]).await;
}

/// E12 deliberately differs: RabbitMQ 3.10 quorum queues accept reject-publish-dlx but act as
/// drop-head (keeping q2). Overflow behaves the same on every queue type here, so a quorum
/// queue refuses q2 (nack) and dead-letters it, keeping q1, as a classic queue does.
#[tokio::test]
async fn quorum_reject_publish_dlx_same_as_classic() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    confirm_select(&ch).await;
    exchange(&ch, "dlx", ExchangeKind::Direct).await;
    declare_durable(
        &ch,
        "qq",
        table(&[
            ("x-queue-type", ls("quorum")),
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish-dlx")),
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    declare(&ch, "dlq", FieldTable::default()).await;
    bind(&ch, "dlq", "dlx", "dlq").await;
    let a = publish_to(&ch, "", "qq", b"q1", BasicProperties::default()).await;
    let n = publish_to(&ch, "", "qq", b"q2", BasicProperties::default()).await;
    assert!(matches!(a, Confirmation::Ack(None)), "{a:?}");
    assert!(matches!(n, Confirmation::Nack(_)), "{n:?}");
    b.wait_counts("qq", 1, 0).await;
    consume(&ch, "qq", &["q1"]).await;
    let d = get_one(&ch, "dlq").await;
    assert_eq!(payload(&d), "q2");
    assert_eq!(x_death(&d)[0].qrc(), ("qq", "maxlen", 1));
}

/// E15: quorum queue drop-head (count and bytes) with a DLX: the oldest go to the DLQ in order
/// with reason `maxlen`.
#[tokio::test]
async fn quorum_drop_head_dead_letters_oldest_in_order() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    for (q, limit) in [
        ("qq-len", ("x-max-length", int(1))),
        ("qq-bytes", ("x-max-length-bytes", int(100))),
    ] {
        declare_durable(
            &ch,
            q,
            table(&[
                ("x-queue-type", ls("quorum")),
                limit,
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-routing-key", ls("dlq")),
            ]),
        )
        .await;
        let bodies: Vec<String> = (1..=3)
            .map(|i| format!("{q}-{i}-{}", "x".repeat(70)))
            .collect();
        for body in &bodies {
            publish_to(&ch, "", q, body.as_bytes(), BasicProperties::default()).await;
        }
        b.wait_counts(q, 1, 0).await;
        for body in &bodies[..2] {
            let d = get_one(&ch, "dlq").await;
            assert_eq!(&payload(&d), body);
            assert_eq!(x_death(&d)[0].qrc(), (q, "maxlen", 1));
        }
        consume(&ch, q, &[&bodies[2]]).await;
    }
}

/// Quorum drop-head with a bytes limit (HEAD's at_most_once_dead_letter_order_maxlen):
/// m1, m2 and a message larger than the limit are all dead-lettered, in that order.
#[tokio::test]
async fn at_most_once_dead_letter_order_maxlen() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    declare_durable(
        &ch,
        "qq",
        table(&[
            ("x-queue-type", ls("quorum")),
            ("x-max-length-bytes", int(1000)),
            ("x-dead-letter-exchange", ls("dlx")),
            ("x-dead-letter-routing-key", ls("dlq")),
        ]),
    )
    .await;
    let large = "L".repeat(1500);
    publish(&ch, "qq", &["m1", "m2", &large]).await;
    b.wait_counts("qq", 0, 0).await;
    consume(&ch, "dlq", &["m1", "m2", &large]).await;
}

/// Probe 3.10.8: with drop-head, a message for an empty queue goes to a waiting consumer
/// before any length check, even with x-max-length = 0.
#[tokio::test]
async fn max_length_zero_drop_head_delivers_to_waiting_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[("x-max-length", int(0))]).await;
    let mut c = consumer(&ch, "q", "c").await;
    let (_c2, ch2) = b.channel().await;
    publish(&ch2, "q", &["m"]).await;
    assert_eq!(payload(&next(&mut c).await), "m");
    b.stays_counts("dlq", 0, 0, 50).await;
    assert_eq!(b.dead_lettered("q", "maxlen"), 0);
}

/// Probe 3.10.8: reject-publish checks the limit before trying consumers: a message larger
/// than x-max-length-bytes is refused (nack) although a consumer is waiting; with
/// reject-publish-dlx it is dead-lettered as `maxlen`.
#[tokio::test]
async fn reject_publish_checks_the_limit_before_a_waiting_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dlx(&ch, "dlx", "dlq").await;
    for (q, overflow) in [("rp", "reject-publish"), ("rpdlx", "reject-publish-dlx")] {
        declare(
            &ch,
            q,
            table(&[
                ("x-max-length-bytes", int(10)),
                ("x-overflow", ls(overflow)),
                ("x-dead-letter-exchange", ls("dlx")),
                ("x-dead-letter-routing-key", ls("dlq")),
            ]),
        )
        .await;
    }
    let (_c2, cons) = b.channel().await;
    let mut crp = consumer(&cons, "rp", "c1").await;
    let mut crpdlx = consumer(&cons, "rpdlx", "c2").await;
    let (_c3, publisher) = b.channel().await;
    confirm_select(&publisher).await;
    for q in ["rp", "rpdlx"] {
        let c = publish_to(&publisher, "", q, &[b'x'; 20], BasicProperties::default()).await;
        assert!(matches!(c, Confirmation::Nack(_)), "{q}: {c:?}");
        let c = publish_to(&publisher, "", q, b"small", BasicProperties::default()).await;
        assert!(matches!(c, Confirmation::Ack(None)), "{q}: {c:?}");
    }
    assert_eq!(payload(&next(&mut crp).await), "small");
    assert_eq!(payload(&next(&mut crpdlx).await), "small");
    let d = get_one(&ch, "dlq").await;
    assert_eq!(d.data.len(), 20);
    assert_eq!(x_death(&d)[0].qrc(), ("rpdlx", "maxlen", 1));
    consume_empty(&ch, "dlq").await;
}

/// Probe 3.10.8: a dead-letter target whose overflow is reject-publish-dlx dead-letters the
/// arriving message onward (maxlen); nothing is counted as dropped.
#[tokio::test]
async fn reject_publish_dlx_target_dead_letters_onward() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "dlx2", ExchangeKind::Direct).await;
    declare(&ch, "final", FieldTable::default()).await;
    bind(&ch, "final", "dlx2", "f").await;
    declare(
        &ch,
        "target",
        table(&[
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish-dlx")),
            ("x-dead-letter-exchange", ls("dlx2")),
            ("x-dead-letter-routing-key", ls("f")),
        ]),
    )
    .await;
    declare(&ch, "src", dead_letter_to("target", &[])).await;
    publish(&ch, "target", &["filler"]).await;
    publish(&ch, "src", &["m"]).await;
    get_and_reject(&ch, "src", "m").await;
    b.wait_counts("final", 1, 0).await;
    let d = get_one(&ch, "final").await;
    assert_eq!(
        x_death(&d).iter().map(Death::qrc).collect::<Vec<_>>(),
        [("target", "maxlen", 1), ("src", "rejected", 1)]
    );
    assert_eq!(b.dead_lettered("src", "rejected"), 1);
    assert_eq!(b.dead_lettered("target", "maxlen"), 1);
    for cause in ["target_full", "unroutable", "no_dlx", "cycle"] {
        assert_eq!(b.dropped("src", cause), 0, "{cause}");
    }
}

/// A dead-letter target with reject-publish (no -dlx) that is full loses the message, as
/// RabbitMQ's at-most-once dead-lettering does; it is counted (cause `target_full`).
#[tokio::test]
async fn reject_publish_target_full_drops_and_counts() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "target",
        table(&[
            ("x-max-length", int(1)),
            ("x-overflow", ls("reject-publish")),
        ]),
    )
    .await;
    declare(&ch, "src", dead_letter_to("target", &[])).await;
    publish(&ch, "target", &["filler"]).await;
    publish(&ch, "src", &["m"]).await;
    get_and_reject(&ch, "src", "m").await;
    b.wait_counts("src", 0, 0).await;
    consume(&ch, "target", &["filler"]).await;
    consume_empty(&ch, "target").await;
    assert_eq!(b.dropped("src", "target_full"), 1);
}

/// A queue that sheds the dead letters it gets passes them on in the order they died: a
/// multiple nack of m1..m4 into a DLQ with `x-max-length` 1 (drop-head) dead-letters m1, m2
/// and m3 onward in that order, each with both deaths, and keeps m4 (probed on 3.10.8).
#[tokio::test]
async fn onward_drop_heads_of_a_multiple_nack_keep_their_order() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "dlq2", FieldTable::default()).await;
    declare(
        &ch,
        "dlq",
        dead_letter_to("dlq2", &[("x-max-length", int(1))]),
    )
    .await;
    declare(&ch, "q", dead_letter_to("dlq", &[])).await;
    publish(&ch, "q", &["m1", "m2", "m3", "m4"]).await;
    let tags = consume(&ch, "q", &["m1", "m2", "m3", "m4"]).await;
    nack(&ch, tags[3], true, false).await;
    b.wait_counts("dlq2", 3, 0).await;
    for body in ["m1", "m2", "m3"] {
        let d = get_one(&ch, "dlq2").await;
        assert_eq!(payload(&d), body, "order in dlq2");
        let deaths: Vec<_> = x_death(&d).iter().map(|e| e.qrc().0.to_string()).collect();
        assert_eq!(deaths, ["dlq", "q"]);
        assert_eq!(x_death(&d)[0].qrc(), ("dlq", "maxlen", 1));
    }
    consume(&ch, "dlq", &["m4"]).await;
}

/// basic.get-ok's message-count leaves out a new head that is already due: it expires when
/// the head before it is taken (RabbitMQ's fetch; probed on 3.10.8: count 0, the expired one
/// dead-lettered at once).
#[tokio::test]
async fn get_ok_counts_no_due_head() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_dead_letter_queues(&ch, "q", "dlq", &[]).await;
    publish(&ch, "q", &["a"]).await;
    ch.basic_publish(
        "".into(),
        "q".into(),
        BasicPublishOptions::default(),
        b"b",
        BasicProperties::default().with_expiration("1".into()),
    )
    .await
    .unwrap();
    b.wait_counts("q", 2, 0).await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let got = ch
        .basic_get("q".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(payload(&got.delivery), "a");
    assert_eq!(got.message_count, 0);
    b.wait_counts("dlq", 1, 0).await;
}
