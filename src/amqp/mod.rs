//! AMQP 0-9-1 wire helpers shared by the embedded server and the proxy: the frame codec,
//! content (header + body) assembly and generation, and the reply codes.

pub mod codec;
pub mod content;
pub mod depth;
pub mod headers;
pub mod peek;
pub mod reply;
