//! Kept deliveries: every delivery a client must still settle, per channel and delivery tag,
//! with a copy of its content when the proxy may have to dead-letter or republish it (queues
//! with a dead-letter exchange or a delivery limit the proxy counts; see
//! `ProxyShared::may_take_over`). The others are kept as a tag only, so a `multiple`
//! settlement can still be split correctly around tags the proxy took over.
//!
//! Tags move through three states as seen by the upstream:
//! - *kept*: delivered, the client has not settled it yet (content held here);
//! - *pending*: the client rejected it (or requeued it on a queue with a delivery limit); the
//!   proxy has published the replacement and waits for the confirm before it settles the
//!   original upstream. The content is no longer held (a failure requeues the original);
//! - gone: settled upstream.
//!
//! Client settlements that name a range (`multiple`) are planned here so the upstream never
//! sees a `multiple` that would also settle a pending tag: [`ChannelDeliveries::plan_settlement`] turns one
//! client frame into the native frames to forward and the tags the proxy takes over.
//!
//! The upstream numbers a channel's deliveries in increasing order, so the kept deliveries are
//! a deque in tag order: a delivery joins at the back, a settlement in delivery order leaves
//! from the front, and one settled out of order leaves an empty slot behind, dropped when it
//! reaches either end or when empty slots outnumber the kept deliveries (so their number stays
//! bounded by the kept ones, which `proxy.max_inflight_bytes` bounds).

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

use crate::broker::ack_timeout::{AckDeadlines, Deadline};

/// Bytes charged per kept delivery on top of its properties and body.
pub const KEPT_OVERHEAD: usize = 128;

/// A delivery the client has not settled yet. Small (a tag-only delivery is moved and kept
/// by the thousand on the forwarding path, with no shared count to touch); the message
/// itself sits behind a box.
#[derive(Clone, Debug)]
pub struct KeptDelivery {
    /// The queue it came from, where the proxy may need it: when its message was kept (a
    /// dead letter names its queue) or it has a consumer timeout (the metric names it).
    pub queue: Option<Arc<str>>,
    pub redelivered: bool,
    /// When it times out unsettled (its consumer timeout), in the session's milliseconds.
    pub deadline: Option<Deadline>,
    /// The message as delivered, when it was kept; without it the proxy cannot take the
    /// delivery over and settles it natively.
    pub message: Option<Box<KeptMessage>>,
}

/// The message of a kept delivery, as it was delivered.
#[derive(Clone, Debug, Default)]
pub struct KeptMessage {
    pub exchange: String,
    pub routing_key: String,
    /// The property section exactly as delivered.
    pub raw_properties: Bytes,
    pub body: Bytes,
}

impl KeptDelivery {
    /// Whether its message was kept (the proxy may take it over).
    pub fn with_content(&self) -> bool {
        self.message.is_some()
    }

    /// The property section as delivered (empty when the message was not kept).
    pub fn raw_properties(&self) -> &[u8] {
        self.message
            .as_ref()
            .map_or(&[][..], |message| &message.raw_properties)
    }

    /// Bytes charged against `proxy.max_inflight_bytes`.
    pub fn charge(&self) -> usize {
        self.message.as_ref().map_or(0, |m| {
            m.raw_properties.len() + m.body.len() + m.exchange.len() + m.routing_key.len()
        }) + KEPT_OVERHEAD
    }
}

/// How the client settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Ack,
    Reject { requeue: bool },
    Nack { requeue: bool },
}

impl Verb {
    /// Whether the message goes back to the queue (false for ack and for requeue=false).
    pub fn requeues(self) -> bool {
        matches!(
            self,
            Verb::Reject { requeue: true } | Verb::Nack { requeue: true }
        )
    }

    /// Whether this is a negative settlement (reject or nack).
    pub fn is_negative(self) -> bool {
        !matches!(self, Verb::Ack)
    }
}

/// One native settlement frame to send upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeSettle {
    pub verb: Verb,
    pub tag: u64,
    pub multiple: bool,
}

/// What to do with one client settlement frame.
#[derive(Debug, Default)]
pub struct SettlementPlan {
    /// Forward the client's frame unchanged.
    pub forward_original: bool,
    /// Otherwise, these frames (in order).
    pub native: Vec<NativeSettle>,
    /// Deliveries the proxy takes over (dead-letter or delivery-limit republish), tag order.
    pub taken_over: Vec<(u64, KeptDelivery)>,
    /// Tags the client named that were already pending (settled twice by the client).
    pub already_pending: Vec<u64>,
}

/// Empty slots tolerated in the kept deque beyond twice the kept deliveries before it is
/// compacted.
const EMPTY_SLOTS_SLACK: usize = 64;

