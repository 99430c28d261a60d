//! Unit tests of [`crate::proxy::passthrough`]: the same traffic handed to two sessions, one
//! frame at a time and in runs (as the connection task hands it), gives both peers the same
//! bytes and leaves the same deliveries kept (also random traffic in reads of random sizes);
//! a run stops where a frame needs more than forwarding and at the outbox and inflight bounds.

use amq_protocol::protocol::{AMQPClass, BasicProperties, basic};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};
use bytes::{Bytes, BytesMut};
use tokio_util::codec::Decoder;

use crate::amqp::codec::{FRAME_BODY, put_raw_frame};
use crate::amqp::content::{encode_properties, put_content};
use crate::amqp::reply;
use crate::proxy::client_session::tests::{Harness, consuming, delivery};
use crate::proxy::test_support::{frames, methods};
use crate::proxy::wire::{WireCodec, method_frame};

const FRAME_MAX: usize = 131_072;

/// Hands `bytes` from one side to the session as the connection task does: a run, then one
/// frame on its own, and again. Returns the bytes the runs took.
fn in_runs(h: &mut Harness, bytes: &[u8], from_client: bool) -> usize {
    drain(h, &mut BytesMut::from(bytes), from_client)
}

/// Handles the complete frames in `buf` as [`in_runs`] does, leaving an incomplete one there
/// for the next read. Returns the bytes the runs took.
fn drain(h: &mut Harness, buf: &mut BytesMut, from_client: bool) -> usize {
    let mut codec = WireCodec::new(FRAME_MAX as u32);
    let mut by_runs = 0;
    loop {
        by_runs += if from_client {
            h.session.client_run(buf, FRAME_MAX, 256)
        } else {
            h.session.upstream_run(buf, FRAME_MAX, 256)
        };
        let frame = match codec.decode(buf) {
            Ok(Some(frame)) => Ok(frame),
            Ok(None) => break,
            Err(err) => Err(err),
        };
        let failed = frame.is_err();
        if from_client {
            h.session.client_read(Some(frame), h.now);
        } else {
            h.session.upstream_read(Some(frame), h.now);
        }
        if failed {
            break;
        }
    }
    by_runs
}

/// Asserts that two sessions queued the same frames: byte for byte, but for the content
/// headers of the proxy's own dead letters on `publisher`, whose x-death carries the time
/// of death in seconds (the same length; the clock may tick between the two sessions).
fn assert_same(one: &Bytes, other: &Bytes, publisher: u16, context: &str) {
    let (one, other) = (frames(one), frames(other));
    assert_eq!(one.len(), other.len(), "{context}");
    for (a, b) in one.iter().zip(&other) {
        if a.channel == publisher && a.kind == crate::amqp::codec::FRAME_HEADER {
            assert_eq!(
                (a.channel, a.raw.len()),
                (b.channel, b.raw.len()),
                "{context}"
            );
        } else {
            assert_eq!(a, b, "{context}");
        }
    }
}

/// What the session queued for the client and for the upstream since the last call.
fn queued(h: &mut Harness) -> (Bytes, Bytes) {
    (
        h.session.client_out.take_queued(),
        h.session.upstream_out.take_queued(),
    )
}

/// The kept deliveries: count, bytes, and those of channel 1.
fn kept(h: &Harness) -> (usize, usize, usize) {
    let channel = h
        .session
        .channels
        .get(&1)
        .map_or(0, |ch| ch.deliveries.kept_len());
    (h.session.inflight_count, h.session.inflight_bytes, channel)
}

/// What the session counted for the metrics (frames and bytes read, messages published,
/// delivered and acked, deliveries kept), and whether a content is still in progress.
fn counted(h: &Harness) -> String {
    let incoming = h
        .session
        .channels
        .get(&1)
        .is_some_and(|ch| ch.incoming.is_some() || ch.outgoing.is_some());
    format!(
        "{:?}, {} in progress, channel 1 in a content: {incoming}",
        h.session.counts, h.session.incoming_in_progress
    )
}

/// A publish on channel 1 whose body goes in frames of at most 40 bytes.
fn publish(body: &[u8], properties: &BasicProperties) -> Bytes {
    let mut out = BytesMut::new();
    out.extend_from_slice(&method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    put_content(&mut out, 1, &encode_properties(properties), body, 48);
    out.freeze()
}

fn ack(delivery_tag: u64, multiple: bool) -> Bytes {
    method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        })),
    )
}

fn reject(delivery_tag: u64) -> Bytes {
    method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag,
            requeue: false,
        })),
    )
}

fn joined(parts: &[Bytes]) -> Bytes {
    let mut out = BytesMut::new();
    for part in parts {
        out.extend_from_slice(part);
    }
    out.freeze()
}

