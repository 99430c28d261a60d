//! Unit tests of [`crate::admin`].

use super::*;
use crate::shutdown::ShutdownTrigger;
use std::sync::Mutex;

/// An in-memory policy store that refuses definitions containing "bad".
#[derive(Default)]
struct MemoryPolicies(Mutex<Vec<PolicyConfig>>);

impl PolicyControl for MemoryPolicies {
    fn set_policy(&self, cfg: PolicyConfig) -> Result<(), String> {
        if cfg.definition.contains_key("bad") {
            return Err("unknown policy key \"bad\"".into());
        }
        let mut policies = self.0.lock().unwrap();
        policies.retain(|p| !(p.vhost == cfg.vhost && p.name == cfg.name));
        policies.push(cfg);
        Ok(())
    }

    fn clear_policy(&self, vhost: &str, name: &str) -> bool {
        let mut policies = self.0.lock().unwrap();
        let before = policies.len();
        policies.retain(|p| !(p.vhost == vhost && p.name == name));
        policies.len() != before
    }

    fn list_policies(&self) -> Vec<PolicyConfig> {
        self.0.lock().unwrap().clone()
    }
}

struct Server {
    address: String,
    state: AdminState,
    trigger: ShutdownTrigger,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// The admin token of the test servers.
const TOKEN: &str = "t0ken-for-tests";

async fn start() -> Server {
    start_with_token(Some(TOKEN)).await
}

async fn start_with_token(token: Option<&str>) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let state = AdminState {
        metrics: Metrics::new(10),
        readiness: Readiness::new(),
        policies: Arc::new(MemoryPolicies::default()),
        token: AdminToken::new(token.map(Secret::from)),
        inspector: Inspector::Unavailable,
        redrive: crate::redrive::Redriver::new(
            crate::redrive::Backend::Unavailable,
            Metrics::new(10),
        ),
    };
    let trigger = ShutdownTrigger::new();
    let task = tokio::spawn(serve(listener, state.clone(), trigger.subscribe()));
    Server {
        address,
        state,
        trigger,
        task,
    }
}

/// Runs the blocking client off the runtime's worker, with the test token.
async fn call(server: &Server, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    call_as(server, Some(TOKEN), method, path, body).await
}

async fn call_as(
    server: &Server,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    let (address, method, path) = (server.address.clone(), method.to_string(), path.to_string());
    let body = body.map(str::to_string);
    let token = token.map(Secret::from);
    tokio::task::spawn_blocking(move || {
        request_with_token(
            &address,
            &method,
            &path,
            body.as_deref(),
            token.as_ref(),
            Duration::from_secs(5),
        )
    })
    .await
    .unwrap()
    .unwrap()
}

/// The raw response head, to check headers.
async fn raw_get(server: &Server, path: &str) -> String {
    raw_request(server, &format!("GET {path} HTTP/1.1\r\n")).await
}

/// Sends `head` (request line and any headers) and returns the whole raw response.
async fn raw_request(server: &Server, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(&server.address)
        .await
        .unwrap();
    let request = format!("{head}Host: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

#[test]
fn readiness_needs_the_switch_and_a_reachable_upstream() {
    let readiness = Readiness::new();
    assert!(!readiness.is_ready());
    readiness.set_ready(true);
    assert!(readiness.is_ready(), "embedded mode: the switch alone");
    let reachable = Arc::new(AtomicBool::new(false));
    readiness.require_upstream(reachable.clone());
    assert!(!readiness.is_ready(), "no upstream reachable");
    reachable.store(true, Ordering::Release);
    assert!(readiness.is_ready());
    readiness.set_ready(false);
    assert!(
        !readiness.is_ready(),
        "draining wins over a reachable upstream"
    );
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let server = start().await;
    assert_eq!(
        call(&server, "GET", "/healthz", None).await,
        (200, "ok".into())
    );
    assert_eq!(
        call(&server, "GET", "/readyz", None).await,
        (503, "not ready".into())
    );
    server.state.readiness.set_ready(true);
    assert_eq!(
        call(&server, "GET", "/readyz", None).await,
        (200, "ready".into())
    );

    server.state.metrics.dead_lettered("/", "q", "expired");
    let response = raw_get(&server, "/metrics").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        response
            .to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{response}"
    );
    assert!(
        response
            .contains(r#"dlx_proxy_dead_lettered_total{queue="q",reason="expired",vhost="/"} 1"#),
        "{response}"
    );
    assert_eq!(call(&server, "GET", "/nope", None).await.0, 404);
}

#[tokio::test]
async fn policies_can_be_set_listed_and_cleared() {
    let server = start().await;
    let body = r#"{"pattern": "^src$", "definition": {"dead-letter-exchange": "dlx",
                  "message-ttl": 100}, "priority": 100, "apply-to": "queues"}"#;
    let path = format!("/api/policies/{}/dlx", encode_path_segment("/"));
    assert_eq!(path, "/api/policies/%2F/dlx");
    assert_eq!(call(&server, "PUT", &path, Some(body)).await.0, 204);

    let stored = server.state.policies.list_policies();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].vhost, "/");
    assert_eq!(stored[0].name, "dlx");
    assert_eq!(stored[0].pattern, "^src$");
    assert_eq!(stored[0].apply_to, "queues");
    assert_eq!(stored[0].priority, 100);
    assert_eq!(stored[0].definition["message-ttl"], 100);

    let (status, listed) = call(&server, "GET", "/api/policies", None).await;
    assert_eq!(status, 200);
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed[0]["vhost"], "/");
    assert_eq!(listed[0]["apply-to"], "queues");
    assert_eq!(listed[0]["definition"]["dead-letter-exchange"], "dlx");
    assert_eq!(call(&server, "GET", &path, None).await.0, 200);

    assert_eq!(call(&server, "DELETE", &path, None).await.0, 204);
    assert!(server.state.policies.list_policies().is_empty());
    assert_eq!(call(&server, "DELETE", &path, None).await.0, 404);
}

