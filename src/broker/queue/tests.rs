//! Unit tests of [`crate::broker::queue`].

use super::*;

fn msg(body: &str, expiration_ms: Option<u64>) -> Arc<Message> {
    Arc::new(Message::new(
        "",
        &["q"],
        &[0, 0],
        body.as_bytes(),
        expiration_ms,
        false,
    ))
}

fn publish(q: &mut QueueState, body: &str, now: u64, deaths: &mut Vec<Death>) -> PublishOutcome {
    let e = q.admit(msg(body, None), now);
    q.publish(e, now, deaths)
}

fn bodies(q: &QueueState) -> Vec<String> {
    q.iter()
        .map(|e| String::from_utf8_lossy(e.message.body()).into_owned())
        .collect()
}

fn dead(deaths: &[Death]) -> Vec<(String, DeadLetterReason)> {
    deaths
        .iter()
        .map(|d| {
            (
                String::from_utf8_lossy(d.entry.message.body()).into_owned(),
                d.reason,
            )
        })
        .collect()
}

#[test]
fn drop_head_dead_letters_oldest() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        ..Default::default()
    });
    let mut d = Vec::new();
    for b in ["1", "2", "3"] {
        assert_eq!(publish(&mut q, b, 0, &mut d), PublishOutcome::Accepted);
    }
    assert_eq!(bodies(&q), vec!["3"]);
    assert_eq!(
        dead(&d),
        vec![
            ("1".into(), DeadLetterReason::MaxLen),
            ("2".into(), DeadLetterReason::MaxLen)
        ]
    );
}

#[test]
fn max_length_zero_kills_everything() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(0),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "a", 0, &mut d);
    assert!(q.is_empty());
    assert_eq!(dead(&d), vec![("a".into(), DeadLetterReason::MaxLen)]);
}

#[test]
fn max_length_bytes_counts_body_bytes() {
    let mut q = QueueState::new(QueueLimits {
        max_length_bytes: Some(100),
        ..Default::default()
    });
    let mut d = Vec::new();
    let body = "x".repeat(80);
    publish(&mut q, &body, 0, &mut d);
    publish(&mut q, &body, 0, &mut d);
    assert_eq!(q.len(), 1);
    assert_eq!(q.bytes(), 80);
    assert_eq!(d.len(), 1);
}

#[test]
fn reject_publish_keeps_old_and_refuses_new() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        overflow: Overflow::RejectPublish,
        ..Default::default()
    });
    let mut d = Vec::new();
    assert_eq!(publish(&mut q, "1", 0, &mut d), PublishOutcome::Accepted);
    assert_eq!(publish(&mut q, "2", 0, &mut d), PublishOutcome::Rejected);
    assert_eq!(bodies(&q), vec!["1"]);
    assert!(d.is_empty());
}

#[test]
fn reject_publish_dlx_dead_letters_the_new_message() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        overflow: Overflow::RejectPublishDlx,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "1", 0, &mut d);
    assert_eq!(
        publish(&mut q, "2", 0, &mut d),
        PublishOutcome::RejectedDeadLettered
    );
    assert_eq!(
        publish(&mut q, "3", 0, &mut d),
        PublishOutcome::RejectedDeadLettered
    );
    assert_eq!(bodies(&q), vec!["1"]);
    assert_eq!(
        dead(&d),
        vec![
            ("2".into(), DeadLetterReason::MaxLen),
            ("3".into(), DeadLetterReason::MaxLen)
        ]
    );
}

#[test]
fn refuses_only_under_reject_publish_modes() {
    let body = "x".repeat(20);
    for (overflow, refused) in [
        (Overflow::DropHead, false),
        (Overflow::RejectPublish, true),
        (Overflow::RejectPublishDlx, true),
    ] {
        let mut q = QueueState::new(QueueLimits {
            max_length_bytes: Some(10),
            overflow,
            ..Default::default()
        });
        let big = q.admit(msg(&body, None), 0);
        assert_eq!(q.refuses(&big), refused, "{overflow:?}");
        let small = q.admit(msg("s", None), 0);
        assert!(!q.refuses(&small));
    }
}

#[test]
fn ttl_is_the_lower_of_queue_and_message() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(1000),
        ..Default::default()
    });
    let a = q.admit(msg("a", Some(100)), 10);
    let b = q.admit(msg("b", Some(5000)), 10);
    assert_eq!(a.expires_at, Some(110));
    assert_eq!(b.expires_at, Some(1010));
}

