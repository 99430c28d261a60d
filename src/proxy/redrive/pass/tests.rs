//! Unit tests of [`super`]: frames in, frames out, no socket.

use super::*;
use crate::amqp::content::{decode_properties, encode_properties, put_content};
use crate::deadletter::DeadLetterReason;
use crate::proxy::wire::WireCodec;
use crate::redrive::plan::{Plan, X_REDRIVEN_COUNT};
use amq_protocol::types::AMQPValue;
use std::time::Duration;
use tokio_util::codec::Decoder;
use tokio_util::sync::CancellationToken;

fn frames(bytes: &[u8]) -> Vec<WireFrame> {
    let mut buf = BytesMut::from(bytes);
    let mut codec = WireCodec::new(1 << 20);
    std::iter::from_fn(|| codec.decode(&mut buf).unwrap()).collect()
}

/// The methods written, by channel.
fn methods(out: &mut BytesMut) -> Vec<(u16, AMQPClass)> {
    let bytes = std::mem::take(out);
    frames(&bytes)
        .into_iter()
        .filter(|f| f.kind == FRAME_METHOD)
        .map(|f| (f.channel, decode_method(f.payload()).unwrap()))
        .collect()
}

fn pass(plan: Plan, dry_run: bool) -> Pass {
    Pass {
        plan,
        dry_run,
        rate: None,
        max: None,
        cancel: CancellationToken::new(),
    }
}

fn state(total: u64, pass: &Pass) -> PassState {
    let publisher = Publisher::new(PUBLISH_CHANNEL, 1 << 17, Duration::from_secs(5));
    PassState::new("dlq", total, pass, publisher).unwrap()
}

/// The frames of a message with content: `method` then its header and body.
fn with_content(channel: u16, method: AMQPClass, raw: &[u8], body: &[u8]) -> Vec<WireFrame> {
    let mut out = BytesMut::from(&method_frame(channel, method)[..]);
    put_content(&mut out, channel, raw, body, 1 << 17);
    frames(&out)
}

/// A delivery of a message that died in `queue` for `reason` (dead-lettered by the proxy: it
/// carries its mark).
fn delivery(tag: u64, consumer: u64, queue: &str, reason: &str) -> Vec<WireFrame> {
    let props = crate::redrive::plan::dead_letter_properties(&[(queue, reason)]);
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(
        ShortString::from(crate::proxy::bcc::PRIVATE_HOP_HEADER),
        AMQPValue::Boolean(true),
    );
    let raw = encode_properties(&props.with_headers(headers));
    with_content(
        CONSUME_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: ShortString::from(consumer_tag(consumer)),
            delivery_tag: tag,
            redelivered: false,
            exchange: ShortString::from(""),
            routing_key: ShortString::from("dlq"),
        })),
        &raw,
        format!("m{tag}").as_bytes(),
    )
}

#[derive(Default)]
struct Seen {
    examined: u64,
    moved: Vec<String>,
    skipped: u64,
    failed: Vec<&'static str>,
}

impl Seen {
    fn add(&mut self, p: Progress) {
        self.examined += p.examined;
        self.moved.extend(p.moved);
        self.skipped += p.skipped;
        self.failed.extend(p.failed);
    }
}

fn feed(s: &mut PassState, pass: &Pass, frames: Vec<WireFrame>, seen: &mut Seen) {
    for frame in frames {
        s.on_frame(&frame, pass, &mut |p| seen.add(p)).unwrap();
    }
}

#[test]
fn a_move_is_acked_after_its_confirm_and_a_returned_one_stays() {
    let pass = pass(Plan::default(), false);
    let mut s = state(2, &pass);
    let start = methods(&mut s.out);
    assert!(
        start
            .iter()
            .any(|(ch, m)| *ch == PUBLISH_CHANNEL && matches!(m, AMQPClass::Confirm(_)))
    );
    assert!(start.iter().any(|(ch, m)| *ch == CONSUME_CHANNEL
        && matches!(m, AMQPClass::Basic(basic::AMQPMethod::Qos(q)) if q.prefetch_count == WINDOW)));
    let mut seen = Seen::default();
    feed(&mut s, &pass, delivery(1, 1, "work", "rejected"), &mut seen);
    feed(&mut s, &pass, delivery(2, 1, "gone", "expired"), &mut seen);
    assert_eq!(seen.examined, 2);
    assert!(!s.step(None, Instant::now(), &mut |p| seen.add(p)).unwrap());
    // Both published to their source through the default exchange, mandatory, stamped.
    let bytes = std::mem::take(&mut s.out);
    let written = frames(&bytes);
    let publishes: Vec<String> = written
        .iter()
        .filter_map(|f| match decode_method(f.payload()) {
            Some(AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => {
                assert!(p.mandatory && p.exchange.as_str().is_empty());
                Some(p.routing_key.as_str().to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(publishes, ["work", "gone"]);
    let header = written.iter().find(|f| f.kind == FRAME_HEADER).unwrap();
    let props = decode_properties(&header.payload()[12..]).unwrap();
    let headers = props.headers().clone().unwrap();
    assert_eq!(
        headers.inner().get(X_REDRIVEN_COUNT),
        Some(&AMQPValue::LongLongInt(1))
    );
    assert!(headers.inner().contains_key("x-death"), "history kept");
    assert!(
        !headers
            .inner()
            .contains_key(crate::proxy::bcc::PRIVATE_HOP_HEADER),
        "a republish: no longer the proxy's dead letter"
    );
    // "gone" comes back (no such queue), then both are confirmed with one multiple ack.
    let returned = with_content(
        PUBLISH_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: ShortString::from("NO_ROUTE"),
            exchange: ShortString::from(""),
            routing_key: ShortString::from("gone"),
        })),
        &[0, 0],
        b"m2",
    );
    feed(&mut s, &pass, returned, &mut seen);
    let ack = method_frame(
        PUBLISH_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 2,
            multiple: true,
        })),
    );
    feed(&mut s, &pass, frames(&ack), &mut seen);
    assert_eq!(seen.moved, ["work"]);
    assert_eq!(seen.failed, ["no_queue"]);
    let acks: Vec<(u16, AMQPClass)> = methods(&mut s.out);
    assert_eq!(
        acks,
        [(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: false,
            }))
        )],
        "only the confirmed move's delivery is acked"
    );
    // All looked at: the consumer went with the first publishes; once both are settled the
    // pass is over and the returned one is given back.
    assert!(written.iter().any(|f| matches!(
        decode_method(f.payload()),
        Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(_)))
    )));
    assert!(s.step(None, Instant::now(), &mut |p| seen.add(p)).unwrap());
    s.give_back();
    assert_eq!(
        methods(&mut s.out),
        [(
            CONSUME_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: 2,
                multiple: true,
                requeue: true,
            }))
        )]
    );
}

