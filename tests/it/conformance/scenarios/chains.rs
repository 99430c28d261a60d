//! Chains, cycles and x-death bookkeeping: two hops, a repeated {queue, reason} entry, cycle
//! detection (TTL self-loop, two TTL queues, a loop with a rejection), and x-death or
//! x-first-death headers a client sent itself.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};
use lapin::options::BasicAckOptions;
use lapin::{BasicProperties, ExchangeKind};
use serde_json::Value;

use super::{
    Ctx, Outcome, get_and_reject, int, long, ls, ls_array, none, reject, scenarios, standard, table,
};

scenarios! {
    two_hop_chain: "q1 -reject-> dlx1 -> q2 -ttl-> dlx2 -> q3: x-death has 2 entries (newest first), x-first-death-* from hop 1",
    same_queue_reason_twice_increments: "reject cycle qA->dlxA->qB->dlxB->qA: repeated {queue,reason} increments count and moves entry to front",
    cycle_ttl_self_dropped: "TTL queue dead-lettering to '' without DLRK (back to itself): cycle detected, message dropped",
    cycle_ttl_two_queues_dropped: "q1 -ttl-> q2 -ttl-> q1 with no rejection: dropped when it would re-enter q1 (observers see each hop)",
    cycle_with_rejection_not_dropped: "qA -reject-> qB -ttl-> qA: cycle contains a rejection so it is NOT dropped; counts increment",
    client_xdeath_unrelated: "client-supplied x-death (other queue): new entry prepended, client entry untouched, no x-first-death-* added",
    client_xdeath_matching_entry: "client x-death entry matching {queue,reason}: its count (int32 'I') is incremented in place and moved to front",
    client_xdeath_duplicate_entries: "client x-death with duplicate {queue,reason} entries: legacy grouping keeps only the first of each",
    client_xfirstdeath_without_xdeath: "client sets x-first-death-reason but no x-death: observe whether broker overwrites/duplicates it",
}

/// 2020-01-01T00:00:00Z, the time of every client-made x-death entry.
const OLD_TIME: u64 = 1_577_836_800;

async fn two_hop_chain(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx1 = t.exchange(&ch, "dlx1", ExchangeKind::Direct).await?;
    let dlx2 = t.exchange(&ch, "dlx2", ExchangeKind::Direct).await?;
    let q3 = t.queue(&ch, "q3", none()).await?;
    t.bind(&ch, &q3, &dlx2, "hop2").await?;
    let q2_args = table(&[
        ("x-dead-letter-exchange", ls(&dlx2)),
        ("x-dead-letter-routing-key", ls("hop2")),
        ("x-message-ttl", int(50)),
    ]);
    let q2 = t.queue(&ch, "q2", q2_args).await?;
    t.bind(&ch, &q2, &dlx1, "rk").await?;
    let q1 = t
        .queue(&ch, "q1", table(&[("x-dead-letter-exchange", ls(&dlx1))]))
        .await?;
    t.bind(&ch, &q1, &x, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &q1).await?;
    t.record("q3", &ch, &q3, 1).await?;
    Ok(())
}

async fn same_queue_reason_twice_increments(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlxa = t.exchange(&ch, "dlxA", ExchangeKind::Fanout).await?;
    let dlxb = t.exchange(&ch, "dlxB", ExchangeKind::Fanout).await?;
    let qa = t
        .queue(&ch, "qA", table(&[("x-dead-letter-exchange", ls(&dlxa))]))
        .await?;
    let qb = t
        .queue(&ch, "qB", table(&[("x-dead-letter-exchange", ls(&dlxb))]))
        .await?;
    t.bind(&ch, &qa, &x, "rk").await?;
    t.bind(&ch, &qb, &dlxa, "").await?;
    t.bind(&ch, &qa, &dlxb, "").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    let mut hops = Vec::new();
    for q in [&qa, &qb, &qa, &qb] {
        match t.get1(&ch, q).await? {
            None => {
                hops.push(Value::Null);
                break;
            }
            Some(d) => {
                hops.push(t.msg_from(&d, q)?);
                reject(&ch, d.delivery_tag).await?;
            }
        }
    }
    if let Some(d) = t.get1(&ch, &qa).await? {
        hops.push(t.msg_from(&d, &qa)?);
        ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
            .await?;
    }
    t.set("hops", hops);
    Ok(())
}

async fn cycle_ttl_self_dropped(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[
        ("x-message-ttl", int(50)),
        ("x-dead-letter-exchange", ls("")),
    ]);
    let q = t.queue(&ch, "q", args).await?;
    t.record_publish(&ch, "", &q, "m1").await;
    // Wait (passive declare, which does not consume) until the message left the queue, then
    // make sure it never comes back: a looping implementation would keep re-enqueueing it.
    let left = t.wait_count(&q, 0, 3.0).await?;
    t.set("left_queue", left);
    t.record_quiet("queue_after", &ch, &q, 0, 0.5).await?;
    Ok(())
}

