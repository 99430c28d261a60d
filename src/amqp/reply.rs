//! AMQP reply codes and the error type every method handler returns.
//!
//! A channel-level error closes the channel (`channel.close`), a connection-level one closes the
//! connection (`connection.close`); the code decides which, as in the 0-9-1 spec.

use std::fmt;

pub const REPLY_SUCCESS: u16 = 200;
pub const CONTENT_TOO_LARGE: u16 = 311;
pub const NO_ROUTE: u16 = 312;
pub const NO_CONSUMERS: u16 = 313;
pub const CONNECTION_FORCED: u16 = 320;
pub const INVALID_PATH: u16 = 402;
pub const ACCESS_REFUSED: u16 = 403;
pub const NOT_FOUND: u16 = 404;
pub const RESOURCE_LOCKED: u16 = 405;
pub const PRECONDITION_FAILED: u16 = 406;
pub const FRAME_ERROR: u16 = 501;
pub const SYNTAX_ERROR: u16 = 502;
pub const COMMAND_INVALID: u16 = 503;
pub const CHANNEL_ERROR: u16 = 504;
pub const UNEXPECTED_FRAME: u16 = 505;
pub const RESOURCE_ERROR: u16 = 506;
pub const NOT_ALLOWED: u16 = 530;
pub const NOT_IMPLEMENTED: u16 = 540;
pub const INTERNAL_ERROR: u16 = 541;

/// The symbolic name RabbitMQ puts in front of a reply text.
pub fn reply_name(code: u16) -> &'static str {
    match code {
        REPLY_SUCCESS => "OK",
        CONTENT_TOO_LARGE => "CONTENT_TOO_LARGE",
        NO_ROUTE => "NO_ROUTE",
        NO_CONSUMERS => "NO_CONSUMERS",
        CONNECTION_FORCED => "CONNECTION_FORCED",
        INVALID_PATH => "INVALID_PATH",
        ACCESS_REFUSED => "ACCESS_REFUSED",
        NOT_FOUND => "NOT_FOUND",
        RESOURCE_LOCKED => "RESOURCE_LOCKED",
        PRECONDITION_FAILED => "PRECONDITION_FAILED",
        FRAME_ERROR => "FRAME_ERROR",
        SYNTAX_ERROR => "SYNTAX_ERROR",
        COMMAND_INVALID => "COMMAND_INVALID",
        CHANNEL_ERROR => "CHANNEL_ERROR",
        UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        RESOURCE_ERROR => "RESOURCE_ERROR",
        NOT_ALLOWED => "NOT_ALLOWED",
        NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        INTERNAL_ERROR => "INTERNAL_ERROR",
        _ => "ERROR",
    }
}

/// True for the codes that close the whole connection.
pub fn is_connection_error(code: u16) -> bool {
    matches!(
        code,
        CONNECTION_FORCED
            | INVALID_PATH
            | FRAME_ERROR
            | SYNTAX_ERROR
            | COMMAND_INVALID
            | CHANNEL_ERROR
            | UNEXPECTED_FRAME
            | RESOURCE_ERROR
            | NOT_ALLOWED
            | NOT_IMPLEMENTED
            | INTERNAL_ERROR
    )
}

/// An error answered to the peer: reply code, text and the method that caused it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmqpError {
    pub code: u16,
    pub text: String,
    pub class_id: u16,
    pub method_id: u16,
}

impl AmqpError {
    /// An error with the RabbitMQ-style text `NAME - detail`.
    pub fn new(code: u16, detail: impl AsRef<str>) -> Self {
        AmqpError {
            code,
            text: format!("{} - {}", reply_name(code), detail.as_ref()),
            class_id: 0,
            method_id: 0,
        }
    }

    /// Records which method failed (filled in by the dispatcher).
    pub fn on_method(mut self, class_id: u16, method_id: u16) -> Self {
        if self.class_id == 0 && self.method_id == 0 {
            self.class_id = class_id;
            self.method_id = method_id;
        }
        self
    }

    pub fn is_connection_error(&self) -> bool {
        is_connection_error(self.code)
    }

    /// The reply text cut to the 255 bytes a short string can carry (on a char boundary).
    pub fn short_text(&self) -> &str {
        truncate_str(&self.text, 255)
    }

    pub fn access_refused(detail: impl AsRef<str>) -> Self {
        Self::new(ACCESS_REFUSED, detail)
    }
    pub fn not_found(detail: impl AsRef<str>) -> Self {
        Self::new(NOT_FOUND, detail)
    }
    pub fn precondition(detail: impl AsRef<str>) -> Self {
        Self::new(PRECONDITION_FAILED, detail)
    }
    pub fn resource_locked(detail: impl AsRef<str>) -> Self {
        Self::new(RESOURCE_LOCKED, detail)
    }
    pub fn command_invalid(detail: impl AsRef<str>) -> Self {
        Self::new(COMMAND_INVALID, detail)
    }
    pub fn channel_error(detail: impl AsRef<str>) -> Self {
        Self::new(CHANNEL_ERROR, detail)
    }
    pub fn unexpected_frame(detail: impl AsRef<str>) -> Self {
        Self::new(UNEXPECTED_FRAME, detail)
    }
    pub fn frame_error(detail: impl AsRef<str>) -> Self {
        Self::new(FRAME_ERROR, detail)
    }
    pub fn syntax_error(detail: impl AsRef<str>) -> Self {
        Self::new(SYNTAX_ERROR, detail)
    }
    pub fn not_allowed(detail: impl AsRef<str>) -> Self {
        Self::new(NOT_ALLOWED, detail)
    }
    pub fn not_implemented(detail: impl AsRef<str>) -> Self {
        Self::new(NOT_IMPLEMENTED, detail)
    }
    pub fn internal(detail: impl AsRef<str>) -> Self {
        Self::new(INTERNAL_ERROR, detail)
    }
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.code, self.text)
    }
}

impl std::error::Error for AmqpError {}

/// Cuts `s` to at most `max` bytes without splitting a UTF-8 character.
pub fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_has_rabbitmq_prefix() {
        let e = AmqpError::not_found("no queue 'q' in vhost '/'");
        assert_eq!(e.text, "NOT_FOUND - no queue 'q' in vhost '/'");
        assert!(!e.is_connection_error());
        assert!(AmqpError::frame_error("x").is_connection_error());
    }

    #[test]
    fn short_text_respects_char_boundaries() {
        let e = AmqpError::precondition("é".repeat(200));
        assert!(e.short_text().len() <= 255);
        assert!(e.short_text().is_char_boundary(e.short_text().len()));
    }
}
