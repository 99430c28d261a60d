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
//! [`cluster`] holds the 3-node cluster of the fleet tests ([`RabbitCluster`]), built from
//! the same nodes sharing one cookie; a node can be killed (SIGKILL) and restarted with the
//! same environment. The nodes raise their open-files limit (1024 would cap connections).
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

mod cluster;
#[allow(unused_imports)]
pub use cluster::{Outage, RabbitCluster, cluster};

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
    /// The management HTTP API (`guest`/`guest`), for a node started with the
    /// `rabbitmq_management` plugin ([`NodeOptions`]).
    pub management: Option<SocketAddr>,
    dist_port: u16,
    bin: PathBuf,
    /// The node this one joined, for a node of a [`RabbitCluster`].
    seed: OnceLock<String>,
    /// Held until the process exits; its closing stops the node.
    watchdog: Mutex<Option<(Child, ChildStdin)>>,
}

/// Raises the soft limit of open files for the node to the hard limit (at most 65536): the
/// usual 1024 caps a node at about a thousand connections.
const RAISE_OPEN_FILES: &str =
    "ulimit -n 65536 2>/dev/null || ulimit -n \"$(ulimit -Hn)\" 2>/dev/null || true\n";

/// The server itself, its output appended to `server.out` (restarts add to it).
const SERVER: &str = "\"$RABBIT_BIN/rabbitmq-server\" >>\"$NODE_DIR/server.out\" 2>&1";

