//! Queue bookkeeping: ready messages in publish order, their byte count, expiry, length limits,
//! requeue and delivery limits.
//!
//! No I/O and no clock: the caller passes `now` (broker milliseconds) and gets back the messages
//! that die, each with its [`DeadLetterReason`]. Every way a message leaves a queue because of
//! a rule goes through `QueueState::kill`, the one place deaths are recorded.
//!
//! Expiry happens at the head, as in RabbitMQ, with one exception: with
//! `dead_letter.ttl_on_dead_letters = false` ([`QueueLimits::keep_dead_letters`]) a message
//! that carries an x-death history never expires here, and such messages at the front are
//! stepped over, so the first message that can expire is the one checked (a kept dead letter
//! never holds back the expiry of the messages behind it). `exempt_prefix` remembers how many
//! front messages are known to be exempt, so the step-over costs nothing per publish.
//!
//! Paging ([`super::paging`]): in a queue that can page, a message with a record in the log
//! may be held without its content (a paged slot). Everything that takes a message out of the
//! queue (delivery, death, inspection) reads its content back first, so callers only ever see
//! whole [`QueuedMessage`]s. A read that fails with an error that may pass leaves the slot
//! where it was: delivery stops at it, an expiry or drop-head waits for it, and
//! [`QueueState::retry_read`] (the queue's timer, at [`QueueState::next_read_retry`]) reads it
//! again with doubling waits. A message whose content cannot be read back for good (or
//! after [`READ_ATTEMPTS`] reads) is lost (counted in [`QueueState::take_lost`] for its
//! removal record). Which messages page out: the newest
//! resident ones with a written record, while the resident content of all queues is over the
//! budget (`candidates` lists them without walking the queue).

use std::collections::VecDeque;
use std::sync::Arc;

use super::message::{Message, PagedMeta, QueuedMessage};
use super::paging::{Paging, READ_ATTEMPTS, READ_RETRY_FIRST_MS, ReadFailure};
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

/// A ready message whose content is on disk only: its queue bookkeeping and what the queue
/// needs of the message ([`PagedMeta`]).
#[derive(Clone, Debug)]
struct PagedEntry {
    seq: u64,
    enqueued_at: u64,
    expires_at: Option<u64>,
    delivery_count: u32,
    redelivered: bool,
    ttl_exempt: bool,
    store_id: u64,
    body_len: u64,
    /// The message's own TTL (its `expiration`), for a policy change.
    expiration_ms: Option<u64>,
}

/// A ready message as [`QueueState::peek_after`] gives it.
#[derive(Clone, Debug)]
pub enum Peeked {
    Resident(QueuedMessage),
    /// Paged out: its position, its id in storage, its redelivered flag.
    Paged {
        seq: u64,
        store_id: u64,
        redelivered: bool,
    },
}

/// A ready message, with its content in memory or on disk only.
#[derive(Clone, Debug)]
enum Slot {
    Resident(QueuedMessage),
    Paged(PagedEntry),
}

impl Slot {
    fn seq(&self) -> u64 {
        match self {
            Slot::Resident(e) => e.seq,
            Slot::Paged(p) => p.seq,
        }
    }
    fn body_len(&self) -> u64 {
        match self {
            Slot::Resident(e) => e.body_len(),
            Slot::Paged(p) => p.body_len,
        }
    }
    fn expires_at(&self) -> Option<u64> {
        match self {
            Slot::Resident(e) => e.expires_at,
            Slot::Paged(p) => p.expires_at,
        }
    }
    fn delivery_count(&self) -> u32 {
        match self {
            Slot::Resident(e) => e.delivery_count,
            Slot::Paged(p) => p.delivery_count,
        }
    }
    fn ttl_exempt(&self) -> bool {
        match self {
            Slot::Resident(e) => e.ttl_exempt,
            Slot::Paged(p) => p.ttl_exempt,
        }
    }
    /// Content bytes held in memory for a message with a record (what paging accounts).
    fn resident_stored(&self) -> u64 {
        match self {
            Slot::Resident(e) if e.store_id.is_some() => e.message.content_len(),
            _ => 0,
        }
    }
}

