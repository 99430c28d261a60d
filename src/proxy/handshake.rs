//! Connection negotiation seen from the middle: the upstream's `connection.tune` is shown to the
//! client with [`RESERVED_CHANNELS`] channel numbers fewer, the client's `connection.tune-ok`
//! is passed on with those added back, and the highest channel numbers of the upstream
//! connection become the proxy's own (declare checks, dead-letter publisher). The capture
//! queue is consumed on the proxy's own service connections ([`super::service`]), not here.
//! The client's `connection.start-ok` gains the `connection.blocked` capability when it lacks
//! it ([`asking_for_blocked`]): the proxy must hear when RabbitMQ blocks the connection, and
//! keeps the notifications from such a client. Everything else in the handshake (start, SASL,
//! open) passes through unchanged.
//! The client is offered no more than `limits.channel_max` channels either.
//!
//! Also here: [`check_login`], the loopback-only rule for users such as guest, which the
//! upstream cannot apply to proxied clients (it only sees the proxy's address).

use std::collections::HashSet;

use amq_protocol::protocol::connection;
use amq_protocol::types::{AMQPValue, FieldTable};

use crate::amqp::reply::AmqpError;
use crate::broker::auth::{login_refused, sasl_user};

/// Channel numbers the proxy keeps for itself on every upstream connection.
pub const RESERVED_CHANNELS: u16 = 2;

/// What was agreed in tune / tune-ok.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Highest channel number the client may use.
    pub client_channel_max: u16,
    /// The proxy's declare-check channel (None when the upstream offers too few channels).
    pub probe_channel: Option<u16>,
    /// The proxy's dead-letter publisher channel.
    pub publisher_channel: Option<u16>,
    /// Largest frame on both legs.
    pub frame_max: u32,
    /// Heartbeat interval in seconds (0 = off).
    pub heartbeat: u16,
}

/// The upstream's channel_max with 0 read as "no limit".
fn effective_channel_max(offered: u16) -> u16 {
    if offered == 0 { u16::MAX } else { offered }
}

/// The highest channel number the client is offered: the upstream's lowered by
/// [`RESERVED_CHANNELS`] when it offers enough channels, and at most `limit`
/// (`limits.channel_max`, 0 = no limit of the proxy's own).
fn offered_channel_max(upstream: u16, limit: u16) -> u16 {
    let max = effective_channel_max(upstream);
    let offered = if max > RESERVED_CHANNELS {
        max - RESERVED_CHANNELS
    } else {
        max
    };
    offered.min(effective_channel_max(limit))
}

/// The largest frame the proxy agrees to: the upstream's offer, and at most `limit`
/// (`limits.frame_max`, which also applies when the upstream offers "no limit").
fn frame_ceiling(upstream: u32, limit: u32) -> u32 {
    if upstream == 0 {
        limit
    } else {
        upstream.min(limit)
    }
}

/// The tune the client sees: channel_max lowered by [`RESERVED_CHANNELS`] when the upstream
/// offers enough channels, and to `limit` (`limits.channel_max`); frame_max the upstream's,
/// at most `frame_limit` (`limits.frame_max`).
pub fn tune_for_client(
    upstream: &connection::Tune,
    limit: u16,
    frame_limit: u32,
) -> connection::Tune {
    let channel_max = offered_channel_max(upstream.channel_max, limit);
    connection::Tune {
        channel_max,
        frame_max: frame_ceiling(upstream.frame_max, frame_limit),
        heartbeat: upstream.heartbeat,
    }
}

