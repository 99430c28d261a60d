//! Service configuration: the data shape of `config.toml`.
//!
//! Values are layered with figment: built-in defaults < the TOML file < `DLX_PROXY_*`
//! environment variables (`__` separates nested keys). Everything downstream (listeners, the
//! broker, the proxy, the policy set) is built from one validated [`Config`].
//!
//! [`load`] merges the layers and runs [`Config::validate`]; every [`ConfigError`] names the
//! key at fault and, when known, where the value came from (the file, with line and column for
//! syntax errors, or the environment variable). [`Config::validate`] is the whole check: `run`,
//! `check-config` and a reload all go through it, and it runs the same policy validation
//! (`policy::Policy::from_config`) the service builds its policy set with, so nothing `run`
//! would refuse passes `check-config`.
//!
//! Passwords, password hashes and the admin token are [`Secret`]s, and the upstream URL's
//! password is masked in `Debug`: a configuration can be logged without leaking them.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::secret::Secret;

/// Which engine serves client connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The process is the broker.
    #[default]
    Embedded,
    /// Each client connection is forwarded to an upstream node (`upstream.urls`).
    Proxy,
}

impl std::fmt::Display for Mode {
    /// As written in the config file: `embedded` or `proxy`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Embedded => "embedded",
            Mode::Proxy => "proxy",
        })
    }
}

/// The whole configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub mode: Mode,
    pub listen: ListenConfig,
    pub upstream: UpstreamConfig,
    pub limits: LimitsConfig,
    pub dead_letter: DeadLetterConfig,
    pub storage: StorageConfig,
    pub proxy: ProxyConfig,
    pub tls: TlsConfig,
    pub log: LogConfig,
    pub metrics: MetricsConfig,
    pub shutdown: ShutdownConfig,
    pub runtime: RuntimeConfig,
    pub admin: AdminConfig,
    /// Virtual hosts of the embedded broker.
    pub vhosts: Vec<String>,
    /// Users of the embedded broker.
    pub users: Vec<UserConfig>,
    /// Dead-letter, TTL and length policies (both modes).
    pub policies: Vec<PolicyConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Embedded,
            listen: ListenConfig::default(),
            upstream: UpstreamConfig::default(),
            limits: LimitsConfig::default(),
            dead_letter: DeadLetterConfig::default(),
            storage: StorageConfig::default(),
            proxy: ProxyConfig::default(),
            tls: TlsConfig::default(),
            log: LogConfig::default(),
            metrics: MetricsConfig::default(),
            shutdown: ShutdownConfig::default(),
            runtime: RuntimeConfig::default(),
            admin: AdminConfig::default(),
            vhosts: vec!["/".to_string()],
            users: vec![UserConfig::default()],
            policies: Vec::new(),
        }
    }
}

/// Listening addresses; an empty string disables a listener.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenConfig {
    pub amqp: String,
    pub amqps: String,
    pub admin: String,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            amqp: "127.0.0.1:5672".into(),
            amqps: String::new(),
            admin: "127.0.0.1:15692".into(),
        }
    }
}

/// The upstream broker (proxy mode).
#[derive(Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    /// One amqp:// or amqps:// URL: the same as `urls` with one entry (give one of the two).
    pub url: String,
    /// amqp:// or amqps:// URLs of the upstream nodes, tried in order (from the last one that
    /// worked) until one accepts; in proxy mode, this or `url` is required. Their credentials
    /// are not used (each client brings its own) but are masked wherever a URL is shown.
    pub urls: Vec<String>,
    /// Seconds to wait for the upstream TCP/TLS connection.
    pub connect_timeout_secs: u64,
    /// PEM file with CA certificates for amqps upstreams (empty: the system's roots are not used;
    /// give a CA file for TLS upstreams).
    pub tls_ca_file: String,
    /// Server name to verify (defaults to the URL host).
    pub tls_server_name: String,
    /// Verify the upstream certificate (on by default).
    pub tls_verify: bool,
    /// The proxy's own user on the upstream (its service identity): the service connections
    /// that own the capture exchange and queue log in as this user. Required in proxy mode
    /// unless `proxy.delegate_to_upstream`.
    pub user: String,
    /// The service user's password (prefer `password_file`).
    #[serde(deserialize_with = "secret_string_or_number")]
    pub password: Secret<String>,
    /// File holding the service user's password (a mounted Kubernetes Secret), one trailing
    /// newline removed; read at start.
    pub password_file: String,
    /// The upstream's management HTTP API (`http://host:15672`), optional. With it the
    /// proxy mirrors its policies as upstream policies named `dlx-proxy.<name>`, so queues
    /// that were never declared through the proxy get their limits and dead-letter through
    /// the capture path ([`crate::proxy::policy_sync`]). Empty: no upstream policies.
    pub management_url: String,
    /// Seconds between two reconciliations of the upstream policies (they also run at start,
    /// on every reload and on every policy change through the admin API).
    pub management_sync_interval_secs: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: String::new(),
            urls: Vec::new(),
            connect_timeout_secs: 5,
            tls_ca_file: String::new(),
            tls_server_name: String::new(),
            tls_verify: true,
            user: String::new(),
            password: Secret::default(),
            password_file: String::new(),
            management_url: String::new(),
            management_sync_interval_secs: 30,
        }
    }
}

/// The proxy's own login on the upstream (`upstream.user` with its password).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceIdentity {
    pub user: String,
    pub password: Secret<String>,
}

impl UpstreamConfig {
    /// The URL with its password masked: the form to log or print.
    pub fn url_for_display(&self) -> String {
        redact_url_password(&self.url)
    }

    /// The service identity: `upstream.user` with exactly one of `upstream.password` and
    /// `upstream.password_file` (read now). `None` when no user is set. Errors name the key
    /// and never show the password.
    pub fn service_identity(&self) -> Result<Option<ServiceIdentity>, ConfigError> {
        let has_password = !self.password.is_empty();
        let has_file = !self.password_file.is_empty();
        if self.user.is_empty() {
            if has_password || has_file {
                return Err(ConfigError::invalid(
                    "upstream.user",
                    "a service password is set but no service user",
                ));
            }
            return Ok(None);
        }
        let password = match (has_password, has_file) {
            (true, true) => {
                return Err(ConfigError::invalid(
                    "upstream.password_file",
                    "set either upstream.password or upstream.password_file, not both",
                ));
            }
            (true, false) => self.password.clone(),
            (false, true) => {
                let password = read_secret_file("upstream.password_file", &self.password_file)?;
                if password.is_empty() {
                    return Err(ConfigError::invalid(
                        "upstream.password_file",
                        format!("{:?} holds an empty password", self.password_file),
                    ));
                }
                Secret::new(password)
            }
            (false, false) => {
                return Err(ConfigError::invalid(
                    "upstream.password",
                    format!(
                        "service user {:?} needs a password or a password_file",
                        self.user
                    ),
                ));
            }
        };
        Ok(Some(ServiceIdentity {
            user: self.user.clone(),
            password,
        }))
    }

    /// The upstream URLs in the order they are tried, each with the key that names it:
    /// `upstream.urls[i]`, else `upstream.url` alone; empty when neither is set.
    pub fn targets(&self) -> Vec<(String, &str)> {
        if !self.urls.is_empty() {
            return self
                .urls
                .iter()
                .enumerate()
                .map(|(index, url)| (format!("upstream.urls[{index}]"), url.as_str()))
                .collect();
        }
        if self.url.is_empty() {
            return Vec::new();
        }
        vec![("upstream.url".to_string(), self.url.as_str())]
    }

    /// The upstream URLs with their passwords masked, comma-separated: the form to log.
    pub fn urls_for_display(&self) -> String {
        self.targets()
            .iter()
            .map(|(_, url)| redact_url_password(url))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The proxy's own RabbitMQ identity (`upstream.user` with `upstream.password` or
/// `upstream.password_file`): the user of the management API calls. Empty when none is set
/// or the password file cannot be read (validation reports that, naming the key).
pub fn service_credentials(config: &Config) -> (String, Secret<String>) {
    match config.upstream.service_identity() {
        Ok(Some(identity)) => (identity.user, identity.password),
        _ => (String::new(), Secret::default()),
    }
}

impl std::fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &self.url_for_display())
            .field(
                "urls",
                &self
                    .urls
                    .iter()
                    .map(|url| redact_url_password(url))
                    .collect::<Vec<_>>(),
            )
            .field("connect_timeout_secs", &self.connect_timeout_secs)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_server_name", &self.tls_server_name)
            .field("tls_verify", &self.tls_verify)
            .field("management_url", &redact_url_password(&self.management_url))
            .field(
                "management_sync_interval_secs",
                &self.management_sync_interval_secs,
            )
            .field("user", &self.user)
            .field("password", &self.password)
            .field("password_file", &self.password_file)
            .finish()
    }
}

/// Protocol and resource limits offered to clients.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest frame the server accepts and offers in connection.tune (bytes).
    pub frame_max: u32,
    /// Largest channel number offered in connection.tune.
    pub channel_max: u16,
    /// Heartbeat interval offered in connection.tune (seconds, 0 = off).
    pub heartbeat_secs: u16,
    /// Largest message body accepted (bytes); larger publishes get 406.
    pub max_message_size: u64,
    /// Largest number of client connections; further connections are refused.
    pub max_connections: usize,
    /// Largest number of queues per vhost.
    pub max_queues: usize,
    /// Bytes of encoded frames waiting for one connection's socket before deliveries pause.
    pub connection_outbox_bytes: usize,
    /// Seconds a client has to finish the handshake.
    pub handshake_timeout_secs: u64,
    /// Deepest nesting of field tables and arrays accepted in method arguments (queue and
    /// exchange declare, bind, consume, client properties); a deeper method closes the
    /// connection with 501. Message headers are never refused (see `amqp::headers`).
    pub max_table_depth: usize,
    /// Used memory above which connections that publish are blocked (embedded mode): bytes
    /// (536870912, "512MiB", "1GB") or a fraction 0 < f < 1 of the memory limit (the cgroup's,
    /// else the total RAM). See `memory::watermark`.
    #[serde(deserialize_with = "string_or_number")]
    pub memory_high_watermark: String,
    /// Milliseconds between two samples of used memory (embedded mode).
    pub memory_check_interval_ms: u64,
    /// Milliseconds a consumer may hold a delivery unacknowledged before its channel is
    /// closed (406) and its deliveries requeued, each counted as a delivery attempt; 0 = off.
    /// A queue's `x-consumer-timeout` or policy `consumer-timeout` lowers it.
    pub consumer_timeout: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat_secs: 60,
            max_message_size: 128 * 1024 * 1024,
            max_connections: 10_000,
            max_queues: 100_000,
            connection_outbox_bytes: 4 * 1024 * 1024,
            handshake_timeout_secs: 10,
            max_table_depth: crate::amqp::depth::DEFAULT_MAX_TABLE_DEPTH,
            memory_high_watermark: "0.4".into(),
            memory_check_interval_ms: 250,
            consumer_timeout: 0,
        }
    }
}

