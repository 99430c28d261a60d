//! A redrive batch on the broker ([`crate::redrive`] drives the passes): under the broker lock,
//! messages are taken from a dead-letter queue from a cursor on, each decided by the pure
//! [`crate::redrive::plan`] (moved, skipped by the filter, or failed), the moved ones
//! published through the default exchange to their target queue with `x-redriven-count` and
//! their x-death history, and taken out of the dead-letter queue. Skipped and failed messages
//! stay where they are, in order; the cursor (the position `seq` of the last message looked
//! at) steps over them, so a pass looks at each message once.
//!
//! With storage each move writes one record, as a dead-letter move does: a Publish that adds
//! the message to its durable target and removes it from the dead-letter queue (or only the
//! removal when the target keeps nothing on disk), so after a crash the message is in one of
//! the two queues, never neither. A target that does not exist (`no_queue`) or would refuse the
//! message (`target_full`, reject-publish limits) leaves it in the dead-letter queue.

use std::sync::Arc;

use crate::amqp::content::encode_properties_from;
use crate::broker::message::Message;
use crate::broker::{Broker, State};
use crate::redrive::plan::{Decision, Plan, stamp};

/// One pass over a dead-letter queue: where it stands and where it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RedriveCursor {
    /// The position of the last message looked at (none yet: from the head).
    pub after: Option<u64>,
    /// The position of the last message the pass looks at (the tail when it started):
    /// messages arriving later, redriven ones dead-lettered again included, wait for the next
    /// pass.
    pub end: u64,
}

/// What one batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedriveBatch {
    /// Messages looked at.
    pub examined: u64,
    /// The target of each message moved (or, dry-run, that would have been).
    pub moved: Vec<String>,
    /// Messages left out by the filter.
    pub skipped: u64,
    /// The cause of each message that could not be moved.
    pub failed: Vec<&'static str>,
    /// Where the next batch starts.
    pub after: Option<u64>,
    /// The pass is over (nothing left up to its end).
    pub done: bool,
}

/// A message a batch looks at: its position, the message, its store id.
type Candidate = (u64, Arc<Message>, Option<u64>);

/// What a batch looks at: the pass, how many messages at most, how many it may move.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub examine: usize,
    pub moves: u64,
    pub dry_run: bool,
}

impl Broker {
    /// Where a pass over `queue` ends (its tail now; `None` when it is empty) and its length;
    /// `Err` names a missing vhost or queue.
    pub fn redrive_start(&self, vhost: &str, queue: &str) -> Result<(Option<u64>, u64), String> {
        let st = self.lock();
        let q = st
            .vhosts
            .get(vhost)
            .ok_or_else(|| format!("no vhost {vhost:?}"))?
            .queues
            .get(queue)
            .ok_or_else(|| format!("no queue {queue:?} in vhost {vhost:?}"))?;
        Ok((q.state.last_seq(), q.state.len() as u64))
    }

