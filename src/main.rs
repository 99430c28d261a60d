//! The `dlx-proxy` command line.
//!
//! - `dlx-proxy run [--config FILE]`: load and validate the configuration (FILE, else
//!   `./config.toml` if it exists, else the built-in defaults; `DLX_PROXY_*` variables on top),
//!   start logging and run the service until SIGTERM/SIGINT.
//! - `dlx-proxy check-config [FILE]`: print the effective settings as TOML (secrets redacted)
//!   and exit 0, or print the error (naming the key) and exit 2.
//! - `dlx-proxy policy set|clear VHOST NAME [PATTERN DEFINITION PRIORITY APPLY_TO]`: edit the
//!   runtime policies of a running instance through its admin API (the conformance harness's
//!   policy hook). The admin address and token come from the same layered configuration as
//!   `run` reads (`listen.admin`, `admin.token` / `admin.token_file`); `--admin` overrides
//!   the address.

use clap::{Parser, Subcommand, ValueEnum};
use dlx_proxy::admin;
use dlx_proxy::config::{self, Config, ConfigError};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// Exit status for an unusable configuration.
const EXIT_CONFIG: u8 = 2;
/// Exit status for a failure while running.
const EXIT_FAILURE: u8 = 1;

#[derive(Debug, Parser)]
#[command(
    name = "dlx-proxy",
    version,
    about = "AMQP 0-9-1 sidecar with complete, observable dead-letter semantics"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service until SIGTERM or SIGINT.
    Run {
        /// Configuration file (default: ./config.toml if it exists, else built-in defaults).
        #[arg(long, short = 'c', value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Validate a configuration file (with DLX_PROXY_* overrides) and print the effective
    /// settings; exits 2 if it is invalid.
    CheckConfig {
        /// Configuration file (default: ./config.toml if it exists, else built-in defaults).
        #[arg(value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Set or clear a runtime policy of a running instance through its admin API.
    Policy {
        /// Admin address (default: listen.admin from the configuration).
        #[arg(long, value_name = "HOST:PORT")]
        admin: Option<String>,
        /// Configuration file with the admin address and token (default: ./config.toml if it
        /// exists, else built-in defaults; DLX_PROXY_* variables on top).
        #[arg(long, short = 'c', value_name = "FILE")]
        config: Option<PathBuf>,
        op: PolicyOp,
        vhost: String,
        name: String,
        /// Regex on queue names (set only).
        #[arg(allow_hyphen_values = true)]
        pattern: Option<String>,
        /// JSON object of policy keys, e.g. '{"dead-letter-exchange": "dlx"}' (set only).
        #[arg(allow_hyphen_values = true)]
        definition: Option<String>,
        /// Priority (set only; default 0).
        #[arg(allow_hyphen_values = true)]
        priority: Option<String>,
        /// queues, exchanges or all (set only; default all).
        apply_to: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyOp {
    Set,
    Clear,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run { config } => run(config.as_deref()),
        Command::CheckConfig { file } => check_config(file.as_deref()),
        Command::Policy {
            admin,
            config,
            op,
            vhost,
            name,
            pattern,
            definition,
            priority,
            apply_to,
        } => {
            let args = PolicyArgs {
                op,
                vhost,
                name,
                pattern,
                definition,
                priority,
                apply_to,
            };
            policy(admin, config.as_deref(), args)
        }
    }
}

/// The named file, else `./config.toml` if it exists, else none (built-in defaults).
fn config_path(given: Option<&Path>) -> Option<PathBuf> {
    given
        .map(Path::to_path_buf)
        .or_else(config::default_config_path)
}

fn load_config(given: Option<&Path>) -> Result<(Config, Option<PathBuf>), ConfigError> {
    let path = config_path(given);
    let config = config::load(path.as_deref())?;
    Ok((config, path))
}

fn run(given: Option<&Path>) -> ExitCode {
    let (config, path) = match load_config(given) {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("dlx-proxy: invalid configuration: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Err(error) = config::init_logging(&config.log) {
        eprintln!("dlx-proxy: cannot start logging: {error}");
        return ExitCode::from(EXIT_CONFIG);
    }
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        mode = ?config.mode,
        config_file = %path.as_deref().map_or("(built-in defaults)".into(), |p| p.display().to_string()),
        "starting dlx-proxy"
    );
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if config.runtime.worker_threads > 0 {
        builder.worker_threads(config.runtime.worker_threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    match runtime.block_on(dlx_proxy::service::run(config, path)) {
        Ok(()) => {
            tracing::info!("dlx-proxy stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "dlx-proxy failed");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn check_config(given: Option<&Path>) -> ExitCode {
    let (config, path) = match load_config(given) {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("dlx-proxy: invalid configuration: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match config.to_toml() {
        Ok(text) => {
            let source = path
                .as_deref()
                .map_or("built-in defaults".into(), |p| p.display().to_string());
            println!(
                "# Effective settings: {source} + {}* environment overrides (secrets redacted).",
                config::ENV_PREFIX
            );
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("dlx-proxy: cannot print the configuration: {error}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

struct PolicyArgs {
    op: PolicyOp,
    vhost: String,
    name: String,
    pattern: Option<String>,
    definition: Option<String>,
    priority: Option<String>,
    apply_to: Option<String>,
}

/// The address to reach the admin server: `--admin`, else `listen.admin` from the
/// configuration with an unspecified IP (0.0.0.0, ::) replaced by loopback.
fn admin_address(admin: Option<String>, config: &Config) -> Result<String, String> {
    if let Some(admin) = admin {
        return Ok(admin);
    }
    let address: SocketAddr = config
        .listen
        .admin
        .parse()
        .map_err(|_| "the admin listener is disabled (listen.admin is empty)".to_string())?;
    let ip = match address.ip() {
        ip if ip.is_unspecified() && ip.is_ipv4() => std::net::Ipv4Addr::LOCALHOST.into(),
        ip if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    Ok(SocketAddr::new(ip, address.port()).to_string())
}

fn policy(admin: Option<String>, given: Option<&Path>, args: PolicyArgs) -> ExitCode {
    match send_policy(admin, given, args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dlx-proxy policy: {message}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn send_policy(
    admin: Option<String>,
    given: Option<&Path>,
    args: PolicyArgs,
) -> Result<(), String> {
    let (config, _) = load_config(given).map_err(|e| format!("invalid configuration: {e}"))?;
    let address = admin_address(admin, &config)?;
    let token = config
        .admin
        .resolve_token()
        .map_err(|e| format!("invalid configuration: {e}"))?;
    let path = format!(
        "/api/policies/{}/{}",
        admin::encode_path_segment(&args.vhost),
        admin::encode_path_segment(&args.name)
    );
    let (method, body) = match args.op {
        PolicyOp::Clear => ("DELETE", None),
        PolicyOp::Set => ("PUT", Some(policy_body(&args)?)),
    };
    let (status, text) = admin::request_with_token(
        &address,
        method,
        &path,
        body.as_deref(),
        token.as_ref(),
        Duration::from_secs(10),
    )
    .map_err(|e| format!("{method} http://{address}{path}: {e}"))?;
    if (200..300).contains(&status) {
        Ok(())
    } else {
        Err(format!(
            "{method} http://{address}{path}: HTTP {status}: {text}"
        ))
    }
}

fn policy_body(args: &PolicyArgs) -> Result<String, String> {
    let pattern = args
        .pattern
        .clone()
        .ok_or("set needs PATTERN and DEFINITION")?;
    let definition_text = args
        .definition
        .as_deref()
        .ok_or("set needs PATTERN and DEFINITION")?;
    let definition: serde_json::Value = serde_json::from_str(definition_text)
        .map_err(|e| format!("DEFINITION is not JSON: {e}"))?;
    if !definition.is_object() {
        return Err("DEFINITION must be a JSON object".into());
    }
    let priority: i32 = match args.priority.as_deref().map(str::trim) {
        None | Some("") => 0,
        Some(text) => text
            .parse()
            .map_err(|_| format!("PRIORITY {text:?} is not an integer"))?,
    };
    let apply_to = match args.apply_to.as_deref() {
        None | Some("") => "all",
        Some(apply_to) => apply_to,
    };
    let body = serde_json::json!({
        "pattern": pattern,
        "definition": definition,
        "priority": priority,
        "apply-to": apply_to,
    });
    Ok(body.to_string())
}
