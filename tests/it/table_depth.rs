//! Field tables nested deeper than anything decodes recursively (issue #11): method arguments
//! beyond `limits.max_table_depth` close only the connection that sent them (501
//! FRAME_ERROR), in both modes; the limit's ceiling is safe on a tokio worker's stack.
//!
//! The frames are built by hand (`common::deep`): lapin cannot encode 10 000 levels.

use crate::common;
use crate::proxy_support;

use common::deep::{self, table_of_depth};
use lapin::options::BasicGetOptions;
use lapin::types::FieldTable;
use proxy_support::*;

const DEEP: usize = 10_000;
/// Levels of a start-ok's client properties: past every limit, yet the frame stays within
/// the 8192 bytes a client may send before it is tuned (7 bytes a level).
const START_OK_DEEP: usize = 1_000;
const CEILING: usize = dlx_proxy::amqp::depth::MAX_TABLE_DEPTH_CEILING;

/// Asserts the 501 close that names the limit, answers it, and sees the connection end.
async fn expect_too_deep(client: &mut RawClient, limit: usize) {
    let (code, text) = client.expect_connection_close().await;
    assert_eq!(code, 501, "{text}");
    assert!(text.starts_with("FRAME_ERROR - cannot decode"), "{text}");
    assert!(
        text.contains(&format!("limits.max_table_depth ({limit})")),
        "{text}"
    );
    client.send_close_ok().await;
    client.expect_end().await;
}

/// A queue holding one message "kept", declared and filled over `ch`.
async fn queue_with_a_message(ch: &lapin::Channel) -> String {
    let q = unique("depth-kept");
    declare(ch, &q, FieldTable::default()).await;
    common::dl::publish(ch, &q, &["kept"]).await;
    q
}

/// The message is still in `q`, and the connection still publishes and gets.
async fn still_works(ch: &lapin::Channel, q: &str) {
    let got = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the queued message is still there");
    assert_eq!(payload(&got), "kept");
    common::dl::publish(ch, q, &["after"]).await;
    let got = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message published afterwards");
    assert_eq!(payload(&got), "after");
}

