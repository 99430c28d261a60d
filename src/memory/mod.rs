//! The memory high watermark (embedded mode): when the process uses more memory than
//! `limits.memory_high_watermark`, connections that publish are blocked until it falls back,
//! as RabbitMQ's memory alarm does; free memory is handed back to the operating system so
//! that it does fall back once queues are drained or deleted.
//!
//! - [`watermark`] parses the setting (bytes, or a fraction of the memory limit);
//! - [`system`] reads the memory limit (cgroup v2/v1, else total RAM) and the resident size;
//! - [`alarm`] decides raised or cleared from one sample (pure, with a clear margin);
//! - [`release`] decides when to return free allocator memory and does it;
//! - [`monitor`] is the task that samples on a timer and ties them together.
//!
//! The alarm state reaches the connections through a `watch` channel held by
//! [`crate::server::ServerContext`]; [`crate::server::blocking`] does the blocking. Proxy mode
//! has no watermark: the upstream broker has its own memory alarm and the proxy's buffers are
//! bounded per connection (`proxy.max_inflight_bytes`).

pub mod alarm;
pub mod monitor;
pub mod release;
pub mod system;
pub mod watermark;

pub use alarm::{AlarmChange, MemoryAlarm};
pub use system::MemorySources;
pub use watermark::Watermark;
