//! Message headers of any depth, carried without decoding the deep parts.
//!
//! RabbitMQ accepts and dead-letters messages whose headers nest tables or arrays tens of
//! thousands of levels deep. amq-protocol (and every walk of a decoded table) recurses, so a
//! header like that must never be decoded whole. Refusing it is not an option either: a
//! message RabbitMQ carries must be carried. So the headers table is split by its top-level
//! entries, on the raw bytes:
//!
//! - an entry whose value nests at most [`HEADER_DECODE_DEPTH`] levels (the headers table
//!   counted) is decoded by amq-protocol as always;
//! - a deeper entry is **opaque**: the decoder sees it as a void value under its key
//!   ([`shallow_properties`]), so it is present (a headers-exchange binding of type void
//!   matches it) but equals no binding value; when properties that came from such a message
//!   are encoded again, each opaque entry still present as a void is replaced by its original
//!   bytes ([`restore_opaque`]), so it leaves byte for byte as it arrived (amq-protocol sorts
//!   table entries by key; the opaque entry stands where its key sorts).
//!
//! The keys dead-lettering reads or writes ([`is_rule_key`]: x-death, x-first-death-*,
//! x-last-death-*, x-death-total, CC, BCC, x-delivery-count, the proxy's x-dlx-proxy-bcc) are
//! never opaque. Such a value nested deeper than the limit is malformed the way a value of the
//! wrong type is: it reads as void and a rewrite treats it as the rules treat a value of the
//! wrong type (an x-death that is not an array is replaced by a fresh history, CC/BCC that are
//! not arrays give no routing keys, x-first-death-* and x-last-death-* are overwritten or kept
//! as the void value). Only a rewrite changes it; a message that is only delivered keeps its
//! exact bytes.

use std::borrow::Cow;
use std::collections::HashMap;

use amq_protocol::types::AMQPValue;
use amq_protocol::types::parsing::parse_value;

use super::depth::{ScanError, skip_value};

/// The deepest a decoded header entry nests, the headers table counted (so its value nests at
/// most one level less). Deeper entries are opaque. Fixed, not `limits.max_table_depth`:
/// headers are never refused, so this only decides which entries the broker can look inside,
/// and it is well below [`MAX_TABLE_DEPTH_CEILING`](super::depth::MAX_TABLE_DEPTH_CEILING).
pub const HEADER_DECODE_DEPTH: usize = super::depth::DEFAULT_MAX_TABLE_DEPTH;

/// Property flag bits before and of `headers` (content-type, content-encoding, headers).
const CONTENT_TYPE_FLAG: u16 = 0x8000;
const CONTENT_ENCODING_FLAG: u16 = 0x4000;
const HEADERS_FLAG: u16 = 0x2000;

/// Whether dead-lettering reads or writes this header (never opaque).
pub fn is_rule_key(key: &[u8]) -> bool {
    matches!(
        key,
        b"x-death" | b"x-death-total" | b"CC" | b"BCC" | b"x-delivery-count" | b"x-dlx-proxy-bcc"
    ) || key.starts_with(b"x-first-death-")
        || key.starts_with(b"x-last-death-")
}

/// Where the headers table sits in a property section: the offset of its 32-bit length and
/// the offset just past it. `None` when the flags announce no headers.
fn headers_table(raw: &[u8]) -> Result<Option<(usize, usize)>, ScanError> {
    let flags = raw.get(..2).ok_or(ScanError::Truncated)?;
    let flags = u16::from_be_bytes([flags[0], flags[1]]);
    if flags & HEADERS_FLAG == 0 {
        return Ok(None);
    }
    let mut pos = 2;
    for flag in [CONTENT_TYPE_FLAG, CONTENT_ENCODING_FLAG] {
        if flags & flag != 0 {
            pos += 1 + *raw.get(pos).ok_or(ScanError::Truncated)? as usize;
        }
    }
    let len = raw.get(pos..pos + 4).ok_or(ScanError::Truncated)?;
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let end = (pos + 4)
        .checked_add(len)
        .filter(|end| *end <= raw.len())
        .ok_or(ScanError::Truncated)?;
    Ok(Some((pos, end)))
}

/// One top-level entry of a headers table.
struct Entry {
    /// Offset of the key's length octet (the entry's first byte).
    start: usize,
    key: (usize, usize),
    /// Offset of the type octet.
    tag_at: usize,
    end: usize,
    /// Its value nests deeper than [`HEADER_DECODE_DEPTH`] allows.
    deep: bool,
}

/// The top-level entries of the table whose contents run from `from` to `to`.
fn entries(raw: &[u8], from: usize, to: usize) -> Result<Vec<Entry>, ScanError> {
    let table = raw.get(..to).ok_or(ScanError::Truncated)?;
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let start = pos;
        let key_len = *table.get(pos).ok_or(ScanError::Truncated)? as usize;
        let key = (pos + 1, pos + 1 + key_len);
        let tag_at = key.1;
        let tag = *table.get(tag_at).ok_or(ScanError::Truncated)?;
        let (end, deep) = match skip_value(table, tag, tag_at + 1, HEADER_DECODE_DEPTH - 1) {
            Ok(skipped) => (skipped.end, false),
            Err(ScanError::TooDeep) => {
                // Only a table or an array nests: skip it whole by its length (what is inside
                // stays unread).
                let len = table
                    .get(tag_at + 1..tag_at + 5)
                    .ok_or(ScanError::Truncated)?;
                let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                let end = (tag_at + 5)
                    .checked_add(len)
                    .filter(|end| *end <= to)
                    .ok_or(ScanError::Truncated)?;
                (end, true)
            }
            Err(other) => return Err(other),
        };
        out.push(Entry {
            start,
            key,
            tag_at,
            end,
            deep,
        });
        pos = end;
    }
    Ok(out)
}

