//! The client's AMQP methods as operations on the broker state, one per method family:
//! exchanges, queues, bindings, publish, consume, get, settle, and channel/connection
//! teardown. (Proxy mode's `proxy::ops` is something else: its publishes awaiting a confirm.)
//!
//! Each public method takes the broker lock once, validates like RabbitMQ (same reply codes
//! and texts), changes state, and writes any resulting deliveries into the write queues.
//! Permission checks happen in the server layer before these are called.

use std::collections::BTreeMap;
use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic};
use amq_protocol::types::FieldTable;

use super::delivery::{delivery_properties, short, write_deliver, write_get_ok};
use super::message::Message;
use super::queue::{Death, PublishOutcome, QueueLimits, QueueState};
use super::routing::{Binding, Destination, ExchangeKind};
use super::vhost::{Consumer, Exchange, Queue, VHost};
use super::{Broker, ChannelState, ConnectionState, State, Unacked};
use crate::amqp::codec::put_method;
use crate::amqp::reply::AmqpError;
use crate::deadletter::DeadLetterReason;
use crate::policy::{EffectiveQueueSettings, effective_settings};
use crate::rabbit::args::{self, QueueType};

use super::write_queue::WriteQueue;

/// Result of a publish, for confirms and mandatory returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishResult {
    /// At least one queue received the message.
    pub routed: bool,
    /// A queue refused it (reject-publish): the publisher gets basic.nack.
    pub rejected: bool,
}

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

fn no_vhost(vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no vhost '{vhost}'"))
}

fn no_queue(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no queue '{name}' in vhost '{vhost}'"))
}

fn no_exchange(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no exchange '{name}' in vhost '{vhost}'"))
}

fn locked(name: &str, vhost: &str) -> AmqpError {
    AmqpError::resource_locked(format!(
        "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
    ))
}

fn unknown_tag(tag: u64) -> AmqpError {
    AmqpError::precondition(format!("unknown delivery tag {tag}"))
}

/// Limits a queue enforces from its effective settings.
pub fn queue_limits(s: &EffectiveQueueSettings) -> QueueLimits {
    QueueLimits {
        message_ttl: s.message_ttl,
        max_length: s.max_length,
        max_length_bytes: s.max_length_bytes,
        overflow: s.overflow,
        delivery_limit: s.delivery_limit,
    }
}

fn check_exclusive(q: &Queue, conn: u64, vhost: &str) -> Result<(), AmqpError> {
    match q.exclusive_owner {
        Some(owner) if owner != conn => Err(locked(&q.name, vhost)),
        _ => Ok(()),
    }
}

