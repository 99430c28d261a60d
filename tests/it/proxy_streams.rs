//! Proxy mode, streams (issue 19): a queue type the proxy does not take over goes to RabbitMQ
//! untouched. Every scenario is run twice, through the proxy and straight on RabbitMQ (on
//! another stream), and what the client observes must be the same: declare answers, 406 texts
//! (queue names replaced), delivered bodies and `x-stream-offset` headers with their AMQP
//! types, and that neither a dead-letter argument nor a dead-letter TOML policy dead-letters
//! anything from a stream.

use std::time::Duration;

use crate::common::dl::{
    AMQPValue, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions, Channel,
    Consumer, FieldTable, QueueDeclareOptions, ack, confirm_select, header, next as next_delivery,
    no_delivery,
};
use crate::proxy_support;
use lapin::Connection;
use proxy_support::*;

/// Stream messages published per scenario.
const N: usize = 6;

fn stream_arguments(max_age: &str) -> FieldTable {
    table(&[
        ("x-queue-type", ls("stream")),
        ("x-max-age", ls(max_age)),
        (
            "x-stream-max-segment-size-bytes",
            AMQPValue::LongInt(1_000_000),
        ),
    ])
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// A declare's answer as a client sees it, the queue's name replaced by `Q`.
async fn declare_answer(
    conn: &Connection,
    name: &str,
    arguments: FieldTable,
) -> Result<(u32, u32), (u16, String)> {
    let ch = conn.create_channel().await.unwrap();
    match ch.queue_declare(name.into(), durable(), arguments).await {
        Ok(queue) => {
            let _ = ch.close(200, "done".into()).await;
            Ok((queue.message_count(), queue.consumer_count()))
        }
        Err(err) => match err.kind() {
            lapin::ErrorKind::ProtocolError(e) => {
                Err((e.get_id(), e.get_message().as_str().replace(name, "Q")))
            }
            other => panic!("declare {name}: not a channel error: {other:?}"),
        },
    }
}

/// A consumer of `stream` from `offset`, with the prefetch streams require.
async fn stream_consumer(ch: &Channel, stream: &str, offset: AMQPValue) -> Consumer {
    ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    ch.basic_consume(
        stream.into(),
        "".into(),
        BasicConsumeOptions::default(),
        table(&[("x-stream-offset", offset)]),
    )
    .await
    .unwrap_or_else(|e| panic!("consume {stream}: {e}"))
}

/// Reads `count` deliveries, acking each: (body, `x-stream-offset` header as delivered).
async fn read(ch: &Channel, consumer: &mut Consumer, count: usize) -> Vec<(String, AMQPValue)> {
    let mut seen = Vec::new();
    for _ in 0..count {
        let d = next_delivery(consumer).await;
        let offset = header(&d, "x-stream-offset")
            .cloned()
            .unwrap_or_else(|| panic!("no x-stream-offset on {:?}", payload(&d)));
        seen.push((payload(&d), offset));
        ack(ch, d.delivery_tag, false).await;
    }
    seen
}

/// The whole stream round trip on `conn`: what a client observes, step by step.
async fn round_trip(conn: &Connection, stream: &str) -> Vec<String> {
    let mut observed = Vec::new();
    let created = declare_answer(conn, stream, stream_arguments("1D")).await;
    observed.push(format!("declare: {created:?}"));
    let publisher = conn.create_channel().await.unwrap();
    confirm_select(&publisher).await;
    publish_acked(&publisher, stream, N).await;

    // From the first offset, from an offset number, then only what comes next.
    let ch = conn.create_channel().await.unwrap();
    let mut first = stream_consumer(&ch, stream, ls("first")).await;
    observed.push(format!("first: {:?}", read(&ch, &mut first, N).await));
    let ch = conn.create_channel().await.unwrap();
    let mut numbered = stream_consumer(&ch, stream, AMQPValue::LongLongInt(2)).await;
    observed.push(format!(
        "from 2: {:?}",
        read(&ch, &mut numbered, N - 2).await
    ));
    let ch = conn.create_channel().await.unwrap();
    let mut next = stream_consumer(&ch, stream, ls("next")).await;
    no_delivery(&mut next, 300).await;
    for i in 0..2 {
        crate::common::dl::publish_to(
            &publisher,
            "",
            stream,
            format!("later{i}").as_bytes(),
            lapin::BasicProperties::default(),
        )
        .await;
    }
    observed.push(format!("next: {:?}", read(&ch, &mut next, 2).await));

    // Redeclares: the same arguments (an int64 segment size is equivalent), another max age.
    let mut same = stream_arguments("1D");
    same.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongLongInt(1_000_000),
    );
    observed.push(format!(
        "redeclare equivalent: {:?}",
        declare_answer(conn, stream, same).await.map(|_| ())
    ));
    observed.push(format!(
        "redeclare inequivalent: {:?}",
        declare_answer(conn, stream, stream_arguments("2D")).await
    ));
    observed.push(format!(
        "redeclare as classic: {:?}",
        declare_answer(conn, stream, FieldTable::default()).await
    ));
    // A queue type neither the proxy nor this RabbitMQ knows: RabbitMQ's own answer.
    let unknown = table(&[("x-queue-type", ls("some-later-type"))]);
    observed.push(format!(
        "unknown type: {:?}",
        declare_answer(conn, &format!("{stream}-later"), unknown).await
    ));
    observed
}

