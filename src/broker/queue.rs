//! Queue bookkeeping: ready messages in publish order, their byte count, expiry, length limits,
//! requeue and delivery limits.
//!
//! No I/O and no clock: the caller passes `now` (broker milliseconds) and gets back the messages
//! that die, each with its [`DeadLetterReason`]. Every way a message leaves a queue because of
//! a rule goes through [`QueueState::kill`], the one place deaths are recorded.

use std::collections::VecDeque;
use std::sync::Arc;

use super::message::{Message, QueuedMessage};
use crate::deadletter::DeadLetterReason;
use crate::rabbit::args::Overflow;

/// The limits a queue enforces (its effective settings: arguments merged with the policy).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    pub message_ttl: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    pub delivery_limit: Option<u64>,
}

/// A message that left the queue because of a rule.
#[derive(Debug)]
pub struct Death {
    pub entry: QueuedMessage,
    pub reason: DeadLetterReason,
}

/// What happened to a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// The message is in the queue (it may already have been dead-lettered by drop-head).
    Accepted,
    /// reject-publish: refused and discarded; the publisher gets a basic.nack.
    Rejected,
    /// reject-publish-dlx: refused and dead-lettered (`maxlen`, in the caller's deaths); the
    /// publisher gets a basic.nack.
    RejectedDeadLettered,
}

impl PublishOutcome {
    /// The publisher gets a basic.nack.
    pub fn is_rejected(self) -> bool {
        self != PublishOutcome::Accepted
    }
}

/// The ready messages of one queue.
#[derive(Debug, Default)]
pub struct QueueState {
    ready: VecDeque<QueuedMessage>,
    ready_bytes: u64,
    next_seq: u64,
    limits: QueueLimits,
}

impl QueueState {
    pub fn new(limits: QueueLimits) -> Self {
        QueueState {
            limits,
            ..Default::default()
        }
    }

    pub fn limits(&self) -> &QueueLimits {
        &self.limits
    }

    /// Ready messages (what max-length counts and queue.declare-ok reports).
    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// Body bytes of ready messages (what max-length-bytes counts).
    pub fn bytes(&self) -> u64 {
        self.ready_bytes
    }

