//! Proxy mode, BCC keys: without a dead-letter routing key a dead-lettered message is routed
//! with every key it was published with, BCC keys included (as RabbitMQ does), although the
//! broker strips `BCC` at publish. The proxy keeps them in `x-dlx-proxy-bcc`, which no client
//! of the proxy ever sees, and publishes stay 1:1 with their confirms.

use crate::proxy_support;

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{Channel, ExchangeKind};
use proxy_support::*;

const PRIVATE: &str = "x-dlx-proxy-bcc";

fn strings(values: &[&str]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        values.iter().map(|v| ls(v)).collect::<Vec<_>>(),
    ))
}

/// What the harness's `bcc_header` scenario builds: exchange `x` routes key "a" to the source
/// queue; the dead-letter exchange routes "a", "c" and "z" to one queue each.
struct Topology {
    x: String,
    dlx: String,
    src: String,
    dlq: std::collections::HashMap<&'static str, String>,
}

async fn topology(ch: &Channel, src_args: &[(&str, AMQPValue)]) -> Topology {
    let x = unique("bcc-x");
    let dlx = unique("bcc-dlx");
    exchange(ch, &x, ExchangeKind::Direct).await;
    exchange(ch, &dlx, ExchangeKind::Direct).await;
    let mut dlq = std::collections::HashMap::new();
    for key in ["a", "c", "z"] {
        let q = unique(&format!("bcc-dlq-{key}"));
        declare(ch, &q, FieldTable::default()).await;
        bind(ch, &q, &dlx, key).await;
        dlq.insert(key, q);
    }
    let src = unique("bcc-src");
    let mut args = vec![("x-dead-letter-exchange", ls(&dlx))];
    args.extend(src_args.iter().cloned());
    declare(ch, &src, table(&args)).await;
    bind(ch, &src, &x, "a").await;
    Topology { x, dlx, src, dlq }
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &str, headers: FieldTable) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        AMQPProperties::default().with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

fn assert_no_routing_headers(d: &lapin::message::Delivery) {
    assert!(header(d, "BCC").is_none(), "BCC is never visible");
    assert!(header(d, PRIVATE).is_none(), "{PRIVATE} is never visible");
}

/// A rejected message reaches the queues of its publish key and of its BCC keys, x-death
/// lists only the publish key, no client sees the keys, and a second dead-lettering (from the
/// dead-letter queue, again without a routing key) still routes with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bcc_keys_route_rejected_messages_and_stay_invisible() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let t = topology(&ch, &[]).await;
    // The dead-letter queue of "a" dead-letters on to a second exchange.
    let dlx2 = unique("bcc-dlx2");
    exchange(&ch, &dlx2, ExchangeKind::Direct).await;
    let hop2_a = unique("bcc-hop2-a");
    let hop2_c = unique("bcc-hop2-c");
    for (q, key) in [(&hop2_a, "a"), (&hop2_c, "c")] {
        declare(&ch, q, FieldTable::default()).await;
        bind(&ch, q, &dlx2, key).await;
    }
    let dlq_a = unique("bcc-dlq-a2");
    declare(&ch, &dlq_a, table(&[("x-dead-letter-exchange", ls(&dlx2))])).await;
    bind(&ch, &dlq_a, &t.dlx, "a").await;

    publish(
        &ch,
        &t.x,
        "a",
        "m1",
        table(&[("BCC", strings(&["c"])), ("keep", ls("yes"))]),
    )
    .await;
    // A consumer of the source queue sees neither header.
    let consumer_ch = conn.create_channel().await.unwrap();
    let mut rx = consume(&consumer_ch, &t.src, BasicConsumeOptions::default()).await;
    let d = next(&mut rx).await;
    assert_no_routing_headers(&d);
    assert_eq!(header(&d, "keep"), Some(&ls("yes")));
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    for q in [&t.dlq["a"], &t.dlq["c"]] {
        let dead = get(&ch, q).await;
        assert_eq!(payload(&dead), "m1");
        assert_eq!(dead.routing_key.as_str(), "a");
        assert_no_routing_headers(&dead);
        assert_eq!(header(&dead, "keep"), Some(&ls("yes")));
        assert_eq!(field(&x_death(&dead)[0], "routing-keys"), &strings(&["a"]));
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    consume_empty(&ch, &t.dlq["z"]).await;

    // Second hop: rejected from the dead-letter queue of "a".
    let dead = get(&ch, &dlq_a).await;
    assert_no_routing_headers(&dead);
    dead.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    for q in [&hop2_a, &hop2_c] {
        let dead = get(&ch, q).await;
        assert_eq!(payload(&dead), "m1");
        assert_no_routing_headers(&dead);
        assert_eq!(x_death(&dead).len(), 2);
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    // Behind the proxy the message carries the kept keys (what a direct consumer would see).
    consumer_ch.close(200, "bye".into()).await.unwrap();
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    publish(&ch, &t.x, "a", "m2", table(&[("BCC", strings(&["c"]))])).await;
    let raw = get(&uch, &t.src).await;
    assert_eq!(header(&raw, PRIVATE), Some(&strings(&["c"])));
    assert!(header(&raw, "BCC").is_none());
    raw.acker.ack(BasicAckOptions::default()).await.unwrap();
    let _ = upstream.close(200, "bye".into()).await;
    proxy.stop().await;
}

/// Messages that expire upstream come back through the capture queue with the kept keys and
/// are routed with them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bcc_keys_route_expired_messages() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let t = topology(&ch, &[("x-message-ttl", AMQPValue::LongInt(50))]).await;
    publish(
        &ch,
        &t.x,
        "a",
        "m1",
        table(&[("BCC", strings(&["c", "z"]))]),
    )
    .await;
    for key in ["a", "c", "z"] {
        let dead = get(&ch, &t.dlq[key]).await;
        assert_eq!(payload(&dead), "m1");
        assert_no_routing_headers(&dead);
        let deaths = x_death(&dead);
        assert_eq!(field(&deaths[0], "reason"), &ls("expired"));
        assert_eq!(field(&deaths[0], "routing-keys"), &strings(&["a"]));
        dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    proxy.stop().await;
}

/// A client cannot add routing keys by setting the proxy's header itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_private_header_is_dropped() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let t = topology(&ch, &[]).await;
    publish(&ch, &t.x, "a", "m1", table(&[(PRIVATE, strings(&["c"]))])).await;
    let d = get(&ch, &t.src).await;
    assert_no_routing_headers(&d);
    d.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(&ch, &t.dlq["a"]).await;
    assert_no_routing_headers(&dead);
    tokio::time::sleep(Duration::from_millis(300)).await;
    consume_empty(&ch, &t.dlq["c"]).await;
    proxy.stop().await;
}

