//! Unit tests of [`crate::proxy::client_session`]: a whole client connection driven with
//! in-memory frames and a hand-set clock, no socket. Each test plays both peers: it hands
//! the session what the client and the upstream send and reads what the session queued for
//! each of them.

use super::*;
use crate::amqp::codec::decode_method;
use crate::amqp::content::{decode_properties, put_content};
use crate::proxy::inflight::KEPT_OVERHEAD;
use crate::proxy::registry::VerifiedQueue;
use crate::proxy::test_support::{frames, methods, shared, shared_with};
use crate::rabbit::args::parse_queue_arguments;
use amq_protocol::protocol::{BasicProperties, basic, channel, confirm, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;

const PEER: &str = "127.0.0.1:40000";

/// A session and its clock.
pub(crate) struct Harness {
    pub(crate) session: ClientSession,
    pub(crate) now: Instant,
}

impl Harness {
    pub(crate) fn new() -> Self {
        Harness::on(shared())
    }

    /// A harness whose session has this shared state.
    pub(crate) fn on(shared: Arc<ProxyShared>) -> Self {
        let now = Instant::now();
        let session = ClientSession::new(
            shared,
            PEER.parse().unwrap(),
            now,
            now + Duration::from_secs(10),
        );
        Harness { session, now }
    }

    pub(crate) fn client_sends(&mut self, bytes: Bytes) {
        for f in frames(&bytes) {
            self.session.client_read(Some(Ok(f)), self.now);
        }
    }

    pub(crate) fn upstream_sends(&mut self, bytes: Bytes) {
        for f in frames(&bytes) {
            self.session.upstream_read(Some(Ok(f)), self.now);
        }
    }

    fn at(&mut self, now: Instant) {
        self.now = now;
        self.session.on_timer(now);
    }

    /// The methods queued for the client since the last call.
    pub(crate) fn client_got(&mut self) -> Vec<(u16, AMQPClass)> {
        methods(&self.session.client_out.take_queued())
    }

    pub(crate) fn upstream_got(&mut self) -> Vec<(u16, AMQPClass)> {
        methods(&self.session.upstream_out.take_queued())
    }

    pub(crate) fn upstream_got_frames(&mut self) -> Vec<WireFrame> {
        frames(&self.session.upstream_out.take_queued())
    }

    /// Plays the handshake through to connection.open-ok; returns the publisher channel.
    pub(crate) fn open(&mut self, heartbeat: u16) -> u16 {
        self.upstream_sends(connection_start());
        assert!(matches!(
            self.client_got()[..],
            [(0, AMQPClass::Connection(connection::AMQPMethod::Start(_)))]
        ));
        self.client_sends(method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            })),
        ));
        assert!(matches!(
            self.upstream_got()[..],
            [(0, AMQPClass::Connection(connection::AMQPMethod::StartOk(_)))]
        ));
        self.upstream_sends(method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: 2047,
                frame_max: 131_072,
                heartbeat,
            })),
        ));
        let offered = match &self.client_got()[..] {
            [(0, AMQPClass::Connection(connection::AMQPMethod::Tune(t)))] => t.clone(),
            other => panic!("{other:?}"),
        };
        // Two channels are kept for the proxy's own use.
        assert!(offered.channel_max < 2047, "{offered:?}");
        self.client_sends(method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: offered.channel_max,
                frame_max: offered.frame_max,
                heartbeat,
            })),
        ));
        assert!(matches!(
            self.upstream_got()[..],
            [(0, AMQPClass::Connection(connection::AMQPMethod::TuneOk(_)))]
        ));
        self.client_sends(method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        ));
        self.upstream_got();
        self.upstream_sends(method_frame(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        ));
        assert!(matches!(
            self.client_got()[..],
            [(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))]
        ));
        // The proxy opens its dead-letter publisher channel, in confirm mode.
        let sent = self.upstream_got();
        let publisher = match &sent[..] {
            [
                (ch, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
                (ch2, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))),
            ] if ch == ch2 => *ch,
            other => panic!("{other:?}"),
        };
        assert!(publisher > offered.channel_max);
        publisher
    }
}

/// The upstream's connection.start.
fn connection_start() -> Bytes {
    method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: LongString::from("PLAIN"),
            locales: LongString::from("en_US"),
        })),
    )
}

fn connection_close(sent: &[(u16, AMQPClass)]) -> (u16, String) {
    match sent {
        [(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))] => {
            (c.reply_code, c.reply_text.to_string())
        }
        other => panic!("expected one connection.close: {other:?}"),
    }
}

#[tokio::test]
async fn the_handshake_passes_through_and_the_proxy_opens_its_publisher_channel() {
    let mut h = Harness::new();
    let publisher = h.open(0);
    assert!(h.session.running);
    assert!(h.session.publisher.is_some());
    assert_eq!(h.session.publisher.as_ref().unwrap().channel(), publisher);
    assert!(!h.session.is_done());
}

#[tokio::test]
async fn an_upstream_that_goes_away_gets_the_client_a_320_and_the_connection_ends_on_close_ok() {
    let mut h = Harness::new();
    h.open(0);
    h.session.upstream_read(None, h.now);
    let (code, text) = connection_close(&h.client_got());
    assert_eq!(code, reply::CONNECTION_FORCED);
    assert_eq!(text, "CONNECTION_FORCED - upstream connection closed");
    assert!(!h.session.is_done(), "waiting for the client's close-ok");
    h.client_sends(method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    ));
    assert!(h.session.is_done());
}

#[tokio::test]
async fn a_malformed_client_frame_gets_frame_error_and_the_upstream_is_closed() {
    let mut h = Harness::new();
    h.open(0);
    h.session.client_read(
        Some(Err(FrameError::TooLarge {
            size: 1 << 30,
            max: 131_072,
        })),
        h.now,
    );
    let (code, text) = connection_close(&h.client_got());
    assert_eq!(code, reply::FRAME_ERROR);
    assert!(text.starts_with("FRAME_ERROR - "), "{text}");
    // Nothing of the proxy's is unsettled: the upstream is closed at once.
    let (code, _) = connection_close(&h.upstream_got());
    assert_eq!(code, reply::REPLY_SUCCESS);
    h.upstream_sends(method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    ));
    assert!(h.session.is_done());
}

#[tokio::test]
async fn a_client_that_misses_heartbeats_is_dropped_and_the_upstream_closed() {
    let mut h = Harness::new();
    h.open(5);
    let start = h.now;
    // Traffic from the upstream only; the client stays silent.
    h.at(start + Duration::from_secs(6));
    h.upstream_sends(Bytes::from_static(&[8, 0, 0, 0, 0, 0, 0, 0xce]));
    assert!(h.upstream_got().is_empty());
    assert_eq!(h.session.client_side, Side::Open);
    // Two intervals of silence: the client is gone.
    h.at(start + Duration::from_secs(10));
    assert_eq!(h.session.client_side, Side::Closed);
    let (code, text) = connection_close(&h.upstream_got());
    assert_eq!((code, text.as_str()), (200, "client connection closed"));
}

#[tokio::test]
async fn a_handshake_that_does_not_finish_in_time_ends_the_connection() {
    let mut h = Harness::new();
    let start = h.now;
    assert_eq!(
        h.session.next_deadline(),
        Some(start + Duration::from_secs(10))
    );
    h.at(start + Duration::from_secs(9));
    assert!(!h.session.is_done());
    h.at(start + Duration::from_secs(10));
    assert!(h.session.is_done());
}

/// A delivery of "m" from `queue` on `channel`, as the upstream sends it.
pub(crate) fn delivery(channel: u16, tag: u64, queue: &str) -> Bytes {
    let mut out = BytesMut::new();
    out.extend_from_slice(&method_frame(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "ctag".into(),
            delivery_tag: tag,
            redelivered: false,
            exchange: "".into(),
            routing_key: queue.into(),
        })),
    ));
    let props = crate::amqp::content::encode_properties(&BasicProperties::default());
    put_content(&mut out, channel, &props, b"m", 131_072);
    out.freeze()
}

/// [`consuming`] from a queue with dead-letter exchange "dlx", and delivery 7 rejected.
pub(crate) async fn rejected() -> (Harness, u16) {
    rejected_in(Harness::new()).await
}

/// [`rejected`] in this harness.
pub(crate) async fn rejected_in(h: Harness) -> (Harness, u16) {
    let dlx = (
        "x-dead-letter-exchange",
        AMQPValue::LongString("dlx".into()),
    );
    let (mut h, publisher) = consuming_in(h, std::slice::from_ref(&dlx)).await;
    // The client rejects it: the proxy publishes the dead letter itself, nothing goes
    // upstream on the client's channel yet.
    h.client_sends(reject(7));
    (h, publisher)
}

/// A harness whose proxy keeps at most `bound` bytes per client connection.
fn bounded(bound: usize) -> Harness {
    Harness::on(shared_with(|config| {
        config.proxy.max_inflight_bytes = bound
    }))
}

