//! [`ConfigError`]: why a configuration cannot be used, naming the key at fault and where its
//! value came from (the file with line and column, or the environment variable).

use std::path::PathBuf;

/// Why a configuration cannot be used. The text names the key at fault and, when known, where
/// the value came from (`config.toml: key `listen.amqp`: invalid socket address ...`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The configuration file does not exist or cannot be read.
    #[error("{}: cannot read the config file: {reason}", .path.display())]
    Unreadable { path: PathBuf, reason: String },
    /// The file is not valid TOML; `key` is the key on the offending line (best effort).
    #[error("{}:{line}:{column}: key `{key}`: {message}", .path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        key: String,
        message: String,
    },
    /// A key is unknown, a value has the wrong type, or a setting is invalid.
    #[error("{}key `{key}`: {message}", origin_prefix(.origin))]
    Invalid {
        /// The file or environment variable the value came from, when known.
        origin: Option<String>,
        /// Dotted key, arrays indexed: `users[0].permissions[1].vhost`.
        key: String,
        message: String,
    },
}

fn origin_prefix(origin: &Option<String>) -> String {
    match origin {
        Some(origin) => format!("{origin}: "),
        None => String::new(),
    }
}

impl ConfigError {
    pub(super) fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            origin: None,
            key: key.into(),
            message: message.into(),
        }
    }

    /// The key at fault (empty for an unreadable file).
    pub fn key(&self) -> &str {
        match self {
            ConfigError::Unreadable { .. } => "",
            ConfigError::Syntax { key, .. } | ConfigError::Invalid { key, .. } => key,
        }
    }
}
