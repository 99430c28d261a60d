//! Unit tests of [`crate::proxy::readback`].

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
        retry_delays: None,
    }
    .encode()
    .unwrap();
    let mut read = ReadBack::new("q", "/", CAPTURE).unwrap();
    let second = declared(read.on_declare_ok());
    assert!(!second.passive);
    let third = declared(read.on_close(406, &refusal("durable", "'false' but current is 'true'")));
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

/// A listing as `GET /api/queues/{vhost}/{name}` gives its `arguments`.
fn listing(json: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match json {
        serde_json::Value::Object(map) => map,
        other => panic!("{other}"),
    }
}

#[test]
fn a_management_listing_reads_a_proxy_queue_whatever_the_length_of_its_names() {
    let long = "d".repeat(200);
    let tag = CaptureTag {
        dead_letter_exchange: Some(long.clone()),
        dead_letter_routing_key: None,
        delivery_limit: Some(2),
        retry_delays: None,
    };
    let queue = "q".repeat(200);
    let read = ReadBack::new(&queue, "/", CAPTURE).unwrap();
    let listed = listing(serde_json::json!({
        "x-dead-letter-exchange": CAPTURE,
        "x-dead-letter-routing-key": tag.encode().unwrap(),
        "x-message-ttl": 60000,
    }));
    let ReadOutcome::Learned(VerifiedQueue::Proxied(args)) = read.from_listing(Some(&listed))
    else {
        panic!("not read as a proxy queue");
    };
    assert_eq!(args.dead_letter_exchange.as_deref(), Some(long.as_str()));
    assert_eq!(args.delivery_limit, Some(2));
    assert_eq!(args.message_ttl, Some(60000));
}

#[test]
fn a_management_listing_reads_an_upstream_owned_queue_a_stream_or_a_missing_one() {
    let read = || ReadBack::new("q", "/", CAPTURE).unwrap();
    let listed = listing(serde_json::json!({
        "x-dead-letter-exchange": "dlx",
        "x-queue-type": "quorum",
        "x-delivery-limit": 5,
    }));
    let ReadOutcome::Learned(VerifiedQueue::UpstreamOwned(args)) =
        read().from_listing(Some(&listed))
    else {
        panic!("not upstream-owned");
    };
    assert_eq!(args.dead_letter_exchange.as_deref(), Some("dlx"));
    assert_eq!(args.queue_type, QueueType::Quorum);
    assert_eq!(args.delivery_limit, Some(5));
    let stream = listing(serde_json::json!({"x-queue-type": "stream"}));
    assert_eq!(
        read().from_listing(Some(&stream)),
        ReadOutcome::Learned(VerifiedQueue::PassedThrough)
    );
    assert_eq!(read().from_listing(None), ReadOutcome::Missing);
    // What RabbitMQ would refuse, or a tag that does not decode, is not guessed at.
    let bad = listing(serde_json::json!({"x-max-length": "many"}));
    assert_eq!(read().from_listing(Some(&bad)), ReadOutcome::Unknown);
    let bad_tag = listing(serde_json::json!({
        "x-dead-letter-exchange": CAPTURE,
        "x-dead-letter-routing-key": "dlx-proxy:{not json",
    }));
    assert_eq!(read().from_listing(Some(&bad_tag)), ReadOutcome::Unknown);
}