#[test]
fn only_the_head_expires() {
    let mut q = QueueState::new(QueueLimits::default());
    let mut d = Vec::new();
    let long = q.admit(msg("long", Some(100_000)), 0);
    q.publish(long, 0, &mut d);
    let short = q.admit(msg("short", Some(10)), 0);
    q.publish(short, 0, &mut d);
    q.expire(50, &mut d);
    assert_eq!(q.len(), 2);
    assert_eq!(q.next_expiry(), Some(100_000));
    assert!(d.is_empty());
}

#[test]
fn ttl_zero_expires_on_arrival() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(0),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "a", 5, &mut d);
    assert!(q.is_empty());
    assert_eq!(dead(&d), vec![("a".into(), DeadLetterReason::Expired)]);
}

#[test]
fn requeue_restores_original_order() {
    let mut q = QueueState::new(QueueLimits::default());
    let mut d = Vec::new();
    for b in ["1", "2", "3"] {
        publish(&mut q, b, 0, &mut d);
    }
    let one = q.pop(0, &mut d).unwrap();
    let two = q.pop(0, &mut d).unwrap();
    q.requeue([two, one], 0, &mut d);
    assert_eq!(bodies(&q), vec!["1", "2", "3"]);
    assert!(
        q.iter()
            .take(2)
            .all(|e| e.redelivered && e.delivery_count == 1)
    );
}

#[test]
fn requeue_past_delivery_limit_dies() {
    let mut q = QueueState::new(QueueLimits {
        delivery_limit: Some(1),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "a", 0, &mut d);
    let e = q.pop(0, &mut d).unwrap();
    q.requeue([e], 0, &mut d);
    assert_eq!(q.len(), 1);
    let e = q.pop(0, &mut d).unwrap();
    q.requeue([e], 0, &mut d);
    assert!(q.is_empty());
    assert_eq!(
        dead(&d),
        vec![("a".into(), DeadLetterReason::DeliveryLimit)]
    );
}

#[test]
fn requeued_after_ttl_expires_immediately() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "a", 0, &mut d);
    let e = q.pop(10, &mut d).unwrap();
    q.requeue([e], 500, &mut d);
    assert!(q.is_empty());
    assert_eq!(dead(&d), vec![("a".into(), DeadLetterReason::Expired)]);
}

#[test]
fn requeue_into_full_queue_drops_the_requeued_head() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "1", 0, &mut d);
    let one = q.pop(0, &mut d).unwrap();
    publish(&mut q, "2", 0, &mut d);
    q.requeue([one], 0, &mut d);
    assert_eq!(bodies(&q), vec!["2"]);
    assert_eq!(dead(&d), vec![("1".into(), DeadLetterReason::MaxLen)]);
}

/// RabbitMQ's requeue sheds before it expires: a requeued head that is both due and over the
/// length limit dies as `maxlen` (probed on 3.10.8: publish A with expiration 100 to a queue
/// with x-max-length 1, get it, publish B, nack A with requeue after 300 ms).
#[test]
fn a_requeued_head_due_and_over_the_limit_dies_as_maxlen() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        ..Default::default()
    });
    let mut d = Vec::new();
    let a = q.admit(msg("a", Some(100)), 0);
    q.publish(a, 0, &mut d);
    let a = q.pop(0, &mut d).unwrap();
    publish(&mut q, "b", 0, &mut d);
    q.requeue([a], 300, &mut d);
    assert_eq!(bodies(&q), vec!["b"]);
    assert_eq!(dead(&d), vec![("a".into(), DeadLetterReason::MaxLen)]);
}

/// The same order on publish: a due head the timer has not reached yet is shed by the
/// publish that puts the queue over its limit, as `maxlen`.
#[test]
fn a_publish_over_the_limit_sheds_a_due_head_as_maxlen() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        ..Default::default()
    });
    let mut d = Vec::new();
    let a = q.admit(msg("a", Some(10)), 0);
    q.publish(a, 0, &mut d);
    publish(&mut q, "b", 50, &mut d);
    assert_eq!(bodies(&q), vec!["b"]);
    assert_eq!(dead(&d), vec![("a".into(), DeadLetterReason::MaxLen)]);
}

/// Taking the head expires the new head when it is due (RabbitMQ's fetch), so what is left
/// counts only live messages (basic.get-ok's message-count).
#[test]
fn taking_the_head_expires_a_due_new_head() {
    let mut q = QueueState::new(QueueLimits::default());
    let mut d = Vec::new();
    publish(&mut q, "a", 0, &mut d);
    let b = q.admit(msg("b", Some(1)), 0);
    q.publish(b, 0, &mut d);
    let a = q.pop(10, &mut d).unwrap();
    assert_eq!(a.message.body(), b"a");
    assert_eq!(q.len(), 0);
    assert_eq!(dead(&d), vec![("b".into(), DeadLetterReason::Expired)]);
}

