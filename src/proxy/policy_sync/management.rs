//! A small client of RabbitMQ's management HTTP API: the few calls the policy sync makes
//! (list, set and delete the policies of a vhost; whether an exchange exists) and the
//! dead-letter queue inspection ([`crate::dlq_inspect`]: get messages, requeued), with the
//! proxy's service identity as basic authentication.
//!
//! HTTP/1.1 with hyper's own client connection (`hyper::client::conn::http1`) over a tokio
//! socket: hyper already serves the admin API (through axum), a sync round is a handful of
//! requests to one address, so one kept-alive connection per round needs no pool. Plain
//! `http://` only. Every request has a deadline and every response body a size limit; the
//! password appears only in the `Authorization` header, never in an error or a log line.

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::Value;

use super::plan::UpstreamPolicy;
use crate::secret::Secret;

/// Largest response body read (a policy listing of a vhost).
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// Where the management API listens: `http://host[:port][/prefix]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagementEndpoint {
    /// Host name or address, without IPv6 brackets: what the socket connects to.
    pub host: String,
    pub port: u16,
    /// The `Host` header: the URL's authority.
    pub authority: String,
    /// Path before `/api` (empty, or `/prefix` behind a reverse proxy), no trailing `/`.
    pub prefix: String,
}

impl ManagementEndpoint {
    /// Reads `upstream.management_url`; `Err` says what is wrong with it.
    pub fn parse(url: &str) -> Result<ManagementEndpoint, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("invalid URL {url:?}: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                    "{other}:// is not supported: give the http:// address of the management \
                     API (e.g. http://rabbitmq:15672)"
                ));
            }
            None => return Err(format!("{url:?} is not an http:// URL")),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{url:?} names no host"))?;
        if authority.as_str().contains('@') {
            return Err("credentials do not go in the URL: set upstream.user and \
                        upstream.password"
                .into());
        }
        if uri.query().is_some() {
            return Err("a query string is not allowed".into());
        }
        let host = authority.host();
        if host.is_empty() {
            return Err(format!("{url:?} names no host"));
        }
        Ok(ManagementEndpoint {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port: authority.port_u16().unwrap_or(80),
            authority: authority.as_str().to_string(),
            prefix: uri.path().trim_end_matches('/').to_string(),
        })
    }
}

/// Why a management call failed (never shows the credentials).
#[derive(Debug, thiserror::Error)]
pub enum ManagementError {
    #[error("cannot connect to the management API at {address}: {source}")]
    Connect {
        address: String,
        source: std::io::Error,
    },
    #[error("management API: {0}")]
    Http(#[from] hyper::Error),
    #[error("management API did not answer within {0:?}")]
    Timeout(Duration),
    #[error("{method} {path}: {status} {body}")]
    Status {
        method: Method,
        path: String,
        status: StatusCode,
        /// The start of RabbitMQ's explanation.
        body: String,
    },
    #[error("{path}: unreadable response: {reason}")]
    Body { path: String, reason: String },
}

impl ManagementError {
    /// An answer with an unexpected status: the connection can still be used.
    pub fn is_status(&self) -> bool {
        matches!(self, ManagementError::Status { .. })
    }

    /// A 404 (the vhost or the object does not exist upstream).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ManagementError::Status { status, .. } if *status == StatusCode::NOT_FOUND)
    }
}

/// The management API with the proxy's credentials.
#[derive(Clone)]
pub struct ManagementClient {
    endpoint: ManagementEndpoint,
    /// `Basic base64(user:password)`.
    authorization: Secret<String>,
    timeout: Duration,
}

impl std::fmt::Debug for ManagementClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagementClient")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl ManagementClient {
    /// `timeout` bounds the connect and each request.
    pub fn new(
        endpoint: ManagementEndpoint,
        user: &str,
        password: &Secret<String>,
        timeout: Duration,
    ) -> ManagementClient {
        let token = base64::engine::general_purpose::STANDARD
            .encode(format!("{user}:{}", password.expose()));
        ManagementClient {
            endpoint,
            authorization: Secret::new(format!("Basic {token}")),
            timeout,
        }
    }

    /// One connection for the calls of a sync round.
    pub async fn session(&self) -> Result<ManagementSession, ManagementError> {
        let address = format!("{}:{}", self.endpoint.host, self.endpoint.port);
        let connect =
            tokio::net::TcpStream::connect((self.endpoint.host.as_str(), self.endpoint.port));
        let stream = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| ManagementError::Timeout(self.timeout))?
            .map_err(|source| ManagementError::Connect { address, source })?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // Drives the socket; ends when the session's sender is dropped.
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%err, "management API connection ended");
            }
        });
        Ok(ManagementSession {
            client: self.clone(),
            sender,
        })
    }
}

