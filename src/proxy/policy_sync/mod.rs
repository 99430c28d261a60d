//! Upstream policy sync: the proxy's policies as RabbitMQ policies, so that queues which
//! already existed upstream (never declared through the proxy) get their TTL and length
//! limits enforced and dead-letter through the capture path.
//!
//! A queue declared through the proxy carries the effective limits and the capture route in
//! its own arguments ([`super::declare`]). A queue the proxy never declared has only what its
//! creator gave it; with `upstream.management_url` set, [`UpstreamPolicySync`] gives it the
//! rest through the upstream's own policy mechanism. It reconciles at start, after every
//! change of the policy set (config reload, admin API) and every
//! `upstream.management_sync_interval_secs` (undoing drift: a policy deleted or edited by
//! hand upstream is put back), for every vhost the proxy serves and every vhost named by a
//! policy. [`plan`](mod@plan) decides what to change (pure); [`management`] makes the calls.
//!
//! The capture route is put only where the capture exchange exists (RabbitMQ drops what dies
//! towards a missing dead-letter exchange): in a vhost without it the round puts nothing,
//! counts `capture_missing` and tries again next time. The upstream policies of the
//! deployment (named `<capture name>.<name>`, [`PolicyOwner`]) belong to it: it deletes those
//! it no longer has, once every round for `upstream.management_delete_grace_secs` found them
//! missing ([`DeleteGrace`]: another instance may have them, during a rolling update), and
//! never touches any other. The capture queue itself is kept out of
//! every pattern ([`plan`](mod@plan)).
//!
//! RabbitMQ applies one user policy per queue (the highest priority) and merges an operator
//! policy into it (the lower numeric limit wins): see docs/semantics.md for what the proxy's
//! policies override and the priorities to give them.

pub mod management;
pub mod plan;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::Notify;

use super::declare::DeadLetterHandling;
use crate::config::{Config, service_credentials};
use crate::metrics::Metrics;
use crate::policy::PolicySet;
use crate::shutdown::Shutdown;
pub use management::{ManagementClient, ManagementEndpoint, ManagementError};
pub use plan::{
    DeleteGrace, LEGACY_PREFIX, PolicyOwner, SyncAction, UpstreamPolicy, desired, plan,
};

/// `result` of `upstream_policy_sync_total`: a vhost reconciled.
pub const SYNC_SUCCESS: &str = "success";
/// ... a vhost's policies not reconciled (management API unreachable, refused, 404 vhost).
pub const SYNC_FAILURE: &str = "failure";
/// ... a vhost's policies not put because its capture exchange does not exist yet.
pub const SYNC_CAPTURE_MISSING: &str = "capture_missing";
pub const SYNC_RESULTS: [&str; 3] = [SYNC_SUCCESS, SYNC_FAILURE, SYNC_CAPTURE_MISSING];

/// The vhosts every round reconciles: those a policy may name (`vhosts`) and those the proxy
/// serves from the start (`proxy.vhosts`). A policy removed from the config is then deleted
/// upstream even after a restart that forgot which vhosts the earlier rounds touched.
pub fn served_vhosts(config: &Config) -> Vec<String> {
    let mut vhosts = config.vhosts.clone();
    vhosts.extend(config.proxy.vhosts.iter().cloned());
    vhosts.sort();
    vhosts.dedup();
    vhosts
}

/// How one vhost's reconciliation ended.
#[derive(Debug)]
struct VhostOutcome {
    result: &'static str,
    /// Policies of the proxy upstream as desired after the round (every other policy of the
    /// deployment's was deleted, or waits for its grace).
    synced: usize,
    /// Deletes that wait for their grace: the vhost is reconciled again until they are made.
    waiting: usize,
}

/// Mirrors the proxy's policies onto the upstream (see the module documentation).
pub struct UpstreamPolicySync {
    client: ManagementClient,
    policies: Arc<RwLock<PolicySet>>,
    owner: PolicyOwner,
    served: Vec<String>,
    interval: Duration,
    metrics: Arc<Metrics>,
    changed: Arc<Notify>,
    /// Vhosts where proxy policies may remain upstream: reconciled until they hold none.
    /// Bounded by the vhosts of the policy set plus the served ones.
    touched: BTreeSet<String>,
    /// The last failure logged per vhost, so a lasting failure is logged once.
    failing: BTreeMap<String, String>,
    synced: BTreeMap<String, usize>,
    /// Deletes wait `upstream.management_delete_grace_secs`.
    grace: DeleteGrace,
}

impl UpstreamPolicySync {
    /// The sync for `config` (`None` without `upstream.management_url`). `policies` is the
    /// set the proxy applies; `changed` is notified after each change of it.
    pub fn from_config(
        config: &Config,
        capture_name: &str,
        policies: Arc<RwLock<PolicySet>>,
        metrics: Arc<Metrics>,
        changed: Arc<Notify>,
    ) -> anyhow::Result<Option<UpstreamPolicySync>> {
        let upstream = &config.upstream;
        if upstream.management_url.is_empty() {
            return Ok(None);
        }
        let endpoint = ManagementEndpoint::parse(&upstream.management_url)
            .map_err(|e| anyhow::anyhow!("upstream.management_url: {e}"))?;
        let (user, password) = service_credentials(config);
        let timeout = Duration::from_secs(upstream.connect_timeout_secs.max(1) * 2);
        let handling = if config.proxy.delegate_to_upstream {
            DeadLetterHandling::Delegate
        } else {
            DeadLetterHandling::Capture {
                exchange: capture_name.to_string(),
            }
        };
        metrics.upstream_policy_sync_results(&SYNC_RESULTS);
        Ok(Some(UpstreamPolicySync {
            client: ManagementClient::new(endpoint, &user, &password, timeout),
            policies,
            owner: PolicyOwner::new(capture_name, handling),
            served: served_vhosts(config),
            interval: Duration::from_secs(upstream.management_sync_interval_secs.max(1)),
            metrics,
            changed,
            touched: BTreeSet::new(),
            failing: BTreeMap::new(),
            synced: BTreeMap::new(),
            grace: DeleteGrace::new(Duration::from_secs(upstream.management_delete_grace_secs)),
        }))
    }

