//! Writes the hand-made seeds of the raw byte targets into `corpus/<target>/seed-*`:
//! real frames, content headers and field tables encoded with amq-protocol and the crate's
//! own encoders. Run from `fuzz/`: `cargo run --example write_seeds`. The structured targets
//! (`queue_args`, `policy_merge`, `x_death`) take `arbitrary` input, which has no encoder:
//! their seeds are a minimised set of inputs kept from a fuzz run (see `.ci/fuzz.sh`).

use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, channel, connection, queue};
use amq_protocol::types::generation::gen_field_table;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use dlx_proxy::amqp::codec::{put_heartbeat, put_method};
use dlx_proxy::amqp::content::{encode_properties, put_content};
use dlx_proxy::deadletter::XDeathEntry;
use std::path::Path;

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text))
}

fn table(fields: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in fields {
        t.insert(ShortString::from(k), v);
    }
    t
}

fn queue_arguments() -> FieldTable {
    table(vec![
        ("x-dead-letter-exchange", long("dlx")),
        ("x-dead-letter-routing-key", long("rk")),
        ("x-message-ttl", AMQPValue::LongInt(1000)),
        ("x-max-length", AMQPValue::LongLongInt(10)),
        ("x-overflow", long("reject-publish-dlx")),
        ("x-queue-type", long("quorum")),
        ("x-delivery-limit", AMQPValue::ShortShortUInt(3)),
    ])
}

/// Headers of a message that died twice and carries CC and BCC keys, plus one of each
/// remaining value type.
fn message_headers() -> FieldTable {
    let entry = |queue: &str, reason: &str, count| XDeathEntry {
        queue: queue.into(),
        reason: reason.into(),
        time: 1_700_000_000,
        exchange: "x".into(),
        routing_keys: vec!["rk".into()],
        count,
        original_expiration: Some("100".into()),
    };
    table(vec![
        (
            "x-death",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::FieldTable(entry("q1", "expired", 2).to_field_table()),
                AMQPValue::FieldTable(entry("q2", "rejected", 1).to_field_table()),
            ])),
        ),
        ("x-first-death-queue", long("q2")),
        (
            "CC",
            AMQPValue::FieldArray(FieldArray::from(vec![long("a"), long("b")])),
        ),
        (
            "BCC",
            AMQPValue::FieldArray(FieldArray::from(vec![long("c")])),
        ),
        ("flag", AMQPValue::Boolean(true)),
        ("d", AMQPValue::Double(1.5)),
        ("f", AMQPValue::Float(0.5)),
        ("t", AMQPValue::Timestamp(5)),
        ("v", AMQPValue::Void),
        ("u", AMQPValue::ShortUInt(7)),
        ("i", AMQPValue::ShortInt(-7)),
        ("I", AMQPValue::LongUInt(70_000)),
        ("x", AMQPValue::ByteArray(vec![1, 2, 3].into())),
        (
            "D",
            AMQPValue::DecimalValue(amq_protocol::types::DecimalValue {
                scale: 2,
                value: 314,
            }),
        ),
    ])
}

fn properties() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_delivery_mode(2)
        .with_priority(1)
        .with_expiration("60000".into())
        .with_message_id("m1".into())
        .with_timestamp(1_700_000_000)
        .with_user_id("guest".into())
        .with_headers(message_headers())
}

/// A content header frame's payload: class 60, weight 0, body size, properties.
fn content_header_payload(props: &BasicProperties, body_size: u64) -> Vec<u8> {
    let mut payload = vec![0, 60, 0, 0];
    payload.extend_from_slice(&body_size.to_be_bytes());
    payload.extend_from_slice(&encode_properties(props));
    payload
}

fn encoded_table(t: &FieldTable) -> Vec<u8> {
    gen_field_table(t)(WriteContext::from(Vec::new()))
        .expect("encodes")
        .write
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("corpus directory");
    std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("seed written");
}

fn main() {
    // frame_decode: [frame_max step, read size, stream...]
    let mut stream = BytesMut::new();
    put_method(
        &mut stream,
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: table(vec![
                ("product", long("seed")),
                (
                    "capabilities",
                    AMQPValue::FieldTable(table(vec![(
                        "publisher_confirms",
                        AMQPValue::Boolean(true),
                    )])),
                ),
            ]),
            mechanism: "PLAIN".into(),
            response: LongString::from("\0guest\0guest"),
            locale: "en_US".into(),
        })),
    );
    put_method(
        &mut stream,
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    put_method(
        &mut stream,
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q1".into(),
            durable: true,
            arguments: queue_arguments(),
            ..Default::default()
        })),
    );
    put_method(
        &mut stream,
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q1".into(),
            mandatory: true,
            immediate: false,
        })),
    );
    put_content(
        &mut stream,
        1,
        &encode_properties(&properties()),
        &[7; 5000],
        4096,
    );
    put_heartbeat(&mut stream);
    put_method(
        &mut stream,
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    let mut seed = vec![0, 61];
    seed.extend_from_slice(&stream);
    write("frame_decode", "session", &seed);

    // content_header: one header payload with every property, one with none.
    write(
        "content_header",
        "all-properties",
        &content_header_payload(&properties(), 5000),
    );
    write(
        "content_header",
        "no-properties",
        &content_header_payload(&BasicProperties::default(), 0),
    );

    // field_table: even selector = raw table bytes.
    for (name, t) in [
        ("queue-arguments", queue_arguments()),
        ("message-headers", message_headers()),
    ] {
        let mut seed = vec![0];
        seed.extend_from_slice(&encoded_table(&t));
        write("field_table", name, &seed);
    }
}