#[tokio::test]
async fn defaults_and_lenient_priority() {
    let server = start().await;
    let body = r#"{"pattern": ".*", "definition": {"max-length": 1}, "priority": "7"}"#;
    assert_eq!(
        call(&server, "PUT", "/api/policies/v%201/p", Some(body))
            .await
            .0,
        204
    );
    let stored = server.state.policies.list_policies();
    assert_eq!(
        (
            stored[0].vhost.as_str(),
            stored[0].apply_to.as_str(),
            stored[0].priority
        ),
        ("v 1", "queues", 7)
    );
}

#[tokio::test]
async fn bad_requests_get_400_with_the_reason() {
    let server = start().await;
    let path = "/api/policies/%2F/p";
    let (status, text) = call(&server, "PUT", path, Some("{not json")).await;
    assert_eq!(status, 400);
    assert!(text.contains("invalid policy body"), "{text}");
    let (status, text) = call(&server, "PUT", path, Some(r#"{"definition": {}}"#)).await;
    assert_eq!(status, 400);
    assert!(text.contains("pattern"), "{text}");
    let body = r#"{"pattern": ".*", "definition": {"bad": 1}}"#;
    assert_eq!(
        call(&server, "PUT", path, Some(body)).await,
        (400, "unknown policy key \"bad\"".into())
    );
}

#[tokio::test]
async fn serve_returns_after_shutdown() {
    let server = start().await;
    assert_eq!(call(&server, "GET", "/healthz", None).await.0, 200);
    server.trigger.trigger();
    tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

const POLICY: &str = r#"{"pattern": ".*", "definition": {"max-length": 1}}"#;

#[tokio::test]
async fn queue_inspection_needs_the_token_and_names_the_missing_setting() {
    let server = start().await;
    let path = "/api/queues/%2F/dlq/messages";
    for path in [path.to_string(), format!("{path}/summary")] {
        assert_eq!(call_as(&server, None, "GET", &path, None).await.0, 401);
        let (status, text) = call(&server, "GET", &path, None).await;
        assert_eq!(status, 501, "{text}");
        assert!(text.contains("set upstream.management_url"), "{text}");
    }
    let (status, text) = call(&server, "GET", &format!("{path}?limit=0"), None).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("from 1 to 1000"), "{text}");
}

#[tokio::test]
async fn writes_need_the_bearer_token_and_reads_do_not() {
    let server = start().await;
    let path = "/api/policies/%2F/p";
    // No header: 401 with the challenge, nothing stored.
    let response = raw_request(&server, &format!("PUT {path} HTTP/1.1\r\n")).await;
    assert!(response.starts_with("HTTP/1.1 401"), "{response}");
    assert!(
        response
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer realm=\"dlx-proxy\"\r\n"),
        "{response}"
    );
    assert_eq!(
        call_as(&server, None, "PUT", path, Some(POLICY)).await.0,
        401
    );
    // A wrong token, or a prefix of the right one: 401 invalid_token.
    for wrong in ["t0ken-for-test", "t0ken-for-tests2", "nope"] {
        let (status, text) = call_as(&server, Some(wrong), "PUT", path, Some(POLICY)).await;
        assert_eq!(
            (status, text.as_str()),
            (401, "the bearer token is not the admin token")
        );
    }
    let response = raw_request(
        &server,
        &format!("DELETE {path} HTTP/1.1\r\nAuthorization: Bearer nope\r\n"),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 401"), "{response}");
    assert!(response.contains("error=\"invalid_token\""), "{response}");
    // Another scheme is no bearer token.
    let response = raw_request(
        &server,
        &format!("DELETE {path} HTTP/1.1\r\nAuthorization: Basic {TOKEN}\r\n"),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 401"), "{response}");
    assert!(server.state.policies.list_policies().is_empty());

    // The right token, the scheme in any case.
    let response = raw_request(
        &server,
        &format!("DELETE {path} HTTP/1.1\r\nAuthorization: bEaReR {TOKEN}\r\n"),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    assert_eq!(call(&server, "PUT", path, Some(POLICY)).await.0, 204);
    assert_eq!(server.state.policies.list_policies().len(), 1);

    // Reads stay open.
    assert_eq!(
        call_as(&server, None, "GET", "/api/policies", None).await.0,
        200
    );
    assert_eq!(call_as(&server, None, "GET", path, None).await.0, 200);
    assert_eq!(call_as(&server, None, "GET", "/metrics", None).await.0, 200);
    assert_eq!(call_as(&server, None, "GET", "/healthz", None).await.0, 200);
    // Any other method on any path is a write.
    assert_eq!(
        call_as(&server, None, "POST", "/api/anything", None)
            .await
            .0,
        401
    );
}

#[tokio::test]
async fn writes_are_disabled_without_a_token_and_follow_a_new_token() {
    let server = start_with_token(None).await;
    let path = "/api/policies/%2F/p";
    let (status, text) = call_as(&server, None, "PUT", path, Some(POLICY)).await;
    assert_eq!(status, 403);
    assert!(text.contains("admin.token"), "{text}");
    assert_eq!(
        call_as(&server, Some("x"), "DELETE", path, None).await.0,
        403
    );
    assert_eq!(
        call_as(&server, None, "GET", "/api/policies", None).await.0,
        200
    );

    // A reload sets a token, then changes it.
    server.state.token.set(Some(Secret::from("first")));
    assert_eq!(
        call_as(&server, Some("first"), "PUT", path, Some(POLICY))
            .await
            .0,
        204
    );
    server.state.token.set(Some(Secret::from("second")));
    assert_eq!(
        call_as(&server, Some("first"), "DELETE", path, None)
            .await
            .0,
        401
    );
    assert_eq!(
        call_as(&server, Some("second"), "DELETE", path, None)
            .await
            .0,
        204
    );
}

#[test]
fn chunked_responses_are_decoded() {
    let response =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    assert_eq!(parse_response(response), Some((200, "abcde".to_string())));
    assert_eq!(parse_response(b"garbage"), None);
}

#[tokio::test]
async fn redrive_routes_are_writes_and_name_what_is_wrong() {
    let server = start().await;
    let body = r#"{"from": "dlq"}"#;
    assert_eq!(
        call_as(&server, None, "POST", "/api/redrive", Some(body))
            .await
            .0,
        401
    );
    assert_eq!(
        call_as(&server, None, "DELETE", "/api/redrive/1", None)
            .await
            .0,
        401
    );
    let (status, text) = call(&server, "POST", "/api/redrive", Some(r#"{"to": "x"}"#)).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("missing field `from`"), "{text}");
    let (status, text) = call(&server, "POST", "/api/redrive", Some(body)).await;
    assert_eq!(status, 501, "{text}");
    assert!(
        text.contains("needs the proxy's own login") && text.contains("upstream.user"),
        "{text}"
    );
    assert_eq!(
        call(&server, "GET", "/api/redrive/9", None).await,
        (404, "no redrive job 9".into())
    );
    assert_eq!(call(&server, "DELETE", "/api/redrive/9", None).await.0, 404);
    assert_eq!(
        call(&server, "POST", "/api/redrive/9/resume", None).await.0,
        404
    );
    assert_eq!(
        call(&server, "GET", "/api/redrive", None).await,
        (200, "[]".into())
    );
}