/// Two sessions consuming from "q" (with these arguments) that got delivery 7, their output
/// so far taken.
async fn twins(arguments: &[(&str, AMQPValue)]) -> (Harness, Harness) {
    let (one, other, _) = twins_publishing(arguments).await;
    (one, other)
}

/// [`twins`], and the proxy's publisher channel (the same in both).
async fn twins_publishing(arguments: &[(&str, AMQPValue)]) -> (Harness, Harness, u16) {
    let (mut one, publisher) = consuming(arguments).await;
    let (mut other, _) = consuming(arguments).await;
    queued(&mut one);
    queued(&mut other);
    (one, other, publisher)
}

#[tokio::test]
async fn deliveries_publishes_and_acks_in_runs_give_the_peers_the_same_bytes() {
    let (mut by_frame, mut by_run) = twins(&[]).await;
    let deliveries = joined(&(8..40).map(|tag| delivery(1, tag, "q")).collect::<Vec<_>>());
    by_frame.upstream_sends(deliveries.clone());
    let taken = in_runs(&mut by_run, &deliveries, false);
    assert_eq!(taken, deliveries.len(), "every delivery goes in a run");
    assert_eq!(queued(&mut by_frame), queued(&mut by_run));
    assert_eq!(kept(&by_frame), kept(&by_run));
    assert_eq!(counted(&by_frame), counted(&by_run));
    assert_eq!(kept(&by_run).2, 33, "deliveries 7 to 39 are kept");

    let mut traffic = Vec::new();
    for n in 0..10u8 {
        traffic.push(publish(&[n; 100], &BasicProperties::default()));
        traffic.push(ack(8 + u64::from(n), false));
    }
    traffic.push(ack(30, true));
    traffic.push(publish(b"", &BasicProperties::default()));
    let traffic = joined(&traffic);
    by_frame.client_sends(traffic.clone());
    let taken = in_runs(&mut by_run, &traffic, true);
    assert_eq!(taken, traffic.len(), "publishes and acks go in runs");
    let (to_client, to_upstream) = queued(&mut by_run);
    assert_eq!(
        (to_client.clone(), to_upstream.clone()),
        queued(&mut by_frame)
    );
    assert_eq!(to_upstream, traffic, "forwarded as the client sent them");
    assert!(to_client.is_empty());
    assert_eq!(kept(&by_frame), kept(&by_run));
    assert_eq!(kept(&by_run).2, 9, "31 to 39 are still kept");
}

#[tokio::test]
async fn confirms_between_deliveries_go_in_runs() {
    let (mut by_frame, mut by_run) = twins(&[]).await;
    let nack = method_frame(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 6,
            multiple: false,
            requeue: false,
        })),
    );
    let traffic = joined(&[
        ack(1, false),
        delivery(1, 8, "q"),
        ack(5, true),
        nack,
        delivery(1, 9, "q"),
    ]);
    by_frame.upstream_sends(traffic.clone());
    assert_eq!(in_runs(&mut by_run, &traffic, false), traffic.len());
    let (to_client, to_upstream) = queued(&mut by_run);
    assert_eq!((to_client.clone(), to_upstream), queued(&mut by_frame));
    assert_eq!(to_client, traffic, "forwarded as the upstream sent them");
    assert_eq!(kept(&by_frame), kept(&by_run));
    assert_eq!(kept(&by_run).2, 3, "deliveries 7, 8 and 9 are kept");
}

