//! Protocol-level behaviour of the embedded broker: heartbeats, AMQPLAIN, byte-exact property
//! round trips, every field type, and routing through every exchange type, e2e bindings,
//! alternate exchanges and sender-selected distribution.

use crate::common;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic, connection, queue};
use amq_protocol::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use common::dl::{
    bind, bind_with, declare, exchange, exchange_bind, exchange_with, message_count, unbind,
};
use common::*;
use dlx_proxy::amqp::codec::{FRAME_BODY, FRAME_HEADER, PROTOCOL_HEADER, put_raw_frame};
use lapin::options::*;
use lapin::{BasicProperties, ExchangeKind};

fn s(v: &str) -> ShortString {
    ShortString::from(v)
}

async fn raw_declare(c: &mut RawClient, ch: u16, q: &str) {
    c.send_method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: s(q),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
    .await;
    assert!(matches!(
        c.read_method().await,
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))
    ));
}

#[tokio::test]
async fn heartbeats_are_sent_and_a_silent_peer_is_dropped() {
    let b = start().await;
    let mut c = RawClient::connect_no_handshake(b.addr).await;
    c.send_raw(&PROTOCOL_HEADER).await;
    let _start = c.read_method().await;
    c.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: s("PLAIN"),
            response: LongString::from("\0guest\0guest"),
            locale: s("en_US"),
        })),
    )
    .await;
    let _tune = c.read_method().await;
    c.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: 131072,
            heartbeat: 1,
        })),
    )
    .await;
    c.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: s("/"),
        })),
    )
    .await;
    assert!(matches!(
        c.read_method().await,
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
    ));
    // Stay silent: the server sends heartbeats, then drops us after two missed intervals.
    let started = std::time::Instant::now();
    let raw = c.read_to_end().await;
    let elapsed = started.elapsed();
    assert!(
        raw.windows(8).any(|w| w == [8, 0, 0, 0, 0, 0, 0, 0xCE]),
        "no heartbeat frame seen"
    );
    assert!(
        elapsed < Duration::from_secs(5),
        "connection not dropped: {elapsed:?}"
    );
    assert!(
        elapsed >= Duration::from_millis(1500),
        "dropped too early: {elapsed:?}"
    );
}

#[tokio::test]
async fn amqplain_authentication() {
    let b = start().await;
    let mut c = RawClient::connect_no_handshake(b.addr).await;
    c.send_raw(&PROTOCOL_HEADER).await;
    let AMQPClass::Connection(connection::AMQPMethod::Start(start)) = c.read_method().await else {
        panic!("expected start");
    };
    assert_eq!(
        String::from_utf8_lossy(start.mechanisms.as_bytes()),
        "PLAIN AMQPLAIN"
    );
    let caps = match start.server_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(t)) => t.clone(),
        other => panic!("capabilities missing: {other:?}"),
    };
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "per_consumer_qos",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        assert_eq!(
            caps.inner().get(cap),
            Some(&AMQPValue::Boolean(true)),
            "{cap}"
        );
    }
    // AMQPLAIN response: a field table without its length prefix.
    let mut resp = Vec::new();
    for (k, v) in [("LOGIN", "guest"), ("PASSWORD", "guest")] {
        resp.push(k.len() as u8);
        resp.extend_from_slice(k.as_bytes());
        resp.push(b'S');
        resp.extend_from_slice(&(v.len() as u32).to_be_bytes());
        resp.extend_from_slice(v.as_bytes());
    }
    c.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: s("AMQPLAIN"),
            response: LongString::from(resp),
            locale: s("en_US"),
        })),
    )
    .await;
    assert!(matches!(
        c.read_method().await,
        AMQPClass::Connection(connection::AMQPMethod::Tune(_))
    ));
}

