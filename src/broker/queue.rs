//! Queue bookkeeping: ready messages in publish order, their byte count, expiry, length limits,
//! requeue and delivery limits.
//!
//! No I/O and no clock: the caller passes `now` (broker milliseconds) and gets back the messages
//! that die, each with its [`DeadLetterReason`]. Every way a message leaves a queue because of
//! a rule goes through [`QueueState::kill`], the one place deaths are recorded.
//!
//! Expiry happens at the head, as in RabbitMQ, with one exception: with
//! `dead_letter.ttl_on_dead_letters = false` ([`QueueLimits::keep_dead_letters`]) a message
//! that carries an x-death history never expires here, and such messages at the front are
//! stepped over, so the first message that can expire is the one checked (a kept dead letter
//! never holds back the expiry of the messages behind it). `exempt_prefix` remembers how many
//! front messages are known to be exempt, so the step-over costs nothing per publish.

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
    /// `dead_letter.ttl_on_dead_letters = false`: messages with an x-death history get no
    /// expiry in this queue (length limits still apply).
    pub keep_dead_letters: bool,
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
    /// The first `exempt_prefix` ready messages are exempt from expiry (a lower bound: the
    /// run may be longer; [`QueueState::first_expirable`] extends it).
    exempt_prefix: usize,
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
        let ttl_exempt = self.limits.keep_dead_letters && message.has_death_history();
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut entry = QueuedMessage {
            message,
            seq,
            enqueued_at: now,
            expires_at: None,
            delivery_count: 0,
            redelivered: false,
            store_id: None,
            ttl_exempt,
        };
        entry.expires_at = self.expiry_of(&entry);
        entry
    }

    /// When `entry` expires under the current limits (never when it is exempt).
    fn expiry_of(&self, entry: &QueuedMessage) -> Option<u64> {
        if entry.ttl_exempt {
            return None;
        }
        let ttl = match (self.limits.message_ttl, entry.message.expiration_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| entry.enqueued_at.saturating_add(t))
    }

    /// Whether reject-publish / reject-publish-dlx refuses this message: the ready messages
    /// plus it would pass max-length or max-length-bytes. RabbitMQ checks this before trying
    /// consumers, so even a waiting consumer does not get a refused message.
    pub fn refuses(&self, entry: &QueuedMessage) -> bool {
        self.refuses_len(entry.body_len())
    }

    /// [`QueueState::refuses`] for a message of `body_len` bytes not admitted yet.
    pub fn refuses_len(&self, body_len: u64) -> bool {
        matches!(
            self.limits.overflow,
            Overflow::RejectPublish | Overflow::RejectPublishDlx
        ) && self.would_overflow(body_len)
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

    /// Puts back a message recovered from storage (its delivery count restored): one that
    /// was returned more often than the delivery limit allows dies (`delivery_limit`), as it
    /// would have on its last requeue; the others are published as usual.
    pub fn restore(
        &mut self,
        entry: QueuedMessage,
        now: u64,
        deaths: &mut Vec<Death>,
    ) -> PublishOutcome {
        if self.over_delivery_limit(&entry) {
            Self::kill(entry, DeadLetterReason::DeliveryLimit, deaths);
            return PublishOutcome::Accepted;
        }
        self.publish(entry, now, deaths)
    }

    fn over_delivery_limit(&self, entry: &QueuedMessage) -> bool {
        self.limits
            .delivery_limit
            .is_some_and(|limit| entry.delivery_count as u64 > limit)
    }

    fn would_overflow(&self, body_len: u64) -> bool {
        let over_len = self
            .limits
            .max_length
            .is_some_and(|max| self.ready.len() as u64 + 1 > max);
        let over_bytes = self
            .limits
            .max_length_bytes
            .is_some_and(|max| self.ready_bytes + body_len > max);
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
    /// RabbitMQ does); exempt dead letters at the front are stepped over (module comment).
    pub fn expire(&mut self, now: u64, deaths: &mut Vec<Death>) {
        loop {
            let at = self.first_expirable();
            let due = self
                .ready
                .get(at)
                .and_then(|e| e.expires_at)
                .is_some_and(|t| t <= now);
            if !due {
                break;
            }
            if let Some(entry) = self.ready.remove(at) {
                self.ready_bytes -= entry.body_len();
                Self::kill(entry, DeadLetterReason::Expired, deaths);
            }
        }
    }

    /// Index of the first ready message that is not exempt from expiry (extends the known
    /// exempt prefix; each message joins it at most once per time it is at the front).
    fn first_expirable(&mut self) -> usize {
        while self
            .ready
            .get(self.exempt_prefix)
            .is_some_and(|e| e.ttl_exempt)
        {
            self.exempt_prefix += 1;
        }
        self.exempt_prefix
    }

    /// When the first message that can expire does (the only deadline a timer needs).
    pub fn next_expiry(&mut self) -> Option<u64> {
        let at = self.first_expirable();
        self.ready.get(at).and_then(|e| e.expires_at)
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
            if self.over_delivery_limit(&entry) {
                Self::kill(entry, DeadLetterReason::DeliveryLimit, deaths);
                continue;
            }
            let pos = self.ready.partition_point(|e| e.seq < entry.seq);
            if pos <= self.exempt_prefix {
                if entry.ttl_exempt {
                    self.exempt_prefix += 1;
                } else {
                    self.exempt_prefix = pos;
                }
            }
            self.ready_bytes += entry.body_len();
            self.ready.insert(pos, entry);
        }
        self.expire(now, deaths);
        self.drop_head_over_limit(deaths);
    }

    /// Applies new limits (a policy change) to the messages already queued.
    pub fn set_limits(&mut self, limits: QueueLimits, now: u64, deaths: &mut Vec<Death>) {
        let ttl_changed = limits.message_ttl != self.limits.message_ttl;
        self.limits = limits;
        if ttl_changed {
            let mut ready = std::mem::take(&mut self.ready);
            for e in ready.iter_mut() {
                e.expires_at = self.expiry_of(e);
            }
            self.ready = ready;
        }
        self.expire(now, deaths);
        self.drop_head_over_limit(deaths);
    }

    /// Removes every ready message without dead-lettering (queue.purge, queue.delete).
    pub fn purge(&mut self) -> usize {
        let n = self.ready.len();
        self.ready.clear();
        self.ready_bytes = 0;
        self.exempt_prefix = 0;
        n
    }

    pub fn iter(&self) -> impl Iterator<Item = &QueuedMessage> {
        self.ready.iter()
    }

    /// The ready messages after position `seq` (all of them for `None`), in order: the
    /// cursor of a redrive pass ([`crate::redrive`]). Ready messages are kept in `seq` order.
    pub fn iter_after(&self, seq: Option<u64>) -> impl Iterator<Item = &QueuedMessage> {
        let start = seq.map_or(0, |seq| self.ready.partition_point(|e| e.seq <= seq));
        self.ready.range(start..)
    }

    /// The position of the last ready message (the end of a redrive pass started now).
    pub fn last_seq(&self) -> Option<u64> {
        self.ready.back().map(|e| e.seq)
    }

    /// Takes out the ready messages at positions `seqs` (ascending), wherever they are,
    /// without dead-lettering them (a redrive moved them); the others keep their order.
    pub fn take_seqs(&mut self, seqs: &[u64]) -> Vec<QueuedMessage> {
        let mut taken = Vec::with_capacity(seqs.len());
        // Backwards, so each index found stays valid for the next.
        for &seq in seqs.iter().rev() {
            let at = self.ready.partition_point(|e| e.seq < seq);
            if self.ready.get(at).is_some_and(|e| e.seq == seq)
                && let Some(entry) = self.ready.remove(at)
            {
                self.ready_bytes -= entry.body_len();
                if at < self.exempt_prefix {
                    self.exempt_prefix -= 1;
                }
                taken.push(entry);
            }
        }
        taken.reverse();
        taken
    }

    fn push_back(&mut self, entry: QueuedMessage) {
        self.ready_bytes += entry.body_len();
        self.ready.push_back(entry);
    }

    fn pop_front(&mut self) -> Option<QueuedMessage> {
        let entry = self.ready.pop_front()?;
        self.ready_bytes -= entry.body_len();
        self.exempt_prefix = self.exempt_prefix.saturating_sub(1);
        Some(entry)
    }

    /// The single place a message dies in a queue.
    fn kill(entry: QueuedMessage, reason: DeadLetterReason, deaths: &mut Vec<Death>) {
        deaths.push(Death { entry, reason });
    }
}

#[cfg(test)]
mod tests;
