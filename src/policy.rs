//! TODO: policy