/// The kept deque keeps room for this many deliveries (four times as many before it shrinks).
const SHRINK_BELOW: usize = 256;

/// The deliveries of one client channel.
#[derive(Debug, Default)]
pub struct ChannelDeliveries {
    /// Kept deliveries in increasing tag order; `None`: settled, not yet dropped.
    kept: VecDeque<(u64, Option<KeptDelivery>)>,
    /// `Some` slots in `kept`.
    live: usize,
    pending: BTreeSet<u64>,
    kept_bytes: usize,
    /// Deadlines of the kept deliveries that have a consumer timeout.
    deadlines: AckDeadlines,
}

impl ChannelDeliveries {
    /// Adds a delivery; returns the bytes charged.
    pub fn keep(&mut self, tag: u64, delivery: KeptDelivery) -> usize {
        let charge = delivery.charge();
        self.kept_bytes += charge;
        self.live += 1;
        if self.kept.back().is_none_or(|(last, _)| *last < tag) {
            self.kept.push_back((tag, Some(delivery)));
            return charge;
        }
        // Not the upstream's order (a tag seen again): keep the deque sorted.
        match self.kept.binary_search_by_key(&tag, |(t, _)| *t) {
            Ok(at) => {
                if let Some(old) = self.kept[at].1.replace(delivery) {
                    self.live -= 1;
                    self.forget(tag, &old);
                }
            }
            Err(at) => self.kept.insert(at, (tag, Some(delivery))),
        }
        charge
    }

    /// Where `tag`'s slot is.
    fn slot(&self, tag: u64) -> Option<usize> {
        match self.kept.front() {
            Some((first, _)) if *first == tag => Some(0),
            _ => self.kept.binary_search_by_key(&tag, |(t, _)| *t).ok(),
        }
    }

    /// Removes a delivery that left the kept set from the byte count and the deadlines.
    fn forget(&mut self, tag: u64, delivery: &KeptDelivery) {
        self.kept_bytes -= delivery.charge();
        if let Some(deadline) = delivery.deadline {
            self.deadlines.remove(tag, deadline);
        }
    }

    /// Drops empty slots at both ends, and all of them once they outnumber the kept ones.
    fn drop_empty_slots(&mut self) {
        while self.kept.back().is_some_and(|(_, d)| d.is_none()) {
            self.kept.pop_back();
        }
        self.drop_front_slots();
    }

    /// Drops the empty slots at the front, and all of them once they outnumber the kept ones
    /// (all a settlement of the front slot needs: the back is as it was).
    fn drop_front_slots(&mut self) {
        while self.kept.front().is_some_and(|(_, d)| d.is_none()) {
            self.kept.pop_front();
        }
        if self.kept.len() > 2 * self.live + EMPTY_SLOTS_SLACK {
            self.kept.retain(|(_, d)| d.is_some());
        }
        // After a burst, give back most of the room it needed.
        if self.kept.capacity() > 4 * self.kept.len().max(SHRINK_BELOW) {
            self.kept
                .shrink_to(2 * self.kept.len().max(EMPTY_SLOTS_SLACK));
        }
    }

    /// Gives kept delivery `tag`, delivered at `now` (ms), a consumer timeout of `timeout` ms.
    pub fn time(&mut self, tag: u64, now: u64, timeout: u64) {
        let Some(at) = self.slot(tag) else {
            return;
        };
        if let Some(delivery) = self.kept[at].1.as_mut() {
            if let Some(old) = delivery.deadline {
                self.deadlines.remove(tag, old);
            }
            delivery.deadline = Some(self.deadlines.insert(tag, now, timeout));
        }
    }

    /// The earliest delivery unsettled past its consumer timeout at `now` (ms), as
    /// (delivery tag, timeout).
    pub fn overdue(&self, now: u64) -> Option<(u64, u64)> {
        self.deadlines.due(now)
    }