/// Rewritten content headers replace frames one for one: confirms keep their numbers across
/// publishes with and without BCC. A header that would outgrow frame_max with the kept keys is
/// forwarded as it is: still routed by its BCC keys at publish, only without kept keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_stay_one_to_one_and_an_oversized_header_keeps_no_keys() {
    let proxy = TestProxy::start(vec![]).await;
    let conn = proxy.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let t = topology(&ch, &[]).await;
    // A queue that gets the BCC copies at publish.
    let bcc_copy = unique("bcc-copy");
    declare(&ch, &bcc_copy, FieldTable::default()).await;
    bind(&ch, &bcc_copy, &t.x, "c").await;
    let mut confirms = Vec::new();
    for i in 0..20 {
        let headers = if i % 2 == 0 {
            table(&[("BCC", strings(&["c"]))])
        } else {
            FieldTable::default()
        };
        confirms.push(
            ch.basic_publish(
                t.x.as_str().into(),
                "a".into(),
                BasicPublishOptions::default(),
                format!("n{i}").as_bytes(),
                AMQPProperties::default().with_headers(headers),
            )
            .await
            .unwrap(),
        );
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
    wait_count(&ch, &t.src, 20).await;
    wait_count(&ch, &bcc_copy, 10).await;
    for i in 0..20 {
        let d = get(&ch, &t.src).await;
        assert_eq!(payload(&d), format!("n{i}"));
        assert_no_routing_headers(&d);
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    for i in (0..20).step_by(2) {
        let d = get(&ch, &bcc_copy).await;
        assert_eq!(payload(&d), format!("n{i}"));
        assert_no_routing_headers(&d);
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }

    // A header frame a few bytes short of frame_max: no room for the kept keys.
    let frame_max = conn.configuration().frame_max() as usize;
    let base = table(&[("BCC", strings(&["c"])), ("pad", ls(""))]);
    let base_len = {
        let props = AMQPProperties::default().with_headers(base);
        dlx_proxy::amqp::content::encode_properties(&props).len()
    };
    // frame = 8 overhead + 12 class/weight/size + properties.
    let pad = frame_max - 8 - 12 - base_len - 4;
    let big = table(&[("BCC", strings(&["c"])), ("pad", ls(&"p".repeat(pad)))]);
    publish(&ch, &t.x, "a", "big", big).await;
    let upstream = upstream_connection().await;
    let uch = upstream.create_channel().await.unwrap();
    for q in [&t.src, &bcc_copy] {
        let d = get(&uch, q).await;
        assert_eq!(payload(&d), "big");
        assert!(header(&d, PRIVATE).is_none());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = upstream.close(200, "bye".into()).await;
    proxy.stop().await;
}
