//! Logging setup: the `[log]` table's checks and the global tracing subscriber built from it.

use super::{ConfigError, LogConfig};

impl LogConfig {
    /// The format is "text" or "json" and the filter parses.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !matches!(self.format.as_str(), "text" | "json") {
            return Err(ConfigError::invalid(
                "log.format",
                format!("{:?} is not \"text\" or \"json\"", self.format),
            ));
        }
        tracing_subscriber::EnvFilter::try_new(&self.filter)
            .map(|_| ())
            .map_err(|error| ConfigError::invalid("log.filter", error.to_string()))
    }
}

/// Installs the global tracing subscriber: the filter comes from `RUST_LOG` when set, else from
/// `log.filter`; lines are text or JSON per `log.format`. Fails if the filter does not parse
/// or a subscriber is already installed.
pub fn init_logging(cfg: &LogConfig) -> Result<(), ConfigError> {
    use tracing_subscriber::EnvFilter;
    cfg.validate()?;
    let (key, directives) = match std::env::var("RUST_LOG") {
        Ok(value) if !value.trim().is_empty() => ("RUST_LOG", value),
        _ => ("log.filter", cfg.filter.clone()),
    };
    let filter = EnvFilter::try_new(&directives)
        .map_err(|error| ConfigError::invalid(key, error.to_string()))?;
    // Colours only on a terminal: in Kubernetes logs go to a pipe and must stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    let installed = if cfg.format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    installed.map_err(|error| ConfigError::invalid("log", error.to_string()))
}