/// The ready messages of one queue.
#[derive(Debug, Default)]
pub struct QueueState {
    ready: VecDeque<Slot>,
    ready_bytes: u64,
    next_seq: u64,
    limits: QueueLimits,
    /// The first `exempt_prefix` ready messages are exempt from expiry (a lower bound: the
    /// run may be longer; [`QueueState::first_expirable`] extends it).
    exempt_prefix: usize,
    /// Set when the queue's messages can page (durable queue, storage attached).
    paging: Option<Arc<Paging>>,
    /// Positions (seq) of resident messages with a record that arrived by publish, oldest
    /// first: what may page out. Stale positions (gone, paged) are dropped when met.
    candidates: VecDeque<u64>,
    /// Resident content with a record, paged messages and their body bytes, in this queue
    /// (its share of the [`Paging`] account).
    resident_stored: u64,
    paged: u64,
    paged_bytes: u64,
    /// Stored content added since the last page-out walk.
    grown: u64,
    /// Message ids whose content could not be read back (lost), for their removal record.
    lost: Vec<u64>,
    /// Paged messages whose read failed with an error that may pass: they stay queued and
    /// are read again at their `at` (module comment). Each path that reads stops at its
    /// first such message (delivery and drop-head at the head, expiry at the first message
    /// that can expire), so this holds one or two, plus any whose message left the queue
    /// meanwhile until their time comes.
    read_retries: Vec<ReadRetry>,
}

/// The next read of a paged message whose last read failed transiently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadRetry {
    store_id: u64,
    /// Failed reads so far.
    failures: u32,
    /// Broker milliseconds of the next read.
    at: u64,
}

/// What reading a slot's content back gave.
enum PageIn {
    Whole(QueuedMessage),
    /// Unreadable for good: counted lost.
    Lost,
    /// Not readable now: the slot, to be put back where it was.
    Later(Slot),
}

impl Drop for QueueState {
    fn drop(&mut self) {
        self.forget_all();
    }
}

impl QueueState {
    pub fn new(limits: QueueLimits) -> Self {
        let mut q = QueueState::default();
        q.limits = limits;
        q
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
        entry.expires_at = self.expiry_of(
            entry.ttl_exempt,
            entry.message.expiration_ms,
            entry.enqueued_at,
        );
        entry
    }

    /// When a message expires under the current limits (never when it is exempt).
    fn expiry_of(&self, exempt: bool, expiration_ms: Option<u64>, enqueued_at: u64) -> Option<u64> {
        if exempt {
            return None;
        }
        let ttl = match (self.limits.message_ttl, expiration_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| enqueued_at.saturating_add(t))
    }

    /// Lets the queue page (its persistent messages are kept on disk).
    pub fn set_paging(&mut self, paging: Arc<Paging>) {
        self.forget_all();
        self.paging = Some(paging);
        let slots: Vec<Slot> = self.ready.iter().cloned().collect();
        for slot in &slots {
            self.note_in(slot);
        }
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
        let outcome = self.publish_slot(Slot::Resident(entry), now, deaths);
        self.page_out_over_budget();
        outcome
    }

    fn publish_slot(&mut self, slot: Slot, now: u64, deaths: &mut Vec<Death>) -> PublishOutcome {
        match self.limits.overflow {
            Overflow::RejectPublish | Overflow::RejectPublishDlx
                if self.refuses_len(slot.body_len()) =>
            {
                if self.limits.overflow == Overflow::RejectPublishDlx {
                    // A published slot is resident: its content is at hand.
                    if let Some(kept) = self.kill(slot, DeadLetterReason::MaxLen, now, deaths) {
                        self.push_back(kept);
                    }
                    return PublishOutcome::RejectedDeadLettered;
                }
                PublishOutcome::Rejected
            }
            _ => {
                self.push_back(slot);
                self.shed_and_expire(now, deaths);
                PublishOutcome::Accepted
            }
        }
    }

