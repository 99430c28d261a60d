//! The broker's side of durable storage ([`crate::storage`]): which queues and messages are
//! kept (durable, non-exclusive queues; persistent messages), the records each operation
//! writes, the definitions snapshot after every change to them, and loading the
//! [`Recovered`] state at start.
//!
//! Records are sent under the broker lock, so the storage thread sees them in the order the
//! state changed. Only a publish waits (its confirm is sent once the record is stable);
//! removals, deliveries and dead-letter moves are written lazily.

use std::collections::HashMap;
use std::sync::Arc;

use super::message::Message;
use super::methods::{ExchangeDeclare, QueueDeclare};
use super::paging::{Paging, ReadFailure};
use super::retry_hold::HeldMessage;
use super::routing::Destination;
use super::vhost::Queue;
use super::{Broker, State};
use crate::storage::definitions::{BindingDef, ExchangeDef, QueueDef};
use crate::storage::{Definitions, Durable, Record, Recovered, Storage};

/// Whether a queue's persistent messages are kept on disk.
pub(crate) fn keeps(q: &Queue) -> bool {
    q.durable && q.exclusive_owner.is_none()
}

/// Exchanges every vhost has without being declared (never stored).
fn builtin(exchange: &str) -> bool {
    exchange.is_empty() || exchange.starts_with("amq.")
}

/// The durable definitions of the whole broker, in a stable order.
fn definitions_of(st: &State) -> Definitions {
    let mut defs = Definitions::default();
    let mut vhosts: Vec<_> = st.vhosts.values().collect();
    vhosts.sort_by(|a, b| a.name.cmp(&b.name));
    for v in vhosts {
        let durable_exchange = |name: &str| v.exchanges.get(name).is_some_and(|x| x.durable);
        let mut exchanges: Vec<_> = v.exchanges.values().collect();
        exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        for x in exchanges {
            if !x.durable || x.name.is_empty() {
                continue;
            }
            if !builtin(&x.name) {
                defs.exchanges.push(ExchangeDef {
                    vhost: v.name.clone(),
                    name: x.name.clone(),
                    kind: x.kind.as_str().to_string(),
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: x.arguments.clone(),
                });
            }
            let mut bindings: Vec<BindingDef> = x
                .bindings
                .bindings()
                .filter_map(|b| {
                    let (to_queue, destination) = match &b.destination {
                        Destination::Queue(q) => (true, q),
                        Destination::Exchange(e) => (false, e),
                    };
                    let durable = if to_queue {
                        v.queues.get(destination).is_some_and(keeps)
                    } else {
                        durable_exchange(destination)
                    };
                    durable.then(|| BindingDef {
                        vhost: v.name.clone(),
                        source: x.name.clone(),
                        to_queue,
                        destination: destination.clone(),
                        routing_key: b.routing_key.clone(),
                        arguments: b.arguments.clone(),
                    })
                })
                .collect();
            bindings.sort_by(|a, b| {
                (a.to_queue, &a.destination, &a.routing_key).cmp(&(
                    b.to_queue,
                    &b.destination,
                    &b.routing_key,
                ))
            });
            defs.bindings.extend(bindings);
        }
        let mut queues: Vec<_> = v.queues.values().filter(|q| keeps(q)).collect();
        queues.sort_by(|a, b| a.name.cmp(&b.name));
        defs.queues.extend(queues.into_iter().map(|q| QueueDef {
            vhost: v.name.clone(),
            name: q.name.clone(),
            id: q.id,
            auto_delete: q.auto_delete,
            arguments: q.arguments.clone(),
        }));
    }
    let kept = &st.unrestored_definitions;
    defs.exchanges.extend(kept.exchanges.iter().cloned());
    defs.queues.extend(kept.queues.iter().cloned());
    defs.bindings.extend(kept.bindings.iter().cloned());
    defs.policies = st.runtime_policies.clone();
    defs
}

impl Broker {
    /// The attached storage, if any.
    pub fn storage(&self) -> Option<&Storage> {
        self.storage.get().map(|s| &**s)
    }

    /// The paging account (with storage attached).
    pub fn paging(&self) -> Option<&Arc<Paging>> {
        self.paging.get()
    }

