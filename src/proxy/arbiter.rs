//! The declare check: RabbitMQ, not the proxy instance, judges whether a client's
//! `queue.declare` matches the queue that exists.
//!
//! The upstream arguments of a declare are a deterministic function of the client's arguments
//! and the policy ([`super::declare::rewrite_declare`]). The proxy declares them non-passively
//! on a channel of its own ([`super::probe::CheckChannel`]) before the client's declare goes
//! out. A declare-ok means the queue matches (or was just created with them): the client's
//! declare follows with the same arguments and the instance caches the verified settings. A
//! refusal is read here:
//!
//! - `inequivalent arg 'durable' | 'exclusive' | 'auto_delete' | <an argument passed as the
//!   client sent it>` - already in the client's terms: the client gets it as it is;
//! - on `x-dead-letter-exchange` (the proxy sent its capture exchange): the queue was not
//!   declared through a proxy (brownfield). It is upstream-owned: the client's declare goes
//!   upstream unchanged and RabbitMQ judges it, and its rejections are passed through;
//! - on `x-dead-letter-routing-key` (the proxy's [`CaptureTag`]): both tags are decoded and
//!   compared in the client's terms, in RabbitMQ's order (exchange before routing key), giving
//!   the exact text a direct client would get. Tags that differ only in a classic queue's
//!   delivery limit are compared after every other argument, as RabbitMQ compares
//!   `x-delivery-limit` last: the check is repeated with the queue's own tag, and the
//!   limit's refusal is given only if nothing else differs; so are retry tiers
//!   (`x-retry-delays`, which only the tag records): a redeclare with other tiers (or none)
//!   is refused with `inequivalent arg 'x-retry-delays'`, so every instance uses the tiers
//!   the queue was created with;
//! - on an argument the proxy filled in from a policy (the client did not send it; RabbitMQ
//!   never compares policy values): the check is repeated with the queue's current value.
//!
//! Every repetition replaces one argument with the queue's own value, so the check ends after
//! at most one round per compared argument ([`MAX_ROUNDS`]); past that, or on any other
//! refusal (403, 405, ...), the client's declare goes upstream with the computed arguments and
//! the client gets RabbitMQ's own answer. A reply text RabbitMQ cut at 255 bytes (very long
//! names) cannot be read back and is given to the client as it is.

use amq_protocol::protocol::queue;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::declare::{CaptureTag, DeclareRewrite, upstream_declare};
use crate::rabbit::args::{
    ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY, ARG_DELIVERY_LIMIT,
    MOST_EQUIVALENCE_ARGUMENTS, check_equivalent, check_retry_delays_equivalent, describe_presence,
    describe_value,
};

/// Most declares one check sends (one per compared argument, and the first).
pub const MAX_ROUNDS: usize = MOST_EQUIVALENCE_ARGUMENTS + 1;

const PRECONDITION_FAILED: u16 = 406;

/// How a check ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// The queue matches these upstream arguments: declare them for the client.
    Verified(FieldTable),
    /// The client's declare is refused with this channel.close.
    Refused { code: u16, text: String },
    /// The queue was not declared through a proxy: the client's declare goes upstream as sent.
    UpstreamOwned,
    /// The check cannot tell: the client's declare goes upstream with the computed arguments
    /// and RabbitMQ answers the client itself.
    Undecided,
}

/// What to do after a reply on the check channel.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Declare again (on a fresh check channel: the refusal closed it).
    Declare(queue::Declare),
    Done(Verdict),
}

/// One value as a refusal text shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shown {
    Absent,
    Value(String),
}

/// The parts of `inequivalent arg 'A' for queue 'Q' in vhost 'V': received R but current is C`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inequivalent<'a> {
    pub argument: &'a str,
    /// Everything after `received `.
    pub comparison: &'a str,
}

