//! The records of the message log and how each is framed on disk.
//!
//! A frame is `length: u32 LE | crc32(payload): u32 LE | payload`; the payload's first byte is
//! the record kind. [`decode_frame`] tells a whole frame from a torn one (the file ends inside
//! it) and from a damaged one (CRC or contents wrong), which is all recovery needs to truncate
//! a torn tail or skip a bad record in the middle.

use std::sync::Arc;

use super::codec::{Reader, Short, Writer};
use super::crc::crc32;
use crate::broker::message::Message;

/// Bytes before the payload: length and CRC.
pub const FRAME_HEADER: usize = 8;
/// The largest payload a frame may carry (larger lengths are damage, not records).
pub const MAX_PAYLOAD: usize = 1 << 30;

/// A publish without its time (the first format; still read).
const KIND_PUBLISH: u8 = 1;
const KIND_REMOVE: u8 = 2;
const KIND_DELIVERED: u8 = 3;
pub(super) const KIND_DEFINITIONS: u8 = 4;
/// A publish with the wall-clock time its message entered its targets (written since).
const KIND_PUBLISH_AT: u8 = 5;
/// A publish into a queue's retry hold: as [`KIND_PUBLISH_AT`], with the wall-clock time the
/// message is due back in the queue.
const KIND_PUBLISH_HELD: u8 = 6;

/// A message entered a durable queue: queue id, message id, and whether it was handed to a
/// consumer in the same step (it comes back redelivered after a crash).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub queue: u64,
    pub id: u64,
    pub delivered: bool,
}

/// One change to the durable message state.
#[derive(Clone, Debug)]
pub enum Record {
    /// A persistent message added to durable queues. With `remove`, the same record takes the
    /// message out of its source queue: a dead-letter move is one atomic record. `at` is the
    /// wall-clock time (Unix milliseconds) it entered its targets, from which TTL deadlines
    /// are recomputed after a restart (`None` in records of the first format). With
    /// `held_until` (wall-clock Unix milliseconds), the message waits in its queue's retry
    /// hold until then (retry tiers): the move from "delivered in Q" to "held in Q" is this
    /// one record, with `remove` the rejected delivery.
    Publish {
        targets: Vec<Target>,
        remove: Option<(u64, u64)>,
        message: Arc<Message>,
        at: Option<u64>,
        held_until: Option<u64>,
    },
    /// Messages gone from their queues (acked, dropped, purged, delivered without ack).
    Remove { items: Vec<(u64, u64)> },
    /// A message was delivered and not settled yet (it comes back redelivered).
    Delivered { queue: u64, id: u64 },
}

impl PartialEq for Record {
    fn eq(&self, other: &Self) -> bool {
        let mut a = Vec::new();
        let mut b = Vec::new();
        self.encode_payload(&mut a);
        other.encode_payload(&mut b);
        a == b
    }
}

impl Record {
    /// Appends the framed record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        frame(out, |payload| self.encode_payload(payload));
    }

    fn encode_payload(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        match self {
            Record::Publish {
                targets,
                remove,
                message,
                at,
                held_until,
            } => {
                match (at, held_until) {
                    (at, Some(until)) => {
                        w.u8(KIND_PUBLISH_HELD);
                        w.u64(at.unwrap_or(*until));
                        w.u64(*until);
                    }
                    (Some(at), None) => {
                        w.u8(KIND_PUBLISH_AT);
                        w.u64(*at);
                    }
                    (None, None) => w.u8(KIND_PUBLISH),
                }
                w.u32(targets.len() as u32);
                for t in targets {
                    w.u64(t.queue);
                    w.u64(t.id);
                    w.u8(t.delivered as u8);
                }
                match remove {
                    Some((q, id)) => {
                        w.u8(1);
                        w.u64(*q);
                        w.u64(*id);
                    }
                    None => w.u8(0),
                }
                w.str(message.exchange());
                let keys: Vec<&str> = message.routing_keys().collect();
                w.u32(keys.len() as u32);
                for k in keys {
                    w.str(k);
                }
                w.bytes(message.raw_properties());
                w.bytes(message.body());
                w.opt_u64(message.expiration_ms);
                w.u8(message.dead_lettered as u8);
            }
            Record::Remove { items } => {
                w.u8(KIND_REMOVE);
                w.u32(items.len() as u32);
                for (q, id) in items {
                    w.u64(*q);
                    w.u64(*id);
                }
            }
            Record::Delivered { queue, id } => {
                w.u8(KIND_DELIVERED);
                w.u64(*queue);
                w.u64(*id);
            }
        }
    }

    /// Decodes a payload (CRC already checked).
    pub fn decode_payload(payload: &[u8]) -> Result<Record, Short> {
        Ok(match Parts::decode(payload)? {
            Parts::Publish(p) => Record::Publish {
                message: Arc::new(Message::new(
                    p.exchange,
                    &p.keys,
                    p.properties,
                    p.body,
                    p.expiration,
                    p.dead_lettered,
                )),
                targets: p.targets,
                remove: p.remove,
                at: p.at,
                held_until: p.held_until,
            },
            Parts::Other(record) => record,
        })
    }
}