    /// Puts back a message recovered from storage (its delivery count restored): one that
    /// was returned more often than the delivery limit allows dies (`delivery_limit`), as it
    /// would have on its last requeue; the others go back as a requeue puts them back (only
    /// `drop-head` sheds the oldest; `reject-publish` does not refuse them).
    pub fn restore(
        &mut self,
        entry: QueuedMessage,
        now: u64,
        deaths: &mut Vec<Death>,
    ) -> PublishOutcome {
        let mut slot = Slot::Resident(entry);
        if self.over_delivery_limit(slot.delivery_count()) {
            match self.kill(slot, DeadLetterReason::DeliveryLimit, now, deaths) {
                None => return PublishOutcome::Accepted,
                Some(kept) => slot = kept,
            }
        }
        self.restore_slot(slot, now, now, deaths);
        self.page_out_over_budget();
        PublishOutcome::Accepted
    }

    /// A recovered message joins the back of its queue. It was accepted once and may have
    /// been delivered and not settled (back now as a requeue puts it back), so the publish
    /// rule of `reject-publish` does not refuse it: only `drop-head` sheds the oldest when
    /// the queue is over its limit, as on a requeue.
    /// `now` is the time expiry is judged at, `clock` the broker's time (what a failed read
    /// is retried by).
    fn restore_slot(&mut self, slot: Slot, now: u64, clock: u64, deaths: &mut Vec<Death>) {
        self.push_back(slot);
        self.expire_judged_at(now, clock, deaths);
        self.drop_head_over_limit(clock, deaths);
    }

    /// Puts back a message recovered from storage without its content (paged: read back
    /// when it leaves the queue), `deliveries` being its unsettled deliveries before the stop.
    /// As [`QueueState::restore`] otherwise. Expiry is judged at `entered` (nothing expires
    /// while the queue loads); `clock` is the broker's time now, for the reads this makes.
    pub fn restore_paged(
        &mut self,
        store_id: u64,
        meta: PagedMeta,
        entered: u64,
        deliveries: u32,
        clock: u64,
        deaths: &mut Vec<Death>,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let ttl_exempt = self.limits.keep_dead_letters && meta.death_history;
        let slot = Slot::Paged(PagedEntry {
            seq,
            enqueued_at: entered,
            expires_at: self.expiry_of(ttl_exempt, meta.expiration_ms, entered),
            delivery_count: deliveries,
            redelivered: deliveries > 0,
            ttl_exempt,
            store_id,
            body_len: meta.body_len,
            expiration_ms: meta.expiration_ms,
        });
        let slot = if self.over_delivery_limit(deliveries) {
            // Kept when its content cannot be read now (delivered once more, not lost; read
            // when it leaves the queue, so no retry of its own).
            match self.kill(slot, DeadLetterReason::DeliveryLimit, clock, deaths) {
                None => return,
                Some(kept) => {
                    self.read_retries.retain(|retry| retry.store_id != store_id);
                    kept
                }
            }
        } else {
            slot
        };
        self.restore_slot(slot, entered, clock, deaths);
    }

