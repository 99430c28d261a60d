//! Config file watching for live reload.
//!
//! Kubernetes mounts a ConfigMap as a directory whose files are symlinks into a `..data`
//! directory that is swapped atomically on update; the file itself never changes in place.
//! So the watcher watches the file's *directory* and treats any event there as "maybe
//! changed"; the reload compares nothing and simply re-reads (a no-op reload is harmless).
//! A subPath mount never sees updates at all (documented in docs/deploy.md).

use std::path::Path;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// Starts watching the directory of `path`; a (debounced) `()` is sent on every change.
/// Keep the returned watcher alive for as long as watching should continue.
pub fn watch_config(
    path: &Path,
    notify_tx: mpsc::Sender<()>,
) -> notify::Result<RecommendedWatcher> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."))
        .to_path_buf();
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            let _ = raw_tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    // Debounce: editors and the ConfigMap swap produce bursts of events.
    tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            while raw_rx.try_recv().is_ok() {}
            if notify_tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(watcher)
}