/// Copies `raw` with the headers table's contents replaced by `contents` (length fixed).
fn with_table_contents(raw: &[u8], (len_at, end): (usize, usize), contents: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() - (end - len_at) + contents.len() + 4);
    out.extend_from_slice(&raw[..len_at]);
    out.extend_from_slice(&(contents.len() as u32).to_be_bytes());
    out.extend_from_slice(contents);
    out.extend_from_slice(&raw[end..]);
    out
}

/// The property section to hand to amq-protocol: `raw` itself when no header entry nests
/// deeper than [`HEADER_DECODE_DEPTH`], else a copy in which each such entry's value is void.
/// `Err` when the headers table is malformed.
pub fn shallow_properties(raw: &[u8]) -> Result<Cow<'_, [u8]>, ScanError> {
    let Some(table) = headers_table(raw)? else {
        return Ok(Cow::Borrowed(raw));
    };
    let entries = entries(raw, table.0 + 4, table.1)?;
    if !entries.iter().any(|e| e.deep) {
        return Ok(Cow::Borrowed(raw));
    }
    let mut contents = Vec::with_capacity(table.1 - table.0);
    for entry in &entries {
        if entry.deep {
            contents.extend_from_slice(&raw[entry.start..entry.tag_at]);
            contents.push(b'V');
        } else {
            contents.extend_from_slice(&raw[entry.start..entry.end]);
        }
    }
    Ok(Cow::Owned(with_table_contents(raw, table, &contents)))
}

/// The value of the header `name` in a raw property section, read without decoding the
/// properties (a requeue decision needs one header of a message it may never rewrite):
/// `Ok(None)` when the message has no such header. The value is what [`shallow_properties`]
/// and amq-protocol would decode: of two entries with one key the last one counts, and an
/// entry nested deeper than [`HEADER_DECODE_DEPTH`] reads as void. `Err` when the headers
/// table is malformed (a full decode fails then too).
pub fn header_value(raw: &[u8], name: &str) -> Result<Option<AMQPValue>, ScanError> {
    let Some(table) = headers_table(raw)? else {
        return Ok(None);
    };
    let entries = entries(raw, table.0 + 4, table.1)?;
    let Some(entry) = entries
        .iter()
        .rev()
        .find(|e| &raw[e.key.0..e.key.1] == name.as_bytes())
    else {
        return Ok(None);
    };
    if entry.deep {
        return Ok(Some(AMQPValue::Void));
    }
    // The entry was skipped by the same scan, so amq-protocol reads it within its bounds.
    match parse_value(&raw[entry.tag_at..entry.end]) {
        Ok((_, value)) => Ok(Some(value)),
        Err(_) => Err(ScanError::Truncated),
    }
}

/// `encoded` (properties encoded from ones decoded out of `original`) with every opaque
/// header entry of `original` that `encoded` still has as a void value put back as its
/// original bytes. Rule keys are never put back ([`is_rule_key`]); a key the rewrite removed
/// stays removed; of two entries with one key the last one counts, as in decoding.
pub fn restore_opaque<'a>(encoded: &'a [u8], original: &[u8]) -> Cow<'a, [u8]> {
    let opaque = match opaque_entries(original) {
        Some(found) if !found.is_empty() => found,
        _ => return Cow::Borrowed(encoded),
    };
    let Ok(Some(table)) = headers_table(encoded) else {
        return Cow::Borrowed(encoded);
    };
    let Ok(current) = entries(encoded, table.0 + 4, table.1) else {
        return Cow::Borrowed(encoded);
    };
    let mut contents =
        Vec::with_capacity(table.1 - table.0 + opaque.values().map(|o| o.len()).sum::<usize>());
    let mut restored = false;
    for entry in &current {
        let key = &encoded[entry.key.0..entry.key.1];
        let placeholder = encoded[entry.tag_at] == b'V';
        match opaque.get(key) {
            Some(bytes) if placeholder => {
                contents.extend_from_slice(bytes);
                restored = true;
            }
            _ => contents.extend_from_slice(&encoded[entry.start..entry.end]),
        }
    }
    if !restored {
        return Cow::Borrowed(encoded);
    }
    Cow::Owned(with_table_contents(encoded, table, &contents))
}

/// The raw bytes of the opaque entries of `original`'s headers by key, for the keys that are
/// not rule keys and are not repeated later in the table by a decoded entry; `None` when its
/// headers are malformed. One pass over the entries, and none at all past the scan when no
/// entry is opaque (the common case): a peer's headers table can hold tens of thousands of
/// keys.
fn opaque_entries(original: &[u8]) -> Option<HashMap<&[u8], &[u8]>> {
    let table = headers_table(original).ok()??;
    let entries = entries(original, table.0 + 4, table.1).ok()?;
    if !entries.iter().any(|e| e.deep) {
        return Some(HashMap::new());
    }
    // The last entry of each key decides, as in decoding.
    let mut last: HashMap<&[u8], Option<&[u8]>> = HashMap::with_capacity(entries.len());
    for e in &entries {
        let key = &original[e.key.0..e.key.1];
        let opaque = e.deep && !is_rule_key(key);
        last.insert(key, opaque.then(|| &original[e.start..e.end]));
    }
    Some(
        last.into_iter()
            .filter_map(|(key, bytes)| Some((key, bytes?)))
            .collect(),
    )
}

#[cfg(test)]
mod tests;
