//! The `dlx-proxy` command line.
//!
//! - `dlx-proxy run [--config FILE]`: load and validate the configuration (FILE, else
//!   `./config.toml` if it exists, else the built-in defaults; `DLX_PROXY_*` variables on top),
//!   start logging and run the service until SIGTERM/SIGINT.
//! - `dlx-proxy check-config [--config FILE | FILE]`: print the effective settings as TOML
//!   (secrets redacted) and exit 0, or print the error (naming the key) and exit 2.
//! - `dlx-proxy policy set NAME PATTERN DEFINITION [--vhost V] [--priority N] [--apply-to
//!   queues|exchanges|all]`, `policy clear NAME [--vhost V]`, `policy list [--vhost V]
//!   [--format table|json]`: edit or list the runtime policies of a running instance through
//!   its admin API, with `rabbitmqctl set_policy`'s argument order ([`dlx_proxy::policy_cli`]).
//!   The admin address and token come from the same layered configuration as `run` reads
//!   (`listen.admin`, `admin.token` / `admin.token_file`); `--admin` overrides the address.
//! - `dlx-proxy dlq list --vhost V --queue Q [--limit N] [--format text|json]` and `dlq summary
//!   --vhost V --queue Q`: a dead-letter queue's messages or their counts by death reason and
//!   source queue, through the admin API ([`dlx_proxy::dlq_cli`]), found the same way.
//! - `dlx-proxy redrive --from DLQ [--vhost V] [--to QUEUE] [--rate N/s] [--max N] [--filter
//!   reason=R1|R2] [--dry-run] [--resume ID] [--detach] [--format text|json]`: a redrive job
//!   started and followed through the admin API ([`dlx_proxy::redrive_cli`]), found the same
//!   way; Ctrl-C cancels it.

use clap::{Parser, Subcommand, ValueEnum};
use dlx_proxy::config::{self, Config, ConfigError};
use dlx_proxy::dlq_cli;
use dlx_proxy::policy_cli::{self, AdminClient};
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
        #[arg(long, short = 'c', value_name = "FILE", conflicts_with = "file")]
        config: Option<PathBuf>,
        /// The configuration file, given without --config.
        #[arg(value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Set, clear or list the runtime policies of a running instance through its admin API
    /// (like rabbitmqctl set_policy, clear_policy and list_policies).
    Policy {
        /// Admin address (default: listen.admin from the configuration).
        #[arg(long, global = true, value_name = "HOST:PORT")]
        admin: Option<String>,
        /// Configuration file with the admin address and token (default: ./config.toml if it
        /// exists, else built-in defaults; DLX_PROXY_* variables on top).
        #[arg(long, short = 'c', global = true, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Inspect a dead-letter queue of a running instance through its admin API, without
    /// consuming its messages (in proxy mode RabbitMQ requeues them: see docs/deploy.md).
    Dlq {
        /// Admin address (default: listen.admin from the configuration).
        #[arg(long, global = true, value_name = "HOST:PORT")]
        admin: Option<String>,
        /// Configuration file with the admin address and token (default: ./config.toml if it
        /// exists, else built-in defaults; DLX_PROXY_* variables on top).
        #[arg(long, short = 'c', global = true, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(subcommand)]
        action: DlqAction,
    },
    /// Move the messages of a dead-letter queue back to the queues they died in (or to
    /// --to) through the admin API of a running instance, following the job to its end;
    /// Ctrl-C cancels it (docs/redrive.md).
    Redrive(RedriveArgs),
}

