//! TODO: service
