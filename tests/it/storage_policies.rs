//! Runtime policies across restarts of the real binary: a policy set through the admin API
//! is in the definitions snapshot, so after a SIGKILL it is listed again and in force (on
//! restored queues and on queues declared afterwards); a cleared one does not come back.

use crate::common;

use std::time::Duration;

use common::dl::{FieldTable, confirm_select, declare_durable};
use common::{admin_call, http};

use crate::storage_restart::{Node, count, publish_numbered};

const TOKEN: &str = "storage-policy-test-token-0123456789";

async fn put_policy(node: &Node, name: &str, body: &str) {
    let path = format!("/api/policies/%2F/{name}");
    let (status, text) = admin_call(node.admin, "PUT", &path, Some(body), Some(TOKEN)).await;
    assert_eq!(status, 204, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_set_at_run_time_survive_a_sigkill() {
    let mut node = Node::start_with(
        "storage-policy",
        &format!("\n[admin]\ntoken = \"{TOKEN}\"\n"),
    )
    .await;
    put_policy(
        &node,
        "keep-policy",
        r#"{"pattern": "^pol", "definition": {"max-length": 2}}"#,
    )
    .await;
    put_policy(
        &node,
        "cleared-policy",
        r#"{"pattern": "^other$", "definition": {"max-length": 7}}"#,
    )
    .await;
    let (status, text) = admin_call(
        node.admin,
        "DELETE",
        "/api/policies/%2F/cleared-policy",
        None,
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 204, "{text}");
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    declare_durable(&ch, "pol", FieldTable::default()).await;
    publish_numbered(&ch, "pol", "p-", 5).await;
    assert_eq!(count(&ch, "pol").await, 2);
    drop(conn);
    // The snapshot is written by the storage thread without a waiter.
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.kill().await;
    node.up().await;

    let (status, listed) = http(node.admin, "GET", "/api/policies").await;
    assert_eq!(status, 200);
    assert!(listed.contains("keep-policy"), "{listed}");
    assert!(!listed.contains("cleared-policy"), "{listed}");
    let (_conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    // In force on the restored queue and on a queue declared now.
    assert_eq!(count(&ch, "pol").await, 2, "{}", node.logs());
    publish_numbered(&ch, "pol", "q-", 3).await;
    assert_eq!(count(&ch, "pol").await, 2);
    declare_durable(&ch, "pol-new", FieldTable::default()).await;
    publish_numbered(&ch, "pol-new", "n-", 4).await;
    assert_eq!(count(&ch, "pol-new").await, 2);
    assert!(
        node.logs()
            .contains("runtime policies restored from storage"),
        "{}",
        node.logs()
    );
}
