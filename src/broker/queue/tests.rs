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
    let after: Vec<u64> = q.iter_after(Some(seqs[1])).map(|e| e.seq).collect();
    assert_eq!(after, seqs[2..]);
    assert_eq!(q.iter_after(None).count(), 5);
    let taken = q.take_seqs(&[seqs[1], seqs[3], 999]);
    let bodies_taken: Vec<&[u8]> = taken.iter().map(|e| e.message.body()).collect();
    assert_eq!(bodies_taken, [b"b", b"d"]);
    assert_eq!(bodies(&q), ["a", "c", "e"]);
    assert_eq!(q.bytes(), 3);
    // The cursor still finds its place after the removals.
    let after: Vec<u64> = q.iter_after(Some(seqs[1])).map(|e| e.seq).collect();
    assert_eq!(after, [seqs[2], seqs[4]]);
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