/// A Publish record's fields, borrowed from its payload (recovery reads what it keeps of a
/// message without building the message).
#[derive(Debug)]
pub struct PublishParts<'a> {
    pub targets: Vec<Target>,
    pub remove: Option<(u64, u64)>,
    pub at: Option<u64>,
    /// A message held for a retry tier until this wall-clock time (Unix ms).
    pub held_until: Option<u64>,
    pub exchange: &'a str,
    pub keys: Vec<&'a str>,
    pub properties: &'a [u8],
    pub body: &'a [u8],
    pub expiration: Option<u64>,
    pub dead_lettered: bool,
}

/// A decoded payload: a Publish as borrowed parts, any other record whole.
#[derive(Debug)]
pub enum Parts<'a> {
    Publish(PublishParts<'a>),
    Other(Record),
}

impl<'a> Parts<'a> {
    /// Decodes a payload (CRC already checked).
    pub fn decode(payload: &'a [u8]) -> Result<Parts<'a>, Short> {
        let mut r = Reader::new(payload);
        let record = match r.u8()? {
            kind @ (KIND_PUBLISH | KIND_PUBLISH_AT | KIND_PUBLISH_HELD) => {
                let at = if kind == KIND_PUBLISH {
                    None
                } else {
                    Some(r.u64()?)
                };
                let held_until = if kind == KIND_PUBLISH_HELD {
                    Some(r.u64()?)
                } else {
                    None
                };
                let n = r.count(17)?;
                let mut targets = Vec::with_capacity(n);
                for _ in 0..n {
                    targets.push(Target {
                        queue: r.u64()?,
                        id: r.u64()?,
                        delivered: r.bool()?,
                    });
                }
                let remove = if r.bool()? {
                    Some((r.u64()?, r.u64()?))
                } else {
                    None
                };
                let exchange = r.str()?;
                let n = r.count(4)?;
                let mut keys = Vec::with_capacity(n);
                for _ in 0..n {
                    keys.push(r.str()?);
                }
                if keys.is_empty() {
                    return Err(Short);
                }
                Parts::Publish(PublishParts {
                    targets,
                    remove,
                    at,
                    held_until,
                    exchange,
                    keys,
                    properties: r.bytes()?,
                    body: r.bytes()?,
                    expiration: r.opt_u64()?,
                    dead_lettered: r.bool()?,
                })
            }
            KIND_REMOVE => {
                let n = r.count(16)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push((r.u64()?, r.u64()?));
                }
                Parts::Other(Record::Remove { items })
            }
            KIND_DELIVERED => Parts::Other(Record::Delivered {
                queue: r.u64()?,
                id: r.u64()?,
            }),
            _ => return Err(Short),
        };
        if !r.is_empty() {
            return Err(Short);
        }
        Ok(record)
    }
}

/// A publish of `body` to queue `queue` as message `id`, at wall-clock time `1000 + id`
/// (for tests).
#[cfg(test)]
pub(crate) fn test_publish(queue: u64, id: u64, body: &str) -> Record {
    test_publish_bytes(queue, id, body.as_bytes())
}

/// [`test_publish`] with any body bytes.
#[cfg(test)]
pub(crate) fn test_publish_bytes(queue: u64, id: u64, body: &[u8]) -> Record {
    Record::Publish {
        targets: vec![Target {
            queue,
            id,
            delivered: false,
        }],
        remove: None,
        message: Arc::new(Message::new("", &["k"], &[0, 0], body, None, false)),
        at: Some(1_000 + id),
        held_until: None,
    }
}