#[tokio::test]
async fn a_reject_the_proxy_takes_over_ends_the_run_and_acks_around_it_stay_in_order() {
    let dlx = [(
        "x-dead-letter-exchange",
        AMQPValue::LongString("dlx".into()),
    )];
    let (mut by_frame, mut by_run, publisher) = twins_publishing(&dlx).await;
    let deliveries = joined(&(8..12).map(|tag| delivery(1, tag, "q")).collect::<Vec<_>>());
    by_frame.upstream_sends(deliveries.clone());
    in_runs(&mut by_run, &deliveries, false);
    assert_eq!(queued(&mut by_frame), queued(&mut by_run));
    // Delivery 9 is rejected (the proxy dead-letters it and holds the upstream's copy until
    // the confirm); the multiple ack of 11 that follows cannot go as sent, since it would
    // settle 9 too: it becomes single acks of the others still kept (7, 10, 11).
    let traffic = joined(&[
        publish(b"before", &BasicProperties::default()),
        ack(8, false),
        reject(9),
        ack(11, true),
        publish(b"after", &BasicProperties::default()),
    ]);
    by_frame.client_sends(traffic.clone());
    let taken = in_runs(&mut by_run, &traffic, true);
    assert!(taken > 0 && taken < traffic.len(), "{taken}");
    let (to_client, to_upstream) = queued(&mut by_run);
    let (frame_client, frame_upstream) = queued(&mut by_frame);
    assert_eq!(to_client, frame_client);
    assert_same(&to_upstream, &frame_upstream, publisher, "upstream");
    let sent: Vec<_> = methods(&to_upstream)
        .into_iter()
        .map(|(channel, method)| match method {
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => {
                (channel, format!("publish {}", p.exchange))
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                (channel, format!("ack {} {}", a.delivery_tag, a.multiple))
            }
            other => (channel, format!("{other:?}")),
        })
        .collect();
    let dead_letter = sent
        .iter()
        .find(|(channel, _)| *channel != 1)
        .expect("the dead letter goes on the proxy's channel")
        .clone();
    assert_eq!(dead_letter.1, "publish dlx");
    let on_client_channel: Vec<_> = sent
        .iter()
        .filter(|(channel, _)| *channel == 1)
        .map(|(_, what)| what.as_str())
        .collect();
    assert_eq!(
        on_client_channel,
        [
            "publish ",
            "ack 8 false",
            "ack 7 false",
            "ack 10 false",
            "ack 11 false",
            "publish "
        ]
    );
    assert_eq!(kept(&by_frame), kept(&by_run));
}

#[tokio::test]
async fn a_publish_with_bcc_keys_is_rewritten_as_when_handled_alone() {
    let (mut by_frame, mut by_run) = twins(&[]).await;
    let mut headers = FieldTable::default();
    headers.insert(
        "BCC".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
            "audit".into(),
        )])),
    );
    let traffic = joined(&[
        publish(b"one", &BasicProperties::default()),
        publish(b"two", &BasicProperties::default().with_headers(headers)),
        publish(b"three", &BasicProperties::default()),
    ]);
    by_frame.client_sends(traffic.clone());
    let taken = in_runs(&mut by_run, &traffic, true);
    assert!(taken > 0 && taken < traffic.len(), "{taken}");
    let (to_client, to_upstream) = queued(&mut by_run);
    assert_eq!((to_client, to_upstream.clone()), queued(&mut by_frame));
    assert_ne!(to_upstream, traffic, "the BCC header is rewritten");
    assert_eq!(frames(&to_upstream).len(), frames(&traffic).len());
}

#[tokio::test]
async fn a_malformed_frame_ends_the_run_and_gets_frame_error() {
    let (mut by_frame, mut by_run) = twins(&[]).await;
    let mut bad = BytesMut::new();
    put_raw_frame(&mut bad, FRAME_BODY, 1, b"xyz");
    let end = bad.len() - 1;
    bad[end] = 0;
    let traffic = joined(&[publish(b"fine", &BasicProperties::default()), bad.freeze()]);
    let good = publish(b"fine", &BasicProperties::default()).len();
    assert_eq!(in_runs(&mut by_run, &traffic, true), good);
    let mut codec = WireCodec::new(FRAME_MAX as u32);
    let mut buf = BytesMut::from(&traffic[..]);
    while let Some(frame) = codec.decode(&mut buf).transpose() {
        let failed = frame.is_err();
        by_frame.session.client_read(Some(frame), by_frame.now);
        if failed {
            break;
        }
    }
    let (to_client, to_upstream) = queued(&mut by_run);
    assert_eq!((to_client.clone(), to_upstream), queued(&mut by_frame));
    match &methods(&to_client)[..] {
        [(0, AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)))] => {
            assert_eq!(c.reply_code, reply::FRAME_ERROR)
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_frame_too_large_to_copy_goes_on_its_own() {
    let (mut by_frame, mut by_run) = twins(&[]).await;
    let mut large = BytesMut::new();
    large.extend_from_slice(&publish(b"small", &BasicProperties::default()));
    let publish_method = frames(&publish(b"", &BasicProperties::default()))[0]
        .raw
        .clone();
    large.extend_from_slice(&publish_method);
    let body = vec![7u8; 100_000];
    put_content(
        &mut large,
        1,
        &encode_properties(&BasicProperties::default()),
        &body,
        FRAME_MAX,
    );
    let traffic = large.freeze();
    let body_frame = 100_000 + 8;
    by_frame.client_sends(traffic.clone());
    // Everything but the large body frame goes in runs.
    assert_eq!(
        in_runs(&mut by_run, &traffic, true),
        traffic.len() - body_frame
    );
    let (to_client, to_upstream) = queued(&mut by_run);
    assert_eq!((to_client, to_upstream.clone()), queued(&mut by_frame));
    assert_eq!(to_upstream, traffic);
}

#[tokio::test]
async fn runs_stop_at_a_full_outbox_and_at_the_inflight_bound() {
    let (mut h, _) = consuming(&[]).await;
    queued(&mut h);
    let limit = h.session.shared.outbox_bytes;
    h.session.upstream_out.send(Bytes::from(vec![0u8; limit]));
    let traffic = publish(b"held", &BasicProperties::default());
    let mut unread = BytesMut::from(&traffic[..]);
    assert_eq!(h.session.client_run(&mut unread, FRAME_MAX, 256), 0);
    assert_eq!(unread, traffic, "a run that takes nothing leaves the bytes");
    queued(&mut h);
    assert_eq!(
        h.session.client_run(&mut unread, FRAME_MAX, 256),
        traffic.len()
    );
    assert!(unread.is_empty(), "the run is cut from the read buffer");

    let max = h.session.shared.max_inflight_bytes;
    h.session.inflight_bytes = max;
    let next = delivery(1, 8, "q");
    let mut unread = BytesMut::from(&next[..]);
    assert_eq!(h.session.upstream_run(&mut unread, FRAME_MAX, 256), 0);
    h.session.inflight_bytes = 0;
    assert_eq!(
        h.session.upstream_run(&mut unread, FRAME_MAX, 256),
        next.len()
    );
    // The run takes no more frames than it is allowed.
    let two = joined(&[delivery(1, 9, "q"), delivery(1, 10, "q")]);
    assert_eq!(
        h.session
            .upstream_run(&mut BytesMut::from(&two[..]), FRAME_MAX, 3),
        delivery(1, 9, "q").len()
    );
}

/// A deterministic stream of numbers for the traffic below (xorshift64*).
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}

