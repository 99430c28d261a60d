//! Connections and channels as the broker sees them: registration after connection.open,
//! channel.open/close/flow, and the teardown that requeues a closed channel's deliveries and
//! deletes a closed connection's exclusive queues.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::amqp::reply::AmqpError;
use crate::broker::write_queue::WriteQueue;
use crate::broker::{Broker, ChannelState, ConnectionState, State, Unacked};

impl Broker {
    /// Registers a connection after connection.open; returns its id.
    /// Whether the connection's client announced `consumer_cancel_notify` (every
    /// connection is taken to have until told).
    pub fn set_cancel_notify(&self, conn: u64, cancel_notify: bool) {
        if let Some(c) = self.lock().connections.get_mut(&conn) {
            c.cancel_notify = cancel_notify;
        }
    }

    pub fn open_connection(
        &self,
        write_queue: Arc<WriteQueue>,
        frame_max: usize,
        user: &str,
        vhost: &str,
    ) -> Result<u64, AmqpError> {
        let mut st = self.lock();
        if !st.vhosts.contains_key(vhost) {
            return Err(AmqpError::new(
                crate::amqp::reply::NOT_ALLOWED,
                format!("vhost {vhost} not found"),
            ));
        }
        let id = st.next_id();
        st.connections.insert(
            id,
            ConnectionState {
                write_queue,
                frame_max,
                user: user.to_string(),
                vhost: vhost.to_string(),
                ack_alarm: Arc::new(tokio::sync::Notify::new()),
                ack_due: Vec::new(),
                cancel_notify: true,
            },
        );
        Ok(id)
    }

    /// What wakes connection `conn`'s task when one of its channels may be past a consumer
    /// timeout (then it calls [`Broker::take_ack_timeouts`]).
    pub fn ack_alarm(&self, conn: u64) -> Option<Arc<tokio::sync::Notify>> {
        self.lock()
            .connections
            .get(&conn)
            .map(|c| c.ack_alarm.clone())
    }

    /// The channels of `conn` with a delivery unacknowledged past its consumer timeout, each
    /// with the timeout used (for [`crate::broker::ack_timeout::timeout_error`]); the caller
    /// closes them ([`Broker::close_channel`] requeues their deliveries, counting each as a
    /// delivery attempt). Counted in `consumer_timeouts_total` by the queue of the delivery
    /// that timed out. A channel acked or closed since the timer found it is left alone.
    pub fn take_ack_timeouts(&self, conn: u64) -> Vec<(u16, u64)> {
        let now = self.now();
        let mut st = self.lock();
        let due = match st.connections.get_mut(&conn) {
            Some(c) => std::mem::take(&mut c.ack_due),
            None => return Vec::new(),
        };
        let mut closing = Vec::new();
        for channel in due {
            let Some(ch) = st.channels.get(&(conn, channel)) else {
                continue;
            };
            match ch.ack_deadlines.due(now) {
                Some((tag, timeout)) => {
                    if let Some(u) = ch.unacked.get(&tag) {
                        self.metrics.consumer_timed_out(&ch.vhost, &u.queue);
                    }
                    closing.push((channel, timeout));
                }
                None => {
                    if st.schedule_ack(conn, channel) {
                        self.wake_timers();
                    }
                }
            }
        }
        closing
    }

    pub fn open_channel(&self, conn: u64, channel: u16) {
        let mut st = self.lock();
        let vhost = st
            .connections
            .get(&conn)
            .map(|c| c.vhost.clone())
            .unwrap_or_default();
        let replaced = st.channels.insert(
            (conn, channel),
            ChannelState {
                vhost,
                next_tag: 1,
                unacked: BTreeMap::new(),
                consumer_prefetch: 0,
                channel_prefetch: 0,
                consumers: Default::default(),
                active: true,
                ack_deadlines: Default::default(),
                ack_timer_at: None,
            },
        );
        if let Some(old) = replaced {
            self.metrics.consumers_ended(old.consumers.len() as u64);
        }
    }

    /// Closes a channel: its consumers go away and its unacked deliveries return to their
    /// queues in order, marked redelivered (counted toward delivery limits).
    pub fn close_channel(&self, conn: u64, channel: u16) {
        let now = self.now();
        let mut st = self.lock();
        self.close_channel_locked(&mut st, conn, channel, now);
    }