    /// When the next consumer timeout of this channel comes (ms).
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.earliest()
    }

    pub fn kept_len(&self) -> usize {
        self.live
    }

    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes
    }

    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_pending(&self, tag: u64) -> bool {
        self.pending.contains(&tag)
    }

    pub fn get(&self, tag: u64) -> Option<&KeptDelivery> {
        self.kept.get(self.slot(tag)?)?.1.as_ref()
    }

    /// The pending tag is settled upstream (or given up); true if it was pending.
    pub fn finish_pending(&mut self, tag: u64) -> bool {
        self.pending.remove(&tag)
    }

    /// Drops everything (channel closed or recovered); returns (deliveries, bytes) released.
    pub fn clear(&mut self) -> (usize, usize) {
        let released = (self.live, self.kept_bytes);
        self.kept.clear();
        self.live = 0;
        self.pending.clear();
        self.deadlines = AckDeadlines::default();
        self.kept_bytes = 0;
        released
    }

    fn take(&mut self, tag: u64) -> Option<KeptDelivery> {
        // The usual settlement is of the oldest delivery: its slot leaves from the front, and
        // the back stays as it was.
        let at = self.slot(tag)?;
        let oldest = at == 0;
        let delivery = if oldest {
            self.kept.pop_front().and_then(|(_, slot)| slot)?
        } else {
            self.kept[at].1.take()?
        };
        self.live -= 1;
        self.forget(tag, &delivery);
        if oldest {
            self.drop_front_slots();
        } else {
            self.drop_empty_slots();
        }
        Some(delivery)
    }

    /// Releases kept delivery `tag`, acked on its own by the client; the bytes it was charged,
    /// or `None` (nothing changed) when it is not kept. An ack is never taken over, so this
    /// is the plan [`Self::plan_settlement`] would make: forward the client's frame.
    pub fn take_acked(&mut self, tag: u64) -> Option<usize> {
        let before = self.kept_bytes;
        self.take(tag)?;
        Some(before - self.kept_bytes)
    }

    /// Takes every kept delivery with a tag up to `last`, in tag order.
    fn take_through(&mut self, last: u64) -> Vec<(u64, KeptDelivery)> {
        let mut taken = Vec::new();
        while let Some((tag, _)) = self.kept.front()
            && *tag <= last
        {
            let Some((tag, slot)) = self.kept.pop_front() else {
                break;
            };
            if let Some(delivery) = slot {
                self.live -= 1;
                self.forget(tag, &delivery);
                taken.push((tag, delivery));
            }
        }
        self.drop_empty_slots();
        taken
    }

    /// Plans one client settlement. `take_over` decides, per kept delivery, whether the proxy
    /// handles it instead of the upstream. Every named kept delivery (one tag, every tag up to
    /// `tag` with `multiple`, or every tag with `multiple` and tag 0) leaves the kept set; the
    /// taken-over ones become pending. Returns the plan and the bytes released.
    pub fn plan_settlement(
        &mut self,
        verb: Verb,
        tag: u64,
        multiple: bool,
        mut take_over: impl FnMut(&KeptDelivery) -> bool,
    ) -> (SettlementPlan, usize) {
        let mut plan = SettlementPlan::default();
        let before = self.kept_bytes;
        if !multiple {
            match self.take(tag) {
                Some(delivery) if take_over(&delivery) => {
                    self.pending.insert(tag);
                    plan.taken_over.push((tag, delivery));
                }
                // The upstream settles it: the client's frame names exactly this tag.
                Some(_) => plan.forward_original = true,
                None if self.pending.contains(&tag) => plan.already_pending.push(tag),
                // Unknown to the proxy (never kept, e.g. a no-ack delivery): the upstream decides.
                None => plan.forward_original = true,
            }
            return (plan, before - self.kept_bytes);
        }
        let range_end = if tag == 0 { u64::MAX } else { tag };
        let pending_in_range = self.pending.range(..=range_end).next().is_some();
        let mut native_tags = Vec::new();
        for (t, delivery) in self.take_through(range_end) {
            if take_over(&delivery) {
                plan.taken_over.push((t, delivery));
            } else {
                native_tags.push(t);
            }
        }
        let released = before - self.kept_bytes;
        if plan.taken_over.is_empty() && !pending_in_range {
            plan.forward_original = true;
            return (plan, released);
        }
        // The upstream also counts pending and taken-over tags as outstanding: a `multiple` may
        // only cover native tags below the lowest of those.
        let lowest_blocked = plan
            .taken_over
            .first()
            .map(|(t, _)| *t)
            .into_iter()
            .chain(self.pending.iter().next().copied())
            .min();
        for (t, _) in &plan.taken_over {
            self.pending.insert(*t);
        }
        if let Some(&last) = native_tags.last() {
            let covered_by_one = lowest_blocked.is_none_or(|blocked| last < blocked);
            // basic.reject has no `multiple` flag.
            let can_range = !matches!(verb, Verb::Reject { .. });
            if covered_by_one && native_tags.len() > 1 && can_range {
                plan.native.push(NativeSettle {
                    verb,
                    tag: last,
                    multiple: true,
                });
            } else {
                plan.native
                    .extend(native_tags.iter().map(|&t| NativeSettle {
                        verb,
                        tag: t,
                        multiple: false,
                    }));
            }
        }
        (plan, released)
    }
}

#[cfg(test)]
mod tests;
