//! The raw client's producer: basic.publish frames to the default exchange with stamped bodies,
//! many messages per write, and publisher confirms counted from basic.ack / basic.nack
//! (single or multiple=true) against a window of unconfirmed messages.
//!
//! [`ConfirmTracker`] is the pure bookkeeping of delivery tags; [`Publisher`] owns the
//! connection; [`publish`] is the loop the scenarios run (same [`PublishSpec`] and
//! [`PublishResult`] as the lapin producer).

use std::collections::VecDeque;
use std::time::Instant;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, basic, confirm};
use anyhow::{Context, Result, anyhow};

use super::wire::{CHANNEL, FRAME_OVERHEAD, Wire, broker_close, short};
use crate::client::{PublishResult, PublishSpec, now_nanos};
use crate::payload::{self, Stamp};

/// Bytes of publishes buffered before they are written in one go.
const WRITE_BATCH: usize = 64 * 1024;

/// A confirm that does not fit the messages published so far.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfirmError {
    #[error("broker confirmed delivery tag {tag}, but only {published} messages were published")]
    UnknownTag { tag: u64, published: u64 },
}

/// Publisher-confirm bookkeeping of one channel: publishes get delivery tags 1, 2, ... in
/// order; acks and nacks settle one tag or (multiple=true) every tag up to theirs.
#[derive(Debug)]
pub struct ConfirmTracker {
    /// Delivery tag of `unconfirmed[0]`.
    first_tag: u64,
    /// Per tag from `first_tag` on: true while it waits for its confirm.
    unconfirmed: VecDeque<bool>,
    outstanding: usize,
    pub acked: u64,
    pub nacked: u64,
    /// Confirms for tags that were already settled (ignored).
    pub repeated: u64,
}

impl Default for ConfirmTracker {
    fn default() -> Self {
        ConfirmTracker {
            first_tag: 1,
            unconfirmed: VecDeque::new(),
            outstanding: 0,
            acked: 0,
            nacked: 0,
            repeated: 0,
        }
    }
}

impl ConfirmTracker {
    /// Records one publish; returns its delivery tag.
    pub fn published(&mut self) -> u64 {
        self.unconfirmed.push_back(true);
        self.outstanding += 1;
        self.first_tag + self.unconfirmed.len() as u64 - 1
    }

    /// Publishes still waiting for their confirm.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Messages published so far.
    pub fn published_count(&self) -> u64 {
        self.first_tag - 1 + self.unconfirmed.len() as u64
    }

    /// Applies basic.ack (`ack`) or basic.nack.
    pub fn confirm(&mut self, tag: u64, multiple: bool, ack: bool) -> Result<(), ConfirmError> {
        let published = self.published_count();
        if tag > published || (tag == 0 && !multiple) {
            return Err(ConfirmError::UnknownTag { tag, published });
        }
        let settle = |waiting: &mut bool, this: &mut ConfirmTracker| {
            if *waiting {
                *waiting = false;
                this.outstanding -= 1;
                if ack {
                    this.acked += 1;
                } else {
                    this.nacked += 1;
                }
            } else if !multiple {
                this.repeated += 1;
            }
        };
        if tag >= self.first_tag {
            let index = (tag - self.first_tag) as usize;
            let mut slots = std::mem::take(&mut self.unconfirmed);
            if multiple {
                for waiting in slots.iter_mut().take(index + 1) {
                    settle(waiting, self);
                }
            } else if let Some(waiting) = slots.get_mut(index) {
                settle(waiting, self);
            }
            self.unconfirmed = slots;
        } else if !multiple {
            self.repeated += 1;
        }
        while self.unconfirmed.front() == Some(&false) {
            self.unconfirmed.pop_front();
            self.first_tag += 1;
        }
        Ok(())
    }
}

/// A producer connection: publishes stamped bodies to one queue through the default exchange.
pub struct Publisher {
    wire: Wire,
    /// basic.publish and content header frames, the same for every message.
    prefix: Vec<u8>,
    body_len: usize,
    /// Largest body slice one frame carries.
    chunk: usize,
    pub confirms: Option<ConfirmTracker>,
    producer: u32,
}