async fn cycle_ttl_two_queues_dropped(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let dlx1 = t.exchange(&ch, "dlx1", ExchangeKind::Fanout).await?;
    let dlx2 = t.exchange(&ch, "dlx2", ExchangeKind::Fanout).await?;
    let o1 = t.queue(&ch, "obs1", none()).await?;
    let o2 = t.queue(&ch, "obs2", none()).await?;
    let q1_args = table(&[
        ("x-message-ttl", int(50)),
        ("x-dead-letter-exchange", ls(&dlx1)),
    ]);
    let q1 = t.queue(&ch, "q1", q1_args).await?;
    let q2_args = table(&[
        ("x-message-ttl", int(50)),
        ("x-dead-letter-exchange", ls(&dlx2)),
    ]);
    let q2 = t.queue(&ch, "q2", q2_args).await?;
    t.bind(&ch, &q2, &dlx1, "").await?;
    t.bind(&ch, &o1, &dlx1, "").await?;
    t.bind(&ch, &q1, &dlx2, "").await?;
    t.bind(&ch, &o2, &dlx2, "").await?;
    t.record_publish(&ch, "", &q1, "m1").await;
    t.record_quiet("obs1", &ch, &o1, 1, 0.5).await?;
    t.record_quiet("obs2", &ch, &o2, 1, 0.5).await?;
    t.record_quiet("q1_after", &ch, &q1, 0, 0.1).await?;
    t.record_quiet("q2_after", &ch, &q2, 0, 0.1).await?;
    Ok(())
}

async fn cycle_with_rejection_not_dropped(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let dlxa = t.exchange(&ch, "dlxA", ExchangeKind::Fanout).await?;
    let qa_name = t.n("qA");
    let qb_args = table(&[
        ("x-message-ttl", int(50)),
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls(&qa_name)),
    ]);
    let qb = t.queue(&ch, "qB", qb_args).await?;
    let qa = t
        .queue(&ch, "qA", table(&[("x-dead-letter-exchange", ls(&dlxa))]))
        .await?;
    t.bind(&ch, &qb, &dlxa, "").await?;
    t.record_publish(&ch, "", &qa, "m1").await;
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let Some(d) = t.get1(&ch, &qa).await? else {
            rounds.push(Value::Null);
            break;
        };
        rounds.push(t.msg(&d)?);
        if rounds.len() < 3 {
            reject(&ch, d.delivery_tag).await?;
        } else {
            ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
                .await?;
        }
    }
    t.set("arrivals_in_qA", rounds);
    Ok(())
}

/// One client-made x-death entry (time 2020-01-01, routing-keys `[rk]`), plus `extra` fields.
fn entry(
    count: Option<AMQPValue>,
    reason: &str,
    queue: &str,
    exchange: &str,
    rk: &str,
    extra: &[(&str, AMQPValue)],
) -> AMQPValue {
    let mut fields = vec![
        ("reason", ls(reason)),
        ("queue", ls(queue)),
        ("time", AMQPValue::Timestamp(OLD_TIME)),
        ("exchange", ls(exchange)),
        ("routing-keys", ls_array(&[rk])),
    ];
    if let Some(count) = count {
        fields.push(("count", count));
    }
    fields.extend(extra.iter().cloned());
    AMQPValue::FieldTable(table(&fields))
}

fn x_death(entries: Vec<AMQPValue>) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(entries))
}

/// Publishes m1 with `headers` through the standard topology, rejects it, collects the DLQ.
async fn publish_reject_collect(t: &mut Ctx, headers: impl FnOnce(&str) -> FieldTable) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    let props = BasicProperties::default().with_headers(headers(&s.src));
    let p = t.publish_with(&ch, &s.x, "rk", b"m1", props).await;
    t.set("publish", p);
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn client_xdeath_unrelated(t: &mut Ctx) -> Outcome {
    publish_reject_collect(t, |_| {
        let e = entry(
            Some(long(3)),
            "expired",
            "elsewhere",
            "old-ex",
            "old-rk",
            &[],
        );
        table(&[("x-death", x_death(vec![e]))])
    })
    .await
}

async fn client_xdeath_matching_entry(t: &mut Ctx) -> Outcome {
    publish_reject_collect(t, |src| {
        let other = entry(Some(long(2)), "expired", "other", "e1", "k1", &[]);
        let matching = entry(
            Some(int(5)),
            "rejected",
            src,
            "old-ex",
            "old-rk",
            &[("original-expiration", ls("999"))],
        );
        table(&[
            ("x-death", x_death(vec![other, matching])),
            ("x-first-death-queue", ls("client-set")),
        ])
    })
    .await
}

async fn client_xdeath_duplicate_entries(t: &mut Ctx) -> Outcome {
    publish_reject_collect(t, |_| {
        let first = entry(Some(long(2)), "expired", "other", "e1", "k1", &[]);
        let second = entry(Some(long(7)), "expired", "other", "e2", "k1", &[]);
        let third = entry(None, "maxlen", "third", "e3", "k3", &[]);
        table(&[("x-death", x_death(vec![first, second, third]))])
    })
    .await
}

async fn client_xfirstdeath_without_xdeath(t: &mut Ctx) -> Outcome {
    publish_reject_collect(t, |_| table(&[("x-first-death-reason", ls("client"))])).await
}
