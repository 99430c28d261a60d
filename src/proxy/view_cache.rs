//! The queue settings one client session acts on, kept between settlements.
//!
//! Every reject, nack and requeue the proxy may take over needs the settings of the
//! delivery's queue ([`super::QueueView`]): a registry lookup, a policy match and the merge of
//! both. A session settling thousands of deliveries a second from a handful of queues would
//! redo that for each one; [`ViewCache`] keeps the answer per queue and drops all of it when
//! the shared settings change (a policy revision or a registry change, the same
//! [`super::SettingsRevision`] the consumer sources cache their answers by). It holds at most
//! [`MAX_QUEUES`] queues, since a client chooses how many queues it gets from.

use std::sync::Arc;

use super::{ProxyShared, QueueView, SettingsRevision};
use crate::metrics::Metrics;

/// Most queues one session keeps settings for; past that the cache starts again.
pub(crate) const MAX_QUEUES: usize = 64;

/// Per-queue settings of one session, valid for one [`SettingsRevision`]. Its size is in the
/// gauge `session_queue_settings` (taken back out when the session ends).
#[derive(Default)]
pub(crate) struct ViewCache {
    revision: Option<SettingsRevision>,
    entries: Vec<(Arc<str>, Option<Arc<QueueView>>)>,
    /// Where the entries are counted (set at the first lookup).
    metrics: Option<Arc<Metrics>>,
}

impl ViewCache {
    /// The settings the proxy applies to `queue`'s dead letters (`None`: the upstream decides,
    /// [`ProxyShared::verified_view`]), computed once per queue and settings revision.
    pub(crate) fn view(
        &mut self,
        shared: &ProxyShared,
        vhost: &str,
        queue: &Arc<str>,
    ) -> Option<Arc<QueueView>> {
        let revision = shared.settings_revision();
        if self.revision != Some(revision) {
            self.clear();
            self.revision = Some(revision);
        }
        if let Some((_, view)) = self.entries.iter().find(|(q, _)| q == queue) {
            return view.clone();
        }
        let view = shared.verified_view(vhost, queue).map(Arc::new);
        if self.entries.len() >= MAX_QUEUES {
            self.clear();
        }
        self.entries.push((queue.clone(), view.clone()));
        self.metrics
            .get_or_insert_with(|| shared.metrics.clone())
            .add_session_queue_settings(1);
        view
    }

    fn clear(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.add_session_queue_settings(-(self.entries.len() as i64));
        }
        self.entries.clear();
    }

    /// Queues with settings kept now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

impl Drop for ViewCache {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyConfig;
    use crate::proxy::registry::VerifiedQueue;
    use crate::proxy::test_support::shared;
    use crate::proxy::test_support::with_dlx;
    use crate::rabbit::args::QueueArguments;

    fn dlx_of(view: &Option<Arc<QueueView>>) -> Option<String> {
        view.as_ref()
            .and_then(|v| v.settings.dead_letter_exchange.clone())
    }

    #[test]
    fn a_queue_is_looked_up_once_until_the_registry_changes() {
        let shared = shared();
        let queue: Arc<str> = Arc::from("orders");
        shared.queues.record("/", "orders", with_dlx("dlx-a"));
        let mut cache = ViewCache::default();
        let first = cache.view(&shared, "/", &queue);
        assert_eq!(dlx_of(&first), Some("dlx-a".into()));
        let again = cache.view(&shared, "/", &queue);
        assert!(
            Arc::ptr_eq(first.as_ref().unwrap(), again.as_ref().unwrap()),
            "the second settlement reuses the first one's view"
        );

        // Another instance's declare through this one, or a read-back: a new generation.
        shared.queues.record("/", "orders", with_dlx("dlx-b"));
        assert_eq!(
            dlx_of(&cache.view(&shared, "/", &queue)),
            Some("dlx-b".into())
        );
        shared.queues.forget("/", "orders");
        assert!(
            cache.view(&shared, "/", &queue).is_none(),
            "a forgotten queue is the upstream's to decide again"
        );
        assert_eq!(shared.metrics.session_queue_settings(), 1);
        drop(cache);
        assert_eq!(
            shared.metrics.session_queue_settings(),
            0,
            "a session that ends takes its entries out of the gauge"
        );
    }

    #[test]
    fn a_policy_change_is_seen_at_the_next_settlement() {
        let shared = shared();
        let queue: Arc<str> = Arc::from("payments");
        shared.queues.record(
            "/",
            "payments",
            VerifiedQueue::Proxied(QueueArguments::default()),
        );
        let mut cache = ViewCache::default();
        assert_eq!(dlx_of(&cache.view(&shared, "/", &queue)), None);

        let policy = PolicyConfig {
            name: "dlx".into(),
            pattern: "^payments$".into(),
            definition: [(
                "dead-letter-exchange".to_string(),
                serde_json::Value::from("policy-dlx"),
            )]
            .into_iter()
            .collect(),
            ..PolicyConfig::default()
        };
        shared.policies.write().unwrap().set(&policy).unwrap();
        assert_eq!(
            dlx_of(&cache.view(&shared, "/", &queue)),
            Some("policy-dlx".into())
        );
    }

    #[test]
    fn the_cache_holds_a_bounded_number_of_queues() {
        let shared = shared();
        let mut cache = ViewCache::default();
        for i in 0..(MAX_QUEUES * 3) {
            let queue: Arc<str> = Arc::from(format!("q{i}").as_str());
            assert!(cache.view(&shared, "/", &queue).is_none());
            assert!(cache.len() <= MAX_QUEUES);
            assert_eq!(shared.metrics.session_queue_settings(), cache.len() as i64);
        }
        // Unverified queues are cached as "the upstream decides" too.
        assert!(cache.len() > 0);
    }
}
