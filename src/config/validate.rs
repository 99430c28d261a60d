//! The checks `run`, `check-config` and a reload share: [`Config::validate`] looks at every
//! setting that can be checked without starting anything and returns the first problem, as a
//! [`ConfigError`] naming the key (`load.rs` then adds where the value came from).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::*;

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
        for (key, value, min) in [
            (
                "limits.frame_max",
                u64::from(limits.frame_max),
                u64::from(MIN_FRAME_MAX),
            ),
            (
                "limits.max_consumers_per_channel",
                limits.max_consumers_per_channel as u64,
                MIN_CONSUMERS_PER_CHANNEL as u64,
            ),
        ] {
            if value < min {
                return Err(ConfigError::invalid(
                    key,
                    format!("{value} is below the AMQP minimum of {min}"),
                ));
            }
        }
        for (key, value) in [
            ("limits.max_message_size", limits.max_message_size),
            ("limits.max_connections", limits.max_connections as u64),
            ("limits.max_queues", limits.max_queues as u64),
            ("limits.max_exchanges", limits.max_exchanges as u64),
            ("limits.max_bindings", limits.max_bindings as u64),
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
        if self.proxy.capture_prefetch == 0 {
            return Err(ConfigError::invalid(
                "proxy.capture_prefetch",
                "must be at least 1 (0 would be an unlimited prefetch)",
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
