//! How deep field tables and arrays nest, measured on the raw bytes before anything decodes
//! them.
//!
//! amq-protocol decodes, encodes, compares and drops field tables recursively, and so does a
//! good part of this crate (argument validation, policy merge, the x-death rewrite, headers
//! matching). A peer that nests tables or arrays ten thousand levels deep would overflow the
//! stack of whichever task touches the value. This module walks the encoded bytes with an
//! explicit stack (no recursion) so that nothing deeper than a limit ever reaches a recursive
//! decoder:
//!
//! - [`check_method`] knows which AMQP 0-9-1 methods carry a field table and where; the method
//!   decoder (`amqp::codec::decode_method_within`) refuses a method whose tables nest deeper
//!   than `limits.max_table_depth` before amq-protocol sees it;
//! - [`skip_value`] measures (or just skips) one field value; the message-headers splitter
//!   (`amqp::headers`) uses it to keep over-deep header entries as opaque bytes.
//!
//! Depth counts tables and arrays: a scalar has depth 0, an empty table or one holding only
//! scalars depth 1, a table holding such a table depth 2, and so on. The field types are those
//! RabbitMQ and amq-protocol read (`t b B s u U I i l L f d D S A T F V x`, where `s` is a
//! signed 16-bit integer as in RabbitMQ, not the spec's short string).

use std::fmt;

/// Default of `limits.max_table_depth`: far above any real use (RabbitMQ's own x-death is 3
/// deep, client properties 2) and far below what a task's stack can take.
pub const DEFAULT_MAX_TABLE_DEPTH: usize = 64;

/// The largest `limits.max_table_depth` the configuration accepts. The test
/// `max_table_depth_ceiling_is_safe_on_a_worker_stack` (tests/table_depth.rs) sends every
/// method that carries a table (declare and redeclare, exchange.declare, bind, unbind,
/// consume) with arguments nested exactly this deep to both modes, whose tasks run on a debug
/// build's 2 MiB tokio worker stacks. Measured there: amq-protocol's parser alone takes about
/// 8 KiB of stack per level in a debug build and overflows a bare 2 MiB thread near 250
/// levels; the embedded broker's declare path overflowed a worker between 192 and 208 levels.
/// 128 leaves a margin of half again.
pub const MAX_TABLE_DEPTH_CEILING: usize = 128;

/// Why a value could not be measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanError {
    /// The value (or a container length) runs past the end of its input or its container.
    Truncated,
    /// A field type octet no AMQP 0-9-1 peer sends.
    UnknownType(u8),
    /// Tables and arrays nest deeper than the limit (scanning stopped there).
    TooDeep,
}

impl fmt::Display for ScanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScanError::Truncated => f.write_str("field value is truncated"),
            ScanError::UnknownType(t) => write!(f, "unknown field type {t:#04x}"),
            ScanError::TooDeep => f.write_str("field tables nest too deep"),
        }
    }
}

/// Where a field value ends and how deep it nests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// Offset just past the value.
    pub end: usize,
    /// Nesting depth of the value (0 for a scalar).
    pub depth: usize,
}

/// Bytes a value of a fixed-size type takes after its type octet; `None` for the types that
/// start with a 32-bit length (`S`, `x`, `A`, `F`) and for unknown types.
pub fn fixed_size(tag: u8) -> Option<usize> {
    Some(match tag {
        b'V' => 0,
        b't' | b'b' | b'B' => 1,
        b's' | b'u' | b'U' => 2,
        b'I' | b'i' | b'f' => 4,
        b'D' => 5,
        b'l' | b'L' | b'd' | b'T' => 8,
        _ => return None,
    })
}

fn read_u32(buf: &[u8], at: usize) -> Result<usize, ScanError> {
    let bytes = buf.get(at..at.checked_add(4).ok_or(ScanError::Truncated)?);
    let bytes: [u8; 4] = bytes
        .and_then(|b| b.try_into().ok())
        .ok_or(ScanError::Truncated)?;
    Ok(u32::from_be_bytes(bytes) as usize)
}