    pub(super) fn close_channel_locked(&self, st: &mut State, conn: u64, channel: u16, now: u64) {
        let Some(ch) = st.channels.remove(&(conn, channel)) else {
            return;
        };
        let vhost = ch.vhost.clone();
        self.metrics.consumers_ended(ch.consumers.len() as u64);
        let requeue: Vec<Unacked> = ch.unacked.into_values().collect();
        self.release_counters(st, &vhost, &requeue);
        let mut taken_over = Vec::new();
        for (tag, queue) in &ch.consumers {
            if self.remove_consumer(st, &vhost, queue, conn, channel, tag, now) {
                taken_over.push(queue);
            }
        }
        self.requeue_unacked(st, &vhost, requeue, now);
        // A single active consumer's successor gets the requeued deliveries first, then what
        // was waiting (as RabbitMQ requeues, then delivers).
        for queue in taken_over {
            self.dispatch(st, &vhost, queue, now);
        }
    }

    /// Closes a connection: all channels, then its exclusive queues.
    pub fn close_connection(&self, conn: u64) {
        let now = self.now();
        let mut st = self.lock();
        let channels: Vec<u16> = st
            .channels
            .keys()
            .filter(|(c, _)| *c == conn)
            .map(|(_, ch)| *ch)
            .collect();
        // Unregistered first: the deliveries each channel gives back are dispatched as it
        // closes, and must not go to a consumer on another channel of this same connection
        // (written to a closing socket, a no-ack delivery would be lost; a manual-ack one
        // would be given back twice and counted twice against a delivery limit).
        let info = st.connections.remove(&conn);
        for ch in channels {
            self.close_channel_locked(&mut st, conn, ch, now);
        }
        let Some(info) = info else {
            return;
        };
        let exclusive: Vec<String> = st
            .vhosts
            .get(&info.vhost)
            .map(|v| {
                v.queues
                    .values()
                    .filter(|q| q.exclusive_owner == Some(conn))
                    .map(|q| q.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        for q in exclusive {
            self.delete_queue_locked(&mut st, &info.vhost, &q);
        }
    }

    /// The writer drained a full write queue: resume dispatch to this connection's consumers.
    pub fn resume_connection(&self, conn: u64) {
        let now = self.now();
        let mut st = self.lock();
        let mut queues: Vec<(String, String)> = Vec::new();
        for ((c, _), ch) in st.channels.iter() {
            if *c == conn {
                for q in ch.consumers.values() {
                    queues.push((ch.vhost.clone(), q.clone()));
                }
            }
        }
        queues.sort();
        queues.dedup();
        for (v, q) in queues {
            self.dispatch(&mut st, &v, &q, now);
        }
    }

    pub fn channel_flow(&self, conn: u64, channel: u16, active: bool) {
        let now = self.now();
        let mut st = self.lock();
        let queues = match st.channels.get_mut(&(conn, channel)) {
            Some(ch) => {
                ch.active = active;
                let v = ch.vhost.clone();
                ch.consumers
                    .values()
                    .map(|q| (v.clone(), q.clone()))
                    .collect::<Vec<_>>()
            }
            None => Vec::new(),
        };
        if active {
            for (v, q) in queues {
                self.dispatch(&mut st, &v, &q, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::{AMQPClass, basic};
    use amq_protocol::types::FieldTable;

    use super::super::test_support::{
        Client, bodies, broker, dead_letter_target, declare, long, publish_to, ready, table, text,
        with_queue,
    };
    use crate::amqp::reply;
    use crate::broker::write_queue::WriteQueue;

    #[test]
    fn an_unknown_vhost_is_refused() {
        let b = broker();
        let err = b
            .open_connection(std::sync::Arc::new(WriteQueue::new(64)), 4096, "u", "nope")
            .unwrap_err();
        assert_eq!(err.code, reply::NOT_ALLOWED);
        assert_eq!(err.text, "NOT_ALLOWED - vhost nope not found");
    }

    #[test]
    fn closing_a_channel_requeues_its_deliveries_in_order() {
        let (b, c) = with_queue(&FieldTable::default(), &[b"1", b"2", b"3"]);
        b.consume(c.conn, 1, "/", "q", "t", false, false, 0, true)
            .unwrap();
        assert_eq!(ready(&b, "q"), 0);
        b.close_channel(c.conn, 1);
        assert_eq!(
            bodies(&b, "q"),
            vec![b"1".to_vec(), b"2".to_vec(), b"3".to_vec()]
        );
        let st = b.lock();
        let q = &st.vhosts["/"].queues["q"];
        assert!(q.consumers.is_empty());
        assert!(q.state.iter().all(|e| e.redelivered));
    }

    #[test]
    fn a_delivery_held_past_its_consumer_timeout_closes_the_channel_and_counts_an_attempt() {
        let b = broker();
        let c = Client::connect(&b);
        dead_letter_target(&b, c.conn);
        let args = table(&[
            ("x-consumer-timeout", long(1)),
            ("x-delivery-limit", long(0)),
            ("x-dead-letter-exchange", text("dlx")),
        ]);
        b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
        publish_to(&b, "q", b"1");
        b.consume(c.conn, 1, "/", "q", "t", false, false, 0, true)
            .unwrap();
        // Before the deadline nothing is due.
        assert!(b.take_ack_timeouts(c.conn).is_empty());
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.run_timers();
        assert_eq!(b.take_ack_timeouts(c.conn), vec![(1, 1)]);
        // The connection task closes the channel: the return is a delivery attempt, past
        // the limit of 0, so the message is dead-lettered (delivery_limit).
        b.close_channel(c.conn, 1);
        assert_eq!(ready(&b, "q"), 0);
        assert_eq!(bodies(&b, "dead"), vec![b"1".to_vec()]);
        let text = b.metrics.encode();
        assert!(
            text.contains("dlx_proxy_consumer_timeouts_total{queue=\"q\",vhost=\"/\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn an_acked_delivery_does_not_time_out_and_the_config_timeout_applies() {
        let b = broker();
        b.lock().options.consumer_timeout = Some(1);
        let c = Client::connect(&b);
        b.queue_declare(c.conn, "/", &declare("q", &FieldTable::default()))
            .unwrap();
        publish_to(&b, "q", b"1");
        publish_to(&b, "q", b"2");
        b.get(c.conn, 1, "/", "q", false).unwrap();
        b.ack(c.conn, 1, 1, false).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.run_timers();
        assert!(b.take_ack_timeouts(c.conn).is_empty());
        // A basic.get delivery is timed as well.
        b.get(c.conn, 1, "/", "q", false).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.run_timers();
        assert_eq!(b.take_ack_timeouts(c.conn), vec![(1, 1)]);
    }

    #[test]
    fn channels_closed_before_their_timeout_do_not_grow_the_timer_heap() {
        let b = broker();
        b.lock().options.consumer_timeout = Some(3_600_000);
        let c = Client::connect(&b);
        b.queue_declare(c.conn, "/", &declare("q", &FieldTable::default()))
            .unwrap();
        for _ in 0..500 {
            publish_to(&b, "q", b"m");
            b.open_channel(c.conn, 2);
            b.get(c.conn, 2, "/", "q", false).unwrap();
            b.close_channel(c.conn, 2);
        }
        let st = b.lock();
        assert!(
            st.ack_timers.len() <= 2 * st.channels.len() + 65,
            "{}",
            st.ack_timers.len()
        );
    }

    #[test]
    fn closing_a_connection_deletes_its_exclusive_queues() {
        let b = broker();
        let c = Client::connect(&b);
        let none = FieldTable::default();
        let mut exclusive = declare("mine", &none);
        exclusive.exclusive = true;
        b.queue_declare(c.conn, "/", &exclusive).unwrap();
        b.queue_declare(c.conn, "/", &declare("shared", &none))
            .unwrap();
        b.close_connection(c.conn);
        assert!(b.queue_settings("/", "mine").is_none());
        assert!(b.queue_settings("/", "shared").is_some());
        assert!(b.lock().channels.is_empty());
    }

    #[test]
    fn channel_flow_off_holds_deliveries_until_it_is_on_again() {
        let (b, c) = with_queue(&FieldTable::default(), &[]);
        b.consume(c.conn, 1, "/", "q", "t", true, false, 0, true)
            .unwrap();
        b.channel_flow(c.conn, 1, false);
        publish_to(&b, "q", b"1");
        assert_eq!(ready(&b, "q"), 1);
        assert!(c.methods().is_empty());
        b.channel_flow(c.conn, 1, true);
        assert_eq!(ready(&b, "q"), 0);
        assert!(matches!(
            &c.methods()[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(_)))]
        ));
    }
}
