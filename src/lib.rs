//! dlx-proxy: an AMQP 0-9-1 sidecar with complete, observable dead-letter semantics.
//!
//! The crate is split the way data flows through it:
//! - [`amqp`] turns bytes into frames and frames into methods and contents (no sockets);
//! - [`deadletter`] and [`policy`] hold the pure dead-letter rules and policy matching;
//! - [`broker`] is the embedded broker core (vhosts, exchanges, queues, consumers);
//! - [`server`] runs one task per client connection for embedded mode;
//! - [`memory`] is the embedded broker's memory high watermark (publishers blocked above it);
//! - [`proxy`] forwards client connections to an upstream broker (proxy mode);
//! - [`config`], [`metrics`], [`admin`], [`tls`] and [`service`] wire everything together.

pub mod admin;
pub mod amqp;
pub mod broker;
pub mod config;
pub mod deadletter;
pub mod listener;
pub mod memory;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod reload;
pub mod server;
pub mod service;
pub mod shutdown;
pub mod tls;
