//! TODO: tls
