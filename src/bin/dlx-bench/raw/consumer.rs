//! The raw client's consumer: basic.consume on one queue, deliveries assembled from
//! deliver + header + body frames out of a buffered reader, and settles written in batches:
//! basic.ack with multiple=true every `ack_every` deliveries (and for whatever is left as soon
//! as the read buffer holds no further whole frame, so the prefetch window never stalls), or
//! basic.reject requeue=false per delivery.
//!
//! [`ContentAssembler`] is the pure frame-to-message logic; [`Subscriber`] owns the
//! connection; [`start_consumer`] runs the loop the scenarios use and records ids, latencies
//! and progress exactly as the lapin consumer does.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic};
use amq_protocol::types::FieldTable;
use anyhow::{Context, Result, anyhow};
use tokio::sync::watch;

use super::wire::{CHANNEL, Wire, broker_close, short};
use crate::client::{
    ConsumeResult, ConsumeSpec, Progress, RunningConsumer, Settle, latency_of, now_nanos,
};

/// Largest body the consumer accepts (guards the allocation a header announces).
const MAX_BODY: u64 = 1 << 30;

/// A message assembled from its frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub delivery_tag: u64,
    pub body: Vec<u8>,
}

/// Content frames that do not follow deliver, header, body.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContentError {
    #[error("basic.deliver {0} arrived before the previous message's content was complete")]
    DeliverMidContent(u64),
    #[error("content header without a basic.deliver before it")]
    StrayHeader,
    #[error("content body without a basic.deliver and header before it")]
    StrayBody,
    #[error("content body longer than the {expected} bytes its header announced")]
    BodyTooLong { expected: u64 },
    #[error("content header announces {0} bytes, more than this client accepts")]
    BodyTooLarge(u64),
}

#[derive(Debug, Default)]
enum Assembly {
    #[default]
    Idle,
    AwaitHeader {
        tag: u64,
    },
    AwaitBody {
        tag: u64,
        size: u64,
        body: Vec<u8>,
    },
}

/// Turns deliver, header and body frames into [`Delivery`]s.
#[derive(Debug, Default)]
pub struct ContentAssembler {
    state: Assembly,
}

impl ContentAssembler {
    pub fn deliver(&mut self, tag: u64) -> Result<(), ContentError> {
        if !matches!(self.state, Assembly::Idle) {
            return Err(ContentError::DeliverMidContent(tag));
        }
        self.state = Assembly::AwaitHeader { tag };
        Ok(())
    }

    pub fn header(&mut self, size: u64) -> Result<Option<Delivery>, ContentError> {
        let Assembly::AwaitHeader { tag } = self.state else {
            return Err(ContentError::StrayHeader);
        };
        if size > MAX_BODY {
            return Err(ContentError::BodyTooLarge(size));
        }
        if size == 0 {
            self.state = Assembly::Idle;
            return Ok(Some(Delivery {
                delivery_tag: tag,
                body: Vec::new(),
            }));
        }
        self.state = Assembly::AwaitBody {
            tag,
            size,
            body: Vec::new(),
        };
        Ok(None)
    }

    pub fn body(&mut self, data: Vec<u8>) -> Result<Option<Delivery>, ContentError> {
        let Assembly::AwaitBody { tag, size, body } = &mut self.state else {
            return Err(ContentError::StrayBody);
        };
        let (tag, size) = (*tag, *size);
        if body.is_empty() {
            *body = data;
        } else {
            body.extend_from_slice(&data);
        }
        let got = body.len() as u64;
        if got > size {
            return Err(ContentError::BodyTooLong { expected: size });
        }
        if got < size {
            return Ok(None);
        }
        let body = std::mem::take(body);
        self.state = Assembly::Idle;
        Ok(Some(Delivery {
            delivery_tag: tag,
            body,
        }))
    }
}

/// A consumer connection subscribed to one queue.
pub struct Subscriber {
    wire: Wire,
    content: ContentAssembler,
    /// The broker cancelled the consumer (basic.cancel), e.g. because its queue was deleted.
    pub cancelled: bool,
}

