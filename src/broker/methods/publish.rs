//! basic.publish on the broker: route from the exchange, then enqueue in each target queue
//! (straight to a waiting consumer when the queue is empty, else under the queue's limits).

use std::sync::Arc;

use amq_protocol::types::FieldTable;

use super::deliver::{DeliveryClock, deliver_to, pick_consumer};
use super::{no_exchange, no_vhost};
use crate::amqp::reply::AmqpError;
use crate::broker::ack_timeout::delivery_timeout;
use crate::broker::message::Message;
use crate::broker::queue::{Death, PublishOutcome};
use crate::broker::{Broker, State};
use crate::storage::{Durable, Target};

/// Result of a publish, for confirms and mandatory returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishResult {
    /// At least one queue received the message.
    pub routed: bool,
    /// A queue refused it (reject-publish): the publisher gets basic.nack.
    pub rejected: bool,
}

impl Broker {
    /// Routes a message from `exchange` and enqueues it in every queue it reaches.
    pub fn publish(
        &self,
        vhost: &str,
        exchange: &str,
        message: Arc<Message>,
        headers: Option<&FieldTable>,
    ) -> Result<PublishResult, AmqpError> {
        self.publish_durable(vhost, exchange, message, headers)
            .map(|(result, _)| result)
    }