/// A running session whose client consumes from "q" (with these arguments, as a verified
/// declare of any instance left them) and got delivery 7 ("m"). Returns the harness and the
/// publisher channel.
pub(crate) async fn consuming(arguments: &[(&str, AMQPValue)]) -> (Harness, u16) {
    consuming_in(Harness::new(), arguments).await
}

/// [`consuming`] in this harness.
pub(crate) async fn consuming_in(h: Harness, arguments: &[(&str, AMQPValue)]) -> (Harness, u16) {
    consuming_with_heartbeat(h, arguments, 0).await
}

/// [`consuming_in`] on a connection that negotiated `heartbeat` seconds.
pub(crate) async fn consuming_with_heartbeat(
    mut h: Harness,
    arguments: &[(&str, AMQPValue)],
    heartbeat: u16,
) -> (Harness, u16) {
    let publisher = h.open(heartbeat);
    let mut args = FieldTable::default();
    for (name, value) in arguments {
        args.insert((*name).into(), value.clone());
    }
    h.session.shared.queues.record(
        "/",
        "q",
        VerifiedQueue::Proxied(parse_queue_arguments(&args).unwrap()),
    );
    h.client_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    ));
    h.client_sends(consume_q());
    assert!(matches!(
        h.upstream_got()[..],
        [
            (1, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
            (1, AMQPClass::Basic(basic::AMQPMethod::Consume(_)))
        ]
    ));
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: "ctag".into(),
        })),
    ));
    h.upstream_sends(delivery(1, 7, "q"));
    let got = h.client_got();
    assert!(
        matches!(
            &got[..],
            [(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))), (1, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))), (1, AMQPClass::Basic(basic::AMQPMethod::Deliver(d)))] if d.delivery_tag == 7
        ),
        "{got:?}"
    );
    (h, publisher)
}

/// Whether the shared metrics hold this exact line.
fn metric_line(h: &Harness, line: &str) -> bool {
    h.session.shared.metrics.encode().lines().any(|l| l == line)
}

#[tokio::test]
async fn messages_counted_in_a_turn_reach_the_metrics_when_the_turn_reports_them() {
    let (mut h, _) = consuming(&[]).await;
    // Delivery 7 is kept, and counted by the session: the shared metrics get the count at
    // the report the connection loop makes before it waits, not one update per frame.
    let client_in = r#"dlx_proxy_frames_total{direction="client_in"}"#;
    assert!(metric_line(&h, "dlx_proxy_messages_delivered_total 0"));
    assert!(metric_line(&h, "dlx_proxy_inflight_deliveries 0"));
    assert!(!metric_line(&h, &format!("{client_in} 5")));
    h.session.report_counts();
    assert!(metric_line(&h, "dlx_proxy_messages_delivered_total 1"));
    assert!(metric_line(&h, "dlx_proxy_inflight_deliveries 1"));
    // The frames read come with them: the client's start-ok, tune-ok, open, channel.open
    // and basic.consume.
    assert!(metric_line(&h, &format!("{client_in} 5")));
    assert!(!metric_line(&h, "dlx_proxy_inflight_bytes 0"));
    h.client_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 7,
            multiple: false,
        })),
    ));
    // The ack is queued for the upstream; its bytes reach the outbox gauge at the report.
    assert!(metric_line(&h, "dlx_proxy_upstream_outbox_bytes 0"));
    h.session.report_counts();
    assert!(metric_line(&h, "dlx_proxy_messages_acked_total 1"));
    assert!(metric_line(&h, "dlx_proxy_inflight_deliveries 0"));
    assert!(metric_line(&h, "dlx_proxy_inflight_bytes 0"));
    let queued = h.session.upstream_out.queued();
    assert!(queued > 0);
    assert!(metric_line(
        &h,
        &format!("dlx_proxy_upstream_outbox_bytes {queued}")
    ));
    // A report with nothing new changes nothing.
    h.session.report_counts();
    assert!(metric_line(&h, "dlx_proxy_messages_acked_total 1"));
    assert!(metric_line(
        &h,
        &format!("dlx_proxy_upstream_outbox_bytes {queued}")
    ));
}

#[tokio::test]
async fn a_reject_is_dead_lettered_on_the_publisher_channel_and_acked_upstream_after_the_confirm() {
    let (mut h, publisher) = rejected().await;
    let sent = h.upstream_got_frames();
    assert!(sent.iter().all(|f| f.channel == publisher), "{sent:?}");
    let publish = match decode_method(sent[0].payload()) {
        Some(AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => p,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        (publish.exchange.as_str(), publish.routing_key.as_str()),
        ("dlx", "q")
    );
    let props = decode_properties(&sent[1].payload()[12..]).unwrap();
    let headers = props.headers().clone().unwrap();
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        panic!("no x-death: {headers:?}");
    };
    let AMQPValue::FieldTable(death) = &deaths.as_slice()[0] else {
        panic!("{deaths:?}");
    };
    assert_eq!(death.inner().get("count"), Some(&AMQPValue::LongLongInt(1)));
    assert_eq!(
        death.inner().get("reason"),
        Some(&AMQPValue::LongString("rejected".into()))
    );
    assert_eq!(
        death.inner().get("queue"),
        Some(&AMQPValue::LongString("q".into()))
    );
    assert_eq!(
        headers.inner().get("x-first-death-reason"),
        Some(&AMQPValue::LongString("rejected".into()))
    );
    assert_eq!(sent[2].payload(), b"m");

    // Confirmed: the original is acked upstream, with the client's delivery tag.
    h.upstream_sends(method_frame(
        publisher,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    ));
    let sent = h.upstream_got();
    assert!(
        matches!(
            &sent[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7 && !a.multiple
        ),
        "{sent:?}"
    );
    assert!(h.client_got().is_empty());
    let text = h.session.shared.metrics.encode();
    assert!(
        text.contains(r#"dlx_proxy_dead_lettered_total{queue="q",reason="rejected",vhost="/"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn after_the_proxy_closes_the_client_nothing_but_the_connection_close_is_queued_for_it() {
    let (mut h, publisher) = rejected().await;
    h.upstream_got();
    // A method RabbitMQ does not know: the proxy closes the connection with 540.
    h.client_sends(Bytes::from_static(&[
        1, 0, 1, 0, 0, 0, 4, 0, 99, 0, 1, 0xCE,
    ]));
    let (code, _) = connection_close(&h.client_got());
    assert_eq!(code, reply::NOT_IMPLEMENTED);
    // The dead letter is unconfirmed, so the upstream is still read while it drains: what it
    // delivers meanwhile is not queued for a client that was told the connection is closed.
    for tag in 20..120 {
        h.upstream_sends(counted_delivery(tag, false, 0));
    }
    assert!(h.client_got().is_empty());
    h.upstream_sends(confirm(publisher, 1));
    let sent = h.upstream_got();
    assert!(
        sent.iter().any(|(channel, m)| *channel == 1
            && matches!(m, AMQPClass::Basic(basic::AMQPMethod::Ack(a)) if a.delivery_tag == 7)),
        "{sent:?}"
    );
}

#[tokio::test]
async fn a_nacked_dead_letter_is_held_not_settled_and_published_again_after_the_backoff() {
    let (mut h, publisher) = rejected().await;
    let first = h.upstream_got_frames();
    h.upstream_sends(refusal(publisher, 1));
    // Held: the original is neither acked nor given back, the client hears nothing.
    assert!(h.upstream_got().is_empty());
    assert!(h.client_got().is_empty());
    let due = h.session.next_deadline().expect("a retry is due");
    assert!(
        due > h.now && due <= h.now + Duration::from_millis(100),
        "{:?}",
        due - h.now
    );
    h.at(due);
    let again = h.upstream_got_frames();
    assert!(again.iter().all(|f| f.channel == publisher));
    let raws = |fs: &[WireFrame]| fs.iter().map(|f| f.payload_bytes()).collect::<Vec<_>>();
    assert_eq!(raws(&again), raws(&first), "the same publish");
    h.upstream_sends(method_frame(
        publisher,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 2,
            multiple: false,
        })),
    ));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7
    ));
    let text = h.session.shared.metrics.encode();
    assert!(
        text.contains(r#"dlx_proxy_dead_letter_retries_total{reason="nacked"} 1"#),
        "{text}"
    );
}

/// The publish the proxy made on its publisher channel: (exchange, routing key, headers).
fn published(frames: &[WireFrame], publisher: u16) -> (String, String, FieldTable) {
    assert!(frames.iter().all(|f| f.channel == publisher), "{frames:?}");
    let Some(AMQPClass::Basic(basic::AMQPMethod::Publish(p))) = decode_method(frames[0].payload())
    else {
        panic!("{frames:?}");
    };
    let props = decode_properties(&frames[1].payload()[12..]).unwrap();
    (
        p.exchange.to_string(),
        p.routing_key.to_string(),
        props.headers().clone().unwrap_or_default(),
    )
}

