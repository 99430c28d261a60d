//! TODO: metrics
