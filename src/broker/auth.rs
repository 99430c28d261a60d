//! TEMPORARY stub until the auth module lands.
use crate::config::UserConfig;
#[derive(Clone, Debug)]
pub struct UserDb {
    users: Vec<UserConfig>,
}
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("unknown user")]
    UnknownUser,
    #[error("bad password")]
    BadPassword,
    #[error("loopback only")]
    LoopbackOnly,
}
#[derive(Clone, Copy, Debug)]
pub enum Access {
    Configure,
    Write,
    Read,
}
impl UserDb {
    pub fn from_config(users: &[UserConfig]) -> Result<UserDb, String> {
        Ok(UserDb {
            users: users.to_vec(),
        })
    }
    pub fn authenticate(&self, user: &str, password: &str, _lo: bool) -> Result<(), AuthError> {
        match self.users.iter().find(|u| u.name == user) {
            None => Err(AuthError::UnknownUser),
            Some(u) if u.password == password => Ok(()),
            Some(_) => Err(AuthError::BadPassword),
        }
    }
    pub fn has_vhost_access(&self, _user: &str, _vhost: &str) -> bool {
        true
    }
    pub fn check(&self, _user: &str, _vhost: &str, _access: Access, _resource: &str) -> bool {
        true
    }
}
pub fn parse_sasl_plain(response: &[u8]) -> Option<(String, String)> {
    let mut parts = response.split(|b| *b == 0);
    let _ = parts.next()?;
    let u = parts.next()?;
    let p = parts.next()?;
    Some((
        String::from_utf8(u.to_vec()).ok()?,
        String::from_utf8(p.to_vec()).ok()?,
    ))
}
pub fn parse_amqplain(_response: &[u8]) -> Option<(String, String)> {
    None
}