impl Publisher {
    /// Opens a connection (with confirm.select when `confirms`).
    pub async fn open(
        url: &str,
        name: &str,
        producer: u32,
        routing_key: &str,
        size: usize,
        confirms: bool,
        persistent: bool,
    ) -> Result<Publisher> {
        let mut wire = Wire::open(url, name).await?;
        if confirms {
            wire.call(
                AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                    nowait: false,
                })),
                |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
            )
            .await
            .context("confirm.select")?;
        }
        let body_len = size.max(payload::STAMP_LEN);
        let mut prefix = Vec::with_capacity(128);
        for frame in [
            AMQPFrame::Method(
                CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                    exchange: short("")?,
                    routing_key: short(routing_key)?,
                    mandatory: false,
                    immediate: false,
                })),
            ),
            AMQPFrame::Header(
                CHANNEL,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: body_len as u64,
                    properties: crate::client::properties(persistent),
                },
            ),
        ] {
            prefix = gen_frame(&frame)(WriteContext::from(prefix))
                .map_err(|e| anyhow!("cannot encode {frame}: {e:?}"))?
                .write;
        }
        let chunk = match wire.frame_max() {
            0 => usize::MAX,
            max => (max as usize).saturating_sub(FRAME_OVERHEAD).max(1),
        };
        Ok(Publisher {
            wire,
            prefix,
            body_len,
            chunk,
            confirms: confirms.then(ConfirmTracker::default),
            producer,
        })
    }

    /// Buffers one message with sequence number `seq`, stamped now.
    pub fn put_message(&mut self, seq: u64) -> Result<()> {
        let body = payload::encode(
            Stamp {
                sent_nanos: now_nanos(),
                producer: self.producer,
                seq,
            },
            self.body_len,
        );
        self.wire.put_bytes(&self.prefix);
        if body.len() <= self.chunk {
            self.wire.put(&AMQPFrame::Body(CHANNEL, body))?;
        } else {
            for part in body.chunks(self.chunk) {
                self.wire.put(&AMQPFrame::Body(CHANNEL, part.to_vec()))?;
            }
        }
        if let Some(c) = &mut self.confirms {
            c.published();
        }
        Ok(())
    }

    /// Bytes buffered and not yet written.
    pub fn unwritten(&self) -> usize {
        self.wire.unwritten()
    }

    /// Publishes waiting for a confirm (0 without confirms).
    pub fn outstanding(&self) -> usize {
        self.confirms
            .as_ref()
            .map_or(0, ConfirmTracker::outstanding)
    }

    /// Writes what is buffered.
    pub async fn flush(&mut self) -> Result<()> {
        self.wire.flush().await
    }

    /// One wait on the socket (write some or read some), then handles every whole frame read.
    pub async fn step(&mut self) -> Result<()> {
        self.wire.io().await?;
        self.handle_frames()
    }

    /// Waits until at most `outstanding` publishes wait for a confirm, writing what is buffered.
    pub async fn wait_confirms(&mut self, outstanding: usize) -> Result<()> {
        self.handle_frames()?;
        while self.outstanding() > outstanding {
            self.step().await?;
        }
        Ok(())
    }

    fn handle_frames(&mut self) -> Result<()> {
        while let Some(frame) = self.wire.next_frame()? {
            let AMQPFrame::Method(_, method) = frame else {
                continue;
            };
            if let Some(closed) = broker_close(&method) {
                return Err(closed.into());
            }
            let (tag, multiple, ack) = match method {
                AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => (a.delivery_tag, a.multiple, true),
                AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => (n.delivery_tag, n.multiple, false),
                _ => continue,
            };
            let confirms = self
                .confirms
                .as_mut()
                .ok_or_else(|| anyhow!("publisher confirm on a channel without confirms"))?;
            confirms.confirm(tag, multiple, ack)?;
        }
        Ok(())
    }

    /// Closes the channel and the connection.
    pub async fn close(self) -> bool {
        self.wire.close().await
    }
}

/// Publishes stamped bodies to the default exchange (the raw counterpart of
/// [`crate::client::publish`]). With confirms, returns once every publish is confirmed.
pub async fn publish(spec: PublishSpec) -> Result<PublishResult> {
    let mut publisher = Publisher::open(
        &spec.url,
        &format!("producer {}", spec.producer),
        spec.producer,
        &spec.routing_key,
        spec.size,
        spec.confirms,
        spec.persistent,
    )
    .await?;
    let window = spec.confirm_window.max(1);
    let mut result = PublishResult {
        started_nanos: now_nanos(),
        ..PublishResult::default()
    };
    let mut seq = 0u64;
    let mut more = true;
    loop {
        while more && publisher.unwritten() < WRITE_BATCH && publisher.outstanding() < window {
            if spec.count.is_some_and(|c| seq >= c)
                || spec.until.is_some_and(|t| Instant::now() >= t)
            {
                more = false;
                break;
            }
            publisher.put_message(seq)?;
            seq += 1;
        }
        if !more && publisher.unwritten() == 0 && publisher.outstanding() == 0 {
            break;
        }
        publisher.step().await?;
    }
    result.published = seq;
    if let Some(c) = &publisher.confirms {
        result.acked = c.acked;
        result.nacked = c.nacked;
    }
    result.finished_nanos = now_nanos();
    publisher.close().await;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_confirms_settle_their_own_tag() {
        let mut t = ConfirmTracker::default();
        assert_eq!((t.published(), t.published(), t.published()), (1, 2, 3));
        t.confirm(2, false, true).unwrap();
        assert_eq!(t.outstanding(), 2);
        t.confirm(1, false, false).unwrap();
        t.confirm(3, false, true).unwrap();
        assert_eq!((t.outstanding(), t.acked, t.nacked), (0, 2, 1));
        assert_eq!(t.published(), 4);
    }

    #[test]
    fn multiple_confirms_settle_everything_up_to_their_tag() {
        let mut t = ConfirmTracker::default();
        for _ in 0..10 {
            t.published();
        }
        t.confirm(3, false, true).unwrap();
        t.confirm(5, true, true).unwrap();
        assert_eq!((t.outstanding(), t.acked), (5, 5));
        t.confirm(9, true, false).unwrap();
        assert_eq!((t.outstanding(), t.acked, t.nacked), (1, 5, 4));
        // A repeated multiple confirm changes nothing.
        t.confirm(9, true, true).unwrap();
        assert_eq!((t.outstanding(), t.acked, t.nacked), (1, 5, 4));
        t.confirm(10, false, true).unwrap();
        assert_eq!((t.outstanding(), t.acked), (0, 6));
        assert_eq!(t.repeated, 0);
        t.confirm(4, false, true).unwrap();
        assert_eq!(t.repeated, 1);
    }

    #[test]
    fn confirms_for_unpublished_tags_are_errors() {
        let mut t = ConfirmTracker::default();
        t.published();
        assert_eq!(
            t.confirm(2, true, true),
            Err(ConfirmError::UnknownTag {
                tag: 2,
                published: 1
            })
        );
        assert!(t.confirm(0, false, true).is_err());
        t.confirm(1, false, true).unwrap();
        assert_eq!(t.outstanding(), 0);
    }
}
