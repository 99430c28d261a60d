//! What the proxy changes on a client connection: queue.declare (policy merge, dead-letter
//! arguments taken over, held until the vhost's capture objects exist), client settlements
//! (reject/nack dead-lettered by the proxy, requeues counted against delivery limits), and the
//! end of each operation (the original is settled only after the confirm; a refused publish
//! is held and retried, see [`super::retry`]). Captured messages are the service
//! connection's ([`super::service`]).

use std::sync::Arc;
use std::time::Instant;

use amq_protocol::protocol::{AMQPClass, basic, queue};
use amq_protocol::types::FieldTable;
use bytes::Bytes;

use super::QueueView;
use super::channels::{DeclareRecord, PendingDeclare};
use super::death::{Death, Plan, drop_unpublishable, now_secs, plan, settle};
use super::declare::{DeadLetterHandling, DeclareRewrite, DeclaredQueue, rewrite_declare};
use super::inflight::{KeptDelivery, NativeSettle, Verb};
use super::ops::{Op, Origin, Purpose, Settlement};
use super::outgoing::{delivery_count, delivery_routing_keys, requeue_publish};
use super::probe::ProbeAnswer;
use super::publisher::{OpId, Outcome, OutgoingMessage};
use super::retry::RetryReason;
use super::session::Session;
use super::wire::{WireFrame, method_frame};
use crate::amqp::codec::decode_method;
use crate::amqp::content::{decode_properties, keep_opaque_headers};
use crate::amqp::reply;
use crate::deadletter::DeadLetterReason;
use crate::rabbit::args::ArgumentError;

/// The frame for a native settlement.
fn settle_frame(channel: u16, settle: NativeSettle) -> Bytes {
    let method = match settle.verb {
        Verb::Ack => basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: settle.tag,
            multiple: settle.multiple,
        }),
        Verb::Reject { requeue } => basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: settle.tag,
            requeue,
        }),
        Verb::Nack { requeue } => basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: settle.tag,
            multiple: settle.multiple,
            requeue,
        }),
    };
    method_frame(channel, AMQPClass::Basic(method))
}

/// A queue.declare held until the probe says whether the queue exists.
#[derive(Debug)]
pub(super) struct PendingProbe {
    channel: u16,
    declare: queue::Declare,
    /// The validated rewrite, or why the arguments are refused (an existing queue is compared
    /// before its arguments are validated, as RabbitMQ does).
    rewrite: Result<DeclareRewrite, ArgumentError>,
}

/// A queue.declare held until the vhost's capture objects exist.
#[derive(Debug)]
pub(super) struct HeldDeclare {
    frame: WireFrame,
    pub(super) deadline: Instant,
}

/// How a declare goes upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UpstreamDeclare {
    /// The queue is new (or the upstream decides): declared with the proxy's arguments, and
    /// the client's declaration replaces what was remembered.
    Create,
    /// The queue exists: declared passively; the client's declaration is remembered only if
    /// nothing was (`remember`).
    Existing { remember: bool },
}

impl Session {
    // ------------------------------------------------------------------------------------
    // queue.declare
    // ------------------------------------------------------------------------------------