/// The upstream's basic.nack of the proxy's publish `tag`.
fn refusal(publisher: u16, tag: u64) -> Bytes {
    method_frame(
        publisher,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue: false,
        })),
    )
}

fn confirm(publisher: u16, tag: u64) -> Bytes {
    method_frame(
        publisher,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple: false,
        })),
    )
}

#[tokio::test]
async fn requeues_past_a_classic_queues_delivery_limit_are_counted_then_dead_lettered() {
    let (mut h, publisher) = consuming(&[
        (
            "x-dead-letter-exchange",
            AMQPValue::LongString("dlx".into()),
        ),
        ("x-delivery-limit", AMQPValue::LongInt(1)),
    ])
    .await;
    // First requeue: the proxy puts the message back at the tail with its count (RabbitMQ's
    // classic queues do not count), and acks the original once that is confirmed.
    h.client_sends(nack_requeue(7));
    let (exchange, key, headers) = published(&h.upstream_got_frames(), publisher);
    assert_eq!((exchange.as_str(), key.as_str()), ("", "q"));
    assert_eq!(
        headers.inner().get("x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    h.upstream_sends(confirm(publisher, 1));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7
    ));
    // It comes back carrying the count; a second requeue is past the limit: dead-lettered.
    h.upstream_sends(counted_delivery(8, false, 1));
    h.client_got();
    h.client_sends(nack_requeue(8));
    dead_lettered_past_the_limit(&mut h, publisher, 8, 2);
}

#[tokio::test]
async fn a_counted_requeue_too_large_to_republish_goes_back_natively_uncounted() {
    let (mut h, _publisher) = consuming(&[("x-delivery-limit", AMQPValue::LongInt(5))]).await;
    h.upstream_got();
    // Properties that fill the 131072-byte frame but for a few bytes: with the count added
    // to them, the republish would not fit in one frame.
    let mut headers = FieldTable::default();
    headers.insert(
        "pad".into(),
        AMQPValue::LongString("p".repeat(131_030).into()),
    );
    let props =
        crate::amqp::content::encode_properties(&BasicProperties::default().with_headers(headers));
    let mut delivery = BytesMut::new();
    delivery.extend_from_slice(&method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "ctag".into(),
            delivery_tag: 8,
            redelivered: false,
            exchange: "".into(),
            routing_key: "q".into(),
        })),
    ));
    put_content(&mut delivery, 1, &props, b"m", 131_072);
    h.upstream_sends(delivery.freeze());
    h.client_got();
    h.client_sends(nack_requeue(8));
    // Nothing published: the original goes back natively, never acked.
    let sent = h.upstream_got();
    assert!(
        matches!(
            &sent[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Nack(n)))] if n.delivery_tag == 8 && n.requeue
        ) || matches!(
            &sent[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Reject(r)))] if r.delivery_tag == 8 && r.requeue
        ),
        "{sent:?}"
    );
}

/// Delivery `tag` of "m" from "q" on channel 1, with `x-delivery-count = count`.
fn counted_delivery(tag: u64, redelivered: bool, count: i64) -> Bytes {
    let mut out = BytesMut::new();
    out.extend_from_slice(&method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "ctag".into(),
            delivery_tag: tag,
            redelivered,
            exchange: "".into(),
            routing_key: "q".into(),
        })),
    ));
    let mut counted = FieldTable::default();
    counted.insert("x-delivery-count".into(), AMQPValue::LongLongInt(count));
    let props =
        crate::amqp::content::encode_properties(&BasicProperties::default().with_headers(counted));
    put_content(&mut out, 1, &props, b"m", 131_072);
    out.freeze()
}

fn nack_requeue(tag: u64) -> Bytes {
    method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue: true,
        })),
    )
}

/// The client's requeue of delivery `tag` was dead-lettered on the publisher channel (its
/// publish sequence number `confirm_tag`) as `delivery_limit`, with no `x-delivery-count`;
/// the confirm acks the original upstream, and the metric counts it.
fn dead_lettered_past_the_limit(h: &mut Harness, publisher: u16, tag: u64, confirm_tag: u64) {
    let (exchange, key, headers) = published(&h.upstream_got_frames(), publisher);
    assert_eq!((exchange.as_str(), key.as_str()), ("dlx", "q"));
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        panic!("{headers:?}");
    };
    let AMQPValue::FieldTable(death) = &deaths.as_slice()[0] else {
        panic!("{deaths:?}");
    };
    assert_eq!(
        death.inner().get("reason"),
        Some(&AMQPValue::LongString("delivery_limit".into()))
    );
    assert_eq!(death.inner().get("count"), Some(&AMQPValue::LongLongInt(1)));
    assert_eq!(headers.inner().get("x-delivery-count"), None);
    h.upstream_sends(confirm(publisher, confirm_tag));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == tag
    ));
    let text = h.session.shared.metrics.encode();
    assert!(
        text.contains(
            r#"dlx_proxy_dead_lettered_total{queue="q",reason="delivery_limit",vhost="/"} 1"#
        ),
        "{text}"
    );
}

/// A quorum queue counts returns itself: requeues within its limit go upstream as the client
/// sent them (a first delivery was returned 0 times, whatever its header says), and the one
/// RabbitMQ would dead-letter on its return is dead-lettered by the proxy in one hop.
#[tokio::test]
async fn the_requeue_past_a_quorum_queues_delivery_limit_is_dead_lettered_by_the_proxy() {
    let (mut h, publisher) = consuming(&[
        ("x-queue-type", AMQPValue::LongString("quorum".into())),
        (
            "x-dead-letter-exchange",
            AMQPValue::LongString("dlx".into()),
        ),
        ("x-delivery-limit", AMQPValue::LongInt(1)),
    ])
    .await;
    h.client_sends(nack_requeue(7));
    let sent = h.upstream_got();
    assert!(
        matches!(
            &sent[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Nack(n)))] if n.delivery_tag == 7 && n.requeue
        ),
        "{sent:?}"
    );
    // A publisher's own header on a first delivery counts for nothing.
    h.upstream_sends(counted_delivery(8, false, 5));
    h.client_got();
    h.client_sends(nack_requeue(8));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Nack(n)))] if n.delivery_tag == 8 && n.requeue
    ));
    // RabbitMQ redelivers it with the count of its returns: this return would pass the limit.
    h.upstream_sends(counted_delivery(9, true, 1));
    h.client_got();
    h.client_sends(nack_requeue(9));
    dead_lettered_past_the_limit(&mut h, publisher, 9, 1);
}

#[tokio::test]
async fn a_delivery_held_past_its_consumer_timeout_closes_the_channel_on_both_sides() {
    let (mut h, _) = consuming(&[("x-consumer-timeout", AMQPValue::LongInt(1000))]).await;
    let start = h.now;
    let due = h.session.next_deadline().expect("the delivery's deadline");
    assert!(
        due >= start + Duration::from_millis(999) && due <= start + Duration::from_millis(1001),
        "{:?}",
        due - start
    );
    h.at(start + Duration::from_millis(999));
    assert!(h.client_got().is_empty());
    h.at(due);
    let (code, text) = match &h.client_got()[..] {
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(c)))] => {
            (c.reply_code, c.reply_text.to_string())
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(code, reply::PRECONDITION_FAILED);
    assert!(
        text.starts_with(
            "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout \
             value used: 1000 ms."
        ),
        "{text}"
    );
    // Closed upstream as if the client had closed it: the upstream requeues the delivery.
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    // Each side's close-ok ends its half; neither is passed to the other.
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert!(h.client_got().is_empty());
    h.client_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert!(h.upstream_got().is_empty());
    assert_eq!(h.session.channels.len(), 0);
    let metrics = h.session.shared.metrics.encode();
    assert!(
        metrics.contains(r#"dlx_proxy_consumer_timeouts_total{queue="q",vhost="/"} 1"#),
        "{metrics}"
    );
}

/// A client's publish on channel 1 of a 30-byte body in body frames of 10 bytes: the method,
/// the header and three bodies.
fn publish_in_small_frames() -> Vec<WireFrame> {
    frames(&client_publish(&[7u8; 30], 18))
}

/// A client's basic.publish on channel 1 (to "elsewhere") of `body`, in frames of at most
/// `frame_max` bytes.
fn client_publish(body: &[u8], frame_max: usize) -> BytesMut {
    let mut publish = BytesMut::from(
        &method_frame(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "elsewhere".into(),
                mandatory: false,
                immediate: false,
            })),
        )[..],
    );
    let props = crate::amqp::content::encode_properties(&BasicProperties::default());
    put_content(&mut publish, 1, &props, body, frame_max);
    publish
}

