//! The admin API's bearer token on the real binary: writes are refused (403) while no token is
//! configured, and a token read from `admin.token_file` follows the file when it is rotated
//! (a Kubernetes Secret update), without a restart.

use crate::common;

use std::time::Duration;

use common::{
    ServiceProcess, TempDir, admin_call, free_addresses, process_config, unique, wait_until,
    write_atomically,
};

const BINARY: &str = env!("CARGO_BIN_EXE_dlx-proxy");

const PATH: &str = "/api/policies/%2F/token-test";
const POLICY: &str = r#"{"pattern": "^token-test$", "definition": {"max-length": 1}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_writes_are_refused_and_reads_are_open() {
    let dir = TempDir::new("dlx-proxy-admin-none");
    let (amqp, admin) = free_addresses();
    let path = dir.join("config.toml");
    write_atomically(&path, &process_config(amqp, admin, 1));
    let _process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    for token in [None, Some("anything")] {
        let (status, text) = admin_call(admin, "PUT", PATH, Some(POLICY), token).await;
        assert_eq!(status, 403, "{text}");
        assert!(text.contains("admin.token"), "{text}");
        assert_eq!(admin_call(admin, "DELETE", PATH, None, token).await.0, 403);
    }
    let (status, text) = admin_call(admin, "GET", "/api/policies", None, None).await;
    assert_eq!((status, text.as_str()), (200, "[]"));
    assert_eq!(
        admin_call(admin, "GET", "/metrics", None, None).await.0,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_token_file_takes_effect_without_a_restart() {
    let dir = TempDir::new("dlx-proxy-admin-rotate");
    let (amqp, admin) = free_addresses();
    // The token lives in its own directory, as a mounted Secret does.
    let secret_dir = dir.join("secret");
    std::fs::create_dir(&secret_dir).unwrap();
    let token_file = secret_dir.join("token");
    let first = unique("first-token");
    write_atomically(&token_file, &format!("{first}\n"));
    let path = dir.join("config.toml");
    write_atomically(
        &path,
        &format!(
            "{}\n[admin]\ntoken_file = {:?}\n",
            process_config(amqp, admin, 1),
            token_file.display().to_string()
        ),
    );
    let process = ServiceProcess::start(BINARY, dir.path(), &path, amqp, admin).await;

    assert_eq!(
        admin_call(admin, "PUT", PATH, Some(POLICY), None).await.0,
        401
    );
    let (status, text) = admin_call(admin, "PUT", PATH, Some(POLICY), Some(&first)).await;
    assert_eq!(status, 204, "{text}");

    let second = unique("second-token");
    write_atomically(&token_file, &format!("{second}\n"));
    wait_until(
        "the new token is accepted",
        Duration::from_secs(10),
        async || {
            admin_call(admin, "PUT", PATH, Some(POLICY), Some(&second))
                .await
                .0
                == 204
        },
    )
    .await;
    assert_eq!(
        admin_call(admin, "DELETE", PATH, None, Some(&first))
            .await
            .0,
        401,
        "{}",
        process.logs()
    );
    assert_eq!(
        admin_call(admin, "DELETE", PATH, None, Some(&second))
            .await
            .0,
        204
    );
    // Logged after the reload applies, through a pipe: waited for.
    wait_until(
        "the reload's log line",
        Duration::from_secs(5),
        async || process.logs().contains("configuration reloaded"),
    )
    .await;
}