/// Properties with every flag set and a headers table whose keys are NOT sorted and that
/// uses type tags amq-protocol would rewrite ('L'): delivered byte for byte.
fn hand_encoded_properties() -> Vec<u8> {
    fn sstr(out: &mut Vec<u8>, v: &str) {
        out.push(v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }
    let mut table = Vec::new();
    sstr(&mut table, "zz");
    table.push(b'I');
    table.extend_from_slice(&7i32.to_be_bytes());
    sstr(&mut table, "aa");
    table.push(b'L');
    table.extend_from_slice(&9u64.to_be_bytes());
    sstr(&mut table, "mid");
    table.push(b'S');
    table.extend_from_slice(&3u32.to_be_bytes());
    table.extend_from_slice(b"xyz");
    let mut p = Vec::new();
    p.extend_from_slice(&0xFFFCu16.to_be_bytes()); // all 14 properties present
    sstr(&mut p, "text/plain"); // content-type
    sstr(&mut p, "gzip"); // content-encoding
    p.extend_from_slice(&(table.len() as u32).to_be_bytes());
    p.extend_from_slice(&table); // headers
    p.push(2); // delivery-mode
    p.push(5); // priority
    sstr(&mut p, "corr-1");
    sstr(&mut p, "reply.q");
    sstr(&mut p, "60000"); // expiration
    sstr(&mut p, "msg-1");
    p.extend_from_slice(&1_700_000_000u64.to_be_bytes()); // timestamp
    sstr(&mut p, "kind");
    sstr(&mut p, "guest"); // user-id must be the authenticated user
    sstr(&mut p, "app");
    sstr(&mut p, "cluster");
    p
}

#[tokio::test]
async fn properties_round_trip_byte_for_byte() {
    let b = start().await;
    let mut c = RawClient::connect(b.addr).await;
    c.open_channel(1).await;
    let q = unique("bytes");
    raw_declare(&mut c, 1, &q).await;
    let props = hand_encoded_properties();
    c.send_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: s(""),
            routing_key: s(&q),
            mandatory: false,
            immediate: false,
        })),
    )
    .await;
    let body = b"exact body";
    let mut header = vec![0, 60, 0, 0];
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    header.extend_from_slice(&props);
    let mut buf = bytes::BytesMut::new();
    put_raw_frame(&mut buf, FRAME_HEADER, 1, &header);
    put_raw_frame(&mut buf, FRAME_BODY, 1, body);
    c.send_raw(&buf).await;
    c.send_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: s(&q),
            no_ack: true,
        })),
    )
    .await;
    assert!(matches!(
        c.read_method().await,
        AMQPClass::Basic(basic::AMQPMethod::GetOk(_))
    ));
    let h = c.read_frame().await.expect("header frame");
    assert_eq!(h.kind, FRAME_HEADER);
    assert_eq!(
        h.payload(),
        &header[..],
        "content header differs from what was published"
    );
    let bf = c.read_frame().await.expect("body frame");
    assert_eq!(bf.payload(), body);
}

#[tokio::test]
async fn every_property_and_field_type_survives_through_lapin() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = unique("props");
    declare(&ch, &q, FieldTable::default()).await;
    let mut nested = FieldTable::default();
    nested.insert(s("inner"), AMQPValue::LongString(LongString::from("v")));
    let mut headers = FieldTable::default();
    headers.insert(s("bool"), AMQPValue::Boolean(true));
    headers.insert(s("i8"), AMQPValue::ShortShortInt(-8));
    headers.insert(s("u8"), AMQPValue::ShortShortUInt(8));
    headers.insert(s("i16"), AMQPValue::ShortInt(-16));
    headers.insert(s("u16"), AMQPValue::ShortUInt(16));
    headers.insert(s("i32"), AMQPValue::LongInt(-32));
    headers.insert(s("u32"), AMQPValue::LongUInt(32));
    headers.insert(s("i64"), AMQPValue::LongLongInt(-64));
    headers.insert(s("f32"), AMQPValue::Float(1.5));
    headers.insert(s("f64"), AMQPValue::Double(2.25));
    headers.insert(
        s("dec"),
        AMQPValue::DecimalValue(DecimalValue {
            scale: 2,
            value: 12345,
        }),
    );
    headers.insert(s("str"), AMQPValue::LongString(LongString::from("héllo")));
    headers.insert(
        s("arr"),
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::LongString(LongString::from("two")),
            AMQPValue::FieldTable(nested.clone()),
        ])),
    );
    headers.insert(s("ts"), AMQPValue::Timestamp(1_700_000_000));
    headers.insert(s("table"), AMQPValue::FieldTable(nested));
    headers.insert(
        s("bytes"),
        AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 255])),
    );
    headers.insert(s("void"), AMQPValue::Void);
    let props = BasicProperties::default()
        .with_content_type(s("application/json"))
        .with_content_encoding(s("utf-8"))
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id(s("c"))
        .with_reply_to(s("r"))
        .with_expiration(s("100000"))
        .with_message_id(s("m"))
        .with_timestamp(42)
        .with_type(s("t"))
        .with_user_id(s("guest"))
        .with_app_id(s("a"))
        .with_cluster_id(s("cl"));
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"x",
        props.clone(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let got = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.delivery.properties, props);
}

async fn declare_bound(ch: &lapin::Channel, x: &str, key: &str, args: FieldTable) -> String {
    let q = unique("rq");
    declare(ch, &q, FieldTable::default()).await;
    bind_with(ch, &q, x, key, args).await;
    q
}