/// Declare, publish with confirms, consume from `first` / an offset / `next` with a prefetch,
/// ack, redeclare: through the proxy exactly what RabbitMQ gives directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_round_trip_through_the_proxy_equals_the_direct_one() {
    let proxy = TestProxy::start(vec![]).await;
    let via = proxy.connect().await;
    let direct = upstream_connection().await;
    let (through, straight) = (unique("stream-proxy"), unique("stream-direct"));
    let through_proxy = round_trip(&via, &through).await;
    let directly = round_trip(&direct, &straight).await;
    assert_eq!(through_proxy, directly);
    // What was compared is what a stream gives (not two equal refusals).
    assert_eq!(directly[0], "declare: Ok((0, 0))");
    assert!(
        directly[1].starts_with("first: [(\"m0\", LongLongInt(0)), (\"m1\", LongLongInt(1))"),
        "{directly:?}"
    );
    assert!(directly[5].contains("406"), "{directly:?}");
    assert!(directly[5].contains("x-max-age"), "{directly:?}");
    assert!(directly[7].contains("some-later-type"), "{directly:?}");
    // The proxy remembers the stream as RabbitMQ's (the gauge of its cache).
    assert_eq!(proxy.counter("verified_queues", &[]), 1.0);
    let ch = direct.create_channel().await.unwrap();
    delete_upstream(&ch, &[&through, &straight], &[]).await;
    proxy.stop().await;
}

/// Where a scenario's client connects: through the proxy or straight to RabbitMQ.
#[derive(Clone, Copy)]
enum Side<'a> {
    Proxy(&'a TestProxy),
    Direct,
}

impl Side<'_> {
    async fn connect(self) -> Connection {
        match self {
            Side::Proxy(proxy) => proxy.connect().await,
            Side::Direct => upstream_connection().await,
        }
    }
}

/// A result as a client sees it: ok, or the reply code and text (names replaced by `Q`).
fn shown<T>(result: Result<T, lapin::Error>, name: &str) -> String {
    match result {
        Ok(_) => "ok".to_string(),
        Err(err) => match err.kind() {
            lapin::ErrorKind::ProtocolError(e) => {
                format!(
                    "{} {}",
                    e.get_id(),
                    e.get_message().as_str().replace(name, "Q")
                )
            }
            other => format!("{other:?}").replace(name, "Q"),
        },
    }
}

/// The error that ended the connection, as [`shown`] writes it; `None` when none came
/// within 5 s.
async fn connection_error(
    events: &mut (impl futures_util::Stream<Item = lapin::Event> + Unpin),
    name: &str,
) -> Option<String> {
    use futures_util::StreamExt;
    let waited = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(err) = event {
                return Some(shown::<()>(Err(err), name));
            }
        }
        None
    });
    waited.await.ok().flatten()
}