/// A consumer timeout that falls due while the client is sending a message's content on the
/// same channel waits for the content's end: the client's last body frame still reaches the
/// upstream, then both sides get the close, and the client's close-ok ends the channel. (The
/// close went to the client mid-content, its remaining body frames were dropped, the upstream
/// close stayed unsent behind them, and the client's close-ok was taken for a 505.)
#[tokio::test]
async fn a_consumer_timeout_waits_for_the_end_of_a_publish_on_its_channel() {
    let (mut h, _) = consuming(&[("x-consumer-timeout", AMQPValue::LongInt(1000))]).await;
    let due = h.session.next_deadline().expect("the delivery's deadline");
    let mut sent = publish_in_small_frames();
    let last = sent.pop().expect("the last body frame");
    for frame in sent {
        h.session.client_read(Some(Ok(frame)), h.now);
    }
    assert_eq!(
        h.upstream_got_frames().len(),
        4,
        "publish, header, two bodies"
    );
    h.at(due);
    assert!(
        h.client_got().is_empty(),
        "no close in the middle of the content"
    );
    assert!(h.upstream_got().is_empty());
    // The content's end fires the timeout at once (no turn of the loop in between): the last
    // body frame goes upstream, then the close, on both sides.
    h.session.client_read(Some(Ok(last)), h.now);
    let forwarded = h.upstream_got_frames();
    assert_eq!(forwarded.len(), 2, "{forwarded:?}");
    assert_eq!(forwarded[0].kind, crate::amqp::codec::FRAME_BODY);
    assert!(matches!(
        methods(&forwarded[1].raw)[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    assert!(matches!(
        &h.client_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    h.client_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert!(h.client_got().is_empty(), "no connection.close");
    assert!(h.upstream_got().is_empty());
    assert_eq!(h.session.channels.len(), 0);
}

/// A client that never finishes the publish it began cannot hold its deliveries past their
/// consumer timeout: [`MID_CONTENT_GRACE`](crate::proxy::consumer_timeout::MID_CONTENT_GRACE)
/// after the timeout the whole connection closes (320), which the upstream answers by
/// requeueing them.
#[tokio::test]
async fn a_publish_left_unfinished_past_a_consumer_timeout_closes_the_connection() {
    let (mut h, _) = consuming(&[("x-consumer-timeout", AMQPValue::LongInt(1000))]).await;
    // No publisher channel (an upstream channel_max with no room for it): the close then
    // leaves the kept deliveries, and their deadlines, to the upstream's requeue.
    h.session.publisher = None;
    let due = h.session.next_deadline().expect("the delivery's deadline");
    let mut sent = publish_in_small_frames();
    sent.pop();
    for frame in sent {
        h.session.client_read(Some(Ok(frame)), h.now);
    }
    h.upstream_got();
    h.at(due);
    assert!(h.client_got().is_empty());
    let grace = crate::proxy::consumer_timeout::MID_CONTENT_GRACE;
    let last_chance = h.session.next_deadline().expect("the grace's end");
    assert_eq!(last_chance, due + grace);
    h.at(due + grace - Duration::from_millis(1));
    assert!(h.client_got().is_empty());
    h.at(due + grace);
    let sent = h.client_got();
    let (code, text) = connection_close(&sent);
    assert_eq!(code, reply::CONNECTION_FORCED);
    assert!(
        text.contains("delivery acknowledgement on channel 1 timed out"),
        "{text}"
    );
    // Closing, the unfinished publish no longer arms the timer (it would fire at once on
    // every turn while the client's close-ok is awaited).
    assert!(
        h.session.next_deadline().is_none_or(|next| next > h.now),
        "a deadline in the past"
    );
}

/// A `nowait` basic.consume without a consumer tag gets one from the proxy: the upstream
/// would make one up that no consume-ok reports, and the deliveries under it were not
/// tracked (here: no consumer timeout). The proxy's tag goes upstream, the deliveries carry
/// it to the client, and they are kept like any other.
#[tokio::test]
async fn a_nowait_consume_without_a_tag_is_named_and_its_deliveries_tracked() {
    let mut h = Harness::new();
    h.open(0);
    let mut args = FieldTable::default();
    args.insert("x-consumer-timeout".into(), AMQPValue::LongInt(1000));
    h.session.shared.queues.record(
        "/",
        "q",
        VerifiedQueue::Proxied(parse_queue_arguments(&args).unwrap()),
    );
    h.client_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    ));
    h.client_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: true,
            arguments: FieldTable::default(),
        })),
    ));
    let tag = match &h.upstream_got()[..] {
        [
            (1, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
            (1, AMQPClass::Basic(basic::AMQPMethod::Consume(c))),
        ] => c.consumer_tag.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(tag.starts_with("amq.ctag-"), "{tag}");
    let mut deliver = BytesMut::from(
        &method_frame(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: tag.as_str().into(),
                delivery_tag: 7,
                redelivered: false,
                exchange: "".into(),
                routing_key: "q".into(),
            })),
        )[..],
    );
    let props = crate::amqp::content::encode_properties(&BasicProperties::default());
    put_content(&mut deliver, 1, &props, b"m", 131_072);
    h.upstream_sends(deliver.freeze());
    assert!(matches!(
        &h.client_got()[..],
        [
            (1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
            (1, AMQPClass::Basic(basic::AMQPMethod::Deliver(d)))
        ] if d.consumer_tag.as_str() == tag
    ));
    let due = h
        .session
        .next_deadline()
        .expect("the delivery's consumer timeout");
    h.at(due);
    assert!(matches!(
        &h.client_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(c)))]
            if c.reply_code == reply::PRECONDITION_FAILED
    ));
}

#[tokio::test]
async fn closes_crossing_a_consumer_timeout_close_are_answered_once() {
    let (mut h, _) = consuming(&[("x-consumer-timeout", AMQPValue::LongInt(1000))]).await;
    let due = h.session.next_deadline().expect("the delivery's deadline");
    h.at(due);
    assert!(matches!(
        &h.client_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    h.upstream_got();
    let close = || {
        method_frame(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        )
    };
    // The close that crosses the proxy's gets its close-ok; a client repeating it (and not
    // reading) gets nothing more queued.
    h.client_sends(close());
    assert!(matches!(
        &h.client_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))]
    ));
    for _ in 0..100 {
        h.client_sends(close());
    }
    assert!(h.client_got().is_empty());
    assert!(h.upstream_got().is_empty());
}

#[tokio::test]
async fn a_declare_naming_a_dead_letter_exchange_waits_for_the_capture_path_then_gets_320() {
    let mut h = Harness::new();
    h.open(0);
    h.client_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("dlx".into()),
    );
    h.client_sends(declare_q(args));
    // The upstream queue would dead-letter into the capture exchange, which the vhost's
    // service connection (its upstream unreachable here) has not declared: nothing is
    // declared meanwhile, and the client's reads pause.
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Open(_)))]
    ));
    assert!(!h.session.wants_client_frames());
    let start = h.now;
    let due = h.session.held_for_capture.as_ref().expect("held").deadline;
    assert_eq!(due, start + h.session.shared.capture_ready_timeout);
    assert!(h.session.next_deadline().is_some_and(|next| next <= due));
    h.at(due - Duration::from_millis(1));
    assert!(h.client_got().is_empty());
    h.at(due);
    let sent = h.client_got();
    let (code, text) = connection_close(&sent);
    assert_eq!(code, reply::CONNECTION_FORCED);
    assert_eq!(
        text,
        "CONNECTION_FORCED - dead-letter capture for vhost '/' is unavailable: its service \
         connection is not ready (upstream unreachable?); reconnect and retry"
    );
    assert!(matches!(
        &sent[..],
        [(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))]
            if (c.class_id, c.method_id) == (50, 10)
    ));
    assert!(
        h.upstream_got()
            .iter()
            .all(|(_, m)| !matches!(m, AMQPClass::Queue(queue::AMQPMethod::Declare(_))))
    );
}

// ---- declare checks and read-backs ------------------------------------------------------

/// The upstream queue "q" and the vhost's service connection, played by the test as RabbitMQ
/// would answer the declare connection's declares ([`crate::rabbit::args::check_equivalent`]
/// gives RabbitMQ's reply texts). Sessions of several instances can share it.
struct UpstreamQueue {
    /// The arguments and `durable` flag the queue exists with.
    exists: Option<(FieldTable, bool)>,
}

/// A session's way to the service connection: what the session sends it, and the status
/// that says the capture objects exist.
struct ServiceEnd {
    declares: tokio::sync::mpsc::Receiver<crate::proxy::service::judge::DeclareRequest>,
    publishes: tokio::sync::mpsc::Receiver<crate::proxy::service::link::PublishRequest>,
    status: tokio::sync::watch::Sender<crate::proxy::service::Status>,
}

