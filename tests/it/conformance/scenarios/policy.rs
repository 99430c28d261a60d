//! Policies (set through the target's own means before the queue is declared): a policy DLX,
//! argument over policy, a policy dead-letter routing key, and the lower of policy and
//! argument TTL and max-length winning.

use lapin::ExchangeKind;
use serde_json::json;

use super::{
    Ctx, Outcome, exactly, get_and_reject, int, ls, none, re_escape, scenarios, source, standard,
    table,
};

scenarios! {
    policy_dead_letter_exchange: "policy dead-letter-exchange applies to a queue declared without DLX arguments",
    policy_vs_argument_dlx: "x-dead-letter-exchange argument takes precedence over a policy dead-letter-exchange",
    policy_dead_letter_routing_key: "policy dead-letter-routing-key (with policy DLX) rewrites the key; an argument DLRK overrides it",
    policy_message_ttl_min_wins: "policy message-ttl 100 vs argument x-message-ttl 60000: the lower value wins",
    policy_max_length_min_wins: "policy max-length 1 vs argument x-max-length 5: the lower value wins (head dead-lettered 'maxlen')",
}

async fn policy_dead_letter_exchange(t: &mut Ctx) -> Outcome {
    let (pattern, dlx) = (exactly(&t.n("src")), t.n("dlx"));
    t.policy("dlx", &pattern, json!({"dead-letter-exchange": dlx}))
        .await?;
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    // Redeclare src without the DLX argument: delete and recreate.
    ch.queue_delete(s.src.as_str().into(), Default::default())
        .await?;
    let src = t.queue(&ch, "src", none()).await?;
    t.bind(&ch, &src, &s.x, "rk").await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn policy_vs_argument_dlx(t: &mut Ctx) -> Outcome {
    let (pattern, dlx_pol) = (exactly(&t.n("src")), t.n("dlx-pol"));
    t.policy("dlx", &pattern, json!({"dead-letter-exchange": dlx_pol}))
        .await?;
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx_pol = t.exchange(&ch, "dlx-pol", ExchangeKind::Fanout).await?;
    let dlx_arg = t.exchange(&ch, "dlx-arg", ExchangeKind::Fanout).await?;
    let q_pol = t.queue(&ch, "dlq-pol", none()).await?;
    let q_arg = t.queue(&ch, "dlq-arg", none()).await?;
    t.bind(&ch, &q_pol, &dlx_pol, "").await?;
    t.bind(&ch, &q_arg, &dlx_arg, "").await?;
    let src = source(t, &ch, &x, &dlx_arg, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    get_and_reject(t, &ch, &src).await?;
    t.record("dlq_arg", &ch, &q_arg, 1).await?;
    t.record_quiet("dlq_pol", &ch, &q_pol, 0, 0.2).await?;
    Ok(())
}

async fn policy_dead_letter_routing_key(t: &mut Ctx) -> Outcome {
    let pattern = format!("^({}|{})$", re_escape(&t.n("src")), re_escape(&t.n("src2")));
    let definition =
        json!({"dead-letter-exchange": t.n("dlx"), "dead-letter-routing-key": "pol-key"});
    t.policy("dlrk", &pattern, definition).await?;
    let ch = t.channel().await?;
    let x = t.exchange(&ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(&ch, "dlx", ExchangeKind::Direct).await?;
    let mut queues = Vec::new();
    for k in ["rk", "pol-key", "arg-key"] {
        let q = t.queue(&ch, &format!("dlq-{k}"), none()).await?;
        t.bind(&ch, &q, &dlx, k).await?;
        queues.push(q);
    }
    let src = t.queue(&ch, "src", none()).await?;
    let src2_args = table(&[
        ("x-dead-letter-routing-key", ls("arg-key")),
        ("x-dead-letter-exchange", ls(&dlx)),
    ]);
    let src2 = t.queue(&ch, "src2", src2_args).await?;
    t.bind(&ch, &src, &x, "rk").await?;
    t.bind(&ch, &src2, &x, "rk").await?;
    t.record_publish(&ch, &x, "rk", "m1").await;
    for q in [&src, &src2] {
        get_and_reject(t, &ch, q).await?;
    }
    t.record("dlq_pol_key", &ch, &queues[1], 1).await?;
    t.record("dlq_arg_key", &ch, &queues[2], 1).await?;
    t.record_quiet("dlq_rk", &ch, &queues[0], 0, 0.2).await?;
    Ok(())
}

async fn policy_message_ttl_min_wins(t: &mut Ctx) -> Outcome {
    let (pattern, dlx) = (exactly(&t.n("src")), t.n("dlx"));
    t.policy(
        "ttl",
        &pattern,
        json!({"message-ttl": 100, "dead-letter-exchange": dlx}),
    )
    .await?;
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-message-ttl", int(60000))])).await?;
    t.record_publish(&ch, &s.x, "rk", "m1").await;
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

async fn policy_max_length_min_wins(t: &mut Ctx) -> Outcome {
    let pattern = exactly(&t.n("src"));
    t.policy("maxlen", &pattern, json!({"max-length": 1}))
        .await?;
    let ch = t.channel().await?;
    let s = standard(t, &ch, table(&[("x-max-length", int(5))])).await?;
    t.record_publishes(&ch, &s.x, &["m1", "m2", "m3"]).await;
    t.record("dead_lettered", &ch, &s.dlq, 2).await?;
    t.record("source_after", &ch, &s.src, 1).await?;
    Ok(())
}
