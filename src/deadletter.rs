//! TODO: deadletter
