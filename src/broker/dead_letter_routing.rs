//! Dead-letter routing inside the embedded broker: takes the [`Death`]s a queue produced,
//! rewrites each message with the pure rules of [`crate::deadletter`] (which knows nothing of
//! exchanges or queues), routes it through the queue's dead-letter exchange and enqueues it in
//! every target that is not a cycle.
//!
//! Targets can overflow or expire in turn, so deaths are processed from a work list rather
//! than by recursion. Every message that is not delivered anywhere is counted by cause
//! (`no_dlx`, `unroutable`, `cycle`, `hop_limit`, `target_full`) and logged once per queue per
//! minute.

use std::sync::Arc;

use super::message::Message;
use super::queue::{Death, PublishOutcome};
use super::{Broker, State};
use crate::amqp::content::encode_properties_from;
use crate::deadletter::{CycleQueues, DeadLetterDrop, DeadLetterTarget, DeathEvent, dead_letter};

impl Broker {
    /// Dead-letters `deaths` that left `queue` (and whatever that causes downstream).
    pub(crate) fn process_deaths(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        deaths: Vec<Death>,
        now: u64,
    ) {
        // First in, first out: a target that sheds or expires what it got dead-letters it
        // in the order it died, as each of RabbitMQ's queues does (a stack would reverse the
        // deaths of one batch, say the drop-heads a multiple nack causes downstream).
        let mut work: Vec<(String, Vec<Death>)> = vec![(queue.to_string(), deaths)];
        let mut touched: Vec<String> = Vec::new();
        let mut next = 0;
        while let Some(item) = work.get_mut(next) {
            let (source, list) = std::mem::take(item);
            next += 1;
            for death in list {
                self.dead_letter_one(st, vhost, &source, death, now, &mut work, &mut touched);
            }
        }
        touched.sort();
        touched.dedup();
        for q in touched {
            self.dispatch(st, vhost, &q, now);
        }
    }

    /// Dead-letters one message and writes its storage record: one record that takes it
    /// out of its source and puts the rewritten message in its durable targets (or only
    /// takes it out, when it is dropped or reaches no durable queue).
    #[allow(clippy::too_many_arguments)]
    fn dead_letter_one(
        &self,
        st: &mut State,
        vhost: &str,
        source: &str,
        death: Death,
        now: u64,
        work: &mut Vec<(String, Vec<Death>)>,
        touched: &mut Vec<String>,
    ) {
        let remove = death.entry.store_id.and_then(|id| {
            let q = st.vhosts.get(vhost)?.queues.get(source)?;
            Some((q.id, id))
        });
        st.persist_targets.clear();
        match self.route_dead_letter(st, vhost, source, death, now, work, touched) {
            Some(message) => {
                self.store_published(st, message, remove, now, false);
            }
            None => {
                st.persist_targets.clear();
                self.store_removed(remove.into_iter().collect());
            }
        }
    }

    /// Rewrites and routes one dead message; returns the rewritten message when it was
    /// enqueued somewhere.
    #[allow(clippy::too_many_arguments)]
    fn route_dead_letter(
        &self,
        st: &mut State,
        vhost: &str,
        source: &str,
        death: Death,
        now: u64,
        work: &mut Vec<(String, Vec<Death>)>,
        touched: &mut Vec<String>,
    ) -> Option<Arc<Message>> {
        let reason = death.reason;
        self.metrics.dead_lettered(vhost, source, reason.as_str());
        self.metrics
            .observe_message_age_at_dead_letter(std::time::Duration::from_millis(
                now.saturating_sub(death.entry.enqueued_at),
            ));
        let settings = st
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(source))
            .map(|q| q.settings.clone())?;
        // No dead-letter exchange configured: the message is discarded, as RabbitMQ does.
        let dlx = settings.dead_letter_exchange.as_deref()?;
        let exists = st
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.exchanges.contains_key(dlx));
        if !exists {
            self.drop_message(st, vhost, source, "no_dlx", now, dlx);
            return None;
        }
        let message = &death.entry.message;
        let Ok(props) = message.properties() else {
            self.drop_message(st, vhost, source, "unroutable", now, dlx);
            return None;
        };
        let routing_keys = message.routing_keys_vec();
        let event = DeathEvent {
            queue: source,
            reason,
            exchange: message.exchange(),
            routing_keys: &routing_keys,
            now_secs: self.wall_secs(now),
            trust_existing_history: message.dead_lettered,
        };
        let target = DeadLetterTarget {
            exchange: dlx,
            routing_key: settings.dead_letter_routing_key.as_deref(),
        };
        let rewritten = match dead_letter(&props, &event, &target, &st.options.dead_letter) {
            Ok(m) => m,
            Err(DeadLetterDrop::HopLimit) => {
                self.drop_message(st, vhost, source, "hop_limit", now, dlx);
                return None;
            }
        };
        let keys: Vec<&str> = rewritten.routing_keys.iter().map(|k| k.as_str()).collect();
        let targets = match st.vhosts.get(vhost) {
            Some(v) => v.route(dlx, &keys, rewritten.properties.headers().as_ref()),
            None => Vec::new(),
        };
        if targets.is_empty() {
            self.drop_message(st, vhost, source, "unroutable", now, dlx);
            return None;
        }
        let new_message = Arc::new(Message::new(
            &rewritten.exchange,
            &rewritten.routing_keys,
            &encode_properties_from(&rewritten.properties, message.raw_properties()),
            message.body(),
            None,
            true,
        ));
        let mut delivered = false;
        let cycles = CycleQueues::of(reason, &rewritten.properties);
        for t in &targets {
            if cycles.contains(t) {
                self.drop_message(st, vhost, source, "cycle", now, t);
                continue;
            }
            match self.enqueue(st, vhost, t, new_message.clone(), now, true, work) {
                Some(PublishOutcome::Accepted) => {
                    delivered = true;
                    touched.push(t.clone());
                }
                Some(PublishOutcome::Rejected) => {
                    self.drop_message(st, vhost, source, "target_full", now, t);
                }
                // Not dropped: the target's reject-publish-dlx dead-letters it onward (the
                // death is queued in `work` and counted there).
                Some(PublishOutcome::RejectedDeadLettered) => {}
                None => {}
            }
        }
        if delivered {
            let latency = now.saturating_sub(death_time(&death, now));
            self.metrics
                .observe_dead_letter_latency(std::time::Duration::from_millis(latency));
        }
        Some(new_message)
    }

    /// Counts a message that is delivered nowhere (by `cause`) and logs it once a minute.
    pub(crate) fn drop_message(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        cause: &'static str,
        now: u64,
        detail: &str,
    ) {
        self.metrics.dropped(vhost, queue, cause);
        if st.should_log_drop(vhost, queue, cause, now) {
            tracing::warn!(
                vhost,
                queue,
                cause,
                detail,
                "dead-lettered message dropped (logged once a minute per queue and cause)"
            );
        }
    }
}

/// When the death happened: the expiry deadline for expired messages, else now.
fn death_time(death: &Death, now: u64) -> u64 {
    match death.reason {
        crate::deadletter::DeadLetterReason::Expired => {
            death.entry.expires_at.unwrap_or(now).min(now)
        }
        _ => now,
    }
}
