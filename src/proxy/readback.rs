//! Reading a queue's arguments back from the upstream, for a queue the instance has not
//! verified when a client consumes from it or gets from it (after a restart, or declared
//! through another instance or straight on RabbitMQ).
//!
//! AMQP 0-9-1 cannot read a queue's arguments, but RabbitMQ names the current value of the
//! first argument a redeclare differs in. So, on the check channel ([`super::probe`]):
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
    ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY, EQUIVALENCE_ARGUMENTS,
    parse_queue_arguments,
};

/// Most declares one read-back sends: the passive one, one per flag and compared argument,
/// and the last.
pub const MAX_ROUNDS: usize = 1 + 3 + EQUIVALENCE_ARGUMENTS.len() + 1;

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
mod tests {
    use super::*;
    use crate::rabbit::args::{ARG_DELIVERY_LIMIT, ARG_MESSAGE_TTL, QueueArguments, QueueType};

    const CAPTURE: &str = "dlx-proxy.capture";

    fn refusal(argument: &str, comparison: &str) -> String {
        format!(
            "PRECONDITION_FAILED - inequivalent arg '{argument}' for queue 'q' in vhost '/': received {comparison}"
        )
    }

    fn declared(next: ReadNext) -> queue::Declare {
        match next {
            ReadNext::Declare(declare) => declare,
            other => panic!("not another round: {other:?}"),
        }
    }

    #[test]
    fn checks_existence_passively_first() {
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        let first = read.request();
        assert!(first.passive);
        assert!(first.arguments.inner().is_empty());
        assert_eq!(
            read.on_close(404, "NOT_FOUND - no queue 'q' in vhost '/'"),
            ReadNext::Done(ReadOutcome::Missing)
        );
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        assert_eq!(
            read.on_close(403, "ACCESS_REFUSED"),
            ReadNext::Done(ReadOutcome::Unknown)
        );
    }

    #[test]
    fn reads_a_proxy_queue_one_argument_at_a_time() {
        let tag = CaptureTag {
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: None,
            delivery_limit: Some(2),
        }
        .encode()
        .unwrap();
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        let second = declared(read.on_declare_ok());
        assert!(!second.passive);
        let third =
            declared(read.on_close(406, &refusal("durable", "'false' but current is 'true'")));
        assert!(third.durable);
        let fourth = declared(read.on_close(
            406,
            &refusal(
                ARG_MESSAGE_TTL,
                "none but current is the value '1000' of type 'signedint'",
            ),
        ));
        assert_eq!(
            fourth.arguments.inner().get(ARG_MESSAGE_TTL),
            Some(&AMQPValue::LongLongInt(1000))
        );
        let fifth = declared(read.on_close(
            406,
            &refusal(
                ARG_DEAD_LETTER_ROUTING_KEY,
                &format!("none but current is the value '{tag}' of type 'longstr'"),
            ),
        ));
        assert!(fifth.durable);
        assert_eq!(
            read.on_declare_ok(),
            ReadNext::Done(ReadOutcome::Learned(VerifiedQueue::Proxied(
                QueueArguments {
                    dead_letter_exchange: Some("dlx".into()),
                    message_ttl: Some(1000),
                    delivery_limit: Some(2),
                    ..QueueArguments::default()
                }
            )))
        );
    }

    #[test]
    fn reads_an_upstream_owned_queue() {
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        read.on_declare_ok();
        // Its own dead-letter exchange replaces the capture exchange.
        let next = declared(read.on_close(
            406,
            &refusal(
                ARG_DEAD_LETTER_EXCHANGE,
                &format!("'{CAPTURE}' but current is 'own'"),
            ),
        ));
        assert_eq!(
            next.arguments.inner().get(ARG_DEAD_LETTER_EXCHANGE),
            Some(&AMQPValue::LongString("own".into()))
        );
        declared(read.on_close(
            406,
            &refusal(
                "x-queue-type",
                "none but current is the value 'quorum' of type 'longstr'",
            ),
        ));
        declared(read.on_close(
            406,
            &refusal(
                ARG_DELIVERY_LIMIT,
                "none but current is the value '5' of type 'long'",
            ),
        ));
        let ReadNext::Done(ReadOutcome::Learned(VerifiedQueue::UpstreamOwned(args))) =
            read.on_declare_ok()
        else {
            panic!("not learned");
        };
        assert_eq!(args.dead_letter_exchange.as_deref(), Some("own"));
        assert_eq!(args.queue_type, QueueType::Quorum);
        assert_eq!(args.delivery_limit, Some(5));
        // A queue without a dead-letter exchange: the capture exchange is left out.
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        read.on_declare_ok();
        let next = declared(read.on_close(
            406,
            &refusal(
                ARG_DEAD_LETTER_EXCHANGE,
                &format!("the value '{CAPTURE}' of type 'longstr' but current is none"),
            ),
        ));
        assert!(next.arguments.inner().is_empty(), "{next:?}");
        assert_eq!(
            read.on_declare_ok(),
            ReadNext::Done(ReadOutcome::Learned(VerifiedQueue::UpstreamOwned(
                QueueArguments::default()
            )))
        );
    }

    #[test]
    fn a_stream_is_passed_through_once_its_type_is_named() {
        let mut read = ReadBack::new("s", "/", CAPTURE).unwrap();
        read.on_declare_ok();
        let stream_refusal = |argument: &str, comparison: &str| {
            format!(
                "PRECONDITION_FAILED - inequivalent arg '{argument}' for queue 's' in vhost '/': received {comparison}"
            )
        };
        let next = declared(read.on_close(
            406,
            &stream_refusal("durable", "'false' but current is 'true'"),
        ));
        assert!(next.durable);
        declared(read.on_close(
            406,
            &stream_refusal(
                ARG_DEAD_LETTER_EXCHANGE,
                &format!("the value '{CAPTURE}' of type 'longstr' but current is none"),
            ),
        ));
        assert_eq!(
            read.on_close(
                406,
                &stream_refusal(
                    "x-queue-type",
                    "none but current is the value 'stream' of type 'longstr'",
                ),
            ),
            ReadNext::Done(ReadOutcome::Learned(VerifiedQueue::PassedThrough))
        );
    }

    #[test]
    fn is_bounded_and_gives_up_on_what_it_cannot_read() {
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        read.on_declare_ok();
        let mut rounds = 2;
        let flip = refusal("durable", "'false' but current is 'true'");
        loop {
            match read.on_close(406, &flip) {
                ReadNext::Declare(_) => rounds += 1,
                ReadNext::Done(outcome) => {
                    assert_eq!(outcome, ReadOutcome::Unknown);
                    break;
                }
            }
        }
        assert_eq!(rounds, MAX_ROUNDS);
        let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
        read.on_declare_ok();
        assert_eq!(
            read.on_close(405, "RESOURCE_LOCKED - cannot obtain exclusive access"),
            ReadNext::Done(ReadOutcome::Unknown)
        );
        assert_eq!(
            read.on_close(406, "PRECONDITION_FAILED - inequivalent arg 'x' for queue 'q' in vhost '/': received 'a' but current is 'b..."),
            ReadNext::Done(ReadOutcome::Unknown)
        );
    }
}
