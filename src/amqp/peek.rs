//! The fields of the methods every message carries, read straight from a method frame's
//! payload: `basic.deliver` and `basic.get-ok` from the upstream, `basic.ack`, `basic.reject`
//! and `basic.nack` from the client. The proxy forwards these frames as the bytes that came in
//! and needs only a few of their fields; [`super::codec::decode_method`] builds
//! amq-protocol's owned method for that (a table-depth scan, a parser pass and an allocation
//! per string), which showed up in profiles of the forwarding path. Borrowed views, no
//! allocation, no table (these methods have none). Anything that is not exactly the expected
//! method (wrong ids, truncated, trailing bytes, a string that is not UTF-8) gives `None`;
//! amq-protocol refuses the same inputs (the tests check both), so a caller treats `None` as
//! it treated a failed decode.

/// `basic.deliver` (60, 60).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deliver<'a> {
    pub consumer_tag: &'a str,
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub exchange: &'a str,
    pub routing_key: &'a str,
}

/// `basic.get-ok` (60, 71).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetOk<'a> {
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub message_count: u32,
}

/// A client's settlement: `basic.ack` (60, 80), `basic.reject` (60, 90), `basic.nack` (60, 120).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Ack {
        delivery_tag: u64,
        multiple: bool,
    },
    Reject {
        delivery_tag: u64,
        requeue: bool,
    },
    Nack {
        delivery_tag: u64,
        multiple: bool,
        requeue: bool,
    },
}

/// The bytes as a `str` when they are UTF-8. Names and tags are ASCII in practice, and an
/// ASCII check runs a word at a time, where `str::from_utf8` takes about 90 instructions for
/// a short string (three per delivery were 12 % of the proxy's instructions per message).
fn utf8(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII bytes are valid UTF-8.
        return Some(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes).ok()
}

/// Reads a payload front to back.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes)
    }

    fn short_str(&mut self) -> Option<&'a str> {
        let len = self.u8()? as usize;
        utf8(self.take(len)?)
    }

    /// The method's ids, when they are `(class, method)`.
    fn ids(&mut self, class: u16, method: u16) -> Option<()> {
        (self.u16()? == class && self.u16()? == method).then_some(())
    }

    /// `value` once the whole payload was read.
    fn end<T>(self, value: T) -> Option<T> {
        self.rest.is_empty().then_some(value)
    }
}

pub fn deliver(payload: &[u8]) -> Option<Deliver<'_>> {
    let mut r = Reader { rest: payload };
    r.ids(60, 60)?;
    let consumer_tag = r.short_str()?;
    let delivery_tag = r.u64()?;
    let redelivered = r.u8()? & 1 != 0;
    let exchange = r.short_str()?;
    let routing_key = r.short_str()?;
    r.end(Deliver {
        consumer_tag,
        delivery_tag,
        redelivered,
        exchange,
        routing_key,
    })
}

pub fn get_ok(payload: &[u8]) -> Option<GetOk<'_>> {
    let mut r = Reader { rest: payload };
    r.ids(60, 71)?;
    let delivery_tag = r.u64()?;
    let redelivered = r.u8()? & 1 != 0;
    let exchange = r.short_str()?;
    let routing_key = r.short_str()?;
    let message_count = r.u32()?;
    r.end(GetOk {
        delivery_tag,
        redelivered,
        exchange,
        routing_key,
        message_count,
    })
}