#[test]
fn requeue_never_rejected_under_reject_publish() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        overflow: Overflow::RejectPublish,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish(&mut q, "1", 0, &mut d);
    let one = q.pop(0, &mut d).unwrap();
    assert_eq!(publish(&mut q, "2", 0, &mut d), PublishOutcome::Accepted);
    q.requeue([one], 0, &mut d);
    assert_eq!(bodies(&q), vec!["1", "2"]);
    assert!(d.is_empty());
}

#[test]
fn policy_change_applies_to_queued_messages() {
    let mut q = QueueState::new(QueueLimits::default());
    let mut d = Vec::new();
    for b in ["1", "2", "3"] {
        publish(&mut q, b, 0, &mut d);
    }
    q.set_limits(
        QueueLimits {
            max_length: Some(1),
            ..Default::default()
        },
        0,
        &mut d,
    );
    assert_eq!(bodies(&q), vec!["3"]);
    assert_eq!(d.len(), 2);
    q.set_limits(
        QueueLimits {
            message_ttl: Some(10),
            ..Default::default()
        },
        20,
        &mut d,
    );
    assert!(q.is_empty());
}

#[test]
fn purge_does_not_dead_letter() {
    let mut q = QueueState::new(QueueLimits::default());
    let mut d = Vec::new();
    publish(&mut q, "1", 0, &mut d);
    assert_eq!(q.purge(), 1);
    assert_eq!(q.bytes(), 0);
    assert!(d.is_empty());
}

#[test]
fn a_restored_message_past_the_delivery_limit_dies_the_others_are_queued() {
    let mut q = QueueState::new(QueueLimits {
        delivery_limit: Some(2),
        ..Default::default()
    });
    let mut d = Vec::new();
    for (body, returned) in [("once", 1), ("at-limit", 2), ("past", 3)] {
        let mut e = q.admit(msg(body, None), 0);
        e.delivery_count = returned;
        e.redelivered = true;
        assert_eq!(q.restore(e, 0, &mut d), PublishOutcome::Accepted);
    }
    assert_eq!(bodies(&q), vec!["once", "at-limit"]);
    assert_eq!(
        dead(&d),
        vec![("past".into(), DeadLetterReason::DeliveryLimit)]
    );
}

/// A message the broker dead-lettered (it carries an x-death history).
fn dead_letter(body: &str) -> Arc<Message> {
    Arc::new(Message::new(
        "dlx",
        &["q"],
        &[0, 0],
        body.as_bytes(),
        None,
        true,
    ))
}

fn publish_message(q: &mut QueueState, m: Arc<Message>, now: u64, d: &mut Vec<Death>) {
    let e = q.admit(m, now);
    q.publish(e, now, d);
}

#[test]
fn kept_dead_letters_never_expire_and_do_not_hold_back_the_rest() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        keep_dead_letters: true,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish_message(&mut q, dead_letter("dl1"), 0, &mut d);
    publish_message(&mut q, msg("fresh1", None), 10, &mut d);
    publish_message(&mut q, dead_letter("dl2"), 20, &mut d);
    publish_message(&mut q, msg("fresh2", None), 30, &mut d);
    // The first message that can expire is the head the timer waits for.
    assert_eq!(q.next_expiry(), Some(110));
    q.expire(115, &mut d);
    assert_eq!(dead(&d), vec![("fresh1".into(), DeadLetterReason::Expired)]);
    assert_eq!(q.next_expiry(), Some(130));
    q.expire(10_000, &mut d);
    assert_eq!(bodies(&q), vec!["dl1", "dl2"]);
    assert_eq!(q.next_expiry(), None);
    assert_eq!(q.bytes(), 6);
    // A fresh message behind kept ones still expires.
    publish_message(&mut q, msg("fresh3", None), 20_000, &mut d);
    q.expire(20_100, &mut d);
    assert_eq!(bodies(&q), vec!["dl1", "dl2"]);
}

#[test]
fn kept_dead_letters_still_obey_length_limits() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        max_length: Some(1),
        keep_dead_letters: true,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish_message(&mut q, dead_letter("dl1"), 0, &mut d);
    publish_message(&mut q, dead_letter("dl2"), 0, &mut d);
    assert_eq!(dead(&d), vec![("dl1".into(), DeadLetterReason::MaxLen)]);
    assert_eq!(bodies(&q), vec!["dl2"]);
}

