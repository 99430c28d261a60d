//! Retry tiers in the embedded broker (`x-retry-delays` / policy `retry-delays`): a delivery
//! rejected or nacked with requeue=false on a queue that has them is held in the queue's
//! [`RetryHold`](crate::broker::retry_hold::RetryHold) for its tier's delay instead of being
//! dead-lettered, then put back at the tail of the same queue as a new arrival.
//!
//! The decision and the rewrite (`x-retry-count`, x-death counted as a rejection) are the pure
//! [`retry_after_rejection`]; this file only moves the message. The returned message has
//! exchange "" and the queue's name as routing key (what proxy mode, which republishes it
//! through the default exchange, delivers too), `redelivered` false and a delivery count of 0;
//! it enters the queue like a publish (queue TTL counted again, overflow applied). Due
//! messages are returned by the queue's timer (the hold's earliest due time is part of the
//! queue's deadline in the broker's timer heap), never by a timer of their own.
//!
//! With storage, a held persistent message of a durable queue is one record (the rejected
//! delivery removed, the held message added with its due time) and its return is another (the
//! held message removed, the queued one added), so a crash never loses it.

use std::sync::Arc;

use crate::amqp::content::encode_properties_from;
use crate::broker::message::Message;
use crate::broker::message::QueuedMessage;
use crate::broker::queue::PublishOutcome;
use crate::broker::retry_hold::HeldMessage;
use crate::broker::{Broker, State};
use crate::deadletter::retry::{retry_after_rejection, retry_count};
use crate::deadletter::{DeadLetterReason, DeathEvent};

