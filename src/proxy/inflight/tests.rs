//! Unit tests of [`crate::proxy::inflight`].

use super::*;

fn delivery(queue: &str, body: &str) -> KeptDelivery {
    KeptDelivery {
        queue: Some(Arc::from(queue)),
        redelivered: false,
        deadline: None,
        message: Some(Box::new(KeptMessage {
            exchange: String::new(),
            routing_key: queue.to_string(),
            raw_properties: Bytes::from_static(&[0, 0]),
            body: Bytes::copy_from_slice(body.as_bytes()),
        })),
    }
}

fn channel_with(tags: &[(u64, &str)]) -> ChannelDeliveries {
    let mut ch = ChannelDeliveries::default();
    for (tag, queue) in tags {
        ch.keep(*tag, delivery(queue, "x"));
    }
    ch
}

#[test]
fn consumer_timeouts_follow_the_kept_deliveries() {
    let mut ch = channel_with(&[(1, "q"), (2, "q"), (3, "q")]);
    ch.time(1, 0, 1000);
    ch.time(2, 10, 300);
    ch.time(9, 0, 1); // not kept: nothing to time
    assert_eq!(ch.next_deadline(), Some(310));
    assert_eq!(ch.overdue(309), None);
    assert_eq!(ch.overdue(310), Some((2, 300)));
    // Settling tag 2 removes its deadline; a multiple ack up to 1 the other.
    ch.plan_settlement(Verb::Ack, 2, false, |_| false);
    assert_eq!(ch.overdue(999), None);
    assert_eq!(ch.overdue(1000), Some((1, 1000)));
    ch.plan_settlement(Verb::Ack, 1, true, |_| false);
    assert_eq!(ch.next_deadline(), None);
    ch.time(3, 50, 100);
    ch.clear();
    assert_eq!(ch.next_deadline(), None);
}

#[test]
fn plain_acks_are_forwarded_unchanged() {
    let mut ch = channel_with(&[(1, "q"), (2, "q"), (3, "q")]);
    let (plan, released) = ch.plan_settlement(Verb::Ack, 2, true, |_| false);
    assert!(plan.forward_original);
    assert!(released > 0);
    assert_eq!(ch.kept_len(), 1);
    let (plan, _) = ch.plan_settlement(Verb::Ack, 3, false, |_| false);
    assert!(plan.forward_original);
    assert_eq!(ch.kept_len(), 0);
    assert_eq!(ch.kept_bytes(), 0);
}

#[test]
fn an_ack_of_one_kept_tag_releases_what_it_was_charged_and_nothing_else() {
    let mut ch = channel_with(&[(1, "q"), (2, "dl"), (3, "q")]);
    let charged = ch.get(2).map(KeptDelivery::charge);
    let before = ch.kept_bytes();
    assert_eq!(ch.take_acked(2), charged);
    assert_eq!(
        (ch.kept_len(), ch.kept_bytes()),
        (2, before - charged.unwrap())
    );
    assert!(ch.get(2).is_none() && ch.get(1).is_some() && ch.get(3).is_some());
    // Not kept (settled already, never kept, or pending): nothing changes, the full plan
    // decides.
    assert_eq!(ch.take_acked(2), None);
    assert_eq!(ch.take_acked(9), None);
    ch.plan_settlement(Verb::Reject { requeue: false }, 3, false, |_| true);
    assert!(ch.is_pending(3));
    assert_eq!(ch.take_acked(3), None);
    assert!(ch.is_pending(3));
    assert_eq!(ch.kept_len(), 1);
}

#[test]
fn unknown_tags_are_left_to_the_upstream() {
    let mut ch = channel_with(&[(1, "q")]);
    let (plan, released) = ch.plan_settlement(Verb::Ack, 9, false, |_| false);
    assert!(plan.forward_original);
    assert_eq!(released, 0);
}

#[test]
fn take_over_makes_tags_pending() {
    let mut ch = channel_with(&[(1, "q"), (2, "dl"), (3, "q")]);
    let (plan, _) = ch.plan_settlement(Verb::Nack { requeue: false }, 3, true, |d| {
        d.queue.as_deref() == Some("dl")
    });
    assert!(!plan.forward_original);
    assert_eq!(plan.taken_over.len(), 1);
    assert_eq!(plan.taken_over[0].0, 2);
    assert_eq!(
        plan.native,
        vec![
            NativeSettle {
                verb: Verb::Nack { requeue: false },
                tag: 1,
                multiple: false
            },
            NativeSettle {
                verb: Verb::Nack { requeue: false },
                tag: 3,
                multiple: false
            },
        ]
    );
    assert!(ch.is_pending(2));
    assert_eq!(ch.kept_len(), 0);
}