/// With kept dead letters at the front, a publish over the limit first expires what is due
/// behind them, then sheds: the kept dead letter stays (drop-head first would shed it and
/// then expire the due message as well, one message below the limit).
#[test]
fn a_kept_dead_letter_at_the_front_is_not_shed_for_a_message_due_behind_it() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        max_length: Some(2),
        keep_dead_letters: true,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish_message(&mut q, dead_letter("dl"), 0, &mut d);
    publish_message(&mut q, msg("due", None), 0, &mut d);
    // The timer has not run yet when the next publish comes, after "due" expired.
    publish_message(&mut q, msg("new", None), 150, &mut d);
    assert_eq!(bodies(&q), vec!["dl", "new"]);
    assert_eq!(dead(&d), vec![("due".into(), DeadLetterReason::Expired)]);
}

#[test]
fn dead_letters_expire_like_the_rest_by_default() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        ..Default::default()
    });
    let mut d = Vec::new();
    publish_message(&mut q, dead_letter("dl1"), 0, &mut d);
    q.expire(100, &mut d);
    assert_eq!(dead(&d), vec![("dl1".into(), DeadLetterReason::Expired)]);
}

#[test]
fn a_requeued_message_keeps_the_exempt_prefix_right() {
    let mut q = QueueState::new(QueueLimits {
        message_ttl: Some(100),
        keep_dead_letters: true,
        ..Default::default()
    });
    let mut d = Vec::new();
    publish_message(&mut q, msg("fresh", None), 0, &mut d);
    publish_message(&mut q, dead_letter("dl"), 0, &mut d);
    let fresh = q.pop(0, &mut d).unwrap();
    // The front is now the kept dead letter; the fresh message comes back in front of it.
    assert_eq!(q.next_expiry(), None);
    q.requeue([fresh], 50, &mut d);
    assert_eq!(bodies(&q), vec!["fresh", "dl"]);
    assert_eq!(q.next_expiry(), Some(100));
    q.expire(100, &mut d);
    assert_eq!(dead(&d), vec![("fresh".into(), DeadLetterReason::Expired)]);
    assert_eq!(bodies(&q), vec!["dl"]);
}

#[test]
fn a_redrive_cursor_steps_over_what_stays_and_takes_what_moves() {
    let mut q = QueueState::new(QueueLimits {
        max_length_bytes: Some(100),
        ..Default::default()
    });
    let mut d = Vec::new();
    for body in ["a", "b", "c", "d", "e"] {
        publish(&mut q, body, 0, &mut d);
    }
    let seqs: Vec<u64> = q.iter().map(|e| e.seq).collect();
    assert_eq!(q.last_seq(), Some(seqs[4]));
    let after: Vec<u64> = q
        .iter_after(Some(seqs[1]))
        .map(|e| e.unwrap().seq)
        .collect();
    assert_eq!(after, seqs[2..]);
    assert_eq!(q.iter_after(None).count(), 5);
    assert_eq!(q.remove_seqs(&[seqs[1], seqs[3], 999]), 2);
    assert_eq!(bodies(&q), ["a", "c", "e"]);
    assert_eq!(q.bytes(), 3);
    // The cursor still finds its place after the removals.
    let after: Vec<u64> = q
        .iter_after(Some(seqs[1]))
        .map(|e| e.unwrap().seq)
        .collect();
    assert_eq!(after, [seqs[2], seqs[4]]);
    assert_eq!(q.seq_after(Some(seqs[1])), Some(seqs[2]));
    assert_eq!(q.seq_after(Some(seqs[4])), None);
    assert!(d.is_empty());
}

#[test]
fn refuses_len_is_the_reject_publish_check_before_admission() {
    let mut q = QueueState::new(QueueLimits {
        max_length: Some(1),
        overflow: Overflow::RejectPublish,
        ..Default::default()
    });
    assert!(!q.refuses_len(10));
    publish(&mut q, "a", 0, &mut Vec::new());
    assert!(q.refuses_len(10));
}

mod paging {
    //! Paging in one queue, over a store in memory.

    use super::*;
    use crate::broker::paging::test_store::MemoryStore;
    use std::sync::atomic::Ordering;

    const BODY: usize = 8 << 10;

    /// A queue that pages with `budget`, its store and the shared account.
    fn paged_queue(
        budget: u64,
        limits: QueueLimits,
    ) -> (QueueState, Arc<MemoryStore>, Arc<Paging>) {
        let store = Arc::new(MemoryStore::default());
        let paging = Paging::new(store.clone(), budget);
        let mut q = QueueState::new(limits);
        q.set_paging(paging.clone());
        (q, store, paging)
    }