/// The end of a length-prefixed region starting at `at` (the length octets included), if it
/// fits within `limit`.
fn region_end(buf: &[u8], at: usize, limit: usize) -> Result<usize, ScanError> {
    let len = read_u32(buf, at)?;
    let end = at
        .checked_add(4)
        .and_then(|start| start.checked_add(len))
        .ok_or(ScanError::Truncated)?;
    if end > limit {
        return Err(ScanError::Truncated);
    }
    Ok(end)
}

/// One open table or array on the explicit stack.
struct Open {
    end: usize,
    table: bool,
    /// Deepest child seen so far (0 = only scalars).
    deepest: usize,
}

/// Skips the field value of type `tag` whose bytes start at `at` (just after the type octet),
/// checking that tables and arrays nest at most `max_depth` levels. With `max_depth ==
/// usize::MAX` this is only a bounds check; the walk's memory is one small entry per open
/// level, at most `max_depth` of them.
pub fn skip_value(buf: &[u8], tag: u8, at: usize, max_depth: usize) -> Result<Skipped, ScanError> {
    let mut stack: Vec<Open> = Vec::new();
    let mut pos = at;
    let mut tag = tag;
    loop {
        // Read the value of type `tag` at `pos`, or open a container.
        let limit = stack.last().map_or(buf.len(), |open| open.end);
        match tag {
            b'S' | b'x' => pos = region_end(buf, pos, limit)?,
            b'A' | b'F' => {
                if stack.len() >= max_depth {
                    return Err(ScanError::TooDeep);
                }
                let end = region_end(buf, pos, limit)?;
                stack.push(Open {
                    end,
                    table: tag == b'F',
                    deepest: 0,
                });
                pos += 4;
            }
            other => {
                let size = fixed_size(other).ok_or(ScanError::UnknownType(other))?;
                pos = pos
                    .checked_add(size)
                    .filter(|end| *end <= limit)
                    .ok_or(ScanError::Truncated)?;
            }
        }
        // Close every container that ends here (every read above stays within the innermost
        // one, so `pos` reaches its end exactly).
        let mut finished = 0;
        let open = loop {
            let Some(open) = stack.last() else {
                return Ok(Skipped {
                    end: pos,
                    depth: finished,
                });
            };
            if pos < open.end {
                break open;
            }
            finished = stack.pop().map_or(0, |open| open.deepest + 1);
            if let Some(parent) = stack.last_mut() {
                parent.deepest = parent.deepest.max(finished);
            }
        };
        // The next element: a table entry starts with its key (a short string).
        if open.table {
            let len = *buf.get(pos).ok_or(ScanError::Truncated)? as usize;
            pos = pos
                .checked_add(1 + len)
                .filter(|end| *end < open.end)
                .ok_or(ScanError::Truncated)?;
        }
        tag = *buf.get(pos).ok_or(ScanError::Truncated)?;
        pos += 1;
    }
}

/// Measures the field table at `at` (its 32-bit length first) against `max_depth`; returns
/// the offset after it.
pub fn skip_table(buf: &[u8], at: usize, max_depth: usize) -> Result<Skipped, ScanError> {
    skip_value(buf, b'F', at, max_depth)
}

/// A method argument that precedes or is the field table, in wire order.
#[derive(Clone, Copy)]
enum Arg {
    Octet,
    Short,
    ShortStr,
    Table,
}

/// The arguments of each method that carries a field table, up to and including the table
/// (what follows it needs no depth check).
fn table_layout(class_id: u16, method_id: u16) -> Option<&'static [Arg]> {
    use Arg::*;
    Some(match (class_id, method_id) {
        // connection.start: version-major, version-minor, server-properties.
        (10, 10) => &[Octet, Octet, Table],
        // connection.start-ok: client-properties.
        (10, 11) => &[Table],
        // exchange.declare: ticket, exchange, type, bits, arguments.
        (40, 10) => &[Short, ShortStr, ShortStr, Octet, Table],
        // exchange.bind / unbind: ticket, destination, source, routing-key, no-wait, arguments.
        (40, 30) | (40, 40) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.declare: ticket, queue, bits, arguments.
        (50, 10) => &[Short, ShortStr, Octet, Table],
        // queue.bind: ticket, queue, exchange, routing-key, no-wait, arguments.
        (50, 20) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.unbind: ticket, queue, exchange, routing-key, arguments (no no-wait).
        (50, 50) => &[Short, ShortStr, ShortStr, ShortStr, Table],
        // basic.consume: ticket, queue, consumer-tag, bits, arguments.
        (60, 20) => &[Short, ShortStr, ShortStr, Octet, Table],
        _ => return None,
    })
}