impl Harness {
    /// Gives the open session a service connection whose capture objects exist.
    fn with_service(&mut self) -> ServiceEnd {
        let (declares_tx, declares) = tokio::sync::mpsc::channel(4);
        let (publishes_tx, publishes) = tokio::sync::mpsc::channel(4);
        let (status, receiver) = tokio::sync::watch::channel(crate::proxy::service::Status {
            declared: true,
            consuming: true,
            blocked: false,
            declaring: true,
        });
        self.session.capture_status = Some(receiver);
        self.session.service = Some(crate::proxy::service::ServiceHandle {
            declares: declares_tx,
            publishes: publishes_tx,
        });
        ServiceEnd {
            declares,
            publishes,
            status,
        }
    }

    /// An open session with a service connection and client channel 1 open.
    fn serving() -> (Harness, ServiceEnd) {
        let mut h = Harness::new();
        h.open(0);
        let service = h.with_service();
        h.open_channel_1();
        (h, service)
    }

    /// Opens client channel 1 (and its upstream twin).
    fn open_channel_1(&mut self) {
        self.client_sends(method_frame(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        self.upstream_sends(method_frame(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ));
        assert!(matches!(
            &self.upstream_got()[..],
            [(1, AMQPClass::Channel(channel::AMQPMethod::Open(_)))]
        ));
        assert!(matches!(
            &self.client_got()[..],
            [(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))]
        ));
    }

    /// Has the declare connection answer every declare the session asked of it, as RabbitMQ
    /// would for `queue`, until the session asks nothing more. Returns the declares made.
    fn serve(
        &mut self,
        service: &mut ServiceEnd,
        queue: &mut UpstreamQueue,
    ) -> Vec<queue::Declare> {
        let mut made = Vec::new();
        while let Ok(request) = service.declares.try_recv() {
            let answer = queue.answer(&request.declare);
            made.push(request.declare);
            request.answer.send(answer).unwrap();
            let answer = self
                .session
                .service_answer
                .as_mut()
                .expect("the session waits for the answer")
                .try_recv()
                .ok();
            self.session.on_service_answer(answer);
        }
        made
    }

    /// Answers the permission probe the session sent on its check channel with RabbitMQ's
    /// 406 for the probe's argument: the client's user may declare the queue.
    fn grant_probe(&mut self) {
        let sent = self.upstream_got();
        let (check, probe) = match &sent[..] {
            [
                (c, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
                (c2, AMQPClass::Queue(queue::AMQPMethod::Declare(probe))),
            ] if c == c2 => (*c, probe.clone()),
            other => panic!("no permission probe: {other:?}"),
        };
        assert!(check > 1);
        assert_eq!(probe.queue.as_str(), "q");
        assert!(!probe.passive);
        assert!(matches!(
            probe
                .arguments
                .inner()
                .get(crate::proxy::permission::PROBE_ARGUMENT),
            Some(AMQPValue::LongString(_))
        ));
        self.upstream_sends(method_frame(
            check,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ));
        self.upstream_sends(method_frame(
            check,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 406,
                reply_text: "PRECONDITION_FAILED - invalid arg 'x-max-length' for queue 'q' in \
                             vhost '/': {unacceptable_type,longstr}"
                    .into(),
                class_id: 50,
                method_id: 10,
            })),
        ));
        assert!(matches!(
            &self.upstream_got()[..],
            [(c, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))] if *c == check
        ));
    }
}

impl UpstreamQueue {
    fn answer(&mut self, declare: &queue::Declare) -> CheckAnswer {
        let refuse = |code: u16, text: String| CheckAnswer::Refused { code, text };
        match (&self.exists, declare.passive) {
            (None, true) => refuse(404, "NOT_FOUND - no queue 'q' in vhost '/'".into()),
            (None, false) => {
                self.exists = Some((declare.arguments.clone(), declare.durable));
                CheckAnswer::DeclareOk
            }
            (Some(_), true) => CheckAnswer::DeclareOk,
            (Some((current, durable)), false) => {
                if *durable != declare.durable {
                    return refuse(
                        406,
                        format!(
                            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in \
                             vhost '/': received '{}' but current is '{durable}'",
                            declare.durable
                        ),
                    );
                }
                match crate::rabbit::args::check_equivalent(current, &declare.arguments, "q", "/") {
                    Ok(()) => CheckAnswer::DeclareOk,
                    Err(text) => refuse(406, format!("PRECONDITION_FAILED - {text}")),
                }
            }
        }
    }
}

fn client_arguments(dlx: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.into()),
    );
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(1000));
    args
}

/// basic.consume from "q" on channel 1.
fn consume_q() -> Bytes {
    consume_q_on(1)
}

/// basic.consume of "q" (consumer tag "ctag") on `channel`.
fn consume_q_on(channel: u16) -> Bytes {
    method_frame(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "ctag".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn declare_q(arguments: FieldTable) -> Bytes {
    method_frame(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        })),
    )
}

/// One instance declares "q": the client's user is probed on its own connection, the
/// service connection declares the queue with the capture exchange and the settings in its
/// tag, and the client's declare follows passively. A second instance, which never saw that
/// declare, refuses a contradicting redeclare with the text RabbitMQ gives a direct client,
/// and a third reads the settings back when its client consumes.
#[tokio::test]
async fn every_instance_reaches_the_same_settings_for_a_queue_one_of_them_declared() {
    let mut upstream = UpstreamQueue { exists: None };

    // Instance A declares.
    let (mut a, mut service) = Harness::serving();
    a.client_sends(declare_q(client_arguments("dlx")));
    assert!(!a.session.wants_client_frames(), "client reads pause");
    a.grant_probe();
    let made = a.serve(&mut service, &mut upstream);
    let [made] = &made[..] else {
        panic!("{made:?}")
    };
    let capture = a.session.shared.capture_name.clone();
    assert_eq!(
        made.arguments.inner().get("x-dead-letter-exchange"),
        Some(&AMQPValue::LongString(capture.as_str().into()))
    );
    let tag = match made.arguments.inner().get("x-dead-letter-routing-key") {
        Some(AMQPValue::LongString(tag)) => tag.to_string(),
        other => panic!("{other:?}"),
    };
    let tagged = crate::proxy::declare::CaptureTag::decode(&tag).expect("a capture tag");
    assert_eq!(tagged.dead_letter_exchange.as_deref(), Some("dlx"));
    assert_eq!(
        made.arguments.inner().get("x-message-ttl"),
        Some(&AMQPValue::LongInt(1000))
    );
    // The client's declare goes upstream passively, and its declare-ok reaches the client.
    match &a.upstream_got()[..] {
        [(1, AMQPClass::Queue(queue::AMQPMethod::Declare(d)))] => {
            assert!(d.passive);
            assert_eq!(d.queue.as_str(), "q");
        }
        other => panic!("{other:?}"),
    }
    a.upstream_sends(method_frame(
        1,
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
            queue: "q".into(),
            message_count: 0,
            consumer_count: 0,
        })),
    ));
    assert!(matches!(
        &a.client_got()[..],
        [(1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))]
    ));
    let settings = parse_queue_arguments(&client_arguments("dlx")).unwrap();
    assert_eq!(
        a.session.shared.queues.lookup("/", "q"),
        Some(VerifiedQueue::Proxied(settings.clone()))
    );

    // Instance B: a redeclare naming another dead-letter exchange gets RabbitMQ's 406, in
    // the client's terms, and nothing is declared on the client's channel.
    let (mut b, mut service) = Harness::serving();
    b.client_sends(declare_q(client_arguments("other")));
    b.grant_probe();
    let made = b.serve(&mut service, &mut upstream);
    assert!(!made.is_empty());
    let expected = format!(
        "PRECONDITION_FAILED - {}",
        crate::rabbit::args::check_equivalent(
            &client_arguments("dlx"),
            &client_arguments("other"),
            "q",
            "/"
        )
        .unwrap_err()
    );
    let sent = b.client_got();
    match &sent[..] {
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(close)))] => {
            assert_eq!(close.reply_code, 406);
            assert_eq!(close.reply_text.as_str(), expected);
            assert_eq!((close.class_id, close.method_id), (50, 10));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        b.upstream_got()
            .iter()
            .all(|(_, m)| !matches!(m, AMQPClass::Queue(_))),
        "nothing declared for the client"
    );
    assert_eq!(b.session.shared.queues.lookup("/", "q"), None);

    // Instance C: a consume from "q" waits while the settings are read back from RabbitMQ's
    // refusals, then goes upstream; the instance now knows what A declared.
    let (mut c, mut service) = Harness::serving();
    c.client_sends(consume_q());
    assert!(c.upstream_got().is_empty(), "the consume waits");
    assert!(!c.session.wants_client_frames());
    let made = c.serve(&mut service, &mut upstream);
    assert!(made[0].passive, "existence is checked first: {made:?}");
    assert!(made.len() > 2, "{made:?}");
    assert!(made.len() <= crate::proxy::readback::MAX_ROUNDS);
    assert!(made.iter().all(|d| d.queue.as_str() == "q"));
    assert!(matches!(
        &c.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Consume(_)))]
    ));
    assert!(c.session.wants_client_frames());
    assert_eq!(
        c.session.shared.queues.lookup("/", "q"),
        Some(VerifiedQueue::Proxied(settings))
    );
    // The upstream queue is as A declared it.
    let (arguments, durable) = upstream.exists.as_ref().unwrap();
    assert!(*durable);
    assert_eq!(
        arguments.inner().get("x-dead-letter-routing-key"),
        Some(&AMQPValue::LongString(tag.as_str().into()))
    );
}

