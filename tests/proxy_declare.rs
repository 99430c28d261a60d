//! Proxy mode, queue.declare: the declares the proxy answers itself (invalid arguments) leave
//! the connection usable, even when the client reuses the channel number at once.

mod proxy_support;

use dlx_proxy::proxy::wire::method_frame;
use lapin::protocol::{AMQPClass, channel, queue};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use proxy_support::*;

fn channel_open(id: u16) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn channel_close_ok(id: u16) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
}

fn queue_declare(id: u16, name: &str, arguments: FieldTable) -> bytes::Bytes {
    method_frame(
        id,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: ShortString::from(name),
            passive: false,
            durable: false,
            exclusive: true,
            auto_delete: false,
            nowait: false,
            arguments,
        })),
    )
}

fn close_code(payload: &[u8]) -> (u16, String) {
    match dlx_proxy::amqp::codec::decode_method(payload) {
        Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
            (close.reply_code, close.reply_text.as_str().to_string())
        }
        Some(AMQPClass::Connection(lapin::protocol::connection::AMQPMethod::Close(close))) => {
            (close.reply_code, close.reply_text.as_str().to_string())
        }
        other => panic!("not a close: {other:?}"),
    }
}

/// A client that answers the proxy's 406 and reopens the same channel number in one write,
/// before the upstream has confirmed the proxy's own channel.close, gets a working channel
/// (RabbitMQ would otherwise see a second channel.open on a channel it is still closing and
/// close the whole connection with 504 CHANNEL_ERROR).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reusing_a_channel_number_right_after_a_refused_declare_works() {
    require_upstream!();
    let proxy = TestProxy::start(vec![]).await;
    let mut client = RawClient::connect(proxy.addr, &unique("reuse")).await;
    client.send(&channel_open(1)).await;
    assert_eq!(client.next_method().await.1, (20, 11));
    let invalid = [
        ("x-expires", AMQPValue::LongInt(0)),
        ("x-dead-letter-exchange", AMQPValue::LongInt(42)),
        ("x-message-ttl", AMQPValue::LongInt(-1)),
    ];
    for round in 0..30 {
        let (key, value) = &invalid[round % invalid.len()];
        let name = unique("refused");
        client
            .send(&queue_declare(1, &name, table(&[(key, value.clone())])))
            .await;
        let (ch, ids, payload) = client.next_method().await;
        assert_eq!(
            (ch, ids),
            (1, (20, 40)),
            "round {round}: {:?}",
            close_code(&payload)
        );
        let (code, text) = close_code(&payload);
        assert_eq!(code, 406, "round {round}: {text}");
        assert!(text.contains(&name), "{text}");
        // close-ok, reopen and a valid declare in one write.
        let mut burst = Vec::new();
        burst.extend_from_slice(&channel_close_ok(1));
        burst.extend_from_slice(&channel_open(1));
        let ok_name = unique("after-refusal");
        burst.extend_from_slice(&queue_declare(1, &ok_name, FieldTable::default()));
        client.send(&burst).await;
        let (ch, ids, payload) = client.next_method().await;
        assert_eq!(
            (ch, ids),
            (1, (20, 11)),
            "round {round}: expected channel.open-ok, got {ids:?} {:?}",
            (ids.1 == 40 || ids.1 == 50).then(|| close_code(&payload))
        );
        let (ch, ids, _) = client.next_method().await;
        assert_eq!((ch, ids), (1, (50, 11)), "round {round}: declare-ok");
    }
    proxy.stop().await;
}
