//! Certificate rotation without a restart: every [`Reloadable`] TLS configuration of the
//! service (the amqps listener's certificate, key and client CA; the upstream CA) is rebuilt
//! when one of its files changes and on SIGHUP.
//!
//! Each material gets its own watcher from [`crate::reload::watch_files`], which watches the
//! files' directories, so a Kubernetes Secret update (an atomic swap of the `..data` symlink
//! in the Secret's own mount directory) is seen like a file rewritten in place. Every rebuild
//! is counted in `tls_reloads_total{result}`; a failed one is logged with the key and file at
//! fault, and the previous configuration stays in force.

use std::path::PathBuf;
use std::sync::Arc;

use notify::RecommendedWatcher;
use tokio::sync::mpsc;

use super::material::Reloadable;
use crate::metrics::Metrics;

/// A TLS configuration that can be rebuilt from its files, whatever its type.
pub trait Material: Send + Sync {
    /// For logs.
    fn what(&self) -> &'static str;
    /// The files to watch.
    fn files(&self) -> &[PathBuf];
    /// Rebuilds from the files; on error the current configuration stays.
    fn reload(&self) -> anyhow::Result<()>;
}

impl<T: Send + Sync> Material for Reloadable<T> {
    fn what(&self) -> &'static str {
        Reloadable::what(self)
    }

    fn files(&self) -> &[PathBuf] {
        Reloadable::files(self)
    }

    fn reload(&self) -> anyhow::Result<()> {
        Reloadable::reload(self)
    }
}

/// The service's reloadable TLS materials.
pub struct TlsRotation {
    materials: Vec<Arc<dyn Material>>,
    metrics: Arc<Metrics>,
}

impl TlsRotation {
    pub fn new(metrics: Arc<Metrics>) -> TlsRotation {
        TlsRotation {
            materials: Vec::new(),
            metrics,
        }
    }

    /// Adds a material to rotate.
    pub fn add(&mut self, material: Arc<dyn Material>) {
        self.materials.push(material);
    }

    /// Rebuilds every material (SIGHUP).
    pub fn reload_all(&self) {
        for material in &self.materials {
            reload_one(material.as_ref(), &self.metrics);
        }
    }

    /// Starts watching each material's files; a change rebuilds that material. Watching stops
    /// when the returned watchers are dropped. A material whose files cannot be watched is
    /// logged (SIGHUP still reloads it).
    pub fn watch(&self) -> Vec<RecommendedWatcher> {
        let mut watchers = Vec::new();
        for material in &self.materials {
            if material.files().is_empty() {
                continue;
            }
            let (tx, mut rx) = mpsc::channel::<()>(1);
            match crate::reload::watch_files(material.files(), tx) {
                Ok(watcher) => watchers.push(watcher),
                Err(err) => {
                    tracing::warn!(%err, material = material.what(), "TLS file watching unavailable; SIGHUP still reloads");
                    continue;
                }
            }
            let material = material.clone();
            let metrics = self.metrics.clone();
            tokio::spawn(async move {
                while rx.recv().await.is_some() {
                    reload_one(material.as_ref(), &metrics);
                }
            });
        }
        watchers
    }
}

fn reload_one(material: &dyn Material, metrics: &Metrics) {
    match material.reload() {
        Ok(()) => {
            metrics.tls_reloaded(true);
            tracing::info!(material = material.what(), "TLS material reloaded");
        }
        Err(err) => {
            metrics.tls_reloaded(false);
            tracing::error!(
                material = material.what(),
                error = %format!("{err:#}"),
                "TLS reload rejected; the previous certificates stay in force"
            );
        }
    }
}
