//! What the proxy changes on a client connection: queue.declare (policy merge, dead-letter
//! arguments taken over, held until the vhost's capture objects exist; streams and unknown
//! queue types pass through untouched), client settlements (reject/nack dead-lettered by the
//! proxy, requeues counted against delivery limits), and the end of each operation (the
//! original is settled only after the confirm; a refused publish is held and retried, see
//! [`super::retry`]). Captured messages are the service connection's ([`super::service`]).

use std::sync::Arc;
use std::time::Instant;

use amq_protocol::protocol::{AMQPClass, queue};
use amq_protocol::types::FieldTable;
use bytes::{Bytes, BytesMut};

use super::ProxyShared;
use super::arbiter::{DeclareCheck, Next, Verdict};
use super::channels::PendingDeclare;
use super::client_session::{ClientSession, Side};
use super::death::{
    Death, Plan, drop_unpublishable, now_secs, plan, requeue_unpublishable, retry_reason, settle,
};
use super::declare::{
    DeadLetterHandling, keep_own_dead_letter_arguments, passes_through, rewrite_declare,
    upstream_declare,
};
use super::inflight::{KeptDelivery, KeptMessage, NativeSettle, SettlementPlan, Verb};
use super::ops::{Op, Origin, Purpose, Route, Settlement};
use super::outgoing::{delivery_routing_keys, requeue_publish};
use super::pending::{HeldDeclare, PendingCheck, PendingRead};
use super::permission::{self, Permission};
use super::policy_sync::management::{ArgumentsListing, lookup_queue_arguments};
use super::probe::{CheckAnswer, CheckRequest};
use super::publisher::{OpId, Outcome, OutgoingMessage, USER_ID_REFUSED};
use super::readback::{ReadBack, ReadNext, ReadOutcome};
use super::registry::VerifiedQueue;
use super::retry::RetryReason;
use super::retry_tiers::{RetryPlan, plan_rejection};
use super::service::judge::DeclareRequest;
use super::service::link::PublishRequest;
use super::view_cache::ViewCache;
use super::wire::{WireFrame, method_frame};
use super::{QueueView, ReturnCounter};
use crate::amqp::codec::{decode_method, put_basic_ack, put_basic_nack, put_basic_reject};
use crate::amqp::content::{decode_properties, keep_opaque_headers};
use crate::amqp::reply;
use crate::deadletter::DeadLetterReason;
use crate::rabbit::args::{ARG_DEAD_LETTER_EXCHANGE, ArgumentError};

/// Why a dead letter handed to the service connection failed before it was published.
const SERVICE_UNAVAILABLE: &str = "service connection unavailable";

/// Whether a message carries a `user_id` property.
fn carries_user_id(message: &OutgoingMessage) -> bool {
    decode_properties(&message.raw_properties).map_or(true, |p| p.user_id().is_some())
}

/// The views one settlement decides with: each queue's is taken once (from the session's
/// [`ViewCache`]) and kept for the whole settlement, so its plan and its take-overs agree even
/// if the shared settings change in between.
type SettlementViews = Vec<(Arc<str>, Option<Arc<QueueView>>)>;

/// A client settlement planned by [`ClientSession::plan_client_settlement`], to be finished by
/// [`ClientSession::finish_client_settlement`].
pub(super) struct ClientSettlement {
    pub(super) plan: SettlementPlan,
    verb: Verb,
    channel_id: u64,
    views: SettlementViews,
}

impl ClientSettlement {
    /// Whether the client's frame goes upstream as it is and nothing else follows.
    pub(super) fn only_forwards(&self) -> bool {
        self.plan.forward_original && self.plan.taken_over.is_empty()
    }
}

/// The view of `queue` for this settlement.
fn cached_view(
    views: &mut SettlementViews,
    cache: &mut ViewCache,
    shared: &ProxyShared,
    vhost: &str,
    queue: &Arc<str>,
) -> Option<Arc<QueueView>> {
    if let Some((_, view)) = views.iter().find(|(q, _)| q == queue) {
        return view.clone();
    }
    let view = cache.view(shared, vhost, queue);
    views.push((queue.clone(), view.clone()));
    view
}

/// The frame for a native settlement (encoded by hand: one per settled delivery).
fn settle_frame(channel: u16, settle: NativeSettle) -> Bytes {
    let mut frame = BytesMut::with_capacity(24);
    match settle.verb {
        Verb::Ack => put_basic_ack(&mut frame, channel, settle.tag, settle.multiple),
        Verb::Reject { requeue } => put_basic_reject(&mut frame, channel, settle.tag, requeue),
        Verb::Nack { requeue } => {
            put_basic_nack(&mut frame, channel, settle.tag, settle.multiple, requeue);
        }
    }
    frame.freeze()
}

impl ClientSession {
    // ------------------------------------------------------------------------------------
    // queue.declare
    // ------------------------------------------------------------------------------------

    pub(super) fn client_queue_declare(&mut self, frame: WireFrame) {
        self.queue_declare(frame, true);
    }