/// Dead-letter behaviour switches.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// "3" (RabbitMQ 3.10-3.12 semantics, default) or "4" (3.13+/4.x: CC kept, x-last-death-*,
    /// client x-death ignored).
    #[serde(deserialize_with = "string_or_number")]
    pub compat: String,
    /// Add an `x-death-total` header counting every death of the message.
    pub x_death_total: bool,
    /// Drop a message (counted, cause `hop_limit`) once it has died this many times; 0 = off.
    pub max_hops: u32,
    /// Default delivery limit for every queue without one (0 = off).
    pub default_delivery_limit: u32,
    /// `false`: a message with an x-death history never expires (queue or message TTL) in
    /// the queue it reached; length limits still apply. `true` (RabbitMQ): it does.
    pub ttl_on_dead_letters: bool,
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        DeadLetterConfig {
            compat: "3".into(),
            x_death_total: false,
            max_hops: 0,
            default_delivery_limit: 0,
            ttl_on_dead_letters: true,
        }
    }
}

/// Embedded mode's durable storage (docs/storage.md).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageConfig {
    /// Directory of the definitions and the message log (relative: under the working
    /// directory); empty = nothing stored.
    pub dir: String,
    /// "always" (confirms after fsync) or "never" (tests and benchmarks).
    pub fsync: String,
    /// Bytes after which the log starts a new segment.
    pub segment_size: u64,
    /// Free space on the file system of `dir` below which publishers are blocked (the disk
    /// alarm): bytes (50000000, "50MB", "1GiB"); 0 = no disk alarm. Changes on reload.
    #[serde(deserialize_with = "string_or_number")]
    pub disk_free_limit: String,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            dir: DEFAULT_STORAGE_DIR.into(),
            fsync: "always".into(),
            segment_size: 64 << 20,
            disk_free_limit: "50MB".into(),
        }
    }
}

/// `storage.dir` by default: `data` under the working directory.
pub const DEFAULT_STORAGE_DIR: &str = "data";

/// Smallest `storage.segment_size`.
const MIN_SEGMENT_SIZE: u64 = 4096;

impl StorageConfig {
    /// The storage settings, or None when storage is off (`dir` empty).
    pub fn options(&self) -> Option<crate::storage::StorageOptions> {
        (!self.dir.is_empty()).then(|| crate::storage::StorageOptions {
            dir: std::path::PathBuf::from(&self.dir),
            fsync: self.fsync != "never",
            segment_size: self.segment_size,
        })
    }

    /// `disk_free_limit` in bytes (0 when invalid: validation refuses that first).
    pub fn disk_free_limit_bytes(&self) -> u64 {
        crate::memory::watermark::parse_size(&self.disk_free_limit).unwrap_or(0)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        crate::memory::watermark::parse_size(&self.disk_free_limit)
            .map_err(|message| ConfigError::invalid("storage.disk_free_limit", message))?;
        if !matches!(self.fsync.as_str(), "always" | "never") {
            return Err(ConfigError::invalid(
                "storage.fsync",
                format!("{:?} is not \"always\" or \"never\"", self.fsync),
            ));
        }
        if self.segment_size < MIN_SEGMENT_SIZE {
            return Err(ConfigError::invalid(
                "storage.segment_size",
                format!("must be at least {MIN_SEGMENT_SIZE} bytes"),
            ));
        }
        Ok(())
    }
}

/// Proxy-mode limits.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Bytes of kept (unsettled) deliveries per client connection before the proxy pauses
    /// reading from the upstream.
    pub max_inflight_bytes: usize,
    /// Seconds to wait for the upstream confirm of a dead-letter publish.
    pub confirm_timeout_secs: u64,
    /// Milliseconds before the first retry of a dead-letter publish the upstream refused
    /// (nack, confirm timeout, channel lost); the original is held unacked meanwhile.
    pub retry_initial_ms: u64,
    /// Longest delay in milliseconds between retries (the delay doubles up to it; each delay
    /// is jittered into its upper half).
    pub retry_max_ms: u64,
    /// Let the upstream broker dead-letter on its own (do not take the DLX arguments over).
    pub delegate_to_upstream: bool,
    /// Name of the upstream exchange and queue the proxy owns to capture TTL and length
    /// deaths (give each proxy deployment sharing one upstream its own).
    pub capture_name: String,
    /// Microseconds a connection keeps polling its sockets after its last traffic before its
    /// thread sleeps (0: never). Trades CPU for latency; see docs/deploy.md.
    pub busy_poll_us: u64,
    /// Users the proxy refuses (403 ACCESS_REFUSED, as RabbitMQ's `loopback_users`) unless
    /// the client connects from a loopback address; empty: no such rule. The upstream only
    /// sees the proxy's address, so it cannot apply its own rule to proxied clients.
    pub loopback_users: Vec<String>,
    /// Upstream vhosts served by a service connection from the start (capture consumed there
    /// with no client connected). Vhosts clients open are added as they are opened.
    pub vhosts: Vec<String>,
    /// Most vhosts with a service connection (configured and opened by clients).
    pub max_service_vhosts: usize,
    /// Seconds a client's queue.declare naming the capture exchange waits for its vhost's
    /// capture objects before the client connection is closed with 320.
    pub capture_ready_timeout_secs: u64,
}

/// Largest accepted `proxy.retry_max_ms` (10 minutes).
pub const MAX_RETRY_MS: u64 = 600_000;

/// Largest accepted `proxy.busy_poll_us` (10 ms).
pub const MAX_BUSY_POLL_US: u64 = 10_000;

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_inflight_bytes: 64 * 1024 * 1024,
            confirm_timeout_secs: 30,
            retry_initial_ms: 100,
            retry_max_ms: 5000,
            delegate_to_upstream: false,
            capture_name: "dlx-proxy.capture".into(),
            busy_poll_us: 0,
            loopback_users: vec!["guest".into()],
            vhosts: vec!["/".into()],
            max_service_vhosts: 64,
            capture_ready_timeout_secs: 10,
        }
    }
}

/// Client-facing TLS (the amqps listener).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: String,
    pub key_file: String,
    /// CA bundle to verify client certificates with (empty: no client certificates).
    pub client_ca_file: String,
    /// Require a client certificate (needs `client_ca_file`).
    pub require_client_cert: bool,
}

/// Logging.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// RUST_LOG-style filter; RUST_LOG wins when set.
    pub filter: String,
    /// "text" or "json".
    pub format: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            filter: "info".into(),
            format: "text".into(),
        }
    }
}

/// Metrics.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Distinct queue label values per metric before new ones fold into `_other`.
    pub max_queue_labels: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            max_queue_labels: 500,
        }
    }
}

/// Graceful shutdown.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Seconds to let in-flight work finish before client connections are closed.
    pub drain_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { drain_secs: 5 }
    }
}

/// The async runtime the service runs on.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Worker threads; 0 means one per CPU core. A sidecar with a CPU request of one core or
    /// less does best with 1: a connection's two sockets and its work then stay on one thread.
    pub worker_threads: usize,
}

/// Most runtime worker threads accepted.
pub const MAX_WORKER_THREADS: usize = 1024;

/// The admin HTTP API (`listen.admin`). Reading (metrics, health, policies) needs nothing;
/// changing policies needs `Authorization: Bearer <token>` with this token, and is refused
/// (403) while no token is set.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// The bearer token for write requests (prefer `token_file`). A number is taken as its
    /// digits (`DLX_PROXY_ADMIN__TOKEN=123456` reads as one), never quoted in an error.
    #[serde(deserialize_with = "secret_string_or_number")]
    pub token: Secret<String>,
    /// File holding the token (a mounted Kubernetes Secret); read at start and on every
    /// reload, one trailing newline removed. Exclusive with `token`.
    pub token_file: String,
}

impl AdminConfig {
    /// The token in force: `token`, else the contents of `token_file` (one trailing newline
    /// removed), else none. Both set, an unreadable or empty file, or a token with characters
    /// a header cannot carry is an error naming the key.
    pub fn resolve_token(&self) -> Result<Option<Secret<String>>, ConfigError> {
        let (key, token) = match (self.token.is_empty(), self.token_file.is_empty()) {
            (true, true) => return Ok(None),
            (false, false) => {
                return Err(ConfigError::invalid(
                    "admin.token",
                    "admin.token and admin.token_file are both set; set only one",
                ));
            }
            (false, true) => ("admin.token", self.token.expose().clone()),
            (true, false) => (
                "admin.token_file",
                read_secret_file("admin.token_file", &self.token_file)?,
            ),
        };
        if token.is_empty() {
            return Err(ConfigError::invalid(key, "the token is empty"));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::invalid(
                key,
                "the token may only hold printable ASCII without spaces",
            ));
        }
        Ok(Some(Secret::new(token)))
    }
}