    fn over_delivery_limit(&self, delivery_count: u32) -> bool {
        self.limits
            .delivery_limit
            .is_some_and(|limit| delivery_count as u64 > limit)
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

    /// Under drop-head, dead-letters the head while the queue is over its limit. A head whose
    /// content cannot be read now stays, the queue over its limit until it can be.
    fn drop_head_over_limit(&mut self, now: u64, deaths: &mut Vec<Death>) {
        if self.limits.overflow != Overflow::DropHead {
            return;
        }
        while self.over_limit() {
            let Some(slot) = self.pop_front() else { break };
            if let Some(kept) = self.kill(slot, DeadLetterReason::MaxLen, now, deaths) {
                self.put_back(0, kept);
                break;
            }
        }
    }

    /// Dead-letters expired messages at the head (per-message TTL is only enforced there, as
    /// RabbitMQ does); exempt dead letters at the front are stepped over (module comment).
    pub fn expire(&mut self, now: u64, deaths: &mut Vec<Death>) {
        self.expire_judged_at(now, now, deaths);
    }

    /// [`QueueState::expire`] judged at `now`, with `clock` the broker's time (for reads).
    fn expire_judged_at(&mut self, now: u64, clock: u64, deaths: &mut Vec<Death>) {
        loop {
            let at = self.first_expirable();
            let due = self
                .ready
                .get(at)
                .and_then(Slot::expires_at)
                .is_some_and(|t| t <= now);
            if !due {
                break;
            }
            if let Some(slot) = self.ready.remove(at) {
                self.ready_bytes -= slot.body_len();
                self.note_out(&slot);
                if let Some(kept) = self.kill(slot, DeadLetterReason::Expired, clock, deaths) {
                    // Its content cannot be read now: it dies when it can be.
                    self.put_back(at, kept);
                    break;
                }
            }
        }
        self.forget_stale_candidates();
    }

    /// Index of the first ready message that is not exempt from expiry (extends the known
    /// exempt prefix; each message joins it at most once per time it is at the front).
    fn first_expirable(&mut self) -> usize {
        while self
            .ready
            .get(self.exempt_prefix)
            .is_some_and(Slot::ttl_exempt)
        {
            self.exempt_prefix += 1;
        }
        self.exempt_prefix
    }

    /// When the first message that can expire does (the only deadline a timer needs); not
    /// before the next read of its content when that failed.
    pub fn next_expiry(&mut self) -> Option<u64> {
        let at = self.first_expirable();
        let slot = self.ready.get(at)?;
        let expires = slot.expires_at()?;
        Some(match slot {
            Slot::Paged(p) => self
                .read_retry_of(p.store_id)
                .map_or(expires, |retry| expires.max(retry.at)),
            Slot::Resident(_) => expires,
        })
    }

    /// When a paged message whose read failed is read again next ([`QueueState::retry_read`]).
    pub fn next_read_retry(&self) -> Option<u64> {
        self.read_retries.iter().map(|retry| retry.at).min()
    }

    fn read_retry_of(&self, store_id: u64) -> Option<ReadRetry> {
        self.read_retries
            .iter()
            .find(|retry| retry.store_id == store_id)
            .copied()
    }

    /// The timer's step for paged messages whose read failed: reads each due one again and
    /// keeps its content in memory (so the next delivery or death has it), then applies what
    /// waited for it (expiry, drop-head). Forgets a retry whose message left the queue.
    pub fn retry_read(&mut self, now: u64, deaths: &mut Vec<Death>) {
        let due: Vec<u64> = self
            .read_retries
            .iter()
            .filter(|retry| retry.at <= now)
            .map(|retry| retry.store_id)
            .collect();
        for store_id in due {
            let Some(at) = self
                .ready
                .iter()
                .position(|slot| matches!(slot, Slot::Paged(p) if p.store_id == store_id))
            else {
                self.read_retries.retain(|retry| retry.store_id != store_id);
                continue;
            };
            let Some(slot) = self.ready.remove(at) else {
                continue;
            };
            self.ready_bytes -= slot.body_len();
            if at < self.exempt_prefix {
                self.exempt_prefix -= 1;
            }
            self.note_out(&slot);
            match self.page_in(slot, now) {
                PageIn::Whole(entry) => self.put_back(at, Slot::Resident(entry)),
                PageIn::Later(slot) => self.put_back(at, slot),
                PageIn::Lost => {}
            }
        }
        self.shed_and_expire(now, deaths);
    }

    /// Takes the head for delivery, expiring dead heads first (its content read back when it
    /// was paged out; one that cannot be read is lost and the next is taken). The new head
    /// expires too when it is due, as RabbitMQ's fetch does, so the count left (basic.get-ok's
    /// message-count) does not include it.
    pub fn pop(&mut self, now: u64, deaths: &mut Vec<Death>) -> Option<QueuedMessage> {
        self.expire(now, deaths);
        loop {
            let slot = self.pop_front()?;
            match self.page_in(slot, now) {
                PageIn::Whole(entry) => {
                    self.expire(now, deaths);
                    return Some(entry);
                }
                PageIn::Lost => {}
                PageIn::Later(slot) => {
                    // Delivered once it can be read ([`QueueState::retry_read`]).
                    self.put_back(0, slot);
                    return None;
                }
            }
        }
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
            let mut slot = Slot::Resident(entry);
            if self.over_delivery_limit(slot.delivery_count()) {
                match self.kill(slot, DeadLetterReason::DeliveryLimit, now, deaths) {
                    None => continue,
                    Some(kept) => slot = kept,
                }
            }
            let pos = self.ready.partition_point(|e| e.seq() < slot.seq());
            self.put_back(pos, slot);
        }
        self.shed_and_expire(now, deaths);
    }