#[test]
fn multiple_ack_never_covers_a_pending_tag() {
    let mut ch = channel_with(&[(1, "q"), (2, "q"), (3, "q"), (4, "q"), (5, "q")]);
    let (plan, _) = ch.plan_settlement(Verb::Reject { requeue: false }, 3, false, |_| true);
    assert_eq!(plan.taken_over.len(), 1);
    // Ack up to 5 with tag 3 pending: 1 and 2 may be acked as a range? No: the range would
    // include 3, so the acks are single.
    let (plan, _) = ch.plan_settlement(Verb::Ack, 5, true, |_| false);
    assert!(!plan.forward_original);
    assert_eq!(
        plan.native
            .iter()
            .map(|n| (n.tag, n.multiple))
            .collect::<Vec<_>>(),
        vec![(1, false), (2, false), (4, false), (5, false)]
    );
    assert!(ch.finish_pending(3));
    let (plan, _) = ch.plan_settlement(Verb::Ack, 0, true, |_| false);
    assert!(plan.forward_original);
}

#[test]
fn native_tags_below_the_pending_ones_use_one_multiple_frame() {
    let mut ch = channel_with(&[(1, "q"), (2, "q"), (3, "dl")]);
    let (plan, _) = ch.plan_settlement(Verb::Nack { requeue: true }, 0, true, |d| {
        d.queue.as_deref() == Some("dl")
    });
    assert_eq!(
        plan.native,
        vec![NativeSettle {
            verb: Verb::Nack { requeue: true },
            tag: 2,
            multiple: true
        }]
    );
    assert_eq!(plan.taken_over[0].0, 3);
}

#[test]
fn settling_a_pending_tag_again_is_reported() {
    let mut ch = channel_with(&[(1, "q")]);
    ch.plan_settlement(Verb::Reject { requeue: false }, 1, false, |_| true);
    let (plan, _) = ch.plan_settlement(Verb::Ack, 1, false, |_| false);
    assert_eq!(plan.already_pending, vec![1]);
    assert!(!plan.forward_original);
    assert!(plan.native.is_empty());
}

#[test]
fn clear_releases_everything() {
    let mut ch = channel_with(&[(1, "q"), (2, "q")]);
    ch.plan_settlement(Verb::Reject { requeue: false }, 1, false, |_| true);
    let (count, bytes) = ch.clear();
    assert_eq!(count, 1);
    assert!(bytes > 0);
    assert_eq!(ch.pending_len(), 0);
}

#[test]
fn settlements_out_of_order_leave_a_bounded_number_of_empty_slots() {
    // The client holds tag 1 and settles every later delivery one by one, as they come.
    let mut ch = channel_with(&[(1, "q")]);
    for tag in 2..=10_000 {
        ch.keep(tag, delivery("q", "x"));
        let (plan, _) = ch.plan_settlement(Verb::Ack, tag, false, |_| false);
        assert!(plan.forward_original);
        assert!(ch.kept.len() <= 2 * ch.kept_len() + EMPTY_SLOTS_SLACK + 1);
    }
    assert_eq!(ch.kept_len(), 1);
    assert!(ch.get(1).is_some());
    assert!(ch.get(5).is_none());
    // A multiple ack over the whole range settles the one left.
    let (plan, released) = ch.plan_settlement(Verb::Ack, 10_000, true, |_| false);
    assert!(plan.forward_original);
    assert!(released > 0);
    assert_eq!((ch.kept_len(), ch.kept_bytes(), ch.kept.len()), (0, 0, 0));
}

#[test]
fn a_tag_kept_again_replaces_the_first_and_out_of_order_tags_stay_sorted() {
    let mut ch = channel_with(&[(2, "a"), (5, "a")]);
    let bytes = ch.kept_bytes();
    ch.keep(5, delivery("b", "x"));
    assert_eq!((ch.kept_len(), ch.kept_bytes()), (2, bytes));
    assert_eq!(ch.get(5).and_then(|d| d.queue.as_deref()), Some("b"));
    ch.keep(3, delivery("c", "x"));
    // A multiple settlement up to 3 names 2 and 3 only, in tag order.
    let (plan, _) = ch.plan_settlement(Verb::Nack { requeue: false }, 3, true, |_| true);
    assert_eq!(
        plan.taken_over.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        vec![2, 3]
    );
    assert_eq!(ch.kept_len(), 1);
    assert!(ch.get(5).is_some());
}

#[test]
fn the_room_of_a_burst_is_given_back_once_it_is_settled() {
    let mut ch = ChannelDeliveries::default();
    for tag in 1..=10_000 {
        ch.keep(tag, delivery("q", "x"));
    }
    assert!(ch.kept.capacity() >= 10_000);
    let (plan, _) = ch.plan_settlement(Verb::Ack, 9_990, true, |_| false);
    assert!(plan.forward_original);
    assert_eq!(ch.kept_len(), 10);
    assert!(
        ch.kept.capacity() <= 4 * SHRINK_BELOW,
        "{}",
        ch.kept.capacity()
    );
    // A steady window below that size keeps its room.
    for tag in 10_001..=10_200 {
        ch.keep(tag, delivery("q", "x"));
        let before = ch.kept.capacity();
        ch.plan_settlement(Verb::Ack, tag - 5, false, |_| false);
        assert_eq!(ch.kept.capacity(), before);
    }
}
