//! No secret reaches the logs, at any level: the real binary runs with `log.filter = "trace"`
//! in embedded mode and in proxy mode (in front of the RabbitMQ node the tests start), clients log
//! in with unique passwords over PLAIN and AMQPLAIN (and once with a wrong one), the admin API
//! is called with the token (and once with a wrong one); then the captured stdout and stderr
//! must hold the startup lines and none of the secret strings: user passwords, the password
//! hash, the upstream URL's password, the admin tokens.

use crate::common;
use crate::proxy_support;

use std::time::Duration;

use common::{ServiceProcess, TempDir, admin_call, free_addresses, unique, write_atomically};
use dlx_proxy::broker::auth::hash_password;
use lapin::{Connection, ConnectionProperties};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

/// Stops the process with SIGTERM and returns everything it wrote (stdout then stderr).
async fn stop_and_collect(mut process: ServiceProcess) -> String {
    process.signal("TERM");
    let status = process
        .wait_exit(Duration::from_secs(15))
        .await
        .unwrap_or_else(|| panic!("no exit:\n{}", process.logs()));
    assert_eq!(status.code(), Some(0), "{}", process.logs());
    process.logs()
}

/// The logs are real (they hold the startup lines and TRACE lines) and hold none of `secrets`.
fn assert_logs_hold_no_secret(logs: &str, startup: &[&str], secrets: &[&str]) {
    assert!(logs.lines().count() > 10, "too few log lines:\n{logs}");
    for line in [
        "starting dlx-proxy",
        "admin HTTP listener",
        "dlx-proxy stopped",
    ]
    .iter()
    .chain(startup)
    {
        assert!(logs.contains(line), "no {line:?} in the logs:\n{logs}");
    }
    assert!(logs.contains("TRACE"), "no TRACE line:\n{logs}");
    for secret in secrets {
        assert!(!secret.is_empty());
        if let Some(line) = logs.lines().find(|line| line.contains(secret)) {
            panic!("secret {secret:?} logged: {line}");
        }
    }
}