    /// A client's queue.declare; `ask_write` is false when the capture-write probe just told
    /// nothing, so this declare goes natively without asking again.
    fn queue_declare(&mut self, frame: WireFrame, ask_write: bool) {
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
        // A stream (or a type the proxy does not know) goes as sent; its declare-ok records
        // that the proxy leaves the queue to RabbitMQ.
        let record = (!untouched && passes_through(&declare.arguments))
            .then_some(VerifiedQueue::PassedThrough);
        if untouched || record.is_some() {
            if let Some(ch) = self.channels.get_mut(&channel) {
                if !declare.nowait {
                    ch.pending_declares.push_back(PendingDeclare { record });
                    self.pending_answers += 1;
                } else if let Some(record) = record.filter(|_| !name.is_empty()) {
                    self.shared.queues.record(&self.vhost, &name, record);
                }
            }
            self.send_upstream(frame.raw);
            return;
        }
        // Server-named and exclusive queues belong to the client's connection, so only it can
        // declare them, and RabbitMQ checks its user's permissions on every argument: they
        // get the capture exchange when that user may write it (asked once per connection,
        // `capture_write`), and otherwise keep their own dead-letter arguments upstream
        // (docs/semantics.md).
        let own_queue = name.is_empty() || declare.exclusive;
        let proxied = !self.shared.delegate_to_upstream && self.publisher.is_some();
        if own_queue && proxied && ask_write && self.capture_write.known().is_none() {
            let request = self
                .check
                .is_some()
                .then(|| self.capture_write.ask(&self.shared.capture_name))
                .flatten();
            if let Some(request) = request {
                self.held_for_write_probe = Some(frame);
                self.check_send(request);
                return;
            }
        }
        let own_capture = own_queue && self.capture_write.known() == Some(true);
        let handling = if !proxied || (own_queue && !own_capture) {
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
        let mut rewrite = match rewrite_declare(
            &declare.arguments,
            policy.as_ref(),
            self.shared.default_delivery_limit,
            &handling,
        ) {
            Ok(rewrite) => rewrite,
            Err(err) => {
                self.refuse_declare(channel, &name, &err);
                return;
            }
        };
        if own_queue && !own_capture && !self.shared.delegate_to_upstream {
            keep_own_dead_letter_arguments(&mut rewrite.upstream_arguments, &declare.arguments);
        }
        // A queue whose upstream arguments are the proxy's (the capture exchange) is judged
        // and created by the declare connection, after the probe on the client's connection
        // said its user may declare it. An own queue is declared on the client's channel; the
        // probe runs first when it names its own dead-letter exchange, whose write permission
        // RabbitMQ would check and the capture exchange in its place would not.
        let capture = matches!(handling, DeadLetterHandling::Capture { .. });
        let checked = capture
            && self.check.is_some()
            && if own_queue {
                declare
                    .arguments
                    .inner()
                    .contains_key(ARG_DEAD_LETTER_EXCHANGE)
            } else {
                self.service.is_some()
            };
        if !checked {
            let record = VerifiedQueue::Proxied(rewrite.client_arguments);
            self.forward_declare(channel, &declare, rewrite.upstream_arguments, Some(record));
            return;
        }
        let check = DeclareCheck::new(&declare, &self.vhost, &rewrite, &self.shared.capture_name);
        self.check_declare(permission::probe(&declare));
        self.pending_check = Some(PendingCheck {
            channel,
            declare,
            client_arguments: rewrite.client_arguments,
            upstream_arguments: rewrite.upstream_arguments,
            check,
            probing: true,
            own: own_queue,
        });
    }

    /// The permission probe answered on the client's check channel: the check goes on with
    /// the declare connection, or the client gets RabbitMQ's refusal as it is.
    fn on_permission_answer(&mut self, answer: CheckAnswer) {
        let Some(mut pending) = self.pending_check.take() else {
            return;
        };
        if answer == CheckAnswer::DeclareOk {
            tracing::warn!(
                peer = %self.peer,
                vhost = %self.vhost,
                queue = pending.declare.queue.as_str(),
                argument = permission::PROBE_ARGUMENT,
                "the upstream accepted the permission probe (it does not validate the \
                 argument); the queue was declared with the client's flags"
            );
            self.close_check();
        }
        match permission::judge(&answer) {
            Permission::Granted if pending.own => {
                if self
                    .channels
                    .get(&pending.channel)
                    .is_some_and(|ch| ch.is_open())
                {
                    let record = VerifiedQueue::Proxied(pending.client_arguments);
                    self.forward_declare(
                        pending.channel,
                        &pending.declare,
                        pending.upstream_arguments,
                        Some(record),
                    );
                }
            }
            Permission::Granted => {
                pending.probing = false;
                let request = pending.check.request();
                self.pending_check = Some(pending);
                if !self.ask_service(request) {
                    self.pending_check = None;
                }
            }
            Permission::Refused { code, text } => {
                if self
                    .channels
                    .get(&pending.channel)
                    .is_some_and(|ch| ch.is_open())
                {
                    tracing::debug!(peer = %self.peer, %text, "queue.declare refused by the upstream");
                    self.close_channel_by_proxy(pending.channel, code, &text, 50, 10);
                }
            }
        }
    }

    /// Has the vhost's declare connection make `declare` (client reads pause until it
    /// answers, at most `proxy.capture_ready_timeout_secs`). When it cannot take it (its
    /// queue is full or gone) the client connection is closed with 320 and false returned.
    fn ask_service(&mut self, declare: queue::Declare) -> bool {
        let (answer, receiver) = tokio::sync::oneshot::channel();
        let sent = self.service.as_ref().is_some_and(|s| {
            s.declares
                .try_send(DeclareRequest { declare, answer })
                .is_ok()
        });
        if !sent {
            self.shared.metrics.service_declare_refused();
            self.refuse_capture_not_ready("its declare connection takes no more declares now");
            return false;
        }
        self.service_answer = Some(receiver);
        self.service_deadline = Some(self.now + self.shared.capture_ready_timeout);
        true
    }

    /// The declare connection answered (or was lost, `None`): the declare check or the
    /// read-back goes on.
    pub(super) fn on_service_answer(&mut self, answer: Option<CheckAnswer>) {
        self.service_answer = None;
        self.service_deadline = None;
        let Some(answer) = answer else {
            self.pending_check = None;
            self.pending_read = None;
            self.refuse_capture_not_ready("its declare connection was lost during a declare");
            return;
        };
        if self.pending_check.is_some() {
            self.on_check_answer(answer);
        } else {
            self.on_read_answer(answer);
        }
    }

    /// The declare connection did not answer in time: the client connection is closed with
    /// 320 (it reconnects and declares again).
    pub(super) fn service_wait_expired(&mut self, now: Instant) {
        if self
            .service_deadline
            .is_some_and(|deadline| now >= deadline)
        {
            self.service_answer = None;
            self.service_deadline = None;
            self.pending_check = None;
            self.pending_read = None;
            self.refuse_capture_not_ready(
                "its declare connection did not answer a declare in time",
            );
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

    /// The declare connection answered a round of the declare check: declare again, or
    /// settle the client's declare by the verdict ([`super::arbiter`]).
    fn on_check_answer(&mut self, answer: CheckAnswer) {
        let Some(mut pending) = self.pending_check.take() else {
            return;
        };
        let verdict = match answer {
            CheckAnswer::DeclareOk => pending.check.on_declare_ok(),
            CheckAnswer::Refused { code, text } => match pending.check.on_close(code, &text) {
                Next::Declare(again) => {
                    self.pending_check = Some(pending);
                    if !self.ask_service(again) {
                        self.pending_check = None;
                    }
                    return;
                }
                Next::Done(verdict) => {
                    if verdict == Verdict::Undecided {
                        tracing::warn!(
                            vhost = %self.vhost,
                            code,
                            %text,
                            "the declare connection's declare was refused; the client's \
                             declare goes upstream as the proxy computed it"
                        );
                    }
                    verdict
                }
            },
        };
        let open = self
            .channels
            .get(&pending.channel)
            .is_some_and(|ch| ch.is_open());
        if !open {
            return;
        }
        let channel = pending.channel;
        let declare = pending.declare;
        match verdict {
            Verdict::Verified(_) => {
                // The declare connection's declare-ok: the queue exists with these arguments.
                // The client's declare-ok (with the queue's real counts) comes from a passive
                // declare on its own connection, which checks no permission.
                let record = VerifiedQueue::Proxied(pending.client_arguments);
                let mut passive = declare.clone();
                passive.passive = true;
                self.forward_declare(channel, &passive, FieldTable::default(), Some(record));
            }
            Verdict::Refused { code, text } => {
                tracing::debug!(peer = %self.peer, %text, "queue.declare refused");
                self.close_channel_by_proxy(channel, code, &text, 50, 10);
            }
            Verdict::UpstreamOwned => {
                // RabbitMQ judges the client's own declare; its declare-ok confirms the
                // arguments it compares.
                let arguments = declare.arguments.clone();
                let record = VerifiedQueue::UpstreamOwned(pending.client_arguments);
                self.forward_declare(channel, &declare, arguments, Some(record));
            }
            Verdict::Undecided => {
                let record = VerifiedQueue::Proxied(pending.client_arguments);
                self.forward_declare(channel, &declare, pending.upstream_arguments, Some(record));
            }
        }
    }

    /// Starts reading back the arguments of `queue`, which a client consumes from or gets
    /// from, when this instance has nothing verified about it: the client's `frame` waits
    /// (client reads pause) and `None` is returned. Otherwise the frame is given back.
    pub(super) fn read_back(&mut self, frame: WireFrame, queue: Arc<str>) -> Option<WireFrame> {
        let wanted = self.publisher.is_some()
            && self.pending_check.is_none()
            && self.pending_read.is_none()
            && !queue.is_empty()
            && *queue != *self.shared.capture_name
            && self
                .shared
                .queues
                .lookup_fresh(&self.vhost, &queue, self.now)
                .is_none();
        let read = wanted
            .then(|| ReadBack::new(&queue, &self.vhost, &self.shared.capture_name))
            .flatten();
        let Some(read) = read.filter(|_| self.service.is_some()) else {
            return Some(frame);
        };
        let request = read.request();
        self.pending_read = Some(PendingRead { frame, queue, read });
        if !self.ask_service(request) {
            self.pending_read = None;
        }
        None
    }

    /// The declare connection answered a read-back: ask again, or cache what was learned and let
    /// the client's method go.
    fn on_read_answer(&mut self, answer: CheckAnswer) {
        let Some(mut pending) = self.pending_read.take() else {
            return;
        };
        let next = match answer {
            CheckAnswer::DeclareOk => pending.read.on_declare_ok(),
            CheckAnswer::Refused { code, text } => pending.read.on_close(code, &text),
        };
        let outcome = match next {
            ReadNext::Declare(again) => {
                self.pending_read = Some(pending);
                if !self.ask_service(again) {
                    self.pending_read = None;
                }
                return;
            }
            ReadNext::Done(outcome) => outcome,
        };
        if outcome == ReadOutcome::Unknown
            && let Some(management) = self.shared.management.as_ref()
        {
            // The reply texts could not tell (cut at 255 bytes, most often): the management
            // API lists the arguments whole. The client's method waits for its answer.
            self.listing_answer = Some(lookup_queue_arguments(
                management,
                &self.vhost,
                &pending.queue,
            ));
            self.pending_read = Some(pending);
            return;
        }
        self.finish_read(pending.frame, &pending.queue, outcome);
    }

    /// The management API answered the listing asked by [`Self::on_read_answer`] (`None`: the
    /// lookup task ended without an answer).
    pub(super) fn on_listing_answer(&mut self, answer: Option<ArgumentsListing>) {
        self.listing_answer = None;
        let Some(PendingRead { frame, queue, read }) = self.pending_read.take() else {
            return;
        };
        let outcome = match answer {
            Some(Ok(listing)) => read.from_listing(listing.as_ref()),
            Some(Err(why)) => {
                tracing::warn!(queue = &*queue, %why, "management API did not list the queue");
                ReadOutcome::Unknown
            }
            None => ReadOutcome::Unknown,
        };
        self.finish_read(frame, &queue, outcome);
    }

    /// Caches what a read-back learned and lets the client's method go.
    fn finish_read(&mut self, frame: WireFrame, queue: &str, outcome: ReadOutcome) {
        match outcome {
            ReadOutcome::Learned(verified) => {
                self.shared.queues.confirm(&self.vhost, queue, verified)
            }
            ReadOutcome::Missing => self.shared.queues.forget(&self.vhost, queue),
            ReadOutcome::Unknown => {
                tracing::debug!(queue, "queue arguments not readable");
                self.shared.queues.touch(&self.vhost, queue);
            }
        }
        let channel = frame.channel;
        if self.channels.get(&channel).is_some_and(|ch| ch.is_open()) {
            self.client_method_now(frame);
        }
    }

    /// An answer on the client connection's check channel: the permission probe's or the
    /// capture-write probe's.
    pub(super) fn on_check_channel_answer(&mut self, answer: CheckAnswer) {
        if self.pending_check.as_ref().is_some_and(|p| p.probing) {
            self.on_permission_answer(answer);
        } else if self.capture_write.asking() {
            self.on_capture_write_answer(answer);
        }
    }

    /// The capture-write probe answered ([`super::capture_write`]): the held declare of an
    /// own queue goes on, with the capture exchange or natively.
    fn on_capture_write_answer(&mut self, answer: CheckAnswer) {
        if answer == CheckAnswer::DeclareOk {
            self.close_check();
        }
        let permitted = self.capture_write.on_answer(&answer);
        let known = self.capture_write.known().is_some();
        tracing::debug!(
            peer = %self.peer,
            permitted,
            ?answer,
            "may the client's user write the capture exchange"
        );
        if let Some(frame) = self.held_for_write_probe.take() {
            self.queue_declare(frame, known);
        }
    }

    /// Sends a declare on the check channel (opening it, or once its close is answered).
    fn check_declare(&mut self, declare: queue::Declare) {
        self.check_send(CheckRequest::Declare(declare));
    }

    /// Sends a check on the check channel (opening it, or once its close is answered).
    fn check_send(&mut self, request: CheckRequest) {
        if let Some(bytes) = self.check.as_mut().and_then(|c| c.send(request)) {
            self.send_upstream(bytes);
        }
    }

    /// Closes the check channel after a check.
    fn close_check(&mut self) {
        if let Some(bytes) = self.check.as_mut().and_then(|c| c.close()) {
            self.send_upstream(bytes);
        }
    }

    /// Answers a declare with invalid arguments with the broker's 406.
    fn refuse_declare(&mut self, channel: u16, queue: &str, err: &ArgumentError) {
        let text = err.reply_text(queue, &self.vhost);
        tracing::debug!(peer = %self.peer, %text, "queue.declare refused");
        self.close_channel_by_proxy(channel, err.reply_code(), &text, 50, 10);
    }

    /// Sends the client's declare upstream with `arguments`; its declare-ok records `record`
    /// (the upstream accepted those arguments for the queue).
    fn forward_declare(
        &mut self,
        channel: u16,
        declare: &queue::Declare,
        arguments: FieldTable,
        record: Option<VerifiedQueue>,
    ) {
        let name = declare.queue.as_str().to_string();
        if let Some(ch) = self.channels.get_mut(&channel) {
            if declare.nowait {
                ch.last_queue = Some(Arc::from(name.as_str()));
                if let Some(record) = record.filter(|_| !name.is_empty()) {
                    self.shared.queues.record(&self.vhost, &name, record);
                }
            } else {
                ch.pending_declares.push_back(PendingDeclare { record });
                self.pending_answers += 1;
            }
        }
        self.send_upstream(method_frame(
            channel,
            AMQPClass::Queue(queue::AMQPMethod::Declare(upstream_declare(
                declare, arguments,
            ))),
        ));
    }

    pub(super) fn upstream_declare_ok(&mut self, frame: &WireFrame) {
        let Some(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))) =
            decode_method(frame.payload())
        else {
            return;
        };
        let Some(ch) = self.channels.get_mut(&frame.channel) else {
            return;
        };
        let name = ok.queue.as_str();
        ch.last_queue = Some(Arc::from(name));
        let Some(pending) = ch.pending_declares.pop_front() else {
            return;
        };
        self.pending_answers = self.pending_answers.saturating_sub(1);
        if let Some(record) = pending.record {
            self.shared.queues.record(&self.vhost, name, record);
        }
    }

    // ------------------------------------------------------------------------------------
    // basic.ack / basic.reject / basic.nack
    // ------------------------------------------------------------------------------------

    pub(super) fn client_settle(&mut self, frame: WireFrame, verb: Verb, tag: u64, multiple: bool) {
        let channel = frame.channel;
        match self.plan_client_settlement(channel, verb, tag, multiple) {
            Some(settlement) => {
                if settlement.plan.forward_original {
                    self.send_upstream(frame.raw);
                }
                self.finish_client_settlement(channel, settlement);
            }
            None => self.send_upstream(frame.raw),
        }
    }

    /// Plans a client's basic.ack, basic.reject or basic.nack on `channel`: the kept
    /// deliveries it settles are released, and what goes upstream instead of (or besides) the
    /// client's frame is decided. `None` when the channel is not known (the frame goes on as
    /// it is). The caller forwards the frame when the plan says so, then calls
    /// [`Self::finish_client_settlement`].
    pub(super) fn plan_client_settlement(
        &mut self,
        channel: u16,
        verb: Verb,
        tag: u64,
        multiple: bool,
    ) -> Option<ClientSettlement> {
        let shared = &self.shared;
        let vhost = &self.vhost;
        let proxy_active = self.publisher.is_some();
        let ch = self.channels.get_mut(&channel)?;
        let channel_id = ch.id;
        let kept_before = ch.deliveries.kept_len();
        let mut views = SettlementViews::new();
        let cache = &mut self.view_cache;
        let (plan, released_bytes) = ch.deliveries.plan_settlement(verb, tag, multiple, |d| {
            if !proxy_active || !verb.is_negative() || !d.with_content() {
                return false;
            }
            // Only verified settings are acted on; otherwise the upstream decides.
            let Some(queue) = d.queue.as_ref() else {
                return false;
            };
            let Some(view) = cached_view(&mut views, cache, shared, vhost, queue) else {
                return false;
            };
            if verb.requeues() {
                view.takes_over_requeue(d)
            } else {
                view.settings.dead_letter_exchange.is_some() || view.settings.retry_delays.is_some()
            }
        });
        let released_count = kept_before - ch.deliveries.kept_len();
        self.release_inflight(released_count, released_bytes);
        if verb == Verb::Ack && released_count > 0 {
            self.counts.acked += released_count as u64;
        }
        if !plan.already_pending.is_empty() {
            tracing::debug!(
                peer = %self.peer,
                channel,
                tags = ?plan.already_pending,
                "client settled a delivery the proxy is already dead-lettering"
            );
        }
        Some(ClientSettlement {
            plan,
            verb,
            channel_id,
            views,
        })
    }

    /// The rest of a planned settlement, once the client's frame was forwarded if the plan
    /// said so: the native settlements sent instead of it, and the deliveries taken over.
    pub(super) fn finish_client_settlement(&mut self, channel: u16, settlement: ClientSettlement) {
        let ClientSettlement {
            plan,
            verb,
            channel_id,
            mut views,
        } = settlement;
        if !plan.forward_original {
            for native in &plan.native {
                self.send_upstream(settle_frame(channel, *native));
            }
        }
        self.take_over_all(channel, channel_id, verb, plan.taken_over, &mut views);
    }

    /// Takes over deliveries planned for it with the views their plan was made with.
    fn take_over_all(
        &mut self,
        channel: u16,
        channel_id: u64,
        verb: Verb,
        taken_over: Vec<(u64, KeptDelivery)>,
        views: &mut SettlementViews,
    ) {
        let shared = self.shared.clone();
        for (delivery_tag, delivery) in taken_over {
            let origin = Origin::Client {
                channel,
                channel_id,
                tag: delivery_tag,
            };
            let view = delivery.queue.as_ref().and_then(|queue| {
                cached_view(views, &mut self.view_cache, &shared, &self.vhost, queue)
            });
            match view {
                Some(view) => self.take_over(origin, verb, delivery, &view),
                // Not planned without a view; given back to be safe.
                None => self.settle_origin(origin, Settlement::Requeue),
            }
        }
    }

    /// The client leaves a channel (channel.close, connection.close, connection lost) holding
    /// unsettled deliveries. RabbitMQ requeues them without counting on a classic queue, so
    /// each one of a queue whose delivery limit the proxy counts is republished with its count
    /// plus one (or dead-lettered past the limit) and the original acked, as if the client had
    /// requeued it; the channel or connection is closed once those are settled. Quorum queues
    /// count the return themselves.
    pub(super) fn count_returns(&mut self, channel: u16) {
        if self.publisher.is_none() {
            return;
        }
        let shared = self.shared.clone();
        let vhost = self.vhost.clone();
        let Some(ch) = self.channels.get_mut(&channel) else {
            return;
        };
        if !matches!(
            ch.phase,
            super::channels::ChannelPhase::Open | super::channels::ChannelPhase::ClosingByClient
        ) || ch.deliveries.kept_len() == 0
        {
            return;
        }
        let channel_id = ch.id;
        let verb = Verb::Nack { requeue: true };
        let mut views = SettlementViews::new();
        let cache = &mut self.view_cache;
        let kept_before = ch.deliveries.kept_len();
        // Every kept delivery leaves the kept set; the ones not taken over go back with the
        // channel (the plan's native frames are not needed).
        let (plan, released_bytes) = ch.deliveries.plan_settlement(verb, 0, true, |d| {
            d.with_content()
                && d.queue.as_ref().is_some_and(|queue| {
                    cached_view(&mut views, cache, &shared, &vhost, queue)
                        .is_some_and(|view| view.takes_over_requeue(d))
                })
        });
        let released_count = kept_before - ch.deliveries.kept_len();
        self.release_inflight(released_count, released_bytes);
        self.take_over_all(channel, channel_id, verb, plan.taken_over, &mut views);
    }

    /// Dead-letters a rejected delivery, or republishes a requeued one with its delivery count.
    fn take_over(&mut self, origin: Origin, verb: Verb, delivery: KeptDelivery, view: &QueueView) {
        let (Some(kept), Some(queue)) = (delivery.message, delivery.queue) else {
            // Only deliveries kept with their message (and queue) are planned for this; given
            // back.
            self.settle_origin(origin, Settlement::Requeue);
            return;
        };
        let KeptMessage {
            exchange,
            routing_key,
            raw_properties,
            body,
        } = *kept;
        let props = match decode_properties(&raw_properties) {
            Ok(props) => props,
            Err(err) => {
                tracing::warn!(peer = %self.peer, %err, queue = &*queue, "delivered properties do not decode; settling natively");
                let settlement = if verb.requeues() {
                    Settlement::Requeue
                } else {
                    self.shared
                        .metrics
                        .dropped(&self.vhost, &queue, "undecodable");
                    Settlement::Ack
                };
                self.settle_origin(origin, settlement);
                return;
            }
        };
        let routing_keys = delivery_routing_keys(&routing_key, &props);
        if verb.requeues() {
            let count = view
                .returns_before(&props, delivery.redelivered)
                .saturating_add(1);
            if view.within_delivery_limit(count) {
                // A quorum queue counts this return itself; and where neither user may
                // publish the count (found at an earlier requeue), trying again would only
                // close the proxy's channels.
                if view.returns_counted_by != ReturnCounter::Proxy || self.requeues_refused {
                    self.settle_origin(origin, Settlement::Requeue);
                    return;
                }
                let mut message = requeue_publish(&props, &queue, count, body);
                message.raw_properties =
                    keep_opaque_headers(message.raw_properties, &raw_properties);
                self.publish_op(origin, Purpose::Requeue, queue, message);
                return;
            }
            let death = Death {
                queue,
                reason: DeadLetterReason::DeliveryLimit,
                before: props,
                raw_before: raw_properties,
                exchange,
                routing_keys,
                time: now_secs(),
                body,
            };
            self.dead_letter_message(origin, death, view);
            return;
        }
        let death = Death {
            queue,
            reason: DeadLetterReason::Rejected,
            before: props,
            raw_before: raw_properties,
            exchange,
            routing_keys,
            time: now_secs(),
            body,
        };
        match plan_rejection(
            &death,
            view.settings.retry_delays.as_deref(),
            &self.shared.dead_letter_options,
            &self.shared.capture_name,
        ) {
            RetryPlan::Hold {
                tier,
                delay_ms,
                message,
            } => {
                // The vhost's service connection declares the delay queue and publishes.
                let purpose = Purpose::RetryHold { tier, delay_ms };
                let mut op = Op::new(origin, purpose, death.queue, message, self.now);
                op.route = Route::Service;
                self.start_op(op);
            }
            RetryPlan::Exhausted => {
                self.shared
                    .metrics
                    .retry_exhausted(&self.vhost, &death.queue);
                self.dead_letter_message(origin, death, view);
            }
            RetryPlan::NotRetried => self.dead_letter_message(origin, death, view),
        }
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
        self.start_op(Op::new(origin, purpose, queue, message, self.now));
    }

    /// Publishes an operation's message (first time or retry) and tracks it until its confirm:
    /// on the proxy's channel of the client's connection, or through the vhost's service
    /// connection once the client's user was refused it ([`ClientSession::hand_to_service`]).
    fn start_op(&mut self, mut op: Op) {
        if op.charged == 0 {
            // Its message is held here until the operation ends, as a kept delivery's was.
            op.charged = op.charge();
            self.charge_inflight(op.charged);
            self.dead_letter_bytes += op.charged;
            if self.spares_consumer_connection(&op) {
                op.route = Route::SparingConsumer;
            }
        } else if op.route == Route::SparingConsumer && !self.service_consuming() {
            // A retry while the service connection is away: the client's connection publishes
            // rather than leave it waiting in the service's queue.
            op.route = Route::Client;
        }
        let op_id = self.next_op;
        self.next_op += 1;
        let delay_ms = match op.purpose {
            Purpose::RetryHold { delay_ms, .. } => Some(delay_ms),
            _ => None,
        };
        if op.route.is_service() && !self.publish_via_service(op_id, &op.message, delay_ms) {
            if op.route == Route::SparingConsumer && !self.service_blocked() {
                // The service connection's queue is full: the client's connection publishes
                // rather than hold the dead letter for a retry. Not while RabbitMQ blocks the
                // service connection (that is why its queue filled): the client's would be
                // blocked too, consumer and all; the dead letter is retried after a backoff.
                op.route = Route::Client;
            } else {
                // It must go through the service connection: failed at once, to be retried.
                let _ = self
                    .service_outcomes
                    .0
                    .send((op_id, Outcome::Failed(SERVICE_UNAVAILABLE)));
            }
        } else if op.route == Route::SparingConsumer && !op.spared {
            op.spared = true;
            self.shared.metrics.consumer_dead_letter_by_service();
        }
        let published = if op.route.is_service() {
            Ok(None)
        } else {
            match self.publisher.as_mut() {
                Some(publisher) => publisher.publish(op_id, &op.message, self.now).map(Some),
                None => Err("no publisher channel"),
            }
        };
        match published {
            Ok(bytes) => {
                if let Some(bytes) = bytes {
                    self.send_upstream(bytes);
                }
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
                self.ops.insert(op_id, op);
            }
            Err(why) => {
                let settlement = if op.purpose == Purpose::Requeue {
                    requeue_unpublishable(&self.shared.metrics, &op.queue, why)
                } else {
                    drop_unpublishable(&self.shared.metrics, &self.vhost, &op.queue, why);
                    Settlement::Ack
                };
                self.release_op(&op);
                self.settle_origin(op.origin, settlement);
            }
        }
    }

    /// Whether a first publish goes to the vhost's service connection to keep this one a
    /// consumer's: RabbitMQ blocks a connection that publishes during a resource alarm and
    /// then reads nothing more from it, acks included, so a client that never published here
    /// (a consumer, kept apart from its publishers as RabbitMQ advises) must not be made a
    /// publisher by its own dead letters, or an alarm would stop it from draining its queues.
    /// Only while the service connection runs (otherwise the client's connection publishes,
    /// as before), and not a message carrying a `user_id` (see [`Self::hand_to_service`]).
    fn spares_consumer_connection(&self, op: &Op) -> bool {
        op.route == Route::Client
            && !self.client_published
            && self.counts.published == 0
            && matches!(op.origin, Origin::Client { .. })
            && matches!(op.purpose, Purpose::DeadLetter(_) | Purpose::Requeue)
            && self.service_consuming()
            && !carries_user_id(&op.message)
    }

    /// Whether RabbitMQ holds the vhost's service connection blocked (a resource alarm).
    fn service_blocked(&self) -> bool {
        self.capture_status
            .as_ref()
            .is_some_and(|status| status.borrow().blocked)
    }

    /// Whether the vhost's service connection runs (its capture consumer is subscribed).
    fn service_consuming(&self) -> bool {
        self.service.is_some()
            && self
                .capture_status
                .as_ref()
                .is_some_and(|status| status.borrow().consuming)
    }

    /// Hands a dead letter to the vhost's service connection, whose outcome then comes back
    /// through `service_outcomes`; `false` when the service cannot take it (none, or its
    /// queue is full).
    fn publish_via_service(
        &mut self,
        op_id: OpId,
        message: &OutgoingMessage,
        delay_ms: Option<u64>,
    ) -> bool {
        let request = PublishRequest {
            op: op_id,
            message: message.clone(),
            delay_ms,
            reply: self.service_outcomes.0.clone(),
        };
        self.service
            .as_ref()
            .is_some_and(|s| s.publishes.try_send(request).is_ok())
    }

    /// The service user may not publish a dead letter given to it only to spare a consumer's
    /// connection (its permissions leave out this exchange): the client's connection
    /// publishes it, as it would have without the service connection. Returns whether it
    /// was taken back.
    fn take_back_from_service(&mut self, op: &mut Op) -> bool {
        if op.route != Route::SparingConsumer {
            return false;
        }
        tracing::info!(
            peer = %self.peer,
            queue = &*op.queue,
            exchange = %op.message.exchange,
            "dead-letter exchange refused to the service user: published on the client's connection"
        );
        op.route = Route::Client;
        true
    }

    /// The client's user may not publish this dead letter, or this requeue counted against a
    /// delivery limit (403 on the proxy's channel of its connection). RabbitMQ dead-letters
    /// and requeues as the broker, without permission checks, so the proxy publishes it as
    /// its own service user, at once; the original is still settled
    /// only on that publish's confirm. Not a message carrying a `user_id`: RabbitMQ lets the
    /// service user publish another user's id only with the `impersonator` tag, and a refusal
    /// (406) would close the service connection's publisher channel for every vhost's dead
    /// letter in flight on it; such a message stays held on the client's connection until the
    /// user may publish it (docs/deploy.md). Returns whether it was handed over.
    fn hand_to_service(&mut self, op: &mut Op) -> bool {
        if op.route.is_service()
            || self.service.is_none()
            || !matches!(op.purpose, Purpose::DeadLetter(_) | Purpose::Requeue)
            || carries_user_id(&op.message)
        {
            return false;
        }
        tracing::info!(
            peer = %self.peer,
            queue = &*op.queue,
            exchange = %op.message.exchange,
            purpose = ?op.purpose,
            "exchange refused to the client's user: published by the service user"
        );
        self.shared.metrics.dead_letter_by_service();
        op.route = Route::Service;
        true
    }

    // ------------------------------------------------------------------------------------
    // The end of an operation
    // ------------------------------------------------------------------------------------

    /// A publish of the proxy's channel ended: settle the original accordingly, or hold it
    /// for a retry when the publish was refused.
    pub(super) fn complete_op(&mut self, op_id: OpId, outcome: Outcome) {
        let Some(mut op) = self.take_op(op_id) else {
            return;
        };
        if outcome == Outcome::AccessRefused
            && (self.take_back_from_service(&mut op) || self.hand_to_service(&mut op))
        {
            let origin = op.origin;
            self.start_op(op);
            self.op_finished(origin);
            return;
        }
        if op.purpose == Purpose::Requeue
            && (outcome == Outcome::AccessRefused
                || (outcome == Outcome::Failed(USER_ID_REFUSED) && carries_user_id(&op.message)))
        {
            self.requeue_uncounted(op, &outcome);
            return;
        }
        if let Some(reason) = retry_reason(&op, &outcome) {
            self.refused(op, &outcome, reason);
            return;
        }
        self.release_op(&op);
        let Some(settlement) = settle(&self.shared.metrics, &self.vhost, &op, &outcome) else {
            return;
        };
        self.settle_origin(op.origin, settlement);
        self.op_finished(op.origin);
    }

    /// Neither user may put a counted requeue back (no write on the default exchange, or
    /// another user's `user_id`), where RabbitMQ requeues without a permission check: the
    /// original goes back natively, this return uncounted, rather than held for ever; after a
    /// 403 so do this connection's later requeues (each refusal closes a proxy channel).
    fn requeue_uncounted(&mut self, op: Op, outcome: &Outcome) {
        let access_refused = *outcome == Outcome::AccessRefused;
        self.requeues_refused |= access_refused;
        tracing::warn!(
            peer = %self.peer,
            queue = &*op.queue,
            "a requeue counted against the delivery limit cannot be published (give the \
             proxy's service user write on amq.default): requeued uncounted"
        );
        let cause = if access_refused {
            "access_refused"
        } else {
            USER_ID_REFUSED
        };
        self.shared.metrics.dead_letter_publish_failed(cause);
        self.release_op(&op);
        self.settle_origin(op.origin, Settlement::Requeue);
        self.op_finished(op.origin);
    }

    /// Removes an operation from the ones awaiting a confirm.
    fn take_op(&mut self, op_id: OpId) -> Option<Op> {
        self.ops.remove(&op_id)
    }

    /// The upstream refused a publish: the original stays unacked upstream, held (still
    /// charged against the inflight bound) until a later publish of the same message is
    /// confirmed.
    /// Not while the connection or the original's channel is going away: the upstream
    /// requeues the original then, so nothing is lost and nothing is held.
    fn refused(&mut self, mut op: Op, outcome: &Outcome, reason: RetryReason) {
        let metrics = self.shared.metrics.clone();
        metrics.dead_letter_publish_failed(reason.failure_cause(outcome));
        let origin = op.origin;
        if !self.can_hold(origin) {
            self.release_op(&op);
            self.op_finished(origin);
            return;
        }
        metrics.dead_letter_retry(reason.as_str());
        if !op.is_held() {
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
        if self.client_side != Side::Open
            || self.upstream_side != Side::Open
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
                self.release_op(&op);
            }
        }
    }