/// Reads the argument and the comparison out of RabbitMQ's refusal text.
pub fn parse_inequivalent<'a>(text: &'a str, queue: &str, vhost: &str) -> Option<Inequivalent<'a>> {
    let rest = text.strip_prefix("PRECONDITION_FAILED - inequivalent arg '")?;
    let marker = format!("' for queue '{queue}' in vhost '{vhost}': received ");
    let at = rest.find(&marker)?;
    Some(Inequivalent {
        argument: &rest[..at],
        comparison: &rest[at + marker.len()..],
    })
}

/// The current value of a comparison whose received side was `sent` (what the proxy declared);
/// `None` when the text does not have that shape (e.g. cut at 255 bytes).
pub fn current_value(comparison: &str, sent: Option<&AMQPValue>) -> Option<Shown> {
    let candidates = match sent {
        Some(value) => vec![describe_value(value), describe_presence(Some(value))],
        None => vec![describe_presence(None)],
    };
    let current = candidates.iter().find_map(|received| {
        comparison
            .strip_prefix(received.as_str())
            .and_then(|rest| rest.strip_prefix(" but current is "))
    })?;
    if current == "none" {
        return Some(Shown::Absent);
    }
    if let Some(rest) = current.strip_prefix("the value '") {
        let end = rest.rfind("' of type '")?;
        rest.ends_with('\'')
            .then(|| Shown::Value(rest[..end].to_string()))
    } else if current.len() >= 2 && current.starts_with('\'') && current.ends_with('\'') {
        Some(Shown::Value(current[1..current.len() - 1].to_string()))
    } else {
        None
    }
}

/// One client declare being checked.
#[derive(Clone, Debug)]
pub struct DeclareCheck {
    client: queue::Declare,
    vhost: String,
    capture_exchange: String,
    /// The arguments of the current round.
    upstream: FieldTable,
    filled: Vec<&'static str>,
    /// The delivery-limit refusal to give if nothing RabbitMQ compares later differs.
    limit_refusal: Option<String>,
    rounds: usize,
}

impl DeclareCheck {
    pub fn new(
        client: &queue::Declare,
        vhost: &str,
        rewrite: &DeclareRewrite,
        capture_exchange: &str,
    ) -> DeclareCheck {
        DeclareCheck {
            client: client.clone(),
            vhost: vhost.to_string(),
            capture_exchange: capture_exchange.to_string(),
            upstream: rewrite.upstream_arguments.clone(),
            filled: rewrite.filled.clone(),
            limit_refusal: None,
            rounds: 1,
        }
    }

    /// The declare of the current round (non-passive, with an answer).
    pub fn request(&self) -> queue::Declare {
        let mut declare = upstream_declare(&self.client, self.upstream.clone());
        declare.passive = false;
        declare.nowait = false;
        declare
    }

    /// The upstream arguments of the current round.
    pub fn upstream_arguments(&self) -> &FieldTable {
        &self.upstream
    }

    /// The check channel got a declare-ok.
    pub fn on_declare_ok(&mut self) -> Verdict {
        match self.limit_refusal.take() {
            Some(text) => Verdict::Refused {
                code: PRECONDITION_FAILED,
                text,
            },
            None => Verdict::Verified(self.upstream.clone()),
        }
    }

    /// The check channel was closed by the upstream with `code` and `text`.
    pub fn on_close(&mut self, code: u16, text: &str) -> Next {
        if code != PRECONDITION_FAILED {
            return Next::Done(Verdict::Undecided);
        }
        let queue = self.client.queue.as_str();
        let passed = || {
            Next::Done(Verdict::Refused {
                code,
                text: text.to_string(),
            })
        };
        let Some(found) = parse_inequivalent(text, queue, &self.vhost) else {
            return passed();
        };
        let argument = found.argument;
        let sent = self.upstream.inner().get(argument).cloned();
        match argument {
            ARG_DEAD_LETTER_EXCHANGE
                if sent == Some(AMQPValue::LongString(self.capture_exchange.as_str().into())) =>
            {
                Next::Done(Verdict::UpstreamOwned)
            }
            ARG_DEAD_LETTER_ROUTING_KEY => {
                let Some(current) = current_value(found.comparison, sent.as_ref()) else {
                    return passed();
                };
                self.on_tag_refused(current)
            }
            _ if self.filled.contains(&argument) => {
                let Some(current) = current_value(found.comparison, sent.as_ref()) else {
                    return passed();
                };
                let key = ShortString::from(argument);
                match current {
                    Shown::Absent => {
                        self.upstream = without(&self.upstream, argument);
                    }
                    Shown::Value(value) => {
                        self.upstream.insert(key, shown_to_value(&value));
                    }
                }
                self.again()
            }
            _ => passed(),
        }
    }

