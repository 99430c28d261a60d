//! The raw AMQP 0-9-1 client (`--client raw`): producers and consumers that write and parse
//! frames themselves (with amq-protocol's frame types) over a tokio `TcpStream`, one channel
//! per connection, buffering many frames per system call. It does what the lapin client in
//! [`crate::client`] does for the scenarios that move messages, at a fraction of lapin's CPU
//! per message, so the benchmark measures the broker rather than its client. Topology (declares,
//! deletes) stays with lapin.

mod consumer;
mod publisher;
mod wire;

pub use consumer::{Subscriber, start_consumer};
pub use publisher::{Publisher, publish};
