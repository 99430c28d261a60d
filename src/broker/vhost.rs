//! One virtual host: its exchanges, queues and bindings, and routing through them.
//!
//! Routing follows RabbitMQ: the default exchange routes a key to the queue of that name,
//! exchange-to-exchange bindings are followed (each exchange visited once), and an exchange
//! that routes to no queue hands the message to its `alternate-exchange`.

use std::collections::{HashMap, HashSet};

use amq_protocol::types::{AMQPValue, FieldTable};

use super::queue::QueueState;
use super::retry_hold::RetryHold;
use super::routing::{BindingTable, Destination, ExchangeKind};
use crate::policy::EffectiveQueueSettings;
use crate::rabbit::args::QueueArguments;

/// An exchange and the bindings that have it as their source.
pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    pub bindings: BindingTable,
}

impl Exchange {
    pub fn new(
        name: &str,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Self {
        Exchange {
            name: name.to_string(),
            kind,
            durable,
            auto_delete,
            internal,
            arguments,
            bindings: BindingTable::new(kind),
        }
    }

    /// The `alternate-exchange` argument, if any.
    pub fn alternate_exchange(&self) -> Option<&str> {
        match self.arguments.inner().get("alternate-exchange") {
            Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes()).ok(),
            Some(AMQPValue::ShortString(s)) => Some(s.as_str()),
            _ => None,
        }
    }
}

/// A consumer attached to a queue.
#[derive(Debug, Clone)]
pub struct Consumer {
    /// Unique in the broker: a tag can be used again once its consumer is cancelled, and the
    /// deliveries the old one left unacked must not count against the new one.
    pub id: u64,
    pub tag: String,
    pub conn: u64,
    pub channel: u16,
    pub no_ack: bool,
    pub exclusive: bool,
    /// Per-consumer prefetch (0 = unlimited), fixed when the consumer was created.
    pub prefetch: u16,
    pub unacked: u32,
    pub priority: i32,
}

/// A queue: metadata, effective settings, ready messages and consumers.
#[derive(Debug)]
pub struct Queue {
    pub id: u64,
    pub name: String,
    /// The name again, shared by the queue's unacked deliveries.
    pub shared_name: std::sync::Arc<str>,
    pub durable: bool,
    pub exclusive_owner: Option<u64>,
    pub auto_delete: bool,
    /// The arguments as declared (for redeclare equivalence).
    pub arguments: FieldTable,
    pub args: QueueArguments,
    pub settings: EffectiveQueueSettings,
    pub state: QueueState,
    /// Messages rejected into a retry tier, waiting for their delay (not in `state`).
    pub retry_hold: RetryHold,
    pub consumers: Vec<Consumer>,
    /// Round-robin position among consumers.
    pub next_consumer: usize,
    /// The highest `x-priority` among `consumers` (0 with none): a consumer of that priority
    /// with capacity ends the dispatcher's search at once.
    pub top_priority: i32,
    /// Deliveries out and not yet settled.
    pub unacked: usize,
    /// Set once a consumer attached (auto-delete applies only after that).
    pub had_consumer: bool,
    /// Broker milliseconds of the last use, for x-expires.
    pub last_used: u64,
    /// The deadline this queue currently has in the broker's timer heap.
    pub timer_at: Option<u64>,
    /// Its depth gauges, resolved once (None while folded by the label cap).
    pub depth_gauges: Option<crate::metrics::QueueDepthGauges>,
}

