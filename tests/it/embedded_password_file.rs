//! A user whose password comes from `password_file` (a mounted Kubernetes Secret, as the
//! Helm chart's standalone install renders it), on the real binary: a client logs in with
//! the file's password (its trailing newline not part of it), a wrong password is refused
//! with 403 ACCESS_REFUSED, and a rotated file takes effect without a restart.

use crate::common;

use std::time::Duration;

use common::dl::amqp_code;
use common::{
    ServiceProcess, TempDir, free_addresses, process_config, unique, wait_until, write_atomically,
};
use lapin::{Connection, ConnectionProperties};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

async fn login(
    amqp: std::net::SocketAddr,
    user: &str,
    password: &str,
) -> Result<Connection, lapin::Error> {
    Connection::connect(
        &format!("amqp://{user}:{password}@{amqp}/%2f"),
        ConnectionProperties::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_logs_in_with_the_password_from_its_file() {
    let dir = TempDir::new("dlx-proxy-password-file");
    let (amqp, admin) = free_addresses();
    // The password lives in its own directory, as a mounted Secret does.
    let secret_dir = dir.join("secret");
    std::fs::create_dir(&secret_dir).unwrap();
    let password_file = secret_dir.join("password");
    let first = unique("first-password");
    write_atomically(&password_file, &format!("{first}\n"));
    let path = dir.join("config.toml");
    write_atomically(
        &path,
        &format!(
            "{}\n[[users]]\nname = \"app\"\npassword = \"\"\npassword_file = {:?}\n\
             loopback_only = false\n\n[[users.permissions]]\nvhost = \"/\"\n\
             configure = \".*\"\nwrite = \".*\"\nread = \".*\"\n",
            process_config(amqp, admin, 1),
            password_file.display().to_string()
        ),
    );
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    let connection = login(amqp, "app", &first)
        .await
        .expect("login with the file's password");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .queue_declare(
            unique("password-file").as_str().into(),
            Default::default(),
            Default::default(),
        )
        .await
        .expect("the user's permissions apply");
    connection.close(200, "bye".into()).await.expect("close");

    // No other password is accepted (a prefix of it, the default "guest").
    for wrong in [&first[..first.len() - 1], "guest"] {
        let error = login(amqp, "app", wrong).await.expect_err("wrong password");
        assert_eq!(amqp_code(&error), Some(403), "{error}");
    }
    // The file replaces the "guest" default: only the users listed exist.
    let error = login(amqp, "guest", "guest")
        .await
        .expect_err("no guest user");
    assert_eq!(amqp_code(&error), Some(403), "{error}");

    // A rotated Secret: the new password works and the old one no longer does.
    let second = unique("second-password");
    write_atomically(&password_file, &format!("{second}\n"));
    wait_until(
        "the new password is accepted",
        Duration::from_secs(10),
        async || login(amqp, "app", &second).await.is_ok(),
    )
    .await;
    let error = login(amqp, "app", &first).await.expect_err("old password");
    assert_eq!(amqp_code(&error), Some(403), "{}", process.logs());
    // Logged after the reload applies, through a pipe: waited for.
    wait_until(
        "the reload's log line",
        Duration::from_secs(5),
        async || process.logs().contains("configuration reloaded"),
    )
    .await;
    assert!(!process.logs().contains(&second), "{}", process.logs());
}