/// Publishes three messages to `stream` with confirms, then on a fresh connection consumes it
/// from the first offset and rejects (or nacks, without requeue) the first delivery: what the
/// client is answered, then what a new consumer reads from the first offset. The rejecting
/// connection is closed.
async fn rejection(side: Side<'_>, stream: &str, with_nack: bool) -> String {
    let conn = side.connect().await;
    let mut events = Box::pin(conn.events_listener());
    let publisher = conn.create_channel().await.unwrap();
    confirm_select(&publisher).await;
    publish_acked(&publisher, stream, 3).await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = stream_consumer(&ch, stream, ls("first")).await;
    let first = next_delivery(&mut consumer).await;
    let sent = if with_nack {
        ch.basic_nack(
            first.delivery_tag,
            BasicNackOptions {
                multiple: false,
                requeue: false,
            },
        )
        .await
    } else {
        ch.basic_reject(first.delivery_tag, BasicRejectOptions { requeue: false })
            .await
    };
    // A round trip on the same channel: the answer to the settlement, if any.
    let after = match sent {
        Ok(()) => shown(
            crate::common::dl::passive_declare(&ch, stream).await,
            stream,
        ),
        Err(err) => shown::<()>(Err(err), stream),
    };
    // When the server's close of the connection reached lapin before the round trip was
    // sent, lapin answers it with the channel's state; the close itself is the answer then.
    let after = if after.starts_with("InvalidChannelState") {
        connection_error(&mut events, stream).await.unwrap_or(after)
    } else {
        after
    };
    let _ = conn.close(200, "done".into()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reader = side.connect().await;
    let ch = reader.create_channel().await.unwrap();
    let mut consumer = stream_consumer(&ch, stream, ls("first")).await;
    let stays = read(&ch, &mut consumer, 3).await;
    no_delivery(&mut consumer, 300).await;
    let _ = reader.close(200, "done".into()).await;
    format!("after the settlement: {after}; the stream holds {stays:?}")
}

/// A stream declared with dead-letter arguments gets RabbitMQ's own answer, and a rejected or
/// nacked stream delivery is answered as RabbitMQ answers it and reaches no dead-letter
/// queue, through the proxy as directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_arguments_on_a_stream_are_answered_as_directly() {
    let proxy = TestProxy::start(vec![]).await;
    let direct = upstream_connection().await;
    let setup = direct.create_channel().await.unwrap();
    let (dlx, dlq) = (unique("stream-dlx"), unique("stream-dlq"));
    declare_dlx(&setup, &dlx, &dlq).await;
    let mut observed = Vec::new();
    let mut names = Vec::new();
    for side in [Side::Proxy(&proxy), Side::Direct] {
        let stream = unique("stream-dl");
        let mut arguments = stream_arguments("1D");
        arguments.insert("x-dead-letter-exchange".into(), ls(&dlx));
        arguments.insert("x-dead-letter-routing-key".into(), ls(&dlq));
        let conn = side.connect().await;
        let answer = declare_answer(&conn, &stream, arguments.clone()).await;
        let mut seen = format!("declare: {answer:?}");
        if answer.is_ok() {
            let redeclared = declare_answer(&conn, &stream, arguments).await;
            seen += &format!(
                "; redeclare: {redeclared:?}; reject: {}; nack: {}",
                rejection(side, &stream, false).await,
                rejection(side, &stream, true).await
            );
        }
        observed.push(seen);
        names.push(stream);
    }
    assert_eq!(observed[0], observed[1]);
    // RabbitMQ 3.10 refuses dead-letter arguments on a stream; a version that accepts them
    // has its rejections compared above.
    assert!(
        observed[1].starts_with("declare: Err((406,") || observed[1].contains("; reject: "),
        "{observed:?}"
    );
    nothing_dead_lettered_then_clean_up(proxy, &setup, &names, (&dlx, &dlq)).await;
}

/// Nothing reached the dead-letter queue and the proxy dead-lettered nothing of the stream
/// declared through it (`streams[0]`); then the streams (those that exist), the dead-letter
/// queue and exchange are deleted and the proxy stopped.
async fn nothing_dead_lettered_then_clean_up(
    proxy: TestProxy,
    setup: &Channel,
    streams: &[String],
    (dlx, dlq): (&str, &str),
) {
    assert_eq!(message_count(setup, dlq).await, 0);
    let labels = [
        ("queue", streams[0].as_str()),
        ("reason", "rejected"),
        ("vhost", "/"),
    ];
    assert_eq!(proxy.counter("dead_lettered_total", &labels), 0.0);
    for stream in streams {
        let _ = setup
            .queue_delete(stream.as_str().into(), Default::default())
            .await;
    }
    delete_upstream(setup, &[dlq], &[dlx]).await;
    proxy.stop().await;
}

