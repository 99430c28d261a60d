//! What a client connection holds back while it waits for an answer: a queue.declare
//! waiting for the check's verdict or for the vhost's capture objects, a consume or get
//! waiting for its queue's arguments to be read back. Plain data, filled and resolved by
//! [`super::intercept`], held by [`super::client_session::ClientSession`] (client reads pause
//! while one is pending).

use std::sync::Arc;
use std::time::Instant;

use amq_protocol::protocol::queue;
use amq_protocol::types::FieldTable;

use super::arbiter::DeclareCheck;
use super::readback::ReadBack;
use super::wire::WireFrame;
use crate::rabbit::args::QueueArguments;

/// A queue.declare held while the check channel asks the upstream ([`super::arbiter`]).
#[derive(Debug)]
pub(super) struct PendingCheck {
    pub(super) channel: u16,
    pub(super) declare: queue::Declare,
    pub(super) client_arguments: QueueArguments,
    /// The computed upstream arguments (declared for the client when the check cannot tell).
    pub(super) upstream_arguments: FieldTable,
    pub(super) check: DeclareCheck,
    /// The permission probe on the client's connection runs ([`super::permission`]); then
    /// the check's rounds on the declare connection.
    pub(super) probing: bool,
    /// A queue of the client's connection (exclusive, server-named): once the probe grants
    /// it, it is declared on the client's channel with the upstream arguments, not by the
    /// service connection.
    pub(super) own: bool,
}

/// A queue.declare held until the vhost's capture objects exist.
#[derive(Debug)]
pub(super) struct HeldDeclare {
    pub(super) frame: WireFrame,
    pub(super) deadline: Instant,
}

/// A basic.consume or basic.get held while its queue's arguments are read back
/// ([`super::readback`]).
#[derive(Debug)]
pub(super) struct PendingRead {
    pub(super) frame: WireFrame,
    pub(super) queue: Arc<str>,
    pub(super) read: ReadBack,
}