async fn send(ch: &lapin::Channel, x: &str, key: &str, headers: Option<FieldTable>) {
    let mut props = BasicProperties::default();
    if let Some(h) = headers {
        props = props.with_headers(h);
    }
    ch.basic_publish(
        x.into(),
        key.into(),
        BasicPublishOptions::default(),
        b"m",
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

#[tokio::test]
async fn topic_routing_table() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let x = unique("topic");
    exchange(&ch, &x, ExchangeKind::Topic).await;
    let patterns = ["#", "a.*", "a.#", "a.#.b", "*.b", "#.#", "*"];
    let mut queues = Vec::new();
    for p in patterns {
        queues.push(declare_bound(&ch, &x, p, FieldTable::default()).await);
    }
    let keys = ["a", "a.b", "a.x.y.b", "b", ""];
    for k in keys {
        send(&ch, &x, k, None).await;
    }
    // Expected matches per pattern over the five keys.
    let expected = [5, 1, 3, 2, 1, 5, 2];
    for (q, (p, want)) in queues.iter().zip(patterns.iter().zip(expected)) {
        assert_eq!(message_count(&ch, q).await, want, "pattern {p}");
    }
}

#[tokio::test]
async fn headers_routing_all_and_any() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let x = unique("headers");
    exchange(&ch, &x, ExchangeKind::Headers).await;
    let mut all = FieldTable::default();
    all.insert(s("x-match"), AMQPValue::LongString("all".into()));
    all.insert(s("a"), AMQPValue::LongInt(1));
    all.insert(s("b"), AMQPValue::LongString("two".into()));
    let mut any = FieldTable::default();
    any.insert(s("x-match"), AMQPValue::LongString("any".into()));
    any.insert(s("a"), AMQPValue::LongInt(1));
    any.insert(s("c"), AMQPValue::LongInt(3));
    let q_all = declare_bound(&ch, &x, "", all).await;
    let q_any = declare_bound(&ch, &x, "", any).await;
    let mut h1 = FieldTable::default();
    h1.insert(s("a"), AMQPValue::LongLongInt(1)); // numeric equality across widths
    h1.insert(s("b"), AMQPValue::LongString("two".into()));
    send(&ch, &x, "", Some(h1)).await;
    let mut h2 = FieldTable::default();
    h2.insert(s("c"), AMQPValue::LongInt(3));
    send(&ch, &x, "", Some(h2)).await;
    assert_eq!(message_count(&ch, &q_all).await, 1);
    assert_eq!(message_count(&ch, &q_any).await, 2);
}

/// A direct exchange named after `tag` whose alternate exchange is a fanout bound to a queue
/// of its own; returns the exchange and that queue.
async fn direct_with_alternate(ch: &lapin::Channel, tag: &str) -> (String, String) {
    let ae = unique("ae");
    exchange(ch, &ae, ExchangeKind::Fanout).await;
    let q_ae = declare_bound(ch, &ae, "", FieldTable::default()).await;
    let name = unique(tag);
    let mut args = FieldTable::default();
    args.insert(
        s("alternate-exchange"),
        AMQPValue::LongString(ae.as_str().into()),
    );
    let options = ExchangeDeclareOptions::default();
    exchange_with(ch, &name, ExchangeKind::Direct, options, args).await;
    (name, q_ae)
}

#[tokio::test]
async fn fanout_direct_e2e_and_alternate_exchange() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (direct, q_ae) = direct_with_alternate(&ch, "direct").await;
    let q1 = declare_bound(&ch, &direct, "k", FieldTable::default()).await;
    let q2 = declare_bound(&ch, &direct, "k", FieldTable::default()).await;
    let fan = unique("fan");
    exchange(&ch, &fan, ExchangeKind::Fanout).await;
    exchange_bind(&ch, &direct, &fan, "").await;
    send(&ch, &direct, "k", None).await; // q1, q2
    send(&ch, &direct, "other", None).await; // alternate exchange
    send(&ch, &fan, "k", None).await; // through the e2e binding: q1, q2
    assert_eq!(message_count(&ch, &q1).await, 2);
    assert_eq!(message_count(&ch, &q2).await, 2);
    assert_eq!(message_count(&ch, &q_ae).await, 1);
}

/// An exchange whose own bindings match does not use its alternate exchange, even when the
/// queue they match was already reached another way (RabbitMQ decides per exchange).
#[tokio::test]
async fn the_alternate_exchange_is_skipped_when_the_exchange_matched_a_queue_already_reached() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (inner, q_ae) = direct_with_alternate(&ch, "inner").await;
    let outer = unique("outer");
    exchange(&ch, &outer, ExchangeKind::Direct).await;
    let q = declare_bound(&ch, &outer, "k", FieldTable::default()).await;
    bind(&ch, &q, &inner, "k").await;
    exchange_bind(&ch, &inner, &outer, "k").await;
    send(&ch, &outer, "k", None).await;
    assert_eq!(message_count(&ch, &q).await, 1);
    assert_eq!(
        message_count(&ch, &q_ae).await,
        0,
        "the alternate exchange got a copy"
    );
}

