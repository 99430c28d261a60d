//! Dead-letter cycles: a message that would reach a queue again is dropped only when no
//! rejection happened since it last left that queue, decided per target queue. RabbitMQ's cases
//! C1 and C2 (reference §1.6, C2 done right: 3.10.8 drops it), the fanout partial cycle probe,
//! and the `cycle` drop counter. The self-loops M4 and T4 are in the length and TTL suites.

use crate::common;

use common::dl::*;
use common::*;

/// C1: a rejection self-loop never drops: the message comes back every time.
#[tokio::test]
async fn dead_letter_routing_key_cycle_with_reject() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", self_loop(&[])).await;
    publish(&ch, "q", &["p"]).await;
    get_and_nack(&ch, "q", "p").await;
    b.wait_counts("q", 1, 0).await;
    get_and_nack(&ch, "q", "p").await;
    b.wait_counts("q", 1, 0).await;
    let d = get_one(&ch, "q").await;
    assert_eq!(payload(&d), "p");
    assert_eq!(x_death(&d)[0].qrc(), ("q", "rejected", 2));
    assert_eq!(b.dead_lettered("q", "rejected"), 2);
    assert_eq!(b.dropped("q", "cycle"), 0);
}

/// C2: b --reject--> a2 --expire--> a3 --expire--> b, twice. The rejection at b is inside the
/// loop, so it is never a cycle (3.10.8 reorders x-death and drops it on the second round).
#[tokio::test]
async fn dead_letter_reject_expire_expire() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "b", dead_letter_to("a2", &[])).await;
    declare(
        &ch,
        "a2",
        dead_letter_to("a3", &[("x-message-ttl", int(5))]),
    )
    .await;
    declare(&ch, "a3", dead_letter_to("b", &[("x-message-ttl", int(5))])).await;
    publish(&ch, "b", &["m"]).await;
    b.wait_counts("b", 1, 0).await;
    for round in 1..=3i64 {
        let d = get_one(&ch, "b").await;
        assert_eq!(payload(&d), "m");
        if round > 1 {
            let deaths = x_death(&d);
            let summary: Vec<_> = deaths.iter().map(|e| e.qrc()).collect();
            let n = round - 1;
            assert_eq!(
                summary,
                [
                    ("a3", "expired", n),
                    ("a2", "expired", n),
                    ("b", "rejected", n)
                ],
                "round {round}: newest first, stable order"
            );
        }
        reject(&ch, d.delivery_tag, false).await;
        b.wait_counts("b", 1, 0).await;
    }
    for q in ["b", "a2", "a3"] {
        assert_eq!(b.dropped(q, "cycle"), 0, "{q}");
    }
}

/// An automatic two-queue loop (expire, expire) is dropped when it comes back to the first.
#[tokio::test]
async fn expire_expire_loop_is_dropped_at_the_first_queue() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "x1",
        dead_letter_to("x2", &[("x-message-ttl", int(5))]),
    )
    .await;
    declare(
        &ch,
        "x2",
        dead_letter_to("x1", &[("x-message-ttl", int(5))]),
    )
    .await;
    publish(&ch, "x1", &["m"]).await;
    let ok = eventually(|| b.dropped("x2", "cycle") == 1).await;
    assert!(ok, "x2 → x1 is a cycle");
    b.wait_counts("x1", 0, 0).await;
    b.wait_counts("x2", 0, 0).await;
    assert_eq!(b.dead_lettered("x1", "expired"), 1);
    assert_eq!(b.dead_lettered("x2", "expired"), 1);
}

/// A rejection anywhere since the target's last death breaks the cycle: x1 (TTL) → x2 (a
/// consumer rejects) → x1 again, repeatedly.
#[tokio::test]
async fn loop_with_a_rejection_in_it_is_not_a_cycle() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "x1",
        dead_letter_to("x2", &[("x-message-ttl", int(5))]),
    )
    .await;
    declare(&ch, "x2", dead_letter_to("x1", &[])).await;
    publish(&ch, "x1", &["m"]).await;
    for round in 1..=3i64 {
        b.wait_counts("x2", 1, 0).await;
        let d = get_one(&ch, "x2").await;
        let deaths = x_death(&d);
        assert_eq!(deaths[0].qrc(), ("x1", "expired", round));
        reject(&ch, d.delivery_tag, false).await;
    }
    assert_eq!(b.dropped("x1", "cycle"), 0);
    assert_eq!(b.dropped("x2", "cycle"), 0);
}

/// Fanout partial cycle (probe 3.10.8): the expiring queue is bound to its own fanout DLX
/// together with another queue; only the copy for itself is dropped.
#[tokio::test]
async fn fanout_partial_cycle_drops_only_the_cycling_target() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "p4_fan", ExchangeKind::Fanout).await;
    declare(
        &ch,
        "p4_self",
        table(&[
            ("x-message-ttl", int(20)),
            ("x-dead-letter-exchange", ls("p4_fan")),
        ]),
    )
    .await;
    declare(&ch, "p4_other", FieldTable::default()).await;
    bind(&ch, "p4_self", "p4_fan", "").await;
    bind(&ch, "p4_other", "p4_fan", "").await;
    publish(&ch, "p4_self", &["m"]).await;
    b.wait_counts("p4_other", 1, 0).await;
    b.wait_counts("p4_self", 0, 0).await;
    let d = get_one(&ch, "p4_other").await;
    assert_eq!(x_death(&d)[0].qrc(), ("p4_self", "expired", 1));
    assert_eq!(b.dropped("p4_self", "cycle"), 1);
    b.stays_counts("p4_self", 0, 0, 60).await;
}

/// A fanout DLX that reaches the source queue after a rejection delivers to both targets.
#[tokio::test]
async fn fanout_self_target_after_rejection_is_delivered() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    exchange(&ch, "fan", ExchangeKind::Fanout).await;
    declare(&ch, "src", table(&[("x-dead-letter-exchange", ls("fan"))])).await;
    declare(&ch, "other", FieldTable::default()).await;
    bind(&ch, "src", "fan", "").await;
    bind(&ch, "other", "fan", "").await;
    publish(&ch, "src", &["m"]).await;
    get_and_reject(&ch, "src", "m").await;
    b.wait_counts("src", 1, 0).await;
    b.wait_counts("other", 1, 0).await;
    assert_eq!(b.dropped("src", "cycle"), 0);
}

/// A message republished by a client with an x-death history of its own: the history counts
/// for the cycle check (3.x semantics), so an expiry back into a queue it expired from before
/// is dropped.
#[tokio::test]
async fn client_supplied_history_counts_for_cycles() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "loop",
        dead_letter_to("loop", &[("x-message-ttl", int(5))]),
    )
    .await;
    // A history without any rejection: loop expired once already.
    let entry = table(&[
        ("count", AMQPValue::LongLongInt(1)),
        ("reason", ls("expired")),
        ("queue", ls("loop")),
        ("time", AMQPValue::Timestamp(now_secs())),
        ("exchange", ls("")),
        ("routing-keys", ls_array(&["loop"])),
    ]);
    let history = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)]));
    publish_headers(&ch, "loop", "m", table(&[("x-death", history)])).await;
    let ok = eventually(|| b.dropped("loop", "cycle") == 1).await;
    assert!(ok);
    b.wait_counts("loop", 0, 0).await;
}
