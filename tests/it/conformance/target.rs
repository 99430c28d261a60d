//! The three servers the scenarios run against and how each sets a policy: the embedded
//! broker and the proxy through dlx-proxy's admin API (`PUT`/`DELETE /api/policies/…`), the
//! reference RabbitMQ node with `rabbitmqctl set_policy` / `clear_policy`.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

use crate::rabbit;

/// How a target sets and clears policies.
pub enum PolicyHook {
    /// dlx-proxy's admin API at this address.
    Admin(SocketAddr),
    /// `rabbitmqctl` against the reference node.
    RabbitMqCtl,
}

/// A server under test.
pub struct Target {
    /// For messages: "embedded broker", "reference RabbitMQ", "proxy".
    pub name: &'static str,
    /// `amqp://guest:guest@host:port/%2f`
    pub uri: String,
    /// Its AMQP address (scenario connections reach it through a tap).
    pub server: SocketAddr,
    /// The user the scenarios log in as (a `user_id` equal to it is recorded as `$USER`).
    pub username: String,
    pub policy: PolicyHook,
}

/// Policies are in vhost "/", for queues, at priority 100, as the harness sets them.
const VHOST: &str = "/";
const PRIORITY: i32 = 100;
const APPLY_TO: &str = "queues";

impl Target {
    /// Sets a policy; returns a note for the scenario's log, or why it failed.
    pub async fn set_policy(
        &self,
        name: &str,
        pattern: &str,
        definition: Value,
    ) -> Result<String, String> {
        match self.policy {
            PolicyHook::Admin(admin) => {
                let body = json!({
                    "pattern": pattern,
                    "definition": definition,
                    "priority": PRIORITY,
                    "apply-to": APPLY_TO,
                })
                .to_string();
                admin_call(admin, "PUT", name, Some(body)).await
            }
            PolicyHook::RabbitMqCtl => {
                let args = vec![
                    "-q".to_string(),
                    "set_policy".into(),
                    "-p".into(),
                    VHOST.into(),
                    "--priority".into(),
                    PRIORITY.to_string(),
                    "--apply-to".into(),
                    APPLY_TO.into(),
                    name.into(),
                    pattern.into(),
                    definition.to_string(),
                ];
                rabbitmqctl(args).await
            }
        }
    }

    pub async fn clear_policy(&self, name: &str) -> Result<String, String> {
        match self.policy {
            PolicyHook::Admin(admin) => admin_call(admin, "DELETE", name, None).await,
            PolicyHook::RabbitMqCtl => {
                let args = vec![
                    "-q".to_string(),
                    "clear_policy".into(),
                    "-p".into(),
                    VHOST.into(),
                    name.into(),
                ];
                rabbitmqctl(args).await
            }
        }
    }
}

/// The admin token the embedded and proxy targets are configured with (policy writes need it).
pub const ADMIN_TOKEN: &str = "conformance-admin-token";

async fn admin_call(
    admin: SocketAddr,
    method: &'static str,
    name: &str,
    body: Option<String>,
) -> Result<String, String> {
    let path = format!(
        "/api/policies/{}/{}",
        dlx_proxy::admin::encode_path_segment(VHOST),
        dlx_proxy::admin::encode_path_segment(name)
    );
    let (status, text) =
        crate::common::admin_call(admin, method, &path, body.as_deref(), Some(ADMIN_TOKEN)).await;
    if (200..300).contains(&status) {
        Ok(format!("{method} -> {status}"))
    } else {
        Err(format!("{method} policy {name}: HTTP {status} {text}"))
    }
}

/// How long one `rabbitmqctl` call may take (it starts an Erlang VM; the harness allows 30 s).
const CTL_TIMEOUT: Duration = Duration::from_secs(30);

async fn rabbitmqctl(args: Vec<String>) -> Result<String, String> {
    // One at a time: concurrent scenarios would otherwise start several VMs at once.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let call = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rabbit::reference().ctl(&args)
    });
    let out = tokio::time::timeout(CTL_TIMEOUT, call)
        .await
        .map_err(|_| format!("rabbitmqctl took over {CTL_TIMEOUT:?}"))?
        .map_err(|e| format!("rabbitmqctl task: {e}"))?;
    let text = format!(
        "rc={:?} {} {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("rabbitmqctl failed: {text}"))
    }
}