#[derive(Debug, clap::Args)]
struct RedriveArgs {
    /// Admin address (default: listen.admin from the configuration).
    #[arg(long, value_name = "HOST:PORT")]
    admin: Option<String>,
    /// Configuration file with the admin address and token (default: ./config.toml if it
    /// exists, else built-in defaults; DLX_PROXY_* variables on top).
    #[arg(long, short = 'c', value_name = "FILE")]
    config: Option<PathBuf>,
    /// Virtual host.
    #[arg(long, short = 'p', default_value = "/")]
    vhost: String,
    /// The dead-letter queue to redrive.
    #[arg(long, required_unless_present = "resume")]
    from: Option<String>,
    /// Send every message to this queue (default: each to the queue of its newest x-death
    /// entry).
    #[arg(long)]
    to: Option<String>,
    /// Messages moved per second at most, e.g. 100 or 100/s (default: unlimited).
    #[arg(long, value_parser = dlx_proxy::redrive_cli::parse_rate)]
    rate: Option<f64>,
    /// Messages moved at most.
    #[arg(long)]
    max: Option<u64>,
    /// Only messages whose newest death has one of these reasons:
    /// reason=expired|rejected|maxlen|delivery_limit (repeatable).
    #[arg(long, value_name = "reason=R1|R2")]
    filter: Vec<String>,
    /// Count what would move and where; move nothing.
    #[arg(long)]
    dry_run: bool,
    /// Start a job for what job ID left (after a cancel or a failure) instead of a new one.
    #[arg(long, value_name = "ID", conflicts_with_all = ["from", "to", "rate", "max", "filter", "dry_run"])]
    resume: Option<u64>,
    /// Start the job and print its status without following it.
    #[arg(long)]
    detach: bool,
    /// The summary as text, or the final job status as JSON.
    #[arg(long, value_enum, default_value_t = DlqFormat::Text)]
    format: DlqFormat,
}

#[derive(Debug, Subcommand)]
enum DlqAction {
    /// The first messages of the queue: x-death summary, headers, properties, body preview.
    List {
        /// Virtual host.
        #[arg(long, short = 'p', default_value = "/")]
        vhost: String,
        /// The queue.
        #[arg(long, short = 'q')]
        queue: String,
        /// Messages to show (1 to 1000; the server's default is 20).
        #[arg(long, short = 'n')]
        limit: Option<usize>,
        /// Readable text, or JSON as the admin API returns it (with every header).
        #[arg(long, value_enum, default_value_t = DlqFormat::Text)]
        format: DlqFormat,
    },
    /// Counts by newest death reason and by source queue.
    Summary {
        /// Virtual host.
        #[arg(long, short = 'p', default_value = "/")]
        vhost: String,
        /// The queue.
        #[arg(long, short = 'q')]
        queue: String,
        /// Readable text, or JSON as the admin API returns it.
        #[arg(long, value_enum, default_value_t = DlqFormat::Text)]
        format: DlqFormat,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DlqFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum PolicyAction {
    /// Add or replace a policy.
    Set {
        /// Policy name.
        name: String,
        /// Regex on queue (or exchange) names, unanchored.
        #[arg(allow_hyphen_values = true)]
        pattern: String,
        /// JSON object of policy keys, e.g. '{"dead-letter-exchange": "dlx"}'.
        #[arg(allow_hyphen_values = true)]
        definition: String,
        /// Virtual host.
        #[arg(long, short = 'p', default_value = "/")]
        vhost: String,
        /// Among policies matching the same name, the highest priority wins.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        priority: i32,
        /// What the pattern matches.
        #[arg(long, value_parser = ["queues", "exchanges", "all"],
              default_value = config::DEFAULT_APPLY_TO)]
        apply_to: String,
    },
    /// Remove a policy (an error if there is none).
    Clear {
        /// Policy name.
        name: String,
        /// Virtual host.
        #[arg(long, short = 'p', default_value = "/")]
        vhost: String,
    },
    /// List the policies in force in a vhost (TOML and runtime ones).
    List {
        /// Virtual host.
        #[arg(long, short = 'p', default_value = "/")]
        vhost: String,
        /// A tab-separated table like rabbitmqctl's, or JSON as the admin API returns it.
        #[arg(long, alias = "formatter", value_enum, default_value_t = ListFormat::Table)]
        format: ListFormat,
        /// Leave out the title line of the table.
        #[arg(long)]
        no_table_headers: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ListFormat {
    Table,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run { config } => run(config.as_deref()),
        Command::CheckConfig { config, file } => check_config(config.or(file).as_deref()),
        Command::Policy {
            admin,
            config,
            action,
        } => policy(admin, config.as_deref(), action),
        Command::Dlq {
            admin,
            config,
            action,
        } => match dlq(admin, config.as_deref(), action) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("dlx-proxy dlq: {message}");
                ExitCode::from(EXIT_FAILURE)
            }
        },
        Command::Redrive(args) => match redrive(args) {
            Ok(code) => code,
            Err(message) => {
                eprintln!("dlx-proxy redrive: {message}");
                ExitCode::from(EXIT_FAILURE)
            }
        },
    }
}

