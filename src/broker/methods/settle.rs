//! Settling deliveries: basic.ack, basic.reject/nack (requeue, hold for a retry tier, or
//! dead-letter as `rejected`) and basic.recover. Each delivery leaves its channel exactly once and frees its queue's and
//! consumer's unacked counters then.

use std::collections::BTreeMap;

use super::unknown_tag;
use crate::amqp::reply::AmqpError;
use crate::broker::queue::Death;
use crate::broker::{Broker, State, Unacked};
use crate::deadletter::DeadLetterReason;

impl Broker {
    /// Removes the deliveries a settlement covers, in delivery-tag order.
    pub(super) fn take_unacked(
        &self,
        st: &mut State,
        conn: u64,
        channel: u16,
        tag: u64,
        multiple: bool,
    ) -> Result<(String, Vec<Unacked>), AmqpError> {
        let ch = st
            .channels
            .get_mut(&(conn, channel))
            .ok_or_else(|| AmqpError::channel_error("channel is not open"))?;
        let vhost = ch.vhost.clone();
        let taken: Vec<(u64, Unacked)> = if multiple {
            if tag == 0 {
                std::mem::take(&mut ch.unacked).into_iter().collect()
            } else {
                if !ch.unacked.contains_key(&tag) {
                    return Err(unknown_tag(tag));
                }
                let rest = ch.unacked.split_off(&(tag + 1));
                std::mem::replace(&mut ch.unacked, rest)
                    .into_iter()
                    .collect()
            }
        } else {
            match ch.unacked.remove(&tag) {
                Some(u) => vec![(tag, u)],
                None => return Err(unknown_tag(tag)),
            }
        };
        let taken: Vec<Unacked> = taken
            .into_iter()
            .map(|(tag, u)| {
                if let Some(deadline) = u.deadline {
                    ch.ack_deadlines.remove(tag, deadline);
                }
                u
            })
            .collect();
        self.release_counters(st, &vhost, &taken);
        Ok((vhost, taken))
    }

    /// Frees the queue's and the consumer's unacked counters of deliveries leaving a channel
    /// (settled, requeued or returned on close). Called exactly once per delivery.
    pub(super) fn release_counters(&self, st: &mut State, vhost: &str, taken: &[Unacked]) {
        let bytes: u64 = taken.iter().map(|u| u.entry.body_len()).sum();
        self.metrics
            .add_inflight(-(taken.len() as i64), -(bytes as i64));
        for u in taken {
            if let Some(q) = st
                .vhosts
                .get_mut(vhost)
                .and_then(|v| v.queues.get_mut(&*u.queue))
                .filter(|q| q.id == u.queue_id)
            {
                q.unacked = q.unacked.saturating_sub(1);
                if let Some(id) = u.consumer
                    && let Some(c) = q.consumers.iter_mut().find(|c| c.id == id)
                {
                    c.unacked = c.unacked.saturating_sub(1);
                }
            }
        }
    }

    pub(super) fn queues_of(taken: &[Unacked]) -> Vec<String> {
        let mut qs: Vec<String> = taken.iter().map(|u| u.queue.to_string()).collect();
        qs.sort();
        qs.dedup();
        qs
    }

