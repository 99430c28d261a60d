//! A message that died, and what the proxy does with it: the one decision shared by the two
//! places a death reaches the proxy, a client's rejection or requeue past a delivery limit
//! (on the client's connection, [`super::intercept`]) and a message the upstream dead-lettered
//! into the capture queue (on the vhost's service connection, [`super::service`]).
//!
//! Pure: [`plan`] takes the death and the queue's settings and says whether the message is
//! discarded (no dead-letter exchange, as RabbitMQ does), dropped (hop limit, cycle), or which
//! publish dead-letters it. [`from_capture`] reads a captured message back into a [`Death`].
//! [`settle`] turns the end of a publish into the settlement of the original and counts it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use amq_protocol::protocol::BasicProperties;
use bytes::Bytes;

use super::QueueView;
use super::bcc::kept_bcc_keys;
use super::capture::{CapturedMessage, reconstruct};
use super::declare::CaptureTag;
use super::ops::{Op, Purpose, Settlement};
use super::outgoing::{back_to_queue, dead_letter_publish, keys_after_cycle_rule};
use super::publisher::{Outcome, OutgoingMessage};
use super::retry::RetryReason;
use crate::amqp::content::{decode_properties, keep_opaque_headers};
use crate::deadletter::{
    DeadLetterOptions, DeadLetterReason, DeadLetterTarget, DeathEvent, dead_letter,
};
use crate::metrics::Metrics;
use crate::rabbit::args::QueueArguments;

/// Seconds since the epoch (the time of a death the proxy witnessed).
pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Everything the dead-letter rewrite needs to know about the message that died.
#[derive(Clone, Debug)]
pub(crate) struct Death {
    pub queue: Arc<str>,
    pub reason: DeadLetterReason,
    /// The message's properties before this death.
    pub before: BasicProperties,
    /// The raw properties `before` was decoded from (the source of its opaque headers).
    pub raw_before: Bytes,
    pub exchange: String,
    pub routing_keys: Vec<String>,
    pub time: u64,
    pub body: Bytes,
}

impl Death {
    /// The death as the pure dead-letter rules see it.
    pub(crate) fn event(&self) -> DeathEvent<'_> {
        DeathEvent {
            queue: &self.queue,
            reason: self.reason,
            exchange: &self.exchange,
            routing_keys: &self.routing_keys,
            now_secs: self.time,
            trust_existing_history: true,
        }
    }
}

/// What becomes of a dead message.
#[derive(Debug)]
pub(crate) enum Plan {
    /// No dead-letter exchange: discarded, as RabbitMQ does.
    Discard,
    /// Not dead-lettered, counted under this cause (`hop_limit`, `cycle`).
    Drop(&'static str),
    /// Published to its dead-letter exchange; the original is settled once confirmed.
    Publish(OutgoingMessage),
}

/// Rewrites a dead message with the pure rules (x-death, routing keys, cycles) for the queue's
/// settings in `view`.
pub(crate) fn plan(death: Death, view: &QueueView, options: &DeadLetterOptions) -> Plan {
    let Some(dlx) = view.settings.dead_letter_exchange.as_deref() else {
        return Plan::Discard;
    };
    let event = death.event();
    let target = DeadLetterTarget {
        exchange: dlx,
        routing_key: view.settings.dead_letter_routing_key.as_deref(),
    };
    let message = match dead_letter(&death.before, &event, &target, options) {
        Ok(message) => message,
        Err(drop) => return Plan::Drop(drop.cause()),
    };
    let keys = keys_after_cycle_rule(death.reason, &message, &death.before, &death.queue);
    if keys.is_empty() {
        tracing::debug!(
            queue = &*death.queue,
            reason = death.reason.as_str(),
            "message dropped: dead-letter cycle"
        );
        return Plan::Drop("cycle");
    }
    let mut publish = dead_letter_publish(&message, &keys, death.body);
    publish.raw_properties = keep_opaque_headers(publish.raw_properties, &death.raw_before);
    Plan::Publish(publish)
}

/// With `dead_letter.ttl_on_dead_letters = false` (`keep_dead_letters`): a message the
/// upstream expired that already carried an x-death history before this death is not
/// dead-lettered but published back into the queue it expired in, as it was before (no new
/// x-death entry; `CC`/`BCC` removed so no copy goes elsewhere). `None` for every other death.
pub(crate) fn kept_in_queue(death: &Death, keep_dead_letters: bool) -> Option<OutgoingMessage> {
    if !keep_dead_letters
        || death.reason != DeadLetterReason::Expired
        || crate::deadletter::x_death_entries(&death.before).is_empty()
    {
        return None;
    }
    let mut message = back_to_queue(&death.before, &death.queue, None, death.body.clone());
    message.raw_properties = keep_opaque_headers(message.raw_properties, &death.raw_before);
    Some(message)
}

/// Why a captured message cannot be dead-lettered (it is dropped and counted).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unreadable {
    Properties(String),
    NoDeathRecord(String),
    UnknownReason(String),
}