impl Queue {
    /// The earliest time something must happen to this queue on its own (head expiry, the
    /// return of a held retry, the next read of a paged message whose read failed, or the
    /// queue's own expiry).
    pub fn next_deadline(&mut self) -> Option<u64> {
        [
            self.state.next_expiry(),
            self.state.next_read_retry(),
            self.retry_hold.next_due(),
            self.expiry_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether deliveries carry `x-delivery-count` (queues that count deliveries).
    pub fn counts_deliveries(&self) -> bool {
        self.settings.delivery_limit.is_some()
            || self.args.queue_type == crate::rabbit::args::QueueType::Quorum
    }

    /// Recomputes [`Queue::top_priority`] after consumers changed.
    pub fn consumers_changed(&mut self) {
        self.top_priority = self.consumers.iter().map(|c| c.priority).max().unwrap_or(0);
    }

    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// When the queue expires for being unused (x-expires), if it can.
    pub fn expiry_deadline(&self) -> Option<u64> {
        let expires = self.settings.expires?;
        if !self.consumers.is_empty() {
            return None;
        }
        Some(self.last_used.saturating_add(expires))
    }
}

/// Exchanges and queues of one vhost.
pub struct VHost {
    pub name: String,
    pub exchanges: HashMap<String, Exchange>,
    pub queues: HashMap<String, Queue>,
}

/// The exchanges every vhost starts with.
pub const PREDECLARED: [(&str, ExchangeKind); 6] = [
    ("amq.direct", ExchangeKind::Direct),
    ("amq.fanout", ExchangeKind::Fanout),
    ("amq.topic", ExchangeKind::Topic),
    ("amq.headers", ExchangeKind::Headers),
    ("amq.match", ExchangeKind::Headers),
    ("amq.rabbitmq.trace", ExchangeKind::Topic),
];

impl VHost {
    pub fn new(name: &str) -> Self {
        let mut exchanges = HashMap::new();
        exchanges.insert(
            String::new(),
            Exchange::new(
                "",
                ExchangeKind::Direct,
                true,
                false,
                false,
                FieldTable::default(),
            ),
        );
        for (n, kind) in PREDECLARED {
            let internal = n == "amq.rabbitmq.trace";
            exchanges.insert(
                n.to_string(),
                Exchange::new(n, kind, true, false, internal, FieldTable::default()),
            );
        }
        VHost {
            name: name.to_string(),
            exchanges,
            queues: HashMap::new(),
        }
    }

    /// Exchanges clients declared: all but the default exchange and the predeclared amq.*
    /// ones (what `limits.max_exchanges` bounds).
    pub fn declared_exchanges(&self) -> usize {
        self.exchanges.len().saturating_sub(PREDECLARED.len() + 1)
    }

    /// Bindings of all the exchanges of this vhost (what `limits.max_bindings` bounds).
    pub fn binding_count(&self) -> usize {
        self.exchanges.values().map(|x| x.bindings.len()).sum()
    }

    /// Queues a message reaches from `exchange` with the given keys (publish key + CC + BCC).
    /// Returns an empty list when the exchange does not exist.
    pub fn route(
        &self,
        exchange: &str,
        keys: &[&str],
        headers: Option<&FieldTable>,
    ) -> Vec<String> {
        let mut queues: Vec<String> = Vec::new();
        if exchange.is_empty() {
            for k in keys {
                if self.queues.contains_key(*k) && !queues.iter().any(|q| q == k) {
                    queues.push(k.to_string());
                }
            }
            return queues;
        }
        let mut visited: HashSet<&str> = HashSet::new();
        let mut pending: Vec<&str> = vec![exchange];
        let mut dests = Vec::new();
        while let Some(name) = pending.pop() {
            if !visited.insert(name) {
                continue;
            }
            let Some(x) = self.exchanges.get(name) else {
                continue;
            };
            dests.clear();
            x.bindings.route(keys, headers, &mut dests);
            // As RabbitMQ: the alternate exchange takes a message the exchange's own bindings
            // did not match, whether or not what they matched was already reached.
            let matched = !dests.is_empty();
            for d in dests.drain(..) {
                match d {
                    Destination::Queue(q) => {
                        if self.queues.contains_key(&q) && !queues.contains(&q) {
                            queues.push(q);
                        }
                    }
                    Destination::Exchange(e) => {
                        if let Some((k, _)) = self.exchanges.get_key_value(&e) {
                            pending.push(k.as_str());
                        }
                    }
                }
            }
            if !matched
                && let Some(ae) = x.alternate_exchange()
                && let Some((k, _)) = self.exchanges.get_key_value(ae)
            {
                pending.push(k.as_str());
            }
        }
        queues
    }

    /// True if some exchange binds to `destination` (for exchange auto-delete and if-unused).
    pub fn has_bindings_from(&self, exchange: &str) -> bool {
        self.exchanges
            .get(exchange)
            .is_some_and(|x| !x.bindings.is_empty())
    }

    /// Removes every binding to `destination`; returns the auto-delete exchanges left without
    /// bindings (the caller deletes them).
    pub fn unbind_destination(&mut self, destination: &Destination) -> Vec<String> {
        let mut emptied = Vec::new();
        for x in self.exchanges.values_mut() {
            if x.bindings.remove_destination(destination) > 0
                && x.auto_delete
                && x.bindings.is_empty()
            {
                emptied.push(x.name.clone());
            }
        }
        emptied
    }

    /// Whether any exchange binds to this exchange as a destination.
    pub fn is_bound_destination(&self, exchange: &str) -> bool {
        let d = Destination::Exchange(exchange.to_string());
        self.exchanges
            .values()
            .any(|x| x.bindings.bindings().any(|b| b.destination == d))
    }
}
