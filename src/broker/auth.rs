//! Users, passwords and permissions of the embedded broker, as RabbitMQ's internal
//! authentication/authorisation backend (`rabbit_auth_backend_internal`) does them.
//!
//! The server authenticates a connection with [`UserDb::authenticate`] (after decoding the
//! SASL response with [`parse_sasl_plain`] or [`parse_amqplain`]), checks the vhost of
//! `connection.open` with [`UserDb::has_vhost_access`], and every resource operation with
//! [`UserDb::check`].
//!
//! What RabbitMQ does, and we mirror:
//! - **Passwords** are stored as `rabbit_password_hashing_sha256` hashes:
//!   `base64(salt[4] ++ sha256(salt ++ utf8 password))` ([`hash_password`]). Hashes made with
//!   `rabbit_password_hashing_sha512` (68 decoded bytes) are accepted too. A plain `password`
//!   (or one read from `password_file`) is hashed with a random salt when loaded. Comparison is constant
//!   time; an unknown user costs the same hashing work as a known one.
//! - **Loopback-only users** (RabbitMQ's `loopback_users`, `guest` by default) are refused
//!   from other addresses, checked after the password, as `rabbit_access_control` does.
//! - **Vhost access**: a user may open a vhost when it has a permission entry for it, whatever
//!   the three patterns are (`check_vhost_access`).
//! - **Resource permissions** (`check_resource_access`): each of configure / write / read is a
//!   regular expression run with `re:run(Name, Regex)`: *unanchored* (`"amq"` grants
//!   `"my-amq-queue"`; write `^...$` for exact names), except that the empty pattern `""` is
//!   replaced by `"^$"` — it matches only an empty name, i.e. grants nothing in practice. The
//!   default exchange (empty name) is checked under the name `"amq.default"` (a rule of
//!   `rabbit_access_control`); since queue names are never empty by the time they are
//!   checked (the server names a `""` queue first), [`UserDb::check`] applies that to every
//!   empty resource name. (RabbitMQ 2.x let anyone use `amq.gen*` names; current versions do
//!   not, nor do we.)
//! - RabbitMQ's regexes are PCRE on the name's bytes; we compile them with the `regex` crate
//!   in byte mode with Unicode classes off, which agrees with PCRE's defaults (`.` is one byte,
//!   `\w`/`\d` are ASCII); a pattern byte mode cannot express (a non-ASCII class like `[é]`,
//!   `\p{L}`) is compiled in Unicode mode instead. PCRE-only syntax (look-around,
//!   back-references) is refused when the configuration is loaded, naming the key.

use std::collections::HashMap;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use regex::bytes::{Regex, RegexBuilder};
use sha2::{Digest, Sha256, Sha512};

use crate::config::{Credential, PermissionConfig, UserConfig};
use crate::secret::constant_time_eq;

/// Why a login was refused. The AMQP reply uses one text for all of them (never reveal which);
/// this is for logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("unknown user")]
    UnknownUser,
    #[error("wrong password")]
    BadPassword,
    #[error("user may only connect from a loopback address")]
    LoopbackOnly,
}

/// The three kinds of resource permission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Configure,
    Write,
    Read,
}

/// The name RabbitMQ checks the default exchange (empty name) under.
pub const DEFAULT_EXCHANGE_RESOURCE: &str = "amq.default";

const SALT_LEN: usize = 4;

/// Every configured user with its credentials and per-vhost permissions.
#[derive(Clone)]
pub struct UserDb {
    users: HashMap<String, User>,
}

#[derive(Clone)]
struct User {
    credential: PasswordHash,
    loopback_only: bool,
    /// vhost → permissions.
    permissions: HashMap<String, Permissions>,
}

#[derive(Clone)]
struct PasswordHash {
    salt: [u8; SALT_LEN],
    algorithm: HashAlgorithm,
    digest: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HashAlgorithm {
    Sha256,
    Sha512,
}

#[derive(Clone)]
struct Permissions {
    configure: Regex,
    write: Regex,
    read: Regex,
}

impl fmt::Debug for UserDb {
    /// Lists user names only: hashes stay out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<&String> = self.users.keys().collect();
        names.sort();
        f.debug_struct("UserDb").field("users", &names).finish()
    }
}

