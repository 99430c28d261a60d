//! TODO: admin
