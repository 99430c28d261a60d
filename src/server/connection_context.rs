//! What the channel handlers know of their connection once the handshake is done: who is
//! connected to which vhost, the negotiated limits, and the write queue its frames go to.
//!
//! A leaf module: [`super::connection`] builds a [`ConnectionContext`] at the end of the
//! handshake and [`super::channel`] reads it, so neither of those two needs the other's
//! internals.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::broker::write_queue::WriteQueue;

/// Connection-level facts the channel handlers need.
pub struct ConnectionContext {
    pub conn_id: u64,
    /// The client's address (in every log line about the connection).
    pub peer: SocketAddr,
    pub user: String,
    pub vhost: String,
    pub frame_max: usize,
    pub channel_max: u16,
    /// Negotiated heartbeat interval in seconds (0 = off).
    pub heartbeat: u64,
    pub write_queue: Arc<WriteQueue>,
    /// The client announced the `connection.blocked` capability.
    pub blocked_notifications: bool,
}
