//! Live configuration reload of the real binary: a changed config file (atomic rename, or a
//! Kubernetes ConfigMap `..data` symlink swap) or SIGHUP applies new policies and users to a
//! running broker without dropping client connections; a broken file is rejected, the old
//! configuration stays in force, and `dlx_proxy_config_reloads_total{result="failure"}` counts
//! it.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::dl::{bind, exchange};
use common::{
    ServiceProcess, TempDir, free_addresses, http, metric_value, process_config, scrape, unique,
    wait_metric, wait_metric_at_least, write_atomically,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");
const SUCCESS: &str = r#"dlx_proxy_config_reloads_total{result="success"}"#;
const FAILURE: &str = r#"dlx_proxy_config_reloads_total{result="failure"}"#;

/// A `max-length = 1` policy on `queue` that dead-letters the overflow to `dlx`.
fn cap_policy(queue: &str, dlx: &str) -> String {
    format!(
        "\n[[policies]]\nname = \"cap\"\nvhost = \"/\"\npattern = \"^{queue}$\"\n\
         apply_to = \"queues\"\npriority = 1\n\
         definition = {{ max-length = 1, dead-letter-exchange = \"{dlx}\" }}\n"
    )
}

/// The value of a sample, 0 when the series does not exist yet.
fn value(text: &str, name_and_labels: &str) -> f64 {
    metric_value(text, name_and_labels).unwrap_or(0.0)
}

fn depth(queue: &str) -> String {
    format!(r#"dlx_proxy_queue_messages{{queue="{queue}",vhost="/"}}"#)
}

fn maxlen_deaths(queue: &str) -> String {
    format!(r#"dlx_proxy_dead_lettered_total{{queue="{queue}",reason="maxlen",vhost="/"}}"#)
}

/// A client with a confirm channel, a fanout DLX bound to a DLQ, and the queue under test.
struct Client {
    conn: Connection,
    ch: Channel,
    queue: String,
    dlx: String,
    dlq: String,
}

impl Client {
    async fn connect(amqp: SocketAddr) -> Client {
        let conn = Connection::connect(
            &format!("amqp://guest:guest@{amqp}/%2f"),
            ConnectionProperties::default(),
        )
        .await
        .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let (queue, dlx, dlq) = (unique("reloaded"), unique("dlx"), unique("dlq"));
        exchange(&ch, &dlx, ExchangeKind::Fanout).await;
        for q in [&queue, &dlq] {
            ch.queue_declare(
                q.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        bind(&ch, &dlq, &dlx, "").await;
        Client {
            conn,
            ch,
            queue,
            dlx,
            dlq,
        }
    }

    async fn publish(&self, count: usize) {
        for i in 0..count {
            let confirm = self
                .ch
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    format!("m{i}").as_bytes(),
                    BasicProperties::default(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack());
        }
    }

    fn still_connected(&self) {
        assert!(
            self.conn.status().connected(),
            "the client connection was dropped by the reload"
        );
    }
}

/// The shared scenario once the service runs with `base` and no policy: `apply(text)` puts a
/// new configuration in place (and signals, if needed). Checks that the policy applies to the
/// existing queue on the same connection, that a broken file is rejected with the old policy
/// kept, and that a fixed file is accepted again.
async fn policy_reload_scenario<F>(process: &ServiceProcess, base: &str, mut apply: F)
where
    F: FnMut(&str),
{
    let admin = process.admin;
    let client = Client::connect(process.amqp).await;
    client.publish(3).await;
    wait_metric(admin, &depth(&client.queue), 3.0).await;

    // Add the policy: the existing queue is trimmed to one message, the overflow dead-lettered.
    let with_policy = format!("{base}{}", cap_policy(&client.queue, &client.dlx));
    apply(&with_policy);
    let text = wait_metric_at_least(admin, SUCCESS, 1.0).await;
    assert_eq!(value(&text, FAILURE), 0.0, "{text}");
    wait_metric(admin, &depth(&client.queue), 1.0).await;
    let text = wait_metric(admin, &depth(&client.dlq), 2.0).await;
    assert_eq!(value(&text, &maxlen_deaths(&client.queue)), 2.0, "{text}");
    client.still_connected();
    client.publish(2).await;
    let text = wait_metric(admin, &depth(&client.dlq), 4.0).await;
    assert_eq!(value(&text, &depth(&client.queue)), 1.0, "{text}");
    assert_eq!(
        value(&text, "dlx_proxy_connections_opened_total"),
        1.0,
        "{text}"
    );
    let (status, listed) = http(admin, "GET", "/api/policies").await;
    assert_eq!(status, 200);
    assert!(listed.contains("\"cap\""), "{listed}");

    // A broken file (unknown key) is rejected; the policy stays in force.
    let successes = value(&scrape(admin).await, SUCCESS);
    apply(&format!("{with_policy}\nnot_a_setting = true\n"));
    let text = wait_metric(admin, FAILURE, 1.0).await;
    assert_eq!(value(&text, SUCCESS), successes, "{text}");
    client.publish(1).await;
    let text = wait_metric(admin, &depth(&client.dlq), 5.0).await;
    assert_eq!(value(&text, &depth(&client.queue)), 1.0, "{text}");
    let (_, listed) = http(admin, "GET", "/api/policies").await;
    assert!(listed.contains("\"cap\""), "{listed}");

    // Broken TOML and an invalid policy value are rejected the same way.
    apply(&format!("{with_policy}\n[[policies]\n"));
    wait_metric(admin, FAILURE, 2.0).await;
    apply(&with_policy.replace("max-length = 1", "max-length = -5"));
    wait_metric(admin, FAILURE, 3.0).await;
    client.publish(1).await;
    let text = wait_metric(admin, &depth(&client.dlq), 6.0).await;
    assert_eq!(value(&text, &depth(&client.queue)), 1.0, "{text}");

    // A valid file without the policy lifts the cap.
    apply(base);
    wait_metric_at_least(admin, SUCCESS, successes + 1.0).await;
    let (_, listed) = http(admin, "GET", "/api/policies").await;
    assert!(!listed.contains("\"cap\""), "{listed}");
    client.publish(2).await;
    let text = wait_metric(admin, &depth(&client.queue), 3.0).await;
    assert_eq!(value(&text, &depth(&client.dlq)), 6.0, "{text}");
    client.still_connected();
    assert_eq!(
        value(&text, "dlx_proxy_connections_opened_total"),
        1.0,
        "{text}"
    );
    assert_eq!(value(&text, "dlx_proxy_connections"), 1.0, "{text}");
}

#[tokio::test]
async fn a_file_replaced_by_rename_is_reloaded() {
    let dir = TempDir::new("dlx-proxy-reload-rename");
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let path = dir.join("config.toml");
    write_atomically(&path, &base);
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
    policy_reload_scenario(&process, &base, |text| write_atomically(&path, text)).await;
}

#[tokio::test]
async fn a_file_rewritten_in_place_is_reloaded() {
    let dir = TempDir::new("dlx-proxy-reload-inplace");
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let path = dir.join("config.toml");
    std::fs::write(&path, &base).unwrap();
    let _process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
    let client = Client::connect(amqp).await;
    client.publish(3).await;
    wait_metric(admin, &depth(&client.queue), 3.0).await;
    std::fs::write(
        &path,
        format!("{base}{}", cap_policy(&client.queue, &client.dlx)),
    )
    .unwrap();
    wait_metric(admin, &depth(&client.queue), 1.0).await;
    wait_metric(admin, &depth(&client.dlq), 2.0).await;
    client.still_connected();
    assert_eq!(value(&scrape(admin).await, FAILURE), 0.0);
}

/// Kubernetes' ConfigMap volume layout: `config.toml -> ..data/config.toml`,
/// `..data -> ..<timestamp>`; an update writes a new timestamped directory, points a temporary
/// symlink at it and renames that over `..data`.
struct ConfigMapVolume {
    dir: TempDir,
    generation: usize,
}

impl ConfigMapVolume {
    fn new(text: &str) -> ConfigMapVolume {
        let dir = TempDir::new("dlx-proxy-configmap");
        let mut volume = ConfigMapVolume { dir, generation: 0 };
        let first = volume.write_generation(text);
        std::os::unix::fs::symlink(&first, volume.dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.toml", volume.dir.join("config.toml")).unwrap();
        volume
    }

    fn write_generation(&mut self, text: &str) -> String {
        self.generation += 1;
        let name = format!(
            "..2026_01_01_00_00_{:02}.{}",
            self.generation, self.generation
        );
        std::fs::create_dir(self.dir.join(&name)).unwrap();
        std::fs::write(self.dir.join(&name).join("config.toml"), text).unwrap();
        name
    }

    /// The kubelet's atomic update.
    fn update(&mut self, text: &str) {
        let old = std::fs::read_link(self.dir.join("..data")).unwrap();
        let new = self.write_generation(text);
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&new, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        std::fs::remove_dir_all(self.dir.path().join(old)).unwrap();
    }

    fn config_path(&self) -> std::path::PathBuf {
        self.dir.join("config.toml")
    }
}

#[tokio::test]
async fn a_configmap_symlink_swap_is_reloaded() {
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let mut volume = ConfigMapVolume::new(&base);
    let logs = TempDir::new("dlx-proxy-configmap-logs");
    let process =
        ServiceProcess::start(BINARY, logs.path(), &volume.config_path(), amqp, admin).await;
    policy_reload_scenario(&process, &base, |text| volume.update(text)).await;
}

#[tokio::test]
async fn sighup_reloads_a_file_the_watcher_cannot_see() {
    // The config path is a symlink into another directory: edits there produce no event in
    // the watched directory, so only SIGHUP can pick them up.
    let watched = TempDir::new("dlx-proxy-hup-watched");
    let elsewhere = TempDir::new("dlx-proxy-hup-real");
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let real = elsewhere.join("real.toml");
    write_atomically(&real, &base);
    let path = watched.join("config.toml");
    std::os::unix::fs::symlink(&real, &path).unwrap();
    // Logs elsewhere too: any event in the watched directory makes the watcher re-read the
    // file (through the symlink) and notice the change.
    let logs = TempDir::new("dlx-proxy-hup-logs");
    let mut process = ServiceProcess::start(BINARY, logs.path(), &path, amqp, admin).await;

    let client = Client::connect(amqp).await;
    client.publish(3).await;
    wait_metric(admin, &depth(&client.queue), 3.0).await;
    let with_policy = format!("{base}{}", cap_policy(&client.queue, &client.dlx));
    write_atomically(&real, &with_policy);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let text = scrape(admin).await;
    assert_eq!(
        value(&text, SUCCESS),
        0.0,
        "reloaded without SIGHUP:\n{text}"
    );
    assert_eq!(value(&text, &depth(&client.queue)), 3.0, "{text}");

    process.signal("HUP");
    wait_metric(admin, SUCCESS, 1.0).await;
    wait_metric(admin, &depth(&client.queue), 1.0).await;
    wait_metric(admin, &depth(&client.dlq), 2.0).await;
    client.still_connected();

    write_atomically(&real, &format!("{with_policy}\nnot_a_setting = 1\n"));
    process.signal("HUP");
    let text = wait_metric(admin, FAILURE, 1.0).await;
    assert_eq!(value(&text, SUCCESS), 1.0, "{text}");
    client.publish(2).await;
    let text = wait_metric(admin, &depth(&client.dlq), 4.0).await;
    assert_eq!(value(&text, &depth(&client.queue)), 1.0, "{text}");
    client.still_connected();
    assert_eq!(
        process.child.try_wait().unwrap(),
        None,
        "SIGHUP ended the process"
    );
}

#[tokio::test]
async fn reloaded_users_can_log_in_without_a_restart() {
    let dir = TempDir::new("dlx-proxy-reload-users");
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let path = dir.join("config.toml");
    write_atomically(&path, &base);
    let _process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
    let alice = format!("amqp://alice:wonderland@{amqp}/%2f");
    assert!(
        Connection::connect(&alice, ConnectionProperties::default())
            .await
            .is_err(),
        "alice logged in before she was configured"
    );
    let guest = Client::connect(amqp).await;
    let users = "\n[[users]]\nname = \"guest\"\npassword = \"guest\"\n\
                 [[users.permissions]]\nvhost = \"/\"\nconfigure = \".*\"\nwrite = \".*\"\nread = \".*\"\n\
                 \n[[users]]\nname = \"alice\"\npassword = \"wonderland\"\n\
                 [[users.permissions]]\nvhost = \"/\"\nconfigure = \".*\"\nwrite = \".*\"\nread = \".*\"\n";
    write_atomically(&path, &format!("{base}{users}"));
    wait_metric(admin, SUCCESS, 1.0).await;
    let conn = Connection::connect(&alice, ConnectionProperties::default())
        .await
        .expect("alice logs in after the reload");
    conn.create_channel().await.unwrap();
    guest.still_connected();
    guest.publish(1).await;
}

#[tokio::test]
async fn start_only_settings_are_kept_and_reported() {
    let dir = TempDir::new("dlx-proxy-reload-fixed");
    let (amqp, admin) = free_addresses();
    let base = process_config(amqp, admin, 1);
    let path = dir.join("config.toml");
    write_atomically(&path, &base);
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;
    let client = Client::connect(amqp).await;
    // A new drain time and a new policy: the policy applies, the drain time is reported.
    let changed = format!(
        "{}{}",
        base.replace("drain_secs = 1", "drain_secs = 7"),
        cap_policy(&client.queue, &client.dlx)
    );
    write_atomically(&path, &changed);
    wait_metric(admin, SUCCESS, 1.0).await;
    client.publish(2).await;
    wait_metric(admin, &depth(&client.dlq), 1.0).await;
    let mut reported = false;
    for _ in 0..50 {
        let logs = process.logs();
        if logs
            .lines()
            .any(|l| l.contains("need a restart") && l.contains("shutdown"))
        {
            reported = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reported, "no restart warning:\n{}", process.logs());
    client.still_connected();
}
