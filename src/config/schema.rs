//! The data shape of `config.toml`: one struct per table, with serde defaults, so that the
//! built-in defaults, the file and the environment all deserialize into the same [`Config`].
//!
//! Loading lives in `load.rs`, the checks in `validate.rs`; this file only says what the
//! settings are, what they default to, and how secrets are kept out of `Debug` and printed
//! settings ([`Config::redacted`], [`redact_url_password`]).

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

use super::ConfigError;
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
    /// proxy mirrors its policies as upstream policies named `<capture_name>.<name>`, so queues
    /// that were never declared through the proxy get their limits and dead-letter through
    /// the capture path ([`crate::proxy::policy_sync`]). Empty: no upstream policies.
    pub management_url: String,
    /// Seconds between two reconciliations of the upstream policies (they also run at start,
    /// on every reload and on every policy change through the admin API).
    pub management_sync_interval_secs: u64,
    /// Seconds an upstream policy of the proxy's must be missing from this instance's
    /// policies, round after round, before the instance deletes it: instances of one
    /// deployment with different policies for a while (a rolling update, a reload reaching
    /// them one by one) do not delete each other's policies every round. 0: at once.
    pub management_delete_grace_secs: u64,
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
            management_delete_grace_secs: 600,
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
            .field(
                "management_delete_grace_secs",
                &self.management_delete_grace_secs,
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
    /// Largest number of exchanges per vhost, besides the default exchange and the amq.*
    /// ones every vhost has (embedded mode).
    pub max_exchanges: usize,
    /// Largest number of bindings per vhost (embedded mode).
    pub max_bindings: usize,
    /// Largest number of consumers on one channel (both modes); a basic.consume past it closes
    /// the connection with 530 NOT_ALLOWED, as RabbitMQ's `consumer_max_per_channel` does.
    /// At least 8 (AMQP 0-9-1: a server that limits consumers per channel allows 8 or more).
    pub max_consumers_per_channel: usize,
    /// Bytes of encoded frames waiting for one connection's socket before deliveries pause;
    /// in embedded mode, at twice this the connection also stops reading the client's frames.
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
            max_exchanges: 10_000,
            max_bindings: 100_000,
            max_consumers_per_channel: DEFAULT_MAX_CONSUMERS_PER_CHANNEL,
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
    /// alarm): bytes (50000000, "50MB", "1GiB") or a multiple of the memory available to the
    /// process ("1.5x", RabbitMQ's `disk_free_limit.relative`); 0 = no disk alarm. Changes on
    /// reload.
    #[serde(deserialize_with = "string_or_number")]
    pub disk_free_limit: String,
    /// Content bytes of queued persistent messages (in durable queues) held in memory; past
    /// it, queues keep the newest ones on disk only and read them back when needed (paging):
    /// bytes or a size with a unit ("64MiB"); 0 = page out every message once written.
    /// Changes on reload.
    #[serde(deserialize_with = "string_or_number")]
    pub paging_budget: String,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            dir: DEFAULT_STORAGE_DIR.into(),
            fsync: "always".into(),
            segment_size: 64 << 20,
            disk_free_limit: "50MB".into(),
            paging_budget: "16MiB".into(),
        }
    }
}

/// `storage.dir` by default: `data` under the working directory.
pub const DEFAULT_STORAGE_DIR: &str = "data";

/// Smallest `storage.segment_size`.
const MIN_SEGMENT_SIZE: u64 = 4096;
/// Largest `storage.segment_size`: record offsets in a segment are kept as 32 bits.
const MAX_SEGMENT_SIZE: u64 = 1 << 30;

impl StorageConfig {
    /// The storage settings, or None when storage is off (`dir` empty).
    pub fn options(&self) -> Option<crate::storage::StorageOptions> {
        (!self.dir.is_empty()).then(|| crate::storage::StorageOptions {
            dir: std::path::PathBuf::from(&self.dir),
            fsync: self.fsync != "never",
            segment_size: self.segment_size,
            paging_budget: self.paging_budget_bytes(),
        })
    }

    /// `paging_budget` in bytes (0 when invalid: validation refuses that first).
    pub fn paging_budget_bytes(&self) -> u64 {
        crate::memory::watermark::parse_size(&self.paging_budget).unwrap_or(0)
    }

    /// `disk_free_limit` in bytes (0 when invalid: validation refuses that first); a relative
    /// limit reads the memory limit now (cgroup, else total RAM).
    pub fn disk_free_limit_bytes(&self) -> u64 {
        use crate::storage::disk::Limit;
        match Limit::parse(&self.disk_free_limit) {
            Ok(limit @ Limit::Relative(_)) => limit.bytes(
                crate::memory::system::MemorySources::default()
                    .limit()
                    .map(|(bytes, _)| bytes),
            ),
            Ok(limit) => limit.bytes(None),
            Err(_) => 0,
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        crate::storage::disk::Limit::parse(&self.disk_free_limit)
            .map_err(|message| ConfigError::invalid("storage.disk_free_limit", message))?;
        crate::memory::watermark::parse_size(&self.paging_budget)
            .map_err(|message| ConfigError::invalid("storage.paging_budget", message))?;
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
        if self.segment_size > MAX_SEGMENT_SIZE {
            return Err(ConfigError::invalid(
                "storage.segment_size",
                format!("must be at most {MAX_SEGMENT_SIZE} bytes (1 GiB)"),
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
    /// deaths, and the prefix of its upstream policies (give each proxy deployment sharing
    /// one upstream its own, also with delegation).
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
    /// Seconds what this instance verified about a queue is trusted before a client's next
    /// basic.consume or basic.get on it reads it back from the upstream again (another
    /// instance may have deleted and declared it anew with other arguments); 0: until the
    /// queue is deleted through this instance.
    pub verified_queue_max_age_secs: u64,
    /// Capture deliveries each service connection holds unacked (basic.qos prefetch of the
    /// capture consumer): the window of dead-letter publishes in flight, and what bounds the
    /// captured messages in the proxy's memory.
    pub capture_prefetch: u16,
}

/// Largest accepted `proxy.retry_max_ms` (10 minutes).
pub const MAX_RETRY_MS: u64 = 600_000;

/// Default `limits.max_consumers_per_channel`.
pub const DEFAULT_MAX_CONSUMERS_PER_CHANNEL: usize = 1_000;

/// Smallest accepted `limits.max_consumers_per_channel` (AMQP 0-9-1, basic.consume: a limit
/// "MUST be at least 8").
pub const MIN_CONSUMERS_PER_CHANNEL: usize = 8;

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
            capture_prefetch: crate::proxy::capture::CAPTURE_PREFETCH,
            loopback_users: vec!["guest".into()],
            vhosts: vec!["/".into()],
            max_service_vhosts: 64,
            capture_ready_timeout_secs: 10,
            verified_queue_max_age_secs: 60,
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
    /// RabbitMQ `rabbit_password_hashing_sha256` hash: base64(salt\[4\] ++ sha256(salt ++ password)).
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

impl Config {
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