    pub(super) fn client_queue_declare(&mut self, frame: WireFrame) {
        let channel = frame.channel;
        let Some(method) = self.decode_client_method(&frame) else {
            return;
        };
        let AMQPClass::Queue(queue::AMQPMethod::Declare(declare)) = method else {
            self.close_client(
                reply::SYNTAX_ERROR,
                "SYNTAX_ERROR - queue.declare does not parse",
                50,
                10,
            );
            return;
        };
        let name = declare.queue.as_str().to_string();
        let untouched = declare.passive
            || name == self.shared.capture_name
            || !self.channels.get(&channel).is_some_and(|ch| ch.is_open());
        if untouched {
            if !declare.nowait
                && let Some(ch) = self.channels.get_mut(&channel)
            {
                ch.pending_declares.push_back(PendingDeclare::default());
            }
            self.send_upstream(frame.raw);
            return;
        }
        let handling = if self.shared.delegate_to_upstream || self.publisher.is_none() {
            DeadLetterHandling::Delegate
        } else {
            DeadLetterHandling::Capture {
                exchange: self.shared.capture_name.clone(),
            }
        };
        if matches!(handling, DeadLetterHandling::Capture { .. }) && !self.capture_declared() {
            // The upstream queue will dead-letter into the capture exchange: it must exist
            // first, or RabbitMQ drops those dead letters silently (see `service`).
            self.hold_for_capture(frame);
            return;
        }
        let policy = self
            .shared
            .policies
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .for_queue(&self.vhost, &name)
            .map(|p| p.definition.clone());
        let rewrite = rewrite_declare(
            &declare.arguments,
            policy.as_ref(),
            self.shared.default_delivery_limit,
            &handling,
        );
        let question = if name.is_empty() {
            None
        } else {
            self.probe.as_mut().and_then(|p| p.ask(&declare.queue))
        };
        match (question, rewrite) {
            (Some(bytes), rewrite) => {
                self.send_upstream(bytes);
                self.pending_probe = Some(PendingProbe {
                    channel,
                    declare,
                    rewrite,
                });
            }
            (None, Err(err)) => self.refuse_declare(channel, &name, &err),
            (None, Ok(rewrite)) => {
                self.forward_declare(channel, declare, rewrite, UpstreamDeclare::Create)
            }
        }
    }

    /// Whether this vhost's capture exchange, queue and binding exist.
    fn capture_declared(&self) -> bool {
        self.capture_status
            .as_ref()
            .is_some_and(|status| status.borrow().declared)
    }

    /// Holds a queue.declare (client reads pause) until the vhost's service connection has
    /// declared the capture objects, at most `proxy.capture_ready_timeout_secs`. With no
    /// service connection for the vhost (over `proxy.max_service_vhosts`) it is refused at
    /// once.
    fn hold_for_capture(&mut self, frame: WireFrame) {
        if self.capture_status.is_none() {
            self.refuse_capture_not_ready(
                "it has no service connection (proxy.max_service_vhosts)",
            );
            return;
        }
        self.held_for_capture = Some(HeldDeclare {
            frame,
            deadline: self.now + self.shared.capture_ready_timeout,
        });
    }

    /// The capture objects exist now: the held declare goes on.
    pub(super) fn resume_held_declare(&mut self) {
        if self.capture_declared()
            && let Some(held) = self.held_for_capture.take()
        {
            self.client_queue_declare(held.frame);
        }
    }

    /// The held declare waited too long: the client connection is closed with 320
    /// CONNECTION_FORCED (a client reconnects, perhaps through another instance), so no queue
    /// is ever created whose dead letters would have nowhere to go.
    pub(super) fn capture_wait_expired(&mut self, now: Instant) {
        if self
            .held_for_capture
            .as_ref()
            .is_some_and(|held| now >= held.deadline)
        {
            self.held_for_capture = None;
            self.refuse_capture_not_ready(
                "its service connection is not ready (upstream unreachable?)",
            );
        }
    }

    fn refuse_capture_not_ready(&mut self, why: &str) {
        let text = format!(
            "CONNECTION_FORCED - dead-letter capture for vhost '{}' is unavailable: {why}; \
             reconnect and retry",
            self.vhost
        );
        tracing::warn!(peer = %self.peer, vhost = %self.vhost, why, "queue.declare refused: capture not ready");
        self.close_client(reply::CONNECTION_FORCED, &text, 50, 10);
    }

