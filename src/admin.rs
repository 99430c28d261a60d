//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`, the runtime policy API, the
//! dead-letter queue inspection and redrive.
//!
//! Routes (axum):
//! - `GET /metrics`: every metric, Prometheus text format 0.0.4;
//! - `GET /healthz`: `200 ok` while the process runs;
//! - `GET /readyz`: `200 ready` once the service accepts clients, else `503 not ready`; in
//!   proxy mode also `503` while no upstream node is reachable;
//! - `GET /api/policies`: the runtime policies as JSON (RabbitMQ's HTTP API shape);
//! - `PUT /api/policies/{vhost}/{name}` with `{"pattern", "definition", "priority",
//!   "apply-to"}` sets a policy, `DELETE` clears it. The vhost is URL-encoded (`%2F` is `/`).
//!
//! - `GET /api/queues/{vhost}/{queue}/messages?limit=N`: a page of the queue's messages
//!   without consuming them ([`crate::dlq_view::MessagePage`]; `limit` 1..=1000, default 20);
//! - `GET /api/queues/{vhost}/{queue}/messages/summary`: counts by newest death reason and
//!   source queue ([`crate::dlq_view::Summary`]); both read through [`crate::dlq_inspect`].
//! - `POST /api/redrive` with a [`crate::redrive::jobs::RedriveRequest`] starts a redrive job
//!   (201 with its status; 409 while one runs on that queue), `GET /api/redrive` lists the
//!   jobs, `GET /api/redrive/{id}` is one job's status, `DELETE /api/redrive/{id}` (or `POST
//!   .../cancel`) cancels it, `POST /api/redrive/{id}/resume` starts a job for what it left
//!   ([`crate::redrive`]).
//!
//! Reads (`GET`, `HEAD`) are open, except message contents (`/api/queues/...`); every other
//! request, on every route present or future, passes the bearer-token guard of
//! [`crate::admin_auth`] first (401 without the admin token, 403 while none is configured).
//!
//! The policy store is behind the [`PolicyControl`] trait, implemented by the service for the
//! broker or the proxy. [`request`] is a tiny blocking HTTP client for the same API, used by
//! `dlx-proxy policy` ([`crate::policy_cli`]).

pub mod connections;

pub use crate::admin_auth::{AdminToken, Refusal};
use crate::config::{DEFAULT_APPLY_TO, PolicyConfig};
use crate::dlq_inspect::{InspectError, Inspector};
use crate::metrics::Metrics;
use crate::redrive::jobs::RedriveRequest;
use crate::redrive::{RedriveError, Redriver};
use crate::secret::Secret;
use crate::shutdown::Shutdown;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The runtime policy store the admin API edits.
pub trait PolicyControl: Send + Sync {
    /// Adds or replaces the policy (`cfg.vhost`, `cfg.name`); `Err` explains why it is invalid.
    fn set_policy(&self, cfg: PolicyConfig) -> Result<(), String>;
    /// Removes a policy; `false` if there was none.
    fn clear_policy(&self, vhost: &str, name: &str) -> bool;
    /// Every policy in force.
    fn list_policies(&self) -> Vec<PolicyConfig>;
}

/// Whether the service is ready for clients (shared between the service and `/readyz`): the
/// service's own switch (on once it accepts clients, off while draining) and, in proxy mode,
/// the upstream pool's reachability ([`crate::proxy::upstream::UpstreamPool`]) and the capture
/// consumers of `proxy.vhosts` ([`crate::proxy::service`]).
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<ReadinessState>);

#[derive(Debug, Default)]
struct ReadinessState {
    ready: AtomicBool,
    /// A condition that must also hold, set once: whether some upstream is reachable.
    upstream: OnceLock<Arc<AtomicBool>>,
    /// Another, set once: whether the capture consumers of `proxy.vhosts` run.
    capture: OnceLock<Arc<AtomicBool>>,
}

impl Readiness {
    /// Not ready.
    pub fn new() -> Readiness {
        Readiness::default()
    }

    pub fn set_ready(&self, ready: bool) {
        self.0.ready.store(ready, Ordering::Release);
    }

    /// From now on, ready also requires `reachable` to be true (the first call wins).
    pub fn require_upstream(&self, reachable: Arc<AtomicBool>) {
        let _ = self.0.upstream.set(reachable);
    }

    /// From now on, ready also requires `consuming` to be true (the first call wins).
    pub fn require_capture(&self, consuming: Arc<AtomicBool>) {
        let _ = self.0.capture.set(consuming);
    }

    pub fn is_ready(&self) -> bool {
        let holds = |condition: &OnceLock<Arc<AtomicBool>>| {
            condition
                .get()
                .is_none_or(|flag| flag.load(Ordering::Acquire))
        };
        self.0.ready.load(Ordering::Acquire) && holds(&self.0.upstream) && holds(&self.0.capture)
    }
}