/// A TOML policy with dead-letter, TTL, length and delivery-limit keys matching a stream
/// changes nothing about it: the declare and its redeclare are accepted, nothing expires or
/// is dropped, a rejection is answered as RabbitMQ answers it and reaches no dead-letter
/// queue, as directly on RabbitMQ (where the TOML policy does not exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_policy_does_not_touch_a_stream() {
    let direct = upstream_connection().await;
    let setup = direct.create_channel().await.unwrap();
    let (dlx, dlq) = (unique("stream-pdlx"), unique("stream-pdlq"));
    declare_dlx(&setup, &dlx, &dlq).await;
    let prefix = unique("stream-pol");
    let proxy = TestProxy::start(vec![policy(
        "dl",
        &format!("^{prefix}"),
        serde_json::json!({
            "dead-letter-exchange": dlx,
            "dead-letter-routing-key": dlq,
            "message-ttl": 1,
            "max-length": 1,
            "overflow": "reject-publish-dlx",
            "delivery-limit": 1,
        }),
    )])
    .await;
    let mut observed = Vec::new();
    let mut names = Vec::new();
    for side in [Side::Proxy(&proxy), Side::Direct] {
        let stream = format!("{prefix}-{}", names.len());
        let conn = side.connect().await;
        let declared = declare_answer(&conn, &stream, stream_arguments("1D")).await;
        let rejected = rejection(side, &stream, false).await;
        // Accepted or not; not its counts: a stream's message count in declare-ok comes from
        // statistics RabbitMQ updates asynchronously (0 or 3 here, whoever asks).
        let redeclared = declare_answer(&conn, &stream, stream_arguments("1D"))
            .await
            .map(|_| ());
        observed.push(format!("{declared:?}; {rejected}; {redeclared:?}"));
        names.push(stream);
    }
    assert_eq!(observed[0], observed[1]);
    // RabbitMQ refuses the settlement (540, the connection closes) and keeps the messages.
    let refused =
        "540 NOT_IMPLEMENTED - basic.nack and basic.reject not supported by stream queues";
    assert!(
        observed[1].starts_with(&format!("Ok((0, 0)); after the settlement: {refused}")),
        "{observed:?}"
    );
    assert!(
        observed[1].ends_with(r#"("m2", LongLongInt(2))]; Ok(())"#),
        "{observed:?}"
    );
    nothing_dead_lettered_then_clean_up(proxy, &setup, &names, (&dlx, &dlq)).await;
}

/// A stream declared straight on RabbitMQ (this proxy instance never saw its declare) is
/// consumed through the proxy with `x-stream-offset`: the read-back learns it is a stream
/// and leaves it to RabbitMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_declared_on_rabbitmq_is_consumed_through_the_proxy() {
    let direct = upstream_connection().await;
    let stream = unique("stream-elsewhere");
    assert!(
        declare_answer(&direct, &stream, stream_arguments("1D"))
            .await
            .is_ok()
    );
    let publisher = direct.create_channel().await.unwrap();
    confirm_select(&publisher).await;
    publish_acked(&publisher, &stream, N).await;
    let proxy = TestProxy::start(vec![]).await;
    let via = proxy.connect().await;
    for offset in [ls("first"), AMQPValue::LongLongInt(4)] {
        let ch = via.create_channel().await.unwrap();
        let skip = match offset {
            AMQPValue::LongLongInt(n) => n as usize,
            _ => 0,
        };
        let mut consumer = stream_consumer(&ch, &stream, offset).await;
        let seen = read(&ch, &mut consumer, N - skip).await;
        let expected: Vec<(String, AMQPValue)> = (skip..N)
            .map(|i| (format!("m{i}"), AMQPValue::LongLongInt(i as i64)))
            .collect();
        assert_eq!(seen, expected);
    }
    assert_eq!(proxy.counter("verified_queues", &[]), 1.0);
    let ch = direct.create_channel().await.unwrap();
    delete_upstream(&ch, &[&stream], &[]).await;
    proxy.stop().await;
}