/// `amq.*` exchanges can be declared again as they are (RabbitMQ checks the reserved prefix
/// only for an exchange that does not exist); a different declaration is 406.
#[tokio::test]
async fn an_equivalent_redeclare_of_a_predeclared_exchange_is_declare_ok() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        "amq.topic".into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .expect("amq.topic declared as it is");
    let err = ch
        .exchange_declare(
            "amq.topic".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(common::dl::amqp_code(&err), Some(406));
    assert!(
        common::dl::amqp_text(&err).contains("inequivalent arg 'durable'"),
        "{}",
        common::dl::amqp_text(&err)
    );
    // The alternate exchange is compared too, as RabbitMQ does.
    let ch = c.create_channel().await.unwrap();
    let mut with_ae = FieldTable::default();
    with_ae.insert(s("alternate-exchange"), AMQPValue::LongString("ae".into()));
    let err = ch
        .exchange_declare("amq.topic".into(), ExchangeKind::Topic, durable, with_ae)
        .await
        .unwrap_err();
    assert_eq!(common::dl::amqp_code(&err), Some(406));
    assert_eq!(
        common::dl::amqp_text(&err),
        "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'amq.topic' \
         in vhost '/': received the value 'ae' of type 'longstr' but current is none"
    );
    // A new exchange with the prefix is still refused.
    let ch = c.create_channel().await.unwrap();
    let err = ch
        .exchange_declare(
            "amq.new".into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(common::dl::amqp_code(&err), Some(403));
}

/// Unbinding what is not bound changes nothing: an auto-delete exchange with a binding left
/// stays, and so does one that never had a binding.
#[tokio::test]
async fn unbinding_what_is_not_bound_leaves_an_auto_delete_exchange() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let x = unique("ad");
    let auto_delete = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    exchange_with(
        &ch,
        &x,
        ExchangeKind::Direct,
        auto_delete,
        FieldTable::default(),
    )
    .await;
    let q = unique("adq");
    declare(&ch, &q, FieldTable::default()).await;
    unbind(&ch, &q, &x, "never").await;
    // The auto-delete exchange is still there.
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    exchange_with(
        &ch,
        &x,
        ExchangeKind::Direct,
        passive,
        FieldTable::default(),
    )
    .await;
}

#[tokio::test]
async fn cc_and_bcc_add_routing_keys_and_bcc_is_removed() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let x = unique("sender");
    exchange(&ch, &x, ExchangeKind::Direct).await;
    let qa = declare_bound(&ch, &x, "a", FieldTable::default()).await;
    let qb = declare_bound(&ch, &x, "b", FieldTable::default()).await;
    let qc = declare_bound(&ch, &x, "c", FieldTable::default()).await;
    let mut h = FieldTable::default();
    h.insert(
        s("CC"),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("b".into())])),
    );
    h.insert(
        s("BCC"),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("c".into())])),
    );
    send(&ch, &x, "a", Some(h)).await;
    for q in [&qa, &qb, &qc] {
        let m = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("routed");
        let headers = m.delivery.properties.headers().clone().unwrap_or_default();
        assert!(headers.inner().contains_key("CC"), "CC stays visible");
        assert!(
            !headers.inner().contains_key("BCC"),
            "BCC removed before delivery"
        );
        assert_eq!(m.delivery.routing_key.as_str(), "a");
    }
}

#[tokio::test]
async fn a_consumer_of_a_deleted_queue_is_told_only_if_it_asked_for_cancel_notifications() {
    let b = start().await;
    let (_conn, ch) = b.channel().await;
    for (announced, cancelled) in [(false, false), (true, true)] {
        let q = unique("deleted-under");
        common::dl::declare(&ch, &q, FieldTable::default()).await;
        let properties = if announced {
            capabilities(&["consumer_cancel_notify"])
        } else {
            FieldTable::default()
        };
        let mut c = RawClient::connect_with_properties(b.addr, properties).await;
        c.open_channel(1).await;
        c.consume(1, &q, true).await;
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        // A request answered after the delete: a basic.cancel, if sent, comes before it.
        c.send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: 1,
                global: false,
            })),
        )
        .await;
        let first = c.read_method().await;
        assert_eq!(
            matches!(first, AMQPClass::Basic(basic::AMQPMethod::Cancel(_))),
            cancelled,
            "capability announced: {announced}; got {first:?}"
        );
    }
}
