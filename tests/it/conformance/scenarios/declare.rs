//! Declaration errors: which dead-letter, TTL and length arguments a queue.declare refuses
//! (406, per argument), and when a redeclare is equivalent.

use amq_protocol::types::{AMQPValue, DecimalValue, FieldTable};
use lapin::options::QueueDeclareOptions;
use serde_json::{Map, Value};

use super::{Ctx, Outcome, int, long, ls, none, scenarios, table};

scenarios! {
    declare_invalid_arguments: "queue.declare with invalid DLX/TTL/length arguments -> channel close 406 (per argument)",
    redeclare_different_dlx: "redeclaring a queue with a different/absent x-dead-letter-exchange or DLRK -> 406; same args -> ok",
}

/// Declares queue `case<i>` (a quorum queue when `quorum`) with each case's arguments, each on
/// its own channel; the outcome of each by label.
pub async fn declare_cases(t: &mut Ctx, cases: Vec<(&str, FieldTable)>, quorum: bool) -> Value {
    let mut results = Map::new();
    for (i, (label, args)) in cases.into_iter().enumerate() {
        let result = async {
            let ch = t.plain_channel().await?;
            let local = format!("case{i}");
            if quorum {
                t.qq(&ch, &local, args).await?;
            } else {
                t.queue(&ch, &local, args).await?;
            }
            ch.close(200, "done".into()).await?;
            Ok(())
        }
        .await;
        let v = t.outcome(result);
        results.insert(label.to_string(), v);
    }
    Value::Object(results)
}

async fn declare_invalid_arguments(t: &mut Ctx) -> Outcome {
    let dlx = t.n("dlx");
    let one = |k: &str, v: AMQPValue| table(&[(k, v)]);
    let cases = vec![
        (
            "x-message-ttl='1000' (string)",
            one("x-message-ttl", ls("1000")),
        ),
        ("x-message-ttl=-1", one("x-message-ttl", int(-1))),
        ("x-message-ttl=2^32", one("x-message-ttl", long(1 << 32))),
        ("x-message-ttl=0", one("x-message-ttl", int(0))),
        (
            "x-message-ttl=1.5 (decimal)",
            one(
                "x-message-ttl",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 1,
                    value: 15,
                }),
            ),
        ),
        ("x-max-length=-1", one("x-max-length", int(-1))),
        ("x-max-length='10' (string)", one("x-max-length", ls("10"))),
        ("x-max-length=0", one("x-max-length", int(0))),
        ("x-max-length-bytes=-1", one("x-max-length-bytes", int(-1))),
        ("x-overflow='bogus'", one("x-overflow", ls("bogus"))),
        ("x-overflow=1 (int)", one("x-overflow", int(1))),
        ("x-expires=0", one("x-expires", int(0))),
        ("x-expires=-5", one("x-expires", int(-5))),
        (
            "x-dead-letter-exchange=42 (int)",
            one("x-dead-letter-exchange", int(42)),
        ),
        (
            "x-dead-letter-exchange='' (default)",
            one("x-dead-letter-exchange", ls("")),
        ),
        (
            "x-dead-letter-routing-key without DLX",
            one("x-dead-letter-routing-key", ls("k")),
        ),
        (
            "x-dead-letter-routing-key=42 (int)",
            table(&[
                ("x-dead-letter-exchange", ls(&dlx)),
                ("x-dead-letter-routing-key", int(42)),
            ]),
        ),
        (
            "x-delivery-limit on classic queue",
            one("x-delivery-limit", int(2)),
        ),
        ("x-queue-type='bogus'", one("x-queue-type", ls("bogus"))),
    ];
    let v = declare_cases(t, cases, false).await;
    t.set("results", v);
    Ok(())
}

async fn redeclare_different_dlx(t: &mut Ctx) -> Outcome {
    let ch = t.plain_channel().await?;
    let (a, b) = (t.n("dlxA"), t.n("dlxB"));
    let ttl = |n: i32| ("x-message-ttl", int(n));
    t.queue(
        &ch,
        "src",
        table(&[("x-dead-letter-exchange", ls(&a)), ttl(1000)]),
    )
    .await?;
    let cases = vec![
        (
            "same args",
            table(&[("x-dead-letter-exchange", ls(&a)), ttl(1000)]),
        ),
        (
            "same args, ttl as int64",
            table(&[
                ("x-dead-letter-exchange", ls(&a)),
                ("x-message-ttl", long(1000)),
            ]),
        ),
        (
            "different DLX",
            table(&[("x-dead-letter-exchange", ls(&b)), ttl(1000)]),
        ),
        ("DLX omitted", table(&[ttl(1000)])),
        ("no arguments at all", none()),
        (
            "DLRK added",
            table(&[
                ("x-dead-letter-exchange", ls(&a)),
                ttl(1000),
                ("x-dead-letter-routing-key", ls("k")),
            ]),
        ),
        (
            "different ttl",
            table(&[("x-dead-letter-exchange", ls(&a)), ttl(2000)]),
        ),
    ];
    let mut results = Map::new();
    for (label, args) in cases {
        let result = async {
            let c = t.plain_channel().await?;
            t.queue(&c, "src", args).await?;
            c.close(200, "done".into()).await?;
            Ok(())
        }
        .await;
        let v = t.outcome(result);
        results.insert(label.to_string(), v);
    }
    let result = async {
        let c = t.plain_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        t.queue_with(&c, "src", none(), passive).await?;
        c.close(200, "done".into()).await?;
        Ok(())
    }
    .await;
    let v = t.outcome(result);
    results.insert("passive".into(), v);
    t.set("results", Value::Object(results));
    Ok(())
}
