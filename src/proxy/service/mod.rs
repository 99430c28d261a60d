//! The proxy's own upstream connections: one *service connection* per vhost, logged in with
//! the proxy's service identity (`upstream.user`), which owns the capture objects of that
//! vhost and dead-letters what the upstream captured there.
//!
//! Each service connection declares the capture exchange (a durable fanout) and the capture
//! queue (a durable quorum queue, so capture survives the loss of a node), binds them,
//! consumes the queue with a prefetch of `proxy.capture_prefetch` (the window of dead letters in
//! flight) and dead-letters each captured message with publisher confirms, pipelined, acking it
//! only once the publish is confirmed, confirmed runs with one multiple ack ([`link`]). It reconnects with backoff after any loss and subscribes
//! again (`task`, [`backoff`]); its login is a pure state machine ([`handshake`]). So
//! messages that expire or overflow upstream are dead-lettered whether or not any client is
//! connected, and client connections carry no capture consumer.
//!
//! Which vhosts: `proxy.vhosts` from the start, plus every vhost a client connection opens
//! (the session asks the [`ServiceRegistry`] in `ProxyShared`), at most
//! `proxy.max_service_vhosts` (`dlx_proxy_service_vhosts`; a vhost over the limit is counted in
//! `dlx_proxy_service_vhosts_refused_total` and gets no capture: declares naming the capture
//! exchange are refused there).
//!
//! Beside it each vhost has a *declare connection* (`declare_task.rs`, same identity), which
//! makes the declares client sessions hand it ([`judge`]) and never publishes: RabbitMQ blocks
//! a connection that publishes during a resource alarm and then reads nothing from it, and
//! the service connection publishes dead letters.
//!
//! Readiness ([`Status`]): `declared` turns true once the capture exchange, queue and binding
//! were declared (and stays true: they are durable). A client's queue.declare that names the
//! capture exchange as its dead-letter exchange is forwarded only then, because RabbitMQ
//! silently drops a dead letter whose dead-letter exchange does not exist. `consuming` is the
//! `dlx_proxy_capture_consumers{vhost}` gauge, `declaring` the
//! `dlx_proxy_declare_connections{vhost}` one; both are part of `/readyz` for the configured
//! vhosts.

pub mod backoff;
mod declare_task;
pub mod handshake;
pub mod judge;
pub mod link;
mod task;

pub(crate) use task::handshake;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use judge::{DECLARE_QUEUE, DeclareRequest};
use link::{FORWARD_LIMIT, PublishRequest};

/// How client sessions reach their vhost's service connections: the declares the declare
/// connection makes for them ([`judge`]) and the dead letters the service connection publishes
/// for them ([`link::PublishRequest`]). Both queues are bounded; what waits in them while its
/// connection is away stays there.
#[derive(Clone, Debug)]
pub struct ServiceHandle {
    pub declares: mpsc::Sender<DeclareRequest>,
    pub publishes: mpsc::Sender<PublishRequest>,
}

/// The receiving end of [`ServiceHandle::publishes`], owned by the vhost's service task.
#[derive(Debug)]
pub(crate) struct ServiceInbox {
    pub(crate) publishes: mpsc::Receiver<PublishRequest>,
}

/// The receiving ends of a [`ServiceHandle`], held until the vhost's tasks are spawned.
#[derive(Debug)]
struct Inboxes {
    service: ServiceInbox,
    declares: mpsc::Receiver<DeclareRequest>,
}

use super::ProxyShared;
use crate::config::ServiceIdentity;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// How far a vhost's service connection got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// The capture exchange, queue and binding exist (declared by this process at least once).
    pub declared: bool,
    /// The capture consumer runs now.
    pub consuming: bool,
    /// RabbitMQ holds the connection blocked (a resource alarm): what is handed to it waits.
    pub blocked: bool,
    /// The vhost's declare connection is open (client declares are checked now).
    pub declaring: bool,
}

struct Entry {
    status: watch::Receiver<Status>,
    /// Held until the task is spawned (before [`ServiceRegistry::start`]).
    sender: Option<watch::Sender<Status>>,
    /// How sessions reach the service connection.
    handle: ServiceHandle,
    /// Held until the tasks are spawned.
    inbox: Option<Inboxes>,
    /// The service connection's task and the declare connection's, once spawned.
    tasks: Option<[JoinHandle<()>; 2]>,
}

struct Runner {
    shared: Weak<ProxyShared>,
    identity: ServiceIdentity,
    shutdown: Shutdown,
}

#[derive(Default)]
struct State {
    runner: Option<Runner>,
    vhosts: HashMap<String, Entry>,
}

/// The vhosts with a service connection, and their status.
pub struct ServiceRegistry {
    state: Mutex<State>,
    limit: usize,
    configured: Vec<String>,
    metrics: Arc<Metrics>,
    /// [`ServiceRegistry::configured_consuming`] as of the last consumer change (`/readyz`).
    consuming: Arc<AtomicBool>,
}

impl std::fmt::Debug for ServiceRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceRegistry")
            .field("limit", &self.limit)
            .field("configured", &self.configured)
            .finish_non_exhaustive()
    }
}

