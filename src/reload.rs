//! File watching for live reload: the config file, and the TLS certificate, key and CA files.
//!
//! Kubernetes mounts a ConfigMap as a directory whose files are symlinks into a `..data`
//! directory that is swapped atomically on update; the file itself never changes in place.
//! So the watcher watches the file's *directory*, and after any event there (debounced) it
//! re-reads the file through its symlinks and asks for a reload only if the content changed.
//! Events about other files in the directory (a log file, an editor's swap file) therefore
//! cause no reload, and in particular no reload loop when the service logs into that
//! directory; events that only say a file was opened or read (the re-read itself) are not
//! waited on at all. SIGHUP reloads unconditionally. A subPath mount never sees updates at all
//! (documented in docs/deploy.md).
//!
//! [`watch_files`] does the same for a set of files in one or more directories; TLS
//! certificate rotation ([`crate::tls::TlsRotation`]) uses it for the certificate, key and CA
//! files, which usually live in a Secret mounted in a directory of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, EventKind};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long a burst of events may last before the file is re-read.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// The last content seen of the watched file; decides whether a re-read is a change.
#[derive(Debug, Default)]
struct ContentTracker {
    last: Option<Vec<u8>>,
}

impl ContentTracker {
    fn new(initial: Option<Vec<u8>>) -> ContentTracker {
        ContentTracker { last: initial }
    }

    /// Records `current` (None: the file could not be read, e.g. in the middle of a swap) and
    /// tells whether it differs from the last readable content.
    fn changed(&mut self, current: Option<Vec<u8>>) -> bool {
        match current {
            None => false,
            Some(content) if self.last.as_ref() == Some(&content) => false,
            Some(content) => {
                self.last = Some(content);
                true
            }
        }
    }
}