    /// Hands storage the definitions snapshot when the durable definitions changed.
    pub(crate) fn sync_definitions(&self, st: &mut State) {
        let Some(storage) = self.storage() else {
            return;
        };
        let defs = definitions_of(st);
        if st.stored_definitions.as_ref() == Some(&defs) {
            return;
        }
        storage.definitions(defs.clone());
        st.stored_definitions = Some(defs);
    }

    /// Keeps the runtime policies (admin API) in the definitions snapshot. The caller applies
    /// them ([`Broker::apply_policies`]); this only records them.
    pub fn set_runtime_policies(&self, policies: Vec<crate::config::PolicyConfig>) {
        let mut st = self.lock();
        st.runtime_policies = policies;
        self.sync_definitions(&mut st);
    }

    /// A message id when `message` is kept in queue `q`.
    pub(crate) fn store_id_for(&self, q: &Queue, message: &Message) -> Option<u64> {
        let storage = self.storage()?;
        (message.persistent && keeps(q)).then(|| storage.next_id())
    }

    /// Writes the record of a message that entered the queues in `st.persist_targets` at
    /// broker time `now` (and left `remove`, for a dead-letter move). With `durable`, the
    /// answer comes once it is on stable storage.
    pub(crate) fn store_published(
        &self,
        st: &mut State,
        message: Arc<Message>,
        remove: Option<(u64, u64)>,
        now: u64,
        durable: bool,
    ) -> Option<Durable> {
        let targets = std::mem::take(&mut st.persist_targets);
        let storage = self.storage()?;
        if targets.is_empty() {
            if let Some(item) = remove {
                storage.append(Record::Remove { items: vec![item] });
            }
            return None;
        }
        let record = Record::Publish {
            targets,
            remove,
            message,
            at: Some(self.wall_ms(now)),
            held_until: None,
        };
        if durable {
            Some(storage.append_durable(record))
        } else {
            storage.append(record);
            None
        }
    }

    /// Writes the move of a rejected delivery (`remove`) into its queue's retry hold as
    /// message `id` of `queue`, due back at broker time `due`: one record, so after a crash the
    /// message is either still the delivery (it comes back redelivered) or held, never lost.
    pub(crate) fn store_held(
        &self,
        queue: u64,
        id: u64,
        remove: Option<(u64, u64)>,
        message: Arc<Message>,
        now: u64,
        due: u64,
    ) {
        if let Some(storage) = self.storage() {
            storage.append(Record::Publish {
                targets: vec![crate::storage::Target {
                    queue,
                    id,
                    delivered: false,
                }],
                remove,
                message,
                at: Some(self.wall_ms(now)),
                held_until: Some(self.wall_ms(due)),
            });
        }
    }

    /// Writes that messages `(queue id, message id)` are gone.
    pub(crate) fn store_removed(&self, items: Vec<(u64, u64)>) {
        if let Some(storage) = self.storage()
            && !items.is_empty()
        {
            storage.append(Record::Remove { items });
        }
    }