/// Settles the negotiation from the upstream's tune and the client's tune-ok; returns the
/// tune-ok to send upstream and what was agreed. `limit` is `limits.channel_max`;
/// `frame_limit` is `limits.frame_max`: the frame size the proxy reads is never above it nor
/// above the upstream's offer, whatever the client asks for. A client asking for more than
/// it was offered fails the negotiation with RabbitMQ's error (which RabbitMQ only logs: it
/// ends such a connection without a connection.close).
pub fn negotiate(
    upstream: &connection::Tune,
    client: &connection::TuneOk,
    limit: u16,
    frame_limit: u32,
) -> Result<(connection::TuneOk, Negotiated), AmqpError> {
    let ceiling = frame_ceiling(upstream.frame_max, frame_limit);
    if client.frame_max > ceiling {
        return Err(AmqpError::not_allowed(format!(
            "frame_max={} > {ceiling} max size",
            client.frame_max
        )));
    }
    let reserve = effective_channel_max(upstream.channel_max) > RESERVED_CHANNELS;
    let offered = offered_channel_max(upstream.channel_max, limit);
    let chosen = if client.channel_max == 0 || client.channel_max > offered {
        offered
    } else {
        client.channel_max
    };
    let (upstream_channel_max, probe_channel, publisher_channel) = if reserve {
        (
            chosen + RESERVED_CHANNELS,
            Some(chosen + 1),
            Some(chosen + 2),
        )
    } else {
        (chosen, None, None)
    };
    let frame_max = if client.frame_max != 0 {
        client.frame_max
    } else {
        ceiling
    };
    let tune_ok = connection::TuneOk {
        channel_max: upstream_channel_max,
        frame_max: client.frame_max,
        heartbeat: client.heartbeat,
    };
    Ok((
        tune_ok,
        Negotiated {
            client_channel_max: chosen,
            probe_channel,
            publisher_channel,
            frame_max,
            heartbeat: client.heartbeat,
        },
    ))
}

/// What the proxy does with a client's `connection.start-ok`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoginCheck {
    /// Passed on to the upstream, which authenticates the client.
    Pass,
    /// A loopback-only user from another address: refused by the proxy, as RabbitMQ refuses
    /// it. `close` is the reply for a client that announced the `authentication_failure_close`
    /// capability; other clients only see the socket close (RabbitMQ does the same).
    Refuse {
        user: String,
        close: Option<AmqpError>,
    },
}

/// Applies the loopback-only rule (`proxy.loopback_users`) to a start-ok: the user named in
/// the SASL response (PLAIN or AMQPLAIN) is refused when the client is not on loopback. A
/// response the proxy cannot read is passed on (the upstream refuses it if it must).
pub fn check_login(
    start_ok: &connection::StartOk,
    peer_is_loopback: bool,
    loopback_users: &HashSet<String>,
) -> LoginCheck {
    if peer_is_loopback || loopback_users.is_empty() {
        return LoginCheck::Pass;
    }
    let mechanism = start_ok.mechanism.as_str();
    let Some(user) = sasl_user(mechanism, start_ok.response.as_bytes()) else {
        return LoginCheck::Pass;
    };
    if !loopback_users.contains(&user) {
        return LoginCheck::Pass;
    }
    let wants_close = asks_for(start_ok, "authentication_failure_close");
    LoginCheck::Refuse {
        user,
        close: wants_close.then(|| AmqpError::access_refused(login_refused(mechanism))),
    }
}

/// The capability by which a client asks for `connection.blocked` / `connection.unblocked`.
pub const BLOCKED_CAPABILITY: &str = "connection.blocked";

/// Whether the client's start-ok asks for a capability (`true` in its `capabilities` table).
fn asks_for(start_ok: &connection::StartOk, capability: &str) -> bool {
    matches!(
        start_ok.client_properties.inner().get("capabilities"),
        Some(AMQPValue::FieldTable(capabilities))
            if matches!(capabilities.inner().get(capability), Some(AMQPValue::Boolean(true)))
    )
}