#[test]
fn a_window_full_of_messages_that_stay_gets_a_new_consumer() {
    let plan = Plan {
        to: None,
        reasons: vec![DeadLetterReason::Rejected],
    };
    let pass = pass(plan, false);
    let mut s = state(1000, &pass);
    s.out.clear();
    let mut seen = Seen::default();
    for tag in 1..u64::from(WINDOW) {
        feed(&mut s, &pass, delivery(tag, 1, "q", "expired"), &mut seen);
    }
    assert!(
        methods(&mut s.out).is_empty(),
        "255 kept: the window has room"
    );
    feed(&mut s, &pass, delivery(256, 1, "q", "expired"), &mut seen);
    let switch = methods(&mut s.out);
    let tags: Vec<String> = switch
        .iter()
        .map(|(_, m)| match m {
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => format!("cancel {}", c.consumer_tag),
            AMQPClass::Basic(basic::AMQPMethod::Consume(c)) => {
                format!("consume {}", c.consumer_tag)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        tags,
        ["cancel dlx-proxy-redrive-1", "consume dlx-proxy-redrive-2"]
    );
    assert_eq!((seen.examined, seen.skipped), (256, 256));
    // A late delivery to the old consumer does not count against the new one's window.
    feed(&mut s, &pass, delivery(257, 1, "q", "expired"), &mut seen);
    assert_eq!(s.kept_here, 0);
}

#[test]
fn a_dry_run_publishes_nothing_and_gives_everything_back() {
    let pass = pass(Plan::default(), true);
    let mut s = state(2, &pass);
    assert!(
        !methods(&mut s.out)
            .iter()
            .any(|(ch, _)| *ch == PUBLISH_CHANNEL)
    );
    let mut seen = Seen::default();
    feed(&mut s, &pass, delivery(1, 1, "a", "expired"), &mut seen);
    feed(&mut s, &pass, delivery(2, 1, "b", "expired"), &mut seen);
    assert!(s.step(None, Instant::now(), &mut |p| seen.add(p)).unwrap());
    assert_eq!(seen.moved, ["a", "b"]);
    s.give_back();
    let end = methods(&mut s.out);
    assert!(end.iter().all(|(ch, _)| *ch == CONSUME_CHANNEL));
    assert!(end.iter().any(|(_, m)| matches!(
        m,
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) if n.delivery_tag == 2 && n.multiple && n.requeue
    )));
}

#[test]
fn a_cancel_gives_back_what_waits_for_its_token() {
    let pass = Pass {
        max: Some(5),
        ..pass(Plan::default(), false)
    };
    let mut s = state(10, &pass);
    s.out.clear();
    let mut seen = Seen::default();
    for tag in 1..=3 {
        feed(&mut s, &pass, delivery(tag, 1, "q", "expired"), &mut seen);
    }
    // One token: one publish, two wait.
    let now = Instant::now();
    let mut bucket = TokenBucket::new(1.0, 1, now);
    assert!(
        !s.step(Some(&mut bucket), now, &mut |p| seen.add(p))
            .unwrap()
    );
    assert!(s.waiting());
    s.cancelled = true;
    assert!(
        !s.step(Some(&mut bucket), now, &mut |p| seen.add(p))
            .unwrap()
    );
    assert!(!s.waiting(), "the waiting ones are let go");
    let ack = method_frame(
        PUBLISH_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    );
    feed(&mut s, &pass, frames(&ack), &mut seen);
    assert!(
        s.step(Some(&mut bucket), now, &mut |p| seen.add(p))
            .unwrap()
    );
    s.give_back();
    let end = methods(&mut s.out);
    assert!(end.iter().any(|(_, m)| matches!(
        m,
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) if n.delivery_tag == 3 && n.multiple
    )));
    assert_eq!(seen.moved, ["q"]);
}

#[test]
fn a_queue_that_runs_out_before_the_count_ends_the_pass() {
    let pass = pass(Plan::default(), true);
    let mut s = state(5, &pass);
    let mut seen = Seen::default();
    feed(&mut s, &pass, delivery(1, 1, "a", "expired"), &mut seen);
    let now = Instant::now();
    assert!(!s.step(None, now, &mut |p| seen.add(p)).unwrap());
    let idle = s.idle_until().unwrap();
    assert!(idle >= now + IDLE - Duration::from_millis(100));
    // Another consumer took the other four: nothing comes, the pass ends.
    assert!(s.step(None, idle, &mut |p| seen.add(p)).unwrap());
    assert_eq!(seen.examined, 1);
}
