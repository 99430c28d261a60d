//! Reading a queue's arguments back from the upstream, for a queue the instance has not
//! verified when a client consumes from it or gets from it (after a restart, or declared
//! through another instance or straight on RabbitMQ).
//!
//! AMQP 0-9-1 cannot read a queue's arguments, but RabbitMQ names the current value of the
//! first argument a redeclare differs in. So, on the vhost's declare connection
//! ([`super::service::judge`], a [`super::probe::CheckChannel`] of its own):
//! 1. a passive declare: a missing queue (404) is never created, and its cached settings are
//!    dropped;
//! 2. a non-passive declare with no flags and only the capture exchange as its dead-letter
//!    exchange; each refusal names one flag or argument with the queue's value, which the
//!    next round takes (a flag flipped, an argument added, or the capture exchange replaced by
//!    the queue's own dead-letter exchange or left out), until RabbitMQ answers declare-ok.
//!    The arguments of that round are the queue's. At most one round per flag and compared
//!    argument ([`MAX_ROUNDS`]).
//!
//! The upstream arguments become client arguments as the declare check reads them: a capture
//! exchange with a tag is a proxy queue (the tag gives its dead-letter arguments and a classic
//! queue's delivery limit), anything else is upstream-owned. A queue whose `x-queue-type` the
//! proxy passes through (a stream) is recorded as such as soon as a refusal names that type
//! ([`super::declare::passes_through`]). A queue that disappears between
//! the two steps would be created by step 2 with the arguments read so far; that window is
//! one round trip.

use amq_protocol::protocol::queue;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::arbiter::{parse_inequivalent, without};
use super::declare::{CaptureTag, passes_through};
use super::registry::VerifiedQueue;
use crate::amqp::reply::NOT_FOUND;
use crate::rabbit::args::{
    ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY, MOST_EQUIVALENCE_ARGUMENTS,
    parse_queue_arguments,
};

/// Most declares one read-back sends: the passive one, one per flag and compared argument,
/// and the last.
pub const MAX_ROUNDS: usize = 1 + 3 + MOST_EQUIVALENCE_ARGUMENTS + 1;

/// What a read-back found.
#[derive(Clone, Debug, PartialEq)]
pub enum ReadOutcome {
    Learned(VerifiedQueue),
    /// The queue does not exist.
    Missing,
    /// The upstream would not say (exclusive to another connection, no permission, an
    /// unreadable reply, too many rounds).
    Unknown,
}

/// What to do after a reply on the check channel.
#[derive(Clone, Debug, PartialEq)]
pub enum ReadNext {
    Declare(queue::Declare),
    Done(ReadOutcome),
}

/// One read-back in progress.
#[derive(Clone, Debug)]
pub struct ReadBack {
    declare: queue::Declare,
    vhost: String,
    capture_exchange: String,
    exists: bool,
    rounds: usize,
}

impl ReadBack {
    pub fn new(queue: &str, vhost: &str, capture_exchange: &str) -> Option<ReadBack> {
        let mut arguments = FieldTable::default();
        arguments.insert(
            ShortString::from(ARG_DEAD_LETTER_EXCHANGE),
            AMQPValue::LongString(LongString::from(capture_exchange)),
        );
        Some(ReadBack {
            declare: queue::Declare {
                queue: ShortString::try_new(queue).ok()?,
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments,
            },
            vhost: vhost.to_string(),
            capture_exchange: capture_exchange.to_string(),
            exists: false,
            rounds: 1,
        })
    }

    /// The declare of the current round.
    pub fn request(&self) -> queue::Declare {
        let mut declare = self.declare.clone();
        if !self.exists {
            declare.arguments = FieldTable::default();
        }
        declare
    }

    pub fn on_declare_ok(&mut self) -> ReadNext {
        if !self.exists {
            self.exists = true;
            self.declare.passive = false;
            return self.again();
        }
        ReadNext::Done(self.outcome())
    }

    pub fn on_close(&mut self, code: u16, text: &str) -> ReadNext {
        if !self.exists {
            return ReadNext::Done(if code == NOT_FOUND {
                ReadOutcome::Missing
            } else {
                ReadOutcome::Unknown
            });
        }
        let unknown = ReadNext::Done(ReadOutcome::Unknown);
        let Some(found) = parse_inequivalent(text, self.declare.queue.as_str(), &self.vhost) else {
            return unknown;
        };
        if found.comparison.starts_with("the value '")
            && found.comparison.ends_with("' but current is none")
        {
            // The proxy sent something the queue does not have (only the capture exchange).
            self.declare.arguments = without(&self.declare.arguments, found.argument);
            return self.again();
        }
        let Some(rest) = found.comparison.strip_prefix("'") else {
            return match current_typed(found.comparison) {
                Some(value) => {
                    self.declare
                        .arguments
                        .insert(ShortString::from(found.argument), value);
                    if passes_through(&self.declare.arguments) {
                        // A stream: nothing more to learn, RabbitMQ keeps it.
                        return ReadNext::Done(ReadOutcome::Learned(VerifiedQueue::PassedThrough));
                    }
                    self.again()
                }
                None => unknown,
            };
        };
        // Both sides present: a flag, or an argument the proxy sent (only the capture
        // exchange: the queue has its own dead-letter exchange).
        let flag = match found.argument {
            "durable" => Some(&mut self.declare.durable),
            "exclusive" => Some(&mut self.declare.exclusive),
            "auto_delete" => Some(&mut self.declare.auto_delete),
            _ => None,
        };
        if let Some(flag) = flag {
            *flag = rest.starts_with("false' but current is 'true'");
            return self.again();
        }
        if found.argument == ARG_DEAD_LETTER_EXCHANGE {
            let received = format!("{}' but current is '", self.capture_exchange);
            if let Some(current) = rest
                .strip_prefix(received.as_str())
                .and_then(|c| c.strip_suffix('\''))
            {
                self.declare.arguments.insert(
                    ShortString::from(ARG_DEAD_LETTER_EXCHANGE),
                    AMQPValue::LongString(LongString::from(current)),
                );
                return self.again();
            }
        }
        unknown
    }

