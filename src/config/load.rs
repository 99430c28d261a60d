//! Loading: the figment layers (built-in defaults < the TOML file < `DLX_PROXY_*` environment
//! variables), then [`Config::validate`]; figment's and the validation's errors become
//! [`ConfigError`]s naming the key and where its value came from.
//!
//! The file is read once ([`SourceFile`]): figment merges its text, and its toml spans give
//! the `path:line:column` of a key at fault.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider, Source};
use std::path::{Path, PathBuf};

use super::source::{Point, SourceFile};
use super::{Config, ConfigError};

/// Prefix of the environment variables that override settings; `__` separates nested keys
/// (`DLX_PROXY_LISTEN__AMQP=0.0.0.0:5672`).
pub const ENV_PREFIX: &str = "DLX_PROXY_";

/// The file read when no config file is named and it exists in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "config.toml";

/// Loads the configuration: built-in defaults < the TOML file at `path` (which must exist) <
/// `DLX_PROXY_*` environment variables; then validates it.
///
/// Only environment variables whose first key is a top-level setting are read, so variables
/// that merely share the prefix (Kubernetes service links such as `DLX_PROXY_SERVICE_HOST`)
/// are ignored.
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    let file = path.map(SourceFile::read).transpose()?;
    let figment = layers(file.as_ref());
    let config: Config = figment
        .extract()
        .map_err(|error| from_figment_error(error, &figment, file.as_ref()))?;
    config
        .validate()
        .map_err(|error| with_origin(error, &figment, file.as_ref()))?;
    Ok(config)
}

/// The file `run` and `check-config` use when none is named: `./config.toml` if it exists.
pub fn default_config_path() -> Option<PathBuf> {
    let path = PathBuf::from(DEFAULT_CONFIG_FILE);
    path.is_file().then_some(path)
}

fn layers(file: Option<&SourceFile>) -> Figment {
    let mut figment = Figment::from(Serialized::defaults(Config::default()));
    if let Some(file) = file {
        figment = figment.merge(FileLayer(file));
    }
    figment.merge(env_provider())
}

/// The file's text as a figment layer, with the file as its source (so errors name it).
struct FileLayer<'a>(&'a SourceFile);

impl Provider for FileLayer<'_> {
    fn metadata(&self) -> Metadata {
        Metadata::from("TOML file", Source::File(self.0.path.clone()))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Toml::string(&self.0.text).data()
    }
}

fn env_provider() -> Env {
    let known = top_level_keys();
    Env::prefixed(ENV_PREFIX).split("__").filter(move |key| {
        let first = key.as_str().split('.').next().unwrap_or_default();
        known.iter().any(|k| k.eq_ignore_ascii_case(first))
    })
}

/// The names of the top-level settings, taken from the data shape itself.
pub(super) fn top_level_keys() -> Vec<String> {
    match serde_json::to_value(Config::default()) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Dotted key from figment's path: numeric segments become `[i]`.
fn key_from_path(path: &[String]) -> String {
    let mut key = String::new();
    for segment in path {
        if !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit()) {
            key.push('[');
            key.push_str(segment);
            key.push(']');
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(segment);
        }
    }
    key
}

/// The part of a key figment can look up (it does not index into arrays): `users[0].name` →
/// `users`.
fn lookup_prefix(key: &str) -> &str {
    key.split('[').next().unwrap_or(key)
}

/// Where a key's value came from, in words: the file path, or the environment variable.
fn describe_origin(
    metadata: &figment::Metadata,
    key: &str,
    file: Option<&SourceFile>,
    point: Point,
) -> Option<String> {
    if matches!(metadata.source, Some(figment::Source::File(_))) {
        return Some(match (file, &metadata.source) {
            (Some(file), _) => file
                .locate(key, point)
                .unwrap_or_else(|| file.path.display().to_string()),
            (None, Some(source)) => source.to_string(),
            (None, None) => metadata.name.to_string(),
        });
    }
    if metadata.name.contains("environment") {
        let variable = lookup_prefix(key).replace('.', "__").to_ascii_uppercase();
        return Some(format!("environment variable {ENV_PREFIX}{variable}"));
    }
    None
}

fn origin_of(
    figment: &Figment,
    key: &str,
    file: Option<&SourceFile>,
    point: Point,
) -> Option<String> {
    let metadata = figment.find_metadata(lookup_prefix(key))?;
    describe_origin(metadata, key, file, point)
}

fn from_figment_error(
    error: figment::Error,
    figment: &Figment,
    file: Option<&SourceFile>,
) -> ConfigError {
    let mut point = Point::Value;
    let mut key = key_from_path(&error.path);
    let message = match &error.kind {
        figment::error::Kind::UnknownField(field, expected) => {
            point = Point::Key;
            // figment's path usually ends with the unknown key already.
            if error.path.last() != Some(field) {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(field);
            }
            format!(
                "unknown key `{field}` (known keys: {})",
                expected.join(", ")
            )
        }
        figment::error::Kind::UnknownVariant(value, expected) => {
            format!(
                "unknown value {value:?}; expected one of: {}",
                expected.join(", ")
            )
        }
        kind => kind.to_string(),
    };
    let origin = origin_of(figment, &key, file, point).or_else(|| {
        error
            .metadata
            .as_ref()
            .and_then(|metadata| describe_origin(metadata, &key, file, point))
    });
    if key.is_empty() {
        key = "(top level)".to_string();
    }
    ConfigError::Invalid {
        origin,
        key,
        message,
    }
}

fn with_origin(error: ConfigError, figment: &Figment, file: Option<&SourceFile>) -> ConfigError {
    match error {
        ConfigError::Invalid {
            origin: None,
            key,
            message,
        } => ConfigError::Invalid {
            origin: origin_of(figment, &key, file, Point::Value),
            key,
            message,
        },
        other => other,
    }
}