    /// Wraps a message for this queue: assigns its position and computes its expiry.
    pub fn admit(&mut self, message: Arc<Message>, now: u64) -> QueuedMessage {
        let ttl = match (self.limits.message_ttl, message.expiration_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        QueuedMessage {
            message,
            seq,
            enqueued_at: now,
            expires_at: ttl.map(|t| now.saturating_add(t)),
            delivery_count: 0,
            redelivered: false,
        }
    }

    /// Whether reject-publish / reject-publish-dlx refuses this message: the ready messages
    /// plus it would pass max-length or max-length-bytes. RabbitMQ checks this before trying
    /// consumers, so even a waiting consumer does not get a refused message.
    pub fn refuses(&self, entry: &QueuedMessage) -> bool {
        matches!(
            self.limits.overflow,
            Overflow::RejectPublish | Overflow::RejectPublishDlx
        ) && self.would_overflow(entry)
    }

    /// Appends a published message, applying the overflow behaviour.
    pub fn publish(
        &mut self,
        entry: QueuedMessage,
        now: u64,
        deaths: &mut Vec<Death>,
    ) -> PublishOutcome {
        match self.limits.overflow {
            Overflow::RejectPublish | Overflow::RejectPublishDlx if self.refuses(&entry) => {
                if self.limits.overflow == Overflow::RejectPublishDlx {
                    Self::kill(entry, DeadLetterReason::MaxLen, deaths);
                    return PublishOutcome::RejectedDeadLettered;
                }
                PublishOutcome::Rejected
            }
            _ => {
                self.push_back(entry);
                self.expire(now, deaths);
                self.drop_head_over_limit(deaths);
                PublishOutcome::Accepted
            }
        }
    }

    fn would_overflow(&self, entry: &QueuedMessage) -> bool {
        let over_len = self
            .limits
            .max_length
            .is_some_and(|max| self.ready.len() as u64 + 1 > max);
        let over_bytes = self
            .limits
            .max_length_bytes
            .is_some_and(|max| self.ready_bytes + entry.body_len() > max);
        over_len || over_bytes
    }

    fn over_limit(&self) -> bool {
        self.limits
            .max_length
            .is_some_and(|max| self.ready.len() as u64 > max)
            || self
                .limits
                .max_length_bytes
                .is_some_and(|max| self.ready_bytes > max)
    }

    fn drop_head_over_limit(&mut self, deaths: &mut Vec<Death>) {
        if self.limits.overflow != Overflow::DropHead {
            return;
        }
        while self.over_limit() {
            match self.pop_front() {
                Some(entry) => Self::kill(entry, DeadLetterReason::MaxLen, deaths),
                None => break,
            }
        }
    }

    /// Dead-letters expired messages at the head (per-message TTL is only enforced there, as
    /// RabbitMQ does).
    pub fn expire(&mut self, now: u64, deaths: &mut Vec<Death>) {
        while self
            .ready
            .front()
            .is_some_and(|e| e.expires_at.is_some_and(|at| at <= now))
        {
            if let Some(entry) = self.pop_front() {
                Self::kill(entry, DeadLetterReason::Expired, deaths);
            }
        }
    }

    /// When the head expires (the only deadline a timer needs).
    pub fn next_expiry(&self) -> Option<u64> {
        self.ready.front().and_then(|e| e.expires_at)
    }

    /// Takes the head for delivery, expiring dead heads first.
    pub fn pop(&mut self, now: u64, deaths: &mut Vec<Death>) -> Option<QueuedMessage> {
        self.expire(now, deaths);
        self.pop_front()
    }

    /// Returns unacked messages to the queue at their original positions, counting the return
    /// toward the delivery limit. Messages past the limit die (`delivery_limit`), messages
    /// whose TTL ran out while unacked die now (`expired`), and under drop-head a full queue
    /// dead-letters its head (`maxlen`).
    pub fn requeue(
        &mut self,
        entries: impl IntoIterator<Item = QueuedMessage>,
        now: u64,
        deaths: &mut Vec<Death>,
    ) {
        for mut entry in entries {
            entry.delivery_count = entry.delivery_count.saturating_add(1);
            entry.redelivered = true;
            if self
                .limits
                .delivery_limit
                .is_some_and(|limit| entry.delivery_count as u64 > limit)
            {
                Self::kill(entry, DeadLetterReason::DeliveryLimit, deaths);
                continue;
            }
            let pos = self.ready.partition_point(|e| e.seq < entry.seq);
            self.ready_bytes += entry.body_len();
            self.ready.insert(pos, entry);
        }
        self.expire(now, deaths);
        self.drop_head_over_limit(deaths);
    }

    /// Applies new limits (a policy change) to the messages already queued.
    pub fn set_limits(&mut self, limits: QueueLimits, now: u64, deaths: &mut Vec<Death>) {
        if limits.message_ttl != self.limits.message_ttl {
            for e in self.ready.iter_mut() {
                let ttl = match (limits.message_ttl, e.message.expiration_ms) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                e.expires_at = ttl.map(|t| e.enqueued_at.saturating_add(t));
            }
        }
        self.limits = limits;
        self.expire(now, deaths);
        self.drop_head_over_limit(deaths);
    }

    /// Removes every ready message without dead-lettering (queue.purge, queue.delete).
    pub fn purge(&mut self) -> usize {
        let n = self.ready.len();
        self.ready.clear();
        self.ready_bytes = 0;
        n
    }

    pub fn iter(&self) -> impl Iterator<Item = &QueuedMessage> {
        self.ready.iter()
    }

    fn push_back(&mut self, entry: QueuedMessage) {
        self.ready_bytes += entry.body_len();
        self.ready.push_back(entry);
    }

    fn pop_front(&mut self) -> Option<QueuedMessage> {
        let entry = self.ready.pop_front()?;
        self.ready_bytes -= entry.body_len();
        Some(entry)
    }

    /// The single place a message dies in a queue.
    fn kill(entry: QueuedMessage, reason: DeadLetterReason, deaths: &mut Vec<Death>) {
        deaths.push(Death { entry, reason });
    }
}

#[cfg(test)]
mod tests {
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

    fn publish(
        q: &mut QueueState,
        body: &str,
        now: u64,
        deaths: &mut Vec<Death>,
    ) -> PublishOutcome {
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
}
