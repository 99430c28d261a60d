//! Graceful-shutdown signalling, the tracking of every task, and Unix signal helpers.
//!
//! As in tokio's mini-redis, one cancellation token tells every task to stop and one task
//! tracker lets the service wait for all of them. A [`ShutdownTrigger`] owns a
//! [`CancellationToken`]; every listener, connection, service connection and background task
//! holds a [`Shutdown`] (cheap to clone), selects on [`Shutdown::recv`] and spawns its own
//! tasks with [`Shutdown::spawn`], so that they join the service's [`TaskTracker`]. The
//! service stops in three steps: the accept trigger (a [`child`](ShutdownTrigger::child) of
//! the connections trigger, on its tracker) stops the listeners, the connections trigger
//! everything else once the drain is over, and the services trigger (a tracker of its own) the
//! proxy's service connections last, once the client connections are done, since closing
//! client connections still hand them work. The service waits on each tracker, bounded by
//! `shutdown.drain_secs` (see `RunningService::shutdown`). A token that fired
//! stays fired, so a task created afterwards still sees it; dropping the trigger fires it
//! too: nothing could trigger it any more.
//! [`TerminationSignals`] yields SIGTERM and SIGINT (installed up front, so none is missed);
//! [`reload_signals`] yields SIGHUPs for configuration reloads.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

/// The sending side: fires shutdown for every [`Shutdown`] created from it.
#[derive(Debug)]
pub struct ShutdownTrigger {
    token: CancellationToken,
    tracker: TaskTracker,
    /// Set before the token is cancelled: this trigger's flag last, its ancestors' before it.
    fired: Lineage,
}

/// The fired flags of a trigger and of every trigger above it: shutdown has fired for a
/// listener once any of them is set. Every "has it fired" question reads these (without a
/// lock, unlike the token); the token only wakes the tasks that wait.
type Lineage = Arc<[Arc<AtomicBool>]>;

fn any_fired(lineage: &Lineage) -> bool {
    lineage.iter().any(|fired| fired.load(Ordering::Acquire))
}

impl ShutdownTrigger {
    /// A trigger that has not fired, with a tracker of its own.
    pub fn new() -> ShutdownTrigger {
        ShutdownTrigger::with_tracker(TaskTracker::new())
    }

    /// A trigger that has not fired; the tasks of its [`Shutdown`]s join `tracker`.
    pub fn with_tracker(tracker: TaskTracker) -> ShutdownTrigger {
        ShutdownTrigger {
            token: CancellationToken::new(),
            tracker,
            fired: Arc::new([Arc::new(AtomicBool::new(false))]),
        }
    }

    /// A trigger that fires with this one or on its own (earlier), sharing the tracker.
    pub fn child(&self) -> ShutdownTrigger {
        let mut fired = self.fired.to_vec();
        fired.push(Arc::new(AtomicBool::new(false)));
        ShutdownTrigger {
            token: self.token.child_token(),
            tracker: self.tracker.clone(),
            fired: fired.into(),
        }
    }

    /// A listener for this trigger.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown {
            token: self.token.clone(),
            tracker: self.tracker.clone(),
            fired: self.fired.clone(),
        }
    }

    /// Fires shutdown (idempotent).
    pub fn trigger(&self) {
        self.fire();
    }

    /// Sets this trigger's flag, then cancels the token (whose wake-ups then find it set).
    fn fire(&self) {
        if let Some(own) = self.fired.last() {
            own.store(true, Ordering::Release);
        }
        self.token.cancel();
    }

    /// Whether [`trigger`](Self::trigger) was called (or a parent fired).
    pub fn is_triggered(&self) -> bool {
        any_fired(&self.fired)
    }

    /// The tracker the tasks of this trigger's [`Shutdown`]s join.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }
}

impl Default for ShutdownTrigger {
    fn default() -> Self {
        ShutdownTrigger::new()
    }
}

impl Drop for ShutdownTrigger {
    fn drop(&mut self) {
        self.fire();
    }
}

/// The listening side: clone it into every task that must stop on shutdown.
#[derive(Clone, Debug)]
pub struct Shutdown {
    token: CancellationToken,
    tracker: TaskTracker,
    fired: Lineage,
}

impl Shutdown {
    /// Whether shutdown has fired (or the trigger is gone).
    pub fn is_shutdown(&self) -> bool {
        any_fired(&self.fired)
    }

    /// Resolves once shutdown has fired (at once if it already has). Cancel-safe.
    pub async fn recv(&mut self) {
        self.token.cancelled().await;
    }

    /// Resolves once shutdown has fired, like [`recv`](Self::recv), for a loop that polls
    /// it on every turn: the first poll registers the task's waker with the token, later
    /// ones from the same task only read the fired flags (the token's poll takes two locks).
    pub fn signal(&self) -> ShutdownSignal {
        ShutdownSignal {
            fired: self.fired.clone(),
            wait: Box::pin(self.token.clone().cancelled_owned()),
            registered: None,
        }
    }

    /// Spawns `task` so that the service waits for it on shutdown (it joins the tracker).
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }
}

/// The future of [`Shutdown::signal`]. The token's future is polled again only when the
/// task's waker is not the one it registered.
pub struct ShutdownSignal {
    fired: Lineage,
    wait: Pin<Box<WaitForCancellationFutureOwned>>,
    /// The waker the token wakes, registered by the last poll of the token's future.
    registered: Option<Waker>,
}

