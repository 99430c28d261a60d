//! The verified-settings cache, shared by all connections of one proxy instance.
//!
//! The truth about a queue is the upstream queue's own arguments ([`super::declare`]); an
//! instance only caches what the upstream confirmed: a declare that RabbitMQ accepted with the
//! proxy's upstream arguments ([`super::arbiter`]) records the client's arguments it stands
//! for, and a queue found not to be declared through a proxy is recorded as upstream-owned;
//! a queue a client consumes from or gets from unverified is read back from the upstream
//! ([`super::readback`]). A queue of a type the proxy passes through (a stream) is recorded
//! as such, so that its consumes are not read back again and its settlements go upstream.
//! A delivery only names its queue, so when a client rejects it the proxy looks the queue up
//! here: with verified settings it dead-letters (or counts the requeue) itself, the fast path;
//! without them (never verified by this instance, evicted, upstream-owned) the settlement is
//! passed through and the upstream decides (through the capture exchange for proxy queues).
//!
//! An entry is replaced by every verified declare or read-back, and dropped on queue.delete
//! and when a read-back finds the queue missing. Past `proxy.verified_queue_max_age_secs` an
//! entry still decides settlements, but a client's next consume or get on the queue reads it
//! back again ([`QueueRegistry::lookup_fresh`]): another instance may have deleted the queue
//! and declared it anew with other arguments. What that read-back learns replaces the entry
//! only where it contradicts it ([`QueueRegistry::confirm`]). The cache is
//! bounded (entries are evicted at random past the capacity) and its size is the
//! `verified_queues` gauge.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;
use crate::rabbit::args::QueueArguments;

/// What the upstream confirmed about a queue.
#[derive(Clone, Debug, PartialEq)]
pub enum VerifiedQueue {
    /// Declared through a proxy: the client arguments its upstream arguments stand for.
    Proxied(QueueArguments),
    /// Not declared through a proxy: RabbitMQ's own arguments (as RabbitMQ confirmed them)
    /// and rules apply; the proxy only adds what a policy gives a queue without a
    /// dead-letter exchange of its own.
    UpstreamOwned(QueueArguments),
    /// A queue type the proxy does not take over (a stream, see
    /// [`super::declare::passes_through`]): RabbitMQ judges and settles everything of it, no
    /// delivery content is kept for it, and no TOML policy applies to it.
    PassedThrough,
}

/// Verified settings by (vhost, queue), with when they were verified.
pub struct QueueRegistry {
    queues: RwLock<HashMap<(String, String), (VerifiedQueue, Instant)>>,
    capacity: usize,
    /// How long an entry spares a consume or get the read-back (zero: for ever).
    max_age: Duration,
    /// Counts changes, so decisions cached from the registry can be checked for staleness.
    generation: AtomicU64,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for QueueRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueRegistry")
            .field("len", &self.len())
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl QueueRegistry {
    /// A cache holding at most `capacity` queues, each fresh for `max_age` (zero: for ever).
    pub fn new(capacity: usize, max_age: Duration, metrics: Arc<Metrics>) -> Self {
        QueueRegistry {
            queues: RwLock::new(HashMap::new()),
            capacity: capacity.max(1),
            max_age,
            generation: AtomicU64::new(0),
            metrics,
        }
    }

    /// Records what the upstream just confirmed, replacing any earlier entry.
    pub fn record(&self, vhost: &str, queue: &str, verified: VerifiedQueue) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        let key = (vhost.to_string(), queue.to_string());
        if !queues.contains_key(&key)
            && queues.len() >= self.capacity
            && let Some(victim) = queues.keys().next().cloned()
        {
            queues.remove(&victim);
        }
        queues.insert(key, (verified, Instant::now()));
        self.metrics.set_verified_queues(queues.len());
    }

    /// What a read-back learned about a queue: recorded, unless the entry agrees with it on
    /// what the upstream shows (the kind of queue, its dead-letter target, limit and tiers).
    /// Such an entry is kept, fresh again: it may know more than the upstream holds (a
    /// consumer timeout, an own queue's delivery limit).
    pub fn confirm(&self, vhost: &str, queue: &str, learned: VerifiedQueue) {
        {
            let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
            if let Some((known, at)) = queues.get_mut(&(vhost.to_string(), queue.to_string()))
                && agrees(known, &learned)
            {
                *at = Instant::now();
                return;
            }
        }
        self.record(vhost, queue, learned);
    }