    /// Publishes a persistent message with id `id` whose record is in `store`.
    fn publish_stored(
        q: &mut QueueState,
        store: &MemoryStore,
        id: u64,
        now: u64,
        d: &mut Vec<Death>,
    ) {
        let body = format!("{id:0>width$}", width = BODY);
        let m = msg(&body, None);
        store.put(id, &m);
        let mut e = q.admit(m, now);
        e.store_id = Some(id);
        assert_eq!(q.publish(e, now, d), PublishOutcome::Accepted);
    }

    fn ids(entries: impl Iterator<Item = QueuedMessage>) -> Vec<u64> {
        entries
            .map(|e| {
                let body = String::from_utf8_lossy(e.message.body()).into_owned();
                assert_eq!(e.store_id, body.parse().ok(), "content of its own record");
                e.store_id.unwrap_or_default()
            })
            .collect()
    }

    #[test]
    fn newest_messages_page_out_first_and_come_back_whole_in_order() {
        let budget = 128 << 10;
        let (mut q, store, paging) = paged_queue(budget, QueueLimits::default());
        let mut d = Vec::new();
        for id in 1..=100 {
            publish_stored(&mut q, &store, id, 0, &mut d);
            assert!(
                paging.resident() <= budget + paging.step() + BODY as u64 + 64,
                "resident {} after {id}",
                paging.resident()
            );
        }
        let stats = paging.stats();
        assert!(stats.paged_messages > 80, "{stats:?}");
        assert_eq!(stats.paged_messages, q.paged());
        assert_eq!(stats.paged_bytes, stats.paged_messages * BODY as u64);
        assert_eq!(stats.page_outs, stats.paged_messages);
        assert_eq!(
            q.bytes(),
            100 * BODY as u64,
            "max-length-bytes still counts them"
        );
        // The head stays in memory: the oldest messages were never paged.
        let resident: Vec<bool> = q
            .ready
            .iter()
            .map(|s| matches!(s, Slot::Resident(_)))
            .collect();
        let first_paged = resident.iter().position(|r| !r).expect("some paged");
        assert!(first_paged >= 5, "{resident:?}");
        // Behind it only those published since the last page-out walk are still in memory.
        let late = resident[first_paged..].iter().filter(|r| **r).count() as u64;
        assert!(late <= paging.step() / BODY as u64 + 1, "{resident:?}");
        // Inspection reads paged ones back and leaves the queue as it was.
        assert_eq!(ids(q.iter()), (1..=100).collect::<Vec<_>>());
        assert_eq!(q.paged(), stats.paged_messages);
        let popped = std::iter::from_fn(|| q.pop(0, &mut d));
        assert_eq!(ids(popped), (1..=100).collect::<Vec<_>>());
        assert!(d.is_empty());
        let after = paging.stats();
        assert_eq!(
            (
                after.resident_bytes,
                after.paged_messages,
                after.paged_bytes
            ),
            (0, 0, 0)
        );
        assert!(after.page_ins >= stats.paged_messages, "{after:?}");
    }

    #[test]
    fn a_message_whose_record_is_not_written_stays_until_it_is() {
        let (mut q, store, paging) = paged_queue(0, QueueLimits::default());
        let mut d = Vec::new();
        store.unwritten.lock().unwrap().extend(1..=20);
        for id in 1..=20 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        assert_eq!(q.paged(), 0, "nothing written yet");
        store.unwritten.lock().unwrap().clear();
        for id in 21..=40 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        assert!(
            q.paged() >= 30,
            "the earlier ones page out too: {}",
            q.paged()
        );
        assert!(paging.resident() <= paging.step() + BODY as u64 + 64);
        // Messages not written yet (in flight to the log) are stepped over: older ones page
        // out behind them.
        store.unwritten.lock().unwrap().extend(41..=60);
        for id in 41..=60 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        store.unwritten.lock().unwrap().retain(|id| *id > 50);
        for id in 61..=70 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        let paged: Vec<u64> = q
            .ready
            .iter()
            .filter_map(|s| match s {
                Slot::Paged(p) => Some(p.store_id),
                Slot::Resident(_) => None,
            })
            .collect();
        assert!((41..=50).all(|id| paged.contains(&id)), "{paged:?}");
        assert!((51..=60).all(|id| !paged.contains(&id)), "{paged:?}");
        // Non-persistent messages (no record) never page.
        let mut e = q.admit(msg("transient", None), 0);
        e.store_id = None;
        q.publish(e, 0, &mut d);
        assert!(matches!(q.ready.back(), Some(Slot::Resident(_))));
    }

