//! What the proxy's unit tests share: a `ProxyShared` with no reachable upstream, and frames
//! read back from the bytes a state machine queued.

use std::sync::{Arc, RwLock};

use amq_protocol::protocol::AMQPClass;
use bytes::BytesMut;
use tokio_util::codec::Decoder;

use super::ProxyShared;
use super::registry::VerifiedQueue;
use super::wire::{WireCodec, WireFrame};
use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::config::{Config, Mode};
use crate::metrics::Metrics;
use crate::policy::PolicySet;
use crate::rabbit::args::QueueArguments;

/// Proxy-mode state whose upstream (`127.0.0.1:1`) refuses every connection.
pub fn shared() -> Arc<ProxyShared> {
    shared_with(|_| {})
}

/// [`shared`] with the configuration changed by `edit` first.
pub fn shared_with(edit: impl FnOnce(&mut Config)) -> Arc<ProxyShared> {
    let mut config = Config {
        mode: Mode::Proxy,
        ..Config::default()
    };
    config.upstream.url = "amqp://127.0.0.1:1".into();
    edit(&mut config);
    ProxyShared::new(
        &config,
        Arc::new(RwLock::new(PolicySet::from_configs(&[]).unwrap())),
        Metrics::new(10),
    )
    .unwrap()
}

/// A queue declared through a proxy with `dlx` as its dead-letter exchange.
pub fn with_dlx(dlx: &str) -> VerifiedQueue {
    VerifiedQueue::Proxied(QueueArguments {
        dead_letter_exchange: Some(dlx.into()),
        ..QueueArguments::default()
    })
}

/// Every frame in `bytes`.
pub fn frames(bytes: &[u8]) -> Vec<WireFrame> {
    let mut buf = BytesMut::from(bytes);
    let mut codec = WireCodec::new(1 << 20);
    std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).collect()
}

/// The methods in `bytes`, with their channel, in order.
pub fn methods(bytes: &[u8]) -> Vec<(u16, AMQPClass)> {
    frames(bytes)
        .into_iter()
        .filter(|f| f.kind == FRAME_METHOD)
        .map(|f| (f.channel, decode_method(f.payload()).unwrap()))
        .collect()
}
