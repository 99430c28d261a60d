//! dlx-proxy: an AMQP 0-9-1 sidecar with complete, observable dead-letter semantics.
//!
//! The crate is split the way data flows through it:
//! - [`amqp`] turns bytes into frames and frames into methods and contents (no sockets);
//! - [`rabbit`] is RabbitMQ's vocabulary both modes share (queue arguments and their checks);
//! - [`deadletter`] and [`policy`] hold the pure dead-letter rules and policy matching;
//! - [`broker`] is the embedded broker core (vhosts, exchanges, queues, consumers);
//! - [`server`] runs one task per client connection for embedded mode;
//! - [`memory`] is the embedded broker's memory high watermark (publishers blocked above it);
//! - [`storage`] keeps durable definitions and persistent messages on disk (embedded mode);
//! - [`proxy`] forwards client connections to an upstream broker (proxy mode);
//! - [`admission`] decides who may connect (connection slots, loopback-only users);
//! - [`secret`] keeps passwords and tokens out of every log line;
//! - [`config`], [`metrics`], [`admin`], [`tls`] and [`service`] wire everything together;
//! - [`policy_cli`] is the client side of `dlx-proxy policy set|clear|list`.

pub mod admin;
pub mod admin_auth;
pub mod admission;
pub mod amqp;
pub mod broker;
pub mod config;
pub mod deadletter;
pub mod dlq_cli;
pub mod dlq_inspect;
pub mod dlq_view;
pub mod listener;
pub mod memory;
pub mod metrics;
pub mod policy;
pub mod policy_cli;
pub mod proxy;
pub mod rabbit;
pub mod redrive;
pub mod redrive_cli;
pub mod reload;
pub mod secret;
pub mod server;
pub mod service;
pub mod shutdown;
pub mod storage;
pub mod tls;
