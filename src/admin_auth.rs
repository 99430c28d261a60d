//! The admin API's write guard: which requests need the bearer token, and the check itself.
//!
//! Reads (`GET`, `HEAD`) pass, except those of message contents (`/api/queues/...`: a
//! dead-letter queue's messages, [`needs_token`]). Every other request goes through
//! [`guard_writes`], one axum
//! middleware the admin router applies to all its routes (so an endpoint added later is
//! guarded without doing anything): it wants `Authorization: Bearer <token>` with the token
//! of `admin.token` / `admin.token_file`. Without the header, or with another token, the
//! answer is 401 with `WWW-Authenticate: Bearer`; while no token is configured, writes are
//! disabled (403). The token is compared in constant time ([`Secret::matches`]); the service
//! replaces it on reload ([`AdminToken::set`]). [`authorize`] is the pure check.

use crate::secret::Secret;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, RwLock};

/// The bearer token write requests must carry (none: writes are disabled). Shared between
/// the service, which replaces it on reload, and the admin server.
#[derive(Clone, Debug, Default)]
pub struct AdminToken(Arc<RwLock<Option<Secret<String>>>>);

impl AdminToken {
    pub fn new(token: Option<Secret<String>>) -> AdminToken {
        AdminToken(Arc::new(RwLock::new(token)))
    }

    /// Replaces the token (a reload).
    pub fn set(&self, token: Option<Secret<String>>) {
        match self.0.write() {
            Ok(mut guard) => *guard = token,
            Err(poisoned) => *poisoned.into_inner() = token,
        }
    }

    /// Whether a token is configured (writes are enabled).
    pub fn is_set(&self) -> bool {
        match self.0.read() {
            Ok(guard) => guard.is_some(),
            Err(poisoned) => poisoned.into_inner().is_some(),
        }
    }

    /// Whether a request with this `Authorization` header value may write.
    pub fn authorize(&self, authorization: Option<&[u8]>) -> Result<(), Refusal> {
        match self.0.read() {
            Ok(guard) => authorize(guard.as_ref(), authorization),
            Err(poisoned) => authorize(poisoned.into_inner().as_ref(), authorization),
        }
    }
}

/// Why a write request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No token is configured: writes are disabled (403).
    Disabled,
    /// No `Authorization: Bearer` header (401).
    Missing,
    /// A bearer token other than the configured one (401).
    Invalid,
}

impl Refusal {
    /// The reason as a log field value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Refusal::Disabled => "disabled",
            Refusal::Missing => "missing_token",
            Refusal::Invalid => "invalid_token",
        }
    }
}

/// The check itself: `authorization` is the header's value, if any. The scheme is matched
/// without regard to case (RFC 7235); the token must match exactly.
pub fn authorize(
    token: Option<&Secret<String>>,
    authorization: Option<&[u8]>,
) -> Result<(), Refusal> {
    let Some(token) = token else {
        return Err(Refusal::Disabled);
    };
    let presented = authorization.and_then(|value| {
        let space = value.iter().position(|&b| b == b' ')?;
        let (scheme, rest) = value.split_at(space);
        scheme
            .eq_ignore_ascii_case(b"bearer")
            .then(|| rest.trim_ascii())
    });
    match presented {
        None => Err(Refusal::Missing),
        Some(presented) if token.matches(presented) => Ok(()),
        Some(_) => Err(Refusal::Invalid),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        const CHALLENGE: &str = "Bearer realm=\"dlx-proxy\"";
        match self {
            Refusal::Disabled => (
                StatusCode::FORBIDDEN,
                "admin API writes are disabled: no admin.token or admin.token_file is configured",
            )
                .into_response(),
            Refusal::Missing => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, CHALLENGE.to_string())],
                "this request needs an Authorization: Bearer token (admin.token)",
            )
                .into_response(),
            Refusal::Invalid => (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    format!("{CHALLENGE}, error=\"invalid_token\""),
                )],
                "the bearer token is not the admin token",
            )
                .into_response(),
        }
    }
}

/// Paths whose reads need the token too: message contents (`/api/queues/...`, the dead-letter
/// queue inspection) may hold personal or secret data, unlike metrics and policies.
const PROTECTED_READS: &str = "/api/queues/";

/// Whether a request needs the admin token: every write, and reads of message contents.
pub fn needs_token(method: &Method, path: &str) -> bool {
    !matches!(*method, Method::GET | Method::HEAD) || path.starts_with(PROTECTED_READS)
}

/// Lets reads through (but those of message contents); every other request must be
/// authorised with the admin token. Applied
/// to the whole router, so a route added later is guarded without doing anything.
pub async fn guard_writes(
    State(token): State<AdminToken>,
    request: Request,
    next: Next,
) -> Response {
    if !needs_token(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes());
    match token.authorize(authorization) {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            tracing::warn!(
                method = %request.method(),
                path = %request.uri().path(),
                refusal = refusal.as_str(),
                "admin API write refused"
            );
            refusal.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorize_reads_the_bearer_scheme() {
        let token = Secret::from("abc");
        let check = |header: Option<&str>| authorize(Some(&token), header.map(str::as_bytes));
        assert_eq!(check(Some("Bearer abc")), Ok(()));
        assert_eq!(check(Some("bearer   abc ")), Ok(()));
        assert_eq!(check(Some("Bearer abd")), Err(Refusal::Invalid));
        assert_eq!(check(Some("Bearer ")), Err(Refusal::Invalid));
        assert_eq!(check(Some("Bearer")), Err(Refusal::Missing));
        assert_eq!(check(Some("Basic abc")), Err(Refusal::Missing));
        assert_eq!(check(Some("abc")), Err(Refusal::Missing));
        assert_eq!(check(None), Err(Refusal::Missing));
        assert_eq!(authorize(None, Some(b"Bearer abc")), Err(Refusal::Disabled));
    }

    #[test]
    fn message_contents_need_the_token_to_be_read() {
        assert!(!needs_token(&Method::GET, "/api/policies"));
        assert!(!needs_token(&Method::HEAD, "/metrics"));
        assert!(needs_token(&Method::PUT, "/api/policies/%2F/p"));
        assert!(needs_token(&Method::GET, "/api/queues/%2F/dlq/messages"));
        assert!(needs_token(
            &Method::GET,
            "/api/queues/%2F/dlq/messages/summary"
        ));
    }
}