    pub fn ack(&self, conn: u64, channel: u16, tag: u64, multiple: bool) -> Result<(), AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let (vhost, taken) = self.take_unacked(&mut st, conn, channel, tag, multiple)?;
        self.metrics.acked(taken.len() as u64);
        self.store_removed(
            taken
                .iter()
                .filter_map(|u| u.entry.store_id.map(|id| (u.queue_id, id)))
                .collect(),
        );
        let mut queues = Self::queues_of(&taken);
        add_channel_limited(&st, conn, channel, &mut queues);
        for q in queues {
            self.dispatch(&mut st, &vhost, &q, now);
        }
        Ok(())
    }

    /// basic.reject / basic.nack: requeue, or dead-letter with reason `rejected`.
    pub fn reject(
        &self,
        conn: u64,
        channel: u16,
        tag: u64,
        multiple: bool,
        requeue: bool,
    ) -> Result<(), AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let (vhost, taken) = self.take_unacked(&mut st, conn, channel, tag, multiple)?;
        let mut queues = Self::queues_of(&taken);
        if requeue {
            self.requeue_unacked(&mut st, &vhost, taken, now);
            queues.clear();
            add_channel_limited(&st, conn, channel, &mut queues);
            for q in &queues {
                self.dispatch(&mut st, &vhost, q, now);
            }
        } else {
            add_channel_limited(&st, conn, channel, &mut queues);
            let mut by_queue: Vec<(String, Vec<Death>)> = Vec::new();
            for u in taken {
                let still_there = st
                    .vhosts
                    .get(&vhost)
                    .and_then(|v| v.queues.get(&*u.queue))
                    .is_some_and(|q| q.id == u.queue_id);
                if !still_there {
                    continue;
                }
                // Retry tiers: held for the next delay instead of dead-lettered.
                let Some(entry) = self.hold_for_retry(&mut st, &vhost, &u.queue, u.entry, now)
                else {
                    continue;
                };
                let death = Death {
                    entry,
                    reason: DeadLetterReason::Rejected,
                };
                match by_queue.last_mut() {
                    Some((q, list)) if **q == *u.queue => list.push(death),
                    _ => by_queue.push((u.queue.to_string(), vec![death])),
                }
            }
            for (q, deaths) in by_queue {
                self.process_deaths(&mut st, &vhost, &q, deaths, now);
            }
            for q in &queues {
                self.dispatch(&mut st, &vhost, q, now);
            }
        }
        Ok(())
    }

    /// basic.recover: every unacked delivery of the channel goes back to its queue.
    pub fn recover(&self, conn: u64, channel: u16) -> Result<(), AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let (vhost, taken) = self.take_unacked(&mut st, conn, channel, 0, true)?;
        self.requeue_unacked(&mut st, &vhost, taken, now);
        let mut queues = Vec::new();
        add_channel_limited(&st, conn, channel, &mut queues);
        for q in &queues {
            self.dispatch(&mut st, &vhost, q, now);
        }
        Ok(())
    }

    /// Returns deliveries to their queues (grouped per queue, original order kept). Their
    /// unacked counters must already be released ([`Self::release_counters`]).
    pub(super) fn requeue_unacked(
        &self,
        st: &mut State,
        vhost: &str,
        taken: Vec<Unacked>,
        now: u64,
    ) {
        let mut by_queue: BTreeMap<String, Vec<Unacked>> = BTreeMap::new();
        for u in taken {
            by_queue.entry(u.queue.to_string()).or_default().push(u);
        }
        for (qname, list) in by_queue {
            let mut deaths = Vec::new();
            {
                let Some(q) = st.queue_mut(vhost, &qname) else {
                    continue;
                };
                let mut entries = Vec::new();
                for u in list {
                    if u.queue_id != q.id {
                        continue;
                    }
                    entries.push(u.entry);
                }
                q.state.requeue(entries, now, &mut deaths);
            }
            if !deaths.is_empty() {
                self.process_deaths(st, vhost, &qname, deaths, now);
            }
            self.dispatch(st, vhost, &qname, now);
        }
    }
}