/// Whether an event in a watched directory can mean that a file's content changed. A file
/// opened, read or closed unwritten cannot; the watcher's own re-read of the file is such an
/// event, and counting it would re-read the file every [`DEBOUNCE`] for ever (an idle
/// service re-reading its config five times a second). Closing a file that was written can.
fn may_change_content(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

fn watched_directory(path: &Path) -> PathBuf {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."))
        .to_path_buf()
}

/// Starts watching the directory of `path`; a `()` is sent each time the file's content has
/// changed. Keep the returned watcher alive for as long as watching should continue.
pub fn watch_config(
    path: &Path,
    notify_tx: mpsc::Sender<()>,
) -> notify::Result<RecommendedWatcher> {
    watch_files(&[path.to_path_buf()], notify_tx)
}

/// Like [`watch_config`] for several files (a certificate, its key and a CA bundle, possibly
/// in different directories): every directory holding one is watched, and a `()` is sent
/// once per burst of events in which the content of at least one of the files changed.
pub fn watch_files(
    paths: &[PathBuf],
    notify_tx: mpsc::Sender<()>,
) -> notify::Result<RecommendedWatcher> {
    watch_counting(paths, notify_tx, None)
}

/// [`watch_files`], counting the passes that re-read the files in `rereads` (for tests).
fn watch_counting(
    paths: &[PathBuf],
    notify_tx: mpsc::Sender<()>,
    rereads: Option<Arc<AtomicU64>>,
) -> notify::Result<RecommendedWatcher> {
    let mut files: Vec<(PathBuf, ContentTracker)> = paths
        .iter()
        .map(|path| (path.clone(), ContentTracker::new(std::fs::read(path).ok())))
        .collect();
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok_and(|event| may_change_content(&event.kind)) {
            let _ = raw_tx.send(());
        }
    })?;
    let mut directories: Vec<PathBuf> = paths.iter().map(|p| watched_directory(p)).collect();
    directories.sort();
    directories.dedup();
    for dir in &directories {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            // Debounce: editors, the ConfigMap/Secret swap and a certificate written next to
            // its key produce bursts of events.
            tokio::time::sleep(DEBOUNCE).await;
            while raw_rx.try_recv().is_ok() {}
            if let Some(rereads) = &rereads {
                rereads.fetch_add(1, Ordering::Relaxed);
            }
            let mut changed = false;
            for (path, tracker) in &mut files {
                // Every tracker sees the new content, also after a first change was found.
                changed |= tracker.changed(tokio::fs::read(&*path).await.ok());
            }
            if changed && notify_tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_different_readable_content_is_a_change() {
        let mut tracker = ContentTracker::new(Some(b"a".to_vec()));
        assert!(!tracker.changed(Some(b"a".to_vec())));
        assert!(!tracker.changed(None));
        assert!(tracker.changed(Some(b"b".to_vec())));
        assert!(!tracker.changed(Some(b"b".to_vec())));
        // Back to an earlier content is a change too.
        assert!(tracker.changed(Some(b"a".to_vec())));
        let mut unreadable_at_start = ContentTracker::new(None);
        assert!(unreadable_at_start.changed(Some(Vec::new())));
    }

    #[test]
    fn a_bare_file_name_watches_the_current_directory() {
        assert_eq!(watched_directory(Path::new("config.toml")), Path::new("."));
        assert_eq!(
            watched_directory(Path::new("/etc/dlx/config.toml")),
            Path::new("/etc/dlx")
        );
    }

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn temp_dir(name: &str) -> Dir {
        let dir =
            std::env::temp_dir().join(format!("dlx-proxy-reload-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    async fn notified(rx: &mut mpsc::Receiver<()>, within: Duration) -> bool {
        tokio::time::timeout(within, rx.recv()).await.is_ok()
    }

    #[tokio::test]
    async fn other_files_in_the_directory_do_not_trigger_a_reload() {
        let dir = temp_dir("others");
        let config = dir.0.join("config.toml");
        std::fs::write(&config, "a = 1\n").unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let _watcher = watch_config(&config, tx).unwrap();
        for i in 0..5 {
            std::fs::write(dir.0.join("service.log"), format!("line {i}\n")).unwrap();
        }
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
        // Rewriting the same content is no change either.
        std::fs::write(&config, "a = 1\n").unwrap();
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
        std::fs::write(&config, "a = 2\n").unwrap();
        assert!(notified(&mut rx, Duration::from_secs(5)).await);
    }

    #[test]
    fn opening_reading_or_closing_unwritten_is_no_change() {
        use notify::event::{CreateKind, ModifyKind, RemoveKind, RenameMode};
        let quiet = [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
        ];
        assert!(quiet.iter().all(|kind| !may_change_content(kind)));
        let changes = [
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Modify(ModifyKind::Any),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Create(CreateKind::File),
            EventKind::Remove(RemoveKind::File),
            EventKind::Any,
        ];
        assert!(changes.iter().all(may_change_content));
    }

    #[tokio::test]
    async fn reading_the_file_does_not_make_the_watcher_read_it_again() {
        let dir = temp_dir("reads");
        let config = dir.0.join("config.toml");
        std::fs::write(&config, "a = 1\n").unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let rereads = Arc::new(AtomicU64::new(0));
        let _watcher =
            watch_counting(std::slice::from_ref(&config), tx, Some(rereads.clone())).unwrap();
        // Another reader of the file (a second instance started with the same file, a shell).
        for _ in 0..5 {
            assert_eq!(std::fs::read(&config).unwrap(), b"a = 1\n");
        }
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
        assert_eq!(rereads.load(Ordering::Relaxed), 0, "no re-read for reads");
        // A write is still seen, and the watcher's own re-read starts no further passes.
        std::fs::write(&config, "a = 2\n").unwrap();
        assert!(notified(&mut rx, Duration::from_secs(5)).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after_write = rereads.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(
            rereads.load(Ordering::Relaxed),
            after_write,
            "the re-read is quiet"
        );
    }

    #[tokio::test]
    async fn a_change_to_any_of_several_files_in_several_directories_is_seen() {
        let first = temp_dir("several-a");
        let second = temp_dir("several-b");
        let cert = first.0.join("tls.crt");
        let key = first.0.join("tls.key");
        let ca = second.0.join("ca.crt");
        for path in [&cert, &key, &ca] {
            std::fs::write(path, "one\n").unwrap();
        }
        let (tx, mut rx) = mpsc::channel(4);
        let _watcher = watch_files(&[cert.clone(), key.clone(), ca.clone()], tx).unwrap();
        // A certificate and its key written one after the other: one notification.
        std::fs::write(&cert, "two\n").unwrap();
        std::fs::write(&key, "two\n").unwrap();
        assert!(notified(&mut rx, Duration::from_secs(5)).await);
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
        std::fs::write(&ca, "two\n").unwrap();
        assert!(notified(&mut rx, Duration::from_secs(5)).await);
        // Other files in either directory are no change.
        std::fs::write(first.0.join("notes.txt"), "x\n").unwrap();
        std::fs::write(second.0.join("notes.txt"), "x\n").unwrap();
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
    }

    #[tokio::test]
    async fn a_configmap_data_swap_triggers_a_reload() {
        let dir = temp_dir("configmap");
        let first = dir.0.join("..2026_01_01_00_00_00.1");
        std::fs::create_dir(&first).unwrap();
        std::fs::write(first.join("config.toml"), "a = 1\n").unwrap();
        std::os::unix::fs::symlink("..2026_01_01_00_00_00.1", dir.0.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.toml", dir.0.join("config.toml")).unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let _watcher = watch_config(&dir.0.join("config.toml"), tx).unwrap();

        let second = dir.0.join("..2026_01_01_00_00_01.2");
        std::fs::create_dir(&second).unwrap();
        std::fs::write(second.join("config.toml"), "a = 2\n").unwrap();
        std::os::unix::fs::symlink("..2026_01_01_00_00_01.2", dir.0.join("..data_tmp")).unwrap();
        std::fs::rename(dir.0.join("..data_tmp"), dir.0.join("..data")).unwrap();
        std::fs::remove_dir_all(&first).unwrap();
        assert!(notified(&mut rx, Duration::from_secs(5)).await);
        assert!(!notified(&mut rx, Duration::from_millis(800)).await);
    }
}