    /// Reconciles now, then after every change notification and every interval, until
    /// shutdown.
    pub async fn run(mut self, mut shutdown: Shutdown) {
        loop {
            tokio::select! {
                _ = shutdown.recv() => return,
                _ = self.reconcile() => {}
            }
            tokio::select! {
                _ = shutdown.recv() => return,
                _ = self.changed.notified() => {}
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    /// One round over every vhost concerned.
    pub async fn reconcile(&mut self) {
        let (wanted, vhosts) = {
            let policies = self.policies.read().unwrap_or_else(|e| e.into_inner());
            let mut vhosts: BTreeSet<String> = self.served.iter().cloned().collect();
            vhosts.extend(policies.iter().map(|p| p.vhost.clone()));
            vhosts.extend(self.touched.iter().cloned());
            let wanted: BTreeMap<String, BTreeMap<String, UpstreamPolicy>> = vhosts
                .iter()
                .map(|vhost| (vhost.clone(), desired(&policies, vhost, &self.owner)))
                .collect();
            (wanted, vhosts)
        };
        let mut session = match self.client.session().await {
            Ok(session) => session,
            Err(err) => {
                for vhost in &vhosts {
                    self.failed(vhost, &err);
                }
                return;
            }
        };
        self.grace.keep_vhosts(&vhosts);
        let mut broken: Option<ManagementError> = None;
        for (vhost, desired) in &wanted {
            if let Some(err) = &broken {
                // The connection is unusable after a transport error: the rest waits for
                // the next round.
                self.failed(vhost, err);
                continue;
            }
            match sync_vhost(&mut session, vhost, desired, &self.owner, &mut self.grace).await {
                Ok(outcome) => {
                    if self.failing.remove(vhost).is_some() {
                        tracing::info!(vhost = %vhost, "upstream policies reconciled again");
                    }
                    if outcome.result == SYNC_CAPTURE_MISSING {
                        tracing::debug!(vhost = %vhost, "capture exchange missing upstream; upstream policies wait for it");
                    }
                    self.metrics.upstream_policy_sync(outcome.result);
                    self.synced.insert(vhost.clone(), outcome.synced);
                    if outcome.synced == 0 && outcome.waiting == 0 && !self.served.contains(vhost) {
                        self.touched.remove(vhost);
                        self.synced.remove(vhost);
                    } else {
                        self.touched.insert(vhost.clone());
                    }
                }
                Err(err) => {
                    self.failed(vhost, &err);
                    if !err.is_status() {
                        broken = Some(err);
                    }
                }
            }
        }
        self.metrics
            .set_upstream_policies_synced(self.synced.values().sum::<usize>() as u64);
    }

    fn failed(&mut self, vhost: &str, err: &ManagementError) {
        self.grace.forget(vhost);
        self.metrics.upstream_policy_sync(SYNC_FAILURE);
        let text = err.to_string();
        if self.failing.get(vhost) != Some(&text) {
            tracing::warn!(vhost = %vhost, error = %text, "upstream policies not reconciled; retrying");
            self.failing.insert(vhost.to_string(), text);
        }
    }
}

/// Reconciles one vhost over `session`.
async fn sync_vhost(
    session: &mut management::ManagementSession,
    vhost: &str,
    desired: &BTreeMap<String, UpstreamPolicy>,
    owner: &PolicyOwner,
    grace: &mut DeleteGrace,
) -> Result<VhostOutcome, ManagementError> {
    let current = match session.policies(vhost).await {
        Ok(current) => current,
        // A served vhost that does not exist upstream holds no policy of the proxy's.
        Err(err) if err.is_not_found() && desired.is_empty() => {
            return Ok(VhostOutcome {
                result: SYNC_SUCCESS,
                synced: 0,
                waiting: 0,
            });
        }
        Err(err) => return Err(err),
    };
    let mut actions = plan(desired, &current, owner);
    let waiting = grace.admit(vhost, &mut actions, std::time::Instant::now());
    if waiting > 0 {
        tracing::debug!(vhost = %vhost, waiting, "upstream policies to delete wait for upstream.management_delete_grace_secs");
    }
    let puts = actions
        .iter()
        .filter(|a| matches!(a, SyncAction::Put(_)))
        .count();
    let mut result = SYNC_SUCCESS;
    if puts > 0
        && let DeadLetterHandling::Capture { exchange } = owner.handling()
        && !session.exchange_exists(vhost, exchange).await?
    {
        actions.retain(|a| matches!(a, SyncAction::Delete(_)));
        result = SYNC_CAPTURE_MISSING;
    }
    for action in &actions {
        match action {
            SyncAction::Put(policy) => {
                session.put_policy(vhost, policy).await?;
                tracing::info!(vhost = %vhost, policy = %policy.name, pattern = %policy.pattern, "upstream policy set");
            }
            SyncAction::Delete(name) => {
                session.delete_policy(vhost, name).await?;
                grace.deleted(vhost, name);
                tracing::info!(vhost = %vhost, policy = %name, "upstream policy deleted");
            }
        }
    }
    let synced = if result == SYNC_SUCCESS {
        desired.len()
    } else {
        desired.len() - puts
    };
    Ok(VhostOutcome {
        result,
        synced,
        waiting,
    })
}