    #[test]
    fn paged_messages_die_whole_and_unreadable_ones_are_lost() {
        let (mut q, store, paging) = paged_queue(
            0,
            QueueLimits {
                message_ttl: Some(10),
                max_length: Some(30),
                ..Default::default()
            },
        );
        let mut d = Vec::new();
        for id in 1..=31 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        assert!(q.paged() > 20);
        // Over max-length: the head (resident or not) is dead-lettered with its content.
        assert_eq!(ids(d.drain(..).map(|death| death.entry)), vec![1]);
        // Message 3's record is gone: it cannot be read back.
        store.messages.lock().unwrap().remove(&3);
        q.expire(10, &mut d);
        let died = ids(d.iter().map(|death| death.entry.clone()));
        let want: Vec<u64> = (2..=31).filter(|id| *id != 3).collect();
        assert_eq!(died, want);
        assert!(
            d.iter()
                .all(|death| death.reason == DeadLetterReason::Expired)
        );
        assert_eq!(q.take_lost(), vec![3]);
        assert!(q.is_empty());
        assert_eq!(paging.stats().page_in_failures, 1);
        assert_eq!((paging.resident(), paging.stats().paged_messages), (0, 0));
    }

    #[test]
    fn messages_that_expire_under_the_budget_leave_no_paging_candidate_behind() {
        let (mut q, store, _paging) = paged_queue(
            64 << 20,
            QueueLimits {
                message_ttl: Some(10),
                ..Default::default()
            },
        );
        let mut d = Vec::new();
        for round in 0..10u64 {
            for id in round * 100 + 1..=round * 100 + 100 {
                publish_stored(&mut q, &store, id, round * 10, &mut d);
            }
            // All under the budget (no page-out walk), all expired at the head.
            q.expire(round * 10 + 10, &mut d);
            assert!(q.is_empty());
            assert_eq!(q.candidates.len(), 0, "round {round}");
        }
        assert_eq!(d.len(), 1000);
        // Expiry past an exempt head, and a redrive's removal from the middle.
        for id in 2001..=2300 {
            publish_stored(&mut q, &store, id, 0, &mut d);
        }
        let seqs: Vec<u64> = q.ready.iter().skip(1).map(Slot::seq).collect();
        assert_eq!(q.remove_seqs(&seqs), 299);
        assert!(q.candidates.len() <= 2 * q.ready.len() + 64);
    }

    #[test]
    fn recovered_messages_come_back_paged_and_requeue_resident() {
        let (mut q, store, paging) = paged_queue(64 << 20, QueueLimits::default());
        let mut d = Vec::new();
        for id in [4, 9] {
            let m = msg(&format!("{id}"), None);
            store.put(id, &m);
            let meta = m.paged_meta();
            q.restore_paged(id, meta, 0, 1, 0, &mut d);
        }
        assert_eq!(q.paged(), 2);
        assert_eq!(q.bytes(), 2);
        let first = q.pop(0, &mut d).expect("head");
        assert_eq!((first.message.body(), first.redelivered), (&b"4"[..], true));
        assert_eq!(first.delivery_count, 1);
        q.requeue([first], 0, &mut d);
        assert_eq!(q.paged(), 1, "the requeued one is back in memory");
        assert_eq!(
            paging.resident(),
            4,
            "its content: key, properties and body"
        );
        let bodies: Vec<Vec<u8>> = q.iter().map(|e| e.message.body().to_vec()).collect();
        assert_eq!(bodies, vec![b"4".to_vec(), b"9".to_vec()]);
        drop(q);
        assert_eq!(
            (paging.resident(), paging.stats().paged_messages),
            (0, 0),
            "a deleted queue leaves the account"
        );
    }

    /// A queue with `limits` holding paged messages `ids` (bodies their ids), restored at 0.
    fn restored(ids: &[u64], limits: QueueLimits) -> (QueueState, Arc<MemoryStore>, Arc<Paging>) {
        let (mut q, store, paging) = paged_queue(64 << 20, limits);
        let mut d = Vec::new();
        for &id in ids {
            let m = msg(&format!("{id}"), None);
            store.put(id, &m);
            q.restore_paged(id, m.paged_meta(), 0, 0, 0, &mut d);
        }
        assert!(d.is_empty());
        (q, store, paging)
    }

    fn fail_reads(store: &MemoryStore, ids: &[u64]) {
        let mut failing = store.failing.lock().unwrap();
        failing.clear();
        failing.extend(ids);
    }

