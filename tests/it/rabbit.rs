//! RabbitMQ nodes that the tests start themselves, from the installed `rabbitmq-server`, the way
//! testcontainers would start a container: each on free ports (AMQP, amqps, Erlang
//! distribution), with its own data directory, Erlang cookie and a TLS listener whose CA the
//! tests trust. No test depends on a broker someone else started, and none returns early
//! because one is missing: without `rabbitmq-server` the tests that need it fail and say how
//! to install it.
//!
//! [`reference`] is the node the proxy-mode and reference tests share (started once per test
//! process, on first use). A node stops when the test process ends, however it ends: a small
//! watchdog shell holds the read end of a pipe whose write end only the test process has;
//! when that closes, the watchdog stops the node and removes its directory.
//!
//! `DLX_RABBITMQ_BIN` names the directory holding `rabbitmq-server` and `rabbitmqctl` when
//! they are not in Debian's `/usr/lib/rabbitmq/bin` or on `PATH`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::common::free_port;
use crate::common::pki::TestCa;

/// How long a node may take to start on a busy 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A running RabbitMQ node owned by this test process.
pub struct RabbitNode {
    /// Erlang node name, e.g. `dlxit-1234-ref@localhost`.
    pub name: String,
    pub amqp: SocketAddr,
    pub amqps: SocketAddr,
    /// The CA that signed the amqps listener's certificate (`localhost`, `127.0.0.1`).
    pub ca_file: PathBuf,
    /// The node's directory: data, logs, config, TLS files, cookie home, `bin/rabbitmqctl`.
    pub dir: PathBuf,
    bin: PathBuf,
    /// Held until the process exits; its closing stops the node.
    _watchdog: Mutex<(Child, ChildStdin)>,
}

/// The shared reference node, started on first use.
pub fn reference() -> &'static RabbitNode {
    static NODE: OnceLock<RabbitNode> = OnceLock::new();
    NODE.get_or_init(|| RabbitNode::start("ref"))
}

/// The directory with `rabbitmq-server` and `rabbitmqctl` (not Debian's su wrappers: the
/// node runs as the test's own user, with the test's own cookie).
fn rabbitmq_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("DLX_RABBITMQ_BIN") {
        return PathBuf::from(dir);
    }
    let debian = PathBuf::from("/usr/lib/rabbitmq/bin");
    if debian.join("rabbitmq-server").exists() {
        return debian;
    }
    if let Some(dir) = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path).find(|dir| dir.join("rabbitmq-server").exists())
    }) {
        return dir;
    }
    panic!(
        "these tests start their own RabbitMQ node, but rabbitmq-server is not installed \
         (Debian: apt-get install rabbitmq-server; or set DLX_RABBITMQ_BIN to the directory \
         holding rabbitmq-server and rabbitmqctl)"
    );
}

impl RabbitNode {
    /// Starts a node called `dlxit-<pid>-<tag>@localhost` and waits until it accepts AMQP and
    /// amqps connections. Panics with the node's log when it does not come up.
    pub fn start(tag: &str) -> RabbitNode {
        let bin = rabbitmq_bin();
        let name = format!("dlxit-{}-{tag}@localhost", std::process::id());
        let dir = std::env::temp_dir().join(format!("dlx-it-rabbit-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["home", "mnesia", "log", "tls", "bin"] {
            std::fs::create_dir_all(dir.join(sub)).expect("create the node's directories");
        }
        let amqp = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let amqps = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let dist_port = free_port();

        let cookie = dir.join("home/.erlang.cookie");
        std::fs::write(&cookie, format!("DLXIT{}{tag}", std::process::id())).unwrap();
        set_mode(&cookie, 0o400);

        let ca = TestCa::new("dlx-proxy test RabbitMQ CA");
        let server = ca.localhost_server();
        let tls = dir.join("tls");
        std::fs::write(tls.join("ca.pem"), &ca.pem).unwrap();
        std::fs::write(tls.join("server.pem"), &server.cert).unwrap();
        std::fs::write(tls.join("server.key"), &server.key).unwrap();
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!(
                "listeners.ssl.default = {amqps}\n\
                 ssl_options.cacertfile = {tls}/ca.pem\n\
                 ssl_options.certfile = {tls}/server.pem\n\
                 ssl_options.keyfile = {tls}/server.key\n\
                 ssl_options.verify = verify_none\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                tls = tls.display()
            ),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();

        // `bin/rabbitmqctl` talks to this node: the conformance harness's policy hook and
        // anyone debugging a run can use it as they would use the system one.
        let ctl = dir.join("bin/rabbitmqctl");
        std::fs::write(
            &ctl,
            format!(
                "#!/bin/sh\nHOME='{home}' exec '{bin}/rabbitmqctl' -n '{name}' \"$@\"\n",
                home = dir.join("home").display(),
                bin = bin.display()
            ),
        )
        .unwrap();
        set_mode(&ctl, 0o755);

        let watchdog_script = "\"$RABBIT_BIN/rabbitmq-server\" >\"$NODE_DIR/server.out\" 2>&1 &\n\
             cat >/dev/null\n\
             \"$RABBIT_BIN/rabbitmqctl\" -n \"$RABBITMQ_NODENAME\" -q stop >/dev/null 2>&1 \
               || kill -9 \"$(cat \"$RABBITMQ_PID_FILE\")\" 2>/dev/null\n\
             rm -rf \"$NODE_DIR\"\n";
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(watchdog_script)
            .current_dir(&dir)
            .env("RABBIT_BIN", &bin)
            .env("NODE_DIR", &dir)
            .env("HOME", dir.join("home"))
            .env("RABBITMQ_NODENAME", &name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", amqp.port().to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the RabbitMQ watchdog shell");
        let stdin = watchdog.stdin.take().expect("watchdog stdin");
        let node = RabbitNode {
            name,
            amqp,
            amqps,
            ca_file: tls.join("ca.pem"),
            dir,
            bin,
            _watchdog: Mutex::new((watchdog, stdin)),
        };
        node.wait_started();
        node
    }

    fn wait_started(&self) {
        let started = Instant::now();
        loop {
            let up = port_open(self.amqp)
                && port_open(self.amqps)
                && self
                    .ctl(&["-q", "await_startup", "--timeout", "5"])
                    .status
                    .success();
            if up {
                return;
            }
            if started.elapsed() > START_TIMEOUT {
                panic!(
                    "RabbitMQ node {} did not start within {START_TIMEOUT:?}\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.amqp)
    }

    /// Runs `rabbitmqctl` against this node.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("rabbitmqctl"))
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .env("HOME", self.dir.join("home"))
            .stdin(Stdio::null())
            .output()
            .expect("run rabbitmqctl")
    }

    /// A directory whose `rabbitmqctl` talks to this node (put it first on `PATH`).
    pub fn ctl_dir(&self) -> PathBuf {
        self.dir.join("bin")
    }

    /// The end of the node's logs, for failure messages.
    pub fn log_tail(&self) -> String {
        let mut text = String::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(self.dir.join("log"))
            .map(|entries| entries.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.push(self.dir.join("server.out"));
        for file in files {
            if let Ok(content) = std::fs::read_to_string(&file) {
                let lines: Vec<&str> = content.lines().collect();
                let tail = &lines[lines.len().saturating_sub(40)..];
                text.push_str(&format!("== {}\n{}\n", file.display(), tail.join("\n")));
            }
        }
        text
    }
}

fn port_open(addr: SocketAddr) -> bool {
    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}
