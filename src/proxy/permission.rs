//! The permission probe: the client's own upstream connection is asked whether RabbitMQ would
//! let *its user* declare a queue, without creating anything, so the proxy never grants more
//! than RabbitMQ would while the queue itself is judged and created by the service identity
//! ([`super::service::judge`]).
//!
//! RabbitMQ 3.10's non-passive queue.declare checks, in order: configure permission on the
//! queue; the queue is looked up (an existing one is compared: 405 when another connection
//! holds it exclusively, 406 when it differs); for a new queue that names an
//! `x-dead-letter-exchange`, read permission on the queue and write permission on that
//! exchange; then the arguments are validated (406) and only then is the queue created. The
//! probe is the client's declare (its name and durable/exclusive/auto-delete flags, and its
//! own dead-letter exchange when it sent one) plus [`PROBE_ARGUMENT`] with a value RabbitMQ
//! always refuses (a string where a number is required). So the probe gets exactly the 403,
//! 405 or 404 the client's declare would get, and otherwise a 406: the user may declare it.
//! RabbitMQ closes the check channel either way and nothing is created.
//!
//! One round trip on the client's connection per checked declare (plus the channel.open the
//! check channel needs when it is closed; [`super::probe::CheckChannel`]).

use amq_protocol::protocol::queue;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::probe::CheckAnswer;
use crate::rabbit::args::ARG_DEAD_LETTER_EXCHANGE;

/// The argument RabbitMQ refuses after its permission checks.
pub const PROBE_ARGUMENT: &str = "x-max-length";
/// Its value: a string, where RabbitMQ requires a non-negative integer.
const PROBE_VALUE: &str = "dlx-proxy permission probe";

const PRECONDITION_FAILED: u16 = 406;

/// What the probe told about the client's permission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Permission {
    /// RabbitMQ got past every permission check: the user may declare the queue.
    Granted,
    /// RabbitMQ refused before that (403 ACCESS_REFUSED, 405 RESOURCE_LOCKED, 404, ...): the
    /// client gets this code and text as they are, as a direct client would.
    Refused { code: u16, text: String },
}

/// The probe declare for the client's `declare`.
pub fn probe(declare: &queue::Declare) -> queue::Declare {
    let mut arguments = FieldTable::default();
    if let Some(dlx) = declare.arguments.inner().get(ARG_DEAD_LETTER_EXCHANGE) {
        arguments.insert(ShortString::from(ARG_DEAD_LETTER_EXCHANGE), dlx.clone());
    }
    arguments.insert(
        ShortString::from(PROBE_ARGUMENT),
        AMQPValue::LongString(LongString::from(PROBE_VALUE)),
    );
    queue::Declare {
        queue: declare.queue.clone(),
        passive: false,
        durable: declare.durable,
        exclusive: declare.exclusive,
        auto_delete: declare.auto_delete,
        nowait: false,
        arguments,
    }
}

/// Reads the probe's answer. A declare-ok cannot happen with a RabbitMQ that validates
/// `x-max-length`; if it does, the user was permitted (and the caller logs it).
pub fn judge(answer: &CheckAnswer) -> Permission {
    match answer {
        CheckAnswer::DeclareOk => Permission::Granted,
        CheckAnswer::Refused { code, .. } if *code == PRECONDITION_FAILED => Permission::Granted,
        CheckAnswer::Refused { code, text } => Permission::Refused {
            code: *code,
            text: text.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declare(arguments: FieldTable) -> queue::Declare {
        queue::Declare {
            queue: ShortString::from("orders.q"),
            passive: true,
            durable: true,
            exclusive: false,
            auto_delete: true,
            nowait: true,
            arguments,
        }
    }

    #[test]
    fn the_probe_keeps_the_flags_and_the_clients_dead_letter_exchange_only() {
        let mut args = FieldTable::default();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("dlx".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString("k".into()),
        );
        args.insert("x-message-ttl".into(), AMQPValue::LongInt(5));
        let probe = probe(&declare(args));
        assert_eq!(probe.queue.as_str(), "orders.q");
        assert!(!probe.passive && !probe.nowait, "non-passive, answered");
        assert!(probe.durable && !probe.exclusive && probe.auto_delete);
        let mut keys: Vec<&str> = probe.arguments.inner().keys().map(|k| k.as_str()).collect();
        keys.sort();
        assert_eq!(keys, vec!["x-dead-letter-exchange", "x-max-length"]);
        assert_eq!(
            probe.arguments.inner().get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("dlx".into()))
        );
        assert!(matches!(
            probe.arguments.inner().get(PROBE_ARGUMENT),
            Some(AMQPValue::LongString(_))
        ));
        // Without a dead-letter exchange, none is added.
        let probe = super::probe(&declare(FieldTable::default()));
        assert_eq!(probe.arguments.inner().len(), 1);
    }

    #[test]
    fn a_406_grants_and_anything_else_is_relayed() {
        let refused = |code: u16, text: &str| CheckAnswer::Refused {
            code,
            text: text.into(),
        };
        assert_eq!(
            judge(&refused(406, "PRECONDITION_FAILED - invalid arg")),
            Permission::Granted
        );
        assert_eq!(judge(&CheckAnswer::DeclareOk), Permission::Granted);
        for code in [403, 404, 405, 530] {
            assert_eq!(
                judge(&refused(code, "X - text")),
                Permission::Refused {
                    code,
                    text: "X - text".into()
                }
            );
        }
    }
}