/// Feeds `bytes` to the session in reads of random sizes (frames cut anywhere). Returns the
/// bytes the runs took.
fn in_random_reads(h: &mut Harness, bytes: &[u8], from_client: bool, dice: &mut Dice) -> usize {
    let mut buf = BytesMut::new();
    let mut rest = bytes;
    let mut by_runs = 0;
    while !rest.is_empty() {
        let n = (1 + dice.below(300) as usize).min(rest.len());
        buf.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        by_runs += drain(h, &mut buf, from_client);
    }
    assert!(buf.is_empty(), "every frame was complete in the end");
    by_runs
}

#[tokio::test]
async fn random_traffic_in_random_reads_gives_the_same_bytes_as_frame_by_frame() {
    let dlx = [(
        "x-dead-letter-exchange",
        AMQPValue::LongString("dlx".into()),
    )];
    let (mut total, mut by_runs) = (0, 0);
    for seed in 1..=24u64 {
        let arguments: &[(&str, AMQPValue)] = if seed % 2 == 0 { &dlx } else { &[] };
        let (mut by_frame, mut by_run, publisher) = twins_publishing(arguments).await;
        let mut dice = Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut next_tag = 8;
        for step in 0..40 {
            let mut from_upstream = Vec::new();
            for _ in 0..dice.below(4) {
                from_upstream.push(delivery(1, next_tag, "q"));
                next_tag += 1;
            }
            let mut from_client = Vec::new();
            for _ in 0..dice.below(6) {
                let tag = 7 + dice.below(next_tag - 7);
                match dice.below(6) {
                    0 | 1 => {
                        let size = dice.below(200) as usize;
                        from_client.push(publish(&vec![b'p'; size], &BasicProperties::default()));
                    }
                    2 | 3 => from_client.push(ack(tag, false)),
                    4 => from_client.push(ack(tag, true)),
                    _ => from_client.push(reject(tag)),
                }
            }
            let (from_upstream, from_client) = (joined(&from_upstream), joined(&from_client));
            by_frame.upstream_sends(from_upstream.clone());
            by_frame.client_sends(from_client.clone());
            by_runs += in_random_reads(&mut by_run, &from_upstream, false, &mut dice);
            by_runs += in_random_reads(&mut by_run, &from_client, true, &mut dice);
            total += from_upstream.len() + from_client.len();
            let context = format!("seed {seed}, step {step}");
            let (run_client, run_upstream) = queued(&mut by_run);
            let (frame_client, frame_upstream) = queued(&mut by_frame);
            assert_same(&run_client, &frame_client, publisher, &context);
            assert_same(&run_upstream, &frame_upstream, publisher, &context);
            assert_eq!(kept(&by_frame), kept(&by_run), "{context}");
            assert_eq!(counted(&by_frame), counted(&by_run), "{context}");
        }
    }
    // Most of it went in runs, the rest on its own (rejects, frames cut by a read).
    assert!(by_runs * 2 > total, "{by_runs} of {total} bytes in runs");
}
