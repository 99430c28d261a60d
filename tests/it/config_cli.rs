//! The `dlx-proxy` binary's configuration commands: `check-config` on the repository's
//! config.toml, on invalid files and with environment overrides (and that it refuses exactly
//! what `run` refuses); and `policy set|list|clear` against a running `dlx-proxy run`, with
//! its admin token.

use dlx_proxy::admin;
use dlx_proxy::config::{Config, PolicyConfig};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

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
            ".toml:2:8: key `listen.amqp`: invalid socket address",
        ),
        (
            "[limits]\nframe_max = \"x\"\n",
            ".toml:2:13: key `limits.frame_max`",
        ),
        (
            "[limits]\nframe_max = 100\n",
            ".toml:2:13: key `limits.frame_max`",
        ),
        (
            "[listen]\namqp_port = 1\n",
            ".toml:2:1: key `listen.amqp_port`: unknown key",
        ),
        ("colour = \"blue\"\n", ".toml:1:1: key `colour`"),
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
            ".toml:3:9: key `policies[0].vhost`",
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

/// `dlx-proxy run --config FILE` with no inherited DLX_PROXY_* or RUST_LOG variables, its
/// listeners on free ports through the environment, `env` on top; the child and the admin
/// address.
fn spawn_run(path: &Path, env: &[(&str, &str)]) -> (Child, String) {
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
    // Storage off: every run here shares the temporary directory as its working directory.
    command
        .env("DLX_PROXY_LISTEN__AMQP", free_address())
        .env("DLX_PROXY_LISTEN__ADMIN", &admin_address)
        .env("DLX_PROXY_STORAGE__DIR", "")
        .envs(env.iter().copied());
    (command.spawn().unwrap(), admin_address)
}

fn is_ready(admin_address: &str) -> bool {
    let timeout = std::time::Duration::from_millis(500);
    matches!(
        admin::request(admin_address, "GET", "/readyz", None, timeout),
        Ok((200, _))
    )
}