    /// Moves up to `limits.moves` messages of `from` after the cursor (looking at no more than
    /// `limits.examine`), as the module comment says.
    pub fn redrive_batch(
        &self,
        vhost: &str,
        from: &str,
        plan: &Plan,
        cursor: RedriveCursor,
        limits: BatchLimits,
    ) -> Result<RedriveBatch, String> {
        let now = self.now();
        let mut st = self.lock();
        let q = st
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(from))
            .ok_or_else(|| format!("queue {from:?} in vhost {vhost:?} is gone"))?;
        let dlq_id = q.id;
        let candidates: Vec<Result<Candidate, u64>> = q
            .state
            .iter_after(cursor.after)
            .take_while(|e| e.as_ref().map_or_else(|seq| *seq, |e| e.seq) <= cursor.end)
            .take(limits.examine)
            .map(|e| e.map(|e| (e.seq, e.message, e.store_id)))
            .collect();
        let mut batch = RedriveBatch {
            after: cursor.after,
            ..RedriveBatch::default()
        };
        let mut moved_seqs = Vec::new();
        let mut deaths = Vec::new();
        for candidate in candidates {
            if batch.moved.len() as u64 >= limits.moves {
                break;
            }
            let (seq, message, store_id) = match candidate {
                Ok(found) => found,
                Err(seq) => {
                    // Paged and unreadable (a disk fault): passed over, not waited for.
                    batch.after = Some(seq);
                    batch.examined += 1;
                    batch.failed.push("unreadable");
                    continue;
                }
            };
            batch.after = Some(seq);
            batch.examined += 1;
            let Ok(props) = message.properties() else {
                batch.failed.push("undecodable");
                continue;
            };
            let target = match plan.decide(&props, from) {
                Decision::Skip => {
                    batch.skipped += 1;
                    continue;
                }
                Decision::Fail(cause) => {
                    batch.failed.push(cause);
                    continue;
                }
                Decision::Move(target) => target,
            };
            let refusal = match st.vhosts.get(vhost).and_then(|v| v.queues.get(&target)) {
                None => Some("no_queue"),
                Some(t) if t.state.refuses_len(message.body_len()) => Some("target_full"),
                Some(_) => None,
            };
            if let Some(cause) = refusal {
                batch.failed.push(cause);
                continue;
            }
            if !limits.dry_run {
                let properties = encode_properties_from(&stamp(&props), message.raw_properties());
                let redriven = Arc::new(Message::new(
                    "",
                    &[target.as_str()],
                    &properties,
                    message.body(),
                    message.expiration_ms,
                    message.dead_lettered,
                ));
                st.persist_targets.clear();
                self.enqueue(
                    &mut st,
                    vhost,
                    &target,
                    redriven.clone(),
                    now,
                    true,
                    &mut deaths,
                );
                let remove = store_id.map(|id| (dlq_id, id));
                self.store_published(&mut st, redriven, remove, now, false);
                moved_seqs.push(seq);
            }
            batch.moved.push(target);
        }
        let State { vhosts, .. } = &mut *st;
        if let Some(q) = vhosts.get_mut(vhost).and_then(|v| v.queues.get_mut(from)) {
            q.state.remove_seqs(&moved_seqs);
            batch.done = q
                .state
                .seq_after(batch.after)
                .is_none_or(|seq| seq > cursor.end);
        }
        for (q, d) in deaths {
            self.process_deaths(&mut st, vhost, &q, d, now);
        }
        let mut targets = batch.moved.clone();
        targets.sort();
        targets.dedup();
        if !limits.dry_run {
            for t in &targets {
                self.dispatch(&mut st, vhost, t, now);
                self.reschedule(&mut st, vhost, t);
                self.update_depth(&mut st, vhost, t);
            }
            self.reschedule(&mut st, vhost, from);
            self.update_depth(&mut st, vhost, from);
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Client, bodies, broker, declare, long, table, text};
    use super::*;
    use crate::amqp::content::encode_properties;
    use crate::deadletter::DeadLetterReason;
    use crate::redrive::plan::X_REDRIVEN_COUNT;
    use amq_protocol::types::{AMQPValue, FieldTable};

    fn limits(moves: u64, dry_run: bool) -> BatchLimits {
        BatchLimits {
            examine: 100,
            moves,
            dry_run,
        }
    }

    /// Publishes to `dead` a message whose newest death is (`queue`, `reason`).
    fn dead_letter(b: &Broker, body: &str, queue: &str, reason: &str) {
        let props = encode_properties(&crate::redrive::plan::dead_letter_properties(&[(
            queue, reason,
        )]));
        let m = Arc::new(Message::new(
            "",
            &["dead"],
            &props,
            body.as_bytes(),
            None,
            false,
        ));
        b.publish("/", "", m, None).unwrap();
    }

    fn texts(b: &Broker, queue: &str) -> Vec<String> {
        bodies(b, queue)
            .into_iter()
            .map(|body| String::from_utf8(body).unwrap())
            .collect()
    }

    fn setup(queues: &[(&str, &FieldTable)]) -> Arc<Broker> {
        let b = broker();
        let c = Client::connect(&b);
        for (name, args) in queues {
            b.queue_declare(c.conn, "/", &declare(name, args)).unwrap();
        }
        dead_letter(&b, "a1", "work", "expired");
        dead_letter(&b, "b1", "other", "rejected");
        dead_letter(&b, "a2", "work", "expired");
        b
    }