    /// The probe answered. An existing queue is compared with the declaration remembered for
    /// it (406 when inequivalent) and declared passively; a missing one is created with the
    /// proxy's upstream arguments.
    pub(super) fn on_probe_answer(&mut self, answer: ProbeAnswer) {
        let Some(pending) = self.pending_probe.take() else {
            return;
        };
        let open = self
            .channels
            .get(&pending.channel)
            .is_some_and(|ch| ch.is_open());
        if !open {
            return;
        }
        let name = pending.declare.queue.as_str().to_string();
        let how = match answer {
            ProbeAnswer::Exists => match self.shared.queues.lookup_declared(&self.vhost, &name) {
                Some(known) => {
                    if let Err(text) = known.check_redeclare(&pending.declare, &self.vhost) {
                        tracing::debug!(peer = %self.peer, %text, "queue.declare refused");
                        self.close_channel_by_proxy(
                            pending.channel,
                            reply::PRECONDITION_FAILED,
                            &format!("PRECONDITION_FAILED - {text}"),
                            50,
                            10,
                        );
                        return;
                    }
                    UpstreamDeclare::Existing { remember: false }
                }
                None => UpstreamDeclare::Existing { remember: true },
            },
            ProbeAnswer::Missing => {
                // Whatever was remembered belongs to a queue that is gone.
                self.shared.queues.forget(&self.vhost, &name);
                UpstreamDeclare::Create
            }
            ProbeAnswer::Unknown => UpstreamDeclare::Create,
        };
        match pending.rewrite {
            Ok(rewrite) => self.forward_declare(pending.channel, pending.declare, rewrite, how),
            Err(err) => self.refuse_declare(pending.channel, &name, &err),
        }
    }

    /// Answers a declare with invalid arguments with the broker's 406.
    fn refuse_declare(&mut self, channel: u16, queue: &str, err: &ArgumentError) {
        let text = err.reply_text(queue, &self.vhost);
        tracing::debug!(peer = %self.peer, %text, "queue.declare refused");
        self.close_channel_by_proxy(channel, err.reply_code(), &text, 50, 10);
    }

    fn forward_declare(
        &mut self,
        channel: u16,
        declare: queue::Declare,
        rewrite: DeclareRewrite,
        how: UpstreamDeclare,
    ) {
        let name = declare.queue.as_str().to_string();
        let mut upstream = declare.clone();
        let record = match how {
            UpstreamDeclare::Existing { remember } => {
                upstream.passive = true;
                upstream.arguments = FieldTable::default();
                remember.then_some(false)
            }
            UpstreamDeclare::Create => {
                upstream.arguments = rewrite.upstream_arguments;
                Some(true)
            }
        }
        .map(|replace| DeclareRecord {
            declared: DeclaredQueue::new(&declare, rewrite.client_arguments),
            replace,
        });
        if let Some(ch) = self.channels.get_mut(&channel) {
            if declare.nowait {
                ch.last_queue = Some(Arc::from(name.as_str()));
                if let Some(record) = record {
                    self.remember_declare(&name, record);
                }
            } else {
                ch.pending_declares.push_back(PendingDeclare { record });
            }
        }
        self.send_upstream(method_frame(
            channel,
            AMQPClass::Queue(queue::AMQPMethod::Declare(upstream)),
        ));
    }

    fn remember_declare(&self, queue: &str, record: DeclareRecord) {
        if record.replace {
            self.shared
                .queues
                .record(&self.vhost, queue, record.declared);
        } else {
            self.shared
                .queues
                .record_if_absent(&self.vhost, queue, record.declared);
        }
    }

