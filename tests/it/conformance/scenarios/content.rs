//! Content preservation: every basic property and typed custom header survives
//! dead-lettering (only `expiration` is removed), and a 1 MiB multi-frame body arrives intact.

use amq_protocol::types::{AMQPValue, ByteArray, FieldArray};
use lapin::BasicProperties;
use sha2::{Digest, Sha256};

use super::{
    Ctx, Outcome, get_and_reject, int, long, ls, none, reject, scenarios, standard, table,
};

scenarios! {
    properties_preserved: "all basic properties and custom headers (typed) survive dead-lettering; only expiration is removed",
    large_message: "~1 MiB body (multi-frame) dead-letters byte-for-byte intact",
}

async fn properties_preserved(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    let headers = table(&[
        ("custom", ls("v")),
        ("int32", int(42)),
        ("int64", long(1 << 40)),
        ("flag", AMQPValue::Boolean(true)),
        (
            "nested",
            AMQPValue::FieldTable(table(&[("a", int(1)), ("b", ls("two"))])),
        ),
        (
            "list",
            AMQPValue::FieldArray(FieldArray::from(vec![
                int(1),
                ls("two"),
                AMQPValue::Boolean(false),
            ])),
        ),
        ("void", AMQPValue::Void),
        ("stamp", AMQPValue::Timestamp(1_577_836_800)),
        ("bin", AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1]))),
    ]);
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("identity".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr-1".into())
        .with_reply_to("reply.q".into())
        .with_expiration("60000".into())
        .with_message_id("mid-1".into())
        .with_timestamp(1_700_000_000)
        .with_type("t1".into())
        .with_user_id(t.target.username.as_str().into())
        .with_app_id("dlxh".into())
        .with_cluster_id("c1".into());
    let p = t
        .publish_with(&ch, &s.x, "rk", br#"{"k":"v"}"#, props)
        .await;
    t.set("publish", p);
    let g = t.get1(&ch, &s.src).await?;
    let v = t.msg_or_null(g.as_ref())?;
    t.set("before", v);
    if let Some(d) = &g {
        reject(&ch, d.delivery_tag).await?;
    }
    t.record("dead_lettered", &ch, &s.dlq, 1).await?;
    Ok(())
}

/// 1 MiB: the SHA-256 digests of "0", "1", … "32767", concatenated.
fn large_body() -> Vec<u8> {
    (0..32768)
        .flat_map(|i: u32| Sha256::digest(i.to_string().as_bytes()).to_vec())
        .collect()
}

async fn large_message(t: &mut Ctx) -> Outcome {
    let ch = t.channel().await?;
    let s = standard(t, &ch, none()).await?;
    let body = large_body();
    let p = t
        .publish_with(&ch, &s.x, "rk", &body, BasicProperties::default())
        .await;
    t.set("publish", p);
    get_and_reject(t, &ch, &s.src).await?;
    let v = t.collect_with(&ch, &s.dlq, 1, 5.0, None).await?;
    t.set("dead_lettered", v);
    Ok(())
}
