//! Secrets in memory: a value that never shows in logs, and a comparison that takes the same
//! time wherever two values differ.
//!
//! [`Secret`] wraps passwords, password hashes and the admin token in the configuration. Its
//! `Debug` and `Display` print `***`, so a `?config` or `%user.password` in a log line, an
//! error text or a panic message cannot leak it; the value is read with [`Secret::expose`],
//! which makes every use easy to find. Serde sees the plain value (the configuration layers
//! and the TOML printer need it); `Config::redacted` replaces secrets before printing.
//!
//! [`constant_time_eq`] compares digests (embedded broker passwords) and [`Secret::matches`]
//! compares a presented token with the configured one (the admin API's bearer token).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

/// What `Debug` and `Display` print instead of a secret.
pub const MASK: &str = "***";

/// A value kept out of every formatted output.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Secret<T> {
        Secret(value)
    }

    /// The value itself: only for the place that needs it (hashing, comparing, connecting).
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl Secret<String> {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` equals the secret. Both are hashed first and the digests are
    /// compared in constant time, so neither the position of the first difference nor the
    /// secret's length shows in the time taken.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = Sha256::digest(self.0.as_bytes());
        let presented = Sha256::digest(presented);
        constant_time_eq(&expected, &presented)
    }
}

impl From<&str> for Secret<String> {
    fn from(value: &str) -> Self {
        Secret(value.to_string())
    }
}

impl From<String> for Secret<String> {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// Compares without an early exit on the first differing byte (lengths are not secret here:
/// callers compare fixed-size digests).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting_never_shows_the_value() {
        let secret = Secret::from("hunter2");
        assert_eq!(format!("{secret:?}"), "***");
        assert_eq!(format!("{secret}"), "***");
        assert_eq!(format!("{:#?}", Some(&secret)), "Some(\n    ***,\n)");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn serde_sees_the_plain_value() {
        let secret: Secret<String> = serde_json::from_str("\"s3\"").unwrap();
        assert_eq!(secret.expose(), "s3");
        assert_eq!(serde_json::to_string(&secret).unwrap(), "\"s3\"");
    }

    #[test]
    fn matching_is_exact() {
        let secret = Secret::from("token-1");
        assert!(secret.matches(b"token-1"));
        assert!(!secret.matches(b"token-2"));
        assert!(!secret.matches(b"token-1 "));
        assert!(!secret.matches(b""));
        assert!(constant_time_eq(b"ab", b"ab"));
        assert!(!constant_time_eq(b"ab", b"ac"));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }
}
