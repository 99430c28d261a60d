//! How clients declared their queues, shared by all connections of one proxy instance.
//!
//! A delivery only names its queue, so when a client rejects it the proxy looks the queue's
//! own dead-letter arguments up here and merges them with the current policy; a redeclare is
//! checked for equivalence against the declaration remembered here (the upstream queue carries
//! the proxy's arguments, so the upstream cannot check it).
//!
//! The registry is what this instance saw. A queue it does not know (declared before a
//! restart, through another instance, or directly on the upstream) gets its entry from the
//! first declaration this instance sees of it: AMQP 0-9-1 has no way to read a queue's
//! arguments back (a passive declare returns only counts) and RabbitMQ compares no argument
//! the proxy could carry them in, so that first declaration is taken as the reference. Until
//! then only the policy applies to rejections, while expiries and overflows still carry the
//! client's dead-letter arguments through the capture tag (see [`super::declare`]).

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use super::declare::DeclaredQueue;
use crate::rabbit::args::QueueArguments;

/// Declarations by (vhost, queue).
#[derive(Debug)]
pub struct QueueRegistry {
    queues: RwLock<HashMap<(String, String), DeclaredQueue>>,
    capacity: usize,
    /// Counts changes, so decisions cached from the registry can be checked for staleness.
    generation: AtomicU64,
}

impl QueueRegistry {
    /// A registry holding at most `capacity` queues (older entries are evicted at random).
    pub fn new(capacity: usize) -> Self {
        QueueRegistry {
            queues: RwLock::new(HashMap::new()),
            capacity: capacity.max(1),
            generation: AtomicU64::new(0),
        }
    }

    /// Remembers a declaration, replacing any earlier one (the queue was created with it).
    pub fn record(&self, vhost: &str, queue: &str, declared: DeclaredQueue) {
        self.insert(vhost, queue, declared, true);
    }

    /// Remembers a declaration unless the queue is known already (an existing queue: the
    /// declaration it was created with stays the reference).
    pub fn record_if_absent(&self, vhost: &str, queue: &str, declared: DeclaredQueue) {
        self.insert(vhost, queue, declared, false);
    }

    fn insert(&self, vhost: &str, queue: &str, declared: DeclaredQueue, replace: bool) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        let key = (vhost.to_string(), queue.to_string());
        if let Some(known) = queues.get_mut(&key) {
            if replace {
                *known = declared;
            }
            return;
        }
        if queues.len() >= self.capacity
            && let Some(victim) = queues.keys().next().cloned()
        {
            queues.remove(&victim);
        }
        queues.insert(key, declared);
    }

    /// The declared arguments of a queue.
    pub fn lookup(&self, vhost: &str, queue: &str) -> Option<QueueArguments> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        queues
            .get(&(vhost.to_string(), queue.to_string()))
            .map(|d| d.arguments.clone())
    }

    /// The whole declaration of a queue.
    pub fn lookup_declared(&self, vhost: &str, queue: &str) -> Option<DeclaredQueue> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        queues.get(&(vhost.to_string(), queue.to_string())).cloned()
    }

    pub fn forget(&self, vhost: &str, queue: &str) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        queues.remove(&(vhost.to_string(), queue.to_string()));
    }

    /// Changes whenever a declaration is remembered, replaced or forgotten.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn len(&self) -> usize {
        self.queues.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_dlx(dlx: &str) -> DeclaredQueue {
        DeclaredQueue {
            arguments: QueueArguments {
                dead_letter_exchange: Some(dlx.into()),
                ..QueueArguments::default()
            },
            ..DeclaredQueue::default()
        }
    }

    #[test]
    fn records_looks_up_and_forgets() {
        let registry = QueueRegistry::new(2);
        let declared = with_dlx("dlx");
        registry.record("/", "q", declared.clone());
        assert_eq!(registry.lookup("/", "q"), Some(declared.arguments.clone()));
        assert_eq!(registry.lookup_declared("/", "q"), Some(declared));
        assert_eq!(registry.lookup("other", "q"), None);
        registry.forget("/", "q");
        assert!(registry.is_empty());
    }

    #[test]
    fn the_first_declaration_of_an_existing_queue_stays_the_reference() {
        let registry = QueueRegistry::new(2);
        registry.record_if_absent("/", "q", with_dlx("a"));
        registry.record_if_absent("/", "q", with_dlx("b"));
        assert_eq!(
            registry
                .lookup("/", "q")
                .unwrap()
                .dead_letter_exchange
                .as_deref(),
            Some("a")
        );
        // A queue created anew replaces it.
        registry.record("/", "q", with_dlx("c"));
        assert_eq!(
            registry
                .lookup("/", "q")
                .unwrap()
                .dead_letter_exchange
                .as_deref(),
            Some("c")
        );
    }

    #[test]
    fn stays_within_capacity() {
        let registry = QueueRegistry::new(2);
        for name in ["a", "b", "c"] {
            registry.record("/", name, DeclaredQueue::default());
        }
        assert_eq!(registry.len(), 2);
        assert!(registry.lookup("/", "c").is_some());
    }
}