    /// Applies new limits (a policy change) to the messages already queued: a new message
    /// TTL counts from each one's enqueue time (a deliberate difference: RabbitMQ keeps the
    /// expiry each got at enqueue, docs/semantics.md), a lower length limit sheds the head.
    pub fn set_limits(&mut self, limits: QueueLimits, now: u64, deaths: &mut Vec<Death>) {
        let ttl_changed = limits.message_ttl != self.limits.message_ttl;
        self.limits = limits;
        if ttl_changed {
            let mut ready = std::mem::take(&mut self.ready);
            for slot in ready.iter_mut() {
                match slot {
                    Slot::Resident(e) => {
                        e.expires_at =
                            self.expiry_of(e.ttl_exempt, e.message.expiration_ms, e.enqueued_at);
                    }
                    Slot::Paged(p) => {
                        p.expires_at = self.expiry_of(p.ttl_exempt, p.expiration_ms, p.enqueued_at);
                    }
                }
            }
            self.ready = ready;
        }
        self.shed_and_expire(now, deaths);
    }

    /// What follows every change of the queue's contents or limits, in RabbitMQ's order:
    /// drop-head sheds what is over the length limits first (`maxlen`), then heads that
    /// are due expire (`expired`). The order decides the reason a due head that is also
    /// over the limit dies with.
    /// With kept dead letters at the front (`dead_letter.ttl_on_dead_letters = false`, which
    /// RabbitMQ does not have), expiry goes first: it steps over them to what may expire
    /// behind them, where drop-head would shed a kept dead letter for a message about to
    /// expire anyway.
    fn shed_and_expire(&mut self, now: u64, deaths: &mut Vec<Death>) {
        if self.first_expirable() > 0 {
            self.expire(now, deaths);
            self.drop_head_over_limit(now, deaths);
        } else {
            self.drop_head_over_limit(now, deaths);
            self.expire(now, deaths);
        }
    }

    /// Removes every ready message without dead-lettering (queue.purge, queue.delete).
    pub fn purge(&mut self) -> usize {
        let n = self.ready.len();
        self.forget_all();
        self.ready.clear();
        self.candidates.clear();
        self.ready_bytes = 0;
        self.exempt_prefix = 0;
        self.read_retries.clear();
        n
    }

