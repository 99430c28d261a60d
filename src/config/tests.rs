//! Unit tests of loading, validation and error locations.

use super::load::top_level_keys;
use super::*;
use crate::secret::Secret;
use std::path::{Path, PathBuf};
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
    let text = error_text("[storage]\ndisk_free_limit = 1.5\n");
    assert!(
        text.contains("key `storage.disk_free_limit`: \"1.5\" is not a size; write a multiple of memory with an x (\"1.5x\")"),
        "{text}"
    );
    let text = error_text("[storage]\ndisk_free_limit = \"0x\"\n");
    assert!(
        text.contains(
            "key `storage.disk_free_limit`: \"0x\": the multiple of memory must be more than 0"
        ),
        "{text}"
    );
    let config = load_text("[storage]\ndisk_free_limit = \"1.5x\"\n").unwrap();
    let memory = crate::memory::system::MemorySources::default()
        .limit()
        .map(|(bytes, _)| bytes)
        .expect("memory limit");
    assert_eq!(
        config.storage.disk_free_limit_bytes(),
        (memory as f64 * 1.5) as u64
    );
    let config = load_text("[storage]\ndisk_free_limit = 1048576\n").unwrap();
    assert_eq!(config.storage.disk_free_limit_bytes(), 1 << 20);
    let config = load_text("[storage]\ndisk_free_limit = \"2GiB\"\n").unwrap();
    assert_eq!(config.storage.disk_free_limit_bytes(), 2 << 30);
    assert_eq!(
        Config::default().storage.disk_free_limit_bytes(),
        50_000_000
    );
    let text = error_text("[storage]\npaging_budget = \"half\"\n");
    assert!(
        text.contains("key `storage.paging_budget`: \"half\" does not start with a number"),
        "{text}"
    );
    let config = load_text("[storage]\npaging_budget = 0\n").unwrap();
    assert_eq!(config.storage.paging_budget_bytes(), 0);
    let config = load_text("[storage]\npaging_budget = \"256MiB\"\n").unwrap();
    assert_eq!(config.storage.paging_budget_bytes(), 256 << 20);
    assert_eq!(Config::default().storage.paging_budget_bytes(), 16 << 20);
    let text = error_text("[storage]\nsegment_size = 2147483648\n");
    assert!(
        text.contains("key `storage.segment_size`: must be at most 1073741824 bytes (1 GiB)"),
        "{text}"
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
        text.contains(".toml:2:8: key `listen.amqp`: invalid socket address \"nope\""),
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
    assert!(
        text.contains(".toml:2:28: key `proxy.loopback_users[1]`"),
        "{text}"
    );
    let text = error_text("[proxy]\nloopback_users = \"guest\"\n");
    assert!(
        text.contains(".toml:2:18: key `proxy.loopback_users`"),
        "{text}"
    );
}

#[test]
fn wrong_type_names_the_key() {
    let text = error_text("[limits]\nmax_queues = 3\nframe_max = \"x\"\n");
    assert!(
        text.contains(".toml:3:13: key `limits.frame_max`"),
        "{text}"
    );
    assert!(text.contains("invalid type"), "{text}");
}

#[test]
fn unknown_key_is_named() {
    let text = error_text("[listen]\n  amqp_port = 5672\n");
    assert!(
        text.contains(".toml:2:3: key `listen.amqp_port`: unknown key"),
        "{text}"
    );
    let text = error_text("mode = \"embedded\"\ncolour = \"blue\"\n");
    assert!(text.contains(".toml:2:1: key `colour`"), "{text}");
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
    let text = error_text("[[users]]\nname = \"a\"\npassword = \"b\"\nloopback_only = \"yes\"\n");
    assert!(
        text.contains(".toml:4:17: key `users[0].loopback_only`"),
        "{text}"
    );
}

#[test]
fn validation_errors_name_the_line_and_column_of_the_value() {
    let text = error_text(
        "[[users]]\nname = \"ops\"\npassword = \"x\"\n\
         [[users]]\nname = \"app\"\npassword = \"x\"\n\
         [[users.permissions]]\nvhost = \"orders\"\n",
    );
    assert!(
        text.contains(".toml:8:9: key `users[1].permissions[0].vhost`"),
        "{text}"
    );
    let text = error_text("[[policies]]\nname = \"p\"\npattern = \"(\"\n");
    assert!(
        text.contains(".toml:3:11: key `policies[0].pattern`"),
        "{text}"
    );
    // A policy definition key names the definition's own key when it is written there.
    let text = error_text(
        "[[policies]]\nname = \"p\"\npattern = \".*\"\n\
         definition = { max-length = \"many\" }\n",
    );
    assert!(text.contains(".toml:4:"), "{text}");
}

#[test]
fn limits_and_switches_are_checked() {
    let cases = [
        ("[limits]\nframe_max = 1024\n", "limits.frame_max"),
        (
            "[limits]\nmax_consumers_per_channel = 7\n",
            "limits.max_consumers_per_channel",
        ),
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
        ("[proxy]\ncapture_prefetch = 0\n", "proxy.capture_prefetch"),
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
    let error = load_text("mode = \"proxy\"\n[upstream]\nurl = \"amqps://rabbit\"\n").unwrap_err();
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
    let base =
        "mode = \"proxy\"\n[proxy]\ndelegate_to_upstream = true\n[upstream]\nurl = \"amqp://a\"\n";
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
        format!("[[policies]]\nname = \"p\"\npattern = \".*\"\ndefinition = {{ {definition} }}\n")
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
fn only_known_top_level_keys_are_taken_from_the_environment() {
    let keys = top_level_keys();
    assert!(keys.contains(&"listen".to_string()));
    assert!(keys.contains(&"dead_letter".to_string()));
    assert!(!keys.contains(&"service_host".to_string()));
}