impl ServiceRegistry {
    pub fn new(configured: Vec<String>, limit: usize, metrics: Arc<Metrics>) -> Self {
        ServiceRegistry {
            state: Mutex::new(State::default()),
            limit: limit.max(configured.len()).max(1),
            consuming: Arc::new(AtomicBool::new(configured.is_empty())),
            configured,
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The status of `vhost`'s service connection, which is started if it has none (once the
    /// registry runs). `None` over `proxy.max_service_vhosts`.
    pub fn ensure(&self, vhost: &str) -> Option<watch::Receiver<Status>> {
        let mut state = self.lock();
        if let Some(entry) = state.vhosts.get(vhost) {
            return Some(entry.status.clone());
        }
        // Stopping: a vhost first seen now gets no connection (nothing would read its queues).
        if state
            .runner
            .as_ref()
            .is_some_and(|runner| runner.shutdown.is_shutdown())
        {
            return None;
        }
        if state.vhosts.len() >= self.limit {
            drop(state);
            tracing::warn!(
                vhost,
                limit = self.limit,
                "no service connection for this vhost: proxy.max_service_vhosts reached"
            );
            self.metrics.service_vhost_refused();
            return None;
        }
        let (sender, status) = watch::channel(Status::default());
        let (declares, declares_rx) = mpsc::channel(DECLARE_QUEUE);
        let (publishes, publishes_rx) = mpsc::channel(FORWARD_LIMIT);
        let mut entry = Entry {
            status: status.clone(),
            sender: Some(sender),
            handle: ServiceHandle {
                declares,
                publishes,
            },
            inbox: Some(Inboxes {
                service: ServiceInbox {
                    publishes: publishes_rx,
                },
                declares: declares_rx,
            }),
            tasks: None,
        };
        if let Some(runner) = state.runner.as_ref()
            && !runner.shutdown.is_shutdown()
        {
            entry.tasks = spawn(runner, vhost, &mut entry);
        }
        self.metrics.service_started(vhost);
        state.vhosts.insert(vhost.to_string(), entry);
        Some(status)
    }

    /// Whether every vhost of `proxy.vhosts` consumes its capture queue and has its declare
    /// connection open (for `/readyz`).
    pub fn configured_consuming(&self) -> bool {
        Self::ready(&self.configured, &self.lock())
    }

    /// A flag that follows [`ServiceRegistry::configured_consuming`] (the readiness condition).
    pub fn consuming_flag(&self) -> Arc<AtomicBool> {
        self.consuming.clone()
    }

    /// A capture consumer or a declare connection started or stopped: the readiness flag
    /// follows. Read and stored under the registry's lock, so two connections of a vhost
    /// changing at once cannot leave the flag with the older reading.
    pub(crate) fn consumer_changed(&self) {
        let state = self.lock();
        self.consuming
            .store(Self::ready(&self.configured, &state), Ordering::Release);
    }

    fn ready(configured: &[String], state: &State) -> bool {
        configured.iter().all(|vhost| {
            state.vhosts.get(vhost).is_some_and(|e| {
                let status = e.status.borrow();
                status.consuming && status.declaring
            })
        })
    }

    /// How the sessions of `vhost` reach its service connection; `None` when the vhost has
    /// none.
    pub fn handle(&self, vhost: &str) -> Option<ServiceHandle> {
        self.lock().vhosts.get(vhost).map(|e| e.handle.clone())
    }

    /// The current status of `vhost` (`None`: no service connection).
    pub fn status(&self, vhost: &str) -> Option<Status> {
        self.lock().vhosts.get(vhost).map(|e| *e.status.borrow())
    }
}

/// Spawns the vhost's service connection and its declare connection.
fn spawn(runner: &Runner, vhost: &str, entry: &mut Entry) -> Option<[JoinHandle<()>; 2]> {
    let shared = runner.shared.upgrade()?;
    let sender = entry.sender.take()?;
    let inbox = entry.inbox.take()?;
    let service = runner.shutdown.spawn(task::run(
        shared.clone(),
        runner.identity.clone(),
        vhost.to_string(),
        sender.clone(),
        inbox.service,
        runner.shutdown.clone(),
    ));
    let declares = runner.shutdown.spawn(declare_task::run(
        shared,
        runner.identity.clone(),
        vhost.to_string(),
        sender,
        inbox.declares,
        runner.shutdown.clone(),
    ));
    Some([service, declares])
}

impl ProxyShared {
    /// Starts the service connections (`proxy.vhosts`, and each vhost clients open from now
    /// on) with the service identity; they stop when `shutdown` fires (after settling their
    /// in-flight dead letters) and join its task tracker, so the service waits for them.
    pub fn start_services(self: &Arc<Self>, identity: ServiceIdentity, shutdown: Shutdown) {
        let registry = &self.services;
        {
            let mut state = registry.lock();
            let runner = Runner {
                shared: Arc::downgrade(self),
                identity,
                shutdown: shutdown.clone(),
            };
            for (vhost, entry) in state.vhosts.iter_mut() {
                if entry.tasks.is_none() {
                    entry.tasks = spawn(&runner, vhost, entry);
                }
            }
            state.runner = Some(runner);
        }
        for vhost in &registry.configured {
            registry.ensure(vhost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhosts_past_the_limit_get_no_service_connection_and_are_counted() {
        let metrics = Metrics::new(10);
        let registry = ServiceRegistry::new(vec!["/".into()], 2, metrics.clone());
        // Not started yet: entries are kept for the start, nothing is spawned.
        let root = registry.ensure("/").expect("configured vhost");
        assert_eq!(*root.borrow(), Status::default());
        assert!(registry.ensure("orders").is_some());
        assert!(
            registry.ensure("/").is_some(),
            "known vhosts are not counted twice"
        );
        assert!(registry.ensure("billing").is_none());
        let text = metrics.encode();
        assert!(text.contains("dlx_proxy_service_vhosts 2"), "{text}");
        assert!(
            text.contains("dlx_proxy_service_vhosts_refused_total 1"),
            "{text}"
        );
        assert!(
            text.contains("dlx_proxy_capture_consumers{vhost=\"orders\"} 0"),
            "{text}"
        );
        assert!(!registry.configured_consuming());
        assert_eq!(registry.status("billing"), None);
    }
}
