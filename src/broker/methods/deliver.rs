//! Getting messages to clients: basic.consume/cancel/qos, basic.get, and the dispatcher that
//! hands ready messages to consumers with capacity (round robin, prefetch, channel flow and the
//! write queue's budget respected), recording each as unacked on its channel.

use amq_protocol::protocol::{AMQPClass, basic};

use super::{check_exclusive, no_queue, no_vhost};
use crate::amqp::codec::put_method;
use crate::amqp::reply::AmqpError;
use crate::broker::ack_timeout::delivery_timeout;
use crate::broker::delivery::{delivery_properties, short, write_deliver, write_get_ok};
use crate::broker::vhost::{Consumer, Queue};
use crate::broker::{Broker, ChannelState, ConnectionState, State, Unacked};
use crate::storage::{Record, Storage};

/// Picks the next consumer of `q` that can take a delivery now: of those with the highest
/// `x-priority`, the next in round-robin order (a lower priority gets messages only while
/// every higher one is blocked, as RabbitMQ's consumer priorities); with
/// `x-single-active-consumer` only the earliest registered consumer still there, whatever its
/// priority (as RabbitMQ 3.10 does).
pub(super) fn pick_consumer(
    q: &Queue,
    channels: &std::collections::HashMap<(u64, u16), ChannelState>,
    connections: &std::collections::HashMap<u64, ConnectionState>,
) -> Option<usize> {
    let single = q.args.single_active_consumer;
    let n = if single {
        q.consumers.len().min(1)
    } else {
        q.consumers.len()
    };
    let mut best: Option<(usize, i32)> = None;
    for i in 0..n {
        let idx = if single { 0 } else { (q.next_consumer + i) % n };
        let c = &q.consumers[idx];
        if best.is_some_and(|(_, priority)| priority >= c.priority) {
            continue;
        }
        let Some(ch) = channels.get(&(c.conn, c.channel)) else {
            continue;
        };
        if !ch.active {
            continue;
        }
        let Some(conn) = connections.get(&c.conn) else {
            continue;
        };
        if conn.write_queue.is_full_marking_starved() {
            continue;
        }
        if !c.no_ack {
            if c.prefetch > 0 && c.unacked >= c.prefetch as u32 {
                continue;
            }
            if ch.channel_prefetch > 0 && ch.unacked.len() >= ch.channel_prefetch as usize {
                continue;
            }
        }
        if c.priority >= q.top_priority {
            return Some(idx);
        }
        best = Some((idx, c.priority));
    }
    best.map(|(idx, _)| idx)
}

/// Where a delivery goes and what it is timed against: `timeout` is its consumer timeout
/// (ms), `now` the delivery time; channels that got a deadline are added to `timed` (to be
/// scheduled with [`State::schedule_ack`]).
pub(super) struct DeliveryClock<'a> {
    pub now: u64,
    pub timeout: Option<u64>,
    pub timed: &'a mut Vec<(u64, u16)>,
}

/// Writes one delivery to consumer `idx` of `q` and records it as unacked. A message kept on
/// disk gets its record through `storage`: removed (no-ack) or delivered.
#[allow(clippy::too_many_arguments)]
pub(super) fn deliver_to(
    q: &mut Queue,
    idx: usize,
    entry: crate::broker::message::QueuedMessage,
    channels: &mut std::collections::HashMap<(u64, u16), ChannelState>,
    connections: &std::collections::HashMap<u64, ConnectionState>,
    metrics: &crate::metrics::Metrics,
    storage: Option<&Storage>,
    clock: &mut DeliveryClock<'_>,
) -> bool {
    let with_count = q.counts_deliveries() && entry.delivery_count > 0;
    let queue_name = q.shared_name.clone();
    let queue_id = q.id;
    let Some(c) = q.consumers.get_mut(idx) else {
        return false;
    };
    let (Some(ch), Some(conn)) = (
        channels.get_mut(&(c.conn, c.channel)),
        connections.get(&c.conn),
    ) else {
        return false;
    };
    let tag = ch.next_tag;
    ch.next_tag += 1;
    let rewritten = delivery_properties(&entry, with_count);
    let props = rewritten
        .as_deref()
        .unwrap_or_else(|| entry.message.raw_properties());
    let frame_max = conn.frame_max;
    conn.write_queue.push(|out| {
        write_deliver(out, c.channel, &c.tag, tag, &entry, props, frame_max);
    });
    if let (Some(storage), Some(id)) = (storage, entry.store_id) {
        storage.append(settle_record(queue_id, id, c.no_ack));
    }
    if !c.no_ack {
        c.unacked += 1;
        metrics.add_inflight(1, entry.body_len() as i64);
        let deadline = clock.timeout.map(|timeout| {
            clock.timed.push((c.conn, c.channel));
            ch.ack_deadlines.insert(tag, clock.now, timeout)
        });
        ch.unacked.insert(
            tag,
            Unacked {
                queue: queue_name,
                queue_id,
                entry,
                consumer: Some(c.id),
                deadline,
            },
        );
        q.unacked += 1;
    }
    q.next_consumer = idx + 1;
    true
}