    #[test]
    fn a_paged_head_unreadable_for_now_stays_queued_and_is_delivered_once_read() {
        let (mut q, store, paging) = restored(&[4, 9], QueueLimits::default());
        let mut d = Vec::new();
        fail_reads(&store, &[4]);
        assert!(q.pop(0, &mut d).is_none(), "not delivered while unreadable");
        assert_eq!((q.len(), q.paged()), (2, 2), "still queued, still paged");
        assert_eq!(q.next_read_retry(), Some(READ_RETRY_FIRST_MS));
        let reads = store.reads.load(Ordering::Relaxed);
        assert!(q.pop(50, &mut d).is_none());
        assert_eq!(
            store.reads.load(Ordering::Relaxed),
            reads,
            "not read again before its time"
        );
        q.retry_read(100, &mut d);
        assert_eq!(
            q.next_read_retry(),
            Some(100 + 2 * READ_RETRY_FIRST_MS),
            "the wait doubles"
        );
        fail_reads(&store, &[]);
        q.retry_read(300, &mut d);
        assert_eq!(q.next_read_retry(), None);
        assert_eq!(q.paged(), 1, "its content is in memory now");
        let first = q.pop(300, &mut d).expect("delivered");
        assert_eq!(first.message.body(), b"4");
        assert_eq!(q.pop(300, &mut d).expect("next").message.body(), b"9");
        assert!(q.take_lost().is_empty() && d.is_empty());
        let stats = paging.stats();
        assert_eq!((stats.page_in_retries, stats.page_in_failures), (2, 0));
    }

    #[test]
    fn an_expired_head_unreadable_for_now_is_dead_lettered_once_read() {
        let limits = QueueLimits {
            message_ttl: Some(10),
            ..Default::default()
        };
        let (mut q, store, _paging) = restored(&[4, 9], limits);
        fail_reads(&store, &[4]);
        let mut d = Vec::new();
        q.expire(10, &mut d);
        assert!(d.is_empty());
        assert_eq!(q.len(), 2);
        assert_eq!(
            q.next_expiry(),
            Some(10 + READ_RETRY_FIRST_MS),
            "the timer waits for the next read, not the past expiry"
        );
        fail_reads(&store, &[]);
        q.retry_read(10 + READ_RETRY_FIRST_MS, &mut d);
        assert_eq!(ids(d.iter().map(|death| death.entry.clone())), vec![4, 9]);
        assert!(
            d.iter()
                .all(|death| death.reason == DeadLetterReason::Expired)
        );
        assert!(q.is_empty() && q.take_lost().is_empty());
    }

    #[test]
    fn a_dropped_head_unreadable_for_now_is_dead_lettered_once_read() {
        let limits = QueueLimits {
            max_length: Some(2),
            overflow: Overflow::DropHead,
            ..Default::default()
        };
        let (mut q, store, _paging) = restored(&[4, 9], limits);
        fail_reads(&store, &[4]);
        let mut d = Vec::new();
        publish_stored(&mut q, &store, 11, 0, &mut d);
        assert!(d.is_empty());
        assert_eq!(q.len(), 3, "over its limit until the head can be read");
        fail_reads(&store, &[]);
        q.retry_read(READ_RETRY_FIRST_MS, &mut d);
        assert_eq!(ids(d.iter().map(|death| death.entry.clone())), vec![4]);
        assert_eq!(d[0].reason, DeadLetterReason::MaxLen);
        assert_eq!(q.len(), 2);
    }

    /// Restores paged message `id` (body its id) with `meta`'s expiry and history, at 0.
    fn restore_with(q: &mut QueueState, store: &MemoryStore, id: u64, meta: PagedMeta) {
        let m = msg(&format!("{id}"), None);
        store.put(id, &m);
        let mut d = Vec::new();
        q.restore_paged(id, meta, 0, 0, 0, &mut d);
        assert!(d.is_empty());
    }

    /// A kept dead letter (exempt from expiry) at the head whose read failed, and an expiring
    /// message behind it whose read failed too: each keeps its own retry, reading the first
    /// back does not make the second exempt, and the second still expires.
    #[test]
    fn an_exempt_head_and_an_expiring_message_retry_their_reads_each() {
        let limits = QueueLimits {
            message_ttl: Some(10),
            keep_dead_letters: true,
            ..Default::default()
        };
        let (mut q, store, _paging) = paged_queue(64 << 20, limits);
        let meta = |death_history| PagedMeta {
            body_len: 1,
            expiration_ms: None,
            death_history,
        };
        restore_with(&mut q, &store, 4, meta(true));
        restore_with(&mut q, &store, 9, meta(false));
        fail_reads(&store, &[4, 9]);
        let mut d = Vec::new();
        assert!(q.pop(0, &mut d).is_none(), "the exempt head cannot be read");
        q.expire(10, &mut d);
        assert!(d.is_empty(), "the expired one cannot be read either");
        assert_eq!(q.next_read_retry(), Some(READ_RETRY_FIRST_MS));
        fail_reads(&store, &[9]);
        q.retry_read(10 + READ_RETRY_FIRST_MS, &mut d);
        assert!(d.is_empty());
        assert_eq!(q.paged(), 1, "the head is read back");
        assert!(q.next_read_retry().is_some(), "the other keeps its retry");
        fail_reads(&store, &[]);
        while let Some(at) = q.next_read_retry() {
            q.retry_read(at, &mut d);
        }
        assert_eq!(ids(d.iter().map(|death| death.entry.clone())), vec![9]);
        assert_eq!(d[0].reason, DeadLetterReason::Expired);
        assert_eq!(ids(q.pop(1_000, &mut Vec::new()).into_iter()), vec![4]);
    }

