//! Connection negotiation seen from the middle: the upstream's `connection.tune` is shown to the
//! client with [`RESERVED_CHANNELS`] channel numbers fewer, the client's `connection.tune-ok`
//! is passed on with those added back, and the highest channel numbers of the upstream
//! connection become the proxy's own (queue probe, dead-letter publisher, capture consumer).
//! Everything else in the handshake (start, SASL, open) passes through unchanged.
//!
//! Also here: [`refuse_client`], which answers a client whose upstream cannot be reached with
//! a proper `connection.close 320` instead of a dropped socket.

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::wire::{FrameReader, method_frame};
use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::amqp::reply::CONNECTION_FORCED;

/// Channel numbers the proxy keeps for itself on every upstream connection.
pub const RESERVED_CHANNELS: u16 = 3;

/// What was agreed in tune / tune-ok.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Highest channel number the client may use.
    pub client_channel_max: u16,
    /// The proxy's queue-probe channel (None when the upstream offers too few channels).
    pub probe_channel: Option<u16>,
    /// The proxy's dead-letter publisher channel.
    pub publisher_channel: Option<u16>,
    /// The proxy's capture consumer channel.
    pub capture_channel: Option<u16>,
    /// Largest frame on both legs.
    pub frame_max: u32,
    /// Heartbeat interval in seconds (0 = off).
    pub heartbeat: u16,
}

/// The upstream's channel_max with 0 read as "no limit".
fn effective_channel_max(offered: u16) -> u16 {
    if offered == 0 { u16::MAX } else { offered }
}

/// The tune the client sees: channel_max lowered by [`RESERVED_CHANNELS`] when the upstream
/// offers enough channels.
pub fn tune_for_client(upstream: &connection::Tune) -> connection::Tune {
    let max = effective_channel_max(upstream.channel_max);
    let channel_max = if max > RESERVED_CHANNELS {
        max - RESERVED_CHANNELS
    } else {
        upstream.channel_max
    };
    connection::Tune {
        channel_max,
        frame_max: upstream.frame_max,
        heartbeat: upstream.heartbeat,
    }
}

/// Settles the negotiation from the upstream's tune and the client's tune-ok; returns the
/// tune-ok to send upstream and what was agreed. `fallback_frame_max` applies when both sides
/// say "no limit".
pub fn negotiate(
    upstream: &connection::Tune,
    client: &connection::TuneOk,
    fallback_frame_max: u32,
) -> (connection::TuneOk, Negotiated) {
    let max = effective_channel_max(upstream.channel_max);
    let reserve = max > RESERVED_CHANNELS;
    let offered = if reserve {
        max - RESERVED_CHANNELS
    } else {
        max
    };
    let chosen = if client.channel_max == 0 || client.channel_max > offered {
        offered
    } else {
        client.channel_max
    };
    let (upstream_channel_max, probe_channel, publisher_channel, capture_channel) = if reserve {
        (
            chosen + RESERVED_CHANNELS,
            Some(chosen + 1),
            Some(chosen + 2),
            Some(chosen + 3),
        )
    } else {
        (chosen, None, None, None)
    };
    let frame_max = if client.frame_max != 0 {
        client.frame_max
    } else if upstream.frame_max != 0 {
        upstream.frame_max
    } else {
        fallback_frame_max
    };
    let tune_ok = connection::TuneOk {
        channel_max: upstream_channel_max,
        frame_max: client.frame_max,
        heartbeat: client.heartbeat,
    };
    (
        tune_ok,
        Negotiated {
            client_channel_max: chosen,
            probe_channel,
            publisher_channel,
            capture_channel,
            frame_max,
            heartbeat: client.heartbeat,
        },
    )
}

