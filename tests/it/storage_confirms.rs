//! Publisher confirms of persistent messages in embedded mode, as the frames a client reads:
//! the confirms of one group commit come coalesced (`basic.ack` with `multiple = true`), in
//! sequence order, every publish confirmed exactly once, transient publishes on the same
//! channel included.

use crate::common;

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, BasicProperties, basic};
use amq_protocol::types::FieldTable;
use common::dl::declare_durable;
use common::encode_publish;

use crate::embedded_memory::confirming_publisher;
use crate::storage_restart::{Node, count};

const BURST: u64 = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_persistent_publishes_is_confirmed_in_order_with_multiple_acks() {
    let node = Node::start("storage-confirms").await;
    let (_conn, ch) = node.channel().await;
    declare_durable(&ch, "burst", FieldTable::default()).await;

    let mut publisher = confirming_publisher(node.amqp, FieldTable::default()).await;
    // Every tenth publish transient (acked as soon as routed, but after the persistent ones
    // before it), all sent in one write.
    let mut bytes = Vec::new();
    for i in 1..=BURST {
        let mode = if i % 10 == 0 { 1 } else { 2 };
        let properties = BasicProperties::default().with_delivery_mode(mode);
        bytes.extend(encode_publish(1, "", "burst", properties, &i.to_be_bytes()));
    }
    publisher.send_raw(&bytes).await;

    let mut confirmed = 0u64;
    let (mut frames, mut multiples) = (0u32, 0u32);
    while confirmed < BURST {
        let Some((channel, method)) = publisher.method_within(Duration::from_secs(15)).await else {
            panic!("only {confirmed} of {BURST} confirmed");
        };
        assert_eq!(channel, 1);
        match method {
            AMQPClass::Basic(basic::AMQPMethod::Ack(ack)) => {
                frames += 1;
                if ack.multiple {
                    multiples += 1;
                    assert!(
                        ack.delivery_tag > confirmed + 1 && ack.delivery_tag <= BURST,
                        "multiple ack {} after {confirmed}",
                        ack.delivery_tag
                    );
                } else {
                    assert_eq!(ack.delivery_tag, confirmed + 1, "confirm order");
                }
                confirmed = ack.delivery_tag;
            }
            other => panic!("expected basic.ack after {confirmed}, got {other:?}"),
        }
    }
    assert!(multiples >= 1, "no multiple ack in {frames} confirms");
    assert!(
        u64::from(frames) < BURST / 2,
        "{frames} confirm frames for {BURST} publishes"
    );
    // Nothing more: each publish was confirmed once.
    assert!(
        publisher
            .method_within(Duration::from_millis(300))
            .await
            .is_none()
    );
    assert_eq!(u64::from(count(&ch, "burst").await), BURST);
}
