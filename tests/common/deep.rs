//! Field tables and arrays nested thousands of levels deep, and the frames that carry them,
//! built without recursion (lapin and amq-protocol encode and decode recursively and would
//! overflow the test's own stack). Used by `tests/table_depth.rs` against both modes.

use bytes::{BufMut, BytesMut};

/// Bytes one nesting level adds inside its parent: `[key "k"] type length` for tables,
/// `type length` for arrays.
fn per_level(kind: u8) -> usize {
    if kind == b'F' { 7 } else { 5 }
}

/// The encoded value (32-bit length first, without its type octet) of `depth` tables
/// (`b'F'`, each under the key "k" of its parent) or arrays (`b'A'`) inside each other, the
/// innermost empty. Its depth is `depth`.
pub fn nested(kind: u8, depth: usize) -> Vec<u8> {
    assert!(depth >= 1 && matches!(kind, b'F' | b'A'));
    let step = per_level(kind);
    let mut out = Vec::with_capacity(depth * step + 4);
    let mut inner = (depth - 1) * step;
    out.extend_from_slice(&(inner as u32).to_be_bytes());
    for _ in 1..depth {
        if kind == b'F' {
            out.extend_from_slice(b"\x01k");
        }
        out.push(kind);
        inner -= step;
        out.extend_from_slice(&(inner as u32).to_be_bytes());
    }
    out
}

/// One table entry: key, type octet, encoded value.
pub fn entry(key: &str, kind: u8, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 2 + value.len());
    out.push(key.len() as u8);
    out.extend_from_slice(key.as_bytes());
    out.push(kind);
    out.extend_from_slice(value);
    out
}

/// A field table (length first) made of these encoded entries, in this order.
pub fn table(entries: &[Vec<u8>]) -> Vec<u8> {
    let len: usize = entries.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(len + 4);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    for e in entries {
        out.extend_from_slice(e);
    }
    out
}

/// A table whose whole nesting depth is `depth`: one entry "x-deep" holding `depth - 1`
/// tables or arrays (for `depth == 1`, a long string).
pub fn table_of_depth(kind: u8, depth: usize) -> Vec<u8> {
    if depth == 1 {
        return table(&[entry("x-deep", b'S', &[0, 0, 0, 1, b'v'])]);
    }
    table(&[entry("x-deep", kind, &nested(kind, depth - 1))])
}

fn short(out: &mut BytesMut, s: &str) {
    out.put_u8(s.len() as u8);
    out.put_slice(s.as_bytes());
}

/// A whole frame around `payload`.
pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::with_capacity(payload.len() + 8);
    out.put_u8(kind);
    out.put_u16(channel);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    out.put_u8(0xCE);
    out.to_vec()
}

/// queue.declare (not passive, not durable, waits for declare-ok) with these encoded
/// arguments.
pub fn queue_declare(channel: u16, queue: &str, arguments: &[u8]) -> Vec<u8> {
    let mut p = BytesMut::new();
    p.put_u16(50);
    p.put_u16(10);
    p.put_u16(0);
    short(&mut p, queue);
    p.put_u8(0);
    p.put_slice(arguments);
    frame(1, channel, &p)
}

/// A property section with only a headers table (these encoded bytes).
pub fn headers_properties(headers: &[u8]) -> Vec<u8> {
    let mut out = vec![0x20, 0x00];
    out.extend_from_slice(headers);
    out
}

/// basic.publish to `exchange` with `routing_key`, its content header with these raw
/// properties, and the body in one frame.
pub fn publish(
    channel: u16,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &[u8],
) -> Vec<u8> {
    let mut m = BytesMut::new();
    m.put_u16(60);
    m.put_u16(40);
    m.put_u16(0);
    short(&mut m, exchange);
    short(&mut m, routing_key);
    m.put_u8(0);
    let mut h = BytesMut::new();
    h.put_u16(60);
    h.put_u16(0);
    h.put_u64(body.len() as u64);
    h.put_slice(properties);
    let mut out = frame(1, channel, &m);
    out.extend_from_slice(&frame(2, channel, &h));
    out.extend_from_slice(&frame(3, channel, body));
    out
}

