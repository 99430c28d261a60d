//! The client side of the AMQP handshake of a service connection, as a pure state machine:
//! frames in, frames out, no socket.
//!
//! The proxy logs in with its own service identity (`upstream.user`, SASL PLAIN), accepts the
//! upstream's tune within its own limits (two channels, [`FRAME_MAX`], a heartbeat of at most
//! [`HEARTBEAT_SECS`] so a dead node is noticed within seconds) and opens the vhost. A
//! connection.close from the upstream at any step (a wrong password, a user without access to
//! the vhost) ends the handshake with the upstream's code and text; the password never
//! appears in an error or a log line.

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::{Bytes, BytesMut};

use crate::amqp::codec::{FRAME_METHOD, decode_method};
use crate::config::ServiceIdentity;
use crate::proxy::wire::{WireFrame, method_frame};

/// Channels a service connection uses: the capture consumer, the dead-letter publisher and
/// the declare channel ([`super::judge`]).
pub const CHANNEL_MAX: u16 = 3;
/// The largest frame the proxy asks for (RabbitMQ's default).
pub const FRAME_MAX: u32 = 131_072;
/// The longest heartbeat interval the proxy accepts, in seconds.
pub const HEARTBEAT_SECS: u16 = 10;

/// What was agreed in tune / tune-ok.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuned {
    pub channel_max: u16,
    pub frame_max: u32,
    /// Seconds; 0 = no heartbeats.
    pub heartbeat: u16,
}

/// Why a handshake did not open the connection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandshakeError {
    /// The upstream closed the connection (login refused, vhost not allowed, ...).
    #[error("upstream refused the service connection: {code} {text}")]
    Refused { code: u16, text: String },
    #[error("upstream offers no PLAIN login (mechanisms: {0})")]
    NoPlain(String),
    #[error("unexpected frame during the handshake: {0}")]
    Unexpected(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    AwaitStart,
    AwaitTune,
    AwaitOpenOk,
    Open,
}

/// What one handshake frame asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct HandshakeStep {
    /// Frames to send to the upstream.
    pub write: Option<Bytes>,
    /// The connection is open with these parameters.
    pub open: Option<Tuned>,
}

/// The handshake of one service connection.
#[derive(Debug)]
pub struct ClientHandshake {
    identity: ServiceIdentity,
    vhost: String,
    /// Shown as the connection's `connection_name` in RabbitMQ.
    name: String,
    stage: Stage,
    tuned: Option<Tuned>,
}

impl ClientHandshake {
    /// The handshake for `vhost`; `name` is shown as the connection's `connection_name`.
    pub fn new(identity: ServiceIdentity, vhost: &str, name: String) -> Self {
        ClientHandshake {
            identity,
            vhost: vhost.to_string(),
            name,
            stage: Stage::AwaitStart,
            tuned: None,
        }
    }