    /// Lets go of held messages `gone` selects, without settling them (their channel or
    /// connection is going away and the upstream requeues the originals).
    pub(super) fn let_go_held(&mut self, gone: impl FnMut(&Op) -> bool) {
        for op in self.held.take_where(gone) {
            self.release_op(&op);
        }
    }

    /// Lets go of the held messages of a client channel.
    pub(super) fn let_go_held_of_channel(&mut self, channel: u16) {
        self.let_go_held(
            |op| matches!(op.origin, Origin::Client { channel: c, .. } if c == channel),
        );
    }

    /// Ends an operation: its charge leaves the inflight bound, and a held one the held gauge.
    fn release_op(&mut self, op: &Op) {
        if op.charged > 0 {
            self.release_inflight(1, op.charged);
            self.dead_letter_bytes = self.dead_letter_bytes.saturating_sub(op.charged);
        }
        if op.is_held() {
            self.shared.metrics.add_held_dead_letters(-1);
        }
    }

    /// Forgets an operation without settling anything (the connection or channel is gone, so
    /// the upstream requeues the original itself).
    pub(super) fn abandon_op(&mut self, op_id: OpId) {
        if let Some(op) = self.take_op(op_id) {
            self.release_op(&op);
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
                self.refresh_parked_deadline();
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