/// Adds to `queues` (sorted, without duplicates, as [`Broker::queues_of`] gives them) the
/// queues the consumers of `(conn, channel)` consume when the channel has a channel-wide
/// prefetch (basic.qos global): a
/// settlement frees room under that limit for the channel's consumers on every queue, not
/// only on the queues of the deliveries settled.
fn add_channel_limited(st: &State, conn: u64, channel: u16, queues: &mut Vec<String>) {
    if let Some(ch) = st
        .channels
        .get(&(conn, channel))
        .filter(|ch| ch.channel_prefetch > 0)
    {
        queues.extend(ch.consumers.values().cloned());
        queues.sort();
        queues.dedup();
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::{AMQPClass, basic};
    use amq_protocol::types::{AMQPValue, FieldTable};

    use super::super::test_support::{
        Client, bodies, broker, dead_letter_target, declare, publish_to, ready, table, text,
    };
    use crate::amqp::content::decode_properties;
    use crate::amqp::reply;

    /// Declares `q` with `args`, publishes `n` messages ("1", "2", ...) and takes them all
    /// with basic.get (unacked on channel 1, tags 1..=n).
    fn taken(b: &crate::broker::Broker, c: &Client, args: &FieldTable, n: u8) {
        b.queue_declare(c.conn, "/", &declare("q", args)).unwrap();
        for i in 1..=n {
            publish_to(b, "q", (i.to_string()).as_bytes());
        }
        for _ in 0..n {
            b.get(c.conn, 1, "/", "q", false).unwrap();
        }
        c.methods();
    }

    fn unacked_tags(b: &crate::broker::Broker, c: &Client) -> Vec<u64> {
        b.lock().channels[&(c.conn, 1)]
            .unacked
            .keys()
            .copied()
            .collect()
    }

    #[test]
    fn unknown_tags_are_refused_and_multiple_acks_up_to_the_tag() {
        let b = broker();
        let c = Client::connect(&b);
        taken(&b, &c, &FieldTable::default(), 3);
        let err = b.ack(c.conn, 1, 5, false).unwrap_err();
        assert_eq!(err.code, reply::PRECONDITION_FAILED);
        assert_eq!(err.text, "PRECONDITION_FAILED - unknown delivery tag 5");
        b.ack(c.conn, 1, 2, true).unwrap();
        assert_eq!(unacked_tags(&b, &c), vec![3]);
        let err = b.ack(c.conn, 1, 2, false).unwrap_err();
        assert_eq!(err.text, "PRECONDITION_FAILED - unknown delivery tag 2");
        b.ack(c.conn, 1, 0, true).unwrap();
        assert!(unacked_tags(&b, &c).is_empty());
    }

    #[test]
    fn a_requeued_delivery_goes_back_to_its_place_marked_redelivered() {
        let b = broker();
        let c = Client::connect(&b);
        taken(&b, &c, &FieldTable::default(), 2);
        b.reject(c.conn, 1, 1, false, true).unwrap();
        assert_eq!(bodies(&b, "q"), vec![b"1".to_vec()]);
        b.get(c.conn, 1, "/", "q", false).unwrap();
        let sent = c.methods();
        assert!(
            matches!(&sent[..], [(1, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)))] if ok.redelivered && ok.delivery_tag == 3),
            "{sent:?}"
        );
    }

    #[test]
    fn a_rejection_without_requeue_is_dead_lettered_as_rejected() {
        let b = broker();
        let c = Client::connect(&b);
        dead_letter_target(&b, c.conn);
        taken(
            &b,
            &c,
            &table(&[("x-dead-letter-exchange", text("dlx"))]),
            2,
        );
        b.reject(c.conn, 1, 2, true, false).unwrap();
        assert_eq!(ready(&b, "q"), 0);
        assert_eq!(bodies(&b, "dead"), vec![b"1".to_vec(), b"2".to_vec()]);
        let st = b.lock();
        let head = st.vhosts["/"].queues["dead"].state.iter().next().unwrap();
        let props = decode_properties(head.message.raw_properties()).unwrap();
        let headers = props.headers().clone().unwrap();
        let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
            panic!("no x-death in {headers:?}");
        };
        let Some(AMQPValue::FieldTable(death)) = deaths.as_slice().first() else {
            panic!("empty x-death");
        };
        assert_eq!(death.inner().get("reason"), Some(&text("rejected")));
        assert_eq!(death.inner().get("queue"), Some(&text("q")));
    }

    #[test]
    fn without_a_dead_letter_exchange_a_rejected_message_is_discarded() {
        let b = broker();
        let c = Client::connect(&b);
        taken(&b, &c, &FieldTable::default(), 1);
        b.reject(c.conn, 1, 1, false, false).unwrap();
        assert_eq!(ready(&b, "q"), 0);
        assert!(unacked_tags(&b, &c).is_empty());
    }

    #[test]
    fn recover_returns_every_unacked_delivery_in_order() {
        let b = broker();
        let c = Client::connect(&b);
        taken(&b, &c, &FieldTable::default(), 3);
        b.recover(c.conn, 1).unwrap();
        assert_eq!(
            bodies(&b, "q"),
            vec![b"1".to_vec(), b"2".to_vec(), b"3".to_vec()]
        );
        assert!(unacked_tags(&b, &c).is_empty());
    }
}
