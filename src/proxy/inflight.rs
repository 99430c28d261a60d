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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::broker::ack_timeout::{AckDeadlines, Deadline};

/// Bytes charged per kept delivery on top of its properties and body.
pub const KEPT_OVERHEAD: usize = 128;

/// A delivery the client has not settled yet.
#[derive(Clone, Debug)]
pub struct KeptDelivery {
    /// The queue it came from.
    pub queue: Arc<str>,
    pub exchange: String,
    pub routing_key: String,
    pub redelivered: bool,
    /// The property section exactly as delivered (empty without content).
    pub raw_properties: Bytes,
    pub body: Bytes,
    /// Whether properties and body were kept; without them the proxy cannot take the
    /// delivery over and settles it natively.
    pub with_content: bool,
    /// When the proxy saw the delivery.
    pub received_at: Instant,
    /// When it times out unsettled (its consumer timeout), in the session's milliseconds.
    pub deadline: Option<Deadline>,
}

impl KeptDelivery {
    /// Bytes charged against `proxy.max_inflight_bytes`.
    pub fn charge(&self) -> usize {
        self.raw_properties.len()
            + self.body.len()
            + self.exchange.len()
            + self.routing_key.len()
            + KEPT_OVERHEAD
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

/// The deliveries of one client channel.
#[derive(Debug, Default)]
pub struct ChannelDeliveries {
    kept: BTreeMap<u64, KeptDelivery>,
    pending: BTreeSet<u64>,
    kept_bytes: usize,
    /// Deadlines of the kept deliveries that have a consumer timeout.
    deadlines: AckDeadlines,
}

impl ChannelDeliveries {
    /// Adds a delivery; returns the bytes charged.
    pub fn keep(&mut self, tag: u64, delivery: KeptDelivery) -> usize {
        let charge = delivery.charge();
        if let Some(old) = self.kept.insert(tag, delivery) {
            self.kept_bytes -= old.charge();
            if let Some(deadline) = old.deadline {
                self.deadlines.remove(tag, deadline);
            }
        }
        self.kept_bytes += charge;
        charge
    }

    /// Gives kept delivery `tag`, delivered at `now` (ms), a consumer timeout of `timeout` ms.
    pub fn time(&mut self, tag: u64, now: u64, timeout: u64) {
        if let Some(delivery) = self.kept.get_mut(&tag) {
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
        self.kept.len()
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
        self.kept.get(&tag)
    }

    /// The pending tag is settled upstream (or given up); true if it was pending.
    pub fn finish_pending(&mut self, tag: u64) -> bool {
        self.pending.remove(&tag)
    }

    /// Drops everything (channel closed or recovered); returns (deliveries, bytes) released.
    pub fn clear(&mut self) -> (usize, usize) {
        let released = (self.kept.len(), self.kept_bytes);
        self.kept.clear();
        self.pending.clear();
        self.deadlines = AckDeadlines::default();
        self.kept_bytes = 0;
        released
    }

    fn take(&mut self, tag: u64) -> Option<KeptDelivery> {
        let delivery = self.kept.remove(&tag)?;
        self.kept_bytes -= delivery.charge();
        if let Some(deadline) = delivery.deadline {
            self.deadlines.remove(tag, deadline);
        }
        Some(delivery)
    }

    /// The kept tags a client settlement names: one tag, every tag up to `tag`, or every tag
    /// (`multiple` with tag 0).
    fn named_tags(&self, tag: u64, multiple: bool) -> Vec<u64> {
        if !multiple {
            return if self.kept.contains_key(&tag) {
                vec![tag]
            } else {
                Vec::new()
            };
        }
        if tag == 0 {
            self.kept.keys().copied().collect()
        } else {
            self.kept.range(..=tag).map(|(t, _)| *t).collect()
        }
    }

    /// Plans one client settlement. `take_over` decides, per kept delivery, whether the proxy
    /// handles it instead of the upstream. Every named kept delivery leaves the kept set; the
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
        let named = self.named_tags(tag, multiple);
        if !multiple && named.is_empty() {
            if self.pending.contains(&tag) {
                plan.already_pending.push(tag);
            } else {
                // Unknown to the proxy (never kept, e.g. a no-ack delivery): the upstream decides.
                plan.forward_original = true;
            }
            return (plan, 0);
        }
        let range_end = if multiple && tag == 0 { u64::MAX } else { tag };
        let pending_in_range = self.pending.range(..=range_end).next().is_some();
        let mut native_tags = Vec::with_capacity(named.len());
        for t in named {
            let Some(delivery) = self.take(t) else {
                continue;
            };
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