/// Checks the field tables of a method payload (class and method ids first) against
/// `max_depth`. Methods without a table pass unchecked; a payload too short or malformed to
/// reach or skip its table is [`ScanError::Truncated`] (or `UnknownType`), which amq-protocol
/// would refuse as well.
pub fn check_method(payload: &[u8], max_depth: usize) -> Result<(), ScanError> {
    if payload.len() < 4 {
        return Err(ScanError::Truncated);
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let method_id = u16::from_be_bytes([payload[2], payload[3]]);
    let Some(layout) = table_layout(class_id, method_id) else {
        return Ok(());
    };
    let mut pos = 4;
    for arg in layout {
        pos = match arg {
            Arg::Octet => pos + 1,
            Arg::Short => pos + 2,
            Arg::ShortStr => pos + 1 + *payload.get(pos).ok_or(ScanError::Truncated)? as usize,
            Arg::Table => skip_table(payload, pos, max_depth)?.end,
        };
        if pos > payload.len() {
            return Err(ScanError::Truncated);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::WriteContext;
    use amq_protocol::protocol::{AMQPClass, basic, connection, exchange, queue};
    use amq_protocol::types::generation::gen_field_table;
    use amq_protocol::types::{
        AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
    };

    /// The encoded field table (length first) nesting `depth` levels: tables (`F`) or arrays
    /// (`A`) inside each other, an empty one innermost. Built without recursion.
    fn nested(kind: u8, depth: usize) -> Vec<u8> {
        // Bytes each level adds inside its parent: [key "k"] tag length.
        let per_level = if kind == b'F' { 7 } else { 5 };
        let mut out = Vec::with_capacity(depth * per_level + 4);
        let mut inner_len = (depth - 1) * per_level;
        out.extend_from_slice(&(inner_len as u32).to_be_bytes());
        for _ in 1..depth {
            if kind == b'F' {
                out.extend_from_slice(b"\x01k");
            }
            out.push(kind);
            inner_len -= per_level;
            out.extend_from_slice(&(inner_len as u32).to_be_bytes());
        }
        out
    }

    fn encode_table(table: &FieldTable) -> Vec<u8> {
        gen_field_table(table)(WriteContext::from(Vec::new()))
            .unwrap()
            .write
    }

    fn every_type() -> FieldTable {
        let mut t = FieldTable::default();
        let mut put = |k: &str, v: AMQPValue| {
            t.insert(ShortString::from(k), v);
        };
        put("t", AMQPValue::Boolean(true));
        put("b", AMQPValue::ShortShortInt(-1));
        put("B", AMQPValue::ShortShortUInt(1));
        put("s", AMQPValue::ShortInt(-2));
        put("u", AMQPValue::ShortUInt(2));
        put("I", AMQPValue::LongInt(-3));
        put("i", AMQPValue::LongUInt(3));
        put("l", AMQPValue::LongLongInt(-4));
        put("f", AMQPValue::Float(1.5));
        put("d", AMQPValue::Double(2.5));
        put(
            "D",
            AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 7 }),
        );
        put("S", AMQPValue::LongString(LongString::from("long")));
        put(
            "A",
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(false)])),
        );
        put("T", AMQPValue::Timestamp(9));
        put("F", AMQPValue::FieldTable(FieldTable::default()));
        put("V", AMQPValue::Void);
        put("x", AMQPValue::ByteArray(ByteArray::from(vec![1u8, 2, 3])));
        t
    }

    #[test]
    fn every_field_type_is_skipped_exactly() {
        let bytes = encode_table(&every_type());
        // The generator writes every tag this test means to cover.
        for tag in b"tbBsuIilfdDSATFVx" {
            assert!(bytes.contains(tag), "tag {} missing", *tag as char);
        }
        assert_eq!(
            skip_table(&bytes, 0, 64),
            Ok(Skipped {
                end: bytes.len(),
                depth: 2
            })
        );
        // The tags amq-protocol reads but never writes: `U` (short) and `L` (long long).
        let hand = [
            0, 0, 0, 16, 1, b'a', b'U', 0, 1, 1, b'b', b'L', 0, 0, 0, 0, 0, 0, 0, 1,
        ];
        assert_eq!(
            skip_table(&hand, 0, 1),
            Ok(Skipped {
                end: hand.len(),
                depth: 1
            })
        );
        // A scalar value on its own has depth 0.
        assert_eq!(
            skip_value(&[1, 2, 3, 4], b'I', 0, 0),
            Ok(Skipped { end: 4, depth: 0 })
        );
    }

    #[test]
    fn depth_counts_tables_and_arrays_and_stops_one_past_the_limit() {
        for kind in [b'F', b'A'] {
            for depth in [1, 2, 5, 64, 1000] {
                let bytes = nested(kind, depth);
                let tag = kind;
                assert_eq!(
                    skip_value(&bytes, tag, 0, depth),
                    Ok(Skipped {
                        end: bytes.len(),
                        depth
                    }),
                    "{} at {depth}",
                    kind as char
                );
                assert_eq!(
                    skip_value(&bytes, tag, 0, depth - 1),
                    Err(ScanError::TooDeep)
                );
            }
        }
        // The deepest branch decides, not the first.
        let mut t = FieldTable::default();
        t.insert("a".into(), AMQPValue::Boolean(true));
        let mut inner = FieldTable::default();
        inner.insert(
            "deep".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(
                FieldTable::default(),
            )])),
        );
        t.insert("b".into(), AMQPValue::FieldTable(inner));
        t.insert("c".into(), AMQPValue::FieldTable(FieldTable::default()));
        let bytes = encode_table(&t);
        assert_eq!(skip_table(&bytes, 0, 4).map(|s| s.depth), Ok(4));
        assert_eq!(skip_table(&bytes, 0, 3), Err(ScanError::TooDeep));
    }

    #[test]
    fn a_hundred_thousand_levels_need_no_stack() {
        let bytes = nested(b'A', 100_000);
        let handle = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                (
                    skip_value(&bytes, b'A', 0, usize::MAX),
                    skip_value(&bytes, b'A', 0, 64),
                    bytes.len(),
                )
            })
            .unwrap();
        let (unlimited, limited, len) = handle.join().unwrap();
        assert_eq!(
            unlimited,
            Ok(Skipped {
                end: len,
                depth: 100_000
            })
        );
        assert_eq!(limited, Err(ScanError::TooDeep));
    }

    #[test]
    fn truncated_and_malformed_input_is_an_error_never_a_panic() {
        let bytes = encode_table(&every_type());
        for cut in 0..bytes.len() {
            assert_eq!(
                skip_table(&bytes[..cut], 0, 64),
                Err(ScanError::Truncated),
                "cut at {cut}"
            );
        }
        // A container longer than its parent.
        let mut t = nested(b'F', 3);
        t[10] = 0xff;
        assert_eq!(skip_table(&t, 0, 64), Err(ScanError::Truncated));
        // A key running past its table.
        assert_eq!(
            skip_table(&[0, 0, 0, 3, 9, b'a', b'b'], 0, 64),
            Err(ScanError::Truncated)
        );
        // An entry without a value.
        assert_eq!(
            skip_table(&[0, 0, 0, 2, 1, b'a'], 0, 64),
            Err(ScanError::Truncated)
        );
        // A length that would overflow.
        assert_eq!(
            skip_value(&[0xff, 0xff, 0xff, 0xff], b'S', usize::MAX - 2, 64),
            Err(ScanError::Truncated)
        );
        // Unknown types, at the top and inside.
        assert_eq!(
            skip_value(&[0], b'Z', 0, 64),
            Err(ScanError::UnknownType(b'Z'))
        );
        assert_eq!(
            skip_table(&[0, 0, 0, 3, 1, b'a', b'?'], 0, 64),
            Err(ScanError::UnknownType(b'?'))
        );
    }

    fn payload(method: AMQPClass) -> Vec<u8> {
        use amq_protocol::frame::{AMQPFrame, gen_frame};
        let frame = gen_frame(&AMQPFrame::Method(0, method))(WriteContext::from(Vec::new()))
            .unwrap()
            .write;
        frame[7..frame.len() - 1].to_vec()
    }

    /// Every method that carries a table, encoded by amq-protocol with `args` in it.
    fn table_methods(args: FieldTable) -> Vec<AMQPClass> {
        vec![
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: args.clone(),
                mechanisms: "PLAIN".into(),
                locales: "en_US".into(),
            })),
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: args.clone(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: "x".into(),
                kind: "headers".into(),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: args.clone(),
            })),
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
                destination: "d".into(),
                source: "s".into(),
                routing_key: "rk".into(),
                nowait: false,
                arguments: args.clone(),
            })),
            AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
                destination: "d".into(),
                source: "s".into(),
                routing_key: "rk".into(),
                nowait: true,
                arguments: args.clone(),
            })),
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "q".into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: args.clone(),
            })),
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: "q".into(),
                exchange: "x".into(),
                routing_key: "rk".into(),
                nowait: false,
                arguments: args.clone(),
            })),
            AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
                queue: "q".into(),
                exchange: "x".into(),
                routing_key: "rk".into(),
                arguments: args.clone(),
            })),
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: "q".into(),
                consumer_tag: "ctag".into(),
                no_local: false,
                no_ack: true,
                exclusive: false,
                nowait: false,
                arguments: args,
            })),
        ]
    }

    /// `levels` tables inside each other (the outermost is the method's argument table).
    fn deep_args(levels: usize) -> FieldTable {
        let mut table = FieldTable::default();
        table.insert("leaf".into(), AMQPValue::LongString("v".into()));
        for _ in 1..levels {
            let mut outer = FieldTable::default();
            outer.insert("k".into(), AMQPValue::FieldTable(table));
            table = outer;
        }
        table
    }

    #[test]
    fn method_tables_are_found_in_every_method_that_has_one() {
        for (at_limit, past_limit) in table_methods(deep_args(5))
            .into_iter()
            .zip(table_methods(deep_args(6)))
        {
            let at = payload(at_limit);
            let past = payload(past_limit);
            assert_eq!(check_method(&at, 5), Ok(()), "{:?}", &at[..4]);
            assert_eq!(check_method(&past, 5), Err(ScanError::TooDeep));
            assert_eq!(check_method(&past, 6), Ok(()));
            // Cut anywhere: never a panic; where the table is the last argument, refused.
            let table_is_last = !matches!(&at[..4], [0, 10, 0, 10] | [0, 10, 0, 11]);
            for cut in 0..at.len() {
                let checked = check_method(&at[..cut], 64);
                if table_is_last {
                    assert!(checked.is_err(), "cut at {cut} of {:?}", &at[..4]);
                }
            }
        }
    }

    #[test]
    fn methods_without_tables_pass_and_short_payloads_do_not() {
        let ack = payload(AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })));
        assert_eq!(check_method(&ack, 0), Ok(()));
        assert_eq!(check_method(&[0, 50], 64), Err(ScanError::Truncated));
        assert_eq!(
            check_method(&[0, 50, 0, 10, 0], 64),
            Err(ScanError::Truncated)
        );
        // queue.declare whose queue name runs past the payload.
        assert_eq!(
            check_method(&[0, 50, 0, 10, 0, 0, 200, b'q'], 64),
            Err(ScanError::Truncated)
        );
    }
}
