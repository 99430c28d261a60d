//! The `dlx-proxy` binary's configuration commands: `check-config` on the repository's
//! config.toml, on invalid files and with environment overrides (and that it refuses exactly
//! what `run` refuses); and `policy` against a live admin server, with its token.

use dlx_proxy::admin::{self, AdminState, AdminToken, PolicyControl, Readiness};
use dlx_proxy::config::{Config, PolicyConfig};
use dlx_proxy::metrics::Metrics;
use dlx_proxy::secret::Secret;
use dlx_proxy::shutdown::ShutdownTrigger;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

fn repo_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml")
}

/// The binary with no inherited DLX_PROXY_* or RUST_LOG variables, run in a scratch directory.
fn dlx_proxy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BINARY);
    command.args(args).current_dir(std::env::temp_dir());
    for (name, _) in std::env::vars() {
        if name.starts_with("DLX_PROXY_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    command.output().unwrap()
}

fn temp_file(text: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("dlx-proxy-cli-{}-{n}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs check-config on `text` and returns (exit code, stdout, stderr).
fn check(text: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let path = temp_file(text);
    let output = dlx_proxy(&["check-config", path.to_str().unwrap()], env);
    std::fs::remove_file(&path).unwrap();
    (
        output.status.code().unwrap_or(-1),
        stdout(&output),
        stderr(&output),
    )
}

#[test]
fn repository_config_is_valid_and_printed() {
    let path = repo_config();
    let output = dlx_proxy(&["check-config", path.to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let printed = stdout(&output);
    for line in [
        "mode = \"embedded\"",
        "amqp = \"127.0.0.1:5672\"",
        "admin = \"127.0.0.1:15692\"",
        "vhosts = [\"/\"]",
        "name = \"guest\"",
        "loopback_only = true",
        "frame_max = 131072",
        "compat = \"3\"",
    ] {
        assert!(
            printed.lines().any(|l| l.trim() == line),
            "{line:?} not in:\n{printed}"
        );
    }
    assert!(
        !printed.contains("password = \"guest\""),
        "secrets are redacted:\n{printed}"
    );
    // The printed settings are themselves a valid configuration.
    let (code, reprinted, errors) = check(&printed, &[]);
    assert_eq!(code, 0, "{errors}");
    assert_eq!(
        reprinted.lines().skip(1).collect::<Vec<_>>(),
        printed.lines().skip(1).collect::<Vec<_>>()
    );
}

#[test]
fn invalid_values_exit_2_and_name_the_key() {
    let cases = [
        (
            "[listen]\namqp = \"nope\"\n",
            "key `listen.amqp`: invalid socket address",
        ),
        ("[limits]\nframe_max = \"x\"\n", "key `limits.frame_max`"),
        ("[limits]\nframe_max = 100\n", "key `limits.frame_max`"),
        (
            "[listen]\namqp_port = 1\n",
            "key `listen.amqp_port`: unknown key",
        ),
        ("colour = \"blue\"\n", "key `colour`"),
        (
            "[runtime]\nworker_threads = 5000\n",
            "key `runtime.worker_threads`: must be at most 1024",
        ),
        (
            "[proxy]\nbusy_poll_us = 20000\n",
            "key `proxy.busy_poll_us`: must be at most 10000",
        ),
        (
            "mode = \"proxy\"\n[upstream]\nurl = \"http://x\"\n",
            "key `upstream.url`",
        ),
        (
            "[[policies]]\nname = \"p\"\nvhost = \"nope\"\npattern = \".*\"\n",
            "key `policies[0].vhost`",
        ),
        (
            "mode = \"embedded\"\n[listen]\namqp = nope\n",
            ":3:8: key `listen.amqp`",
        ),
    ];
    for (text, expected) in cases {
        let (code, printed, errors) = check(text, &[]);
        assert_eq!(code, 2, "{text}: {printed}");
        assert!(
            errors.contains(expected),
            "{text}: expected {expected:?} in {errors:?}"
        );
        assert!(errors.contains(".toml"), "the file is named: {errors}");
        assert!(printed.is_empty());
    }
}

/// `run` with `text` as its configuration (listeners on free ports through the environment):
/// (exit code, stderr) if it exits
/// within 10 s, else it is killed and `None` (it started).
fn run_briefly(text: &str) -> Option<(i32, String)> {
    let path = temp_file(text);
    let mut command = Command::new(BINARY);
    command
        .args(["run", "--config", path.to_str().unwrap()])
        .current_dir(std::env::temp_dir())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (name, _) in std::env::vars() {
        if name.starts_with("DLX_PROXY_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    let admin_address = free_address();
    command
        .env("DLX_PROXY_LISTEN__AMQP", free_address())
        .env("DLX_PROXY_LISTEN__ADMIN", &admin_address);
    let mut child = command.spawn().unwrap();
    let ready = || {
        let timeout = std::time::Duration::from_millis(500);
        matches!(
            admin::request(&admin_address, "GET", "/readyz", None, timeout),
            Ok((200, _))
        )
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let result = loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut errors = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut errors).unwrap();
            break Some((status.code().unwrap_or(-1), errors));
        }
        if ready() || std::time::Instant::now() >= until {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::fs::remove_file(&path).unwrap();
    result
}

fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// The policy mistakes of issue #11 that `check-config` used to accept while `run` refused
/// them: both now exit 2 with the same message naming the key; a valid policy passes both.
#[test]
fn check_config_and_run_refuse_the_same_policies() {
    let policy = |definition: &str| {
        format!("[[policies]]\nname = \"p\"\npattern = \"^q$\"\ndefinition = {{ {definition} }}\n")
    };
    for (definition, expected) in [
        (
            "message-ttl = -5",
            "key `policies[0].definition.message-ttl`: policy \"p\": expected a non-negative integer",
        ),
        (
            "overflow = \"explode\"",
            "key `policies[0].definition.overflow`: policy \"p\": expected 'drop-head', 'reject-publish' or 'reject-publish-dlx'",
        ),
        (
            "message-tll = 60000",
            "key `policies[0].definition.message-tll`: policy \"p\": unknown policy key",
        ),
        (
            "max-length = 1e3",
            "key `policies[0].definition.max-length`: policy \"p\": expected a non-negative integer",
        ),
    ] {
        let text = policy(definition);
        let (code, printed, errors) = check(&text, &[]);
        assert_eq!(code, 2, "check-config accepted {definition}: {printed}");
        assert!(errors.contains(expected), "{definition}: {errors}");
        let (code, errors) =
            run_briefly(&text).unwrap_or_else(|| panic!("run accepted {definition}"));
        assert_eq!(code, 2, "{definition}: {errors}");
        assert!(errors.contains(expected), "{definition}: {errors}");
    }
    let valid = policy("message-ttl = 60000, max-length = 1000, overflow = \"reject-publish\"");
    let (code, printed, errors) = check(&valid, &[]);
    assert_eq!(code, 0, "{errors}");
    assert!(printed.contains("max-length = 1000"), "{printed}");
    assert_eq!(run_briefly(&valid), None, "run refused a valid policy");
}

/// TLS files that exist but do not hold what they should are refused by both commands (the
/// certificates are loaded as the service loads them, not only looked up).
#[test]
fn check_config_and_run_refuse_unusable_tls_files() {
    let junk = temp_file("not a PEM file\n");
    let text = format!(
        "[listen]\namqps = \"127.0.0.1:0\"\n[tls]\ncert_file = {path:?}\nkey_file = {path:?}\n",
        path = junk.display().to_string()
    );
    let expected = "key `tls.cert_file`: tls.cert_file:";
    let (code, printed, errors) = check(&text, &[]);
    assert_eq!(code, 2, "{printed}");
    assert!(errors.contains(expected), "{errors}");
    let (code, errors) = run_briefly(&text).expect("run started with a junk certificate");
    assert_eq!(code, 2);
    assert!(errors.contains(expected), "{errors}");
    std::fs::remove_file(&junk).unwrap();
}

/// Proxy mode has no default upstream: without `upstream.url` both commands refuse it.
#[test]
fn proxy_mode_requires_the_upstream_url() {
    let text = "mode = \"proxy\"\n";
    let expected = "key `upstream.url`: required in proxy mode";
    let (code, _, errors) = check(text, &[]);
    assert_eq!(code, 2);
    assert!(errors.contains(expected), "{errors}");
    let (code, errors) = run_briefly(text).expect("run started without upstream.url");
    assert_eq!(code, 2);
    assert!(errors.contains(expected), "{errors}");
}

#[test]
fn admin_token_and_token_file_are_exclusive() {
    let token_file = temp_file("from-file\n");
    let text = format!(
        "[admin]\ntoken = \"inline\"\ntoken_file = {:?}\n",
        token_file.display().to_string()
    );
    let (code, _, errors) = check(&text, &[]);
    std::fs::remove_file(&token_file).unwrap();
    assert_eq!(code, 2);
    assert!(
        errors.contains("key `admin.token`: admin.token and admin.token_file are both set"),
        "{errors}"
    );
    // The printed settings never show the token.
    let (code, printed, errors) = check("[admin]\ntoken = \"tok-4d2b9\"\n", &[]);
    assert_eq!(code, 0, "{errors}");
    assert!(!printed.contains("tok-4d2b9"), "{printed}");
    assert!(printed.contains("token = \"<redacted>\""), "{printed}");
    // A token of digits in the environment is read as the token, not refused with its value
    // quoted in the error.
    let (code, printed, errors) = check("", &[("DLX_PROXY_ADMIN__TOKEN", "918273645")]);
    assert_eq!(code, 0, "{errors}");
    assert!(!printed.contains("918273645"), "{printed}");
    assert!(printed.contains("token = \"<redacted>\""), "{printed}");
}

#[test]
fn a_missing_file_is_an_error() {
    let output = dlx_proxy(&["check-config", "/nonexistent/dlx-proxy.toml"], &[]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("/nonexistent/dlx-proxy.toml"));
}

#[test]
fn environment_overrides_show_in_the_printed_settings() {
    let (code, printed, errors) = check(
        "[listen]\namqp = \"127.0.0.1:5672\"\n",
        &[
            ("DLX_PROXY_LISTEN__AMQP", "0.0.0.0:5673"),
            ("DLX_PROXY_DEAD_LETTER__COMPAT", "4"),
            ("DLX_PROXY_LIMITS__FRAME_MAX", "8192"),
            // Kubernetes service-link variables share the prefix and are ignored.
            ("DLX_PROXY_SERVICE_HOST", "10.0.0.1"),
            ("DLX_PROXY_PORT", "tcp://10.0.0.1:5672"),
        ],
    );
    assert_eq!(code, 0, "{errors}");
    for line in [
        "amqp = \"0.0.0.0:5673\"",
        "compat = \"4\"",
        "frame_max = 8192",
    ] {
        assert!(
            printed.lines().any(|l| l.trim() == line),
            "{line:?} not in:\n{printed}"
        );
    }
}

#[test]
fn an_invalid_environment_value_names_the_variable() {
    let (code, _, errors) = check("", &[("DLX_PROXY_LIMITS__FRAME_MAX", "x")]);
    assert_eq!(code, 2);
    assert!(
        errors.contains("environment variable DLX_PROXY_LIMITS__FRAME_MAX: key `limits.frame_max`"),
        "{errors}"
    );
    let (code, _, errors) = check("", &[("DLX_PROXY_LISTEN__ADMIN", "localhost")]);
    assert_eq!(code, 2);
    assert!(
        errors.contains("DLX_PROXY_LISTEN__ADMIN: key `listen.admin`"),
        "{errors}"
    );
}

/// Every setting of the data shape is documented in config.toml, and the commented-out
/// defaults of the plain sections are the real defaults.
#[test]
fn config_toml_documents_every_setting_with_its_default() {
    let text = std::fs::read_to_string(repo_config()).unwrap();
    let defaults = toml::Table::try_from(Config::default()).unwrap();
    let documented = |section: &str, key: &str| {
        let mut in_section = section.is_empty();
        for line in text.lines() {
            let bare = line.trim_start_matches(['#', ' ']);
            if bare.starts_with('[') {
                let header = bare.trim_matches(['[', ']']);
                in_section = header == section;
            } else if in_section && bare.split('=').next().map(str::trim) == Some(key) {
                return Some(bare.to_string());
            }
        }
        None
    };
    let default_user = Config::default().users[0].clone();
    let user = toml::Table::try_from(&default_user).unwrap();
    for key in user.keys().filter(|k| *k != "permissions") {
        assert!(
            documented("users", key).is_some(),
            "users.{key} is not documented"
        );
    }
    let permission = toml::Table::try_from(&default_user.permissions[0]).unwrap();
    for key in permission.keys() {
        assert!(
            documented("users.permissions", key).is_some(),
            "permissions.{key} is not documented"
        );
    }
    let policy = toml::Table::try_from(PolicyConfig::default()).unwrap();
    for key in policy.keys() {
        assert!(
            documented("policies", key).is_some(),
            "policies.{key} is not documented"
        );
    }
    for (key, value) in &defaults {
        match value {
            toml::Value::Table(table) => {
                for (field, default) in table {
                    let line = documented(key, field)
                        .unwrap_or_else(|| panic!("{key}.{field} is not documented"));
                    if matches!(
                        key.as_str(),
                        "upstream"
                            | "limits"
                            | "dead_letter"
                            | "proxy"
                            | "log"
                            | "metrics"
                            | "shutdown"
                            | "admin"
                    ) {
                        let written: toml::Table = toml::from_str(&line).unwrap();
                        assert_eq!(&written[field], default, "{key}.{field}: {line}");
                    }
                }
            }
            // Arrays of tables are documented as [[key]] blocks (checked field by field above).
            _ if matches!(key.as_str(), "users" | "policies") => {
                assert!(
                    text.contains(&format!("[[{key}]]")),
                    "[[{key}]] is not documented"
                );
            }
            _ => assert!(documented("", key).is_some(), "{key} is not documented"),
        }
    }
}

/// An in-memory policy store for the admin server.
#[derive(Default)]
struct MemoryPolicies(Mutex<Vec<PolicyConfig>>);

impl PolicyControl for MemoryPolicies {
    fn set_policy(&self, cfg: PolicyConfig) -> Result<(), String> {
        let mut policies = self.0.lock().unwrap();
        policies.retain(|p| !(p.vhost == cfg.vhost && p.name == cfg.name));
        policies.push(cfg);
        Ok(())
    }

    fn clear_policy(&self, vhost: &str, name: &str) -> bool {
        let mut policies = self.0.lock().unwrap();
        let before = policies.len();
        policies.retain(|p| !(p.vhost == vhost && p.name == name));
        before != policies.len()
    }

    fn list_policies(&self) -> Vec<PolicyConfig> {
        self.0.lock().unwrap().clone()
    }
}

/// `dlx-proxy policy set|clear` as the conformance harness's hook calls it.
#[test]
fn policy_command_sets_and_clears_through_the_admin_api() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let policies = Arc::new(MemoryPolicies::default());
    let trigger = ShutdownTrigger::new();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let token_text = "cli-token-7f3e";
    let state = AdminState {
        metrics: Metrics::new(10),
        readiness: Readiness::new(),
        policies: policies.clone(),
        token: AdminToken::new(Some(Secret::from(token_text))),
    };
    let server = runtime.spawn(admin::serve(listener, state, trigger.subscribe()));
    // The token as a mounted Secret file, named by the environment (the layered settings).
    let token_file = temp_file(&format!("{token_text}\n"));
    let token_path = token_file.display().to_string();
    let with_token: &[(&str, &str)] = &[("DLX_PROXY_ADMIN__TOKEN_FILE", &token_path)];

    // Without a token, or with another one, the server refuses and the command says so.
    for env in [&[][..], &[("DLX_PROXY_ADMIN__TOKEN", "not-the-token")][..]] {
        let refused = dlx_proxy(
            &[
                "policy",
                "--admin",
                &address,
                "set",
                "/",
                "p",
                ".*",
                r#"{"max-length": 1}"#,
            ],
            env,
        );
        assert_eq!(refused.status.code(), Some(1), "{env:?}");
        let errors = stderr(&refused);
        assert!(errors.contains("HTTP 401"), "{env:?}: {errors}");
    }
    assert!(policies.list_policies().is_empty());

    let set = dlx_proxy(
        &[
            "policy",
            "--admin",
            &address,
            "set",
            "/",
            "pol-dlx.dlxh0a1b",
            "^src\\.dlxh0a1b$",
            r#"{"dead-letter-exchange": "dlx.dlxh0a1b"}"#,
            "100",
            "queues",
        ],
        with_token,
    );
    assert!(set.status.success(), "{}", stderr(&set));
    let stored = policies.list_policies();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        (
            stored[0].vhost.as_str(),
            stored[0].name.as_str(),
            stored[0].pattern.as_str()
        ),
        ("/", "pol-dlx.dlxh0a1b", "^src\\.dlxh0a1b$")
    );
    assert_eq!(
        (stored[0].priority, stored[0].apply_to.as_str()),
        (100, "queues")
    );
    assert_eq!(stored[0].definition["dead-letter-exchange"], "dlx.dlxh0a1b");

    // The harness passes empty placeholders to clear.
    let clear = dlx_proxy(
        &[
            "policy",
            "--admin",
            &address,
            "clear",
            "/",
            "pol-dlx.dlxh0a1b",
            "",
            "",
            "0",
            "",
        ],
        with_token,
    );
    assert!(clear.status.success(), "{}", stderr(&clear));
    assert!(policies.list_policies().is_empty());
    let again = dlx_proxy(
        &[
            "policy",
            "--admin",
            &address,
            "clear",
            "/",
            "pol-dlx.dlxh0a1b",
        ],
        with_token,
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(stderr(&again).contains("404"), "{}", stderr(&again));

    let bad = dlx_proxy(
        &[
            "policy", "--admin", &address, "set", "/", "p", ".*", "{oops",
        ],
        &[],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("DEFINITION"), "{}", stderr(&bad));

    // Without --admin the address comes from the configuration (here via the environment);
    // the token from a configuration file.
    let config_file = temp_file(&format!("[admin]\ntoken_file = {token_path:?}\n"));
    let from_config = dlx_proxy(
        &[
            "policy",
            "--config",
            config_file.to_str().unwrap(),
            "set",
            "/",
            "p",
            ".*",
            r#"{"max-length": 1}"#,
        ],
        &[("DLX_PROXY_LISTEN__ADMIN", &address)],
    );
    assert!(from_config.status.success(), "{}", stderr(&from_config));
    assert_eq!(policies.list_policies()[0].apply_to, "all");
    std::fs::remove_file(&config_file).unwrap();
    std::fs::remove_file(&token_file).unwrap();

    trigger.trigger();
    runtime.block_on(server).unwrap().unwrap();
}