    /// A read-back that could not tell (reply texts cut short, an exclusive queue): what the
    /// entry says stays, fresh again, rather than be read back at every consume.
    pub fn touch(&self, vhost: &str, queue: &str) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        if let Some((_, at)) = queues.get_mut(&(vhost.to_string(), queue.to_string())) {
            *at = Instant::now();
        }
    }

    /// What is verified about a queue.
    pub fn lookup(&self, vhost: &str, queue: &str) -> Option<VerifiedQueue> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        queues
            .get(&(vhost.to_string(), queue.to_string()))
            .map(|(verified, _)| verified.clone())
    }

    /// What was verified about a queue less than the maximum age before `now`: what spares a
    /// client's consume or get the read-back.
    pub fn lookup_fresh(&self, vhost: &str, queue: &str, now: Instant) -> Option<VerifiedQueue> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        let (verified, at) = queues.get(&(vhost.to_string(), queue.to_string()))?;
        let fresh = self.max_age.is_zero() || now.saturating_duration_since(*at) < self.max_age;
        fresh.then(|| verified.clone())
    }

    /// The client arguments of a queue declared through a proxy.
    pub fn proxied(&self, vhost: &str, queue: &str) -> Option<QueueArguments> {
        match self.lookup(vhost, queue) {
            Some(VerifiedQueue::Proxied(arguments)) => Some(arguments),
            _ => None,
        }
    }

    /// The verified arguments the proxy decides a queue's dead letters with: a proxy queue's,
    /// or an upstream-owned queue's without a dead-letter exchange of its own (a policy may
    /// give it one). `None`: the upstream decides.
    pub fn decided_by_proxy(&self, vhost: &str, queue: &str) -> Option<QueueArguments> {
        match self.lookup(vhost, queue)? {
            VerifiedQueue::Proxied(arguments) => Some(arguments),
            VerifiedQueue::UpstreamOwned(arguments) => arguments
                .dead_letter_exchange
                .is_none()
                .then_some(arguments),
            VerifiedQueue::PassedThrough => None,
        }
    }

    pub fn forget(&self, vhost: &str, queue: &str) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        queues.remove(&(vhost.to_string(), queue.to_string()));
        self.metrics.set_verified_queues(queues.len());
    }

    /// Changes whenever an entry is recorded or forgotten.
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