impl Future for ShutdownSignal {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if any_fired(&self.fired) {
            return Poll::Ready(());
        }
        // Polled by another task than the one registered (or not yet): register that one.
        if !self
            .registered
            .as_ref()
            .is_some_and(|waker| waker.will_wake(cx.waker()))
        {
            if self.wait.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            self.registered = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// SIGTERM and SIGINT handlers, installed when this is created: from then on these signals
/// are queued for [`recv`](Self::recv) instead of killing the process. Create it before the
/// service reports ready, so that a prompt SIGTERM still shuts down gracefully.
#[derive(Debug)]
pub struct TerminationSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl TerminationSignals {
    /// Installs both handlers.
    pub fn install() -> std::io::Result<TerminationSignals> {
        Ok(TerminationSignals {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves on the next SIGTERM or SIGINT and returns its name ("SIGTERM" or "SIGINT").
    /// Cancel-safe.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT and returns its name ("SIGTERM" or "SIGINT").
/// The handlers are only installed when this is first polled: prefer
/// [`TerminationSignals::install`] where a signal may arrive before that.
pub async fn wait_for_signal() -> std::io::Result<&'static str> {
    let mut signals = TerminationSignals::install()?;
    Ok(signals.recv().await)
}

/// A stream of SIGHUPs (`recv().await` once per signal), used to reload the configuration.
/// Installing it stops SIGHUP from terminating the process.
pub fn reload_signals() -> std::io::Result<Signal> {
    signal(SignalKind::hangup())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn listeners_see_the_trigger_even_when_created_later() {
        let trigger = ShutdownTrigger::new();
        let mut early = trigger.subscribe();
        assert!(!early.is_shutdown());
        assert!(!trigger.is_triggered());
        let waiter = tokio::spawn(async move {
            early.recv().await;
            early.is_shutdown()
        });
        tokio::task::yield_now().await;
        trigger.trigger();
        assert!(trigger.is_triggered());
        assert!(waiter.await.unwrap());
        let mut late = trigger.subscribe();
        assert!(late.is_shutdown());
        tokio::time::timeout(Duration::from_secs(1), late.recv())
            .await
            .unwrap();
        let mut clone = late.clone();
        tokio::time::timeout(Duration::from_secs(1), clone.recv())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_child_fires_alone_or_with_its_parent_and_shares_the_tracker() {
        let parent = ShutdownTrigger::new();
        let child = parent.child();
        let mut accepting = child.subscribe();
        let connections = parent.subscribe();
        child.trigger();
        tokio::time::timeout(Duration::from_secs(1), accepting.recv())
            .await
            .unwrap();
        assert!(!connections.is_shutdown(), "the parent fires on its own");
        let other = parent.child();
        parent.trigger();
        assert!(
            other.is_triggered(),
            "a parent's shutdown reaches its children"
        );
        // Tasks spawned through either side are waited for on the one tracker.
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        accepting.spawn(async move {
            let _ = released.await;
        });
        connections.spawn(async {});
        let tracker = parent.tracker().clone();
        tracker.close();
        let early = tokio::time::timeout(Duration::from_millis(50), tracker.wait()).await;
        assert!(early.is_err(), "a tracked task still runs");
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(1), tracker.wait())
            .await
            .unwrap();
        assert!(tracker.is_empty());
    }

    #[tokio::test]
    async fn a_signal_wakes_its_task_when_it_or_a_parent_fires() {
        for fire_parent in [false, true] {
            let parent = ShutdownTrigger::new();
            let child = parent.child();
            let shutdown = child.subscribe();
            let mut signal = shutdown.signal();
            // Registered by a first poll, then waiting without being polled again.
            let waited = tokio::time::timeout(Duration::from_millis(50), &mut signal).await;
            assert!(waited.is_err(), "nothing fired yet");
            let waiter = tokio::spawn(async move {
                signal.await;
            });
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(!waiter.is_finished());
            if fire_parent {
                parent.trigger();
            } else {
                child.trigger();
            }
            tokio::time::timeout(Duration::from_secs(1), waiter)
                .await
                .expect("the firing wakes the waiting task")
                .unwrap();
            assert!(shutdown.is_shutdown());
        }
    }

    #[tokio::test]
    async fn a_signal_is_ready_at_once_after_the_fact_and_stays_ready() {
        let trigger = ShutdownTrigger::new();
        let shutdown = trigger.subscribe();
        drop(trigger);
        let mut signal = shutdown.signal();
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(1), &mut signal)
                .await
                .expect("ready once fired, however often polled");
        }
    }

    #[tokio::test]
    async fn recv_waits_until_triggered() {
        let trigger = ShutdownTrigger::new();
        let mut shutdown = trigger.subscribe();
        let waited = tokio::time::timeout(Duration::from_millis(50), shutdown.recv()).await;
        assert!(waited.is_err());
    }

    #[tokio::test]
    async fn dropping_the_trigger_counts_as_shutdown() {
        let trigger = ShutdownTrigger::new();
        let mut shutdown = trigger.subscribe();
        drop(trigger);
        assert!(shutdown.is_shutdown());
        tokio::time::timeout(Duration::from_secs(1), shutdown.recv())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_termination_signal_sent_before_waiting_is_not_lost() {
        let mut signals = TerminationSignals::install().unwrap();
        let pid = std::process::id().to_string();
        let status = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        // Only now start waiting: the signal was queued by the installed handler.
        let name = tokio::time::timeout(Duration::from_secs(5), signals.recv())
            .await
            .unwrap();
        assert_eq!(name, "SIGINT");
    }

    #[tokio::test]
    async fn sighup_is_delivered_to_the_reload_stream() {
        let mut hangups = reload_signals().unwrap();
        let pid = std::process::id().to_string();
        let status = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(5), hangups.recv())
            .await
            .unwrap();
    }
}