impl Unreadable {
    /// The cause it is counted under in `dead_letter_dropped_total`.
    pub(crate) fn cause(&self) -> &'static str {
        match self {
            Unreadable::Properties(_) => "undecodable",
            Unreadable::NoDeathRecord(_) => "no_death_record",
            Unreadable::UnknownReason(_) => "unknown_reason",
        }
    }
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreadable::Properties(e) => write!(f, "properties do not decode: {e}"),
            Unreadable::NoDeathRecord(e) => write!(f, "no death record: {e}"),
            Unreadable::UnknownReason(r) => write!(f, "unknown death reason {r:?}"),
        }
    }
}

/// A captured message read back: the death as the original queue saw it, and the queue's
/// dead-letter settings carried in the capture tag (its routing key), if any, or its own
/// dead-letter routing key (a routing key the message was not published with).
pub(crate) fn from_capture(
    message: &CapturedMessage,
) -> Result<(Death, Option<QueueArguments>), Unreadable> {
    let props = decode_properties(&message.raw_properties)
        .map_err(|e| Unreadable::Properties(e.to_string()))?;
    let mut tag = CaptureTag::decode(&message.routing_key);
    let (mut before, mut death) =
        reconstruct(&props, tag.is_some()).map_err(|e| Unreadable::NoDeathRecord(e.to_string()))?;
    if tag.is_some() && death.routing_keys.contains(&message.routing_key) {
        // The upstream queue had no dead-letter routing key, so the message kept the key it
        // was published with: a tag there is the publisher's, never the queue's. (A queue's
        // tag that a publisher also used as its key is lost too; the queue's settings then
        // come from the cache or a read-back, as for an untagged queue.)
        tag = None;
        (before, death) =
            reconstruct(&props, false).map_err(|e| Unreadable::NoDeathRecord(e.to_string()))?;
    }
    // No tag, and a routing key other than the one the message was published with (a queue
    // without a dead-letter routing key delivers the first of its routing keys, the publish
    // key): the queue has a dead-letter routing key of its own (an upstream-owned queue,
    // whose policy gives it the capture exchange; its own key beats the policy's tag in
    // RabbitMQ). Only on the entry's first death: a repeated one keeps the routing keys of
    // its first, which may not be the message's current ones.
    let own_routing_key = (tag.is_none()
        && death.count == 1
        && !message.routing_key.is_empty()
        && death.routing_keys.first() != Some(&message.routing_key))
    .then(|| message.routing_key.clone());
    if own_routing_key.is_some() {
        (before, death) =
            reconstruct(&props, true).map_err(|e| Unreadable::NoDeathRecord(e.to_string()))?;
    }
    let reason = death
        .reason
        .parse::<DeadLetterReason>()
        .map_err(|_| Unreadable::UnknownReason(death.reason.clone()))?;
    let time = if death.time == 0 {
        now_secs()
    } else {
        death.time
    };
    // The upstream recorded the publish key and the CC keys; the BCC keys come from the
    // proxy's private header.
    let mut routing_keys = death.routing_keys;
    routing_keys.extend(kept_bcc_keys(&before));
    Ok((
        Death {
            queue: Arc::from(death.queue.as_str()),
            reason,
            before,
            raw_before: message.raw_properties.clone(),
            exchange: death.exchange,
            routing_keys,
            time,
            body: message.body.clone(),
        },
        tag.map(|t| t.to_arguments()).or_else(|| {
            own_routing_key.map(|key| QueueArguments {
                dead_letter_routing_key: Some(key),
                ..QueueArguments::default()
            })
        }),
    ))
}

/// `dead_letter_dropped_total{cause}` of a message the proxy put back into its queue (a
/// requeue counted against a delivery limit, a kept dead letter, a retry whose delay passed)
/// after the queue was deleted.
pub(crate) const DROPPED_QUEUE_DELETED: &str = "queue_deleted";
/// The drop cause of a retry whose queue refused it back at a `reject-publish` length limit.
pub(crate) const DROPPED_TARGET_FULL: &str = "target_full";