/// What [`lookup_queue_arguments`] answers: the queue's arguments, `None` when it does not
/// exist, or why the API could not say.
pub type ArgumentsListing = Result<Option<serde_json::Map<String, Value>>, String>;

/// Asks the management API for the arguments of queue `name` in `vhost` on a task of its own
/// (one connection, the client's timeouts); the answer comes on the returned receiver.
pub fn lookup_queue_arguments(
    client: &ManagementClient,
    vhost: &str,
    name: &str,
) -> tokio::sync::oneshot::Receiver<ArgumentsListing> {
    let (answer, receiver) = tokio::sync::oneshot::channel();
    let (client, vhost, name) = (client.clone(), vhost.to_string(), name.to_string());
    tokio::spawn(async move {
        let listing = async {
            let mut session = client.session().await?;
            session.queue_arguments(&vhost, &name).await
        }
        .await;
        let _ = answer.send(listing.map_err(|e| e.to_string()));
    });
    receiver
}

/// A connection to the management API, used for one round of calls.
pub struct ManagementSession {
    client: ManagementClient,
    sender: SendRequest<Full<Bytes>>,
}

fn segment(text: &str) -> String {
    utf8_percent_encode(text, NON_ALPHANUMERIC).to_string()
}

impl ManagementSession {
    /// Every policy of `vhost` (the user's too), as listed.
    pub async fn policies(&mut self, vhost: &str) -> Result<Vec<Value>, ManagementError> {
        let path = format!("/api/policies/{}", segment(vhost));
        let body = self
            .call(Method::GET, &path, None, &[StatusCode::OK])
            .await?;
        let listing: Vec<Value> =
            serde_json::from_slice(&body).map_err(|e| ManagementError::Body {
                path,
                reason: e.to_string(),
            })?;
        Ok(listing)
    }

    /// Creates or replaces `policy` in `vhost`.
    pub async fn put_policy(
        &mut self,
        vhost: &str,
        policy: &UpstreamPolicy,
    ) -> Result<(), ManagementError> {
        let path = format!("/api/policies/{}/{}", segment(vhost), segment(&policy.name));
        let ok = [StatusCode::CREATED, StatusCode::NO_CONTENT, StatusCode::OK];
        self.call(Method::PUT, &path, Some(policy.body()), &ok)
            .await
            .map(drop)
    }

    /// Deletes the policy `name` of `vhost` (already gone is fine).
    pub async fn delete_policy(&mut self, vhost: &str, name: &str) -> Result<(), ManagementError> {
        let path = format!("/api/policies/{}/{}", segment(vhost), segment(name));
        let ok = [
            StatusCode::NO_CONTENT,
            StatusCode::OK,
            StatusCode::NOT_FOUND,
        ];
        self.call(Method::DELETE, &path, None, &ok).await.map(drop)
    }