    /// Handles one frame from the upstream.
    pub fn on_frame(&mut self, frame: &WireFrame) -> Result<HandshakeStep, HandshakeError> {
        if frame.is_heartbeat() {
            return Ok(HandshakeStep::default());
        }
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            return Err(HandshakeError::Unexpected(format!(
                "frame type {} on channel {}",
                frame.kind, frame.channel
            )));
        }
        let method = decode_method(frame.payload()).ok_or_else(|| {
            HandshakeError::Unexpected(format!("method {:?} does not parse", frame.method_ids()))
        })?;
        let AMQPClass::Connection(method) = method else {
            return Err(HandshakeError::Unexpected(format!(
                "method {:?}",
                frame.method_ids()
            )));
        };
        match (self.stage, method) {
            (_, connection::AMQPMethod::Close(close)) => Err(HandshakeError::Refused {
                code: close.reply_code,
                text: close.reply_text.as_str().to_string(),
            }),
            (Stage::AwaitStart, connection::AMQPMethod::Start(start)) => {
                let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
                if !mechanisms.split_whitespace().any(|m| m == "PLAIN") {
                    return Err(HandshakeError::NoPlain(mechanisms));
                }
                self.stage = Stage::AwaitTune;
                Ok(HandshakeStep {
                    write: Some(self.start_ok()),
                    open: None,
                })
            }
            (Stage::AwaitTune, connection::AMQPMethod::Tune(tune)) => {
                let tuned = agree(&tune);
                self.tuned = Some(tuned);
                self.stage = Stage::AwaitOpenOk;
                let mut out = BytesMut::new();
                out.extend_from_slice(&method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                        channel_max: tuned.channel_max,
                        frame_max: tuned.frame_max,
                        heartbeat: tuned.heartbeat,
                    })),
                ));
                let vhost = ShortString::try_new(self.vhost.clone()).map_err(|_| {
                    HandshakeError::Unexpected("vhost name longer than 255 bytes".into())
                })?;
                out.extend_from_slice(&method_frame(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                        virtual_host: vhost,
                    })),
                ));
                Ok(HandshakeStep {
                    write: Some(out.freeze()),
                    open: None,
                })
            }
            (Stage::AwaitOpenOk, connection::AMQPMethod::OpenOk(_)) => {
                self.stage = Stage::Open;
                Ok(HandshakeStep {
                    write: None,
                    open: self.tuned,
                })
            }
            (stage, _) => Err(HandshakeError::Unexpected(format!(
                "method {:?} while waiting for {}",
                frame.method_ids(),
                match stage {
                    Stage::AwaitStart => "connection.start",
                    Stage::AwaitTune => "connection.tune",
                    Stage::AwaitOpenOk => "connection.open-ok",
                    Stage::Open => "nothing",
                }
            ))),
        }
    }

    fn start_ok(&self) -> Bytes {
        let mut capabilities = FieldTable::default();
        for name in [
            "consumer_cancel_notify",
            "publisher_confirms",
            "authentication_failure_close",
            "connection.blocked",
        ] {
            capabilities.insert(ShortString::from(name), AMQPValue::Boolean(true));
        }
        let mut properties = FieldTable::default();
        properties.insert(
            ShortString::from("product"),
            AMQPValue::LongString(LongString::from("dlx-proxy")),
        );
        properties.insert(
            ShortString::from("version"),
            AMQPValue::LongString(LongString::from(env!("CARGO_PKG_VERSION"))),
        );
        properties.insert(
            ShortString::from("connection_name"),
            AMQPValue::LongString(LongString::from(self.name.as_str())),
        );
        properties.insert(
            ShortString::from("capabilities"),
            AMQPValue::FieldTable(capabilities),
        );
        let mut response = Vec::with_capacity(
            2 + self.identity.user.len() + self.identity.password.expose().len(),
        );
        response.push(0);
        response.extend_from_slice(self.identity.user.as_bytes());
        response.push(0);
        response.extend_from_slice(self.identity.password.expose().as_bytes());
        method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: properties,
                mechanism: ShortString::from("PLAIN"),
                response: LongString::from(response),
                locale: ShortString::from("en_US"),
            })),
        )
    }
}

/// The `connection_name` a vhost's service connection shows in RabbitMQ (the capture name
/// tells deployments sharing one upstream apart).
pub fn connection_name(capture_name: &str, vhost: &str) -> String {
    format!("dlx-proxy service {capture_name} {vhost}")
}

/// The `connection_name` a vhost's declare connection shows in RabbitMQ.
pub fn declare_connection_name(capture_name: &str, vhost: &str) -> String {
    format!("dlx-proxy declares {capture_name} {vhost}")
}

/// Our limits against the upstream's offer (0 = no limit on its side).
fn agree(tune: &connection::Tune) -> Tuned {
    let lower = |offered: u32, ours: u32| {
        if offered == 0 {
            ours
        } else {
            offered.min(ours)
        }
    };
    Tuned {
        channel_max: lower(u32::from(tune.channel_max), u32::from(CHANNEL_MAX)) as u16,
        frame_max: lower(tune.frame_max, FRAME_MAX),
        heartbeat: lower(u32::from(tune.heartbeat), u32::from(HEARTBEAT_SECS)) as u16,
    }
}

#[cfg(test)]
mod tests;
