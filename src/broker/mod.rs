//! The embedded broker core: vhosts, exchanges and routing, queues, consumers, users and
//! permissions. Plain data structures driven by the connection tasks in [`crate::server`].

pub mod args;
pub mod auth;
pub mod message;
pub mod queue;
pub mod routing;