/// Plays the server's side of the handshake just far enough to tell the client, with
/// `connection.close 320`, that the upstream is unreachable. Bounded by `within`.
pub async fn refuse_client<S>(client: S, reason: &str, within: Duration)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (reader, mut writer) = tokio::io::split(client);
    let mut frames = FrameReader::new(reader, crate::amqp::codec::FRAME_MIN_SIZE * 32);
    let exchange = async {
        let mut capabilities = FieldTable::default();
        capabilities.insert(
            ShortString::from("connection.blocked"),
            AMQPValue::Boolean(true),
        );
        let mut properties = FieldTable::default();
        properties.insert(
            ShortString::from("capabilities"),
            AMQPValue::FieldTable(capabilities),
        );
        properties.insert(
            ShortString::from("product"),
            AMQPValue::LongString(LongString::from("dlx-proxy")),
        );
        let start = AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: properties,
            mechanisms: LongString::from("PLAIN AMQPLAIN"),
            locales: LongString::from("en_US"),
        }));
        writer.write_all(&method_frame(0, start)).await?;
        // Wait for start-ok (or anything that is not a handshake reply), then close.
        while let Some(frame) = frames.next().await {
            let frame = frame.map_err(std::io::Error::other)?;
            if frame.kind == FRAME_METHOD && frame.method_ids() == (10, 11) {
                break;
            }
        }
        let text = ShortString::try_new(crate::amqp::reply::truncate_str(
            &format!("CONNECTION_FORCED - {reason}"),
            255,
        ))
        .unwrap_or_else(|_| ShortString::from("CONNECTION_FORCED"));
        let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: CONNECTION_FORCED,
            reply_text: text,
            class_id: 0,
            method_id: 0,
        }));
        writer.write_all(&method_frame(0, close)).await?;
        writer.flush().await?;
        // Give the client a moment to answer close-ok before the socket goes.
        while let Some(frame) = frames.next().await {
            let Ok(frame) = frame else { break };
            if frame.kind == FRAME_METHOD
                && matches!(
                    decode_method(&frame.payload),
                    Some(AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                )
            {
                break;
            }
        }
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(within, exchange).await;
    let _ = writer.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tune(channel_max: u16, frame_max: u32, heartbeat: u16) -> connection::Tune {
        connection::Tune {
            channel_max,
            frame_max,
            heartbeat,
        }
    }

    fn tune_ok(channel_max: u16, frame_max: u32, heartbeat: u16) -> connection::TuneOk {
        connection::TuneOk {
            channel_max,
            frame_max,
            heartbeat,
        }
    }

    #[test]
    fn client_sees_three_channels_fewer() {
        assert_eq!(tune_for_client(&tune(2047, 131072, 60)).channel_max, 2044);
        assert_eq!(tune_for_client(&tune(0, 131072, 60)).channel_max, 65532);
        assert_eq!(tune_for_client(&tune(3, 131072, 60)).channel_max, 3);
    }

    #[test]
    fn proxy_takes_the_numbers_above_the_client() {
        let (ok, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(0, 131072, 30), 4096);
        assert_eq!(ok.channel_max, 2047);
        assert_eq!(ok.heartbeat, 30);
        assert_eq!(agreed.client_channel_max, 2044);
        assert_eq!(agreed.probe_channel, Some(2045));
        assert_eq!(agreed.publisher_channel, Some(2046));
        assert_eq!(agreed.capture_channel, Some(2047));
        let (ok, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(10, 0, 0), 65536);
        assert_eq!(ok.channel_max, 13);
        assert_eq!(agreed.publisher_channel, Some(12));
        assert_eq!(agreed.frame_max, 131072);
        let (_, agreed) = negotiate(&tune(2047, 0, 60), &tune_ok(10, 0, 0), 65536);
        assert_eq!(agreed.frame_max, 65536);
    }

    #[test]
    fn a_tiny_upstream_leaves_no_proxy_channels() {
        let (ok, agreed) = negotiate(&tune(3, 4096, 0), &tune_ok(3, 4096, 0), 4096);
        assert_eq!(ok.channel_max, 3);
        assert_eq!(agreed.publisher_channel, None);
    }
}