impl Broker {
    /// A delivery of `queue` rejected with requeue=false: held for its next retry tier when
    /// the queue has tiers left for it (`None`), else given back to be dead-lettered as usual
    /// (counted as `retry_exhausted` when its tiers are used up).
    pub(super) fn hold_for_retry(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        entry: QueuedMessage,
        now: u64,
    ) -> Option<QueuedMessage> {
        let Some(delays) = st
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(queue))
            .and_then(|q| q.settings.retry_delays.clone())
        else {
            return Some(entry);
        };
        let source = &entry.message;
        // Properties that do not decode cannot be rewritten: dead-lettered (or dropped) as
        // any other rejection.
        let Ok(props) = source.properties() else {
            return Some(entry);
        };
        let keys = source.routing_keys_vec();
        let event = DeathEvent {
            queue,
            reason: DeadLetterReason::Rejected,
            exchange: source.exchange(),
            routing_keys: &keys,
            now_secs: self.wall_secs(now),
            trust_existing_history: source.dead_lettered,
        };
        let Some(retry) = retry_after_rejection(&props, &delays, &event, &st.options.dead_letter)
        else {
            if retry_count(&props) >= delays.len() as u64 {
                self.metrics.retry_exhausted(vhost, queue);
            }
            return Some(entry);
        };
        let message = Arc::new(Message::new(
            "",
            &[queue],
            &encode_properties_from(&retry.properties, source.raw_properties()),
            source.body(),
            None,
            true,
        ));
        let due = now.saturating_add(retry.delay_ms);
        let q = st.queue_mut(vhost, queue)?;
        let store_id = self.store_id_for(q, &message);
        let remove = entry.store_id.map(|id| (q.id, id));
        match store_id {
            Some(id) => self.store_held(q.id, id, remove, message.clone(), now, due),
            None => self.store_removed(remove.into_iter().collect()),
        }
        q.retry_hold.hold(due, HeldMessage { message, store_id });
        self.metrics.retried(vhost, queue, retry.tier);
        self.metrics.add_retry_held(vhost, queue, 1);
        self.reschedule(st, vhost, queue);
        None
    }

    /// Puts the held messages of `queue` that are due at `now` back at its tail, earliest
    /// deadline first, and delivers what consumers can take.
    pub(super) fn return_due_retries(&self, st: &mut State, vhost: &str, queue: &str, now: u64) {
        let Some(q) = st.queue_mut(vhost, queue) else {
            return;
        };
        let due = q.retry_hold.take_due(now);
        if due.is_empty() {
            return;
        }
        let queue_id = q.id;
        self.metrics
            .add_retry_held(vhost, queue, -(due.len() as i64));
        let mut deaths = Vec::new();
        for held in due {
            st.persist_targets.clear();
            let message = held.message.clone();
            let outcome = self.enqueue(st, vhost, queue, message, now, true, &mut deaths);
            if outcome == Some(PublishOutcome::Rejected) {
                self.drop_message(st, vhost, queue, "target_full", now, queue);
            }
            let remove = held.store_id.map(|id| (queue_id, id));
            self.store_published(st, held.message, remove, now, false);
        }
        for (q, died) in deaths {
            self.process_deaths(st, vhost, &q, died, now);
        }
        self.dispatch(st, vhost, queue, now);
    }

    /// queue.purge: the held messages are dropped with the ready ones (not dead-lettered).
    pub(super) fn purge_retries(&self, st: &mut State, vhost: &str, queue: &str) {
        let Some(q) = st.queue_mut(vhost, queue) else {
            return;
        };
        let queue_id = q.id;
        let gone = q.retry_hold.take_all();
        if gone.is_empty() {
            return;
        }
        self.metrics
            .add_retry_held(vhost, queue, -(gone.len() as i64));
        self.store_removed(
            gone.iter()
                .filter_map(|h| h.store_id.map(|id| (queue_id, id)))
                .collect(),
        );
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::{AMQPValue, FieldArray};

    use super::super::test_support::{
        Client, bodies, broker, dead_letter_target, declare, long, publish_to, ready, table, text,
    };
    use crate::broker::Broker;
    use crate::deadletter::x_death_entries;

    fn delays(ms: &[i64]) -> AMQPValue {
        AMQPValue::FieldArray(FieldArray::from(
            ms.iter().map(|d| long(*d)).collect::<Vec<_>>(),
        ))
    }

    /// Queue `q` with retry tiers `ms` dead-lettering to `dead`, holding `n` messages taken
    /// with basic.get (delivery tags 1..=n).
    fn taken(ms: &[i64], n: u8) -> (std::sync::Arc<Broker>, Client) {
        let b = broker();
        let c = Client::connect(&b);
        dead_letter_target(&b, c.conn);
        let args = table(&[
            ("x-retry-delays", delays(ms)),
            ("x-dead-letter-exchange", text("dlx")),
        ]);
        b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
        for i in 1..=n {
            publish_to(&b, "q", i.to_string().as_bytes());
        }
        for _ in 0..n {
            b.get(c.conn, 1, "/", "q", false).unwrap();
        }
        c.methods();
        (b, c)
    }

    fn held(b: &Broker) -> usize {
        b.lock().vhosts["/"].queues["q"].retry_hold.len()
    }

    /// Runs the queue's returns as the timer would at `ms` after now.
    fn after(b: &Broker, ms: u64) {
        let now = b.now() + ms;
        let mut st = b.lock();
        b.return_due_retries(&mut st, "/", "q", now);
    }

    fn head_retry_count(b: &Broker) -> Option<AMQPValue> {
        let st = b.lock();
        let head = st.vhosts["/"].queues["q"].state.iter().next()?;
        let props = head.message.properties().ok()?;
        props
            .headers()
            .as_ref()?
            .inner()
            .get("x-retry-count")
            .cloned()
    }

    #[test]
    fn a_rejection_is_held_for_its_tier_then_returned_to_the_tail() {
        let (b, c) = taken(&[1_000, 5_000], 1);
        publish_to(&b, "q", b"later");
        b.reject(c.conn, 1, 1, false, false).unwrap();
        assert_eq!((ready(&b, "q"), held(&b)), (1, 1));
        assert!(bodies(&b, "dead").is_empty());
        let due = b.lock().vhosts["/"].queues["q"].retry_hold.next_due();
        assert!(due.is_some_and(|d| d >= b.now() + 900), "{due:?}");
        assert_eq!(
            b.lock()
                .vhosts
                .get_mut("/")
                .unwrap()
                .queues
                .get_mut("q")
                .unwrap()
                .next_deadline(),
            due
        );
        after(&b, 500);
        assert_eq!(held(&b), 1);
        after(&b, 1_001);
        assert_eq!(held(&b), 0);
        assert_eq!(bodies(&b, "q"), vec![b"later".to_vec(), b"1".to_vec()]);
        let st = b.lock();
        let back = st.vhosts["/"].queues["q"].state.iter().nth(1).unwrap();
        assert_eq!(
            (back.message.exchange(), back.message.routing_key()),
            ("", "q")
        );
        assert!(!back.redelivered);
        assert_eq!(back.delivery_count, 0);
        let props = back.message.properties().unwrap();
        let deaths = x_death_entries(&props);
        assert_eq!(
            (
                deaths[0].queue.as_str(),
                deaths[0].reason.as_str(),
                deaths[0].count
            ),
            ("q", "rejected", 1)
        );
    }

    #[test]
    fn the_last_tier_used_up_dead_letters_with_the_history_and_counts_it() {
        let (b, c) = taken(&[10], 1);
        b.reject(c.conn, 1, 1, false, false).unwrap();
        after(&b, 11);
        assert_eq!(head_retry_count(&b), Some(AMQPValue::LongLongInt(1)));
        b.get(c.conn, 1, "/", "q", false).unwrap();
        b.reject(c.conn, 1, 2, false, false).unwrap();
        assert_eq!((ready(&b, "q"), held(&b)), (0, 0));
        assert_eq!(bodies(&b, "dead"), vec![b"1".to_vec()]);
        let st = b.lock();
        let dead = st.vhosts["/"].queues["dead"].state.iter().next().unwrap();
        let deaths = x_death_entries(&dead.message.properties().unwrap());
        assert_eq!(deaths[0].count, 2, "{deaths:?}");
        let scraped = b.metrics.encode();
        assert!(
            scraped.contains("dlx_proxy_retry_exhausted_total{queue=\"q\",vhost=\"/\"} 1"),
            "{scraped}"
        );
        assert!(
            scraped.contains("dlx_proxy_retries_total{queue=\"q\",tier=\"1\",vhost=\"/\"} 1"),
            "{scraped}"
        );
    }

    #[test]
    fn a_shorter_delay_given_later_comes_back_first() {
        let (b, c) = taken(&[10, 1_000], 2);
        // Message 1 goes round its first tier, then takes the long second one.
        b.reject(c.conn, 1, 1, false, false).unwrap();
        after(&b, 11);
        b.get(c.conn, 1, "/", "q", false).unwrap();
        b.reject(c.conn, 1, 3, false, false).unwrap();
        // Message 2, rejected after it, takes the short first tier.
        b.reject(c.conn, 1, 2, false, false).unwrap();
        assert_eq!(held(&b), 2);
        after(&b, 11);
        assert_eq!(bodies(&b, "q"), vec![b"2".to_vec()]);
        after(&b, 1_001);
        assert_eq!(bodies(&b, "q"), vec![b"2".to_vec(), b"1".to_vec()]);
    }

    #[test]
    fn a_returned_message_meets_the_queue_overflow_like_a_publish() {
        for (overflow, queued, dead) in [
            ("drop-head", vec![b"1".to_vec()], vec![b"2".to_vec()]),
            (
                "reject-publish-dlx",
                vec![b"2".to_vec()],
                vec![b"1".to_vec()],
            ),
            ("reject-publish", vec![b"2".to_vec()], vec![]),
        ] {
            let b = broker();
            let c = Client::connect(&b);
            dead_letter_target(&b, c.conn);
            let args = table(&[
                ("x-retry-delays", delays(&[10])),
                ("x-dead-letter-exchange", text("dlx")),
                ("x-max-length", long(1)),
                ("x-overflow", text(overflow)),
            ]);
            b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
            publish_to(&b, "q", b"1");
            b.get(c.conn, 1, "/", "q", false).unwrap();
            b.reject(c.conn, 1, 1, false, false).unwrap();
            publish_to(&b, "q", b"2");
            after(&b, 11);
            assert_eq!(bodies(&b, "q"), queued, "{overflow}");
            assert_eq!(bodies(&b, "dead"), dead, "{overflow}");
            let dropped = b.metrics.encode().contains(
                "dlx_proxy_dead_letter_dropped_total{cause=\"target_full\",queue=\"q\",vhost=\"/\"} 1",
            );
            assert_eq!(dropped, overflow == "reject-publish", "{overflow}");
        }
    }

    #[test]
    fn purge_drops_held_messages_and_a_queue_without_tiers_dead_letters() {
        let (b, c) = taken(&[1_000], 1);
        b.reject(c.conn, 1, 1, false, false).unwrap();
        assert_eq!(held(&b), 1);
        assert_eq!(b.queue_purge(c.conn, "/", "q").unwrap(), 0);
        assert_eq!(held(&b), 0);
        after(&b, 2_000);
        assert_eq!(ready(&b, "q"), 0);
        let scraped = b.metrics.encode();
        assert!(
            scraped.contains("dlx_proxy_retry_held_messages{queue=\"q\",vhost=\"/\"} 0"),
            "{scraped}"
        );

        let plain = broker();
        let c = Client::connect(&plain);
        dead_letter_target(&plain, c.conn);
        let args = table(&[("x-dead-letter-exchange", text("dlx"))]);
        plain
            .queue_declare(c.conn, "/", &declare("q", &args))
            .unwrap();
        publish_to(&plain, "q", b"1");
        plain.get(c.conn, 1, "/", "q", false).unwrap();
        plain.reject(c.conn, 1, 1, false, false).unwrap();
        assert_eq!(bodies(&plain, "dead"), vec![b"1".to_vec()]);
    }
}