impl UserDb {
    /// Builds the database from `users` in the configuration. Errors name the offending key,
    /// e.g. `users[1].permissions[0].read: invalid regex ...`.
    pub fn from_config(users: &[UserConfig]) -> Result<UserDb, String> {
        let mut db = HashMap::with_capacity(users.len());
        for (i, user) in users.iter().enumerate() {
            let key = format!("users[{i}]");
            if user.name.is_empty() {
                return Err(format!("{key}.name: must not be empty"));
            }
            if db.contains_key(&user.name) {
                return Err(format!("{key}.name: duplicate user '{}'", user.name));
            }
            let credential = match user.credential(i).map_err(|e| e.to_string())? {
                Credential::Plain(password) => PasswordHash::new(rand::random(), password.expose()),
                Credential::Hash(hash) => PasswordHash::parse(hash.expose())
                    .map_err(|e| format!("{key}.password_hash: {e}"))?,
            };
            let mut permissions = HashMap::with_capacity(user.permissions.len());
            for (j, permission) in user.permissions.iter().enumerate() {
                let key = format!("{key}.permissions[{j}]");
                if permissions.contains_key(&permission.vhost) {
                    return Err(format!(
                        "{key}.vhost: duplicate permissions for vhost '{}'",
                        permission.vhost
                    ));
                }
                permissions.insert(
                    permission.vhost.clone(),
                    Permissions::from_config(permission, &key)?,
                );
            }
            db.insert(
                user.name.clone(),
                User {
                    credential,
                    loopback_only: user.loopback_only,
                    permissions,
                },
            );
        }
        Ok(UserDb { users: db })
    }

    /// Checks a login. The password is checked before the loopback rule, as RabbitMQ does.
    pub fn authenticate(
        &self,
        user: &str,
        password: &str,
        peer_is_loopback: bool,
    ) -> Result<(), AuthError> {
        let Some(entry) = self.users.get(user) else {
            // Same hashing work as for a known user, so timing does not tell names apart.
            let _ = dummy_credential().verify(password);
            return Err(AuthError::UnknownUser);
        };
        if !entry.credential.verify(password) {
            return Err(AuthError::BadPassword);
        }
        if entry.loopback_only && !peer_is_loopback {
            return Err(AuthError::LoopbackOnly);
        }
        Ok(())
    }

    /// True if `user` has a permission entry for `vhost` (needed to open it).
    pub fn has_vhost_access(&self, user: &str, vhost: &str) -> bool {
        self.users
            .get(user)
            .is_some_and(|u| u.permissions.contains_key(vhost))
    }

    /// True if `user` may perform `access` on the exchange or queue named `resource` in
    /// `vhost`. An empty name (the default exchange) is checked as `amq.default`.
    pub fn check(&self, user: &str, vhost: &str, access: Access, resource: &str) -> bool {
        let Some(permissions) = self.users.get(user).and_then(|u| u.permissions.get(vhost)) else {
            return false;
        };
        let name = if resource.is_empty() {
            DEFAULT_EXCHANGE_RESOURCE
        } else {
            resource
        };
        let regex = match access {
            Access::Configure => &permissions.configure,
            Access::Write => &permissions.write,
            Access::Read => &permissions.read,
        };
        regex.is_match(name.as_bytes())
    }

    /// True if the user exists.
    pub fn contains_user(&self, user: &str) -> bool {
        self.users.contains_key(user)
    }
}

impl Permissions {
    fn from_config(config: &PermissionConfig, key: &str) -> Result<Permissions, String> {
        Ok(Permissions {
            configure: compile_permission(&config.configure)
                .map_err(|e| format!("{key}.configure: {e}"))?,
            write: compile_permission(&config.write).map_err(|e| format!("{key}.write: {e}"))?,
            read: compile_permission(&config.read).map_err(|e| format!("{key}.read: {e}"))?,
        })
    }
}

/// Compiles one permission pattern with RabbitMQ's rules (see the module docs).
fn compile_permission(pattern: &str) -> Result<Regex, String> {
    let pattern = if pattern.is_empty() { "^$" } else { pattern };
    RegexBuilder::new(pattern)
        .unicode(false)
        .build()
        // Byte mode refuses non-ASCII classes such as `[é]` or `\p{L}`: take those in Unicode
        // mode rather than refusing a pattern PCRE accepts.
        .or_else(|_| RegexBuilder::new(pattern).build())
        .map_err(|e| format!("invalid regex '{pattern}': {e}"))
}

impl PasswordHash {
    fn new(salt: [u8; SALT_LEN], password: &str) -> Self {
        PasswordHash {
            salt,
            algorithm: HashAlgorithm::Sha256,
            digest: salted_digest(HashAlgorithm::Sha256, &salt, password),
        }
    }

    /// Decodes a RabbitMQ password hash (base64 of the salt followed by the digest).
    fn parse(encoded: &str) -> Result<Self, String> {
        let bytes = BASE64
            .decode(encoded.trim())
            .map_err(|e| format!("invalid base64: {e}"))?;
        let algorithm = match bytes.len() {
            36 => HashAlgorithm::Sha256,
            68 => HashAlgorithm::Sha512,
            n if n <= SALT_LEN => {
                return Err(format!(
                    "decodes to {n} bytes; a hash is a 4-byte salt followed by a digest"
                ));
            }
            n => {
                return Err(format!(
                    "decodes to {n} bytes; expected 36 (salt + SHA-256, RabbitMQ's default) \
                     or 68 (salt + SHA-512)"
                ));
            }
        };
        let (salt, digest) = bytes.split_at(SALT_LEN);
        let mut salt_bytes = [0u8; SALT_LEN];
        salt_bytes.copy_from_slice(salt);
        Ok(PasswordHash {
            salt: salt_bytes,
            algorithm,
            digest: digest.to_vec(),
        })
    }