    pub(super) fn upstream_declare_ok(&mut self, frame: &WireFrame) {
        let Some(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))) =
            decode_method(&frame.payload)
        else {
            return;
        };
        let Some(ch) = self.channels.get_mut(&frame.channel) else {
            return;
        };
        let name = ok.queue.as_str();
        ch.last_queue = Some(Arc::from(name));
        if let Some(PendingDeclare {
            record: Some(record),
        }) = ch.pending_declares.pop_front()
        {
            self.remember_declare(name, record);
        }
    }

    // ------------------------------------------------------------------------------------
    // basic.ack / basic.reject / basic.nack
    // ------------------------------------------------------------------------------------

    pub(super) fn client_settle(&mut self, frame: WireFrame, verb: Verb, tag: u64, multiple: bool) {
        let channel = frame.channel;
        let shared = self.shared.clone();
        let vhost = self.vhost.clone();
        let proxy_active = self.publisher.is_some();
        let Some(ch) = self.channels.get_mut(&channel) else {
            self.send_upstream(frame.raw);
            return;
        };
        let channel_id = ch.id;
        let kept_before = ch.deliveries.kept_len();
        let mut views: Vec<(Arc<str>, QueueView)> = Vec::new();
        let (plan, released_bytes) = ch.deliveries.plan_settlement(verb, tag, multiple, |d| {
            if !proxy_active || !verb.is_negative() || !d.with_content {
                return false;
            }
            let view = match views.iter().find(|(q, _)| *q == d.queue) {
                Some((_, view)) => view.clone(),
                None => {
                    let view = shared.queue_view(&vhost, &d.queue, None);
                    views.push((d.queue.clone(), view.clone()));
                    view
                }
            };
            if verb.requeues() {
                view.proxy_delivery_limit
            } else {
                view.settings.dead_letter_exchange.is_some()
            }
        });
        let released_count = kept_before - ch.deliveries.kept_len();
        self.release_inflight(released_count, released_bytes);
        if verb == Verb::Ack && released_count > 0 {
            self.shared.metrics.acked(released_count as u64);
        }
        if !plan.already_pending.is_empty() {
            tracing::debug!(
                peer = %self.peer,
                channel,
                tags = ?plan.already_pending,
                "client settled a delivery the proxy is already dead-lettering"
            );
        }
        if plan.forward_original {
            self.send_upstream(frame.raw);
        } else {
            for native in &plan.native {
                self.send_upstream(settle_frame(channel, *native));
            }
        }
        for (delivery_tag, delivery) in plan.taken_over {
            let view = views
                .iter()
                .find(|(q, _)| *q == delivery.queue)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| self.shared.queue_view(&self.vhost, &delivery.queue, None));
            let origin = Origin::Client {
                channel,
                channel_id,
                tag: delivery_tag,
            };
            self.take_over(origin, verb, delivery, &view);
        }
    }

    /// Dead-letters a rejected delivery, or republishes a requeued one with its delivery count.
    fn take_over(&mut self, origin: Origin, verb: Verb, delivery: KeptDelivery, view: &QueueView) {
        let props = match decode_properties(&delivery.raw_properties) {
            Ok(props) => props,
            Err(err) => {
                tracing::warn!(%err, queue = &*delivery.queue, "delivered properties do not decode; settling natively");
                let settlement = if verb.requeues() {
                    Settlement::Requeue
                } else {
                    self.shared
                        .metrics
                        .dropped(&self.vhost, &delivery.queue, "undecodable");
                    Settlement::Ack
                };
                self.settle_origin(origin, settlement);
                return;
            }
        };
        let routing_keys = delivery_routing_keys(&delivery.routing_key, &props);
        if verb.requeues() {
            let count = delivery_count(&props).saturating_add(1);
            let limit = view
                .settings
                .delivery_limit
                .map_or(i64::MAX, |l| i64::try_from(l).unwrap_or(i64::MAX));
            if count <= limit {
                let mut message = requeue_publish(&props, &delivery.queue, count, delivery.body);
                message.raw_properties =
                    keep_opaque_headers(message.raw_properties, &delivery.raw_properties);
                self.publish_op(origin, Purpose::Requeue, delivery.queue, message);
                return;
            }
            let death = Death {
                queue: delivery.queue,
                reason: DeadLetterReason::DeliveryLimit,
                before: props,
                raw_before: delivery.raw_properties,
                exchange: delivery.exchange,
                routing_keys,
                time: now_secs(),
                body: delivery.body,
            };
            self.dead_letter_message(origin, death, view);
            return;
        }
        let death = Death {
            queue: delivery.queue,
            reason: DeadLetterReason::Rejected,
            before: props,
            raw_before: delivery.raw_properties,
            exchange: delivery.exchange,
            routing_keys,
            time: now_secs(),
            body: delivery.body,
        };
        self.dead_letter_message(origin, death, view);
    }

    /// Rewrites a dead message with the pure rules and publishes it to its dead-letter
    /// exchange; drops (and counts) it when there is nowhere to go.
    fn dead_letter_message(&mut self, origin: Origin, death: Death, view: &QueueView) {
        let queue = death.queue.clone();
        let purpose = Purpose::DeadLetter(death.reason);
        match plan(death, view, &self.shared.dead_letter_options) {
            Plan::Discard => self.settle_origin(origin, Settlement::Ack),
            Plan::Drop(cause) => {
                self.shared.metrics.dropped(&self.vhost, &queue, cause);
                self.settle_origin(origin, Settlement::Ack);
            }
            Plan::Publish(publish) => self.publish_op(origin, purpose, queue, publish),
        }
    }

    fn publish_op(
        &mut self,
        origin: Origin,
        purpose: Purpose,
        queue: Arc<str>,
        message: OutgoingMessage,
    ) {
        self.start_op(Op::new(origin, purpose, queue, message, Instant::now()));
    }

    /// Publishes an operation's message (first time or retry) and tracks it until its confirm.
    fn start_op(&mut self, op: Op) {
        let op_id = self.next_op;
        self.next_op += 1;
        let published = match self.publisher.as_mut() {
            Some(publisher) => publisher.publish(op_id, &op.message, self.now),
            None => Err("no publisher channel"),
        };
        match published {
            Ok(bytes) => {
                self.send_upstream(bytes);
                if let Origin::Client {
                    channel,
                    channel_id,
                    ..
                } = op.origin
                    && let Some(ch) = self.channels.get_mut(&channel)
                    && ch.id == channel_id
                {
                    ch.ops += 1;
                }
                if op.refusals > 0 {
                    self.retrying += 1;
                }
                self.ops.insert(op_id, op);
            }
            Err(why) => {
                drop_unpublishable(&self.shared.metrics, &self.vhost, &op.queue, why);
                self.release_held(&op);
                self.settle_origin(op.origin, Settlement::Ack);
            }
        }
    }

    // ------------------------------------------------------------------------------------
    // The end of an operation
    // ------------------------------------------------------------------------------------

    /// A publish of the proxy's channel ended: settle the original accordingly, or hold it
    /// for a retry when the publish was refused.
    pub(super) fn complete_op(&mut self, op_id: OpId, outcome: Outcome) {
        let Some(op) = self.take_op(op_id) else {
            return;
        };
        if let Some(reason) = RetryReason::of(&outcome) {
            self.refused(op, &outcome, reason);
            return;
        }
        self.release_held(&op);
        let Some(settlement) = settle(&self.shared.metrics, &self.vhost, &op, &outcome) else {
            return;
        };
        self.settle_origin(op.origin, settlement);
        self.op_finished(op.origin);
    }

    /// Removes an operation from the ones awaiting a confirm.
    fn take_op(&mut self, op_id: OpId) -> Option<Op> {
        let op = self.ops.remove(&op_id)?;
        if op.refusals > 0 {
            self.retrying = self.retrying.saturating_sub(1);
        }
        Some(op)
    }

    /// The upstream refused a publish: the original stays unacked upstream, held (charged
    /// against the inflight bound) until a later publish of the same message is confirmed.
    /// Not while the connection or the original's channel is going away: the upstream
    /// requeues the original then, so nothing is lost and nothing is held.
    fn refused(&mut self, mut op: Op, outcome: &Outcome, reason: RetryReason) {
        let metrics = self.shared.metrics.clone();
        metrics.dead_letter_publish_failed(reason.failure_cause(outcome));
        let origin = op.origin;
        if !self.can_hold(origin) {
            self.release_held(&op);
            self.op_finished(origin);
            return;
        }
        metrics.dead_letter_retry(reason.as_str());
        if op.held_charge == 0 {
            op.held_charge = op.charge();
            self.inflight_bytes += op.held_charge;
            self.inflight_count += 1;
            metrics.add_inflight(1, op.held_charge as i64);
            metrics.add_held_dead_letters(1);
        }
        let attempt = op.note_refusal(reason);
        self.held
            .schedule(self.now, attempt, rand::random::<f64>(), op);
        self.op_finished(origin);
    }

    /// Whether a refused publish may be held for a retry: both sides are open and the
    /// original's client channel is the one it came on.
    fn can_hold(&self, origin: Origin) -> bool {
        if self.client_side != super::session::Side::Open
            || self.upstream_side != super::session::Side::Open
            || self.publisher.is_none()
        {
            return false;
        }
        match origin {
            Origin::Client {
                channel,
                channel_id,
                ..
            } => self.channels.get(&channel).is_some_and(|ch| {
                ch.id == channel_id && ch.phase == super::channels::ChannelPhase::Open
            }),
            // Captured messages are the service connection's, never on a client session.
            Origin::Capture { .. } => false,
        }
    }

    /// Publishes again the held messages whose backoff is over (those whose channel went
    /// away meanwhile are let go: the upstream requeued their originals).
    pub(super) fn retry_due(&mut self, now: Instant) {
        for op in self.held.take_due(now) {
            if self.can_hold(op.origin) {
                self.start_op(op);
            } else {
                self.release_held(&op);
            }
        }
    }

    /// Lets go of held messages `gone` selects, without settling them (their channel or
    /// connection is going away and the upstream requeues the originals).
    pub(super) fn let_go_held(&mut self, gone: impl FnMut(&Op) -> bool) {
        for op in self.held.take_where(gone) {
            self.release_held(&op);
        }
    }

    /// Lets go of the held messages of a client channel.
    pub(super) fn let_go_held_of_channel(&mut self, channel: u16) {
        self.let_go_held(
            |op| matches!(op.origin, Origin::Client { channel: c, .. } if c == channel),
        );
    }

    /// Ends an operation's hold: its charge leaves the inflight bound and the held gauge.
    fn release_held(&mut self, op: &Op) {
        if op.held_charge > 0 {
            self.release_inflight(1, op.held_charge);
            self.shared.metrics.add_held_dead_letters(-1);
        }
    }

    /// Forgets an operation without settling anything (the connection or channel is gone, so
    /// the upstream requeues the original itself).
    pub(super) fn abandon_op(&mut self, op_id: OpId) {
        if let Some(op) = self.take_op(op_id) {
            self.release_held(&op);
            self.op_finished(op.origin);
        }
    }

    /// Every operation, in flight or held, ends without settling its original (the
    /// connection is going away, so the upstream requeues the originals itself).
    pub(super) fn abandon_all_ops(&mut self) {
        if let Some(publisher) = self.publisher.as_mut() {
            publisher.fail_all();
        }
        self.let_go_held(|_| true);
        let ops: Vec<OpId> = self.ops.keys().copied().collect();
        for op in ops {
            self.abandon_op(op);
        }
    }

    fn op_finished(&mut self, origin: Origin) {
        if let Origin::Client {
            channel,
            channel_id,
            ..
        } = origin
        {
            let parked = match self.channels.get_mut(&channel) {
                Some(ch) if ch.id == channel_id => {
                    ch.ops = ch.ops.saturating_sub(1);
                    if ch.ops == 0 {
                        ch.parked_close.take()
                    } else {
                        None
                    }
                }
                _ => None,
            };
            if let Some(close) = parked {
                self.forward_channel_close(channel, close);
            }
        }
        self.maybe_finish_draining();
    }

    /// Settles the message an operation replaced (or gives it back to its queue).
    pub(super) fn settle_origin(&mut self, origin: Origin, settlement: Settlement) {
        match origin {
            Origin::Client {
                channel,
                channel_id,
                tag,
            } => {
                let live = match self.channels.get_mut(&channel) {
                    Some(ch) if ch.id == channel_id => {
                        ch.deliveries.finish_pending(tag);
                        matches!(
                            ch.phase,
                            super::channels::ChannelPhase::Open
                                | super::channels::ChannelPhase::ClosingByClient
                        )
                    }
                    _ => false,
                };
                if !live {
                    return;
                }
                let verb = match settlement {
                    Settlement::Ack => Verb::Ack,
                    Settlement::Requeue => Verb::Nack { requeue: true },
                };
                let frame = settle_frame(
                    channel,
                    NativeSettle {
                        verb,
                        tag,
                        multiple: false,
                    },
                );
                self.inject_upstream(channel, frame);
            }
            // Capture deliveries are settled by the service connection, never here.
            Origin::Capture { .. } => {}
        }
    }
}
