//! What keeps queues in shape between client methods: the timer deadline of each queue
//! (message and queue expiry, held retries coming due), its depth gauges, and re-applying policies when they change;
//! and the channels whose consumer timeout came due, handed to their connection task.

use super::queue_limits;
use crate::broker::queue::Death;
use crate::broker::{Broker, State};
use crate::policy::effective_settings;

impl Broker {
    /// After `queue` changed: dead-letters what died, schedules its next deadline and updates
    /// its depth gauges.
    pub(super) fn after_queue_change(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        deaths: Vec<Death>,
        now: u64,
    ) {
        if !deaths.is_empty() {
            self.process_deaths(st, vhost, queue, deaths, now);
        }
        self.reschedule(st, vhost, queue);
        self.update_depth(st, vhost, queue);
    }

    /// Makes sure the timer heap holds this queue's next deadline.
    pub(crate) fn reschedule(&self, st: &mut State, vhost: &str, queue: &str) {
        let Some(q) = st.queue_mut(vhost, queue) else {
            return;
        };
        let Some(at) = q.next_deadline() else {
            return;
        };
        if q.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        q.timer_at = Some(at);
        let id = q.id;
        if st.schedule(at, vhost, queue, id) {
            self.wake_timers();
        }
    }

    pub(crate) fn update_depth(&self, st: &mut State, vhost: &str, queue: &str) {
        if let Some(q) = st.queue_mut(vhost, queue) {
            if q.state.pages() {
                let lost = q.state.take_lost();
                let id = q.id;
                self.store_removed(lost.into_iter().map(|m| (id, m)).collect());
                if let Some(paging) = self.paging() {
                    self.metrics.set_paging(&paging.stats());
                }
            }
            if q.depth_gauges.is_none() {
                q.depth_gauges = self.metrics.queue_depth_gauges(vhost, queue);
            }
            if let Some(g) = &q.depth_gauges {
                g.set(q.state.len() as u64, q.state.bytes());
            }
        }
    }

    /// Policy set changed: recompute every queue's effective settings and enforce them.
    pub fn apply_policies(&self, policies: crate::policy::PolicySet) {
        let now = self.now();
        let mut st = self.lock();
        st.policies = policies;
        let names: Vec<(String, String)> = st
            .vhosts
            .iter()
            .flat_map(|(v, vh)| vh.queues.keys().map(move |q| (v.clone(), q.clone())))
            .collect();
        for (v, qn) in names {
            let default_limit = st.options.default_delivery_limit;
            let keep_dead_letters = st.options.keep_dead_letters;
            let policy_def = st.policies.for_queue(&v, &qn).map(|p| p.definition.clone());
            let mut deaths = Vec::new();
            if let Some(q) = st.vhosts.get_mut(&v).and_then(|vh| vh.queues.get_mut(&qn)) {
                let settings = effective_settings(&q.args, policy_def.as_ref(), default_limit);
                if settings != q.settings {
                    q.state.set_limits(
                        queue_limits(&settings, keep_dead_letters),
                        now,
                        &mut deaths,
                    );
                    q.settings = settings;
                    q.timer_at = None;
                }
            }
            self.after_queue_change(&mut st, &v, &qn, deaths, now);
        }
    }
}

/// Called by [`Broker::run_timers`]: every channel whose consumer-timeout deadline has come is
/// checked again; one still past a deadline is handed to its connection task (which closes it,
/// see [`Broker::take_ack_timeouts`]), any other is scheduled for its next deadline.
pub(crate) fn on_ack_timers(st: &mut State, now: u64) {
    let mut due = Vec::new();
    while let Some(std::cmp::Reverse((at, conn, channel))) = st.ack_timers.peek().copied() {
        if at > now {
            break;
        }
        st.ack_timers.pop();
        due.push((at, conn, channel));
    }
    for (at, conn, channel) in due {
        let Some(ch) = st.channels.get_mut(&(conn, channel)) else {
            continue;
        };
        if ch.ack_timer_at != Some(at) {
            continue; // a stale entry: the channel has another one in the heap
        }
        ch.ack_timer_at = None;
        if ch.ack_deadlines.due(now).is_none() {
            st.schedule_ack(conn, channel);
            continue;
        }
        if let Some(c) = st.connections.get_mut(&conn) {
            if !c.ack_due.contains(&channel) {
                c.ack_due.push(channel);
            }
            c.ack_alarm.notify_one();
        }
    }
}

/// Called by [`Broker::run_timers`] for a due queue deadline.
pub(crate) fn on_timer(b: &Broker, st: &mut State, vhost: &str, queue: &str, id: u64, now: u64) {
    let mut deaths = Vec::new();
    let mut read_due = false;
    let expire_queue = {
        let Some(q) = st.queue_mut(vhost, queue) else {
            return;
        };
        if q.id != id {
            return;
        }
        q.timer_at = None;
        if q.expiry_deadline().is_some_and(|at| at <= now) {
            true
        } else {
            // A message whose read failed and is due again holds back the ones behind it:
            // whoever reads it now (expiry or the retry), consumers may take them after.
            read_due = q.state.next_read_retry().is_some_and(|at| at <= now);
            q.state.expire(now, &mut deaths);
            q.state.retry_read(now, &mut deaths);
            false
        }
    };
    if expire_queue {
        b.delete_queue_locked(st, vhost, queue);
        return;
    }
    // Held retries first: their return reschedules the queue with the hold's next due time.
    b.return_due_retries(st, vhost, queue, now);
    b.after_queue_change(st, vhost, queue, deaths, now);
    if read_due {
        b.dispatch(st, vhost, queue, now);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use amq_protocol::types::FieldTable;

    use super::super::test_support::{
        Client, bodies, broker, dead_letter_target, declare, long, publish_to, ready, table, text,
    };
    use crate::config::PolicyConfig;
    use crate::policy::PolicySet;

    #[test]
    fn a_new_policy_is_enforced_on_existing_queues_at_once() {
        let b = broker();
        let c = Client::connect(&b);
        b.queue_declare(c.conn, "/", &declare("q", &FieldTable::default()))
            .unwrap();
        for body in [b"1", b"2", b"3"] {
            publish_to(&b, "q", body);
        }
        let policy = PolicyConfig {
            name: "short".into(),
            vhost: "/".into(),
            pattern: "^q$".into(),
            apply_to: "queues".into(),
            priority: 0,
            definition: BTreeMap::from([("max-length".to_string(), serde_json::json!(1))]),
        };
        b.apply_policies(PolicySet::from_configs(&[policy]).unwrap());
        assert_eq!(bodies(&b, "q"), vec![b"3".to_vec()]);
        assert_eq!(b.queue_settings("/", "q").unwrap().max_length, Some(1));
    }

    #[test]
    fn the_timer_expires_the_head_and_dead_letters_it() {
        let b = broker();
        let c = Client::connect(&b);
        dead_letter_target(&b, c.conn);
        let args = table(&[
            ("x-message-ttl", long(1)),
            ("x-dead-letter-exchange", text("dlx")),
        ]);
        b.queue_declare(c.conn, "/", &declare("q", &args)).unwrap();
        publish_to(&b, "q", b"1");
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.run_timers();
        assert_eq!(ready(&b, "q"), 0);
        assert_eq!(bodies(&b, "dead"), vec![b"1".to_vec()]);
    }
}