    fn verify(&self, password: &str) -> bool {
        let candidate = salted_digest(self.algorithm, &self.salt, password);
        constant_time_eq(&candidate, &self.digest)
    }
}

fn dummy_credential() -> PasswordHash {
    PasswordHash {
        salt: [0; SALT_LEN],
        algorithm: HashAlgorithm::Sha256,
        digest: vec![0; 32],
    }
}

fn salted_digest(algorithm: HashAlgorithm, salt: &[u8], password: &str) -> Vec<u8> {
    match algorithm {
        HashAlgorithm::Sha256 => {
            let mut hasher = Sha256::new();
            hasher.update(salt);
            hasher.update(password.as_bytes());
            hasher.finalize().to_vec()
        }
        HashAlgorithm::Sha512 => {
            let mut hasher = Sha512::new();
            hasher.update(salt);
            hasher.update(password.as_bytes());
            hasher.finalize().to_vec()
        }
    }
}

/// RabbitMQ's `rabbit_password_hashing_sha256`: `base64(salt ++ sha256(salt ++ utf8 password))`.
/// Useful to produce a `password_hash` for the configuration.
pub fn hash_password(salt: [u8; 4], password: &str) -> String {
    let mut bytes = salt.to_vec();
    bytes.extend_from_slice(&salted_digest(HashAlgorithm::Sha256, &salt, password));
    BASE64.encode(bytes)
}

/// The detail of RabbitMQ's 403 ACCESS_REFUSED for any refused login (unknown user, wrong
/// password, loopback-only user from elsewhere): the same text for all, which never says why.
pub fn login_refused(mechanism: &str) -> String {
    format!(
        "Login was refused using authentication mechanism {mechanism}. \
         For details see the broker logfile."
    )
}

/// The user name of a SASL response (PLAIN or AMQPLAIN), `None` for another mechanism or a
/// response that does not parse. The password is dropped at once.
pub fn sasl_user(mechanism: &str, response: &[u8]) -> Option<String> {
    let (user, _password) = match mechanism {
        "PLAIN" => parse_sasl_plain(response)?,
        "AMQPLAIN" => parse_amqplain(response)?,
        _ => return None,
    };
    Some(user)
}

/// Decodes a SASL PLAIN response `authzid \0 authcid \0 password` into (user, password); the
/// authorisation identity is ignored. `None` unless there are exactly two NUL separators and
/// both fields are UTF-8.
pub fn parse_sasl_plain(response: &[u8]) -> Option<(String, String)> {
    let mut parts = response.split(|&b| b == 0);
    let _authzid = parts.next()?;
    let user = parts.next()?;
    let password = parts.next()?;
    if parts.next().is_some() {
        return None;
    }
    Some((
        String::from_utf8(user.to_vec()).ok()?,
        String::from_utf8(password.to_vec()).ok()?,
    ))
}

/// Decodes an AMQPLAIN response: the entries of a field table (without its 4-byte size) with
/// long-string `LOGIN` and `PASSWORD`. As RabbitMQ, the first entry of each name counts and it
/// must be a long string. Other entries are skipped without being decoded (so nesting depth
/// costs nothing); `None` on anything malformed.
pub fn parse_amqplain(response: &[u8]) -> Option<(String, String)> {
    let mut reader = TableReader {
        bytes: response,
        position: 0,
    };
    // Outer None: not seen yet; inner None: seen, but not a long string.
    let mut login: Option<Option<&[u8]>> = None;
    let mut password: Option<Option<&[u8]>> = None;
    while !reader.is_at_end() {
        let name_len = reader.u8()?;
        let name = reader.take(usize::from(name_len))?;
        let tag = reader.u8()?;
        let value = if tag == b'S' {
            Some(reader.long_bytes()?)
        } else {
            reader.skip_value(tag)?;
            None
        };
        match name {
            b"LOGIN" if login.is_none() => login = Some(value),
            b"PASSWORD" if password.is_none() => password = Some(value),
            _ => {}
        }
    }
    let login = login??;
    let password = password??;
    Some((
        String::from_utf8(login.to_vec()).ok()?,
        String::from_utf8(password.to_vec()).ok()?,
    ))
}

/// A bounds-checked cursor over field-table bytes (RabbitMQ's type tags, as amq-protocol).
struct TableReader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> TableReader<'a> {
    fn is_at_end(&self) -> bool {
        self.position >= self.bytes.len()
    }

    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        let end = self.position.checked_add(len)?;
        let slice = self.bytes.get(self.position..end)?;
        self.position = end;
        Some(slice)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn long_bytes(&mut self) -> Option<&'a [u8]> {
        let len = self.take(4)?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        self.take(usize::try_from(len).ok()?)
    }

    fn skip_value(&mut self, tag: u8) -> Option<()> {
        match crate::amqp::depth::fixed_size(tag) {
            Some(fixed) => self.take(fixed).map(|_| ()),
            None if matches!(tag, b'S' | b'A' | b'F' | b'x') => self.long_bytes().map(|_| ()),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests;
