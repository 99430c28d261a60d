//! exchange.declare/delete, queue.declare/purge/delete and the bindings between them:
//! RabbitMQ's checks (reserved names, equivalence of a redeclare, exclusive owners, the
//! queue limit), the exchange and binding limits, and the changes to a vhost's exchanges,
//! queues and binding tables.

use amq_protocol::protocol::{AMQPClass, basic};
use amq_protocol::types::FieldTable;

use super::{check_exclusive, no_exchange, no_queue, no_vhost, queue_limits};
use crate::amqp::codec::put_method;
use crate::amqp::reply::AmqpError;
use crate::broker::delivery::short;
use crate::broker::queue::QueueState;
use crate::broker::routing::{Binding, Destination, ExchangeKind};
use crate::broker::vhost::{Exchange, Queue, VHost};
use crate::broker::{Broker, State};
use crate::policy::{EffectiveQueueSettings, effective_settings};
use crate::rabbit::args::{self, QueueType};

/// queue.declare-ok fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeclaredQueue {
    pub name: String,
    pub message_count: u32,
    pub consumer_count: u32,
}

/// A queue.declare request.
#[derive(Clone, Debug)]
pub struct QueueDeclare<'a> {
    pub name: &'a str,
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: &'a FieldTable,
    /// A definition restored from storage: arguments an earlier version accepted are not
    /// refused now ([`args::check_queue_type_arguments`] applies to clients only).
    pub restored: bool,
}

/// An exchange.declare request.
#[derive(Clone, Debug)]
pub struct ExchangeDeclare<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub passive: bool,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: &'a FieldTable,
}

pub(super) fn server_named_queue() -> String {
    use rand::RngExt;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut rng = rand::rng();
    let suffix: String = (0..22)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("amq.gen-{suffix}")
}

/// The checks bind and unbind share: the source is not the default exchange, the destination
/// exists and is not another connection's exclusive queue.
pub(super) fn check_binding_ends(
    v: &VHost,
    conn: u64,
    vhost: &str,
    source: &str,
    destination: &Destination,
) -> Result<(), AmqpError> {
    if source.is_empty() {
        return Err(AmqpError::access_refused(
            "operation not permitted on the default exchange",
        ));
    }
    match destination {
        Destination::Queue(q) => {
            let queue = v.queues.get(q).ok_or_else(|| no_queue(q, vhost))?;
            check_exclusive(queue, conn, vhost)
        }
        Destination::Exchange(e) if !v.exchanges.contains_key(e) => Err(no_exchange(e, vhost)),
        Destination::Exchange(_) => Ok(()),
    }
}