/// The declare connection goes away while it judges a declare: the client gets 320 (it
/// reconnects and declares again), and nothing was declared for it.
#[tokio::test]
async fn a_service_connection_lost_during_a_declare_check_gets_the_client_320() {
    let (mut h, mut service) = Harness::serving();
    h.client_sends(declare_q(client_arguments("dlx")));
    h.grant_probe();
    let request = service.declares.try_recv().expect("the service is asked");
    drop(request);
    let answer = h.session.service_answer.as_mut().unwrap().try_recv().ok();
    assert_eq!(answer, None);
    h.session.on_service_answer(answer);
    let (code, text) = connection_close(&h.client_got());
    assert_eq!(code, reply::CONNECTION_FORCED);
    assert!(
        text.ends_with("its declare connection was lost during a declare; reconnect and retry"),
        "{text}"
    );
    assert!(
        h.upstream_got()
            .iter()
            .all(|(_, m)| !matches!(m, AMQPClass::Queue(_)))
    );
}

/// A get from a queue that does not exist is read back with one passive declare and goes
/// upstream, which answers it as it would a direct client.
#[tokio::test]
async fn a_get_from_a_missing_queue_is_read_back_once_and_passed_on() {
    let mut upstream = UpstreamQueue { exists: None };
    let (mut h, mut service) = Harness::serving();
    h.client_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    ));
    assert!(h.upstream_got().is_empty());
    let made = h.serve(&mut service, &mut upstream);
    assert_eq!(made.len(), 1);
    assert!(made[0].passive);
    assert!(upstream.exists.is_none(), "nothing created");
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Get(_)))]
    ));
    assert_eq!(h.session.shared.queues.lookup("/", "q"), None);
}

/// A client that sends basic.gets without reading the answers: at [`MAX_PENDING_ANSWERS`]
/// waiting for the upstream the session reads no more client frames; an answer, or the close
/// of the channel that asked, frees the places.
#[tokio::test]
async fn client_reads_pause_while_too_many_requests_wait_for_their_answers() {
    let (mut h, _) = consuming(&[]).await;
    let get = method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    );
    for _ in 0..MAX_PENDING_ANSWERS {
        assert!(h.session.wants_client_frames());
        h.client_sends(get.clone());
        h.upstream_got();
    }
    assert!(!h.session.wants_client_frames(), "paused at the limit");
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
    ));
    assert!(matches!(
        h.client_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)))]
    ));
    assert!(h.session.wants_client_frames(), "an answer frees a place");
    h.client_sends(get.clone());
    assert!(!h.session.wants_client_frames());
    // The channel closes with its requests unanswered: their places are free again.
    h.client_sends(channel_1_close());
    h.upstream_sends(method_frame(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert!(
        h.session.wants_client_frames(),
        "the closed channel's places are free"
    );
    assert_eq!(h.session.pending_answers, 0);
}

/// The client's channel.close of channel 1.
fn channel_1_close() -> Bytes {
    channel_close(1)
}

/// The client's channel.close of `channel`.
fn channel_close(channel: u16) -> Bytes {
    method_frame(
        channel,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

/// A basic.reject of `tag` on channel 1, without requeue.
fn reject(tag: u64) -> Bytes {
    method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: tag,
            requeue: false,
        })),
    )
}

#[tokio::test]
async fn at_the_inflight_bound_deliveries_keep_no_content_while_confirms_are_awaited() {
    let bound = 1000;
    // Delivery 7 is rejected: its dead letter is published and awaits its confirm, charged
    // (message, x-death and all) as its delivery was.
    let (mut h, publisher) = rejected_in(bounded(bound)).await;
    let sent = h.upstream_got_frames();
    assert!(sent.iter().all(|f| f.channel == publisher), "{sent:?}");
    let dead_letter = h.session.inflight_bytes;
    assert!(
        dead_letter > KEPT_OVERHEAD && dead_letter < bound,
        "{dead_letter}"
    );
    assert_eq!(h.session.dead_letter_bytes, dead_letter);

    // Below the bound, deliveries are kept with their content.
    let mut tag = 8;
    while h.session.inflight_bytes < bound {
        assert!(h.session.wants_upstream_frames());
        h.upstream_sends(delivery(1, tag, "q"));
        tag += 1;
    }
    let last_with_content = tag - 1;
    // At the bound the upstream is still read, for the confirm, until the kept deliveries
    // alone reach twice the bound; what it delivers meanwhile is kept as its tag only (128
    // bytes each).
    while h.session.wants_upstream_frames() {
        let before = h.session.inflight_bytes;
        h.upstream_sends(delivery(1, tag, "q"));
        assert_eq!(h.session.inflight_bytes - before, KEPT_OVERHEAD);
        tag += 1;
        assert!(tag < 100, "reads never stop");
    }
    let last = tag - 1;
    let deliveries = h.session.inflight_bytes - dead_letter;
    let stop = 2 * bound..2 * bound + KEPT_OVERHEAD;
    assert!(stop.contains(&deliveries), "{deliveries}");
    assert!(metric_line(
        &h,
        &format!(
            "dlx_proxy_deliveries_kept_tag_only_total {}",
            last - last_with_content
        )
    ));
    h.client_got();

    // Paused there, the confirm's deadline does not run (the confirm may be waiting unread
    // behind the deliveries): no timeout, nothing published again.
    assert!(h.session.upstream_paused());
    h.session.next_deadline();
    let later = h.now + Duration::from_secs(60);
    h.at(later);
    assert!(h.upstream_got().is_empty(), "published again while paused");
    assert!(metric_line(&h, "dlx_proxy_dead_letters_held 0"));

    // The client rejects one of each: the proxy dead-letters the one with its content; the
    // one kept as a tag goes upstream as sent (the upstream dead-letters it to the capture
    // route).
    h.client_sends(reject(last_with_content));
    let sent = h.upstream_got_frames();
    assert!(
        !sent.is_empty() && sent.iter().all(|f| f.channel == publisher),
        "{sent:?}"
    );
    // That freed room: reads resume, and the first confirm's deadline moved on by the pause.
    assert!(!h.session.upstream_paused());
    let next = h.session.next_deadline().expect("confirm deadlines");
    assert!(
        next > later,
        "{:?} before the end of the pause",
        later - next
    );
    h.client_sends(reject(last));
    let sent = h.upstream_got();
    assert!(
        matches!(
            &sent[..],
            [(1, AMQPClass::Basic(basic::AMQPMethod::Reject(r)))]
                if r.delivery_tag == last && !r.requeue
        ),
        "{sent:?}"
    );

    // The confirms free the dead letters' charge; with none awaited, reads stay paused at
    // the bound until the client settles deliveries.
    h.upstream_sends(confirm(publisher, 1));
    h.upstream_sends(confirm(publisher, 2));
    let acked: Vec<u64> = h
        .upstream_got()
        .into_iter()
        .filter_map(|(channel, method)| match method {
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) if channel == 1 => Some(a.delivery_tag),
            _ => None,
        })
        .collect();
    assert_eq!(acked, [7, last_with_content]);
    assert!(h.session.inflight_bytes >= bound);
    assert!(!h.session.wants_upstream_frames());
    h.client_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: last - 1,
            multiple: true,
        })),
    ));
    assert_eq!(h.session.inflight_bytes, 0);
    assert_eq!(h.session.dead_letter_bytes, 0);
    assert!(h.session.wants_upstream_frames());
}

#[tokio::test]
async fn held_dead_letters_alone_do_not_pause_reads_but_keep_new_content_out() {
    let bound = 200;
    let (mut h, publisher) = rejected_in(bounded(bound)).await;
    h.upstream_got();
    // The dead-letter queue refuses it: held, its x-death and all above the bound.
    h.upstream_sends(refusal(publisher, 1));
    assert!(h.session.dead_letter_bytes >= bound);
    assert!(!h.session.awaits_confirms());
    // The client holds nothing: reads go on (answers and heartbeats come that way), and a
    // delivery of a queue that dead-letters is kept as its tag only.
    assert!(h.session.wants_upstream_frames());
    h.upstream_sends(delivery(1, 8, "q"));
    assert_eq!(
        h.session.inflight_bytes - h.session.dead_letter_bytes,
        KEPT_OVERHEAD
    );
    assert!(metric_line(
        &h,
        "dlx_proxy_deliveries_kept_tag_only_total 1"
    ));
    h.client_sends(reject(8));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Reject(r)))] if r.delivery_tag == 8
    ));
}