/// How a retry nacked on its way back into its queue ends, by the queue's overflow (the
/// caller passes drop-head for a queue without a length limit; `None`: it is held and
/// retried, as any refused publish). A full queue refuses it as it refuses a
/// publish: `reject-publish` drops it (counted `target_full`), and `reject-publish-dlx` has
/// dead-lettered it (`maxlen`) as well as refusing it, so publishing it again would make
/// another dead letter each time. Any other nack (a queue without a length limit that
/// refuses: a lost leader, a crashed queue) is retried.
pub(crate) fn refused_return_ends(
    metrics: &Metrics,
    vhost: &str,
    op: &Op,
    overflow: crate::rabbit::args::Overflow,
) -> Option<Settlement> {
    use crate::rabbit::args::Overflow;
    match overflow {
        Overflow::DropHead => return None,
        Overflow::RejectPublish => metrics.dropped(vhost, &op.queue, DROPPED_TARGET_FULL),
        Overflow::RejectPublishDlx => {}
    }
    metrics.add_retry_held(vhost, &op.queue, -1);
    Some(Settlement::Ack)
}

/// How the original of a finished publish is settled, with the publish counted in the
/// metrics (dead-lettered, dropped); `None` for a refused publish (nacked, timed out, lost,
/// 403), which the caller holds and retries ([`super::retry`]).
pub(crate) fn settle(
    metrics: &Metrics,
    vhost: &str,
    op: &Op,
    outcome: &Outcome,
) -> Option<Settlement> {
    Some(match (op.purpose, outcome) {
        (Purpose::DeadLetter(reason), Outcome::Confirmed) => {
            metrics.dead_lettered(vhost, &op.queue, reason.as_str());
            metrics.observe_dead_letter_latency(op.started.elapsed());
            Settlement::Ack
        }
        (Purpose::DeadLetter(_), Outcome::Unroutable) => {
            metrics.dropped(vhost, &op.queue, "unroutable");
            Settlement::Ack
        }
        (Purpose::DeadLetter(_), Outcome::ExchangeMissing) => {
            metrics.dropped(vhost, &op.queue, "no_dlx");
            Settlement::Ack
        }
        // The queue itself is gone (deleted while its message was out): the message goes
        // with it, counted.
        (Purpose::Requeue, Outcome::Unroutable | Outcome::ExchangeMissing) => {
            metrics.dropped(vhost, &op.queue, DROPPED_QUEUE_DELETED);
            Settlement::Ack
        }
        (Purpose::Requeue, Outcome::Confirmed) => Settlement::Ack,
        (Purpose::KeepDeadLetter, Outcome::Confirmed) => {
            metrics.dead_letter_kept(vhost, &op.queue);
            Settlement::Ack
        }
        // The queue is gone: the dead letter goes with it.
        (Purpose::KeepDeadLetter, Outcome::Unroutable | Outcome::ExchangeMissing) => {
            metrics.dropped(vhost, &op.queue, DROPPED_QUEUE_DELETED);
            Settlement::Ack
        }
        (Purpose::RetryHold { tier, .. }, Outcome::Confirmed) => {
            metrics.retried(vhost, &op.queue, tier);
            metrics.add_retry_held(vhost, &op.queue, 1);
            Settlement::Ack
        }
        // The delay queue is missing (deleted since it was declared): held and retried, see
        // [`retry_reason`].
        (Purpose::RetryHold { .. }, Outcome::Unroutable | Outcome::ExchangeMissing) => {
            return None;
        }
        // Back in its queue.
        (Purpose::RetryReturn, Outcome::Confirmed) => {
            metrics.add_retry_held(vhost, &op.queue, -1);
            Settlement::Ack
        }
        // Its queue is gone (deleted while the message waited).
        (Purpose::RetryReturn, Outcome::Unroutable | Outcome::ExchangeMissing) => {
            metrics.add_retry_held(vhost, &op.queue, -1);
            metrics.dropped(vhost, &op.queue, DROPPED_QUEUE_DELETED);
            Settlement::Ack
        }
        // A counted requeue that cannot be republished (its properties with the count no
        // longer fit a frame) goes back natively, uncounted: a requeue never loses the
        // message.
        (Purpose::Requeue, Outcome::Failed(cause)) if *cause == super::publisher::UNPUBLISHABLE => {
            requeue_unpublishable(metrics, &op.queue, cause)
        }
        (_, Outcome::Failed(cause)) if *cause == super::publisher::UNPUBLISHABLE => {
            drop_unpublishable(metrics, vhost, &op.queue, cause);
            Settlement::Ack
        }
        (_, Outcome::Failed(_) | Outcome::TimedOut | Outcome::AccessRefused) => return None,
    })
}

/// A counted requeue no publish can carry: the original goes back natively and this return
/// is not counted against the delivery limit (logged, and counted as a failed publish).
pub(crate) fn requeue_unpublishable(metrics: &Metrics, queue: &str, why: &str) -> Settlement {
    tracing::warn!(
        queue,
        why,
        "a requeue counted against the delivery limit cannot be published; requeued uncounted"
    );
    metrics.dead_letter_publish_failed("invalid");
    Settlement::Requeue
}