fn server_named_queue() -> String {
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
fn check_binding_ends(
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

/// Picks the next consumer of `q` that can take a delivery now (round robin).
fn pick_consumer(
    q: &Queue,
    channels: &std::collections::HashMap<(u64, u16), ChannelState>,
    connections: &std::collections::HashMap<u64, ConnectionState>,
) -> Option<usize> {
    let n = q.consumers.len();
    for i in 0..n {
        let idx = (q.next_consumer + i) % n;
        let c = &q.consumers[idx];
        let Some(ch) = channels.get(&(c.conn, c.channel)) else {
            continue;
        };
        if !ch.active {
            continue;
        }
        let Some(conn) = connections.get(&c.conn) else {
            continue;
        };
        if conn.write_queue.is_full() {
            conn.write_queue.mark_starved();
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
        return Some(idx);
    }
    None
}

/// Writes one delivery to consumer `idx` of `q` and records it as unacked.
fn deliver_to(
    q: &mut Queue,
    idx: usize,
    entry: super::message::QueuedMessage,
    channels: &mut std::collections::HashMap<(u64, u16), ChannelState>,
    connections: &std::collections::HashMap<u64, ConnectionState>,
    metrics: &crate::metrics::Metrics,
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
    if !c.no_ack {
        c.unacked += 1;
        metrics.add_inflight(1, entry.body_len() as i64);
        ch.unacked.insert(
            tag,
            Unacked {
                queue: queue_name,
                queue_id,
                entry,
                consumer_tag: Some(c.tag.clone()),
            },
        );
        q.unacked += 1;
    }
    q.next_consumer = idx + 1;
    true
}

impl Broker {
    // ---------------------------------------------------------------- connections/channels

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

    fn close_channel_locked(&self, st: &mut State, conn: u64, channel: u16, now: u64) {
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

    // ---------------------------------------------------------------- exchanges

    pub fn exchange_declare(
        &self,
        vhost: &str,
        req: &ExchangeDeclare<'_>,
    ) -> Result<(), AmqpError> {
        let mut st = self.lock();
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
        if req.name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "exchange name '{}' contains reserved prefix 'amq.*'",
                req.name
            )));
        }
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
            return Ok(());
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
        Ok(())
    }

    fn delete_exchange_in(v: &mut VHost, name: &str) {
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
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        if matches!(&destination, Destination::Exchange(e) if e.is_empty()) {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        check_binding_ends(v, conn, vhost, source, &destination)?;
        let x = v
            .exchanges
            .get_mut(source)
            .ok_or_else(|| no_exchange(source, vhost))?;
        if x.kind == ExchangeKind::Headers {
            super::routing::validate_headers_binding(arguments).map_err(AmqpError::precondition)?;
        }
        x.bindings.add(Binding {
            destination,
            routing_key: routing_key.to_string(),
            arguments: arguments.clone(),
        });
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
        x.bindings.remove(&destination, routing_key, arguments);
        if x.auto_delete && x.bindings.is_empty() {
            let name = source.to_string();
            Self::delete_exchange_in(v, &name);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- queues

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
        if name.starts_with("amq.") && !req.name.is_empty() {
            return Err(AmqpError::access_refused(format!(
                "queue name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let parsed = args::parse_queue_arguments(req.arguments).map_err(|e| {
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
        let queue = Queue {
            id,
            shared_name: std::sync::Arc::from(name.as_str()),
            name: name.clone(),
            durable: req.durable,
            exclusive_owner: req.exclusive.then_some(conn),
            auto_delete: req.auto_delete,
            arguments: req.arguments.clone(),
            args: parsed,
            state: QueueState::new(queue_limits(&settings)),
            settings,
            consumers: Vec::new(),
            next_consumer: 0,
            unacked: 0,
            had_consumer: false,
            last_used: now,
            timer_at: None,
            depth_gauges: None,
        };
        let v = st.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        v.queues.insert(name.clone(), queue);
        self.reschedule(st, vhost, &name);
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
        let n = q.state.purge() as u32;
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
    fn delete_queue_locked(&self, st: &mut State, vhost: &str, name: &str) {
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
            if let Some(ch) = channels.get_mut(&(c.conn, c.channel)) {
                ch.consumers.remove(&c.tag);
            }
            if let Some(conn) = connections.get(&c.conn) {
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
    }

    // ---------------------------------------------------------------- publish

    /// Routes a message from `exchange` and enqueues it in every queue it reaches.
    pub fn publish(
        &self,
        vhost: &str,
        exchange: &str,
        message: Arc<Message>,
        headers: Option<&FieldTable>,
    ) -> Result<PublishResult, AmqpError> {
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
        for q in &targets {
            if self
                .enqueue(&mut st, vhost, q, message.clone(), now, &mut deaths)
                .is_some_and(PublishOutcome::is_rejected)
            {
                result.rejected = true;
            }
        }
        self.metrics.published(1);
        for (q, d) in deaths {
            self.process_deaths(&mut st, vhost, &q, d, now);
        }
        for q in &targets {
            self.reschedule(&mut st, vhost, q);
            self.update_depth(&mut st, vhost, q);
        }
        Ok(result)
    }

    /// Puts a message into one queue: straight to a waiting consumer when the queue is empty,
    /// else at the tail under the queue's limits.
    pub(crate) fn enqueue(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        message: Arc<Message>,
        now: u64,
        deaths: &mut Vec<(String, Vec<Death>)>,
    ) -> Option<PublishOutcome> {
        let State {
            vhosts,
            channels,
            connections,
            ..
        } = st;
        let q = vhosts.get_mut(vhost)?.queues.get_mut(queue)?;
        let entry = q.state.admit(message, now);
        // As RabbitMQ: reject-publish(-dlx) refuses first; otherwise a waiting consumer gets
        // the message before drop-head or TTL look at it (even with x-max-length = 0).
        if q.state.is_empty()
            && !q.consumers.is_empty()
            && !q.state.refuses(&entry)
            && let Some(idx) = pick_consumer(q, channels, connections)
        {
            deliver_to(q, idx, entry, channels, connections, &self.metrics);
            self.metrics.delivered(1);
            return Some(PublishOutcome::Accepted);
        }
        let mut died = Vec::new();
        let outcome = q.state.publish(entry, now, &mut died);
        if !died.is_empty() {
            deaths.push((queue.to_string(), died));
        }
        Some(outcome)
    }

    // ---------------------------------------------------------------- consume

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
        let tag = if tag.is_empty() {
            let id = st.next_id();
            format!("amq.ctag-{id:016x}")
        } else {
            tag.to_string()
        };
        let (prefetch, dup) = match st.channels.get(&(conn, channel)) {
            Some(ch) => (ch.consumer_prefetch, ch.consumers.contains_key(&tag)),
            None => return Err(AmqpError::channel_error("channel is not open")),
        };
        if dup {
            return Err(AmqpError::not_allowed(format!(
                "attempt to reuse consumer tag '{tag}'"
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
            tag: tag.clone(),
            conn,
            channel,
            no_ack,
            exclusive,
            prefetch,
            unacked: 0,
            priority,
        });
        q.had_consumer = true;
        q.last_used = now;
        if let Some(ch) = st.channels.get_mut(&(conn, channel)) {
            ch.consumers.insert(tag.clone(), queue.to_string());
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
        let vhost = ch.vhost.clone();
        self.remove_consumer(&mut st, &vhost, &queue, conn, channel, tag, now);
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn remove_consumer(
        &self,
        st: &mut State,
        vhost: &str,
        queue: &str,
        conn: u64,
        channel: u16,
        tag: &str,
        now: u64,
    ) {
        let Some(q) = st
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
        else {
            return;
        };
        q.consumers
            .retain(|c| !(c.conn == conn && c.channel == channel && c.tag == tag));
        q.last_used = now;
        if q.consumers.is_empty() && q.auto_delete && q.had_consumer {
            self.delete_queue_locked(st, vhost, queue);
        } else {
            self.reschedule(st, vhost, queue);
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
                    if !no_ack {
                        self.metrics.add_inflight(1, entry.body_len() as i64);
                        ch.unacked.insert(
                            tag,
                            Unacked {
                                queue: q.shared_name.clone(),
                                queue_id: q.id,
                                entry,
                                consumer_tag: None,
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
        }
        if !deaths.is_empty() {
            self.process_deaths(st, vhost, queue, deaths, now);
        }
        self.reschedule(st, vhost, queue);
        self.update_depth(st, vhost, queue);
        Ok(())
    }

    // ---------------------------------------------------------------- settlement

    /// Removes the deliveries a settlement covers, in delivery-tag order.
    fn take_unacked(
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
        let taken: Vec<Unacked> = if multiple {
            if tag == 0 {
                std::mem::take(&mut ch.unacked).into_values().collect()
            } else {
                if !ch.unacked.contains_key(&tag) {
                    return Err(unknown_tag(tag));
                }
                let rest = ch.unacked.split_off(&(tag + 1));
                std::mem::replace(&mut ch.unacked, rest)
                    .into_values()
                    .collect()
            }
        } else {
            match ch.unacked.remove(&tag) {
                Some(u) => vec![u],
                None => return Err(unknown_tag(tag)),
            }
        };
        self.release_counters(st, &vhost, conn, channel, &taken);
        Ok((vhost, taken))
    }

    /// Frees the queue's and the consumer's unacked counters of deliveries leaving a channel
    /// (settled, requeued or returned on close). Called exactly once per delivery.
    fn release_counters(
        &self,
        st: &mut State,
        vhost: &str,
        conn: u64,
        channel: u16,
        taken: &[Unacked],
    ) {
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
                if let Some(ct) = &u.consumer_tag
                    && let Some(c) = q
                        .consumers
                        .iter_mut()
                        .find(|c| &c.tag == ct && c.conn == conn && c.channel == channel)
                {
                    c.unacked = c.unacked.saturating_sub(1);
                }
            }
        }
    }

    fn queues_of(taken: &[Unacked]) -> Vec<String> {
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
        for q in Self::queues_of(&taken) {
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
        let queues = Self::queues_of(&taken);
        if requeue {
            self.requeue_unacked(&mut st, &vhost, taken, now);
        } else {
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
                let death = Death {
                    entry: u.entry,
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
        Ok(())
    }

    /// Returns deliveries to their queues (grouped per queue, original order kept). Their
    /// unacked counters must already be released ([`Self::release_counters`]).
    fn requeue_unacked(&self, st: &mut State, vhost: &str, taken: Vec<Unacked>, now: u64) {
        let mut by_queue: BTreeMap<String, Vec<Unacked>> = BTreeMap::new();
        for u in taken {
            by_queue.entry(u.queue.to_string()).or_default().push(u);
        }
        for (qname, list) in by_queue {
            let mut deaths = Vec::new();
            {
                let Some(q) = st
                    .vhosts
                    .get_mut(vhost)
                    .and_then(|v| v.queues.get_mut(&qname))
                else {
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

    // ---------------------------------------------------------------- dispatch & timers

    /// Delivers ready messages of a queue to consumers with capacity.
    pub(crate) fn dispatch(&self, st: &mut State, vhost: &str, queue: &str, now: u64) {
        let mut deaths = Vec::new();
        let mut delivered = 0u64;
        {
            let State {
                vhosts,
                channels,
                connections,
                ..
            } = &mut *st;
            let Some(q) = vhosts.get_mut(vhost).and_then(|v| v.queues.get_mut(queue)) else {
                return;
            };
            while !q.state.is_empty() && !q.consumers.is_empty() {
                let Some(idx) = pick_consumer(q, channels, connections) else {
                    break;
                };
                let Some(entry) = q.state.pop(now, &mut deaths) else {
                    break;
                };
                if deliver_to(q, idx, entry, channels, connections, &self.metrics) {
                    delivered += 1;
                }
            }
        }
        if delivered > 0 {
            self.metrics.delivered(delivered);
        }
        if !deaths.is_empty() {
            self.process_deaths(st, vhost, queue, deaths, now);
        }
        self.reschedule(st, vhost, queue);
        self.update_depth(st, vhost, queue);
    }

    /// Makes sure the timer heap holds this queue's next deadline.
    pub(crate) fn reschedule(&self, st: &mut State, vhost: &str, queue: &str) {
        let Some(q) = st
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
        else {
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

    fn update_depth(&self, st: &mut State, vhost: &str, queue: &str) {
        if let Some(q) = st
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
        {
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
            let policy_def = st.policies.for_queue(&v, &qn).map(|p| p.definition.clone());
            let mut deaths = Vec::new();
            if let Some(q) = st.vhosts.get_mut(&v).and_then(|vh| vh.queues.get_mut(&qn)) {
                let settings = effective_settings(&q.args, policy_def.as_ref(), default_limit);
                if settings != q.settings {
                    q.state
                        .set_limits(queue_limits(&settings), now, &mut deaths);
                    q.settings = settings;
                    q.timer_at = None;
                }
            }
            if !deaths.is_empty() {
                self.process_deaths(&mut st, &v, &qn, deaths, now);
            }
            self.reschedule(&mut st, &v, &qn);
            self.update_depth(&mut st, &v, &qn);
        }
    }
}

/// Called by [`Broker::run_timers`] for a due queue deadline.
pub(super) fn on_timer(b: &Broker, st: &mut State, vhost: &str, queue: &str, id: u64, now: u64) {
    let mut deaths = Vec::new();
    let expire_queue = {
        let Some(q) = st
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
        else {
            return;
        };
        if q.id != id {
            return;
        }
        q.timer_at = None;
        if q.expiry_deadline().is_some_and(|at| at <= now) {
            true
        } else {
            q.state.expire(now, &mut deaths);
            false
        }
    };
    if expire_queue {
        b.delete_queue_locked(st, vhost, queue);
        return;
    }
    if !deaths.is_empty() {
        b.process_deaths(st, vhost, queue, deaths, now);
    }
    b.reschedule(st, vhost, queue);
    b.update_depth(st, vhost, queue);
}