/// `run` with `text` as its configuration: (exit code, stderr) if it exits within 10 s, else
/// it is killed and `None` (it started).
fn run_briefly(text: &str) -> Option<(i32, String)> {
    let path = temp_file(text);
    let (mut child, admin_address) = spawn_run(&path, &[]);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let result = loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut errors = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut errors).unwrap();
            break Some((status.code().unwrap_or(-1), errors));
        }
        if is_ready(&admin_address) || std::time::Instant::now() >= until {
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

/// Proxy mode has no default upstream: without `upstream.urls` (or `upstream.url`) both
/// commands refuse it.
#[test]
fn proxy_mode_requires_the_upstream_url() {
    let text = "mode = \"proxy\"\n";
    let expected = "key `upstream.urls`: required in proxy mode";
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

/// The file is named with `--config` / `-c` as for `run`, or positionally; not both.
#[test]
fn check_config_takes_the_file_by_option_or_position() {
    let path = temp_file("[limits]\nframe_max = 8192\n");
    let file = path.to_str().unwrap();
    let positional = dlx_proxy(&["check-config", file], &[]);
    assert!(positional.status.success(), "{}", stderr(&positional));
    assert!(stdout(&positional).contains("frame_max = 8192"));
    for option in ["--config", "-c"] {
        let named = dlx_proxy(&["check-config", option, file], &[]);
        assert!(named.status.success(), "{option}: {}", stderr(&named));
        assert_eq!(stdout(&named), stdout(&positional), "{option}");
    }
    let missing = dlx_proxy(&["check-config", "--config", "/nonexistent/dlx.toml"], &[]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("/nonexistent/dlx.toml"));
    let both = dlx_proxy(&["check-config", "--config", file, file], &[]);
    assert_eq!(both.status.code(), Some(2));
    assert!(
        stderr(&both).contains("the argument '--config <FILE>' cannot be used with '[FILE]'"),
        "{}",
        stderr(&both)
    );
    assert!(stdout(&both).is_empty());
    std::fs::remove_file(&path).unwrap();
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

/// `upstream.urls` from the environment, as a TOML array (passwords masked when printed);
/// a bad entry is named by its index and the variable.
#[test]
fn upstream_urls_from_the_environment() {
    let variable = "DLX_PROXY_UPSTREAM__URLS";
    let (code, printed, errors) = check(
        "mode = \"proxy\"\n[upstream]\nuser = \"svc\"\npassword = \"pw\"\n",
        &[(
            variable,
            r#"["amqp://a:5672", "amqp://u:env-secret@b:5673"]"#,
        )],
    );
    assert_eq!(code, 0, "{errors}");
    assert!(!printed.contains("env-secret"), "{printed}");
    let urls: Vec<&str> = printed
        .lines()
        .skip_while(|l| !l.starts_with("urls = ["))
        .skip(1)
        .take_while(|l| l.trim() != "]")
        .map(str::trim)
        .collect();
    assert_eq!(
        urls,
        [r#""amqp://a:5672","#, r#""amqp://u:<redacted>@b:5673","#],
        "{printed}"
    );
    let (code, _, errors) = check(
        "mode = \"proxy\"\n",
        &[(variable, r#"["amqp://a", "http://u:env-secret@b"]"#)],
    );
    assert_eq!(code, 2);
    assert!(
        errors.contains("environment variable DLX_PROXY_UPSTREAM__URLS: key `upstream.urls[1]`"),
        "{errors}"
    );
    assert!(!errors.contains("env-secret"), "{errors}");
    // Both keys at once: refused, naming both.
    let (code, _, errors) = check(
        "mode = \"proxy\"\n[upstream]\nurl = \"amqp://a\"\n",
        &[(variable, r#"["amqp://b"]"#)],
    );
    assert_eq!(code, 2);
    assert!(
        errors.contains("upstream.url and upstream.urls are both set"),
        "{errors}"
    );
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

/// A `dlx-proxy run` child, killed (and its files removed) on drop.
struct RunningService {
    child: Child,
    admin: String,
    files: Vec<PathBuf>,
}

impl RunningService {
    /// Starts `run` on `text` (with `env`) and waits until it is ready.
    fn start(text: &str, env: &[(&str, &str)], mut files: Vec<PathBuf>) -> RunningService {
        let path = temp_file(text);
        files.push(path.clone());
        let (child, admin) = spawn_run(&path, env);
        let mut service = RunningService {
            child,
            admin,
            files,
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !is_ready(&service.admin) {
            if let Some(status) = service.child.try_wait().unwrap() {
                let mut errors = String::new();
                std::io::Read::read_to_string(
                    &mut service.child.stderr.take().unwrap(),
                    &mut errors,
                )
                .unwrap();
                panic!("dlx-proxy run exited ({status}): {errors}");
            }
            assert!(
                std::time::Instant::now() < until,
                "dlx-proxy run never got ready"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        service
    }
}

impl Drop for RunningService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// `dlx-proxy policy ARGS` against `service` (address from `--admin`), the token given to the
/// command as a mounted Secret file named by the environment (the layered settings).
fn policy_cmd(service: &RunningService, token_file: &str, args: &[&str]) -> Output {
    let mut all = vec!["policy", "--admin", &service.admin];
    all.extend_from_slice(args);
    dlx_proxy(&all, &[("DLX_PROXY_ADMIN__TOKEN_FILE", token_file)])
}

/// `policy set`, `list` and `clear` with rabbitmqctl's argument order against a running
/// service: the token is required, the defaults (vhost "/", priority 0, apply-to "queues")
/// show in `list` next to the TOML policies, bad definitions are refused naming the problem.
#[test]
fn policy_set_list_and_clear_against_a_running_service() {
    let token = "cli-token-7f3e";
    let token_file = temp_file(&format!("{token}\n"));
    let token_path = token_file.display().to_string();
    let service = RunningService::start(
        "[[policies]]\nname = \"from-toml\"\npattern = \"^t$\"\ndefinition = { max-length = 5 }\n",
        &[("DLX_PROXY_ADMIN__TOKEN", token)],
        vec![token_file],
    );
    let set_args = [
        "set",
        "pol-dlx.dlxh0a1b",
        "^src\\.dlxh0a1b$",
        r#"{"dead-letter-exchange": "dlx.dlxh0a1b"}"#,
    ];

    // Without a token, or with another one, the service refuses and the command says so.
    for env in [&[][..], &[("DLX_PROXY_ADMIN__TOKEN", "not-the-token")][..]] {
        let mut args = vec!["policy", "--admin", &service.admin];
        args.extend_from_slice(&set_args);
        let refused = dlx_proxy(&args, env);
        assert_eq!(refused.status.code(), Some(1), "{env:?}");
        let errors = stderr(&refused);
        assert!(errors.contains("HTTP 401"), "{env:?}: {errors}");
    }

    // Defaults: vhost "/", priority 0, apply-to "queues".
    let set = policy_cmd(&service, &token_path, &set_args);
    assert!(set.status.success(), "{}", stderr(&set));
    // Every option, negative priority and a pattern starting with '-'.
    let set = policy_cmd(
        &service,
        &token_path,
        &[
            "set",
            "all-of-them",
            "-x$",
            r#"{"max-length": 1, "overflow": "reject-publish"}"#,
            "--vhost",
            "/",
            "--priority",
            "-5",
            "--apply-to",
            "all",
        ],
    );
    assert!(set.status.success(), "{}", stderr(&set));

    let list = policy_cmd(&service, &token_path, &["list"]);
    assert!(list.status.success(), "{}", stderr(&list));
    let printed = stdout(&list);
    let mut lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        lines.remove(0),
        "vhost\tname\tpattern\tapply-to\tdefinition\tpriority"
    );
    lines.sort();
    assert_eq!(
        lines,
        [
            "/\tall-of-them\t-x$\tall\t{\"max-length\":1,\"overflow\":\"reject-publish\"}\t-5",
            "/\tfrom-toml\t^t$\tqueues\t{\"max-length\":5}\t0",
            "/\tpol-dlx.dlxh0a1b\t^src\\.dlxh0a1b$\tqueues\t{\"dead-letter-exchange\":\"dlx.dlxh0a1b\"}\t0",
        ]
    );
    // Reads need no token; without --admin the address comes from the configuration.
    let json = dlx_proxy(
        &["policy", "list", "--format", "json", "--vhost", "/"],
        &[("DLX_PROXY_LISTEN__ADMIN", &service.admin)],
    );
    assert!(json.status.success(), "{}", stderr(&json));
    let listed: serde_json::Value = serde_json::from_str(&stdout(&json)).unwrap();
    let dlx = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "pol-dlx.dlxh0a1b")
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(
        dlx,
        &serde_json::json!({"vhost": "/", "name": "pol-dlx.dlxh0a1b",
            "pattern": "^src\\.dlxh0a1b$", "apply-to": "queues", "priority": 0,
            "definition": {"dead-letter-exchange": "dlx.dlxh0a1b"}})
    );
    let other = policy_cmd(
        &service,
        &token_path,
        &["list", "-p", "other", "--no-table-headers"],
    );
    assert!(other.status.success(), "{}", stderr(&other));
    assert_eq!(stdout(&other), "");

    // Bad definitions and options, each refused naming the problem; nothing changes.
    for (args, code, expected) in [
        (
            vec!["set", "p", ".*", "{oops"],
            1,
            "dlx-proxy policy: DEFINITION is not valid JSON: key must be a string",
        ),
        (
            vec!["set", "p", ".*", "[1]"],
            1,
            "dlx-proxy policy: DEFINITION must be a JSON object",
        ),
        (
            vec!["set", "p", ".*", r#"{"message-tll": 60000}"#],
            1,
            "HTTP 400: policy 'p': key 'definition.message-tll': unknown policy key",
        ),
        (
            vec!["set", "p", ".*", r#"{"message-ttl": -5}"#],
            1,
            "HTTP 400: policy 'p': key 'definition.message-ttl': expected a non-negative integer",
        ),
        (
            vec!["set", "p", ".*", "{}", "--apply-to", "bindings"],
            2,
            "invalid value 'bindings' for '--apply-to <APPLY_TO>'",
        ),
        (
            vec!["set", "p", ".*", "{}", "--priority", "high"],
            2,
            "invalid value 'high' for '--priority <PRIORITY>'",
        ),
    ] {
        let refused = policy_cmd(&service, &token_path, &args);
        assert_eq!(refused.status.code(), Some(code), "{args:?}");
        assert!(
            stderr(&refused).contains(expected),
            "{args:?}: {}",
            stderr(&refused)
        );
    }
    assert_eq!(
        stdout(&policy_cmd(&service, &token_path, &["list"])),
        printed
    );

    let clear = policy_cmd(&service, &token_path, &["clear", "pol-dlx.dlxh0a1b"]);
    assert!(clear.status.success(), "{}", stderr(&clear));
    let clear = policy_cmd(
        &service,
        &token_path,
        &["clear", "all-of-them", "--vhost", "/"],
    );
    assert!(clear.status.success(), "{}", stderr(&clear));
    assert_eq!(
        stdout(&policy_cmd(
            &service,
            &token_path,
            &["list", "--no-table-headers"]
        )),
        "/\tfrom-toml\t^t$\tqueues\t{\"max-length\":5}\t0\n"
    );
    let again = policy_cmd(&service, &token_path, &["clear", "pol-dlx.dlxh0a1b"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("HTTP 404: no policy \"pol-dlx.dlxh0a1b\" in vhost \"/\""),
        "{}",
        stderr(&again)
    );
}

/// The policy command reads the admin address and token from a configuration file.
#[test]
fn policy_reads_address_and_token_from_the_configuration_file() {
    let token = "file-token-19ce";
    let service = RunningService::start("", &[("DLX_PROXY_ADMIN__TOKEN", token)], vec![]);
    let config_file = temp_file(&format!(
        "[listen]\nadmin = {:?}\n[admin]\ntoken = {token:?}\n",
        service.admin
    ));
    let config = config_file.to_str().unwrap();
    let set = dlx_proxy(
        &[
            "policy",
            "set",
            "p",
            ".*",
            r#"{"max-length": 2}"#,
            "--config",
            config,
        ],
        &[],
    );
    assert!(set.status.success(), "{}", stderr(&set));
    let list = dlx_proxy(&["policy", "-c", config, "list", "--no-table-headers"], &[]);
    assert_eq!(
        stdout(&list),
        "/\tp\t.*\tqueues\t{\"max-length\":2}\t0\n",
        "{}",
        stderr(&list)
    );
    std::fs::remove_file(&config_file).unwrap();
}
