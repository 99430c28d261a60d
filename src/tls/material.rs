//! [`Reloadable`]: a TLS configuration built from files, the one in force, and a way to build
//! it again when the files change.
//!
//! Listeners and connectors take [`Reloadable::current`] for each new connection, so a new
//! certificate, key or CA applies to the next handshake; connections already established keep
//! the configuration they were made with. A rebuild that fails (a file cut short, a key that
//! does not match the certificate) changes nothing: the previous configuration stays in force
//! and the caller reports the error.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

type Loader<T> = Box<dyn Fn() -> anyhow::Result<Arc<T>> + Send + Sync>;

/// A configuration of type `T` (a rustls `ServerConfig` or `ClientConfig`) and its sources.
pub struct Reloadable<T> {
    what: &'static str,
    files: Vec<PathBuf>,
    load: Loader<T>,
    current: RwLock<Arc<T>>,
}

impl<T> std::fmt::Debug for Reloadable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloadable")
            .field("what", &self.what)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl<T> Reloadable<T> {
    /// Builds the first configuration with `load` (its error is returned as is); `what` names
    /// the material in logs, `files` are the files `load` reads.
    pub fn new(
        what: &'static str,
        files: Vec<PathBuf>,
        load: impl Fn() -> anyhow::Result<Arc<T>> + Send + Sync + 'static,
    ) -> anyhow::Result<Reloadable<T>> {
        let first = load()?;
        Ok(Reloadable {
            what,
            files,
            load: Box::new(load),
            current: RwLock::new(first),
        })
    }

    /// The configuration for the next connection.
    pub fn current(&self) -> Arc<T> {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Builds the configuration again from the files; on success it replaces the current one,
    /// on failure the current one stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let fresh = (self.load)()?;
        match self.current.write() {
            Ok(mut current) => *current = fresh,
            Err(poisoned) => *poisoned.into_inner() = fresh,
        }
        Ok(())
    }

    /// What this material is, for logs ("amqps listener", "upstream CA").
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The files the configuration is built from (to watch them).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A loader that returns whatever the test put in `source`.
    fn from_source(source: &Arc<Mutex<Result<u32, String>>>) -> Reloadable<u32> {
        let source = source.clone();
        Reloadable::new("test", vec![PathBuf::from("/x")], move || {
            match source.lock().unwrap().clone() {
                Ok(value) => Ok(Arc::new(value)),
                Err(error) => Err(anyhow::anyhow!(error)),
            }
        })
        .unwrap()
    }

    #[test]
    fn a_successful_reload_replaces_and_a_failed_one_keeps_the_current_value() {
        let source = Arc::new(Mutex::new(Ok(1)));
        let material = from_source(&source);
        let first = material.current();
        assert_eq!(*first, 1);

        *source.lock().unwrap() = Ok(2);
        material.reload().unwrap();
        assert_eq!(*material.current(), 2);
        // Whoever took the old value keeps it (an established connection).
        assert_eq!(*first, 1);

        *source.lock().unwrap() = Err("tls.key_file: broken".into());
        let error = material.reload().unwrap_err();
        assert_eq!(error.to_string(), "tls.key_file: broken");
        assert_eq!(*material.current(), 2);
        assert_eq!(material.files(), [PathBuf::from("/x")]);
        assert_eq!(material.what(), "test");
    }

    #[test]
    fn the_first_load_must_succeed() {
        let error =
            Reloadable::<u32>::new("test", vec![], || Err(anyhow::anyhow!("no file"))).unwrap_err();
        assert_eq!(error.to_string(), "no file");
    }
}