    fn again(&mut self) -> ReadNext {
        if self.rounds >= MAX_ROUNDS {
            return ReadNext::Done(ReadOutcome::Unknown);
        }
        self.rounds += 1;
        ReadNext::Declare(self.request())
    }

    /// What the management API listed for the queue (`None`: the queue does not exist), read
    /// as the rounds would have read it. The fallback for a read-back the reply texts cannot
    /// finish: RabbitMQ cuts them at 255 bytes, so long queue, exchange or routing-key names
    /// leave the current value unreadable ([`ReadOutcome::Unknown`]).
    pub fn from_listing(
        mut self,
        listing: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> ReadOutcome {
        let Some(listed) = listing else {
            return ReadOutcome::Missing;
        };
        let mut arguments = FieldTable::default();
        for (name, value) in listed {
            let (Ok(key), Some(value)) =
                (ShortString::try_new(name.as_str()), json_value(value, 0))
            else {
                return ReadOutcome::Unknown;
            };
            arguments.insert(key, value);
        }
        self.declare.arguments = arguments;
        self.outcome()
    }

    /// The queue's arguments in the client's terms.
    fn outcome(&self) -> ReadOutcome {
        let arguments = &self.declare.arguments;
        if passes_through(arguments) {
            return ReadOutcome::Learned(VerifiedQueue::PassedThrough);
        }
        let capture = AMQPValue::LongString(LongString::from(self.capture_exchange.as_str()));
        let proxied = arguments.inner().get(ARG_DEAD_LETTER_EXCHANGE) == Some(&capture);
        let client = if proxied {
            let tag = match arguments.inner().get(ARG_DEAD_LETTER_ROUTING_KEY) {
                None => Some(CaptureTag::default()),
                Some(AMQPValue::LongString(key)) => {
                    CaptureTag::decode(&String::from_utf8_lossy(key.as_bytes()))
                }
                Some(_) => None,
            };
            let Some(tag) = tag else {
                return ReadOutcome::Unknown;
            };
            let mut client = without(
                &without(arguments, ARG_DEAD_LETTER_EXCHANGE),
                ARG_DEAD_LETTER_ROUTING_KEY,
            );
            for (key, value) in &tag.to_field_table() {
                client.insert(key.clone(), value.clone());
            }
            client
        } else {
            arguments.clone()
        };
        match parse_queue_arguments(&client) {
            Ok(parsed) if proxied => ReadOutcome::Learned(VerifiedQueue::Proxied(parsed)),
            Ok(parsed) => ReadOutcome::Learned(VerifiedQueue::UpstreamOwned(parsed)),
            Err(_) => ReadOutcome::Unknown,
        }
    }
}

/// Deepest nesting read from a management listing (queue arguments are flat in practice).
const LISTING_DEPTH: usize = 8;

/// A JSON value of a management listing as the AMQP value RabbitMQ compares as equal:
/// strings as longstr, integers by value, booleans, arrays and tables; `None` past
/// [`LISTING_DEPTH`] or for what AMQP has no value for.
fn json_value(value: &serde_json::Value, depth: usize) -> Option<AMQPValue> {
    use serde_json::Value;
    if depth > LISTING_DEPTH {
        return None;
    }
    Some(match value {
        Value::String(text) => AMQPValue::LongString(LongString::from(text.as_str())),
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64()?),
        },
        Value::Array(items) => AMQPValue::FieldArray(
            items
                .iter()
                .map(|v| json_value(v, depth + 1))
                .collect::<Option<Vec<_>>>()?
                .into(),
        ),
        Value::Object(fields) => {
            let mut table = FieldTable::default();
            for (name, v) in fields {
                table.insert(
                    ShortString::try_new(name.as_str()).ok()?,
                    json_value(v, depth + 1)?,
                );
            }
            AMQPValue::FieldTable(table)
        }
        Value::Null => AMQPValue::Void,
    })
}

/// The current value of `none but current is the value 'X' of type 'T'`, as an AMQP value
/// RabbitMQ compares as equal (integers compare by value whatever their width).
fn current_typed(comparison: &str) -> Option<AMQPValue> {
    let rest = comparison.strip_prefix("none but current is the value '")?;
    let at = rest.rfind("' of type '")?;
    let (text, kind) = (
        &rest[..at],
        rest[at + "' of type '".len()..].strip_suffix('\'')?,
    );
    Some(match kind {
        "longstr" => AMQPValue::LongString(LongString::from(text)),
        "bool" => AMQPValue::Boolean(text == "true"),
        "byte" | "unsignedbyte" | "short" | "unsignedshort" | "signedint" | "unsignedint"
        | "long" => AMQPValue::LongLongInt(text.parse().ok()?),
        "float" | "double" => AMQPValue::Double(text.parse().ok()?),
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
