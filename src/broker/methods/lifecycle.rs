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
            },
        );
        Ok(id)
    }

    pub fn open_channel(&self, conn: u64, channel: u16) {
        let mut st = self.lock();
        let vhost = st
            .connections
            .get(&conn)
            .map(|c| c.vhost.clone())
            .unwrap_or_default();
        st.channels.insert(
            (conn, channel),
            ChannelState {
                vhost,
                next_tag: 1,
                unacked: BTreeMap::new(),
                consumer_prefetch: 0,
                channel_prefetch: 0,
                consumers: Default::default(),
                active: true,
            },
        );
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
        let requeue: Vec<Unacked> = ch.unacked.into_values().collect();
        self.release_counters(st, &vhost, conn, channel, &requeue);
        for (tag, queue) in &ch.consumers {
            self.remove_consumer(st, &vhost, queue, conn, channel, tag, now);
        }
        self.requeue_unacked(st, &vhost, requeue, now);
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
        for ch in channels {
            self.close_channel_locked(&mut st, conn, ch, now);
        }
        let Some(info) = st.connections.remove(&conn) else {
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
        Client, bodies, broker, declare, publish_to, ready, with_queue,
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