/// What the admin handlers need.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub readiness: Readiness,
    pub policies: Arc<dyn PolicyControl>,
    pub token: AdminToken,
    /// Where queue inspections read messages.
    pub inspector: Inspector,
    /// The redrive jobs.
    pub redrive: Redriver,
}

/// Serves the admin API on `listener` until `shutdown` fires (connection limits and
/// timeouts: [`connections`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let metrics = state.metrics.clone();
    let limits = connections::ConnectionLimits::default();
    connections::serve(listener, router(state), metrics, limits, shutdown).await
}

/// The admin routes (exposed for tests and embedding).
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/api/policies", get(list_policies))
        .route(
            "/api/policies/{vhost}/{name}",
            get(get_policy).put(put_policy).delete(delete_policy),
        )
        .route("/api/queues/{vhost}/{queue}/messages", get(queue_messages))
        .route(
            "/api/queues/{vhost}/{queue}/messages/summary",
            get(queue_summary),
        )
        .route("/api/redrive", get(list_redrives).post(start_redrive))
        .route(
            "/api/redrive/{id}",
            get(redrive_status).delete(cancel_redrive),
        )
        .route("/api/redrive/{id}/cancel", post(cancel_redrive))
        .route("/api/redrive/{id}/resume", post(resume_redrive))
        .layer(middleware::from_fn_with_state(
            state.token.clone(),
            crate::admin_auth::guard_writes,
        ))
        .with_state(state)
}

/// The Prometheus text format's content type.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.encode(),
    )
        .into_response()
}

async fn readyz(State(state): State<AdminState>) -> Response {
    if state.readiness.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

/// A policy as `GET /api/policies` shows it (RabbitMQ's field names); also what
/// `dlx-proxy policy list` reads back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyView {
    pub vhost: String,
    pub name: String,
    pub pattern: String,
    #[serde(rename = "apply-to")]
    pub apply_to: String,
    pub priority: i32,
    pub definition: BTreeMap<String, serde_json::Value>,
}

impl From<PolicyConfig> for PolicyView {
    fn from(policy: PolicyConfig) -> Self {
        PolicyView {
            vhost: policy.vhost,
            name: policy.name,
            pattern: policy.pattern,
            apply_to: policy.apply_to,
            priority: policy.priority,
            definition: policy.definition,
        }
    }
}

async fn list_policies(State(state): State<AdminState>) -> Response {
    let policies: Vec<PolicyView> = state
        .policies
        .list_policies()
        .into_iter()
        .map(PolicyView::from)
        .collect();
    axum::Json(policies).into_response()
}

async fn get_policy(
    State(state): State<AdminState>,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    match state
        .policies
        .list_policies()
        .into_iter()
        .find(|p| p.vhost == vhost && p.name == name)
    {
        Some(policy) => axum::Json(PolicyView::from(policy)).into_response(),
        None => not_found(&vhost, &name),
    }
}

fn not_found(vhost: &str, name: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        format!("no policy {name:?} in vhost {vhost:?}"),
    )
        .into_response()
}

/// The body of `PUT /api/policies/{vhost}/{name}`. `apply-to` defaults to "queues" (as a
/// `[[policies]]` entry in TOML does, [`DEFAULT_APPLY_TO`]) and `priority` to 0; `priority`
/// may also be a numeric string.
#[derive(Debug, Deserialize)]
struct PolicyBody {
    pattern: String,
    definition: BTreeMap<String, serde_json::Value>,
    #[serde(default, deserialize_with = "number_or_numeric_string")]
    priority: i32,
    #[serde(rename = "apply-to", alias = "apply_to", default = "default_apply_to")]
    apply_to: String,
}

fn default_apply_to() -> String {
    DEFAULT_APPLY_TO.to_string()
}

fn number_or_numeric_string<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NumberOrString {
        Number(i32),
        String(String),
    }
    match NumberOrString::deserialize(deserializer)? {
        NumberOrString::Number(n) => Ok(n),
        NumberOrString::String(s) => s
            .trim()
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("priority {s:?} is not an integer"))),
    }
}

async fn put_policy(
    State(state): State<AdminState>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let body: PolicyBody = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid policy body: {error}"),
            )
                .into_response();
        }
    };
    let policy = PolicyConfig {
        name,
        vhost,
        pattern: body.pattern,
        apply_to: body.apply_to,
        priority: body.priority,
        definition: body.definition,
    };
    match state.policies.set_policy(policy) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(message) => (StatusCode::BAD_REQUEST, message).into_response(),
    }
}

async fn delete_policy(
    State(state): State<AdminState>,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    if state.policies.clear_policy(&vhost, &name) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        not_found(&vhost, &name)
    }
}

async fn queue_messages(
    State(state): State<AdminState>,
    Path((vhost, queue)): Path<(String, String)>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let limit = match crate::dlq_view::page_limit(query.get("limit").map(String::as_str)) {
        Ok(limit) => limit,
        Err(message) => return (StatusCode::BAD_REQUEST, message).into_response(),
    };
    match state.inspector.page(&vhost, &queue, limit).await {
        Ok(page) => axum::Json(page).into_response(),
        Err(error) => inspect_error(error),
    }
}

