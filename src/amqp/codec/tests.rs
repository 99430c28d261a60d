//! Unit tests of [`crate::amqp::codec`].

use super::*;

#[test]
fn known_methods_agree_with_amq_protocol() {
    use amq_protocol::protocol::{basic, confirm, connection, exchange};
    let ids = |m: AMQPClass| (m.get_amqp_class_id(), m.get_amqp_method_id());
    for method in [
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack::default())),
        AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})),
        AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
            connection::UpdateSecretOk {},
        )),
    ] {
        let (class_id, method_id) = ids(method);
        assert!(
            is_known_method(class_id, method_id),
            "{class_id}.{method_id}"
        );
    }
    assert!(!is_known_method(60, 99));
    assert!(!is_known_method(99, 1));
    assert!(!is_known_method(0, 0));
    assert!(!is_known_method(20, 30), "channel.alert of AMQP 0-8");
}
use amq_protocol::protocol::channel;

fn encode(kind: u8, ch: u16, payload: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    put_raw_frame(&mut b, kind, ch, payload);
    b
}

#[test]
fn decodes_frames_split_across_reads() {
    let mut codec = FrameCodec::new(4096);
    let whole = encode(FRAME_BODY, 3, b"hello");
    let mut buf = BytesMut::new();
    for (i, byte) in whole.iter().enumerate() {
        buf.put_u8(*byte);
        let got = codec.decode(&mut buf).unwrap();
        if i + 1 < whole.len() {
            assert!(got.is_none());
        } else {
            let f = got.unwrap();
            assert_eq!((f.kind, f.channel, &f.payload[..]), (3, 3, &b"hello"[..]));
        }
    }
    assert!(buf.is_empty());
}

#[test]
fn refuses_oversized_frame_before_buffering() {
    let mut codec = FrameCodec::new(4096);
    let mut buf = BytesMut::new();
    buf.put_u8(FRAME_BODY);
    buf.put_u16(1);
    buf.put_u32(10_000_000);
    assert!(matches!(
        codec.decode(&mut buf),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn refuses_bad_frame_end_and_type() {
    let mut codec = FrameCodec::new(4096);
    let mut buf = encode(FRAME_BODY, 1, b"x");
    let last = buf.len() - 1;
    buf[last] = 0;
    assert!(matches!(
        codec.decode(&mut buf),
        Err(FrameError::BadFrameEnd(0))
    ));
    let mut buf = encode(7, 1, b"x");
    assert!(matches!(
        codec.decode(&mut buf),
        Err(FrameError::UnknownType(7))
    ));
}

/// What a hand encoder writes into an empty buffer.
fn encoded(put: impl FnOnce(&mut BytesMut)) -> BytesMut {
    let mut b = BytesMut::new();
    put(&mut b);
    b
}

#[test]
fn hand_encoded_methods_match_amq_protocol() {
    use amq_protocol::protocol::basic;
    let cases: Vec<(BytesMut, AMQPClass)> = vec![
        (
            encoded(|b| put_basic_deliver(b, 3, "ctag", 42, true, "x", "rk")),
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag".into(),
                delivery_tag: 42,
                redelivered: true,
                exchange: "x".into(),
                routing_key: "rk".into(),
            })),
        ),
        (
            encoded(|b| put_basic_get_ok(b, 3, 7, false, "", "q", 9)),
            AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                delivery_tag: 7,
                redelivered: false,
                exchange: "".into(),
                routing_key: "q".into(),
                message_count: 9,
            })),
        ),
        (
            encoded(|b| put_basic_ack(b, 3, 5, true)),
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 5,
                multiple: true,
            })),
        ),
        (
            encoded(|b| put_basic_nack(b, 3, 5, false, true)),
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: 5,
                multiple: false,
                requeue: true,
            })),
        ),
        (
            encoded(|b| put_basic_publish(b, 3, "dlx", "orders.dead", true)),
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "dlx".into(),
                routing_key: "orders.dead".into(),
                mandatory: true,
                immediate: false,
            })),
        ),
        (
            encoded(|b| put_basic_publish(b, 3, "", "q", false)),
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "q".into(),
                mandatory: false,
                immediate: false,
            })),
        ),
        (
            encoded(|b| put_basic_reject(b, 3, 11, true)),
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag: 11,
                requeue: true,
            })),
        ),
    ];
    for (hand, method) in cases {
        let mut generated = BytesMut::new();
        put_method(&mut generated, 3, method);
        assert_eq!(hand, generated);
    }
}

#[test]
fn method_round_trip() {
    let mut buf = BytesMut::new();
    put_method(
        &mut buf,
        5,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    );
    let mut codec = FrameCodec::new(4096);
    let f = codec.decode(&mut buf).unwrap().unwrap();
    assert_eq!(f.kind, FRAME_METHOD);
    assert_eq!(f.channel, 5);
    assert_eq!(method_ids(&f.payload), (20, 11));
    assert!(matches!(
        decode_method(&f.payload),
        Some(AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
    ));
    assert!(decode_method(&f.payload[..3]).is_none());
}