/// Sends 10 000 levels of tables, then of arrays, in queue.declare arguments on fresh raw
/// connections to `addr`, and a start-ok with 1 000 levels of client properties.
async fn refuse_deep_methods(addr: std::net::SocketAddr, limit: usize, start_ok: bool) {
    for kind in [b'F', b'A'] {
        let mut client = RawClient::connect(addr).await;
        client.open_channel(1).await;
        let arguments = table_of_depth(kind, DEEP);
        client
            .send_raw(&deep::queue_declare(1, &unique("deep"), &arguments))
            .await;
        expect_too_deep(&mut client, limit).await;
    }
    if start_ok {
        let mut client = RawClient::connect_no_handshake(addr).await;
        client
            .send_raw(&dlx_proxy::amqp::codec::PROTOCOL_HEADER)
            .await;
        client.expect_method(10, 10).await;
        client
            .send_raw(&deep::start_ok(&table_of_depth(b'F', START_OK_DEEP)))
            .await;
        expect_too_deep(&mut client, limit).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_deep_method_arguments_close_only_that_connection() {
    let broker = common::start().await;
    let (_conn, ch) = broker.channel().await;
    let q = queue_with_a_message(&ch).await;
    refuse_deep_methods(broker.addr, 64, true).await;
    still_works(&ch, &q).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_deep_method_arguments_close_only_that_connection() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue_with_a_message(&ch).await;
    // queue.declare is decoded by the proxy (start-ok passes through to RabbitMQ).
    refuse_deep_methods(proxy.addr, 64, false).await;
    // basic.consume is decoded by the proxy too.
    let mut client = RawClient::connect(proxy.addr).await;
    client.open_channel(1).await;
    let consume = deep::method_with_table(
        1,
        (60, 20),
        &deep::fields(true, &[&q, ""], Some(0)),
        &table_of_depth(b'A', DEEP),
    );
    client.send_raw(&consume).await;
    expect_too_deep(&mut client, 64).await;
    still_works(&ch, &q).await;
    let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    proxy.stop().await;
}

/// Declares `q` with arguments `depth` deep (tables and arrays) and expects declare-ok.
async fn declare_ok(client: &mut RawClient, q: &str, kind: u8, depth: usize) {
    client
        .send_raw(&deep::queue_declare(1, q, &table_of_depth(kind, depth)))
        .await;
    client.expect_method(50, 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_limit_accepts_its_depth_and_refuses_one_more() {
    let mut config = common::test_config();
    config.limits.max_table_depth = 5;
    let broker = common::start_with(config).await;
    let mut client = RawClient::connect(broker.addr).await;
    client.open_channel(1).await;
    declare_ok(&mut client, &unique("five"), b'F', 5).await;
    declare_ok(&mut client, &unique("five"), b'A', 5).await;
    client
        .send_raw(&deep::queue_declare(
            1,
            &unique("six"),
            &table_of_depth(b'A', 6),
        ))
        .await;
    expect_too_deep(&mut client, 5).await;
}

/// Every method that carries a table, with arguments exactly `depth` deep, on one channel:
/// queue.declare twice (the redeclare compares the arguments), exchange.declare (headers),
/// queue.bind and queue.unbind, basic.consume. Each must be answered.
async fn every_table_method_at(
    client: &mut RawClient,
    depth: usize,
    prefix: &str,
) -> (String, String) {
    let q = unique(prefix);
    let x = unique(prefix);
    for kind in [b'F', b'A'] {
        let args = table_of_depth(kind, depth);
        let q = format!("{q}-{}", kind as char);
        declare_ok(client, &q, kind, depth).await;
        declare_ok(client, &q, kind, depth).await;
        let x = format!("{x}-{}", kind as char);
        let declare_x = deep::method_with_table(
            1,
            (40, 10),
            &deep::fields(true, &[&x, "headers"], Some(0)),
            &args,
        );
        client.send_raw(&declare_x).await;
        client.expect_method(40, 11).await;
        let bind = deep::method_with_table(
            1,
            (50, 20),
            &deep::fields(true, &[&q, &x, "rk"], Some(0)),
            &args,
        );
        client.send_raw(&bind).await;
        client.expect_method(50, 21).await;
        let unbind = deep::method_with_table(
            1,
            (50, 50),
            &deep::fields(true, &[&q, &x, "rk"], None),
            &args,
        );
        client.send_raw(&unbind).await;
        client.expect_method(50, 51).await;
        let consume = deep::method_with_table(
            1,
            (60, 20),
            &deep::fields(true, &[&q, &format!("deep-{}", kind as char)], Some(0)),
            &args,
        );
        client.send_raw(&consume).await;
        client.expect_method(60, 21).await;
        // A known argument with a deep value: refused with 406 (its text describes the value),
        // on a first declaration and on a redeclaration.
        let bad = deep::table(&[deep::entry(
            "x-dead-letter-exchange",
            kind,
            &deep::nested(kind, depth - 1),
        )]);
        client.send_raw(&deep::queue_declare(1, &q, &bad)).await;
        expect_channel_refusal(client, 406).await;
        let fresh = format!("{q}-bad");
        client.send_raw(&deep::queue_declare(1, &fresh, &bad)).await;
        expect_channel_refusal(client, 406).await;
    }
    (q, x)
}

/// channel.close with `code` on channel 1: answered, and the channel opened again.
async fn expect_channel_refusal(client: &mut RawClient, code: u16) {
    let close = client.expect_method(20, 40).await;
    assert_eq!(u16::from_be_bytes([close[4], close[5]]), code);
    client.send_raw(&deep::frame(1, 1, &[0, 20, 0, 41])).await;
    client.open_channel(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_table_depth_ceiling_is_safe_on_a_worker_stack() {
    // Embedded: the broker's tasks run on this runtime's workers (2 MiB stacks).
    let mut config = common::test_config();
    config.limits.max_table_depth = CEILING;
    let broker = common::start_with(config).await;
    let mut client = RawClient::connect(broker.addr).await;
    client.open_channel(1).await;
    every_table_method_at(&mut client, CEILING, "ceiling").await;
    // Closing the connection drops every stored deep value.
    drop(client);
    let (_conn, ch) = broker.channel().await;
    let q = queue_with_a_message(&ch).await;
    still_works(&ch, &q).await;

    // Proxy: the proxy decodes, merges and re-encodes queue.declare and decodes basic.consume.
    let proxy = TestProxy::start_with(vec![], |c| c.limits.max_table_depth = CEILING).await;
    let mut client = RawClient::connect(proxy.addr).await;
    client.open_channel(1).await;
    let (q, x) = every_table_method_at(&mut client, CEILING, "ceiling-proxy").await;
    drop(client);
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    for kind in ['F', 'A'] {
        let _ = ch
            .queue_delete(format!("{q}-{kind}").as_str().into(), Default::default())
            .await;
        let _ = ch
            .exchange_delete(format!("{x}-{kind}").as_str().into(), Default::default())
            .await;
    }
    proxy.stop().await;
}

// ------------------------------------------------------------------------------------------
// Message headers: never refused, carried byte-exact, dead-lettered with the deep entries
// ------------------------------------------------------------------------------------------

/// Headers with a 10 000-level array, a 10 000-level table and a plain string, and the
/// property section carrying them.
struct DeepHeaders {
    array: Vec<u8>,
    table: Vec<u8>,
    properties: Vec<u8>,
}

impl DeepHeaders {
    fn new() -> DeepHeaders {
        let array = deep::nested(b'A', DEEP);
        let table = deep::nested(b'F', DEEP);
        let headers = deep::table(&[
            deep::entry("app", b'S', &[0, 0, 0, 2, b'o', b'k']),
            deep::entry("deep-array", b'A', &array),
            deep::entry("deep-table", b'F', &table),
        ]);
        DeepHeaders {
            array,
            table,
            properties: deep::headers_properties(&headers),
        }
    }

    /// Publishes `body` to `queue` through the default exchange on `channel`.
    async fn publish(&self, client: &mut RawClient, channel: u16, queue: &str, body: &str) {
        client
            .send_raw(&deep::publish(
                channel,
                "",
                queue,
                &self.properties,
                body.as_bytes(),
            ))
            .await;
    }

    /// A dead letter's headers: both deep entries byte for byte, "app" kept, and one x-death
    /// entry for `queue` and `reason` with RabbitMQ's field types.
    fn assert_dead_letter(&self, properties: &[u8], queue: &str, reason: &str) {
        use amq_protocol::types::{AMQPValue, FieldArray, LongString};
        let entries = deep::header_entries(properties);
        let raw = |key: &str| {
            entries
                .iter()
                .find(|e| e.key == key)
                .unwrap_or_else(|| panic!("header {key} missing: {entries:?}"))
        };
        assert_eq!(raw("deep-array").kind, b'A');
        assert!(raw("deep-array").value == self.array, "deep-array changed");
        assert_eq!(raw("deep-table").kind, b'F');
        assert!(raw("deep-table").value == self.table, "deep-table changed");
        let headers = deep::decode_entries(&entries, &["deep-array", "deep-table"]);
        let headers = headers.inner();
        let s = |v: &str| AMQPValue::LongString(LongString::from(v));
        assert_eq!(headers.get("app"), Some(&s("ok")));
        assert_eq!(headers.get("x-first-death-reason"), Some(&s(reason)));
        assert_eq!(headers.get("x-first-death-queue"), Some(&s(queue)));
        assert_eq!(headers.get("x-first-death-exchange"), Some(&s("")));
        let Some(AMQPValue::FieldArray(deaths)) = headers.get("x-death") else {
            panic!("x-death is not an array: {headers:?}");
        };
        let [AMQPValue::FieldTable(death)] = deaths.as_slice() else {
            panic!("one x-death entry expected: {deaths:?}");
        };
        let death = death.inner();
        assert_eq!(death.get("count"), Some(&AMQPValue::LongLongInt(1)));
        assert_eq!(death.get("reason"), Some(&s(reason)));
        assert_eq!(death.get("queue"), Some(&s(queue)));
        assert_eq!(death.get("exchange"), Some(&s("")));
        assert_eq!(
            death.get("routing-keys"),
            Some(&AMQPValue::FieldArray(FieldArray::from(vec![s(queue)])))
        );
        let Some(AMQPValue::Timestamp(time)) = death.get("time") else {
            panic!("x-death time is not a timestamp: {death:?}");
        };
        assert!(time.abs_diff(common::dl::now_secs()) < 60, "time {time}");
    }
}

/// basic.reject requeue=false.
async fn reject(client: &mut RawClient, channel: u16, delivery_tag: u64) {
    use amq_protocol::protocol::{AMQPClass, basic};
    client
        .send_method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag,
                requeue: false,
            })),
        )
        .await;
}

/// The next delivery on the raw client must be `body` with exactly the deep properties.
async fn expect_exact(client: &mut RawClient, headers: &DeepHeaders, body: &str) -> u64 {
    let delivery = client.next_delivery().await;
    assert_eq!(delivery.body, body.as_bytes());
    assert!(
        delivery.properties[..] == headers.properties[..],
        "properties not delivered byte for byte"
    );
    delivery.delivery_tag
}

/// Queues that dead-letter to `dlq` through the default exchange: `rejecting` (plain),
/// `expiring` (x-message-ttl 0 and no consumer), `overflowing` (x-max-length 1).
async fn dead_lettering_queues(ch: &lapin::Channel, prefix: &str) -> [String; 4] {
    use common::dl::{dead_letter_to, int};
    let [dlq, rejecting, expiring, overflowing] =
        ["dlq", "rejected", "expired", "maxlen"].map(|s| unique(&format!("{prefix}-{s}")));
    declare(ch, &dlq, FieldTable::default()).await;
    declare(ch, &rejecting, dead_letter_to(&dlq, &[])).await;
    declare(
        ch,
        &expiring,
        dead_letter_to(&dlq, &[("x-message-ttl", int(0))]),
    )
    .await;
    declare(
        ch,
        &overflowing,
        dead_letter_to(&dlq, &[("x-max-length", int(1))]),
    )
    .await;
    [dlq, rejecting, expiring, overflowing]
}

/// Publish → deliver byte-exact; reject, TTL expiry and max-length each dead-letter it with
/// the deep entries intact. `publisher` and `consumer` are raw clients of the mode under
/// test (or, for `publisher`, of RabbitMQ itself).
async fn deep_headers_round_trip(
    publisher: &mut RawClient,
    consumer: &mut RawClient,
    ch: &lapin::Channel,
    prefix: &str,
) -> [String; 4] {
    let headers = DeepHeaders::new();
    let queues = dead_lettering_queues(ch, prefix).await;
    let [dlq, rejecting, expiring, overflowing] = &queues;
    publisher.open_channel(1).await;
    publisher
        .send_method(
            1,
            amq_protocol::protocol::AMQPClass::Confirm(
                amq_protocol::protocol::confirm::AMQPMethod::Select(
                    amq_protocol::protocol::confirm::Select { nowait: false },
                ),
            ),
        )
        .await;
    publisher.expect_method(85, 11).await;
    headers.publish(publisher, 1, rejecting, rejecting).await;
    headers.publish(publisher, 1, expiring, expiring).await;
    headers
        .publish(publisher, 1, overflowing, "pushed out")
        .await;
    headers
        .publish(publisher, 1, overflowing, overflowing)
        .await;
    // Every publish confirmed: routed (and the expiry and overflow deaths happened).
    let mut confirmed = 0;
    while confirmed < 4 {
        let ack = publisher.expect_method(60, 80).await;
        confirmed = u64::from_be_bytes(ack[4..12].try_into().unwrap());
    }

    consumer.open_channel(1).await;
    consumer.consume(1, rejecting, false).await;
    let tag = expect_exact(consumer, &headers, rejecting).await;
    reject(consumer, 1, tag).await;
    consumer.consume(1, overflowing, true).await;
    expect_exact(consumer, &headers, overflowing).await;

    // The dead letters arrive in the order the deaths happened: the expiry and the overflow
    // at publish, the rejection last.
    let mut arrived = Vec::new();
    consumer.open_channel(2).await;
    consumer.consume(2, dlq, true).await;
    for _ in 0..3 {
        let delivery = consumer.next_delivery().await;
        arrived.push((
            String::from_utf8(delivery.body).unwrap(),
            delivery.properties,
        ));
    }
    for (queue, reason, body) in [
        (rejecting, "rejected", rejecting.as_str()),
        (expiring, "expired", expiring.as_str()),
        (overflowing, "maxlen", "pushed out"),
    ] {
        let (_, properties) = arrived
            .iter()
            .find(|(b, _)| b == body)
            .unwrap_or_else(|| panic!("no dead letter from {queue}"));
        headers.assert_dead_letter(properties, queue, reason);
    }
    queues
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_deep_headers_are_carried_and_dead_lettered() {
    let broker = common::start().await;
    let (_conn, ch) = broker.channel().await;
    let mut publisher = RawClient::connect(broker.addr).await;
    let mut consumer = RawClient::connect(broker.addr).await;
    deep_headers_round_trip(&mut publisher, &mut consumer, &ch, "emb").await;
    // Nothing was lost on the way: the broker still serves.
    let q = queue_with_a_message(&ch).await;
    still_works(&ch, &q).await;
}

async fn delete_queues(queues: &[String]) {
    let upstream = upstream_connection().await;
    let ch = upstream.create_channel().await.unwrap();
    for q in queues {
        let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_deep_headers_are_carried_and_dead_lettered() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut publisher = RawClient::connect(proxy.addr).await;
    let mut consumer = RawClient::connect(proxy.addr).await;
    let queues = deep_headers_round_trip(&mut publisher, &mut consumer, &ch, "prx").await;
    delete_queues(&queues).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_dead_letters_deep_headers_published_straight_to_rabbitmq() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let upstream_addr = proxy_support::upstream_host().parse().unwrap();
    let mut publisher = RawClient::connect(upstream_addr).await;
    let mut consumer = RawClient::connect(proxy.addr).await;
    let queues = deep_headers_round_trip(&mut publisher, &mut consumer, &ch, "direct").await;
    delete_queues(&queues).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_headers_exchange_routes_messages_with_deep_headers() {
    use lapin::ExchangeKind;
    use lapin::types::AMQPValue;
    let broker = common::start().await;
    let (_conn, ch) = broker.channel().await;
    let x = unique("deep-headers-x");
    exchange(&ch, &x, ExchangeKind::Headers).await;
    // Matches: the shallow header's value and the deep header's presence (a void binding
    // value). Never matches: a value for the deep header.
    let [present, valued] = ["present", "valued"].map(|s| unique(&format!("deep-{s}")));
    declare(&ch, &present, FieldTable::default()).await;
    declare(&ch, &valued, FieldTable::default()).await;
    common::dl::bind_with(
        &ch,
        &present,
        &x,
        "",
        table(&[("app", ls("ok")), ("deep-array", AMQPValue::Void)]),
    )
    .await;
    common::dl::bind_with(
        &ch,
        &valued,
        &x,
        "",
        table(&[("x-match", ls("any")), ("deep-table", ls("ok"))]),
    )
    .await;

    let headers = DeepHeaders::new();
    let mut client = RawClient::connect(broker.addr).await;
    client.open_channel(1).await;
    client
        .send_raw(&deep::publish(1, &x, "", &headers.properties, b"routed"))
        .await;
    client.consume(1, &present, true).await;
    expect_exact(&mut client, &headers, "routed").await;
    let none = ch
        .basic_get(valued.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(none.is_none(), "an opaque value equals no binding value");
}