#[tokio::test]
async fn with_client_reads_paused_for_answers_the_upstream_is_read_past_the_bound() {
    // Delivery 7 alone fills a 1-byte bound: upstream reads pause until the client settles.
    let h = bounded(1);
    let (mut h, _) = consuming_in(h, &[]).await;
    assert!(!h.session.wants_upstream_frames());
    // The client pipelines requests up to the limit: its reads pause for their answers, so
    // its acks cannot come; the answers must be read, whatever the bound.
    let get = method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    );
    for _ in 0..MAX_PENDING_ANSWERS {
        h.client_sends(get.clone());
    }
    assert!(!h.session.wants_client_frames());
    assert!(h.session.wants_upstream_frames());
}

#[tokio::test]
async fn a_client_gets_the_proxys_heartbeats_while_upstream_reads_are_paused() {
    // Delivery 7 alone fills a 1-byte bound: upstream reads pause until the client settles.
    let h = bounded(1);
    let (mut h, _) = consuming_with_heartbeat(h, &[], 10).await;
    assert!(h.session.upstream_paused());
    h.session.next_deadline();
    let start = h.now;
    let beats = |h: &mut Harness| {
        frames(&h.session.client_out.take_queued())
            .iter()
            .filter(|f| f.is_heartbeat())
            .count()
    };
    beats(&mut h);
    // Every half interval, the proxy's own heartbeat (the upstream's are not read).
    for half in 1..=3 {
        assert_eq!(
            h.session.next_deadline(),
            Some(start + Duration::from_secs(5 * half))
        );
        h.at(start + Duration::from_secs(5 * half));
        assert_eq!(beats(&mut h), 1, "half interval {half}");
        // The client's own heartbeats keep its side alive.
        h.client_sends(Bytes::from_static(&[8, 0, 0, 0, 0, 0, 0, 0xCE]));
    }
    // Reads resume once the client settles: the upstream's heartbeats reach it again, and
    // the proxy sends none of its own.
    h.client_sends(method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 7,
            multiple: false,
        })),
    ));
    assert!(!h.session.upstream_paused());
    h.upstream_sends(Bytes::from_static(&[8, 0, 0, 0, 0, 0, 0, 0xCE]));
    assert_eq!(beats(&mut h), 1, "the upstream's, forwarded");
    h.session.next_deadline();
    h.at(start + Duration::from_secs(20));
    assert_eq!(beats(&mut h), 0);
    assert!(!h.session.is_done());
}

// ---- a consumer's dead letters and the service connection -------------------------------

/// [`consuming`] from a queue with dead-letter exchange "dlx", given a running service
/// connection once open.
async fn consuming_with_service() -> (Harness, u16, ServiceEnd) {
    let dlx = (
        "x-dead-letter-exchange",
        AMQPValue::LongString("dlx".into()),
    );
    let (mut h, publisher) = consuming(std::slice::from_ref(&dlx)).await;
    let service = h.with_service();
    (h, publisher, service)
}

/// [`consuming_with_service`]; the client published on channel 1 first when `published`,
/// then rejects delivery 7.
async fn rejected_with_service(published: bool) -> (Harness, u16, ServiceEnd) {
    let (mut h, publisher, service) = consuming_with_service().await;
    if published {
        h.client_sends(client_publish(b"p", 131_072).freeze());
        assert_eq!(h.upstream_got().len(), 1, "the publish is forwarded");
        h.session.report_counts();
    }
    h.client_sends(reject(7));
    (h, publisher, service)
}

/// The dead letter the session handed to the service connection, if any.
fn handed(service: &mut ServiceEnd) -> Option<crate::proxy::service::link::PublishRequest> {
    service.publishes.try_recv().ok()
}

#[tokio::test]
async fn a_consumers_dead_letter_is_published_by_the_service_connection() {
    // A resource alarm blocks a connection once it publishes and reads no more of it, acks
    // included: a connection whose client never published stays a consumer's.
    let (mut h, _, mut service) = rejected_with_service(false).await;
    assert!(
        h.upstream_got().is_empty(),
        "nothing on the client's connection"
    );
    let request = handed(&mut service).expect("handed to the service connection");
    assert_eq!(
        (
            request.message.exchange.as_str(),
            request.message.routing_key.as_str()
        ),
        ("dlx", "q")
    );
    let props = decode_properties(&request.message.raw_properties).unwrap();
    let headers = props.headers().clone().unwrap();
    assert_eq!(
        headers.inner().get("x-first-death-reason"),
        Some(&AMQPValue::LongString("rejected".into()))
    );
    assert!(metric_line(
        &h,
        "dlx_proxy_consumer_dead_letters_by_service_total 1"
    ));
    // Its confirm acks the original on the client's channel.
    h.session.complete_op(request.op, Outcome::Confirmed);
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7
    ));
}

#[tokio::test]
async fn a_client_that_published_dead_letters_on_its_own_connection() {
    // Its connection is a publisher's already: an alarm blocks it either way.
    let (mut h, publisher, mut service) = rejected_with_service(true).await;
    let (exchange, routing_key, _) = published(&h.upstream_got_frames(), publisher);
    assert_eq!((exchange.as_str(), routing_key.as_str()), ("dlx", "q"));
    assert!(handed(&mut service).is_none());
    assert!(metric_line(
        &h,
        "dlx_proxy_consumer_dead_letters_by_service_total 0"
    ));
}

#[tokio::test]
async fn a_consumers_dead_letter_goes_on_its_own_connection_while_the_service_is_away() {
    let (mut h, publisher, mut service) = consuming_with_service().await;
    service.status.send_modify(|s| s.consuming = false);
    h.client_sends(reject(7));
    let (exchange, _, _) = published(&h.upstream_got_frames(), publisher);
    assert_eq!(exchange, "dlx");
    assert!(handed(&mut service).is_none());
}

#[tokio::test]
async fn a_consumers_dead_letter_refused_to_the_service_user_goes_on_the_clients_connection() {
    let (mut h, publisher, mut service) = rejected_with_service(false).await;
    let request = handed(&mut service).expect("handed to the service connection");
    h.session.complete_op(request.op, Outcome::AccessRefused);
    let (exchange, _, headers) = published(&h.upstream_got_frames(), publisher);
    assert_eq!(exchange, "dlx");
    assert!(headers.inner().contains_key("x-death"));
    assert!(handed(&mut service).is_none(), "not handed back and forth");
    // Confirmed there: the original is acked.
    h.upstream_sends(confirm(publisher, 1));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7
    ));
}

/// connection.blocked (`true`) or connection.unblocked from the upstream.
fn blocked_frame(blocked: bool) -> Bytes {
    let method = if blocked {
        connection::AMQPMethod::Blocked(connection::Blocked {
            reason: "low on memory".into(),
        })
    } else {
        connection::AMQPMethod::Unblocked(connection::Unblocked {})
    };
    method_frame(0, AMQPClass::Connection(method))
}

#[tokio::test]
async fn while_rabbitmq_blocks_the_connection_the_dead_letters_confirm_deadline_waits() {
    // RabbitMQ reads nothing from a blocked connection: a confirm deadline passing then would
    // publish the same dead letter again behind the first.
    let (mut h, publisher) = rejected().await;
    let first = h.upstream_got_frames();
    assert_eq!(published(&first, publisher).0, "dlx");
    let deadline = h.session.next_deadline().expect("the confirm deadline");
    let blocked_at = h.now + Duration::from_millis(10);
    h.at(blocked_at);
    h.upstream_sends(blocked_frame(true));
    // The harness's client did not ask for the notification: the proxy asked for it, and
    // keeps it from the client.
    assert!(h.client_got().is_empty());
    assert!(metric_line(
        &h,
        r#"dlx_proxy_upstream_connections_blocked{connection="client"} 1"#
    ));
    assert!(h.session.next_deadline().is_none_or(|at| at > deadline));
    let long_after = deadline + Duration::from_secs(600);
    h.at(long_after);
    assert!(h.upstream_got().is_empty(), "not published again");
    h.upstream_sends(blocked_frame(false));
    assert!(h.client_got().is_empty());
    assert_eq!(
        h.session.next_deadline(),
        Some(deadline + (long_after - blocked_at))
    );
    assert!(metric_line(
        &h,
        r#"dlx_proxy_upstream_connections_blocked{connection="client"} 0"#
    ));
    h.upstream_sends(confirm(publisher, 1));
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))] if a.delivery_tag == 7
    ));
}