/// Starts (or resumes) a job and follows it; exits 0 when it is done, 1 when it was
/// cancelled or failed.
fn redrive(args: RedriveArgs) -> Result<ExitCode, String> {
    use dlx_proxy::redrive::jobs::{JobState, RedriveRequest};
    use dlx_proxy::redrive_cli::{self, Follow};
    let client = admin_client(args.admin, args.config.as_deref())?;
    let started = match args.resume {
        Some(id) => redrive_cli::resume(&client, id)?,
        None => {
            let request = RedriveRequest {
                vhost: args.vhost,
                from: args.from.unwrap_or_default(),
                to: args.to,
                rate: args.rate,
                max: args.max,
                filter: args.filter,
                dry_run: args.dry_run,
            };
            redrive_cli::start(&client, &request)?
        }
    };
    let json = matches!(args.format, DlqFormat::Json);
    let last = if args.detach {
        started
    } else {
        if !json {
            eprintln!("redrive job {} started", started.id);
        }
        redrive_cli::follow(client, started, Follow::detect(json))?
    };
    match args.format {
        DlqFormat::Text => print!("{}", redrive_cli::summary_text(&last)),
        DlqFormat::Json => println!("{}", pretty(&last)?),
    }
    Ok(match last.state {
        JobState::Done | JobState::Running => ExitCode::SUCCESS,
        JobState::Cancelled | JobState::Failed => ExitCode::from(EXIT_FAILURE),
    })
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
        mode = %config.mode,
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

fn policy(admin: Option<String>, given: Option<&Path>, action: PolicyAction) -> ExitCode {
    match run_policy(admin, given, action) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dlx-proxy policy: {message}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// The admin API of the instance the layered configuration (or `--admin`) names.
fn admin_client(admin: Option<String>, given: Option<&Path>) -> Result<AdminClient, String> {
    let (config, _) = load_config(given).map_err(|e| format!("invalid configuration: {e}"))?;
    Ok(AdminClient {
        address: admin_address(admin, &config)?,
        token: config
            .admin
            .resolve_token()
            .map_err(|e| format!("invalid configuration: {e}"))?,
        timeout: Duration::from_secs(30),
    })
}

fn dlq(admin: Option<String>, given: Option<&Path>, action: DlqAction) -> Result<(), String> {
    let client = admin_client(admin, given)?;
    match action {
        DlqAction::List {
            vhost,
            queue,
            limit,
            format,
        } => {
            let page = dlq_cli::list(&client, &vhost, &queue, limit)?;
            match format {
                DlqFormat::Text => print!("{}", dlq_cli::page_text(&page)),
                DlqFormat::Json => println!("{}", pretty(&page)?),
            }
        }
        DlqAction::Summary {
            vhost,
            queue,
            format,
        } => {
            let summary = dlq_cli::summary(&client, &vhost, &queue)?;
            match format {
                DlqFormat::Text => print!("{}", dlq_cli::summary_text(&summary)),
                DlqFormat::Json => println!("{}", pretty(&summary)?),
            }
        }
    }
    Ok(())
}

fn pretty<T: serde::Serialize>(value: &T) -> Result<String, String> {
    serde_json::to_string_pretty(value).map_err(|e| e.to_string())
}

fn run_policy(
    admin: Option<String>,
    given: Option<&Path>,
    action: PolicyAction,
) -> Result<(), String> {
    let client = admin_client(admin, given)?;
    match action {
        PolicyAction::Set {
            name,
            pattern,
            definition,
            vhost,
            priority,
            apply_to,
        } => {
            let body = policy_cli::set_body(&pattern, &definition, priority, &apply_to)?;
            client.set(&vhost, &name, &body)
        }
        PolicyAction::Clear { name, vhost } => client.clear(&vhost, &name),
        PolicyAction::List {
            vhost,
            format,
            no_table_headers,
        } => {
            let policies = client.list(&vhost)?;
            match format {
                ListFormat::Table => print!("{}", policy_cli::table(&policies, !no_table_headers)),
                ListFormat::Json => {
                    let text =
                        serde_json::to_string_pretty(&policies).map_err(|e| e.to_string())?;
                    println!("{text}");
                }
            }
            Ok(())
        }
    }
}