    /// Whether the exchange `name` exists in `vhost`.
    pub async fn exchange_exists(
        &mut self,
        vhost: &str,
        name: &str,
    ) -> Result<bool, ManagementError> {
        let path = format!("/api/exchanges/{}/{}", segment(vhost), segment(name));
        match self.call(Method::GET, &path, None, &[StatusCode::OK]).await {
            Ok(_) => Ok(true),
            Err(err) if err.is_not_found() => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// The arguments of queue `name` in `vhost` as `GET /api/queues/{vhost}/{name}` lists
    /// them (`None`: no such queue).
    pub async fn queue_arguments(
        &mut self,
        vhost: &str,
        name: &str,
    ) -> Result<Option<serde_json::Map<String, Value>>, ManagementError> {
        let path = format!("/api/queues/{}/{}", segment(vhost), segment(name));
        let answer = match self.call(Method::GET, &path, None, &[StatusCode::OK]).await {
            Ok(answer) => answer,
            Err(err) if err.is_not_found() => return Ok(None),
            Err(err) => return Err(err),
        };
        let queue: Value = serde_json::from_slice(&answer).map_err(|e| ManagementError::Body {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        match queue.get("arguments") {
            Some(Value::Object(arguments)) => Ok(Some(arguments.clone())),
            _ => Err(ManagementError::Body {
                path,
                reason: "no arguments object".into(),
            }),
        }
    }

    /// Up to `count` messages of queue `name` in `vhost` through `POST
    /// /api/queues/{vhost}/{name}/get` with `ackmode=reject_requeue_true`: they are returned
    /// to the queue, redelivered (what the management UI's "Get messages" does). Payloads are
    /// cut at `truncate` bytes.
    pub async fn get_messages(
        &mut self,
        vhost: &str,
        name: &str,
        count: usize,
        truncate: usize,
    ) -> Result<Vec<Value>, ManagementError> {
        let path = format!("/api/queues/{}/{}/get", segment(vhost), segment(name));
        let body = serde_json::json!({
            "count": count,
            "ackmode": "reject_requeue_true",
            "encoding": "auto",
            "truncate": truncate,
        });
        let answer = self
            .call(Method::POST, &path, Some(body), &[StatusCode::OK])
            .await?;
        serde_json::from_slice(&answer).map_err(|e| ManagementError::Body {
            path,
            reason: e.to_string(),
        })
    }

    /// One request; `Err` for a status not in `ok`.
    async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Value>,
        ok: &[StatusCode],
    ) -> Result<Bytes, ManagementError> {
        let timeout = self.client.timeout;
        tokio::time::timeout(timeout, self.round_trip(method, path, body, ok))
            .await
            .map_err(|_| ManagementError::Timeout(timeout))?
    }

    async fn round_trip(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Value>,
        ok: &[StatusCode],
    ) -> Result<Bytes, ManagementError> {
        let endpoint = &self.client.endpoint;
        let content = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut request = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", endpoint.prefix))
            .header(hyper::header::HOST, &endpoint.authority)
            .header(
                hyper::header::AUTHORIZATION,
                self.client.authorization.expose().as_str(),
            )
            .header(hyper::header::ACCEPT, "application/json");
        if !content.is_empty() {
            request = request.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(content))
            .map_err(|e| ManagementError::Body {
                path: path.to_string(),
                reason: e.to_string(),
            })?;
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| ManagementError::Body {
                path: path.to_string(),
                reason: e.to_string(),
            })?
            .to_bytes();
        if !ok.contains(&status) {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            return Err(ManagementError::Status {
                method,
                path: path.to_string(),
                status,
                body: text,
            });
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_urls_without_credentials() {
        assert_eq!(
            ManagementEndpoint::parse("http://rabbit:15672"),
            Ok(ManagementEndpoint {
                host: "rabbit".into(),
                port: 15672,
                authority: "rabbit:15672".into(),
                prefix: String::new(),
            })
        );
        let behind = ManagementEndpoint::parse("http://[::1]/rabbitmq/").unwrap();
        assert_eq!(
            (behind.host.as_str(), behind.port, behind.prefix.as_str()),
            ("::1", 80, "/rabbitmq")
        );
        for (url, words) in [
            ("https://rabbit:15671", "https:// is not supported"),
            ("rabbit:15672", "not an http:// URL"),
            ("http://u:secret@rabbit:15672", "set upstream.user"),
            ("http://rabbit:15672/?x=1", "query string"),
            ("http://", "invalid URL"),
        ] {
            let error = ManagementEndpoint::parse(url).unwrap_err();
            assert!(error.contains(words), "{url}: {error}");
            assert!(!error.contains("secret"), "{url}: {error}");
        }
    }

    #[test]
    fn the_client_shows_no_password() {
        let client = ManagementClient::new(
            ManagementEndpoint::parse("http://rabbit:15672").unwrap(),
            "proxy",
            &Secret::from("pw-secret"),
            Duration::from_secs(1),
        );
        let shown = format!("{client:?}");
        assert!(
            !shown.contains("pw-secret") && !shown.contains("cHJveHk6"),
            "{shown}"
        );
        assert_eq!(
            client.authorization.expose(),
            &format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode("proxy:pw-secret")
            )
        );
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(segment("/"), "%2F");
        assert_eq!(segment("dlx-proxy.a b"), "dlx%2Dproxy%2Ea%20b");
    }
}