    /// [`Broker::publish`], and when the message was kept on disk (persistent, routed to
    /// durable queues), the answer of storage once it is stable: the publisher's confirm
    /// waits for it.
    pub fn publish_durable(
        &self,
        vhost: &str,
        exchange: &str,
        message: Arc<Message>,
        headers: Option<&FieldTable>,
    ) -> Result<(PublishResult, Option<Durable>), AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let v = st.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        match v.exchanges.get(exchange) {
            None => return Err(no_exchange(exchange, vhost)),
            Some(x) if x.internal => {
                return Err(AmqpError::access_refused(format!(
                    "cannot publish to internal exchange '{exchange}' in vhost '{vhost}'"
                )));
            }
            Some(_) => {}
        }
        let keys: Vec<&str> = message.routing_keys().collect();
        let targets = v.route(exchange, &keys, headers);
        let mut result = PublishResult {
            routed: !targets.is_empty(),
            rejected: false,
        };
        let mut deaths = Vec::new();
        st.persist_targets.clear();
        for q in &targets {
            if self
                .enqueue(&mut st, vhost, q, message.clone(), now, false, &mut deaths)
                .is_some_and(PublishOutcome::is_rejected)
            {
                result.rejected = true;
            }
        }
        let durable = self.store_published(&mut st, message, None, now, true);
        self.metrics.published(1);
        for (q, d) in deaths {
            self.process_deaths(&mut st, vhost, &q, d, now);
        }
        for q in &targets {
            self.reschedule(&mut st, vhost, q);
            self.update_depth(&mut st, vhost, q);
        }
        Ok((result, durable))
    }

    /// Puts a message into one queue: straight to a waiting consumer when the queue is empty,
    /// else at the tail under the queue's limits. A message kept on disk gets its id here and
    /// the queue is added to `st.persist_targets` (the caller writes the record). `moved`: the
    /// message is moved from a stored source (a dead letter, a retry coming back, a redrive),
    /// so a copy a reject-publish-dlx queue refuses is stored there too (see below).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn enqueue(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        message: Arc<Message>,
        now: u64,
        moved: bool,
        deaths: &mut Vec<(String, Vec<Death>)>,
    ) -> Option<PublishOutcome> {
        let State {
            vhosts,
            channels,
            connections,
            persist_targets,
            options,
            ..
        } = &mut *st;
        let q = vhosts.get_mut(vhost)?.queues.get_mut(queue)?;
        let store_id = self.store_id_for(q, &message);
        let mut entry = q.state.admit(message, now);
        entry.store_id = store_id;
        let queue_id = q.id;
        let target = |delivered| Target {
            queue: queue_id,
            id: store_id.unwrap_or_default(),
            delivered,
        };
        // As RabbitMQ: reject-publish(-dlx) refuses first; otherwise a waiting consumer gets
        // the message before drop-head or TTL look at it (even with x-max-length = 0).
        if q.state.is_empty()
            && !q.consumers.is_empty()
            && !q.state.refuses(&entry)
            && let Some(idx) = pick_consumer(q, channels, connections)
        {
            // Kept only while a consumer must still settle it.
            if store_id.is_some() && q.consumers.get(idx).is_some_and(|c| !c.no_ack) {
                persist_targets.push(target(true));
            }
            let mut timed = Vec::new();
            let mut clock = DeliveryClock {
                now,
                timeout: delivery_timeout(options.consumer_timeout, q.settings.consumer_timeout),
                timed: &mut timed,
            };
            deliver_to(
                q,
                idx,
                entry,
                channels,
                connections,
                &self.metrics,
                None,
                &mut clock,
            );
            self.metrics.delivered(1);
            for (conn, channel) in timed {
                if st.schedule_ack(conn, channel) {
                    self.wake_timers();
                }
            }
            return Some(PublishOutcome::Accepted);
        }
        let mut died = Vec::new();
        let kept = target(false);
        let outcome = q.state.publish(entry, now, &mut died);
        // A message moved from a stored source (`moved`) that a reject-publish-dlx target
        // refuses is stored in that target too: the record that takes it out of its source
        // then puts it somewhere, and the refused copy's own death (queued in `deaths`) moves
        // it on in a record of its own. Without it a crash between the two records lost it.
        // A client's publish is nacked instead, so its refused copy is not stored.
        let refused_move = moved && outcome == PublishOutcome::RejectedDeadLettered;
        if store_id.is_some() && (outcome == PublishOutcome::Accepted || refused_move) {
            persist_targets.push(kept);
        }
        if !died.is_empty() {
            deaths.push((queue.to_string(), died));
        }
        Some(outcome)
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::{AMQPClass, basic};
    use amq_protocol::types::FieldTable;

    use super::super::test_support::{
        Client, bodies, broker, dead_letter_target, declare, exchange, long, message, publish_to,
        ready, table, text, with_queue,
    };
    use crate::amqp::reply;

    #[test]
    fn unroutable_and_missing_or_internal_exchanges() {
        let b = broker();
        let none = FieldTable::default();
        let result = publish_to(&b, "nowhere", b"1");
        assert!(!result.routed && !result.rejected);
        let err = b
            .publish("/", "nope", message("nope", "k", b""), None)
            .unwrap_err();
        assert_eq!(err.text, "NOT_FOUND - no exchange 'nope' in vhost '/'");
        let mut internal = exchange("inside", "fanout", &none);
        internal.internal = true;
        b.exchange_declare("/", &internal).unwrap();
        let err = b
            .publish("/", "inside", message("inside", "", b""), None)
            .unwrap_err();
        assert_eq!(err.code, reply::ACCESS_REFUSED);
        assert_eq!(
            err.text,
            "ACCESS_REFUSED - cannot publish to internal exchange 'inside' in vhost '/'"
        );
    }

    #[test]
    fn reject_publish_refuses_the_message_over_the_limit() {
        let b = broker();
        let c = Client::connect(&b);
        let args = table(&[
            ("x-max-length", long(1)),
            ("x-overflow", text("reject-publish")),
        ]);
        b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
        let first = publish_to(&b, "q", b"1");
        assert!(first.routed && !first.rejected);
        let second = publish_to(&b, "q", b"2");
        assert!(second.routed && second.rejected);
        assert_eq!(bodies(&b, "q"), vec![b"1".to_vec()]);
    }

    #[test]
    fn drop_head_dead_letters_the_oldest_message() {
        let b = broker();
        let c = Client::connect(&b);
        dead_letter_target(&b, c.conn);
        let args = table(&[
            ("x-max-length", long(1)),
            ("x-dead-letter-exchange", text("dlx")),
        ]);
        b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
        publish_to(&b, "q", b"1");
        let second = publish_to(&b, "q", b"2");
        assert!(second.routed && !second.rejected);
        assert_eq!(bodies(&b, "q"), vec![b"2".to_vec()]);
        assert_eq!(bodies(&b, "dead"), vec![b"1".to_vec()]);
    }

    #[test]
    fn a_waiting_consumer_gets_the_message_without_queueing() {
        let (b, c) = with_queue(&FieldTable::default(), &[]);
        b.consume(c.conn, 1, "/", "q", "t", true, false, 0, true)
            .unwrap();
        publish_to(&b, "q", b"1");
        assert_eq!(ready(&b, "q"), 0);
        let sent = c.methods();
        assert!(
            matches!(&sent[..], [(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(d)))] if d.delivery_tag == 1 && d.routing_key.as_str() == "q"),
            "{sent:?}"
        );
    }
}
