//! The integration tests, one crate: embedded-mode tests with lapin and a raw client over
//! real TCP, proxy-mode tests against RabbitMQ, operations (metrics, reload, shutdown, TLS,
//! logs), the CLI, and the differential conformance scenarios.
//!
//! Shared helpers live in `common` (test broker, raw AMQP client, metrics and dead-letter
//! helpers) and `proxy_support` (the proxy in front of RabbitMQ).

mod common;
#[macro_use]
mod docs_map;
mod proxy_support;
mod rabbit;

mod config_cli;
mod conformance;
mod conformance_harness;
mod consumer_timeout;
mod dead_letter_cycles;
mod dead_letter_declare;
mod dead_letter_delivery_limit;
mod dead_letter_headers;
mod dead_letter_length;
mod dead_letter_metrics;
mod dead_letter_policy;
mod dead_letter_queue_length_limits;
mod dead_letter_rejection;
mod dead_letter_routing;
mod dead_letter_ttl;
mod dlq_inspect;
mod embedded_backpressure;
mod embedded_basic;
mod embedded_errors;
mod embedded_memory;
mod embedded_password_file;
mod embedded_protocol;
mod fleet_batched_capture;
mod fleet_capture;
mod fleet_cluster;
mod fleet_findings;
mod fleet_proxies;
mod ops_admin_token;
mod ops_logs;
mod ops_metrics;
mod ops_reload;
mod ops_secrets;
mod ops_shutdown;
mod ops_tls;
mod proxy_alarm;
mod proxy_backpressure;
mod proxy_bcc;
mod proxy_capture;
mod proxy_connections;
mod proxy_deadletter;
mod proxy_decisions;
mod proxy_declare;
mod proxy_delivery_limit;
mod proxy_failover;
mod proxy_fault_close;
mod proxy_faults;
mod proxy_forwarding;
mod proxy_holdretry;
mod proxy_least_privilege;
mod proxy_service;
mod proxy_streams;
mod proxy_upstream_policies;
mod proxy_upstream_tls;
mod redrive;
mod retry_tiers_embedded;
mod retry_tiers_proxy;
mod storage_confirms;
mod storage_crash;
mod storage_disk;
mod storage_paging;
mod storage_policies;
mod storage_restart;
mod storage_ttl;
mod table_depth;
mod ttl_on_dead_letters;