/// The contents of a secret file (a mounted Kubernetes Secret) with one trailing newline
/// (`\n` or `\r\n`) removed; an unreadable file is an error naming `key`.
fn read_secret_file(key: &str, path: &str) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| ConfigError::invalid(key, format!("cannot read {path:?}: {error}")))?;
    let trimmed = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    Ok(trimmed.to_string())
}

/// A user of the embedded broker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UserConfig {
    pub name: String,
    /// Plain-text password (use `password_hash` in production).
    #[serde(deserialize_with = "secret_string_or_number")]
    pub password: Secret<String>,
    /// RabbitMQ `rabbit_password_hashing_sha256` hash: base64(salt[4] ++ sha256(salt ++ password)).
    #[serde(deserialize_with = "secret_string_or_number")]
    pub password_hash: Secret<String>,
    /// File holding the plain-text password (a mounted Kubernetes Secret); read at start and
    /// on every reload, one trailing newline removed.
    pub password_file: String,
    /// Only allow this user from loopback addresses (RabbitMQ's rule for guest).
    pub loopback_only: bool,
    pub permissions: Vec<PermissionConfig>,
}

impl Default for UserConfig {
    fn default() -> Self {
        UserConfig {
            name: "guest".into(),
            password: "guest".into(),
            password_hash: Secret::default(),
            password_file: String::new(),
            loopback_only: true,
            permissions: vec![PermissionConfig::default()],
        }
    }
}

/// How a user's password is configured, once `password`, `password_hash` and
/// `password_file` are resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credential {
    /// A plain-text password, from `password` or read from `password_file`.
    Plain(Secret<String>),
    /// A RabbitMQ password hash (`password_hash`), not yet decoded.
    Hash(Secret<String>),
}

impl UserConfig {
    /// The credential in force for `users[index]`: exactly one of `password`,
    /// `password_hash` and `password_file` must be set (`password` defaults to "guest":
    /// write `password = ""` next to the others). The file is read now, so a reload picks
    /// up a rotated Secret; an unreadable or empty file is an error naming the key.
    pub fn credential(&self, index: usize) -> Result<Credential, ConfigError> {
        let key = |field: &str| format!("users[{index}].{field}");
        let set = [
            ("password", !self.password.is_empty()),
            ("password_hash", !self.password_hash.is_empty()),
            ("password_file", !self.password_file.is_empty()),
        ];
        let given: Vec<&str> = set.iter().filter(|(_, on)| *on).map(|(k, _)| *k).collect();
        match given.as_slice() {
            ["password"] => Ok(Credential::Plain(self.password.clone())),
            ["password_hash"] => Ok(Credential::Hash(self.password_hash.clone())),
            ["password_file"] => {
                let password = read_secret_file(&key("password_file"), &self.password_file)?;
                if password.is_empty() {
                    return Err(ConfigError::invalid(
                        key("password_file"),
                        format!("{:?} holds an empty password", self.password_file),
                    ));
                }
                Ok(Credential::Plain(Secret::new(password)))
            }
            [] => Err(ConfigError::invalid(
                key("password"),
                format!(
                    "user {:?} needs a password, a password_hash or a password_file",
                    self.name
                ),
            )),
            [.., last] => Err(ConfigError::invalid(
                key(last),
                format!(
                    "user {:?} has {}; set exactly one (password defaults to \"guest\": \
                     write password = \"\" next to a password_hash or password_file)",
                    self.name,
                    given.join(" and ")
                ),
            )),
        }
    }
}

/// configure/write/read permission regexes of one user in one vhost.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PermissionConfig {
    pub vhost: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

impl Default for PermissionConfig {
    fn default() -> Self {
        PermissionConfig {
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }
    }
}

/// What a policy applies to when it does not say: queues, in TOML, in the admin API and in
/// `dlx-proxy policy set` alike (dead-letter keys only act on queues).
pub const DEFAULT_APPLY_TO: &str = "queues";

/// A policy as written in TOML (validated into a `policy::Policy`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub name: String,
    pub vhost: String,
    /// Regex on the queue (or exchange) name, unanchored like RabbitMQ's.
    pub pattern: String,
    /// "queues" (the default, [`DEFAULT_APPLY_TO`]), "exchanges" or "all".
    pub apply_to: String,
    pub priority: i32,
    /// RabbitMQ policy keys: dead-letter-exchange, dead-letter-routing-key, message-ttl,
    /// expires, max-length, max-length-bytes, overflow, delivery-limit.
    pub definition: BTreeMap<String, serde_json::Value>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            name: String::new(),
            vhost: "/".into(),
            pattern: String::new(),
            apply_to: DEFAULT_APPLY_TO.into(),
            priority: 0,
            definition: BTreeMap::new(),
        }
    }
}

/// Accepts a string or a bare number for a string setting (`compat = 4`, or an environment
/// variable such as `DLX_PROXY_DEAD_LETTER__COMPAT=4`, which figment reads as a number).
fn string_or_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum StringOrNumber {
        String(String),
        Unsigned(u64),
        Signed(i64),
        Float(f64),
    }
    Ok(match StringOrNumber::deserialize(deserializer)? {
        StringOrNumber::String(s) => s,
        StringOrNumber::Unsigned(n) => n.to_string(),
        StringOrNumber::Signed(n) => n.to_string(),
        StringOrNumber::Float(n) => n.to_string(),
    })
}

/// [`string_or_number`] for a secret (`password = 1234`).
fn secret_string_or_number<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Secret<String>, D::Error> {
    string_or_number(deserializer).map(Secret::new)
}

// ------------------------------------------------------------------------------------------
// Loading
// ------------------------------------------------------------------------------------------

/// Prefix of the environment variables that override settings; `__` separates nested keys
/// (`DLX_PROXY_LISTEN__AMQP=0.0.0.0:5672`).
pub const ENV_PREFIX: &str = "DLX_PROXY_";

/// The file read when no config file is named and it exists in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "config.toml";

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
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
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

/// Loads the configuration: built-in defaults < the TOML file at `path` (which must exist) <
/// `DLX_PROXY_*` environment variables; then validates it.
///
/// Only environment variables whose first key is a top-level setting are read, so variables
/// that merely share the prefix (Kubernetes service links such as `DLX_PROXY_SERVICE_HOST`)
/// are ignored.
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    if let Some(path) = path {
        check_toml_syntax(path)?;
    }
    let figment = layers(path);
    let config: Config = figment
        .extract()
        .map_err(|error| from_figment_error(error, &figment, path))?;
    config
        .validate()
        .map_err(|error| with_origin(error, &figment, path))?;
    Ok(config)
}

/// The file `run` and `check-config` use when none is named: `./config.toml` if it exists.
pub fn default_config_path() -> Option<PathBuf> {
    let path = PathBuf::from(DEFAULT_CONFIG_FILE);
    path.is_file().then_some(path)
}

fn layers(path: Option<&Path>) -> Figment {
    let mut figment = Figment::from(Serialized::defaults(Config::default()));
    if let Some(path) = path {
        figment = figment.merge(Toml::file_exact(path));
    }
    figment.merge(env_provider())
}

fn env_provider() -> Env {
    let known = top_level_keys();
    Env::prefixed(ENV_PREFIX).split("__").filter(move |key| {
        let first = key.as_str().split('.').next().unwrap_or_default();
        known.iter().any(|k| k.eq_ignore_ascii_case(first))
    })
}

