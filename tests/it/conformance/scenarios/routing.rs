//! Routing of dead-lettered messages: the dead-letter routing key, CC and BCC, topic, fanout,
//! direct and default-exchange DLXs, a missing or unbound DLX, a quorum DLQ.

use amq_protocol::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};

use super::{
    Ch, Ctx, Failure, Outcome, get_and_reject, ls, ls_array, none, scenarios, source, standard,
    standard_with, table,
};

scenarios! {
    dlrk_overrides_routing_key: "x-dead-letter-routing-key replaces the routing key; x-death keeps the original keys",
    no_dlrk_keeps_routing_key: "without x-dead-letter-routing-key the original routing key is used on the DLX",
    cc_without_dlrk: "CC header, no DLRK: dead-lettered with all original keys (incl. CC); x-death routing-keys include CC",
    cc_with_dlrk: "CC header with DLRK: routed only by DLRK, CC header removed, x-death routing-keys keep original+CC",
    bcc_header: "BCC header: stripped on publish, excluded from x-death routing-keys, (observe) whether DL routing uses it",
    cc_and_bcc_with_dlrk: "CC+BCC headers with DLRK: only DLRK used for routing, CC removed, x-death routing-keys = key+CC",
    dlx_topic: "topic exchange as DLX routes on the original key ('orders.created' -> orders.# and *.created)",
    dlx_fanout: "fanout exchange as DLX delivers to every bound queue, original routing key kept",
    dlx_direct: "direct exchange as DLX: all queues bound with the key get a copy, others none",
    dlx_default_exchange: "DLX '' (default exchange) with DLRK naming a queue delivers there",
    dlx_missing_exchange: "DLX that does not exist: message silently dropped, channel stays open",
    dlx_declared_after_queue: "queue declared with a DLX name before the exchange exists; DL works once it is declared",
    dlx_no_binding_no_return: "DLX exists but nothing bound: message dropped; no basic.return to the (mandatory) publisher",
    dlq_is_quorum: "dead-lettering from a classic queue into a quorum DLQ keeps the same x-death",
}

async fn dlrk_overrides_routing_key(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let args = table(&[("x-dead-letter-routing-key", ls("dl-key"))]);
    let s = standard_with(t, &ch, args, &["dl-key"], "rk", false).await?;
    let orig = t.queue(&ch, "orig-key-q", none()).await?;
    t.bind(&ch, &orig, &s.dlx, "rk").await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    t.record_quiet("queue_bound_to_original_key", &ch, &orig, 0, 0.2)
        .await?;
    Ok(())
}

