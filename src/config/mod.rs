//! Service configuration: the data shape of `config.toml`, how it is loaded, and its checks.
//!
//! Values are layered with figment: built-in defaults < the TOML file < `DLX_PROXY_*`
//! environment variables (`__` separates nested keys). Everything downstream (listeners, the
//! broker, the proxy, the policy set) is built from one validated [`Config`].
//!
//! [`load`] merges the layers and runs [`Config::validate`]; every [`ConfigError`] names the
//! key at fault and, when known, where the value came from: the file with the line and column
//! of the key or value (from toml's own spans), or the environment variable.
//! [`Config::validate`] is the whole check: `run`, `check-config` and a reload all go through
//! it, and it runs the same policy validation (`policy::Policy::from_config`) the service
//! builds its policy set with, so nothing `run` would refuse passes `check-config`.
//!
//! Passwords, password hashes and the admin token are [`Secret`](crate::secret::Secret)s, and
//! the upstream URL's password is masked in `Debug`: a configuration can be logged without
//! leaking them.
//!
//! One job per file:
//!
//! | file | job |
//! |---|---|
//! | `schema.rs` | the structs, their defaults and serde shape |
//! | `load.rs` | the figment layers and mapping figment's errors to keys and origins |
//! | `source.rs` | the config file's text and toml's spans: syntax errors, key → line:column |
//! | `validate.rs` | [`Config::validate`], each error naming the key |
//! | `error.rs` | [`ConfigError`] |
//! | `logging.rs` | the `[log]` checks and the tracing subscriber |

mod error;
mod load;
mod logging;
mod schema;
mod source;
mod validate;

pub use error::ConfigError;
pub use load::{DEFAULT_CONFIG_FILE, ENV_PREFIX, default_config_path, load};
pub use logging::init_logging;
pub use schema::*;
pub use validate::MIN_FRAME_MAX;

#[cfg(test)]
mod tests;