/// Whether a read-back (`learned`) says what `known` says about a queue, as far as the
/// upstream shows it.
fn agrees(known: &VerifiedQueue, learned: &VerifiedQueue) -> bool {
    // The type decides who counts a delivery limit (a quorum queue, or the proxy).
    let target = |a: &QueueArguments, b: &QueueArguments| {
        a.queue_type == b.queue_type
            && a.dead_letter_exchange == b.dead_letter_exchange
            && a.dead_letter_routing_key == b.dead_letter_routing_key
    };
    match (known, learned) {
        (VerifiedQueue::Proxied(a), VerifiedQueue::Proxied(b)) => {
            target(a, b) && a.delivery_limit == b.delivery_limit && a.retry_delays == b.retry_delays
        }
        // An own queue's delivery limit is not on the upstream queue.
        (VerifiedQueue::UpstreamOwned(a), VerifiedQueue::UpstreamOwned(b)) => target(a, b),
        (VerifiedQueue::PassedThrough, VerifiedQueue::PassedThrough) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::test_support::with_dlx;

    fn registry(capacity: usize) -> (QueueRegistry, Arc<Metrics>) {
        let metrics = Metrics::new(10);
        (
            QueueRegistry::new(capacity, Duration::ZERO, metrics.clone()),
            metrics,
        )
    }

    #[test]
    fn records_replaces_looks_up_and_forgets() {
        let (registry, metrics) = registry(3);
        registry.record("/", "q", with_dlx("a"));
        registry.record("/", "q", with_dlx("b"));
        assert_eq!(registry.lookup("/", "q"), Some(with_dlx("b")));
        assert_eq!(
            registry.proxied("/", "q").unwrap().dead_letter_exchange,
            Some("b".into())
        );
        registry.record(
            "/",
            "plain",
            VerifiedQueue::UpstreamOwned(QueueArguments::default()),
        );
        assert_eq!(registry.proxied("/", "plain"), None);
        assert_eq!(
            registry.decided_by_proxy("/", "plain"),
            Some(QueueArguments::default())
        );
        registry.record("/", "own", with_dlx("own"));
        let VerifiedQueue::Proxied(own) = with_dlx("own") else {
            unreachable!()
        };
        registry.record("/", "own", VerifiedQueue::UpstreamOwned(own));
        assert_eq!(registry.decided_by_proxy("/", "own"), None);
        assert_eq!(registry.lookup("other", "q"), None);
        assert_eq!(metrics.verified_queues(), 3);
        registry.forget("/", "q");
        assert_eq!(registry.len(), 2);
        assert_eq!(metrics.verified_queues(), 2);
    }

    #[test]
    fn an_entry_past_its_age_still_decides_but_no_longer_spares_a_read_back() {
        let metrics = Metrics::new(10);
        let cache = QueueRegistry::new(8, Duration::from_secs(60), metrics);
        cache.record("/", "q", with_dlx("a"));
        let now = Instant::now();
        assert_eq!(cache.lookup_fresh("/", "q", now), Some(with_dlx("a")));
        let later = now + Duration::from_secs(61);
        assert_eq!(cache.lookup_fresh("/", "q", later), None);
        assert_eq!(cache.lookup("/", "q"), Some(with_dlx("a")));
        assert!(cache.decided_by_proxy("/", "q").is_some());
        // Read back, the same target: the entry stays (it may know more), fresh again.
        let VerifiedQueue::Proxied(mut richer) = with_dlx("a") else {
            unreachable!()
        };
        richer.consumer_timeout = Some(5000);
        cache.record("/", "q", VerifiedQueue::Proxied(richer.clone()));
        cache.confirm("/", "q", with_dlx("a"));
        assert_eq!(
            cache.lookup("/", "q"),
            Some(VerifiedQueue::Proxied(richer.clone()))
        );
        // Read back, another target: replaced.
        cache.confirm("/", "q", with_dlx("b"));
        assert_eq!(
            cache.lookup_fresh("/", "q", Instant::now()),
            Some(with_dlx("b"))
        );
        // Read back, the same target on a queue of another type (deleted and declared
        // again as a classic queue): replaced, since the type decides who counts returns.
        let VerifiedQueue::Proxied(mut quorum) = with_dlx("b") else {
            unreachable!()
        };
        quorum.queue_type = crate::rabbit::args::QueueType::Quorum;
        cache.record("/", "q", VerifiedQueue::Proxied(quorum));
        cache.confirm("/", "q", with_dlx("b"));
        assert_eq!(cache.lookup("/", "q"), Some(with_dlx("b")));
        // A read-back that cannot tell keeps the entry, fresh again.
        cache.touch("/", "q");
        assert_eq!(
            cache.lookup_fresh("/", "q", Instant::now()),
            Some(with_dlx("b"))
        );
        // A maximum age of zero: for ever.
        let (forever, _) = registry(8);
        forever.record("/", "q", with_dlx("a"));
        assert!(
            forever
                .lookup_fresh("/", "q", later + Duration::from_secs(3600))
                .is_some()
        );
    }

    #[test]
    fn a_passed_through_queue_is_decided_by_the_upstream() {
        let (registry, metrics) = registry(3);
        registry.record("/", "stream", VerifiedQueue::PassedThrough);
        assert_eq!(
            registry.lookup("/", "stream"),
            Some(VerifiedQueue::PassedThrough)
        );
        assert_eq!(registry.decided_by_proxy("/", "stream"), None);
        assert_eq!(registry.proxied("/", "stream"), None);
        assert_eq!(metrics.verified_queues(), 1);
    }

    #[test]
    fn stays_within_capacity() {
        let (registry, metrics) = registry(2);
        for name in ["a", "b", "c"] {
            registry.record("/", name, with_dlx(name));
        }
        assert_eq!(registry.len(), 2);
        assert_eq!(metrics.verified_queues(), 2);
        assert!(registry.lookup("/", "c").is_some());
    }
}