/// What a node of a test's own runs beyond the defaults (no plugins).
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// Plugins enabled at boot, e.g. `rabbitmq_management` (which then listens on a free
    /// port of 127.0.0.1, [`RabbitNode::management`]).
    pub plugins: Vec<&'static str>,
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
        Self::start_with(tag, &NodeOptions::default())
    }

    /// [`RabbitNode::start`] with `options` (plugins); waits for the management listener too
    /// when the management plugin is enabled.
    pub fn start_with(tag: &str, options: &NodeOptions) -> RabbitNode {
        let cookie = format!("DLXIT{}{tag}", std::process::id());
        let node = Self::launch_with(tag, &cookie, options);
        node.wait_started();
        node
    }

    /// Prepares the node `dlxit-<pid>-<tag>@localhost` (directories, free ports, TLS files,
    /// `cookie` as its Erlang cookie) and starts it under its watchdog, without waiting for
    /// it: nodes of a cluster boot side by side.
    pub(crate) fn launch(tag: &str, cookie: &str) -> RabbitNode {
        Self::launch_with(tag, cookie, &NodeOptions::default())
    }

    fn launch_with(tag: &str, cookie: &str, options: &NodeOptions) -> RabbitNode {
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
        let management = options
            .plugins
            .contains(&"rabbitmq_management")
            .then(|| SocketAddr::from(([127, 0, 0, 1], free_port())));

        let cookie_file = dir.join("home/.erlang.cookie");
        std::fs::write(&cookie_file, cookie).unwrap();
        set_mode(&cookie_file, 0o400);

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
                 ssl_options.fail_if_no_peer_cert = false\n{management}",
                tls = tls.display(),
                management = management
                    .map(|addr| format!(
                        "management.tcp.ip = {}\nmanagement.tcp.port = {}\n",
                        addr.ip(),
                        addr.port()
                    ))
                    .unwrap_or_default(),
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("enabled_plugins"),
            format!("[{}].\n", options.plugins.join(",")),
        )
        .unwrap();

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

        let node = RabbitNode {
            name,
            amqp,
            amqps,
            ca_file: tls.join("ca.pem"),
            dir,
            management,
            dist_port,
            bin,
            seed: OnceLock::new(),
            watchdog: Mutex::new(None),
        };
        // The watchdog starts the server, then waits for the test process to go away.
        let watchdog_script = format!(
            "{RAISE_OPEN_FILES}{SERVER} &\n\
             cat >/dev/null\n\
             \"$RABBIT_BIN/rabbitmqctl\" -n \"$RABBITMQ_NODENAME\" -q stop >/dev/null 2>&1 \
               || kill -9 \"$(cat \"$RABBITMQ_PID_FILE\")\" 2>/dev/null\n\
             rm -rf \"$NODE_DIR\"\n"
        );
        let mut watchdog = node
            .server_command(&watchdog_script)
            .stdin(Stdio::piped())
            .spawn()
            .expect("start the RabbitMQ watchdog shell");
        let stdin = watchdog.stdin.take().expect("watchdog stdin");
        *node.watchdog.lock().unwrap() = Some((watchdog, stdin));
        node
    }

    /// `sh -c script` in the node's directory with the node's whole environment: what the
    /// watchdog and [`RabbitNode::restart`] run `rabbitmq-server` with.
    fn server_command(&self, script: &str) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(script)
            .current_dir(&self.dir)
            .env("RABBIT_BIN", &self.bin)
            .env("NODE_DIR", &self.dir)
            .env("HOME", self.dir.join("home"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.amqp.port().to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", self.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env("RABBITMQ_PID_FILE", self.pid_file())
            .env("RABBITMQ_CONFIG_FILE", self.dir.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.dir.join("enabled_plugins"),
            )
            // Idle schedulers sleep instead of spinning: several nodes share two cores.
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "+sbwt none +sbwtdcpu none +sbwtdio none",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        command
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.join("pid")
    }

    /// The OS pid of the node's `beam.smp` (from its pid file), if it wrote one.
    pub fn beam_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.pid_file())
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Kills the node's `beam.smp` with SIGKILL (a node lost without warning) and waits until
    /// the process is gone and its AMQP port closed. Tests on a shared cluster hold
    /// [`RabbitCluster::exclusive`] while a node is down; see [`cluster`].
    pub fn kill(&self) {
        let pid = self
            .beam_pid()
            .unwrap_or_else(|| panic!("{} has no pid file (not running?)", self.name));
        // SAFETY: kill(2) with a pid read from the node's own pid file; no memory involved.
        let sent = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(sent, 0, "SIGKILL {} (pid {pid}) failed", self.name);
        let killed = Instant::now();
        while process_alive(pid) || port_open(self.amqp) {
            assert!(
                killed.elapsed() < Duration::from_secs(30),
                "{} (pid {pid}) still running 30 s after SIGKILL",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // A stale pid must not be killed by the watchdog once the number is reused.
        let _ = std::fs::remove_file(self.pid_file());
    }

    /// Starts a stopped or killed node again with the same environment (name, ports, data,
    /// cookie) and waits until it has started and, for a cluster node, until it runs in the
    /// cluster again. Blocks for the seconds this takes.
    pub fn restart(&self) {
        let mut server = self
            .server_command(&format!("{RAISE_OPEN_FILES}exec {SERVER}\n"))
            .spawn()
            .expect("start rabbitmq-server");
        // Reaped whenever it ends; the watchdog stops the node with the test process.
        std::thread::spawn(move || server.wait());
        self.wait_started();
        if self.seed.get().is_some() {
            self.wait_cluster_complete();
        }
    }

    pub(crate) fn wait_started(&self) {
        let started = Instant::now();
        loop {
            let up = port_open(self.amqp)
                && port_open(self.amqps)
                && self.management.is_none_or(port_open)
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

    /// One request to the management API as `guest` (the node must have been started with
    /// the management plugin): (status, body).
    pub async fn management_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, String) {
        let address = self
            .management
            .unwrap_or_else(|| panic!("{} runs without the management plugin", self.name))
            .to_string();
        let (method, path) = (method.to_string(), path.to_string());
        let body = body.map(str::to_string);
        tokio::task::spawn_blocking(move || {
            let guest = dlx_proxy::secret::Secret::new("Basic Z3Vlc3Q6Z3Vlc3Q=".to_string());
            dlx_proxy::admin::request_authorized(
                &address,
                &method,
                &path,
                body.as_deref(),
                Some(&guest),
                Duration::from_secs(10),
            )
        })
        .await
        .expect("management request task")
        .expect("management HTTP request")
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

/// Whether `pid` is a live process (not gone, not a zombie).
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn port_open(addr: SocketAddr) -> bool {
    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}