    fn pass(b: &Broker, plan: &Plan, l: BatchLimits) -> RedriveBatch {
        let (end, _) = b.redrive_start("/", "dead").unwrap();
        let cursor = RedriveCursor {
            after: None,
            end: end.unwrap(),
        };
        b.redrive_batch("/", "dead", plan, cursor, l).unwrap()
    }

    #[test]
    fn a_filtered_pass_moves_the_matching_ones_to_their_source() {
        let none = FieldTable::default();
        let b = setup(&[("dead", &none), ("work", &none), ("other", &none)]);
        let plan = Plan {
            to: None,
            reasons: vec![DeadLetterReason::Expired],
        };
        let batch = pass(&b, &plan, limits(u64::MAX, false));
        assert_eq!(batch.moved, ["work", "work"]);
        assert_eq!((batch.examined, batch.skipped, batch.done), (3, 1, true));
        assert_eq!(texts(&b, "work"), ["a1", "a2"]);
        assert_eq!(texts(&b, "dead"), ["b1"]);
        let st = b.lock();
        let moved = st.vhosts["/"].queues["work"].state.iter().next().unwrap();
        assert_eq!(
            (moved.message.exchange(), moved.message.routing_key()),
            ("", "work")
        );
        let props = moved.message.properties().unwrap();
        let headers = props.headers().clone().unwrap();
        assert_eq!(
            headers.inner().get(X_REDRIVEN_COUNT),
            Some(&AMQPValue::LongLongInt(1))
        );
        assert_eq!(crate::deadletter::x_death_entries(&props)[0].queue, "work");
        drop(st);
        // The next pass, unfiltered, takes the rest to its own source.
        let batch = pass(&b, &Plan::default(), limits(u64::MAX, false));
        assert_eq!(batch.moved, ["other"]);
        assert_eq!(texts(&b, "other"), ["b1"]);
        assert!(texts(&b, "dead").is_empty());
    }

    #[test]
    fn the_move_limit_stops_the_cursor_where_it_is() {
        let none = FieldTable::default();
        let b = setup(&[("dead", &none), ("work", &none), ("other", &none)]);
        let (end, length) = b.redrive_start("/", "dead").unwrap();
        assert_eq!(length, 3);
        let mut cursor = RedriveCursor {
            after: None,
            end: end.unwrap(),
        };
        let plan = Plan {
            to: Some("other".into()),
            reasons: vec![],
        };
        let first = b
            .redrive_batch("/", "dead", &plan, cursor, limits(2, false))
            .unwrap();
        assert_eq!((first.moved.len(), first.done), (2, false));
        cursor.after = first.after;
        let second = b
            .redrive_batch("/", "dead", &plan, cursor, limits(2, false))
            .unwrap();
        assert_eq!((second.moved.len(), second.done), (1, true));
        assert_eq!(texts(&b, "other"), ["a1", "b1", "a2"]);
    }

    #[test]
    fn missing_or_full_targets_and_dry_runs_leave_the_queue_as_it_was() {
        let none = FieldTable::default();
        let full = table(&[
            ("x-max-length", long(0)),
            ("x-overflow", text("reject-publish")),
        ]);
        let b = setup(&[("dead", &none), ("work", &full)]);
        let batch = pass(&b, &Plan::default(), limits(u64::MAX, false));
        assert_eq!(batch.failed, ["target_full", "no_queue", "target_full"]);
        assert!(batch.moved.is_empty() && batch.done);
        assert_eq!(texts(&b, "dead"), ["a1", "b1", "a2"]);

        let b = setup(&[("dead", &none), ("work", &none), ("other", &none)]);
        let batch = pass(&b, &Plan::default(), limits(u64::MAX, true));
        assert_eq!(batch.moved, ["work", "other", "work"]);
        assert_eq!(texts(&b, "dead"), ["a1", "b1", "a2"]);
        assert!(texts(&b, "work").is_empty());
        let plan = Plan {
            to: Some("dead".into()),
            reasons: vec![],
        };
        assert_eq!(pass(&b, &plan, limits(9, false)).failed, ["same_queue"; 3]);
        assert_eq!(
            b.redrive_start("/", "nope").unwrap_err(),
            "no queue \"nope\" in vhost \"/\""
        );
    }
}
