//! Frames the broker writes for deliveries: basic.deliver / basic.get-ok with their content,
//! and the `x-delivery-count` header added to redeliveries from queues with a delivery limit.

use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use bytes::{Bytes, BytesMut};

use super::message::QueuedMessage;
use crate::amqp::codec::{put_basic_deliver, put_basic_get_ok};
use crate::amqp::content::{decode_properties, encode_properties_from, put_content};

/// A short string from a name the broker already validated (cut at 255 bytes, never panics).
pub fn short(s: &str) -> ShortString {
    let cut = crate::amqp::reply::truncate_str(s, 255);
    ShortString::try_new(cut).unwrap_or_default()
}

/// Properties to deliver when they differ from the stored bytes: with `x-delivery-count` set
/// when the queue counts deliveries. `None` means "deliver the stored bytes" (no copy).
pub fn delivery_properties(entry: &QueuedMessage, with_count: bool) -> Option<Bytes> {
    if !with_count {
        return None;
    }
    let props = decode_properties(entry.message.raw_properties()).ok()?;
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(
        short("x-delivery-count"),
        AMQPValue::LongLongInt(entry.delivery_count as i64),
    );
    Some(encode_properties_from(
        &props.with_headers(headers),
        entry.message.raw_properties(),
    ))
}

/// Writes basic.deliver and the content.
pub fn write_deliver(
    out: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    entry: &QueuedMessage,
    properties: &[u8],
    frame_max: usize,
) {
    put_basic_deliver(
        out,
        channel,
        consumer_tag,
        delivery_tag,
        entry.redelivered,
        entry.message.exchange(),
        entry.message.routing_key(),
    );
    put_content(out, channel, properties, entry.message.body(), frame_max);
}

/// Writes basic.get-ok and the content.
pub fn write_get_ok(
    out: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    entry: &QueuedMessage,
    properties: &[u8],
    message_count: u32,
    frame_max: usize,
) {
    put_basic_get_ok(
        out,
        channel,
        delivery_tag,
        entry.redelivered,
        entry.message.exchange(),
        entry.message.routing_key(),
        message_count,
    );
    put_content(out, channel, properties, entry.message.body(), frame_max);
}

/// Reads the CC or BCC header as a list of routing keys (longstr array entries only, as
/// RabbitMQ does).
pub fn header_keys(headers: &FieldTable, name: &str) -> Vec<String> {
    crate::deadletter::routing_key_list(headers.inner().get(name))
}
