//! TODO: shutdown