/// The client's start-ok as it goes upstream when it does not ask for `connection.blocked`:
/// the proxy asks for it (it must know when RabbitMQ blocks the connection, see
/// `ClientSession::upstream_blocked`) and keeps the notifications from the client. `None`
/// when the client asks for them itself: its start-ok goes as it is.
pub fn asking_for_blocked(start_ok: &connection::StartOk) -> Option<connection::StartOk> {
    if asks_for(start_ok, BLOCKED_CAPABILITY) {
        return None;
    }
    let mut asked = start_ok.clone();
    let mut capabilities = match asked.client_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(capabilities)) => capabilities.clone(),
        _ => FieldTable::default(),
    };
    capabilities.insert(BLOCKED_CAPABILITY.into(), AMQPValue::Boolean(true));
    asked
        .client_properties
        .insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    Some(asked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::LongString;

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
    fn client_sees_two_channels_fewer() {
        assert_eq!(
            tune_for_client(&tune(2047, 131072, 60), 2047, 131072).channel_max,
            2045
        );
        assert_eq!(
            tune_for_client(&tune(0, 131072, 60), 0, 131072).channel_max,
            65533
        );
        assert_eq!(
            tune_for_client(&tune(2, 131072, 60), 0, 131072).channel_max,
            2
        );
        // limits.channel_max caps the offer.
        assert_eq!(
            tune_for_client(&tune(2047, 131072, 60), 100, 131072).channel_max,
            100
        );
        assert_eq!(
            tune_for_client(&tune(0, 131072, 60), 2047, 131072).channel_max,
            2047
        );
    }

    #[test]
    fn proxy_takes_the_numbers_above_the_client() {
        let (ok, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(0, 131072, 30), 0, 131072)
            .expect("negotiated");
        assert_eq!(ok.channel_max, 2047);
        assert_eq!(ok.heartbeat, 30);
        assert_eq!(agreed.client_channel_max, 2045);
        assert_eq!(agreed.probe_channel, Some(2046));
        assert_eq!(agreed.publisher_channel, Some(2047));
        let (ok, agreed) =
            negotiate(&tune(2047, 131072, 60), &tune_ok(10, 0, 0), 0, 262144).expect("negotiated");
        assert_eq!(ok.channel_max, 12);
        assert_eq!(agreed.publisher_channel, Some(12));
        assert_eq!(agreed.frame_max, 131072);
        let (_, agreed) =
            negotiate(&tune(2047, 0, 60), &tune_ok(10, 0, 0), 0, 65536).expect("negotiated");
        assert_eq!(agreed.frame_max, 65536);
    }

    #[test]
    fn the_frame_size_read_is_never_above_the_offer() {
        // limits.frame_max below the upstream's offer: the client is offered the limit.
        assert_eq!(
            tune_for_client(&tune(2047, 131072, 60), 0, 65536).frame_max,
            65536
        );
        // "No limit" upstream: the proxy's own limit is offered and agreed.
        assert_eq!(
            tune_for_client(&tune(2047, 0, 60), 0, 65536).frame_max,
            65536
        );
        let (ok, agreed) =
            negotiate(&tune(2047, 0, 60), &tune_ok(10, 0, 0), 0, 65536).expect("negotiated");
        assert_eq!((ok.frame_max, agreed.frame_max), (0, 65536));
        // A client asking for more than it was offered is refused as RabbitMQ refuses it,
        // instead of having the proxy buffer frames of that size.
        let refused = negotiate(
            &tune(2047, 131072, 60),
            &tune_ok(10, u32::MAX, 0),
            0,
            131072,
        )
        .expect_err("refused");
        assert_eq!(refused.code, 530);
        assert_eq!(
            refused.text,
            "NOT_ALLOWED - frame_max=4294967295 > 131072 max size"
        );
        let refused = negotiate(&tune(2047, 0, 60), &tune_ok(10, 1 << 20, 0), 0, 131072)
            .expect_err("refused");
        assert_eq!(refused.code, 530);
        let (_, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(10, 8192, 0), 0, 131072)
            .expect("negotiated");
        assert_eq!(agreed.frame_max, 8192);
    }

    #[test]
    fn a_tiny_upstream_leaves_no_proxy_channels() {
        let (ok, agreed) =
            negotiate(&tune(2, 4096, 0), &tune_ok(2, 4096, 0), 0, 4096).expect("negotiated");
        assert_eq!(ok.channel_max, 2);
        assert_eq!(agreed.publisher_channel, None);
    }

    #[test]
    fn limits_channel_max_caps_what_the_client_may_use() {
        let (ok, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(0, 131072, 0), 5, 131072)
            .expect("negotiated");
        assert_eq!(agreed.client_channel_max, 5);
        assert_eq!(ok.channel_max, 7);
        assert_eq!(agreed.publisher_channel, Some(7));
        let (_, agreed) = negotiate(&tune(2047, 131072, 60), &tune_ok(3, 131072, 0), 5, 131072)
            .expect("negotiated");
        assert_eq!(agreed.client_channel_max, 3);
    }

    fn start_ok(mechanism: &str, response: &[u8], failure_close: bool) -> connection::StartOk {
        let mut properties = FieldTable::default();
        if failure_close {
            let mut capabilities = FieldTable::default();
            capabilities.insert(
                "authentication_failure_close".into(),
                AMQPValue::Boolean(true),
            );
            properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        }
        connection::StartOk {
            client_properties: properties,
            mechanism: mechanism.into(),
            response: LongString::from(response.to_vec()),
            locale: "en_US".into(),
        }
    }

    #[test]
    fn loopback_users_are_refused_from_elsewhere_only() {
        let guest_only: HashSet<String> = ["guest".to_string()].into();
        let guest = start_ok("PLAIN", b"\0guest\0guest", true);
        assert_eq!(check_login(&guest, true, &guest_only), LoginCheck::Pass);
        assert_eq!(
            check_login(&guest, false, &HashSet::new()),
            LoginCheck::Pass
        );
        let LoginCheck::Refuse { user, close } = check_login(&guest, false, &guest_only) else {
            panic!("guest from elsewhere must be refused");
        };
        assert_eq!(user, "guest");
        let close = close.expect("the client asked for a close");
        assert_eq!(close.code, 403);
        assert_eq!(
            close.text,
            "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. \
             For details see the broker logfile."
        );
        // Without authentication_failure_close the socket just closes, as RabbitMQ does.
        let quiet = start_ok("PLAIN", b"\0guest\0wrong", false);
        assert_eq!(
            check_login(&quiet, false, &guest_only),
            LoginCheck::Refuse {
                user: "guest".into(),
                close: None
            }
        );
        let other = start_ok("PLAIN", b"\0alice\0pw", true);
        assert_eq!(check_login(&other, false, &guest_only), LoginCheck::Pass);
        // An unreadable response is the upstream's to refuse.
        let garbage = start_ok("PLAIN", b"guest", true);
        assert_eq!(check_login(&garbage, false, &guest_only), LoginCheck::Pass);
    }

    #[test]
    fn the_upstream_is_always_asked_for_blocked_notifications() {
        // No capabilities at all, and others without this one: the proxy adds it.
        for start_ok in [
            start_ok("PLAIN", b"\0a\0b", false),
            start_ok("PLAIN", b"\0a\0b", true),
        ] {
            let asked = asking_for_blocked(&start_ok).expect("asked for");
            assert!(asks_for(&asked, BLOCKED_CAPABILITY));
            // Nothing else changes.
            assert_eq!(
                asks_for(&asked, "authentication_failure_close"),
                asks_for(&start_ok, "authentication_failure_close")
            );
            assert_eq!(asked.response, start_ok.response);
            assert_eq!(asked.mechanism, start_ok.mechanism);
        }
        let asking = asking_for_blocked(&start_ok("PLAIN", b"\0a\0b", false)).unwrap();
        assert_eq!(asking_for_blocked(&asking), None, "goes as it is");
    }
}