/// Writes a frame whose payload `fill` appends.
pub(super) fn frame(out: &mut Vec<u8>, fill: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER]);
    fill(out);
    let payload = &out[start + FRAME_HEADER..];
    let len = payload.len() as u32;
    let crc = crc32(payload);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// What is at some offset of a log file.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A whole frame whose CRC matches: its payload and total length.
    Whole(&'a [u8], usize),
    /// The file ends inside the frame (or inside its header).
    Torn,
    /// The length is impossible or the CRC does not match.
    Damaged,
}

/// Reads the frame at the start of `bytes`.
pub fn decode_frame(bytes: &[u8]) -> Frame<'_> {
    if bytes.len() < FRAME_HEADER {
        return Frame::Torn;
    }
    let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let crc = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if len == 0 || len > MAX_PAYLOAD {
        return Frame::Damaged;
    }
    if bytes.len() - FRAME_HEADER < len {
        return Frame::Torn;
    }
    let payload = &bytes[FRAME_HEADER..FRAME_HEADER + len];
    if crc32(payload) != crc {
        return Frame::Damaged;
    }
    Frame::Whole(payload, FRAME_HEADER + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish() -> Record {
        publish_at(Some(1_700_000_000_123))
    }

    fn publish_at(at: Option<u64>) -> Record {
        publish_held(at, None)
    }

    fn publish_held(at: Option<u64>, held_until: Option<u64>) -> Record {
        Record::Publish {
            at,
            held_until,
            targets: vec![
                Target {
                    queue: 3,
                    id: 10,
                    delivered: false,
                },
                Target {
                    queue: 4,
                    id: 11,
                    delivered: true,
                },
            ],
            remove: Some((2, 9)),
            message: Arc::new(Message::new(
                "dlx",
                &["rk", "cc"],
                &[0x80, 0x00, 0x02],
                b"body bytes",
                Some(1000),
                true,
            )),
        }
    }

    #[test]
    fn records_round_trip() {
        for record in [
            publish(),
            publish_at(None),
            publish_held(Some(1_700_000_000_123), Some(1_700_000_010_123)),
            Record::Remove {
                items: vec![(1, 2), (3, 4)],
            },
            Record::Delivered { queue: 5, id: 6 },
        ] {
            let mut out = Vec::new();
            record.encode(&mut out);
            let Frame::Whole(payload, used) = decode_frame(&out) else {
                panic!("not whole");
            };
            assert_eq!(used, out.len());
            let back = Record::decode_payload(payload).unwrap();
            assert_eq!(back, record);
        }
        let mut out = Vec::new();
        publish().encode(&mut out);
        let Frame::Whole(payload, _) = decode_frame(&out) else {
            panic!()
        };
        let Record::Publish { message, .. } = Record::decode_payload(payload).unwrap() else {
            panic!()
        };
        assert_eq!(message.exchange(), "dlx");
        assert_eq!(message.routing_keys_vec(), vec!["rk", "cc"]);
        assert_eq!(message.raw_properties(), &[0x80, 0x00, 0x02]);
        assert_eq!(message.body(), b"body bytes");
        assert_eq!(message.expiration_ms, Some(1000));
        assert!(message.dead_lettered);
    }

    #[test]
    fn a_torn_frame_is_torn_at_every_cut() {
        let mut out = Vec::new();
        publish().encode(&mut out);
        for cut in 0..out.len() {
            assert_eq!(decode_frame(&out[..cut]), Frame::Torn, "cut at {cut}");
        }
    }

    #[test]
    fn a_flipped_byte_is_damage() {
        let mut out = Vec::new();
        publish().encode(&mut out);
        for i in FRAME_HEADER..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x40;
            assert_eq!(decode_frame(&bad), Frame::Damaged, "flip at {i}");
        }
        let mut zero_len = out.clone();
        zero_len[..4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode_frame(&zero_len), Frame::Damaged);
    }

    #[test]
    fn unknown_kinds_and_trailing_bytes_are_refused() {
        assert_eq!(Record::decode_payload(&[99]), Err(Short));
        let mut payload = Vec::new();
        Record::Delivered { queue: 1, id: 2 }.encode_payload(&mut payload);
        payload.push(0);
        assert_eq!(Record::decode_payload(&payload), Err(Short));
    }
}