    /// Loads what recovery found (definitions, then each queue's messages in order) and
    /// attaches `storage` for everything that follows. The stored runtime policies are kept
    /// in later snapshots; the caller applies them before (so that restored queues get their
    /// limits and TTL from them).
    pub fn restore(&self, recovered: Recovered, storage: Arc<Storage>) {
        let defs = &recovered.definitions;
        {
            let mut st = self.lock();
            st.next_id = st.next_id.max(recovered.next_queue_id);
        }
        let mut unrestored = Definitions::default();
        for x in &defs.exchanges {
            let req = ExchangeDeclare {
                name: &x.name,
                kind: &x.kind,
                passive: false,
                durable: true,
                auto_delete: x.auto_delete,
                internal: x.internal,
                arguments: &x.arguments,
            };
            if let Err(e) = self.exchange_declare(&x.vhost, &req) {
                tracing::warn!(vhost = %x.vhost, exchange = %x.name, error = %e.text, "stored exchange not restored (kept on disk)");
                unrestored.exchanges.push(x.clone());
            }
        }
        let mut names: HashMap<u64, (String, String)> = HashMap::new();
        for q in &defs.queues {
            let req = QueueDeclare {
                name: &q.name,
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: q.auto_delete,
                arguments: &q.arguments,
                restored: true,
            };
            match self.queue_declare(0, &q.vhost, &req) {
                Ok(_) => {
                    let mut st = self.lock();
                    if let Some(queue) = st.queue_mut(&q.vhost, &q.name) {
                        queue.id = q.id;
                        queue.timer_at = None;
                    }
                    st.next_id = st.next_id.max(q.id + 1);
                    self.reschedule(&mut st, &q.vhost, &q.name);
                    names.insert(q.id, (q.vhost.clone(), q.name.clone()));
                }
                Err(e) => {
                    tracing::warn!(vhost = %q.vhost, queue = %q.name, error = %e.text, "stored queue not restored (kept on disk with its messages)");
                    unrestored.queues.push(q.clone());
                    let mut st = self.lock();
                    st.next_id = st.next_id.max(q.id + 1);
                }
            }
        }
        for b in &defs.bindings {
            let destination = if b.to_queue {
                Destination::Queue(b.destination.clone())
            } else {
                Destination::Exchange(b.destination.clone())
            };
            if let Err(e) = self.bind(
                0,
                &b.vhost,
                &b.source,
                destination,
                &b.routing_key,
                &b.arguments,
            ) {
                tracing::warn!(vhost = %b.vhost, source = %b.source, destination = %b.destination, error = %e.text, "stored binding not restored (kept on disk)");
                unrestored.bindings.push(b.clone());
            }
        }
        let paging = Paging::new(storage.clone(), storage.paging_budget());
        let _ = self.storage.set(storage);
        let _ = self.paging.set(paging.clone());
        let now = self.now();
        let mut st = self.lock();
        for (vhost, name) in names.values() {
            if let Some(q) = st.queue_mut(vhost, name) {
                q.state.set_paging(paging.clone());
            }
        }
        self.metrics.set_paging(&paging.stats());
        st.unrestored_definitions = unrestored;
        st.runtime_policies = defs.policies.clone();
        self.sync_definitions(&mut st);
        // Every queue gets its messages back before any of them dies, so a dead letter made
        // at start goes after the messages its target already held.
        let mut deaths = Vec::new();
        for (queue_id, messages) in recovered.queues {
            let Some((vhost, name)) = names.get(&queue_id) else {
                continue;
            };
            let mut died = Vec::new();
            let mut unreadable = Vec::new();
            let mut held = 0;
            if let Some(q) = st.queue_mut(vhost, name) {
                for m in messages {
                    // Held for a retry tier: held again until its due time (at once if past).
                    // Held messages are kept whole (never paged): read back now; one that
                    // cannot be read for good is lost (logged and counted by the paging
                    // account), one that cannot be read now joins the queue paged (back
                    // before its due time rather than lost).
                    if let Some(until) = m.held_until {
                        match paging.read(m.id, false) {
                            Ok(message) => {
                                let message = HeldMessage {
                                    message,
                                    store_id: Some(m.id),
                                };
                                q.retry_hold.hold(self.broker_ms(until), message);
                                held += 1;
                                continue;
                            }
                            Err(ReadFailure::Permanent) => {
                                unreadable.push((queue_id, m.id));
                                continue;
                            }
                            Err(ReadFailure::Transient) => {}
                        }
                    }
                    // Its TTL counts from when it entered the queue, before the restart.
                    let entered = m.at.map_or(now, |at| self.broker_ms(at).min(now));
                    // Paged: the content stays on disk until it is needed. Time `entered`:
                    // nothing expires while the queue is loaded.
                    q.state
                        .restore_paged(m.id, m.meta, entered, m.deliveries, now, &mut died);
                }
            }
            self.store_removed(unreadable);
            if held > 0 {
                self.metrics.add_retry_held(vhost, name, held);
            }
            deaths.push((vhost, name, died));
        }
        // Messages whose TTL ran out while the broker was down die now (`expired`).
        for (vhost, name, died) in &mut deaths {
            if let Some(q) = st.queue_mut(vhost, name) {
                q.state.expire(now, died);
            }
        }
        for (vhost, name, died) in deaths {
            self.process_deaths(&mut st, vhost, name, died, now);
        }
        for (vhost, name) in names.values() {
            self.reschedule(&mut st, vhost, name);
            self.update_depth(&mut st, vhost, name);
        }
        let stats = &recovered.stats;
        tracing::info!(
            queues = names.len(),
            messages = stats.messages,
            segments = stats.segments,
            torn_bytes = stats.torn_bytes,
            damaged_records = stats.damaged_records,
            orphans = stats.orphans,
            "storage recovered"
        );
    }
}

#[cfg(test)]
mod tests;