impl Subscriber {
    /// Opens a connection, sets the prefetch and starts consuming `queue`.
    pub async fn open(url: &str, name: &str, queue: &str, prefetch: u16) -> Result<Subscriber> {
        let mut wire = Wire::open(url, name).await?;
        wire.call(
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: prefetch,
                global: false,
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        )
        .await
        .context("basic.qos")?;
        wire.call(
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: short(queue)?,
                consumer_tag: short(&name.replace(' ', "-"))?,
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))),
        )
        .await
        .with_context(|| format!("basic.consume on {queue}"))?;
        Ok(Subscriber {
            wire,
            content: ContentAssembler::default(),
            cancelled: false,
        })
    }

    /// The next delivery already in the read buffer; None once no whole frame is left.
    pub fn buffered_delivery(&mut self) -> Result<Option<Delivery>> {
        while let Some(frame) = self.wire.next_frame()? {
            let done = match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    self.content.deliver(d.delivery_tag)?;
                    None
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    self.cancelled = true;
                    None
                }
                AMQPFrame::Method(_, method) => {
                    if let Some(closed) = broker_close(&method) {
                        return Err(closed.into());
                    }
                    None
                }
                AMQPFrame::Header(_, header) => self.content.header(header.body_size)?,
                AMQPFrame::Body(_, data) => self.content.body(data)?,
                AMQPFrame::Heartbeat | AMQPFrame::InvalidHeartbeat(_) => None,
                AMQPFrame::ProtocolHeader(_) => return Err(anyhow!("protocol header mid-stream")),
            };
            if done.is_some() {
                return Ok(done);
            }
        }
        Ok(None)
    }

    /// Waits for the next delivery (writing buffered settles meanwhile).
    pub async fn next_delivery(&mut self) -> Result<Delivery> {
        loop {
            if let Some(d) = self.buffered_delivery()? {
                return Ok(d);
            }
            if self.cancelled {
                return Err(anyhow!("the broker cancelled the consumer"));
            }
            self.wire.io().await?;
        }
    }

    /// Buffers basic.ack.
    pub fn put_ack(&mut self, delivery_tag: u64, multiple: bool) -> Result<()> {
        self.wire.put_method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag,
                multiple,
            })),
        )
    }

    /// Buffers basic.reject requeue=false.
    pub fn put_reject(&mut self, delivery_tag: u64) -> Result<()> {
        self.wire.put_method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag,
                requeue: false,
            })),
        )
    }

    /// Buffers basic.nack (multiple=false).
    pub fn put_nack(&mut self, delivery_tag: u64, requeue: bool) -> Result<()> {
        self.wire.put_method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag,
                multiple: false,
                requeue,
            })),
        )
    }

    /// Writes buffered settles.
    pub async fn flush(&mut self) -> Result<()> {
        self.wire.flush().await
    }

    /// One wait on the socket: writes buffered settles or reads what arrived.
    pub async fn io(&mut self) -> Result<()> {
        self.wire.io().await
    }

    pub async fn close(self) -> bool {
        self.wire.close().await
    }
}

/// Starts a consumer on its own connection (the raw counterpart of
/// [`crate::client::start_consumer`]); returns once basic.consume-ok arrived.
pub async fn start_consumer(
    spec: ConsumeSpec,
    progress: Arc<Progress>,
    stop: watch::Receiver<bool>,
) -> Result<RunningConsumer> {
    let subscriber = Subscriber::open(&spec.url, &spec.name, &spec.queue, spec.prefetch).await?;
    let what = format!("{} on {}", spec.name, spec.queue);
    let task = tokio::spawn(async move {
        consume_loop(subscriber, spec, progress, stop)
            .await
            .context(what)
    });
    Ok(RunningConsumer { task })
}

async fn consume_loop(
    mut sub: Subscriber,
    spec: ConsumeSpec,
    progress: Arc<Progress>,
    mut stop: watch::Receiver<bool>,
) -> Result<ConsumeResult> {
    let mut result = ConsumeResult::default();
    let ack_every = spec.ack_every.max(1);
    let mut unacked = 0u64;
    let mut last_tag = 0u64;
    loop {
        while let Some(delivery) = sub.buffered_delivery()? {
            let arrived = now_nanos();
            if spec.record
                && let Some(stamp) = result.ids.record_body(&delivery.body)
            {
                result
                    .latencies
                    .push(latency_of(&stamp, spec.events.as_deref(), arrived));
            }
            progress.received.fetch_add(1, Ordering::Relaxed);
            progress.last_nanos.fetch_max(arrived, Ordering::Relaxed);
            if !spec.record
                && let Some(events) = &spec.events
            {
                events.settled(&delivery.body, arrived);
            }
            match spec.settle {
                Settle::Reject => sub.put_reject(delivery.delivery_tag)?,
                Settle::Nack { requeue } => sub.put_nack(delivery.delivery_tag, requeue)?,
                Settle::Ack => {
                    last_tag = delivery.delivery_tag;
                    unacked += 1;
                    if unacked >= ack_every {
                        sub.put_ack(last_tag, ack_every > 1)?;
                        unacked = 0;
                    }
                }
            }
        }
        // No whole frame left to read: settle the remainder now rather than leave the
        // broker waiting for acks it needs to free prefetch slots.
        if unacked > 0 {
            sub.put_ack(last_tag, true)?;
            unacked = 0;
        }
        if sub.cancelled {
            break;
        }
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            step = sub.io() => step?,
        }
    }
    if sub.flush().await.is_err() {
        result.settle_errors += 1;
    }
    sub.close().await;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_deliver_header_and_bodies() {
        let mut a = ContentAssembler::default();
        a.deliver(7).unwrap();
        assert_eq!(a.header(5).unwrap(), None);
        assert_eq!(a.body(vec![1, 2]).unwrap(), None);
        assert_eq!(
            a.body(vec![3, 4, 5]).unwrap(),
            Some(Delivery {
                delivery_tag: 7,
                body: vec![1, 2, 3, 4, 5]
            })
        );
        a.deliver(8).unwrap();
        assert_eq!(
            a.header(0).unwrap(),
            Some(Delivery {
                delivery_tag: 8,
                body: vec![]
            })
        );
    }

    #[test]
    fn frames_out_of_order_are_errors() {
        let mut a = ContentAssembler::default();
        assert_eq!(a.header(3), Err(ContentError::StrayHeader));
        assert_eq!(a.body(vec![1]), Err(ContentError::StrayBody));
        a.deliver(1).unwrap();
        assert_eq!(a.deliver(2), Err(ContentError::DeliverMidContent(2)));
        assert_eq!(a.body(vec![1]), Err(ContentError::StrayBody));
        a.header(2).unwrap();
        assert_eq!(
            a.body(vec![1, 2, 3]),
            Err(ContentError::BodyTooLong { expected: 2 })
        );
        let mut b = ContentAssembler::default();
        b.deliver(1).unwrap();
        assert_eq!(
            b.header(u64::MAX),
            Err(ContentError::BodyTooLarge(u64::MAX))
        );
    }
}