/// The start-ok the upstream gets for a client's start-ok with these client properties,
/// whether it was forwarded as the client sent it, and whether the session will pass
/// connection.blocked on to the client.
fn start_ok_upstream(client_properties: FieldTable) -> (connection::StartOk, bool, bool) {
    let mut h = Harness::new();
    h.upstream_sends(connection_start());
    h.client_got();
    let start_ok = method_frame(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties,
            mechanism: "PLAIN".into(),
            response: LongString::from("\0guest\0guest"),
            locale: "en_US".into(),
        })),
    );
    h.client_sends(start_ok.clone());
    let sent = h.session.upstream_out.take_queued();
    let Some(AMQPClass::Connection(connection::AMQPMethod::StartOk(upstream))) =
        decode_method(frames(&sent)[0].payload())
    else {
        panic!("{sent:?}");
    };
    (upstream, sent == start_ok, h.session.client_wants_blocked)
}

/// The `connection.blocked` capability in a start-ok.
fn asks_for_blocked(start_ok: &connection::StartOk) -> bool {
    matches!(
        start_ok.client_properties.inner().get("capabilities"),
        Some(AMQPValue::FieldTable(c))
            if c.inner().get("connection.blocked") == Some(&AMQPValue::Boolean(true))
    )
}

#[tokio::test]
async fn the_upstream_is_asked_for_blocked_notifications_whether_or_not_the_client_asked() {
    // Not asked by the client: the proxy asks, and keeps the notifications to itself.
    let (upstream, as_sent, passed_on) = start_ok_upstream(FieldTable::default());
    assert!(asks_for_blocked(&upstream));
    assert!(!as_sent && !passed_on);
    // Asked: the start-ok goes as the client sent it, and so will the notifications.
    let mut capabilities = FieldTable::default();
    capabilities.insert("connection.blocked".into(), AMQPValue::Boolean(true));
    let mut properties = FieldTable::default();
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    let (upstream, as_sent, passed_on) = start_ok_upstream(properties);
    assert!(asks_for_blocked(&upstream));
    assert!(as_sent && passed_on);
}

#[tokio::test]
async fn a_consumers_dead_letter_goes_on_its_own_connection_when_the_services_queue_is_full() {
    let (mut h, publisher, mut service) = consuming_with_service().await;
    fill_service_queue(&h);
    // Not held for a retry: published at once where it would have been before.
    h.client_sends(reject(7));
    let (exchange, _, _) = published(&h.upstream_got_frames(), publisher);
    assert_eq!(exchange, "dlx");
    assert!(metric_line(
        &h,
        "dlx_proxy_consumer_dead_letters_by_service_total 0"
    ));
    assert!(h.session.held.is_empty());
    while let Some(request) = handed(&mut service) {
        assert_eq!(request.message.exchange, "other");
    }
}

/// Fills the service connection's queue of the session in `h` with other dead letters.
fn fill_service_queue(h: &Harness) {
    let handle = h.session.service.clone().unwrap();
    let (reply, _) = tokio::sync::mpsc::unbounded_channel();
    let mut op = 1000;
    while handle
        .publishes
        .try_send(crate::proxy::service::link::PublishRequest {
            op,
            message: crate::proxy::publisher::OutgoingMessage {
                exchange: "other".into(),
                routing_key: "k".into(),
                raw_properties: Bytes::from_static(&[0, 0]),
                body: Bytes::new(),
            },
            delay_ms: None,
            reply: reply.clone(),
        })
        .is_ok()
    {
        op += 1;
    }
}

#[tokio::test]
async fn while_the_service_connection_is_blocked_a_consumers_dead_letter_waits_for_it() {
    // Its queue filled because RabbitMQ blocks it: the client's connection would be blocked
    // as well, so the dead letter is held for a retry, not published there.
    let (mut h, _, service) = consuming_with_service().await;
    service.status.send_modify(|s| s.blocked = true);
    fill_service_queue(&h);
    h.client_sends(reject(7));
    assert!(
        h.upstream_got().is_empty(),
        "nothing on the client's connection"
    );
    let (op, outcome) = h.session.service_outcomes.1.try_recv().unwrap();
    h.session.complete_op(op, outcome);
    assert_eq!(h.session.held.len(), 1, "held for a retry");
    assert!(h.upstream_got().is_empty());
}

#[tokio::test]
async fn a_close_parked_behind_a_service_publish_goes_on_after_the_confirm_timeout() {
    let (mut h, _, mut service) = rejected_with_service(false).await;
    let request = handed(&mut service).expect("handed to the service connection");
    // The client closes its channel: parked while the dead letter is out.
    h.client_sends(channel_1_close());
    assert!(h.upstream_got().is_empty(), "parked");
    let deadline = h
        .session
        .next_deadline()
        .expect("the parked close's deadline");
    assert_eq!(deadline, h.now + h.session.shared.confirm_timeout);
    h.at(deadline);
    // Abandoned: the close goes upstream, which requeues the original.
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    // A late confirm settles nothing.
    h.session.complete_op(request.op, Outcome::Confirmed);
    assert!(h.upstream_got().is_empty());
    assert_eq!(h.session.next_deadline(), None);
}

#[tokio::test]
async fn each_parked_close_waits_its_own_confirm_timeout() {
    // Channel 1's close is parked first, channel 2's later: each gives up on its own
    // publishes at its own deadline, not at the first one.
    let (mut h, _, mut service) = rejected_with_service(false).await;
    let first = handed(&mut service).expect("channel 1's dead letter");
    h.client_sends(method_frame(
        2,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    h.upstream_sends(method_frame(
        2,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    ));
    h.client_sends(consume_q_on(2));
    h.upstream_sends(method_frame(
        2,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: "ctag".into(),
        })),
    ));
    h.upstream_sends(delivery(2, 8, "q"));
    h.upstream_got();
    h.client_got();
    let timeout = h.session.shared.confirm_timeout;
    let start = h.now;
    h.client_sends(channel_1_close());
    h.at(start + timeout - Duration::from_secs(1));
    h.client_sends(method_frame(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: 8,
            requeue: false,
        })),
    ));
    let second = handed(&mut service).expect("channel 2's dead letter");
    h.client_sends(channel_close(2));
    assert!(h.upstream_got().is_empty(), "both parked");
    h.at(start + timeout);
    assert!(matches!(
        &h.upstream_got()[..],
        [(1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))]
    ));
    assert_eq!(
        h.session.next_deadline(),
        Some(start + timeout - Duration::from_secs(1) + timeout)
    );
    // Channel 2's publish is confirmed in time: its original is acked, then its close goes.
    h.session.complete_op(second.op, Outcome::Confirmed);
    assert!(matches!(
        &h.upstream_got()[..],
        [
            (2, AMQPClass::Basic(basic::AMQPMethod::Ack(a))),
            (2, AMQPClass::Channel(channel::AMQPMethod::Close(_)))
        ] if a.delivery_tag == 8
    ));
    h.session.complete_op(first.op, Outcome::Confirmed);
    assert!(h.upstream_got().is_empty(), "channel 1's was abandoned");
    assert_eq!(h.session.next_deadline(), None);
}

#[tokio::test]
async fn a_close_parked_on_a_blocked_connection_waits_for_the_unblock() {
    // RabbitMQ would read the close no sooner than the confirm: nothing is abandoned.
    let (mut h, publisher) = rejected().await;
    h.upstream_got();
    h.upstream_sends(blocked_frame(true));
    h.client_sends(channel_1_close());
    // The connection loop's turn notes the pause.
    let _ = h.session.next_deadline();
    let start = h.now;
    h.at(start + h.session.shared.confirm_timeout);
    assert!(h.upstream_got().is_empty(), "not abandoned while blocked");
    assert!(h.session.next_deadline().is_some_and(|at| at > h.now));
    h.upstream_sends(blocked_frame(false));
    h.upstream_sends(confirm(publisher, 1));
    assert!(matches!(
        &h.upstream_got()[..],
        [
            (1, AMQPClass::Basic(basic::AMQPMethod::Ack(a))),
            (1, AMQPClass::Channel(channel::AMQPMethod::Close(_)))
        ] if a.delivery_tag == 7
    ));
}

#[tokio::test]
async fn a_start_ok_that_would_outgrow_the_handshake_frame_goes_as_it_is() {
    // 4096 bytes is the frame every peer accepts before tune: a start-ok just under it is
    // not made larger than that to add the capability.
    let mut properties = FieldTable::default();
    properties.insert(
        "information".into(),
        AMQPValue::LongString("i".repeat(4010).into()),
    );
    let (upstream, as_sent, _) = start_ok_upstream(properties.clone());
    assert!(as_sent);
    assert!(!asks_for_blocked(&upstream));
    // With room for it, the capability is added.
    properties.insert(
        "information".into(),
        AMQPValue::LongString("i".repeat(3900).into()),
    );
    let (upstream, as_sent, _) = start_ok_upstream(properties);
    assert!(!as_sent);
    assert!(asks_for_blocked(&upstream));
}
