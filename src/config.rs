//! Service configuration: the data shape of `config.toml`.
//!
//! Values are layered with figment: built-in defaults < the TOML file < `DLX_PROXY_*`
//! environment variables (`__` separates nested keys). Everything downstream (listeners, the
//! broker, the proxy, the policy set) is built from one validated [`Config`].

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Which engine serves client connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The process is the broker.
    #[default]
    Embedded,
    /// Each client connection is forwarded to `upstream.url`.
    Proxy,
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
    pub proxy: ProxyConfig,
    pub tls: TlsConfig,
    pub log: LogConfig,
    pub metrics: MetricsConfig,
    pub shutdown: ShutdownConfig,
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
            proxy: ProxyConfig::default(),
            tls: TlsConfig::default(),
            log: LogConfig::default(),
            metrics: MetricsConfig::default(),
            shutdown: ShutdownConfig::default(),
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
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    pub url: String,
    /// Seconds to wait for the upstream TCP/TLS connection.
    pub connect_timeout_secs: u64,
    /// PEM file with CA certificates for amqps upstreams (empty: the system's roots are not used;
    /// give a CA file for TLS upstreams).
    pub tls_ca_file: String,
    /// Server name to verify (defaults to the URL host).
    pub tls_server_name: String,
    /// Verify the upstream certificate (on by default).
    pub tls_verify: bool,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: "amqp://127.0.0.1:5673".into(),
            connect_timeout_secs: 5,
            tls_ca_file: String::new(),
            tls_server_name: String::new(),
            tls_verify: true,
        }
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
        }
    }
}

/// Dead-letter behaviour switches.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// "3" (RabbitMQ 3.10-3.12 semantics, default) or "4" (3.13+/4.x: CC kept, x-last-death-*,
    /// client x-death ignored).
    pub compat: String,
    /// Add an `x-death-total` header counting every death of the message.
    pub x_death_total: bool,
    /// Drop a message (counted, cause `hop_limit`) once it has died this many times; 0 = off.
    pub max_hops: u32,
    /// Default delivery limit for every queue without one (0 = off).
    pub default_delivery_limit: u32,
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        DeadLetterConfig {
            compat: "3".into(),
            x_death_total: false,
            max_hops: 0,
            default_delivery_limit: 0,
        }
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
    /// Let the upstream broker dead-letter on its own (do not take the DLX arguments over).
    pub delegate_to_upstream: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_inflight_bytes: 64 * 1024 * 1024,
            confirm_timeout_secs: 30,
            delegate_to_upstream: false,
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

/// A user of the embedded broker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UserConfig {
    pub name: String,
    /// Plain-text password (use `password_hash` in production).
    pub password: String,
    /// RabbitMQ `rabbit_password_hashing_sha256` hash: base64(salt[4] ++ sha256(salt ++ password)).
    pub password_hash: String,
    /// Only allow this user from loopback addresses (RabbitMQ's rule for guest).
    pub loopback_only: bool,
    pub permissions: Vec<PermissionConfig>,
}

impl Default for UserConfig {
    fn default() -> Self {
        UserConfig {
            name: "guest".into(),
            password: "guest".into(),
            password_hash: String::new(),
            loopback_only: true,
            permissions: vec![PermissionConfig::default()],
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

/// A policy as written in TOML (validated into a `policy::Policy`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub name: String,
    pub vhost: String,
    /// Regex on the queue (or exchange) name, unanchored like RabbitMQ's.
    pub pattern: String,
    /// "queues", "exchanges" or "all".
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
            apply_to: "queues".into(),
            priority: 0,
            definition: BTreeMap::new(),
        }
    }
}