    /// Reading back an exempt head whose read failed leaves the resident message behind it
    /// expirable (the count of exempt messages at the front is not raised twice).
    #[test]
    fn a_head_read_back_by_the_timer_does_not_shield_the_next_from_expiry() {
        let limits = QueueLimits {
            message_ttl: Some(10),
            keep_dead_letters: true,
            ..Default::default()
        };
        let (mut q, store, _paging) = paged_queue(64 << 20, limits);
        let exempt = PagedMeta {
            body_len: 1,
            expiration_ms: None,
            death_history: true,
        };
        restore_with(&mut q, &store, 4, exempt);
        let mut d = Vec::new();
        publish_stored(&mut q, &store, 9, 0, &mut d);
        fail_reads(&store, &[4]);
        assert!(q.pop(0, &mut d).is_none());
        fail_reads(&store, &[]);
        q.retry_read(READ_RETRY_FIRST_MS, &mut d);
        assert_eq!(ids(d.iter().map(|death| death.entry.clone())), vec![9]);
        assert_eq!(q.len(), 1);
    }

    /// Restoring reads a head that drop-head sheds with the broker's clock, not the times the
    /// restored messages entered: a read that fails during a load is not tried again for
    /// every message restored after it (which would give it up in an instant).
    #[test]
    fn a_read_failing_while_a_queue_loads_is_retried_by_the_clock() {
        let limits = QueueLimits {
            max_length: Some(1),
            overflow: Overflow::DropHead,
            ..Default::default()
        };
        let (mut q, store, paging) = paged_queue(64 << 20, limits);
        for id in 1..=20u64 {
            let m = msg(&format!("{id}"), None);
            store.put(id, &m);
        }
        fail_reads(&store, &[1]);
        let mut d = Vec::new();
        for id in 1..=20u64 {
            let m = msg(&format!("{id}"), None);
            // Entered 10 s apart; the broker's clock is 0 throughout the load.
            q.restore_paged(id, m.paged_meta(), id * 10_000, 0, 0, &mut d);
        }
        assert!(q.take_lost().is_empty());
        assert_eq!(paging.stats().page_in_retries, 1);
        assert_eq!(q.next_read_retry(), Some(READ_RETRY_FIRST_MS));
        fail_reads(&store, &[]);
        q.retry_read(READ_RETRY_FIRST_MS, &mut d);
        assert_eq!(ids(d.iter().map(|death| death.entry.clone()))[0], 1);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn a_paged_message_unreadable_through_every_attempt_is_lost() {
        let (mut q, store, paging) = restored(&[4], QueueLimits::default());
        fail_reads(&store, &[4]);
        let mut d = Vec::new();
        assert!(q.pop(0, &mut d).is_none());
        let mut now = 0;
        while let Some(at) = q.next_read_retry() {
            now = at;
            q.retry_read(now, &mut d);
        }
        assert_eq!(q.take_lost(), vec![4]);
        assert!(q.is_empty() && d.is_empty());
        assert!(now < 60_000, "given up after {now} ms");
        let stats = paging.stats();
        assert_eq!(
            (stats.page_in_retries, stats.page_in_failures),
            (u64::from(READ_ATTEMPTS) - 1, 1)
        );
        assert_eq!((stats.paged_messages, stats.paged_bytes), (0, 0));
    }
}

#[test]
fn a_paged_slot_costs_no_more_than_a_resident_entry() {
    // What a queued message costs in the queue itself, paged or not (docs/storage.md): one
    // word more than the entry of a resident message.
    let slot = std::mem::size_of::<Slot>();
    assert!(slot <= 72, "{slot} bytes");
    assert!(std::mem::size_of::<PagedEntry>() <= std::mem::size_of::<QueuedMessage>() + 8);
}
