//! RabbitMQ's vocabulary shared by both modes: queue arguments with their validation, their
//! 406 reply texts and the redeclare-equivalence check. Pure code; `broker` (embedded mode)
//! and `proxy` (proxy mode) both import it and never import each other for it.

pub mod args;