    /// The store ids of the ready messages kept on disk, paged or not, without reading any
    /// content back (a purge writes their removal).
    pub fn store_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.ready.iter().filter_map(|slot| match slot {
            Slot::Resident(e) => e.store_id,
            Slot::Paged(p) => Some(p.store_id),
        })
    }

    /// The ready messages in order, as copies (the queue is unchanged): contents paged out
    /// are read back for the copy (one that cannot be read is left out).
    pub fn iter(&self) -> impl Iterator<Item = QueuedMessage> + '_ {
        self.ready.iter().filter_map(|slot| match slot {
            Slot::Resident(e) => Some(e.clone()),
            Slot::Paged(p) => {
                let message = self.paging.as_ref()?.read(p.store_id, false).ok()?;
                Some(p.with(message))
            }
        })
    }

    /// The ready messages after position `seq` (all of them for `None`), in order, as copies
    /// ([`QueueState::iter`]): the cursor of a redrive pass ([`crate::redrive`]). Ready
    /// messages are kept in `seq` order. A paged message whose content cannot be read back
    /// is `Err(its seq)`, so the cursor can still move past it (it stays in the queue, and
    /// is counted lost when it leaves it, as on delivery).
    pub fn iter_after(
        &self,
        seq: Option<u64>,
    ) -> impl Iterator<Item = Result<QueuedMessage, u64>> + '_ {
        let start = seq.map_or(0, |seq| self.ready.partition_point(|e| e.seq() <= seq));
        self.ready.range(start..).map(|slot| match slot {
            Slot::Resident(e) => Ok(e.clone()),
            Slot::Paged(p) => self
                .paging
                .as_ref()
                .and_then(|paging| paging.read(p.store_id, false).ok())
                .map(|message| p.with(message))
                .ok_or(p.seq),
        })
    }

    /// The ready messages after position `seq` (all of them for `None`), in order, without
    /// reading any content back: a resident message itself, a paged one as where it is kept
    /// (an inspection reads it back with [`crate::storage::Storage::read`] after releasing the
    /// broker lock).
    pub fn peek_after(&self, seq: Option<u64>) -> impl Iterator<Item = Peeked> + '_ {
        let start = seq.map_or(0, |seq| self.ready.partition_point(|e| e.seq() <= seq));
        self.ready.range(start..).map(|slot| match slot {
            Slot::Resident(e) => Peeked::Resident(e.clone()),
            Slot::Paged(p) => Peeked::Paged {
                seq: p.seq,
                store_id: p.store_id,
                redelivered: p.redelivered,
            },
        })
    }

    /// The position of the first ready message after `seq` (the first of all for `None`),
    /// without reading any content back.
    pub fn seq_after(&self, seq: Option<u64>) -> Option<u64> {
        let start = seq.map_or(0, |seq| self.ready.partition_point(|e| e.seq() <= seq));
        self.ready.get(start).map(Slot::seq)
    }

    /// The position of the last ready message (the end of a redrive pass started now).
    pub fn last_seq(&self) -> Option<u64> {
        self.ready.back().map(Slot::seq)
    }

    /// Removes the ready messages at positions `seqs` (ascending), wherever they are, without
    /// dead-lettering them (a redrive moved them; their content is not read back); the others
    /// keep their order. Returns how many were there.
    pub fn remove_seqs(&mut self, seqs: &[u64]) -> usize {
        let mut removed = 0;
        // Backwards, so each index found stays valid for the next.
        for &seq in seqs.iter().rev() {
            let at = self.ready.partition_point(|e| e.seq() < seq);
            if self.ready.get(at).is_some_and(|e| e.seq() == seq)
                && let Some(slot) = self.ready.remove(at)
            {
                self.ready_bytes -= slot.body_len();
                if at < self.exempt_prefix {
                    self.exempt_prefix -= 1;
                }
                self.note_out(&slot);
                removed += 1;
            }
        }
        self.forget_stale_candidates();
        removed
    }

    /// Drops paging candidates whose message left the queue other than from its head
    /// (expiry past an exempt prefix, a redrive): those before the head at once, the others
    /// once they outnumber the ready messages (so each is looked at a bounded number of
    /// times). Without this a queue emptied by expiry, with its contents under the paging
    /// budget (no page-out walk), would keep a position for every message it ever held.
    fn forget_stale_candidates(&mut self) {
        let Some(head) = self.ready.front().map(Slot::seq) else {
            self.candidates.clear();
            return;
        };
        while self.candidates.front().is_some_and(|&c| c < head) {
            self.candidates.pop_front();
        }
        if self.candidates.len() > 2 * self.ready.len() + 64 {
            let ready = &self.ready;
            self.candidates.retain(|seq| {
                ready
                    .binary_search_by_key(seq, Slot::seq)
                    .is_ok_and(|at| matches!(ready[at], Slot::Resident(_)))
            });
        }
    }

    /// Messages whose content could not be read back since the last call (lost): their
    /// message ids, for the removal record.
    pub fn take_lost(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.lost)
    }

    /// Whether the queue can page (its persistent messages are kept on disk).
    pub fn pages(&self) -> bool {
        self.paging.is_some()
    }

    /// Ready messages held without their content.
    pub fn paged(&self) -> u64 {
        self.paged
    }

    fn push_back(&mut self, slot: Slot) {
        self.ready_bytes += slot.body_len();
        self.note_in(&slot);
        if let Slot::Resident(e) = &slot
            && e.store_id.is_some()
            && self.paging.is_some()
        {
            self.candidates.push_back(e.seq);
            self.grown += e.message.content_len();
        }
        self.ready.push_back(slot);
    }

    fn pop_front(&mut self) -> Option<Slot> {
        let slot = self.ready.pop_front()?;
        self.ready_bytes -= slot.body_len();
        self.exempt_prefix = self.exempt_prefix.saturating_sub(1);
        self.note_out(&slot);
        while self.candidates.front().is_some_and(|&c| c <= slot.seq()) {
            self.candidates.pop_front();
        }
        Some(slot)
    }

    /// The single place a message dies in a queue (its content read back first; one that
    /// cannot be read for good is lost, not dead-lettered). `Some`: its content cannot be
    /// read now, and the caller puts the slot back (it dies when it can be read).
    fn kill(
        &mut self,
        slot: Slot,
        reason: DeadLetterReason,
        now: u64,
        deaths: &mut Vec<Death>,
    ) -> Option<Slot> {
        match self.page_in(slot, now) {
            PageIn::Whole(entry) => {
                deaths.push(Death { entry, reason });
                None
            }
            PageIn::Lost => None,
            PageIn::Later(slot) => Some(slot),
        }
    }

    /// The whole message of a slot that left the queue. A read that fails with an error that
    /// may pass gives the slot back and sets when it is read again (doubling waits, then lost
    /// after [`READ_ATTEMPTS`] failures); before then it is not read at all.
    fn page_in(&mut self, slot: Slot, now: u64) -> PageIn {
        let p = match slot {
            Slot::Resident(e) => return PageIn::Whole(e),
            Slot::Paged(p) => p,
        };
        let pending = self.read_retry_of(p.store_id);
        if pending.is_some_and(|retry| now < retry.at) {
            return PageIn::Later(Slot::Paged(p));
        }
        let failures = pending.map_or(0, |retry| retry.failures);
        let Some(paging) = self.paging.clone() else {
            self.lost.push(p.store_id);
            return PageIn::Lost;
        };
        let read = paging.read(p.store_id, failures + 1 >= READ_ATTEMPTS);
        if pending.is_some() {
            self.read_retries
                .retain(|retry| retry.store_id != p.store_id);
        }
        match read {
            Ok(message) => PageIn::Whole(p.with(message)),
            Err(ReadFailure::Transient) => {
                let wait = READ_RETRY_FIRST_MS.saturating_mul(1 << failures.min(16));
                self.read_retries.push(ReadRetry {
                    store_id: p.store_id,
                    failures: failures + 1,
                    at: now.saturating_add(wait),
                });
                PageIn::Later(Slot::Paged(p))
            }
            Err(ReadFailure::Permanent) => {
                self.lost.push(p.store_id);
                PageIn::Lost
            }
        }
    }

    /// Puts a slot (back) into `ready` at `at`, with its share of the accounts.
    fn put_back(&mut self, at: usize, slot: Slot) {
        if at <= self.exempt_prefix {
            if slot.ttl_exempt() {
                self.exempt_prefix += 1;
            } else {
                self.exempt_prefix = at;
            }
        }
        self.ready_bytes += slot.body_len();
        self.note_in(&slot);
        self.ready.insert(at, slot);
    }

    /// A slot entered `ready`: its share of the paging account.
    fn note_in(&mut self, slot: &Slot) {
        let Some(paging) = &self.paging else { return };
        match slot {
            Slot::Resident(_) => {
                let n = slot.resident_stored();
                self.resident_stored += n;
                paging.add_resident(n);
            }
            Slot::Paged(p) => {
                self.paged += 1;
                self.paged_bytes += p.body_len;
                paging.add_paged(1, p.body_len);
            }
        }
    }

    /// A slot left `ready`.
    fn note_out(&mut self, slot: &Slot) {
        let Some(paging) = &self.paging else { return };
        match slot {
            Slot::Resident(_) => {
                let n = slot.resident_stored();
                self.resident_stored = self.resident_stored.saturating_sub(n);
                paging.sub_resident(n);
            }
            Slot::Paged(p) => {
                self.paged = self.paged.saturating_sub(1);
                self.paged_bytes = self.paged_bytes.saturating_sub(p.body_len);
                paging.sub_paged(1, p.body_len);
            }
        }
    }

    /// Takes this queue's share out of the paging account (purge, drop).
    fn forget_all(&mut self) {
        if let Some(paging) = &self.paging {
            paging.sub_resident(self.resident_stored);
            paging.sub_paged(self.paged, self.paged_bytes);
        }
        self.resident_stored = 0;
        self.paged = 0;
        self.paged_bytes = 0;
    }

    /// While the resident content of all queues is over the budget, drops the content of
    /// this queue's newest messages whose record is written (newest first: the head is
    /// delivered soonest). Runs once the queue has grown by a step since the last walk, and
    /// then frees what is over plus a step.
    fn page_out_over_budget(&mut self) {
        let Some(paging) = self.paging.clone() else {
            return;
        };
        let over = paging.over_budget();
        if over == 0 || self.grown < paging.step().min(over) {
            return;
        }
        self.grown = 0;
        let want = over + paging.step();
        // Candidates from the newest back, in rounds that hold what is still wanted: those
        // whose record is not written yet (the newest, usually) stay and are stepped over.
        let mut freed = 0u64;
        let mut out = 0u64;
        let mut from = self.candidates.len();
        while freed < want && from > 0 {
            let mut picked = Vec::new();
            let mut sum = 0u64;
            while from > 0 && sum < want - freed {
                from -= 1;
                let seq = self.candidates[from];
                if let Ok(at) = self.ready.binary_search_by_key(&seq, Slot::seq)
                    && let Slot::Resident(e) = &self.ready[at]
                    && let Some(id) = e.store_id
                {
                    sum += e.message.content_len();
                    picked.push((at, id));
                }
            }
            let ids: Vec<u64> = picked.iter().map(|(_, id)| *id).collect();
            let written = paging.written(&ids);
            for ((at, _), written) in picked.into_iter().zip(written) {
                if written {
                    freed += self.page_out_at(at);
                    out += 1;
                }
            }
        }
        paging.paged_out(out);
        // Keep the candidates that are still resident (records not written yet).
        let tail: Vec<u64> = self
            .candidates
            .drain(from..)
            .filter(|seq| {
                self.ready
                    .binary_search_by_key(seq, Slot::seq)
                    .is_ok_and(|at| matches!(self.ready[at], Slot::Resident(_)))
            })
            .collect();
        self.candidates.extend(tail);
    }

    /// Drops the content of the resident message at `at` (its record is written); returns
    /// the bytes freed.
    fn page_out_at(&mut self, at: usize) -> u64 {
        let Some(Slot::Resident(e)) = self.ready.get(at) else {
            return 0;
        };
        let paged = Slot::Paged(PagedEntry::of(e));
        let resident = std::mem::replace(&mut self.ready[at], paged);
        let freed = resident.resident_stored();
        self.note_out(&resident);
        self.note_in(&self.ready[at].clone());
        freed
    }
}

impl PagedEntry {
    /// What stays of a resident message with a record once its content is dropped.
    fn of(e: &QueuedMessage) -> PagedEntry {
        PagedEntry {
            seq: e.seq,
            enqueued_at: e.enqueued_at,
            expires_at: e.expires_at,
            delivery_count: e.delivery_count,
            redelivered: e.redelivered,
            ttl_exempt: e.ttl_exempt,
            store_id: e.store_id.unwrap_or_default(),
            body_len: e.message.body_len(),
            expiration_ms: e.message.expiration_ms,
        }
    }

    /// The whole message again, with its content read back.
    fn with(&self, message: Arc<Message>) -> QueuedMessage {
        QueuedMessage {
            message,
            seq: self.seq,
            enqueued_at: self.enqueued_at,
            expires_at: self.expires_at,
            delivery_count: self.delivery_count,
            redelivered: self.redelivered,
            store_id: Some(self.store_id),
            ttl_exempt: self.ttl_exempt,
        }
    }
}

#[cfg(test)]
mod tests;
