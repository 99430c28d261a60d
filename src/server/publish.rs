//! Turns a completed basic.publish (method + content header + body) into a broker
//! [`Message`]: routing keys from CC/BCC, BCC removed, expiration and user-id validated.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::FieldTable;
use bytes::Bytes;

use crate::amqp::content::{ContentHeader, encode_properties_from};
use crate::amqp::reply::AmqpError;
use crate::broker::args::parse_expiration;
use crate::broker::delivery::header_keys;
use crate::broker::message::Message;

/// A publish waiting for its content.
#[derive(Debug)]
pub struct PendingPublish {
    pub exchange: String,
    pub routing_key: String,
    pub mandatory: bool,
    pub header: Option<ContentHeader>,
    pub body: Option<crate::amqp::content::BodyCollector>,
}

/// The message and the headers routing needs.
pub struct PreparedMessage {
    pub message: Message,
    pub headers: Option<FieldTable>,
}

/// Builds the message the broker stores, applying sender-selected distribution.
pub fn prepare(
    exchange: &str,
    routing_key: &str,
    header: ContentHeader,
    body: Bytes,
    authenticated_user: &str,
) -> Result<PreparedMessage, AmqpError> {
    let props = header.properties;
    if let Some(user_id) = props.user_id()
        && user_id.as_str() != authenticated_user
    {
        return Err(AmqpError::precondition(format!(
            "user_id property set to '{}' but authenticated user was '{authenticated_user}'",
            user_id.as_str()
        )));
    }
    let expiration_ms = match props.expiration() {
        // RabbitMQ's text: invalid expiration '<value>': <reason>.
        Some(e) => Some(
            parse_expiration(e.as_str()).map_err(|err| AmqpError::precondition(err.to_string()))?,
        ),
        None => None,
    };
    let mut keys: Vec<Box<str>> = vec![routing_key.into()];
    let mut raw = header.raw_properties;
    let mut headers = props.headers().clone();
    if let Some(h) = &headers {
        keys.extend(header_keys(h, "CC").into_iter().map(String::into_boxed_str));
        let bcc = header_keys(h, "BCC");
        if h.inner().contains_key("BCC") {
            keys.extend(bcc.into_iter().map(String::into_boxed_str));
            let mut without = FieldTable::default();
            for (k, v) in h.inner() {
                if k.as_str() != "BCC" {
                    without.insert(k.clone(), v.clone());
                }
            }
            let rewritten =
                encode_properties_from(&rebuild_with_headers(&props, without.clone()), &raw);
            raw = rewritten;
            headers = Some(without);
        }
    }
    // Message::new copies everything into one allocation of its own, so a queued message
    // never pins a socket read buffer.
    Ok(PreparedMessage {
        message: Message::new(exchange, &keys, &raw, &body, expiration_ms, false),
        headers,
    })
}

/// The same properties with another headers table.
fn rebuild_with_headers(props: &BasicProperties, headers: FieldTable) -> BasicProperties {
    props.clone().with_headers(headers)
}