    /// RabbitMQ refused the capture tag: compare the client's dead-letter arguments with the
    /// ones the queue carries.
    fn on_tag_refused(&mut self, current: Shown) -> Next {
        let stored = match &current {
            Shown::Absent => Some(CaptureTag::default()),
            Shown::Value(text) => CaptureTag::decode(text),
        };
        let Some(stored) = stored else {
            // A dead-letter routing key that is not a tag: not the proxy's queue.
            return Next::Done(Verdict::UpstreamOwned);
        };
        let existing = stored.to_field_table();
        let queue = self.client.queue.as_str();
        let requested = only(
            &self.client.arguments,
            &[ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY],
        );
        let current_target = only(
            &existing,
            &[ARG_DEAD_LETTER_EXCHANGE, ARG_DEAD_LETTER_ROUTING_KEY],
        );
        if let Err(text) = check_equivalent(&current_target, &requested, queue, &self.vhost) {
            return Next::Done(Verdict::Refused {
                code: PRECONDITION_FAILED,
                text: format!("PRECONDITION_FAILED - {text}"),
            });
        }
        let requested_limit = only(&self.client.arguments, &[ARG_DELIVERY_LIMIT]);
        let current_limit = only(&existing, &[ARG_DELIVERY_LIMIT]);
        if let Err(text) = check_equivalent(&current_limit, &requested_limit, queue, &self.vhost)
            && self.limit_refusal.is_none()
        {
            self.limit_refusal = Some(format!("PRECONDITION_FAILED - {text}"));
        }
        if self.limit_refusal.is_none()
            && let Err(text) =
                check_retry_delays_equivalent(&existing, &self.client.arguments, queue, &self.vhost)
        {
            self.limit_refusal = Some(format!("PRECONDITION_FAILED - {text}"));
        }
        // Check the rest against the queue's own tag.
        let key = ShortString::from(ARG_DEAD_LETTER_ROUTING_KEY);
        match current {
            Shown::Absent => {
                self.upstream = without(&self.upstream, ARG_DEAD_LETTER_ROUTING_KEY);
            }
            Shown::Value(text) => {
                self.upstream
                    .insert(key, AMQPValue::LongString(LongString::from(text)));
            }
        }
        self.again()
    }

    fn again(&mut self) -> Next {
        if self.rounds >= MAX_ROUNDS {
            return Next::Done(Verdict::Undecided);
        }
        self.rounds += 1;
        Next::Declare(self.request())
    }
}

/// The entries of `table` named in `keys`.
fn only(table: &FieldTable, keys: &[&str]) -> FieldTable {
    let mut out = FieldTable::default();
    for (key, value) in table {
        if keys.contains(&key.as_str()) {
            out.insert(key.clone(), value.clone());
        }
    }
    out
}

/// `table` without `key`.
pub(crate) fn without(table: &FieldTable, key: &str) -> FieldTable {
    let mut out = FieldTable::default();
    for (k, value) in table {
        if k.as_str() != key {
            out.insert(k.clone(), value.clone());
        }
    }
    out
}

/// A value read from a refusal text, as the proxy declares it again (integers compare by
/// value in RabbitMQ, whatever their width).
fn shown_to_value(text: &str) -> AMQPValue {
    match text.parse::<i64>() {
        Ok(number) => AMQPValue::LongLongInt(number),
        Err(_) => AMQPValue::LongString(LongString::from(text)),
    }
}

#[cfg(test)]
mod tests;