/// One top-level entry of a headers table as it was on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEntry {
    pub key: String,
    pub kind: u8,
    /// The encoded value (length first for S, x, A, F).
    pub value: Vec<u8>,
}

/// The top-level entries of the headers table of a raw property section (flags first), in
/// wire order, without decoding any value (a table or array is skipped by its length).
pub fn header_entries(properties: &[u8]) -> Vec<RawEntry> {
    let flags = u16::from_be_bytes([properties[0], properties[1]]);
    let mut pos = 2;
    for bit in [0x8000, 0x4000] {
        if flags & bit != 0 {
            pos += 1 + properties[pos] as usize;
        }
    }
    if flags & 0x2000 == 0 {
        return Vec::new();
    }
    let len = u32::from_be_bytes(properties[pos..pos + 4].try_into().unwrap()) as usize;
    pos += 4;
    let end = pos + len;
    let mut out = Vec::new();
    while pos < end {
        let key_len = properties[pos] as usize;
        let key = String::from_utf8(properties[pos + 1..pos + 1 + key_len].to_vec()).unwrap();
        pos += 1 + key_len;
        let kind = properties[pos];
        pos += 1;
        let size = match dlx_proxy::amqp::depth::fixed_size(kind) {
            Some(size) => size,
            None => 4 + u32::from_be_bytes(properties[pos..pos + 4].try_into().unwrap()) as usize,
        };
        out.push(RawEntry {
            key,
            kind,
            value: properties[pos..pos + size].to_vec(),
        });
        pos += size;
    }
    assert_eq!(pos, end, "headers table length");
    out
}

/// The entries of a headers table other than those named in `except`, decoded with
/// amq-protocol.
pub fn decode_entries(entries: &[RawEntry], except: &[&str]) -> amq_protocol::types::FieldTable {
    let encoded: Vec<Vec<u8>> = entries
        .iter()
        .filter(|e| !except.contains(&e.key.as_str()))
        .map(|e| entry(&e.key, e.kind, &e.value))
        .collect();
    let bytes = table(&encoded);
    match amq_protocol::types::parsing::parse_field_table(&bytes[..]) {
        Ok((&[], table)) => table,
        other => panic!("headers do not decode: {other:?}"),
    }
}

/// A method frame: class and method ids, the encoded fields before the arguments table
/// (`fields`, as the method lays them out), then the encoded table.
pub fn method_with_table(
    channel: u16,
    (class_id, method_id): (u16, u16),
    fields: &[u8],
    table: &[u8],
) -> Vec<u8> {
    let mut p = BytesMut::new();
    p.put_u16(class_id);
    p.put_u16(method_id);
    p.put_slice(fields);
    p.put_slice(table);
    frame(1, channel, &p)
}

/// The encoded short strings and octets that precede a method's table: `ticket` (0) first
/// when `with_ticket`, then each string, then `bits` when given.
pub fn fields(with_ticket: bool, strings: &[&str], bits: Option<u8>) -> Vec<u8> {
    let mut out = BytesMut::new();
    if with_ticket {
        out.put_u16(0);
    }
    for s in strings {
        short(&mut out, s);
    }
    if let Some(bits) = bits {
        out.put_u8(bits);
    }
    out.to_vec()
}

/// connection.start-ok (PLAIN guest/guest) with these encoded client properties.
pub fn start_ok(client_properties: &[u8]) -> Vec<u8> {
    let mut p = BytesMut::new();
    p.put_u16(10);
    p.put_u16(11);
    p.put_slice(client_properties);
    short(&mut p, "PLAIN");
    let response = b"\0guest\0guest";
    p.put_u32(response.len() as u32);
    p.put_slice(response);
    short(&mut p, "en_US");
    frame(1, 0, &p)
}