impl Broker {
    pub fn exchange_declare(
        &self,
        vhost: &str,
        req: &ExchangeDeclare<'_>,
    ) -> Result<(), AmqpError> {
        let mut st = self.lock();
        let max_exchanges = st.options.max_exchanges;
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        if req.name.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        if req.passive {
            return match v.exchanges.get(req.name) {
                Some(_) => Ok(()),
                None => Err(no_exchange(req.name, vhost)),
            };
        }
        let kind: ExchangeKind = req.kind.parse().map_err(|_| {
            AmqpError::command_invalid(format!("invalid exchange type '{}'", req.kind))
        })?;
        // As RabbitMQ: the reserved prefix is checked only for an exchange that does not
        // exist, so an equivalent redeclare of `amq.topic` is declare-ok.
        if let Some(x) = v.exchanges.get(req.name) {
            let mismatch = if x.kind != kind {
                Some((
                    "type",
                    kind.as_str().to_string(),
                    x.kind.as_str().to_string(),
                ))
            } else if x.durable != req.durable {
                Some(("durable", req.durable.to_string(), x.durable.to_string()))
            } else if x.auto_delete != req.auto_delete {
                Some((
                    "auto_delete",
                    req.auto_delete.to_string(),
                    x.auto_delete.to_string(),
                ))
            } else if x.internal != req.internal {
                Some(("internal", req.internal.to_string(), x.internal.to_string()))
            } else {
                None
            };
            if let Some((arg, got, have)) = mismatch {
                return Err(AmqpError::precondition(format!(
                    "inequivalent arg '{arg}' for exchange '{}' in vhost '{vhost}': received '{got}' but current is '{have}'",
                    req.name
                )));
            }
            // The one argument RabbitMQ compares on an exchange redeclare.
            let key = "alternate-exchange";
            if let Some(text) =
                args::mismatch(x.arguments.inner().get(key), req.arguments.inner().get(key))
            {
                return Err(AmqpError::precondition(format!(
                    "inequivalent arg '{key}' for exchange '{}' in vhost '{vhost}': {text}",
                    req.name
                )));
            }
            return Ok(());
        }
        if req.name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "exchange name '{}' contains reserved prefix 'amq.*'",
                req.name
            )));
        }
        if v.declared_exchanges() >= max_exchanges {
            return Err(AmqpError::precondition(format!(
                "exchange limit in vhost '{vhost}' ({max_exchanges}) is reached"
            )));
        }
        v.exchanges.insert(
            req.name.to_string(),
            Exchange::new(
                req.name,
                kind,
                req.durable,
                req.auto_delete,
                req.internal,
                req.arguments.clone(),
            ),
        );
        self.sync_definitions(&mut st);
        Ok(())
    }

    pub fn exchange_delete(
        &self,
        vhost: &str,
        name: &str,
        if_unused: bool,
    ) -> Result<(), AmqpError> {
        let mut st = self.lock();
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        if name.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        if name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "exchange name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let Some(x) = v.exchanges.get(name) else {
            return Ok(());
        };
        if if_unused && !x.bindings.is_empty() {
            return Err(AmqpError::precondition(format!(
                "exchange '{name}' in vhost '{vhost}' in use"
            )));
        }
        Self::delete_exchange_in(v, name);
        self.sync_definitions(&mut st);
        Ok(())
    }

    pub(super) fn delete_exchange_in(v: &mut VHost, name: &str) {
        v.exchanges.remove(name);
        let mut emptied = v.unbind_destination(&Destination::Exchange(name.to_string()));
        while let Some(e) = emptied.pop() {
            if e != name && v.exchanges.remove(&e).is_some() {
                emptied.extend(v.unbind_destination(&Destination::Exchange(e)));
            }
        }
    }

    /// queue.bind / exchange.bind.
    pub fn bind(
        &self,
        conn: u64,
        vhost: &str,
        source: &str,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let mut st = self.lock();
        let max_bindings = st.options.max_bindings;
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        if matches!(&destination, Destination::Exchange(e) if e.is_empty()) {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        check_binding_ends(v, conn, vhost, source, &destination)?;
        let bindings = v.binding_count();
        let x = v
            .exchanges
            .get_mut(source)
            .ok_or_else(|| no_exchange(source, vhost))?;
        if x.kind == ExchangeKind::Headers {
            crate::broker::routing::validate_headers_binding(arguments)
                .map_err(AmqpError::precondition)?;
        }
        // Binding again is a no-op, even at the limit.
        if bindings >= max_bindings && !x.bindings.contains(&destination, routing_key, arguments) {
            return Err(AmqpError::precondition(format!(
                "binding limit in vhost '{vhost}' ({max_bindings}) is reached"
            )));
        }
        x.bindings.add(Binding {
            destination,
            routing_key: routing_key.to_string(),
            arguments: arguments.clone(),
        });
        self.sync_definitions(&mut st);
        Ok(())
    }

    /// queue.unbind / exchange.unbind (unknown bindings are not an error, as RabbitMQ).
    pub fn unbind(
        &self,
        conn: u64,
        vhost: &str,
        source: &str,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let mut st = self.lock();
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        check_binding_ends(v, conn, vhost, source, &destination)?;
        let Some(x) = v.exchanges.get_mut(source) else {
            return Err(no_exchange(source, vhost));
        };
        // Only a binding that was there can leave an auto-delete exchange unused (RabbitMQ:
        // unbinding what is not bound changes nothing).
        let removed = x.bindings.remove(&destination, routing_key, arguments);
        if removed && x.auto_delete && x.bindings.is_empty() {
            let name = source.to_string();
            Self::delete_exchange_in(v, &name);
        }
        self.sync_definitions(&mut st);
        Ok(())
    }

    pub fn queue_declare(
        &self,
        conn: u64,
        vhost: &str,
        req: &QueueDeclare<'_>,
    ) -> Result<DeclaredQueue, AmqpError> {
        let now = self.now();
        let mut st = self.lock();
        let st = &mut *st;
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        if let Some(q) = v.queues.get_mut(req.name) {
            check_exclusive(q, conn, vhost)?;
            if !req.passive {
                let mismatch = if q.durable != req.durable {
                    Some(("durable", req.durable, q.durable))
                } else if q.exclusive_owner.is_some() != req.exclusive {
                    Some(("exclusive", req.exclusive, q.exclusive_owner.is_some()))
                } else if q.auto_delete != req.auto_delete {
                    Some(("auto_delete", req.auto_delete, q.auto_delete))
                } else {
                    None
                };
                if let Some((arg, got, have)) = mismatch {
                    return Err(AmqpError::precondition(format!(
                        "inequivalent arg '{arg}' for queue '{}' in vhost '{vhost}': received '{got}' but current is '{have}'",
                        req.name
                    )));
                }
                args::check_equivalent(&q.arguments, req.arguments, req.name, vhost)
                    .map_err(AmqpError::precondition)?;
                args::check_retry_delays_equivalent(&q.arguments, req.arguments, req.name, vhost)
                    .map_err(AmqpError::precondition)?;
            }
            q.last_used = now;
            let out = DeclaredQueue {
                name: q.name.clone(),
                message_count: q.state.len() as u32,
                consumer_count: q.consumers.len() as u32,
            };
            let name = q.name.clone();
            self.reschedule(st, vhost, &name);
            return Ok(out);
        }
        if req.passive {
            return Err(no_queue(req.name, vhost));
        }
        let name = if req.name.is_empty() {
            server_named_queue()
        } else {
            req.name.to_string()
        };
        if name.starts_with("amq.") && !req.name.is_empty() && !req.restored {
            return Err(AmqpError::access_refused(format!(
                "queue name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let parsed = args::parse_queue_arguments(req.arguments)
            .and_then(|parsed| {
                if !req.restored {
                    args::check_queue_type_arguments(req.arguments, parsed.queue_type)?;
                }
                Ok(parsed)
            })
            .map_err(|e| {
                AmqpError::precondition(
                    e.reply_text(&name, vhost)
                        .trim_start_matches("PRECONDITION_FAILED - "),
                )
            })?;
        if parsed.queue_type == QueueType::Quorum {
            let bad = if !req.durable {
                Some("non-durable")
            } else if req.exclusive {
                Some("exclusive")
            } else if req.auto_delete {
                Some("auto-delete")
            } else {
                None
            };
            if let Some(prop) = bad {
                return Err(AmqpError::precondition(format!(
                    "invalid property '{prop}' for queue '{name}' in vhost '{vhost}'"
                )));
            }
        }
        if v.queues.len() >= st.options.max_queues {
            return Err(AmqpError::precondition(format!(
                "queue limit in vhost '{vhost}' ({}) is reached",
                st.options.max_queues
            )));
        }
        let policy = st.policies.for_queue(vhost, &name);
        let settings = effective_settings(
            &parsed,
            policy.map(|p| &p.definition),
            st.options.default_delivery_limit,
        );
        let id = st.next_id;
        st.next_id += 1;
        let mut queue = Queue {
            id,
            shared_name: std::sync::Arc::from(name.as_str()),
            name: name.clone(),
            durable: req.durable,
            exclusive_owner: req.exclusive.then_some(conn),
            auto_delete: req.auto_delete,
            arguments: req.arguments.clone(),
            args: parsed,
            state: QueueState::new(queue_limits(&settings, st.options.keep_dead_letters)),
            settings,
            retry_hold: Default::default(),
            consumers: Vec::new(),
            next_consumer: 0,
            top_priority: 0,
            unacked: 0,
            had_consumer: false,
            last_used: now,
            timer_at: None,
            depth_gauges: None,
        };
        if let Some(paging) = self.paging()
            && crate::broker::persistence::keeps(&queue)
        {
            queue.state.set_paging(paging.clone());
        }
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        v.queues.insert(name.clone(), queue);
        self.reschedule(st, vhost, &name);
        self.sync_definitions(st);
        Ok(DeclaredQueue {
            name,
            message_count: 0,
            consumer_count: 0,
        })
    }

    /// Effective DLX of an existing queue (for permission checks and the admin API).
    pub fn queue_settings(&self, vhost: &str, queue: &str) -> Option<EffectiveQueueSettings> {
        let st = self.lock();
        st.vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(queue))
            .map(|q| q.settings.clone())
    }

    pub fn queue_purge(&self, conn: u64, vhost: &str, name: &str) -> Result<u32, AmqpError> {
        let mut st = self.lock();
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let q = v
            .queues
            .get_mut(name)
            .ok_or_else(|| no_queue(name, vhost))?;
        check_exclusive(q, conn, vhost)?;
        // Their ids only: a purge reads no paged content back (under the broker lock).
        let gone: Vec<(u64, u64)> = q.state.store_ids().map(|id| (q.id, id)).collect();
        let n = q.state.purge() as u32;
        self.store_removed(gone);
        self.purge_retries(&mut st, vhost, name);
        self.update_depth(&mut st, vhost, name);
        Ok(n)
    }

    pub fn queue_delete(
        &self,
        conn: u64,
        vhost: &str,
        name: &str,
        if_unused: bool,
        if_empty: bool,
    ) -> Result<u32, AmqpError> {
        let mut st = self.lock();
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let Some(q) = v.queues.get(name) else {
            return Ok(0);
        };
        check_exclusive(q, conn, vhost)?;
        if if_unused && !q.consumers.is_empty() {
            return Err(AmqpError::precondition(format!(
                "queue '{name}' in vhost '{vhost}' in use"
            )));
        }
        if if_empty && !q.state.is_empty() {
            return Err(AmqpError::precondition(format!(
                "queue '{name}' in vhost '{vhost}' is not empty"
            )));
        }
        let n = q.state.len() as u32;
        self.delete_queue_locked(&mut st, vhost, name);
        Ok(n)
    }

    /// Deletes a queue without dead-lettering; its consumers get basic.cancel.
    pub(super) fn delete_queue_locked(&self, st: &mut State, vhost: &str, name: &str) {
        let State {
            vhosts,
            channels,
            connections,
            ..
        } = st;
        let Some(v) = vhosts.get_mut(vhost) else {
            return;
        };
        let Some(q) = v.queues.remove(name) else {
            return;
        };
        for c in &q.consumers {
            if let Some(ch) = channels.get_mut(&(c.conn, c.channel))
                && ch.consumers.remove(&c.tag).is_some()
            {
                self.metrics.consumers_ended(1);
            }
            if let Some(conn) = connections.get(&c.conn)
                && conn.cancel_notify
            {
                conn.write_queue.push(|out| {
                    put_method(
                        out,
                        c.channel,
                        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                            consumer_tag: short(&c.tag),
                            nowait: true,
                        })),
                    )
                });
            }
        }
        let mut emptied = v.unbind_destination(&Destination::Queue(name.to_string()));
        while let Some(e) = emptied.pop() {
            if v.exchanges.remove(&e).is_some() {
                emptied.extend(v.unbind_destination(&Destination::Exchange(e)));
            }
        }
        self.metrics.remove_queue(vhost, name);
        self.sync_definitions(st);
    }
}

#[cfg(test)]
mod tests;