/// The storage record of a delivery: gone when nobody acks it, else delivered.
fn settle_record(queue: u64, id: u64, no_ack: bool) -> Record {
    if no_ack {
        Record::Remove {
            items: vec![(queue, id)],
        }
    } else {
        Record::Delivered { queue, id }
    }
}

impl Broker {
    /// basic.consume: registers the consumer, writes consume-ok (before any delivery) and
    /// starts delivering.
    #[allow(clippy::too_many_arguments)]
    pub fn consume(
        &self,
        conn: u64,
        channel: u16,
        vhost: &str,
        queue: &str,
        tag: &str,
        no_ack: bool,
        exclusive: bool,
        priority: i32,
        nowait: bool,
    ) -> Result<String, AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let st = &mut *st;
        let consumer_id = st.next_id();
        let tag = if tag.is_empty() {
            let id = st.next_id();
            format!("amq.ctag-{id:016x}")
        } else {
            tag.to_string()
        };
        let (prefetch, dup, consumers) = match st.channels.get(&(conn, channel)) {
            Some(ch) => (
                ch.consumer_prefetch,
                ch.consumers.contains_key(&tag),
                ch.consumers.len(),
            ),
            None => return Err(AmqpError::channel_error("channel is not open")),
        };
        if dup {
            return Err(AmqpError::not_allowed(format!(
                "attempt to reuse consumer tag '{tag}'"
            )));
        }
        if consumers >= st.options.max_consumers_per_channel {
            return Err(AmqpError::not_allowed(format!(
                "reached maximum ({}) of consumers per channel",
                st.options.max_consumers_per_channel
            )));
        }
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let q = v
            .queues
            .get_mut(queue)
            .ok_or_else(|| no_queue(queue, vhost))?;
        check_exclusive(q, conn, vhost)?;
        if q.consumers.iter().any(|c| c.exclusive) || (exclusive && !q.consumers.is_empty()) {
            return Err(AmqpError::access_refused(format!(
                "queue '{queue}' in vhost '{vhost}' in exclusive use"
            )));
        }
        q.consumers.push(Consumer {
            id: consumer_id,
            tag: tag.clone(),
            conn,
            channel,
            no_ack,
            exclusive,
            prefetch,
            unacked: 0,
            priority,
        });
        q.consumers_changed();
        q.had_consumer = true;
        q.last_used = now;
        if let Some(ch) = st.channels.get_mut(&(conn, channel))
            && ch
                .consumers
                .insert(tag.clone(), queue.to_string())
                .is_none()
        {
            self.metrics.consumer_started();
        }
        if !nowait && let Some(c) = st.connections.get(&conn) {
            c.write_queue.push(|out| {
                put_method(
                    out,
                    channel,
                    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: short(&tag),
                    })),
                )
            });
        }
        self.dispatch(st, vhost, queue, now);
        Ok(tag)
    }

    /// basic.cancel from the client; returns false for an unknown tag (still answered ok).
    pub fn cancel(&self, conn: u64, channel: u16, tag: &str) -> bool {
        let now = self.now();
        let mut st = self.lock();
        let Some(ch) = st.channels.get_mut(&(conn, channel)) else {
            return false;
        };
        let Some(queue) = ch.consumers.remove(tag) else {
            return false;
        };
        self.metrics.consumers_ended(1);
        let vhost = ch.vhost.clone();
        // A cancelled consumer's unacked deliveries stay with its channel (as RabbitMQ): the
        // next single active consumer takes over what is waiting at once.
        if self.remove_consumer(&mut st, &vhost, &queue, conn, channel, tag, now) {
            self.dispatch(&mut st, &vhost, &queue, now);
        }
        true
    }

    /// Unregisters a consumer; returns whether a single active consumer's successor takes
    /// over (the caller dispatches the queue once what the leaving channel gives back is
    /// requeued, so the successor gets the messages in order).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn remove_consumer(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        conn: u64,
        channel: u16,
        tag: &str,
        now: u64,
    ) -> bool {
        let Some(q) = st.queue_mut(vhost, queue) else {
            return false;
        };
        q.consumers
            .retain(|c| !(c.conn == conn && c.channel == channel && c.tag == tag));
        q.consumers_changed();
        q.last_used = now;
        let takes_over = q.args.single_active_consumer && !q.consumers.is_empty();
        if q.consumers.is_empty() && q.auto_delete && q.had_consumer {
            self.delete_queue_locked(st, vhost, queue);
            false
        } else {
            self.reschedule(st, vhost, queue);
            takes_over
        }
    }

    pub fn qos(&self, conn: u64, channel: u16, prefetch_count: u16, global: bool) {
        let now = self.now();
        let mut st = self.lock();
        let Some(ch) = st.channels.get_mut(&(conn, channel)) else {
            return;
        };
        if global {
            ch.channel_prefetch = prefetch_count;
        } else {
            ch.consumer_prefetch = prefetch_count;
        }
        let v = ch.vhost.clone();
        let queues: Vec<String> = ch.consumers.values().cloned().collect();
        for q in queues {
            self.dispatch(&mut st, &v, &q, now);
        }
    }

    /// basic.get: writes get-ok with the head message, or get-empty.
    pub fn get(
        &self,
        conn: u64,
        channel: u16,
        vhost: &str,
        queue: &str,
        no_ack: bool,
    ) -> Result<(), AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let st = &mut *st;
        let mut deaths = Vec::new();
        let timeout = st.options.consumer_timeout;
        let result = {
            let State {
                vhosts,
                channels,
                connections,
                ..
            } = &mut *st;
            let v = vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
            let q = v
                .queues
                .get_mut(queue)
                .ok_or_else(|| no_queue(queue, vhost))?;
            check_exclusive(q, conn, vhost)?;
            q.last_used = now;
            let conn_state = connections
                .get(&conn)
                .ok_or_else(|| AmqpError::channel_error("connection is closing"))?;
            let ch = channels
                .get_mut(&(conn, channel))
                .ok_or_else(|| AmqpError::channel_error("channel is not open"))?;
            match q.state.pop(now, &mut deaths) {
                Some(entry) => {
                    let tag = ch.next_tag;
                    ch.next_tag += 1;
                    let rewritten = delivery_properties(&entry, q.counts_deliveries());
                    let props = rewritten
                        .as_deref()
                        .unwrap_or_else(|| entry.message.raw_properties());
                    let remaining = q.state.len() as u32;
                    let frame_max = conn_state.frame_max;
                    conn_state.write_queue.push(|out| {
                        write_get_ok(out, channel, tag, &entry, props, remaining, frame_max)
                    });
                    if let (Some(storage), Some(id)) = (self.storage(), entry.store_id) {
                        storage.append(settle_record(q.id, id, no_ack));
                    }
                    if !no_ack {
                        self.metrics.add_inflight(1, entry.body_len() as i64);
                        let deadline = delivery_timeout(timeout, q.settings.consumer_timeout)
                            .map(|t| ch.ack_deadlines.insert(tag, now, t));
                        ch.unacked.insert(
                            tag,
                            Unacked {
                                queue: q.shared_name.clone(),
                                queue_id: q.id,
                                entry,
                                consumer: None,
                                deadline,
                            },
                        );
                        q.unacked += 1;
                    }
                    true
                }
                None => {
                    conn_state.write_queue.push(|out| {
                        put_method(
                            out,
                            channel,
                            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
                        )
                    });
                    false
                }
            }
        };
        if result {
            self.metrics.delivered(1);
            if st.schedule_ack(conn, channel) {
                self.wake_timers();
            }
        }
        self.after_queue_change(st, vhost, queue, deaths, now);
        Ok(())
    }

    /// Delivers ready messages of a queue to consumers with capacity.
    pub(crate) fn dispatch(&self, st: &mut State, vhost: &str, queue: &str, now: u64) {
        let mut deaths = Vec::new();
        let mut delivered = 0u64;
        let mut timed = Vec::new();
        {
            let State {
                vhosts,
                channels,
                connections,
                options,
                ..
            } = &mut *st;
            let Some(q) = vhosts.get_mut(vhost).and_then(|v| v.queues.get_mut(queue)) else {
                return;
            };
            let mut clock = DeliveryClock {
                now,
                timeout: delivery_timeout(options.consumer_timeout, q.settings.consumer_timeout),
                timed: &mut timed,
            };
            while !q.state.is_empty() && !q.consumers.is_empty() {
                let Some(idx) = pick_consumer(q, channels, connections) else {
                    break;
                };
                let Some(entry) = q.state.pop(now, &mut deaths) else {
                    break;
                };
                if deliver_to(
                    q,
                    idx,
                    entry,
                    channels,
                    connections,
                    &self.metrics,
                    self.storage.get().map(|s| &**s),
                    &mut clock,
                ) {
                    delivered += 1;
                }
            }
        }
        if delivered > 0 {
            self.metrics.delivered(delivered);
        }
        timed.dedup();
        let mut wake = false;
        for (conn, channel) in timed {
            wake |= st.schedule_ack(conn, channel);
        }
        if wake {
            self.wake_timers();
        }
        self.after_queue_change(st, vhost, queue, deaths, now);
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::{AMQPClass, basic};
    use amq_protocol::types::FieldTable;

    use super::super::test_support::{Client, broker, declare, publish_to, ready, with_queue};
    use crate::amqp::reply;

    fn deliveries(c: &Client) -> Vec<u64> {
        c.methods()
            .into_iter()
            .filter_map(|(_, m)| match m {
                AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => Some(d.delivery_tag),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn consume_ok_is_written_before_the_first_delivery() {
        let (b, c) = with_queue(&FieldTable::default(), &[b"1", b"2"]);
        let tag = b
            .consume(c.conn, 1, "/", "q", "", false, false, 0, false)
            .unwrap();
        assert!(tag.starts_with("amq.ctag-"), "{tag}");
        let sent = c.methods();
        assert!(
            matches!(&sent[0], (1, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok))) if ok.consumer_tag.as_str() == tag),
            "{sent:?}"
        );
        let tags: Vec<u64> = sent[1..]
            .iter()
            .filter_map(|(_, m)| match m {
                AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) if !d.redelivered => {
                    Some(d.delivery_tag)
                }
                _ => None,
            })
            .collect();
        assert_eq!(tags, vec![1, 2]);
        assert_eq!(ready(&b, "q"), 0);
    }

    #[test]
    fn prefetch_holds_deliveries_until_an_ack() {
        let (b, c) = with_queue(&FieldTable::default(), &[b"1", b"2", b"3"]);
        b.qos(c.conn, 1, 1, false);
        b.consume(c.conn, 1, "/", "q", "t", false, false, 0, true)
            .unwrap();
        assert_eq!(deliveries(&c), vec![1]);
        assert_eq!(ready(&b, "q"), 2);
        b.ack(c.conn, 1, 1, false).unwrap();
        assert_eq!(deliveries(&c), vec![2]);
    }

    #[test]
    fn get_answers_get_ok_with_the_remaining_count_or_get_empty() {
        let (b, c) = with_queue(&FieldTable::default(), &[]);
        b.get(c.conn, 1, "/", "q", false).unwrap();
        assert!(matches!(
            &c.methods()[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)))]
        ));
        publish_to(&b, "q", b"1");
        publish_to(&b, "q", b"2");
        b.get(c.conn, 1, "/", "q", false).unwrap();
        let sent = c.methods();
        assert!(
            matches!(&sent[..], [(1, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)))] if ok.delivery_tag == 1 && ok.message_count == 1),
            "{sent:?}"
        );
        assert_eq!(b.lock().channels[&(c.conn, 1)].unacked.len(), 1);
    }

    #[test]
    fn reused_tags_and_exclusive_consumers_are_refused() {
        let (b, c) = with_queue(&FieldTable::default(), &[]);
        b.consume(c.conn, 1, "/", "q", "t", false, true, 0, true)
            .unwrap();
        let err = b
            .consume(c.conn, 1, "/", "q", "t", false, false, 0, true)
            .unwrap_err();
        assert_eq!(err.code, reply::NOT_ALLOWED);
        assert_eq!(err.text, "NOT_ALLOWED - attempt to reuse consumer tag 't'");
        let err = b
            .consume(c.conn, 1, "/", "q", "u", false, false, 0, true)
            .unwrap_err();
        assert_eq!(
            err.text,
            "ACCESS_REFUSED - queue 'q' in vhost '/' in exclusive use"
        );
    }

    #[test]
    fn a_cancelled_consumer_gets_nothing_more() {
        let (b, c) = with_queue(&FieldTable::default(), &[]);
        b.consume(c.conn, 1, "/", "q", "t", true, false, 0, true)
            .unwrap();
        assert!(!b.cancel(c.conn, 1, "other"));
        assert!(b.cancel(c.conn, 1, "t"));
        publish_to(&b, "q", b"1");
        assert!(deliveries(&c).is_empty());
        assert_eq!(ready(&b, "q"), 1);
    }

    #[test]
    fn a_full_write_queue_pauses_dispatch_until_resumed() {
        let b = broker();
        let c = Client::connect_with_budget(&b, 1);
        let none = FieldTable::default();
        b.queue_declare(c.conn, "/", &declare("q", &none)).unwrap();
        b.consume(c.conn, 1, "/", "q", "t", true, false, 0, true)
            .unwrap();
        publish_to(&b, "q", b"1");
        publish_to(&b, "q", b"2");
        // The first delivery fills the budget of one byte: the second waits in the queue.
        assert_eq!(ready(&b, "q"), 1);
        assert_eq!(deliveries(&c), vec![1]);
        c.out.written(usize::MAX);
        b.resume_connection(c.conn);
        assert_eq!(deliveries(&c), vec![2]);
        assert_eq!(ready(&b, "q"), 0);
    }
}