async fn queue_summary(
    State(state): State<AdminState>,
    Path((vhost, queue)): Path<(String, String)>,
) -> Response {
    match state.inspector.summary(&vhost, &queue).await {
        Ok(summary) => axum::Json(summary).into_response(),
        Err(error) => inspect_error(error),
    }
}

fn inspect_error(error: InspectError) -> Response {
    let status = match error {
        InspectError::NotFound(_) => StatusCode::NOT_FOUND,
        InspectError::Unavailable(_) => StatusCode::NOT_IMPLEMENTED,
        InspectError::Upstream(_) => StatusCode::BAD_GATEWAY,
    };
    (status, error.to_string()).into_response()
}

async fn list_redrives(State(state): State<AdminState>) -> Response {
    axum::Json(state.redrive.list()).into_response()
}

async fn start_redrive(State(state): State<AdminState>, body: Bytes) -> Response {
    let request: RedriveRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid redrive request: {error}"),
            )
                .into_response();
        }
    };
    match state.redrive.start(request).await {
        Ok(status) => (StatusCode::CREATED, axum::Json(status)).into_response(),
        Err(error) => redrive_error(error),
    }
}

async fn redrive_status(State(state): State<AdminState>, Path(id): Path<u64>) -> Response {
    match state.redrive.status(id) {
        Some(status) => axum::Json(status).into_response(),
        None => redrive_error(RedriveError::NotFound(format!("no redrive job {id}"))),
    }
}

async fn cancel_redrive(State(state): State<AdminState>, Path(id): Path<u64>) -> Response {
    match state.redrive.cancel(id) {
        Some(status) => (StatusCode::ACCEPTED, axum::Json(status)).into_response(),
        None => redrive_error(RedriveError::NotFound(format!("no redrive job {id}"))),
    }
}

async fn resume_redrive(State(state): State<AdminState>, Path(id): Path<u64>) -> Response {
    match state.redrive.resume(id).await {
        Ok(status) => (StatusCode::CREATED, axum::Json(status)).into_response(),
        Err(error) => redrive_error(error),
    }
}

fn redrive_error(error: RedriveError) -> Response {
    let status = match error {
        RedriveError::BadRequest(_) => StatusCode::BAD_REQUEST,
        RedriveError::NotFound(_) => StatusCode::NOT_FOUND,
        RedriveError::Conflict(_) => StatusCode::CONFLICT,
        RedriveError::Full(_) => StatusCode::SERVICE_UNAVAILABLE,
        RedriveError::Unavailable(_) => StatusCode::NOT_IMPLEMENTED,
        RedriveError::Upstream(_) => StatusCode::BAD_GATEWAY,
    };
    (status, error.to_string()).into_response()
}

// ------------------------------------------------------------------------------------------
// A minimal blocking client for the admin API
// ------------------------------------------------------------------------------------------

/// Percent-encodes one URL path segment (everything but RFC 3986 unreserved characters).
pub fn encode_path_segment(segment: &str) -> String {
    let mut encoded = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// Sends one HTTP/1.1 request to the admin server at `address` (`host:port`) and returns the
/// status code and body. `body` is sent as JSON. Blocking; for the command line and tests.
pub fn request(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    request_with_token(address, method, path, body, None, timeout)
}

/// [`request`] with `Authorization: Bearer <token>` when a token is given (writes).
pub fn request_with_token(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&Secret<String>>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let authorization = token.map(|token| Secret::new(format!("Bearer {}", token.expose())));
    request_authorized(address, method, path, body, authorization.as_ref(), timeout)
}

/// [`request`] with `authorization` as the whole `Authorization` header value (`Bearer ...`,
/// `Basic ...`); tests also use it on RabbitMQ's management API.
pub fn request_authorized(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    authorization: Option<&Secret<String>>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    use std::io::{Error, ErrorKind};
    use std::net::ToSocketAddrs;
    let socket_address = address
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| Error::new(ErrorKind::InvalidInput, format!("cannot resolve {address}")))?;
    let mut stream = std::net::TcpStream::connect_timeout(&socket_address, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = body.unwrap_or("");
    let authorization = match authorization {
        Some(value) => format!("Authorization: {}\r\n", value.expose()),
        None => String::new(),
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         {authorization}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    parse_response(&response)
        .ok_or_else(|| Error::new(ErrorKind::InvalidData, "malformed HTTP response"))
}

/// Status and body of a `Connection: close` HTTP/1.1 response (plain or chunked body).
fn parse_response(response: &[u8]) -> Option<(u16, String)> {
    let header_end = response.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&response[..header_end]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let raw_body = &response[header_end + 4..];
    let chunked = head.lines().any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    let body = if chunked {
        dechunk(raw_body)?
    } else {
        raw_body.to_vec()
    };
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&data[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests;
