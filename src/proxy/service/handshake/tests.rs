//! Unit tests of [`crate::proxy::service::handshake`].

use super::*;
use crate::proxy::wire::WireCodec;
use tokio_util::codec::Decoder;

fn frames(bytes: &[u8]) -> Vec<WireFrame> {
    let mut buf = BytesMut::from(bytes);
    let mut codec = WireCodec::new(FRAME_MAX);
    std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).collect()
}

fn one(method: connection::AMQPMethod) -> WireFrame {
    frames(&method_frame(0, AMQPClass::Connection(method)))
        .pop()
        .unwrap()
}

fn decode(frame: &WireFrame) -> connection::AMQPMethod {
    match decode_method(frame.payload()) {
        Some(AMQPClass::Connection(m)) => m,
        other => panic!("not a connection method: {other:?}"),
    }
}

fn start(mechanisms: &str) -> WireFrame {
    one(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: FieldTable::default(),
        mechanisms: LongString::from(mechanisms),
        locales: LongString::from("en_US"),
    }))
}

fn identity() -> ServiceIdentity {
    ServiceIdentity {
        user: "svc".into(),
        password: "s3cret".into(),
    }
}

#[test]
fn logs_in_tunes_and_opens_the_vhost() {
    let mut hs = ClientHandshake::new(identity(), "orders", connection_name("cap", "orders"));
    let step = hs.on_frame(&start("AMQPLAIN PLAIN")).unwrap();
    let sent = frames(&step.write.unwrap());
    let connection::AMQPMethod::StartOk(start_ok) = decode(&sent[0]) else {
        panic!("expected start-ok");
    };
    assert_eq!(start_ok.mechanism.as_str(), "PLAIN");
    assert_eq!(start_ok.response.as_bytes(), b"\0svc\0s3cret");
    let props = start_ok.client_properties.inner();
    assert_eq!(
        props.get("connection_name"),
        Some(&AMQPValue::LongString(
            "dlx-proxy service cap orders".into()
        ))
    );
    let Some(AMQPValue::FieldTable(caps)) = props.get("capabilities") else {
        panic!("no capabilities");
    };
    assert_eq!(
        caps.inner().get("consumer_cancel_notify"),
        Some(&AMQPValue::Boolean(true))
    );
    // Heartbeats: the upstream's 60 s is lowered to ours; channel_max to three.
    let step = hs
        .on_frame(&one(connection::AMQPMethod::Tune(connection::Tune {
            channel_max: 2047,
            frame_max: 0,
            heartbeat: 60,
        })))
        .unwrap();
    assert!(step.open.is_none());
    let sent = frames(&step.write.unwrap());
    assert_eq!(
        decode(&sent[0]),
        connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 3,
            frame_max: FRAME_MAX,
            heartbeat: HEARTBEAT_SECS,
        })
    );
    assert_eq!(
        decode(&sent[1]),
        connection::AMQPMethod::Open(connection::Open {
            virtual_host: "orders".into(),
        })
    );
    let step = hs
        .on_frame(&one(connection::AMQPMethod::OpenOk(
            connection::OpenOk::default(),
        )))
        .unwrap();
    assert_eq!(
        step.open,
        Some(Tuned {
            channel_max: 3,
            frame_max: FRAME_MAX,
            heartbeat: HEARTBEAT_SECS
        })
    );
}

#[test]
fn a_shorter_upstream_heartbeat_wins_and_zero_means_ours() {
    let tuned = agree(&connection::Tune {
        channel_max: 0,
        frame_max: 4096,
        heartbeat: 3,
    });
    assert_eq!(
        tuned,
        Tuned {
            channel_max: 3,
            frame_max: 4096,
            heartbeat: 3
        }
    );
    assert_eq!(
        agree(&connection::Tune {
            channel_max: 0,
            frame_max: 0,
            heartbeat: 0
        })
        .heartbeat,
        HEARTBEAT_SECS
    );
}

#[test]
fn refusals_carry_the_upstream_reply_and_never_the_password() {
    let mut hs = ClientHandshake::new(identity(), "/", "n".into());
    hs.on_frame(&start("PLAIN")).unwrap();
    let err = hs
        .on_frame(&one(connection::AMQPMethod::Close(connection::Close {
            reply_code: 403,
            reply_text: "ACCESS_REFUSED - Login was refused using authentication mechanism \
                         PLAIN. For details see the broker logfile."
                .into(),
            class_id: 0,
            method_id: 0,
        })))
        .unwrap_err();
    assert!(matches!(err, HandshakeError::Refused { code: 403, .. }));
    assert!(!err.to_string().contains("s3cret"));
    assert!(!format!("{hs:?}").contains("s3cret"));
    let mut hs = ClientHandshake::new(identity(), "/", "n".into());
    assert_eq!(
        hs.on_frame(&start("AMQPLAIN EXTERNAL")).unwrap_err(),
        HandshakeError::NoPlain("AMQPLAIN EXTERNAL".into())
    );
    // Out of order: a tune before start.
    let mut hs = ClientHandshake::new(identity(), "/", "n".into());
    let err = hs
        .on_frame(&one(connection::AMQPMethod::Tune(
            connection::Tune::default(),
        )))
        .unwrap_err();
    assert!(matches!(err, HandshakeError::Unexpected(_)), "{err}");
}
