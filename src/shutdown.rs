//! Graceful-shutdown signalling and Unix signal helpers.
//!
//! One [`ShutdownTrigger`] is owned by the service; every listener, connection task and the
//! admin server holds a [`Shutdown`] (cheap to clone) and selects on [`Shutdown::recv`]. The
//! trigger is a `tokio::sync::watch` flag, so a listener created after the trigger fired still
//! sees it. Dropping the trigger counts as shutting down: nothing could trigger it any more.
//! [`wait_for_signal`] resolves on SIGTERM or SIGINT; [`reload_signals`] yields SIGHUPs for
//! configuration reloads.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::watch;

/// The sending side: fires shutdown for every [`Shutdown`] created from it.
#[derive(Debug)]
pub struct ShutdownTrigger {
    sender: watch::Sender<bool>,
}

impl ShutdownTrigger {
    /// A trigger that has not fired.
    pub fn new() -> ShutdownTrigger {
        let (sender, _) = watch::channel(false);
        ShutdownTrigger { sender }
    }

    /// A listener for this trigger.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown {
            receiver: self.sender.subscribe(),
        }
    }

    /// Fires shutdown (idempotent).
    pub fn trigger(&self) {
        self.sender.send_replace(true);
    }

    /// Whether [`trigger`](Self::trigger) was called.
    pub fn is_triggered(&self) -> bool {
        *self.sender.borrow()
    }
}

impl Default for ShutdownTrigger {
    fn default() -> Self {
        ShutdownTrigger::new()
    }
}

/// The listening side: clone it into every task that must stop on shutdown.
#[derive(Clone, Debug)]
pub struct Shutdown {
    receiver: watch::Receiver<bool>,
}

impl Shutdown {
    /// Whether shutdown has fired (or the trigger is gone).
    pub fn is_shutdown(&self) -> bool {
        *self.receiver.borrow() || self.receiver.has_changed().is_err()
    }

    /// Resolves once shutdown has fired (at once if it already has). Cancel-safe.
    pub async fn recv(&mut self) {
        // An error means the trigger was dropped: treat it as shutdown too.
        let _ = self.receiver.wait_for(|triggered| *triggered).await;
    }
}

/// Resolves on the first SIGTERM or SIGINT and returns its name ("SIGTERM" or "SIGINT").
pub async fn wait_for_signal() -> std::io::Result<&'static str> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => Ok("SIGTERM"),
        _ = interrupt.recv() => Ok("SIGINT"),
    }
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