/// The names of the top-level settings, taken from the data shape itself.
fn top_level_keys() -> Vec<String> {
    match serde_json::to_value(Config::default()) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Reads and parses the file once on its own to report syntax errors with line and column.
fn check_toml_syntax(path: &Path) -> Result<(), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Unreadable {
        path: path.to_path_buf(),
        reason: error.to_string(),
    })?;
    match toml::from_str::<toml::Table>(&text) {
        Ok(_) => Ok(()),
        Err(error) => {
            let offset = error.span().map(|span| span.start).unwrap_or(0);
            let (line, column) = line_and_column(&text, offset);
            Err(ConfigError::Syntax {
                path: path.to_path_buf(),
                line,
                column,
                key: key_at_line(&text, line),
                message: error.message().trim().replace('\n', "; "),
            })
        }
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// The dotted key written on `line` (1-based), prefixed by the table it sits in; or the table
/// header itself. Best effort: used only to name the key in a syntax error.
fn key_at_line(text: &str, line: usize) -> String {
    let mut table = String::new();
    for (index, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        let header = trimmed
            .strip_prefix("[[")
            .and_then(|rest| rest.split("]]").next())
            .or_else(|| {
                trimmed
                    .strip_prefix('[')
                    .and_then(|rest| rest.split(']').next())
            });
        if index + 1 == line {
            if let Some(header) = header {
                return header.trim().to_string();
            }
            let key = trimmed
                .split('=')
                .next()
                .map(str::trim)
                .filter(|key| !key.is_empty() && trimmed.contains('='))
                .map(|key| key.trim_matches(|c| c == '"' || c == '\'').to_string());
            return match (key, table.is_empty()) {
                (Some(key), true) => key,
                (Some(key), false) => format!("{table}.{key}"),
                (None, false) => table,
                (None, true) => "(top level)".to_string(),
            };
        }
        if let Some(header) = header {
            table = header.trim().to_string();
        }
    }
    if table.is_empty() {
        "(top level)".to_string()
    } else {
        table
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
fn describe_origin(metadata: &figment::Metadata, key: &str, file: Option<&Path>) -> Option<String> {
    if matches!(metadata.source, Some(figment::Source::File(_))) {
        return Some(match (file, &metadata.source) {
            (Some(file), _) => file.display().to_string(),
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

fn origin_of(figment: &Figment, key: &str, file: Option<&Path>) -> Option<String> {
    let metadata = figment.find_metadata(lookup_prefix(key))?;
    describe_origin(metadata, key, file)
}

fn from_figment_error(
    error: figment::Error,
    figment: &Figment,
    file: Option<&Path>,
) -> ConfigError {
    let mut key = key_from_path(&error.path);
    let message = match &error.kind {
        figment::error::Kind::UnknownField(field, expected) => {
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
    let origin = origin_of(figment, &key, file).or_else(|| {
        error
            .metadata
            .as_ref()
            .and_then(|metadata| describe_origin(metadata, &key, file))
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

fn with_origin(error: ConfigError, figment: &Figment, file: Option<&Path>) -> ConfigError {
    match error {
        ConfigError::Invalid {
            origin: None,
            key,
            message,
        } => ConfigError::Invalid {
            origin: origin_of(figment, &key, file),
            key,
            message,
        },
        other => other,
    }
}

// ------------------------------------------------------------------------------------------
// Validation
// ------------------------------------------------------------------------------------------

/// The smallest frame_max AMQP 0-9-1 allows.
pub const MIN_FRAME_MAX: u32 = 4096;

/// Longest vhost, user and policy name (an AMQP short string).
const MAX_NAME_LEN: usize = 255;

/// Bounds of `limits.memory_check_interval_ms`.
const MIN_MEMORY_CHECK_MS: u64 = 10;
const MAX_MEMORY_CHECK_MS: u64 = 60_000;

impl Config {
    /// Checks every setting that can be checked without starting anything (files are read:
    /// the admin token, TLS certificates, keys and CA bundles); the first problem found is
    /// returned. `run`, `check-config` and reloads
    /// all call this, so `check-config` accepts exactly what `run` accepts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_listen()?;
        if self.mode == Mode::Proxy {
            self.validate_upstream()?;
        }
        self.admin.resolve_token()?;
        self.validate_limits()?;
        self.validate_dead_letter()?;
        self.storage.validate()?;
        self.validate_proxy()?;
        self.validate_tls()?;
        self.validate_tls_material()?;
        self.log.validate()?;
        if self.runtime.worker_threads > MAX_WORKER_THREADS {
            return Err(ConfigError::invalid(
                "runtime.worker_threads",
                format!("must be at most {MAX_WORKER_THREADS} (0 = one per CPU core)"),
            ));
        }
        let vhosts = self.validate_vhosts()?;
        self.validate_users(&vhosts)?;
        self.validate_policies(&vhosts)
    }

    fn validate_listen(&self) -> Result<(), ConfigError> {
        for (key, address) in [
            ("listen.amqp", &self.listen.amqp),
            ("listen.amqps", &self.listen.amqps),
            ("listen.admin", &self.listen.admin),
        ] {
            if !address.is_empty() {
                parse_socket_addr(key, address)?;
            }
        }
        if self.listen.amqp.is_empty() && self.listen.amqps.is_empty() {
            return Err(ConfigError::invalid(
                "listen.amqp",
                "listen.amqp and listen.amqps are both empty: no client listener",
            ));
        }
        Ok(())
    }

    fn validate_upstream(&self) -> Result<(), ConfigError> {
        let upstream = &self.upstream;
        if !upstream.url.is_empty() && !upstream.urls.is_empty() {
            return Err(ConfigError::invalid(
                "upstream.urls",
                "upstream.url and upstream.urls are both set: give the addresses in \
                 upstream.urls only",
            ));
        }
        let targets = upstream.targets();
        if targets.is_empty() {
            return Err(ConfigError::invalid(
                "upstream.urls",
                "required in proxy mode (the amqp:// or amqps:// URLs of the upstream broker's \
                 nodes; upstream.url for a single one)",
            ));
        }
        let mut seen = BTreeSet::new();
        let mut any_tls = false;
        for (key, url) in &targets {
            let uri = parse_amqp_url(key, url)?;
            if !seen.insert((uri.authority.host.clone(), uri.authority.port)) {
                return Err(ConfigError::invalid(
                    key.as_str(),
                    format!("{:?} names a node listed before", redact_url_password(url)),
                ));
            }
            any_tls |= uri.scheme == amq_protocol::uri::AMQPScheme::AMQPS;
        }
        if upstream.connect_timeout_secs == 0 {
            return Err(ConfigError::invalid(
                "upstream.connect_timeout_secs",
                "must be at least 1",
            ));
        }
        if !upstream.tls_ca_file.is_empty() {
            require_file("upstream.tls_ca_file", &upstream.tls_ca_file)?;
        }
        if any_tls && upstream.tls_verify && upstream.tls_ca_file.is_empty() {
            return Err(ConfigError::invalid(
                "upstream.tls_ca_file",
                "an amqps:// upstream with tls_verify = true needs a CA file",
            ));
        }
        let identity = upstream.service_identity()?;
        if identity.is_none() && !self.proxy.delegate_to_upstream {
            return Err(ConfigError::invalid(
                "upstream.user",
                "required in proxy mode (the proxy's own user on the upstream, which owns the \
                 capture exchange and queue) unless proxy.delegate_to_upstream = true",
            ));
        }
        self.validate_management()
    }

    /// `upstream.management_url` and what it needs: an http:// URL without credentials in
    /// it, a sync interval, and the service identity to authenticate with.
    fn validate_management(&self) -> Result<(), ConfigError> {
        let upstream = &self.upstream;
        if upstream.management_url.is_empty() {
            return Ok(());
        }
        crate::proxy::policy_sync::ManagementEndpoint::parse(&upstream.management_url)
            .map_err(|message| ConfigError::invalid("upstream.management_url", message))?;
        if upstream.management_sync_interval_secs == 0 {
            return Err(ConfigError::invalid(
                "upstream.management_sync_interval_secs",
                "must be at least 1",
            ));
        }
        let (user, _) = service_credentials(self);
        if user.is_empty() {
            return Err(ConfigError::invalid(
                "upstream.user",
                "required with upstream.management_url (the proxy's own RabbitMQ user, \
                 allowed to set policies in the proxy's vhosts)",
            ));
        }
        Ok(())
    }

    fn validate_limits(&self) -> Result<(), ConfigError> {
        let limits = &self.limits;
        if limits.frame_max < MIN_FRAME_MAX {
            return Err(ConfigError::invalid(
                "limits.frame_max",
                format!(
                    "{} is below the AMQP minimum of {MIN_FRAME_MAX}",
                    limits.frame_max
                ),
            ));
        }
        for (key, value) in [
            ("limits.max_message_size", limits.max_message_size),
            ("limits.max_connections", limits.max_connections as u64),
            ("limits.max_queues", limits.max_queues as u64),
            (
                "limits.connection_outbox_bytes",
                limits.connection_outbox_bytes as u64,
            ),
            (
                "limits.handshake_timeout_secs",
                limits.handshake_timeout_secs,
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(key, "must be at least 1"));
            }
        }
        let ceiling = crate::amqp::depth::MAX_TABLE_DEPTH_CEILING;
        if !(1..=ceiling).contains(&limits.max_table_depth) {
            return Err(ConfigError::invalid(
                "limits.max_table_depth",
                format!(
                    "{} is not between 1 and {ceiling} (deeper tables would risk the stack of \
                     the task decoding them)",
                    limits.max_table_depth
                ),
            ));
        }
        crate::memory::Watermark::parse(&limits.memory_high_watermark)
            .map_err(|message| ConfigError::invalid("limits.memory_high_watermark", message))?;
        if !(MIN_MEMORY_CHECK_MS..=MAX_MEMORY_CHECK_MS).contains(&limits.memory_check_interval_ms) {
            return Err(ConfigError::invalid(
                "limits.memory_check_interval_ms",
                format!("must be {MIN_MEMORY_CHECK_MS} to {MAX_MEMORY_CHECK_MS}"),
            ));
        }
        if limits.consumer_timeout > crate::rabbit::args::MAX_EXPIRY_MS {
            return Err(ConfigError::invalid(
                "limits.consumer_timeout",
                "must be at most 315360000000 (ten years in ms; 0 = off)",
            ));
        }
        Ok(())
    }

    fn validate_dead_letter(&self) -> Result<(), ConfigError> {
        match self.dead_letter.compat.as_str() {
            "3" | "4" => Ok(()),
            other => Err(ConfigError::invalid(
                "dead_letter.compat",
                format!("{other:?} is not \"3\" or \"4\""),
            )),
        }
    }

    fn validate_proxy(&self) -> Result<(), ConfigError> {
        if self.proxy.max_inflight_bytes == 0 {
            return Err(ConfigError::invalid(
                "proxy.max_inflight_bytes",
                "must be at least 1",
            ));
        }
        if self.proxy.confirm_timeout_secs == 0 {
            return Err(ConfigError::invalid(
                "proxy.confirm_timeout_secs",
                "must be at least 1",
            ));
        }
        if self.proxy.retry_initial_ms == 0 {
            return Err(ConfigError::invalid(
                "proxy.retry_initial_ms",
                "must be at least 1",
            ));
        }
        if self.proxy.retry_max_ms < self.proxy.retry_initial_ms
            || self.proxy.retry_max_ms > MAX_RETRY_MS
        {
            return Err(ConfigError::invalid(
                "proxy.retry_max_ms",
                format!(
                    "must be between proxy.retry_initial_ms ({}) and {MAX_RETRY_MS}",
                    self.proxy.retry_initial_ms
                ),
            ));
        }
        if self.proxy.capture_name.is_empty() || self.proxy.capture_name.len() > 255 {
            return Err(ConfigError::invalid(
                "proxy.capture_name",
                "must be 1 to 255 bytes",
            ));
        }
        if self.proxy.busy_poll_us > MAX_BUSY_POLL_US {
            return Err(ConfigError::invalid(
                "proxy.busy_poll_us",
                format!("must be at most {MAX_BUSY_POLL_US} (0 = never poll)"),
            ));
        }
        for (i, user) in self.proxy.loopback_users.iter().enumerate() {
            if user.is_empty() {
                return Err(ConfigError::invalid(
                    format!("proxy.loopback_users[{i}]"),
                    "must not be empty",
                ));
            }
        }
        for (i, vhost) in self.proxy.vhosts.iter().enumerate() {
            if vhost.is_empty() || vhost.len() > 255 {
                return Err(ConfigError::invalid(
                    format!("proxy.vhosts[{i}]"),
                    "must be 1 to 255 bytes",
                ));
            }
        }
        if self.proxy.max_service_vhosts < self.proxy.vhosts.len().max(1) {
            return Err(ConfigError::invalid(
                "proxy.max_service_vhosts",
                format!(
                    "must be at least 1 and at least the {} vhosts in proxy.vhosts",
                    self.proxy.vhosts.len()
                ),
            ));
        }
        if self.proxy.capture_ready_timeout_secs == 0 {
            return Err(ConfigError::invalid(
                "proxy.capture_ready_timeout_secs",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    fn validate_tls(&self) -> Result<(), ConfigError> {
        let tls = &self.tls;
        if !self.listen.amqps.is_empty() {
            for (key, file) in [
                ("tls.cert_file", &tls.cert_file),
                ("tls.key_file", &tls.key_file),
            ] {
                if file.is_empty() {
                    return Err(ConfigError::invalid(
                        key,
                        "required when listen.amqps is set",
                    ));
                }
                require_file(key, file)?;
            }
        }
        if !tls.client_ca_file.is_empty() {
            require_file("tls.client_ca_file", &tls.client_ca_file)?;
        }
        if tls.require_client_cert && tls.client_ca_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.client_ca_file",
                "required when tls.require_client_cert = true",
            ));
        }
        Ok(())
    }

    /// Loads the TLS material the way the service does at start (certificates, keys and CA
    /// bundles must parse, not only exist), so `check-config` catches what `run` would.
    fn validate_tls_material(&self) -> Result<(), ConfigError> {
        if !self.listen.amqps.is_empty() {
            crate::tls::acceptor(&self.tls).map_err(|error| {
                let text = format!("{error:#}");
                let key = text
                    .split(':')
                    .next()
                    .filter(|prefix| prefix.starts_with("tls."))
                    .unwrap_or("tls.cert_file")
                    .to_string();
                ConfigError::invalid(key, text)
            })?;
        }
        if self.mode == Mode::Proxy {
            use crate::proxy::upstream::{UpstreamError, UpstreamTarget};
            UpstreamTarget::all_from_config(&self.upstream).map_err(|error| {
                let key = match &error {
                    UpstreamError::BadUrl { key, .. } => key.as_str(),
                    UpstreamError::NoUrl => "upstream.urls",
                    UpstreamError::Tls(text) if text.starts_with("server name") => {
                        "upstream.tls_server_name"
                    }
                    UpstreamError::Tls(_) => "upstream.tls_ca_file",
                };
                ConfigError::invalid(key, error.to_string())
            })?;
        }
        Ok(())
    }

    fn validate_vhosts(&self) -> Result<BTreeSet<&str>, ConfigError> {
        if self.vhosts.is_empty() {
            return Err(ConfigError::invalid(
                "vhosts",
                "at least one vhost is needed",
            ));
        }
        let mut seen = BTreeSet::new();
        for (index, vhost) in self.vhosts.iter().enumerate() {
            let key = format!("vhosts[{index}]");
            check_name(&key, vhost)?;
            if !seen.insert(vhost.as_str()) {
                return Err(ConfigError::invalid(
                    key,
                    format!("vhost {vhost:?} is listed twice"),
                ));
            }
        }
        Ok(seen)
    }

    fn validate_users(&self, vhosts: &BTreeSet<&str>) -> Result<(), ConfigError> {
        let mut seen = BTreeSet::new();
        for (index, user) in self.users.iter().enumerate() {
            let key = |field: &str| format!("users[{index}].{field}");
            check_name(&key("name"), &user.name)?;
            if !seen.insert(user.name.as_str()) {
                return Err(ConfigError::invalid(
                    key("name"),
                    format!("user {:?} is listed twice", user.name),
                ));
            }
            if let Credential::Hash(hash) = user.credential(index)? {
                check_password_hash(&key("password_hash"), hash.expose())?;
            }
            let mut permitted = BTreeSet::new();
            for (p, permission) in user.permissions.iter().enumerate() {
                let key = |field: &str| format!("users[{index}].permissions[{p}].{field}");
                if !vhosts.contains(permission.vhost.as_str()) {
                    return Err(ConfigError::invalid(
                        key("vhost"),
                        format!("unknown vhost {:?} (not in `vhosts`)", permission.vhost),
                    ));
                }
                if !permitted.insert(permission.vhost.as_str()) {
                    return Err(ConfigError::invalid(
                        key("vhost"),
                        format!(
                            "user {:?} has two permission entries for vhost {:?}",
                            user.name, permission.vhost
                        ),
                    ));
                }
                check_regex(&key("configure"), &permission.configure)?;
                check_regex(&key("write"), &permission.write)?;
                check_regex(&key("read"), &permission.read)?;
            }
        }
        Ok(())
    }

    fn validate_policies(&self, vhosts: &BTreeSet<&str>) -> Result<(), ConfigError> {
        let mut seen = BTreeSet::new();
        for (index, policy) in self.policies.iter().enumerate() {
            let key = |field: &str| format!("policies[{index}].{field}");
            check_name(&key("name"), &policy.name)?;
            if !vhosts.contains(policy.vhost.as_str()) {
                return Err(ConfigError::invalid(
                    key("vhost"),
                    format!(
                        "policy {:?}: unknown vhost {:?} (not in `vhosts`)",
                        policy.name, policy.vhost
                    ),
                ));
            }
            if !seen.insert((policy.vhost.as_str(), policy.name.as_str())) {
                return Err(ConfigError::invalid(
                    key("name"),
                    format!(
                        "policy {:?} is defined twice in vhost {:?}",
                        policy.name, policy.vhost
                    ),
                ));
            }
            check_regex(&key("pattern"), &policy.pattern)?;
            if !matches!(policy.apply_to.as_str(), "queues" | "exchanges" | "all") {
                return Err(ConfigError::invalid(
                    key("apply_to"),
                    format!(
                        "{:?} is not \"queues\", \"exchanges\" or \"all\"",
                        policy.apply_to
                    ),
                ));
            }
            // The definition, exactly as the service builds its policy set from it.
            crate::policy::Policy::from_config(policy).map_err(|error| {
                ConfigError::invalid(
                    key(&error.key),
                    format!("policy {:?}: {}", policy.name, error.message),
                )
            })?;
        }
        Ok(())
    }

    /// A copy with secrets replaced by `"<redacted>"`: user passwords and password hashes,
    /// the admin token and the upstream URL's password. For printing the effective settings.
    pub fn redacted(&self) -> Config {
        let redact = |secret: &mut Secret<String>| {
            if !secret.is_empty() {
                *secret = Secret::from(REDACTED);
            }
        };
        let mut config = self.clone();
        for user in &mut config.users {
            redact(&mut user.password);
            redact(&mut user.password_hash);
        }
        redact(&mut config.admin.token);
        redact(&mut config.upstream.password);
        config.upstream.management_url = redact_url_password(&config.upstream.management_url);
        config.upstream.url = config.upstream.url_for_display();
        for url in &mut config.upstream.urls {
            *url = redact_url_password(url);
        }
        config
    }

    /// The settings as TOML text (secrets redacted), as `check-config` prints them.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string_pretty(&self.redacted())
            .map_err(|error| ConfigError::invalid("(top level)", error.to_string()))
    }
}

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

const REDACTED: &str = "<redacted>";

/// `amqp://user:secret@host/` → `amqp://user:<redacted>@host/`.
pub fn redact_url_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let authority_start = scheme_end + 3;
    let rest = &url[authority_start..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_len];
    let Some(at) = authority.rfind('@') else {
        return url.to_string();
    };
    let Some(colon) = authority[..at].find(':') else {
        return url.to_string();
    };
    format!(
        "{}{}{}{}",
        &url[..authority_start + colon + 1],
        REDACTED,
        &authority[at..],
        &rest[authority_len..]
    )
}

fn parse_socket_addr(key: &str, address: &str) -> Result<SocketAddr, ConfigError> {
    address.parse::<SocketAddr>().map_err(|error| {
        ConfigError::invalid(
            key,
            format!("invalid socket address {address:?} ({error}); expected IP:PORT, e.g. \"127.0.0.1:5672\""),
        )
    })
}

fn parse_amqp_url(key: &str, url: &str) -> Result<amq_protocol::uri::AMQPUri, ConfigError> {
    let shown = redact_url_password(url);
    if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
        return Err(ConfigError::invalid(
            key,
            format!("{shown:?} is not an amqp:// or amqps:// URL"),
        ));
    }
    url.parse::<amq_protocol::uri::AMQPUri>().map_err(|error| {
        // The parser's message may quote the whole URL: never show its password.
        let error = error.replace(url, &shown);
        ConfigError::invalid(key, format!("invalid URL {shown:?}: {error}"))
    })
}

fn require_file(key: &str, path: &str) -> Result<(), ConfigError> {
    match std::fs::metadata(path) {
        Ok(metadata) if metadata.is_file() => Ok(()),
        Ok(_) => Err(ConfigError::invalid(key, format!("{path:?} is not a file"))),
        Err(error) => Err(ConfigError::invalid(key, format!("{path:?}: {error}"))),
    }
}

fn check_name(key: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(ConfigError::invalid(key, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(ConfigError::invalid(
            key,
            format!("longer than {MAX_NAME_LEN} bytes"),
        ));
    }
    Ok(())
}

fn check_regex(key: &str, pattern: &str) -> Result<(), ConfigError> {
    regex::Regex::new(pattern)
        .map(|_| ())
        .map_err(|error| ConfigError::invalid(key, format!("invalid regex {pattern:?}: {error}")))
}

/// base64(salt[4] ++ sha256(salt ++ password)): 36 bytes once decoded.
fn check_password_hash(key: &str, hash: &str) -> Result<(), ConfigError> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(hash)
        .map_err(|error| ConfigError::invalid(key, format!("not base64: {error}")))?;
    if bytes.len() != 36 {
        return Err(ConfigError::invalid(
            key,
            format!(
                "decodes to {} bytes; a rabbit_password_hashing_sha256 hash has 36 (4 salt + 32 digest)",
                bytes.len()
            ),
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Logging
// ------------------------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Writes `text` to a fresh temporary file and returns its path.
    fn temp_file(text: &str) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("dlx-proxy-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    fn load_text(text: &str) -> Result<Config, ConfigError> {
        let path = temp_file(text);
        let result = load(Some(&path));
        std::fs::remove_file(&path).unwrap();
        result
    }

    fn error_text(text: &str) -> String {
        load_text(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
        let config = load(None).unwrap();
        assert_eq!(config.listen.amqp, "127.0.0.1:5672");
    }

    #[test]
    fn file_values_override_defaults() {
        let config = load_text(
            r#"
            mode = "proxy"
            vhosts = ["/", "orders"]
            [listen]
            amqp = "0.0.0.0:5673"
            [upstream]
            url = "amqp://user:pw@rabbit:5672/orders"
            user = "dlx-proxy"
            password = "service-pw"
            [dead_letter]
            compat = 4
            [[policies]]
            name = "dlx-all"
            vhost = "orders"
            pattern = ".*"
            definition = { dead-letter-exchange = "dlx", message-ttl = 60000 }
            "#,
        )
        .unwrap();
        assert_eq!(config.mode, Mode::Proxy);
        assert_eq!(config.listen.amqp, "0.0.0.0:5673");
        assert_eq!(config.listen.admin, "127.0.0.1:15692");
        assert_eq!(config.dead_letter.compat, "4");
        assert_eq!(config.policies[0].definition["message-ttl"], 60000);
        assert_eq!(config.policies[0].apply_to, "queues");
    }

    #[test]
    fn storage_settings_are_checked_by_key() {
        let text = error_text("[storage]\nfsync = \"sometimes\"\n");
        assert!(
            text.contains("key `storage.fsync`: \"sometimes\" is not \"always\" or \"never\""),
            "{text}"
        );
        let text = error_text("[storage]\ndisk_free_limit = \"lots\"\n");
        assert!(
            text.contains("key `storage.disk_free_limit`: \"lots\" does not start with a number"),
            "{text}"
        );
        let config = load_text("[storage]\ndisk_free_limit = 1048576\n").unwrap();
        assert_eq!(config.storage.disk_free_limit_bytes(), 1 << 20);
        let config = load_text("[storage]\ndisk_free_limit = \"2GiB\"\n").unwrap();
        assert_eq!(config.storage.disk_free_limit_bytes(), 2 << 30);
        assert_eq!(
            Config::default().storage.disk_free_limit_bytes(),
            50_000_000
        );
        let text = error_text("[storage]\nsegment_size = 100\n");
        assert!(
            text.contains("key `storage.segment_size`: must be at least 4096 bytes"),
            "{text}"
        );
        assert!(
            load_text("[storage]\ndir = \"\"\n")
                .unwrap()
                .storage
                .options()
                .is_none(),
            "an empty dir turns it off"
        );
        let options = Config::default().storage.options().expect("on by default");
        assert_eq!(options.dir, PathBuf::from("data"));
        assert!(options.fsync);
        let config = load_text("[storage]\ndir = \"/var/lib/x\"\nfsync = \"never\"\n").unwrap();
        let options = config.storage.options().unwrap();
        assert_eq!(options.dir, PathBuf::from("/var/lib/x"));
        assert!(!options.fsync);
        assert_eq!(options.segment_size, 64 << 20);
    }

    #[test]
    fn missing_file_is_an_error() {
        let error = load(Some(Path::new("/nonexistent/dlx-proxy.toml"))).unwrap_err();
        assert!(matches!(error, ConfigError::Unreadable { .. }), "{error}");
        assert!(error.to_string().contains("/nonexistent/dlx-proxy.toml"));
    }

    #[test]
    fn invalid_socket_address_names_file_and_key() {
        let text = error_text("[listen]\namqp = \"nope\"\n");
        assert!(
            text.contains(".toml: key `listen.amqp`: invalid socket address \"nope\""),
            "{text}"
        );
    }

    #[test]
    fn proxy_loopback_users_default_to_guest_and_name_a_bad_entry() {
        assert_eq!(
            Config::default().proxy.loopback_users,
            vec!["guest".to_string()]
        );
        let text = error_text("[proxy]\nloopback_users = [\"guest\", \"\"]\n");
        assert!(text.contains("key `proxy.loopback_users[1]`"), "{text}");
        let text = error_text("[proxy]\nloopback_users = \"guest\"\n");
        assert!(text.contains("key `proxy.loopback_users`"), "{text}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let text = error_text("[limits]\nframe_max = \"x\"\n");
        assert!(text.contains("key `limits.frame_max`"), "{text}");
        assert!(text.contains("invalid type"), "{text}");
    }

    #[test]
    fn unknown_key_is_named() {
        let text = error_text("[listen]\namqp_port = 5672\n");
        assert!(
            text.contains("key `listen.amqp_port`: unknown key"),
            "{text}"
        );
        let text = error_text("colour = \"blue\"\n");
        assert!(text.contains("key `colour`"), "{text}");
    }

    #[test]
    fn syntax_error_has_line_column_and_key() {
        let error = load_text("mode = \"embedded\"\n[listen]\namqp = nope\n").unwrap_err();
        match &error {
            ConfigError::Syntax {
                line, column, key, ..
            } => {
                assert_eq!((*line, *column, key.as_str()), (3, 8, "listen.amqp"));
            }
            other => panic!("expected a syntax error, got {other:?}"),
        }
        assert!(
            error.to_string().contains(":3:8: key `listen.amqp`:"),
            "{error}"
        );
    }

    #[test]
    fn array_element_errors_are_indexed() {
        let text =
            error_text("[[users]]\nname = \"a\"\npassword = \"b\"\nloopback_only = \"yes\"\n");
        assert!(text.contains("key `users[0].loopback_only`"), "{text}");
    }

    #[test]
    fn limits_and_switches_are_checked() {
        let cases = [
            ("[limits]\nframe_max = 1024\n", "limits.frame_max"),
            ("[limits]\nmax_table_depth = 0\n", "limits.max_table_depth"),
            (
                "[limits]\nmax_table_depth = 129\n",
                "limits.max_table_depth",
            ),
            ("[dead_letter]\ncompat = \"5\"\n", "dead_letter.compat"),
            ("[log]\nformat = \"xml\"\n", "log.format"),
            ("[log]\nfilter = \"info,[[\"\n", "log.filter"),
            ("vhosts = []\n", "vhosts"),
            ("vhosts = [\"/\", \"/\"]\n", "vhosts[1]"),
            ("[listen]\namqp = \"\"\n", "listen.amqp"),
            ("[listen]\nadmin = \"localhost\"\n", "listen.admin"),
            ("[listen]\namqps = \"127.0.0.1:5671\"\n", "tls.cert_file"),
            ("[tls]\nrequire_client_cert = true\n", "tls.client_ca_file"),
            (
                "[proxy]\nconfirm_timeout_secs = 0\n",
                "proxy.confirm_timeout_secs",
            ),
            ("[proxy]\nretry_initial_ms = 0\n", "proxy.retry_initial_ms"),
            (
                "[proxy]\nretry_initial_ms = 500\nretry_max_ms = 100\n",
                "proxy.retry_max_ms",
            ),
            ("[proxy]\nretry_max_ms = 600001\n", "proxy.retry_max_ms"),
            (
                "[limits]\nmemory_high_watermark = 1.5\n",
                "limits.memory_high_watermark",
            ),
            (
                "[limits]\nmemory_high_watermark = \"12 parsecs\"\n",
                "limits.memory_high_watermark",
            ),
            (
                "[limits]\nmemory_high_watermark = 0\n",
                "limits.memory_high_watermark",
            ),
            (
                "[limits]\nmemory_check_interval_ms = 0\n",
                "limits.memory_check_interval_ms",
            ),
            (
                "[limits]\nconsumer_timeout = 315360000001\n",
                "limits.consumer_timeout",
            ),
            (
                "[limits]\nconsumer_timeout = -1\n",
                "limits.consumer_timeout",
            ),
            (
                "[dead_letter]\nttl_on_dead_letters = \"no\"\n",
                "dead_letter.ttl_on_dead_letters",
            ),
        ];
        for (text, key) in cases {
            let error = load_text(text).unwrap_err();
            assert_eq!(error.key(), key, "{text}: {error}");
        }
    }

    #[test]
    fn memory_watermark_takes_sizes_and_fractions() {
        for (value, expected) in [
            ("0.6", "0.6"),
            ("536870912", "536870912"),
            ("\"512MiB\"", "512MiB"),
        ] {
            let text = format!("[limits]\nmemory_high_watermark = {value}\n");
            let config = load_text(&text).unwrap();
            assert_eq!(config.limits.memory_high_watermark, expected);
        }
        assert_eq!(Config::default().limits.memory_high_watermark, "0.4");
        let error = error_text("[limits]\nmemory_high_watermark = 1.5\n");
        assert!(
            error.contains("key `limits.memory_high_watermark`")
                && error.contains("strictly between 0 and 1"),
            "{error}"
        );
    }

    #[test]
    fn empty_listeners_disable_them() {
        let config = load_text("[listen]\nadmin = \"\"\namqps = \"\"\n").unwrap();
        assert_eq!(config.listen.admin, "");
    }

    #[test]
    fn upstream_url_is_checked_only_in_proxy_mode() {
        load_text("[upstream]\nurl = \"http://x\"\n").unwrap();
        let error =
            load_text("mode = \"proxy\"\n[upstream]\nurl = \"http://u:secret@x\"\n").unwrap_err();
        assert_eq!(error.key(), "upstream.url");
        assert!(!error.to_string().contains("secret"), "{error}");
        let error =
            load_text("mode = \"proxy\"\n[upstream]\nurl = \"amqps://rabbit\"\n").unwrap_err();
        assert_eq!(error.key(), "upstream.tls_ca_file");
        load_text(
            "mode = \"proxy\"\n[upstream]\nurl = \"amqps://rabbit\"\ntls_verify = false\n\
             user = \"svc\"\npassword = \"pw\"\n",
        )
        .unwrap();
        let error = load_text("mode = \"cluster\"\n").unwrap_err();
        assert_eq!(error.key(), "mode");
        assert!(
            error
                .to_string()
                .ends_with("unknown value \"cluster\"; expected one of: embedded, proxy"),
            "{error}"
        );
    }

    #[test]
    fn users_and_policies_must_name_known_vhosts() {
        let error = load_text(
            "[[users]]\nname = \"app\"\npassword = \"x\"\n[[users.permissions]]\nvhost = \"orders\"\n",
        )
        .unwrap_err();
        assert_eq!(error.key(), "users[0].permissions[0].vhost");
        let error = load_text("[[policies]]\nname = \"p\"\nvhost = \"orders\"\npattern = \".*\"\n")
            .unwrap_err();
        assert_eq!(error.key(), "policies[0].vhost");
        let error = load_text("[[policies]]\nname = \"p\"\npattern = \"(\"\n").unwrap_err();
        assert_eq!(error.key(), "policies[0].pattern");
        let error = load_text(
            "[[policies]]\nname = \"p\"\npattern = \"a\"\ndefinition = { max-length = 1 }\n\
             [[policies]]\nname = \"p\"\npattern = \"b\"\ndefinition = { max-length = 1 }\n",
        )
        .unwrap_err();
        assert_eq!(error.key(), "policies[1].name");
        let error = load_text("[[users]]\nname = \"app\"\npassword = \"\"\n").unwrap_err();
        assert_eq!(error.key(), "users[0].password");
        let error = load_text("[[users]]\nname = \"app\"\npassword_hash = \"abc=\"\n").unwrap_err();
        assert_eq!(error.key(), "users[0].password_hash");
    }

    #[test]
    fn proxy_mode_needs_a_service_identity() {
        let base = "mode = \"proxy\"\n[upstream]\nurl = \"amqp://rabbit\"\n";
        let error = load_text(base).unwrap_err();
        assert_eq!(error.key(), "upstream.user");
        assert!(
            error.to_string().contains("delegate_to_upstream"),
            "{error}"
        );
        // Left to the upstream, the proxy owns no objects and needs no user.
        load_text(&format!("{base}[proxy]\ndelegate_to_upstream = true\n")).unwrap();
        let error = load_text(&format!("{base}user = \"svc\"\n")).unwrap_err();
        assert_eq!(error.key(), "upstream.password");
        let error = load_text(&format!("{base}password = \"pw\"\n")).unwrap_err();
        assert_eq!(error.key(), "upstream.user");
        let dir = std::env::temp_dir().join(format!("dlx-svc-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "file-secret\n").unwrap();
        let with_file = format!("{base}user = \"svc\"\npassword_file = {file:?}\n");
        let config = load_text(&with_file).unwrap();
        let identity = config.upstream.service_identity().unwrap().unwrap();
        assert_eq!(identity.user, "svc");
        assert_eq!(identity.password.expose(), "file-secret");
        // Never shown: Debug, the printed configuration.
        assert!(!format!("{config:?}").contains("file-secret"));
        let error = load_text(&format!("{with_file}password = \"pw2\"\n")).unwrap_err();
        assert_eq!(error.key(), "upstream.password_file");
        let printed = load_text(&format!(
            "{base}user = \"svc\"\npassword = \"plain-secret\"\n"
        ))
        .unwrap()
        .to_toml()
        .unwrap();
        assert!(!printed.contains("plain-secret"), "{printed}");
        std::fs::write(&file, "\n").unwrap();
        let error = load_text(&with_file).unwrap_err();
        assert_eq!(error.key(), "upstream.password_file");
        let missing = format!("{base}user = \"svc\"\npassword_file = \"/nonexistent/pw\"\n");
        assert_eq!(
            load_text(&missing).unwrap_err().key(),
            "upstream.password_file"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let error = load_text(&format!(
            "{base}user = \"svc\"\npassword = \"pw\"\n[proxy]\nvhosts = [\"/\", \"\"]\n"
        ))
        .unwrap_err();
        assert_eq!(error.key(), "proxy.vhosts[1]");
    }

    #[test]
    fn upstream_urls_are_a_list_each_checked_under_its_own_key() {
        let config = load_text(
            "mode = \"proxy\"\n[upstream]\nuser = \"svc\"\npassword = \"pw\"\n\
             urls = [\"amqp://a:5672\", \"amqp://u:pw@b:5673/%2f\"]\n",
        )
        .unwrap();
        let targets: Vec<(String, &str)> = config.upstream.targets();
        assert_eq!(
            targets,
            [
                ("upstream.urls[0]".to_string(), "amqp://a:5672"),
                ("upstream.urls[1]".to_string(), "amqp://u:pw@b:5673/%2f"),
            ]
        );
        assert_eq!(
            config.upstream.urls_for_display(),
            "amqp://a:5672, amqp://u:<redacted>@b:5673/%2f"
        );
        // `url` alone is a list of one.
        let config = load_text(
            "mode = \"proxy\"\n[upstream]\nurl = \"amqp://a\"\nuser = \"svc\"\npassword = \"pw\"\n",
        )
        .unwrap();
        assert_eq!(
            config.upstream.targets(),
            [("upstream.url".to_string(), "amqp://a")]
        );
        for (upstream, key, words) in [
            (
                "url = \"amqp://a\"\nurls = [\"amqp://b\"]",
                "upstream.urls",
                "upstream.url and upstream.urls are both set",
            ),
            ("urls = []", "upstream.urls", "required in proxy mode"),
            (
                "urls = [\"amqp://a\", \"http://u:secret@b\"]",
                "upstream.urls[1]",
                "is not an amqp:// or amqps:// URL",
            ),
            (
                "urls = [\"amqp://a\", \"amqp://u:secret@b:1:2\"]",
                "upstream.urls[1]",
                "invalid URL",
            ),
            (
                "urls = [\"amqp://a:5672\", \"amqp://u:secret@a\"]",
                "upstream.urls[1]",
                "names a node listed before",
            ),
            (
                "urls = [\"amqp://a\", \"amqps://b\"]",
                "upstream.tls_ca_file",
                "needs a CA file",
            ),
        ] {
            let text = format!("mode = \"proxy\"\n[upstream]\n{upstream}\n");
            let error = load_text(&text).unwrap_err();
            assert_eq!(error.key(), key, "{text}: {error}");
            let shown = error.to_string();
            assert!(shown.contains(words), "{text}: {shown}");
            assert!(!shown.contains("secret"), "{shown}");
        }
        // Passwords are masked in Debug and in the printed settings.
        let mut config = Config::default();
        config.upstream.urls = vec!["amqp://u:list-secret@a".into(), "amqp://b".into()];
        let debug = format!("{config:?}");
        assert!(!debug.contains("list-secret"), "{debug}");
        assert!(debug.contains("amqp://u:<redacted>@a"), "{debug}");
        let printed = config.to_toml().unwrap();
        assert!(!printed.contains("list-secret"), "{printed}");
        assert!(printed.contains("amqp://u:<redacted>@a"), "{printed}");
    }

    #[test]
    fn the_management_url_needs_http_and_the_service_identity() {
        // Delegating: the service user is required only by the management URL here.
        let base = "mode = \"proxy\"\n[proxy]\ndelegate_to_upstream = true\n[upstream]\nurl = \"amqp://a\"\n";
        let config = load_text(&format!(
            "{base}management_url = \"http://a:15672\"\nuser = \"dlx\"\npassword = \"pw-secret\"\n"
        ))
        .unwrap();
        assert_eq!(config.upstream.management_sync_interval_secs, 30);
        let (user, password) = service_credentials(&config);
        assert_eq!(
            (user.as_str(), password.expose().as_str()),
            ("dlx", "pw-secret")
        );
        let shown = format!("{config:?}\n{}", config.to_toml().unwrap());
        assert!(!shown.contains("pw-secret"), "{shown}");
        for (extra, key, words) in [
            (
                "management_url = \"https://a:15671\"\nuser = \"dlx\"\npassword = \"pw\"",
                "upstream.management_url",
                "https:// is not supported",
            ),
            (
                "management_url = \"http://dlx:secret@a:15672\"\nuser = \"dlx\"\npassword = \"pw\"",
                "upstream.management_url",
                "credentials do not go in the URL",
            ),
            (
                "management_url = \"http://a:15672\"",
                "upstream.user",
                "required with upstream.management_url",
            ),
            (
                "management_url = \"http://a:15672\"\nuser = \"dlx\"\npassword = \"pw\"\n\
                 management_sync_interval_secs = 0",
                "upstream.management_sync_interval_secs",
                "at least 1",
            ),
        ] {
            let text = format!("{base}{extra}\n");
            let error = load_text(&text).unwrap_err();
            assert_eq!(error.key(), key, "{text}: {error}");
            let shown = error.to_string();
            assert!(shown.contains(words), "{text}: {shown}");
            assert!(!shown.contains("secret"), "{shown}");
        }
        // Without a management URL nothing else is required.
        load_text(base).unwrap();
    }

    #[test]
    fn proxy_mode_needs_an_upstream_url() {
        let error = load_text("mode = \"proxy\"\n").unwrap_err();
        assert_eq!(error.key(), "upstream.urls");
        assert!(
            error.to_string().contains("required in proxy mode"),
            "{error}"
        );
        // Embedded mode does not use it.
        assert_eq!(load_text("").unwrap().upstream.url, "");
    }

    /// Policy definitions are checked by `validate` with the rules the service applies, so
    /// `check-config` refuses what `run` refuses, naming the key.
    #[test]
    fn policy_definitions_are_validated_with_the_key_named() {
        let policy = |definition: &str| {
            format!(
                "[[policies]]\nname = \"p\"\npattern = \".*\"\ndefinition = {{ {definition} }}\n"
            )
        };
        for (definition, key, message) in [
            (
                "message-ttl = -5",
                "policies[0].definition.message-ttl",
                "expected a non-negative integer",
            ),
            (
                "overflow = \"explode\"",
                "policies[0].definition.overflow",
                "expected 'drop-head'",
            ),
            (
                "message-tll = 5",
                "policies[0].definition.message-tll",
                "unknown policy key",
            ),
            (
                "max-length = 1e3",
                "policies[0].definition.max-length",
                "expected a non-negative integer",
            ),
        ] {
            let error = load_text(&policy(definition)).unwrap_err();
            assert_eq!(error.key(), key, "{definition}: {error}");
            assert!(error.to_string().contains(message), "{definition}: {error}");
            assert!(
                error.to_string().contains("policy \"p\""),
                "{definition}: {error}"
            );
        }
        let error = load_text("[[policies]]\nname = \"p\"\npattern = \".*\"\n").unwrap_err();
        assert_eq!(error.key(), "policies[0].definition.*");
        let config = load_text(&policy(
            "message-ttl = 5, max-length = 1000, overflow = \"reject-publish\"",
        ))
        .unwrap();
        crate::policy::PolicySet::from_configs(&config.policies).unwrap();
    }

    #[test]
    fn a_user_has_a_password_or_a_hash_not_both() {
        use base64::Engine as _;
        let hash = base64::engine::general_purpose::STANDARD.encode([7u8; 36]);
        let error = load_text(&format!(
            "[[users]]\nname = \"app\"\npassword = \"x\"\npassword_hash = \"{hash}\"\n"
        ))
        .unwrap_err();
        assert_eq!(error.key(), "users[0].password_hash");
    }

    #[test]
    fn the_admin_token_comes_from_the_setting_or_a_file() {
        let config = load_text("[admin]\ntoken = \"abc\"\n").unwrap();
        assert_eq!(
            config.admin.resolve_token().unwrap().unwrap().expose(),
            "abc"
        );
        assert_eq!(Config::default().admin.resolve_token().unwrap(), None);

        // A mounted Secret: one trailing newline is not part of the token.
        for (contents, token) in [
            ("s3cr3t\n", "s3cr3t"),
            ("s3cr3t\r\n", "s3cr3t"),
            ("s3cr3t", "s3cr3t"),
        ] {
            let file = temp_file(contents);
            let config = load_text(&format!(
                "[admin]\ntoken_file = {:?}\n",
                file.display().to_string()
            ))
            .unwrap();
            assert_eq!(
                config.admin.resolve_token().unwrap().unwrap().expose(),
                token
            );
            std::fs::remove_file(&file).unwrap();
        }

        let file = temp_file("abc\n");
        let both = format!(
            "[admin]\ntoken = \"abc\"\ntoken_file = {:?}\n",
            file.display().to_string()
        );
        let error = load_text(&both).unwrap_err();
        assert_eq!(error.key(), "admin.token");
        assert!(error.to_string().contains("admin.token_file"), "{error}");
        std::fs::remove_file(&file).unwrap();

        let error = load_text("[admin]\ntoken_file = \"/nonexistent/token\"\n").unwrap_err();
        assert_eq!(error.key(), "admin.token_file");
        assert!(error.to_string().contains("/nonexistent/token"), "{error}");
        for contents in ["", "\n", "two words\n"] {
            let file = temp_file(contents);
            let error = load_text(&format!(
                "[admin]\ntoken_file = {:?}\n",
                file.display().to_string()
            ))
            .unwrap_err();
            assert_eq!(error.key(), "admin.token_file", "{contents:?}");
            std::fs::remove_file(&file).unwrap();
        }
        let error = load_text("[admin]\ntoken = \"a b\"\n").unwrap_err();
        assert_eq!(error.key(), "admin.token");
        assert!(!error.to_string().contains("a b"), "{error}");
    }

    #[test]
    fn a_user_password_can_come_from_a_file() {
        let user = |file: &std::path::Path| {
            format!(
                "[[users]]\nname = \"app\"\npassword = \"\"\npassword_file = {:?}\n",
                file.display().to_string()
            )
        };
        // A mounted Secret: one trailing newline is not part of the password; inner spaces are.
        for (contents, password) in [
            ("pa ss\n", "pa ss"),
            ("pa ss\r\n", "pa ss"),
            ("pa ss", "pa ss"),
            ("pa ss\n\n", "pa ss\n"),
        ] {
            let file = temp_file(contents);
            let config = load_text(&user(&file)).unwrap();
            assert_eq!(
                config.users[0].credential(0).unwrap(),
                Credential::Plain(Secret::from(password)),
                "{contents:?}"
            );
            // The file is read again each time: a rotated Secret is seen on reload.
            std::fs::write(&file, "rotated\n").unwrap();
            assert_eq!(
                config.users[0].credential(0).unwrap(),
                Credential::Plain(Secret::from("rotated"))
            );
            // Never shown: neither in Debug nor in the printed settings.
            let shown = format!("{config:?} {}", config.to_toml().unwrap());
            assert!(
                !shown.contains("rotated") && !shown.contains("pa ss"),
                "{shown}"
            );
            std::fs::remove_file(&file).unwrap();
        }

        for contents in ["", "\n"] {
            let file = temp_file(contents);
            let error = load_text(&user(&file)).unwrap_err();
            assert_eq!(error.key(), "users[0].password_file", "{contents:?}");
            assert!(error.to_string().contains("empty password"), "{error}");
            std::fs::remove_file(&file).unwrap();
        }
        let error = load_text(
            "[[users]]\nname = \"app\"\npassword = \"\"\npassword_file = \"/nonexistent/pw\"\n",
        )
        .unwrap_err();
        assert_eq!(error.key(), "users[0].password_file");
        assert!(error.to_string().contains("/nonexistent/pw"), "{error}");
    }

    #[test]
    fn a_password_file_excludes_password_and_password_hash() {
        let file = temp_file("secret\n");
        let path = file.display().to_string();
        let hash = crate::broker::auth::hash_password([1, 2, 3, 4], "x");
        // password defaults to "guest", so leaving it out next to a file is "both".
        for (extra, listed) in [
            (String::new(), "password and password_file"),
            (
                "password = \"x\"\n".to_string(),
                "password and password_file",
            ),
            (
                format!("password = \"\"\npassword_hash = \"{hash}\"\n"),
                "password_hash and password_file",
            ),
        ] {
            let error = load_text(&format!(
                "[[users]]\nname = \"app\"\n{extra}password_file = {path:?}\n"
            ))
            .unwrap_err();
            assert_eq!(error.key(), "users[0].password_file", "{extra}");
            assert!(error.to_string().contains(listed), "{error}");
            assert!(!error.to_string().contains("secret\n"), "{error}");
        }
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn debug_output_holds_no_secret() {
        let mut config = Config::default();
        config.upstream.url = "amqp://user:url-secret@rabbit:5672/".into();
        config.users[0].password = "user-secret".into();
        config.users.push(UserConfig {
            name: "hashed".into(),
            password: Secret::default(),
            password_hash: "hash-secret".into(),
            ..UserConfig::default()
        });
        config.admin.token = "token-secret".into();
        let debug = format!("{config:?} {config:#?}");
        for secret in ["url-secret", "user-secret", "hash-secret", "token-secret"] {
            assert!(!debug.contains(secret), "{secret} in {debug}");
        }
        assert!(
            debug.contains("amqp://user:<redacted>@rabbit:5672/"),
            "{debug}"
        );
        let printed = config.to_toml().unwrap();
        for secret in ["url-secret", "user-secret", "hash-secret", "token-secret"] {
            assert!(!printed.contains(secret), "{secret} in {printed}");
        }
    }

    #[test]
    fn password_hash_of_the_right_length_is_accepted() {
        // 36 bytes: 4 salt + 32 digest.
        use base64::Engine as _;
        let hash = base64::engine::general_purpose::STANDARD.encode([7u8; 36]);
        load_text(&format!(
            "[[users]]\nname = \"app\"\npassword = \"\"\npassword_hash = \"{hash}\"\n"
        ))
        .unwrap();
    }

    #[test]
    fn printed_settings_redact_secrets_and_reload() {
        let mut config = Config::default();
        config.upstream.url = "amqp://user:secret@rabbit:5672/%2f?heartbeat=5".into();
        config.policies.push(PolicyConfig {
            name: "p".into(),
            pattern: ".*".into(),
            definition: [("message-ttl".to_string(), serde_json::json!(100))].into(),
            ..PolicyConfig::default()
        });
        let text = config.to_toml().unwrap();
        assert!(!text.contains("secret"), "{text}");
        assert!(!text.contains("password = \"guest\""), "{text}");
        assert!(
            text.contains("amqp://user:<redacted>@rabbit:5672/%2f?heartbeat=5"),
            "{text}"
        );
        let reloaded = load_text(&text).unwrap();
        assert_eq!(reloaded.policies[0].definition["message-ttl"], 100);
    }

    #[test]
    fn url_redaction_leaves_urls_without_password_alone() {
        assert_eq!(
            redact_url_password("amqp://rabbit:5672/"),
            "amqp://rabbit:5672/"
        );
        assert_eq!(
            redact_url_password("amqp://user@rabbit/"),
            "amqp://user@rabbit/"
        );
        assert_eq!(redact_url_password("not a url"), "not a url");
    }

    #[test]
    fn key_at_line_handles_tables_and_arrays() {
        let text = "a = 1\n[x]\nb = 2\n[[y]]\n\"c\" = 3\n[z\n";
        assert_eq!(key_at_line(text, 1), "a");
        assert_eq!(key_at_line(text, 3), "x.b");
        assert_eq!(key_at_line(text, 5), "y.c");
        assert_eq!(key_at_line(text, 4), "y");
        assert_eq!(line_and_column("ab\ncdé f", 9), (2, 6));
    }

    #[test]
    fn only_known_top_level_keys_are_taken_from_the_environment() {
        let keys = top_level_keys();
        assert!(keys.contains(&"listen".to_string()));
        assert!(keys.contains(&"dead_letter".to_string()));
        assert!(!keys.contains(&"service_host".to_string()));
    }
}
