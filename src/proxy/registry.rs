//! The arguments clients declared their queues with, shared by all connections of one proxy.
//!
//! A delivery only names its queue, so when a client rejects it the proxy looks the queue's
//! own dead-letter arguments up here and merges them with the current policy. Queues declared
//! elsewhere (another proxy instance, or directly on the upstream) are unknown: for them only
//! the policy applies to rejections, while expiries and overflows still carry their
//! arguments through the capture tag (see [`super::declare`]).

use std::collections::HashMap;
use std::sync::RwLock;

use crate::broker::args::QueueArguments;

/// Queue arguments by (vhost, queue).
#[derive(Debug)]
pub struct QueueRegistry {
    queues: RwLock<HashMap<(String, String), QueueArguments>>,
    capacity: usize,
}

impl QueueRegistry {
    /// A registry holding at most `capacity` queues (older entries are evicted at random).
    pub fn new(capacity: usize) -> Self {
        QueueRegistry {
            queues: RwLock::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    pub fn record(&self, vhost: &str, queue: &str, arguments: QueueArguments) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        let key = (vhost.to_string(), queue.to_string());
        if queues.len() >= self.capacity
            && !queues.contains_key(&key)
            && let Some(victim) = queues.keys().next().cloned()
        {
            queues.remove(&victim);
        }
        queues.insert(key, arguments);
    }

    pub fn lookup(&self, vhost: &str, queue: &str) -> Option<QueueArguments> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        queues.get(&(vhost.to_string(), queue.to_string())).cloned()
    }

    pub fn forget(&self, vhost: &str, queue: &str) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        queues.remove(&(vhost.to_string(), queue.to_string()));
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

    #[test]
    fn records_looks_up_and_forgets() {
        let registry = QueueRegistry::new(2);
        let args = QueueArguments {
            dead_letter_exchange: Some("dlx".into()),
            ..QueueArguments::default()
        };
        registry.record("/", "q", args.clone());
        assert_eq!(registry.lookup("/", "q"), Some(args));
        assert_eq!(registry.lookup("other", "q"), None);
        registry.forget("/", "q");
        assert!(registry.is_empty());
    }

    #[test]
    fn stays_within_capacity() {
        let registry = QueueRegistry::new(2);
        for name in ["a", "b", "c"] {
            registry.record("/", name, QueueArguments::default());
        }
        assert_eq!(registry.len(), 2);
        assert!(registry.lookup("/", "c").is_some());
    }
}