async fn no_dlrk_keeps_routing_key(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard_with(t, &ch, none(), &["orig.key"], "orig.key", false).await?;
    t.record_publish(&ch, &s.x, "orig.key", "m1").await;
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

/// The CC/BCC topology: direct `x` → `src` (key `a`) dead-lettering to direct `dlx`, which
/// routes keys a, b, c, z to queues dlq-a, dlq-b, dlq-c, dlq-z.
struct CcSetup {
    x: String,
    queues: Vec<(&'static str, String)>,
    src: String,
}

async fn cc_setup(t: &mut Ctx, ch: &Ch, src_args: FieldTable) -> Result<CcSetup, Failure> {
    let x = t.exchange(ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(ch, "dlx", ExchangeKind::Direct).await?;
    let mut queues = Vec::new();
    for k in ["a", "b", "c", "z"] {
        let q = t.queue(ch, &format!("dlq-{k}"), none()).await?;
        t.bind(ch, &q, &dlx, k).await?;
        queues.push((k, q));
    }
    let mut args = table(&[("x-dead-letter-exchange", ls(&dlx))]);
    for (k, v) in src_args.inner() {
        args.insert(k.clone(), v.clone());
    }
    let src = t.queue(ch, "src", args).await?;
    t.bind(ch, &src, &x, "a").await?;
    Ok(CcSetup { x, queues, src })
}

/// Collects `dlq_<k>` for each CC queue, expecting one message in the queues of `full`.
async fn collect_cc(t: &mut Ctx, ch: &Ch, setup: &CcSetup, full: &[&str]) -> Outcome {
    for (k, q) in &setup.queues {
        let expect = usize::from(full.contains(k));
        let v = t.collect_quiet(ch, q, expect, 0.2).await?;
        t.set(&format!("dlq_{k}"), v);
    }
    Ok(())
}

/// Publishes m1 with `headers` to the CC topology, records the source message when
/// `record_source`, rejects it and collects every DLQ.
async fn cc_case(
    t: &mut Ctx,
    src_args: FieldTable,
    headers: FieldTable,
    record_source: bool,
    full: &[&str],
) -> Outcome {
    let ch = t.channel().await?;
    let setup = cc_setup(t, &ch, src_args).await?;
    let props = BasicProperties::default().with_headers(headers);
    let p = t.publish_with(&ch, &setup.x, "a", b"m1", props).await;
    t.set("publish", p);
    let g = t.get1(&ch, &setup.src).await?;
    if record_source {
        let v = t.msg_or_null(g.as_ref())?;
        t.set("source_message", v);
    }
    if let Some(d) = &g {
        super::reject(&ch, d.delivery_tag).await?;
    }
    collect_cc(t, &ch, &setup, full).await
}

async fn cc_without_dlrk(t: &mut Ctx) -> Outcome {
    let headers = table(&[("CC", ls_array(&["b"]))]);
    cc_case(t, none(), headers, true, &["a", "b"]).await
}

async fn cc_with_dlrk(t: &mut Ctx) -> Outcome {
    let args = table(&[("x-dead-letter-routing-key", ls("z"))]);
    let headers = table(&[("CC", ls_array(&["b"]))]);
    cc_case(t, args, headers, false, &["z"]).await
}

async fn bcc_header(t: &mut Ctx) -> Outcome {
    let headers = table(&[("BCC", ls_array(&["c"])), ("keep", ls("yes"))]);
    cc_case(t, none(), headers, true, &["a"]).await
}

async fn cc_and_bcc_with_dlrk(t: &mut Ctx) -> Outcome {
    let args = table(&[("x-dead-letter-routing-key", ls("z"))]);
    let headers = table(&[("CC", ls_array(&["b"])), ("BCC", ls_array(&["c"]))]);
    cc_case(t, args, headers, false, &["z"]).await
}

async fn dlx_topic(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Topic).await?;
    let mut queues = Vec::new();
    for (local, pattern) in [
        ("hash", "orders.#"),
        ("star", "*.created"),
        ("miss", "payments.*"),
    ] {
        let q = t.queue(&ch, &format!("dlq-{local}"), none()).await?;
        t.bind(&ch, &q, &dlx, pattern).await?;
        queues.push((local, q));
    }
    let src = source(t, &ch, &x, &dlx, "orders.created").await?;
    t.record_publish(&ch, &x, "orders.created", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    queues.sort();
    for (local, q) in &queues {
        let expect = usize::from(*local != "miss");
        t.record_quiet(&format!("dlq_{local}"), &ch, q, expect, 0.2)
            .await?;
    }
    Ok(())
}

async fn dlx_fanout(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Fanout).await?;
    let q1 = t.queue(&ch, "dlq1", none()).await?;
    let q2 = t.queue(&ch, "dlq2", none()).await?;
    t.bind(&ch, &q1, &dlx, "ignored").await?;
    t.bind(&ch, &q2, &dlx, "").await?;
    let src = source(t, &ch, &x, &dlx, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dlq1", &ch, &q1, 1).await?;
    t.record("dlq2", &ch, &q2, 1).await?;
    Ok(())
}

async fn dlx_direct(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    let dlq2 = t.queue(&ch, "dlq2", none()).await?;
    let other = t.queue(&ch, "other", none()).await?;
    t.bind(&ch, &dlq2, &s.dlx, "rk").await?;
    t.bind(&ch, &other, &s.dlx, "other").await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    get_and_reject(t, &ch, &s.src).await?;
    t.record("dlq", &ch, &s.dlq, 1).await?;
    t.record("dlq2", &ch, &dlq2, 1).await?;
    t.record_quiet("other", &ch, &other, 0, 0.2).await?;
    Ok(())
}

async fn dlx_default_exchange(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlq = t.queue(&ch, "dlq", none()).await?;
    let args = table(&[
        ("x-dead-letter-exchange", ls("")),
        ("x-dead-letter-routing-key", ls(&dlq)),
    ]);
    let src = t.queue(&ch, "src", args).await?;
    t.bind(&ch, &src, &x, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dead_lettered", &ch, &dlq, 1).await?;
    Ok(())
}

async fn dlx_missing_exchange(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let missing = t.n("no-such-dlx");
    let src = source(t, &ch, &x, &missing, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record_quiet("source_after", &ch, &src, 0, 0.3).await?;
    t.set("channel_open", ch.status().connected());
    let p = t.publish(&ch, &x, "rk", "m2").await;
    t.set("publish_after", p);
    let n = t.count(&src).await;
    t.set("source_count_after_second_publish", n);
    // Creating the exchange later does not resurrect the dropped message.
    let dlx = t.exchange(&ch, "no-such-dlx", ExchangeKind::Fanout).await?;
    let late = t.queue(&ch, "late", none()).await?;
    t.bind(&ch, &late, &dlx, "").await?;
    t.record_quiet("late_queue", &ch, &late, 0, 0.2).await?;
    Ok(())
}

async fn dlx_declared_after_queue(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx_name = t.n("dlx");
    let src = source(t, &ch, &x, &dlx_name, "rk").await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Direct).await?;
    let dlq = t.queue(&ch, "dlq", none()).await?;
    t.bind(&ch, &dlq, &dlx, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dead_lettered", &ch, &dlq, 1).await?;
    Ok(())
}

async fn dlx_no_binding_no_return(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Direct).await?;
    let src = source(t, &ch, &x, &dlx, "rk").await?;
    let pch = t.channel().await?;
    let (p, mut returns) = t
        .publish_full(&pch, &x, "rk", b"m1", BasicProperties::default(), true)
        .await;
    t.set("publish", p);
    get_and_reject(t, &ch, &src).await?;
    // A basic.return for the dead letter would come after the confirm: give it time to come.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    // lapin hands a return that no publish is waiting for to the next confirm of the channel.
    let (_, late) = t
        .publish_full(
            &pch,
            "",
            &t.n("no-such-queue"),
            b"probe",
            BasicProperties::default(),
            false,
        )
        .await;
    returns.extend(late);
    t.set("returns", returns);
    t.record_quiet("source_after", &ch, &src, 0, 0.1).await?;
    t.set("publisher_channel_open", pch.status().connected());
    Ok(())
}

async fn dlq_is_quorum(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Direct).await?;
    let dlq = t.qq(&ch, "dlq", none()).await?;
    t.bind(&ch, &dlq, &dlx, "rk").await?;
    let src = source(t, &ch, &x, &dlx, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dead_lettered", &ch, &dlq, 1).await?;
    Ok(())
}