async fn login(url: &str) -> Result<Connection, lapin::Error> {
    tokio::time::timeout(
        Duration::from_secs(10),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .expect("login timed out")
}

/// Logs in with `user`/`password` over PLAIN and AMQPLAIN (declaring a queue on each
/// connection), and once with `wrong_password`, which is refused.
async fn logins(amqp: &str, user: &str, password: &str, wrong_password: &str, queue: &str) {
    for mechanism in ["plain", "amqplain"] {
        let url = format!("amqp://{user}:{password}@{amqp}/%2f?auth_mechanism={mechanism}");
        let connection = login(&url)
            .await
            .unwrap_or_else(|e| panic!("{mechanism} login: {e}"));
        let channel = connection.create_channel().await.expect("channel");
        channel
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    auto_delete: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .expect("declare");
        connection.close(200, "bye".into()).await.expect("close");
    }
    let url = format!("amqp://{user}:{wrong_password}@{amqp}/%2f");
    assert!(login(&url).await.is_err(), "a wrong password was accepted");
}

/// A restricted user through the proxy at `amqp` (it may write anything but `t-locked-*`):
/// its declare naming the locked exchange as dead-letter exchange is refused with RabbitMQ's
/// 403, and its rejection from `queue` (which dead-letters there into `dlq`, declared by an
/// administrator) is published by the proxy's service user. Returns every reply text the
/// client got.
async fn restricted_user_through_the_service(
    amqp: &str,
    user: &str,
    password: &str,
    queue: &str,
    locked: &str,
    dlq: &str,
) -> Vec<String> {
    use crate::common::dl::{amqp_text, get_and_reject, publish, table, try_declare};
    let url = format!("amqp://{user}:{password}@{amqp}/%2f");
    let connection = login(&url).await.expect("restricted login");
    let channel = connection.create_channel().await.expect("channel");
    let refused = try_declare(
        &channel,
        &unique("secrets-refused"),
        table(&[("x-dead-letter-exchange", crate::common::dl::ls(locked))]),
    )
    .await
    .map(|_| ())
    .expect_err("no write permission on the dead-letter exchange");
    let text = amqp_text(&refused);
    assert!(
        text.starts_with("ACCESS_REFUSED") && text.contains(locked),
        "{text}"
    );
    let channel = connection.create_channel().await.expect("channel");
    publish(&channel, queue, &["secret-test"]).await;
    get_and_reject(&channel, queue, "secret-test").await;
    let landed = proxy_support::fleet::wait_count_at(
        &proxy_support::upstream_uri(),
        dlq,
        1,
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(landed, Ok(()), "the dead letter reached {dlq}");
    connection.close(200, "bye".into()).await.expect("close");
    vec![text]
}

/// PUT and DELETE a policy with `token` (204 each), once with `wrong_token` (401), and a read
/// without any token (200).
async fn admin_writes(admin: std::net::SocketAddr, token: &str, wrong_token: &str, queue: &str) {
    let path = "/api/policies/%2F/secrets-test";
    let body = format!(r#"{{"pattern": "^{queue}$", "definition": {{"max-length": 5}}}}"#);
    let (status, text) = admin_call(admin, "PUT", path, Some(&body), Some(token)).await;
    assert_eq!(status, 204, "{text}");
    let (status, text) = admin_call(admin, "GET", "/api/policies", None, None).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("secrets-test"), "{text}");
    let (status, _) = admin_call(admin, "DELETE", path, None, Some(wrong_token)).await;
    assert_eq!(status, 401);
    let (status, text) = admin_call(admin, "DELETE", path, None, Some(token)).await;
    assert_eq!(status, 204, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_mode_logs_no_secret_at_trace_level() {
    let dir = TempDir::new("dlx-proxy-secrets");
    let (amqp, admin) = free_addresses();
    let token = unique("admin-token");
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let plain_user = unique("plain-user");
    let plain_password = unique("plain-pw");
    let hashed_user = unique("hashed-user");
    let hashed_password = unique("hashed-pw");
    let hash = hash_password(rand_salt(), &hashed_password);
    let wrong_password = unique("wrong-pw");
    let wrong_token = unique("wrong-token");
    let permissions = "[[users.permissions]]\nvhost = \"/\"\n";
    let config = format!(
        "{}\n[log]\nfilter = \"trace\"\n\n[admin]\ntoken_file = {:?}\n\n\
         [[users]]\nname = \"{plain_user}\"\npassword = \"{plain_password}\"\n{permissions}\n\
         [[users]]\nname = \"{hashed_user}\"\npassword = \"\"\npassword_hash = \"{hash}\"\n\
         {permissions}",
        common::process_config(amqp, admin, 1),
        token_file.display().to_string(),
    );
    let path = dir.join("config.toml");
    write_atomically(&path, &config);
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    let queue = unique("secrets-q");
    let address = amqp.to_string();
    logins(
        &address,
        &plain_user,
        &plain_password,
        &wrong_password,
        &queue,
    )
    .await;
    logins(
        &address,
        &hashed_user,
        &hashed_password,
        &wrong_password,
        &queue,
    )
    .await;
    admin_writes(admin, &token, &wrong_token, &queue).await;

    let logs = stop_and_collect(process).await;
    // The user names show (the logins really happened and were logged), the secrets do not.
    assert!(logs.contains("connection open"), "{logs}");
    assert!(logs.contains(&plain_user), "{logs}");
    assert!(logs.contains("authentication failed"), "{logs}");
    assert!(logs.contains("admin API write refused"), "{logs}");
    assert_logs_hold_no_secret(
        &logs,
        &["AMQP listener (embedded broker)"],
        &[
            &plain_password,
            &hashed_password,
            &hash,
            &wrong_password,
            &token,
            &wrong_token,
        ],
    );
}

fn rand_salt() -> [u8; 4] {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    nanos.to_le_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_logs_no_secret_at_trace_level() {
    let user = unique("proxy-user");
    let password = unique("proxy-pw");
    let _rabbit_user = proxy_support::RabbitUser::create(&user, &password);
    let url_password = unique("url-pw");
    let token = unique("admin-token");
    let wrong_token = unique("wrong-token");
    let wrong_password = unique("wrong-pw");
    let capture = unique("secrets-capture");
    // The proxy's own service user, its password in a file (a mounted Secret).
    let service_user = unique("proxy-service");
    let service_password = unique("service-pw");
    let _service = proxy_support::RabbitUser::create(&service_user, &service_password);

    let dir = TempDir::new("dlx-proxy-secrets-proxy");
    let password_file = dir.join("service-password");
    write_atomically(&password_file, &format!("{service_password}\n"));
    let (amqp, admin) = free_addresses();
    let config = format!(
        "mode = \"proxy\"\n\n[listen]\namqp = \"{amqp}\"\nadmin = \"{admin}\"\n\n\
         [upstream]\nurl = \"amqp://url-user:{url_password}@{}/%2f\"\n\
         user = \"{service_user}\"\npassword_file = {password_file:?}\n\n\
         [proxy]\ncapture_name = \"{capture}\"\n\n[log]\nfilter = \"trace\"\n\n\
         [admin]\ntoken = \"{token}\"\n\n[shutdown]\ndrain_secs = 1\n",
        proxy_support::upstream_host()
    );
    let path = dir.join("config.toml");
    write_atomically(&path, &config);
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    let queue = unique("secrets-q");
    logins(&amqp.to_string(), &user, &password, &wrong_password, &queue).await;
    admin_writes(admin, &token, &wrong_token, &queue).await;
    // A restricted user, whose declare check and dead letter go through the service user.
    let restricted = unique("restricted-user");
    let restricted_password = unique("restricted-pw");
    let _restricted =
        proxy_support::RabbitUser::create_with(&restricted, &restricted_password, "^(?!t-locked-)");
    let locked = unique("locked-dlx");
    let dlq = unique("secrets-dlq");
    let source = unique("secrets-src");
    let upstream = proxy_support::upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    crate::common::dl::declare_dlx(&uch, &locked, &dlq).await;
    let through = login(&format!("amqp://{user}:{password}@{amqp}/%2f"))
        .await
        .expect("login");
    let ach = through.create_channel().await.unwrap();
    crate::common::dl::declare_dead_lettering(&ach, &source, &locked, &dlq).await;
    let replies = restricted_user_through_the_service(
        &amqp.to_string(),
        &restricted,
        &restricted_password,
        &source,
        &locked,
        &dlq,
    )
    .await;
    let _ = through.close(200, "bye".into()).await;
    proxy_support::delete_upstream(&uch, &[&source, &dlq], &[&locked]).await;
    let _ = upstream.close(200, "bye".into()).await;
    for reply in &replies {
        for secret in [&service_password, &password, &restricted_password] {
            assert!(!reply.contains(secret.as_str()), "{reply}");
        }
    }

    let logs = stop_and_collect(process).await;
    proxy_support::delete_capture(&capture).await;
    // The service connection logged in with the password from the file.
    assert!(logs.contains("capture consumer subscribed"), "{logs}");
    // The startup line shows the upstream with the password masked.
    assert!(
        logs.contains(&format!(
            "amqp://url-user:<redacted>@{}/%2f",
            proxy_support::upstream_host()
        )),
        "{logs}"
    );
    assert_logs_hold_no_secret(
        &logs,
        &["AMQP listener (proxy)", "published by the service user"],
        &[
            &password,
            &service_password,
            &restricted_password,
            &url_password,
            &wrong_password,
            &token,
            &wrong_token,
        ],
    );
}