pub fn settle(payload: &[u8]) -> Option<Settle> {
    let mut r = Reader { rest: payload };
    if r.u16()? != 60 {
        return None;
    }
    let method = r.u16()?;
    let delivery_tag = r.u64()?;
    let bits = r.u8()?;
    let settle = match method {
        80 => Settle::Ack {
            delivery_tag,
            multiple: bits & 1 != 0,
        },
        90 => Settle::Reject {
            delivery_tag,
            requeue: bits & 1 != 0,
        },
        120 => Settle::Nack {
            delivery_tag,
            multiple: bits & 1 != 0,
            requeue: bits & 2 != 0,
        },
        _ => return None,
    };
    r.end(settle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::codec::{decode_method, put_method};
    use amq_protocol::protocol::{AMQPClass, basic};
    use bytes::BytesMut;

    /// The payload amq-protocol encodes for `method`.
    fn payload(method: AMQPClass) -> Vec<u8> {
        let mut frame = BytesMut::new();
        put_method(&mut frame, 1, method);
        // type, channel, size before; the frame-end octet after.
        frame[7..frame.len() - 1].to_vec()
    }

    #[test]
    fn deliver_reads_what_amq_protocol_wrote() {
        for (tag, redelivered, ctag, exchange, key) in [
            (1u64, false, "ctag", "", "q"),
            (u64::MAX, true, "amq.ctag-Ä", "ex", &*"k".repeat(255)),
        ] {
            let bytes = payload(AMQPClass::Basic(basic::AMQPMethod::Deliver(
                basic::Deliver {
                    consumer_tag: ctag.into(),
                    delivery_tag: tag,
                    redelivered,
                    exchange: exchange.into(),
                    routing_key: key.into(),
                },
            )));
            let view = deliver(&bytes).unwrap();
            assert_eq!(
                view,
                Deliver {
                    consumer_tag: ctag,
                    delivery_tag: tag,
                    redelivered,
                    exchange,
                    routing_key: key,
                }
            );
            // Cut anywhere, or with a byte more, it is not a deliver.
            for cut in 0..bytes.len() {
                assert_eq!(deliver(&bytes[..cut]), None);
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(deliver(&longer), None);
            assert!(decode_method(&bytes).is_some());
        }
    }

    #[test]
    fn get_ok_reads_what_amq_protocol_wrote() {
        let bytes = payload(AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
            delivery_tag: 42,
            redelivered: true,
            exchange: "dlx".into(),
            routing_key: "rk".into(),
            message_count: 7,
        })));
        assert_eq!(
            get_ok(&bytes),
            Some(GetOk {
                delivery_tag: 42,
                redelivered: true,
                exchange: "dlx",
                routing_key: "rk",
                message_count: 7,
            })
        );
        assert_eq!(deliver(&bytes), None);
    }

    #[test]
    fn settlements_read_what_amq_protocol_wrote() {
        let cases = [
            (
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 9,
                    multiple: true,
                })),
                Settle::Ack {
                    delivery_tag: 9,
                    multiple: true,
                },
            ),
            (
                AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                    delivery_tag: 3,
                    requeue: false,
                })),
                Settle::Reject {
                    delivery_tag: 3,
                    requeue: false,
                },
            ),
            (
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 5,
                    multiple: false,
                    requeue: true,
                })),
                Settle::Nack {
                    delivery_tag: 5,
                    multiple: false,
                    requeue: true,
                },
            ),
            (
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 6,
                    multiple: true,
                    requeue: false,
                })),
                Settle::Nack {
                    delivery_tag: 6,
                    multiple: true,
                    requeue: false,
                },
            ),
        ];
        for (method, expected) in cases {
            let bytes = payload(method);
            assert_eq!(settle(&bytes), Some(expected));
            // Cut short or with a byte more, neither reader takes it.
            let short = &bytes[..bytes.len() - 1];
            assert_eq!(settle(short), None);
            assert!(decode_method(short).is_none());
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(settle(&longer), None);
            assert!(decode_method(&longer).is_none());
        }
        let other = payload(AMQPClass::Basic(basic::AMQPMethod::Recover(
            basic::Recover { requeue: true },
        )));
        assert_eq!(settle(&other), None);
    }

    /// A `basic.deliver` payload with these strings.
    fn deliver_payload(consumer_tag: &str, exchange: &str, routing_key: &str) -> Vec<u8> {
        payload(AMQPClass::Basic(basic::AMQPMethod::Deliver(
            basic::Deliver {
                consumer_tag: consumer_tag.into(),
                delivery_tag: 7,
                redelivered: true,
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            },
        )))
    }

    #[test]
    fn a_string_that_is_not_utf8_is_left_to_the_full_decoder() {
        let mut bytes = deliver_payload("ab", "", "q");
        bytes[5] = 0xff;
        assert_eq!(deliver(&bytes), None);
        // amq-protocol refuses it too, so the fallback changes nothing.
        assert!(decode_method(&bytes).is_none());
    }

    #[test]
    fn strings_beyond_ascii_are_read_as_the_full_decoder_reads_them() {
        for (tag, routing_key) in [("ctag-é", "clé.ü"), ("amq.ctag-1", "日本語"), ("", "")] {
            let bytes = deliver_payload(tag, "ex-ß", routing_key);
            let got = deliver(&bytes).expect("valid UTF-8 is read");
            assert_eq!(
                (got.consumer_tag, got.exchange, got.routing_key),
                (tag, "ex-ß", routing_key)
            );
        }
        // A byte past ASCII that does not start a UTF-8 sequence, inside ASCII text.
        let mut bytes = deliver_payload("abcdefghijklmnopqrstuvwxyz", "", "q");
        bytes[20] = 0x80;
        assert_eq!(deliver(&bytes), None);
        assert!(decode_method(&bytes).is_none());
    }
}