/// Why a finished publish is held and published again (`None`: it ended). As
/// [`RetryReason::of`], and a message for a delay queue that routed nowhere (the queue was
/// deleted; the next publish declares it again) is retried too rather than lost.
pub(crate) fn retry_reason(op: &Op, outcome: &Outcome) -> Option<RetryReason> {
    match (op.purpose, outcome) {
        (Purpose::RetryHold { .. }, Outcome::Unroutable | Outcome::ExchangeMissing) => {
            Some(RetryReason::Unroutable)
        }
        _ => RetryReason::of(outcome),
    }
}

/// A dead letter no publish can carry (a name that is not a short string, such as a
/// dead-letter routing key taken from a long CC entry): dropped and counted, since retrying
/// would loop. The caller settles the original.
pub(crate) fn drop_unpublishable(metrics: &Metrics, vhost: &str, queue: &str, why: &str) {
    tracing::warn!(queue, why, "cannot publish the dead letter; dropped");
    metrics.dead_letter_publish_failed("invalid");
    metrics.dropped(vhost, queue, "unpublishable");
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

    use super::*;

    fn death(reason: DeadLetterReason, with_history: bool) -> Death {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("CC"),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                LongString::from("elsewhere"),
            )])),
        );
        if with_history {
            let mut entry = FieldTable::default();
            entry.insert(
                ShortString::from("queue"),
                AMQPValue::LongString(LongString::from("q")),
            );
            entry.insert(
                ShortString::from("reason"),
                AMQPValue::LongString(LongString::from("rejected")),
            );
            headers.insert(
                ShortString::from("x-death"),
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
            );
        }
        let before = BasicProperties::default().with_headers(headers);
        Death {
            queue: Arc::from("dlq"),
            reason,
            raw_before: crate::amqp::content::encode_properties(&before),
            before,
            exchange: String::new(),
            routing_keys: vec!["dlq".into()],
            time: 0,
            body: Bytes::from_static(b"m"),
        }
    }

    /// A captured message whose newest x-death entry recorded `published_with` and which
    /// reached the capture queue with `routing_key`.
    fn captured(routing_key: &str, published_with: &str) -> CapturedMessage {
        let text = |t: &str| AMQPValue::LongString(LongString::from(t));
        let mut entry = FieldTable::default();
        entry.insert(ShortString::from("queue"), text("q"));
        entry.insert(ShortString::from("reason"), text("expired"));
        entry.insert(
            ShortString::from("routing-keys"),
            AMQPValue::FieldArray(FieldArray::from(vec![text(published_with)])),
        );
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-death"),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
        );
        let props = BasicProperties::default().with_headers(headers);
        CapturedMessage {
            delivery_tag: 1,
            epoch: 1,
            routing_key: routing_key.to_string(),
            raw_properties: crate::amqp::content::encode_properties(&props),
            body: Bytes::from_static(b"m"),
        }
    }

    #[test]
    fn a_tag_is_the_queues_only_when_the_message_was_not_published_with_it() {
        let tag = CaptureTag {
            dead_letter_exchange: Some("dlx".into()),
            dead_letter_routing_key: None,
            delivery_limit: None,
            retry_delays: None,
        }
        .encode()
        .unwrap();
        // The queue's dead-letter routing key (the tag) replaced the publish key.
        let (death, settings) = from_capture(&captured(&tag, "q")).unwrap();
        assert_eq!(death.routing_keys, ["q"]);
        let settings = settings.expect("the queue's tag");
        assert_eq!(settings.dead_letter_exchange.as_deref(), Some("dlx"));
        // A queue without a dead-letter routing key kept the publish key: a tag chosen by
        // the publisher (to pick the dead-letter exchange) is not taken.
        let (death, settings) = from_capture(&captured(&tag, &tag)).unwrap();
        assert_eq!(death.routing_keys.as_slice(), std::slice::from_ref(&tag));
        assert!(settings.is_none(), "{settings:?}");
    }

    #[test]
    fn only_an_expired_dead_letter_is_kept_and_only_when_asked() {
        let kept = kept_in_queue(&death(DeadLetterReason::Expired, true), true).unwrap();
        assert_eq!(
            (kept.exchange.as_str(), kept.routing_key.as_str()),
            ("", "dlq")
        );
        assert_eq!(&kept.body[..], b"m");
        let props = decode_properties(&kept.raw_properties).unwrap();
        let headers = props.headers().clone().unwrap();
        assert!(
            headers.inner().get("CC").is_none(),
            "no copy to the CC queues"
        );
        assert_eq!(crate::deadletter::x_death_entries(&props).len(), 1);
        assert!(kept_in_queue(&death(DeadLetterReason::Expired, true), false).is_none());
        assert!(kept_in_queue(&death(DeadLetterReason::Expired, false), true).is_none());
        assert!(kept_in_queue(&death(DeadLetterReason::MaxLen, true), true).is_none());
    }
}
