//! Reading a paged-out message back ([`crate::broker::paging`]): a positioned read of its
//! Publish record at the location the [`super::index::Index`] gives (segment and offset).
//!
//! Each read takes [`CHUNK`] bytes from that offset, not only the one record, and keeps them:
//! messages of a queue are written in order, so the next messages to page in (the head of the
//! same queue, delivered next) are usually in the chunk already. That is the read-ahead that
//! keeps draining a paged backlog at one system call per chunk instead of one per message.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::record::{FRAME_HEADER, Frame, Record, decode_frame};
use crate::broker::message::Message;

/// Bytes read at once from the location of a message (its record and those after it).
pub const CHUNK: usize = 256 << 10;

/// The chunk read last.
#[derive(Debug, Default)]
pub struct ChunkReader {
    segment: u64,
    start: u64,
    bytes: Vec<u8>,
}

/// A message read back, and whether that took a read from the file (else: from the chunk).
#[derive(Debug)]
pub struct PagedIn {
    pub message: Arc<Message>,
    pub read: bool,
}

impl ChunkReader {
    /// Whether the whole record at `offset` of `segment` is in the chunk (by its length; the
    /// CRC is checked when it is decoded).
    pub fn covers(&self, segment: u64, offset: u64) -> bool {
        self.frame_at(segment, offset).is_some()
    }

    /// The bytes of the record at `offset` of `segment`, when the chunk holds all of them.
    fn frame_at(&self, segment: u64, offset: u64) -> Option<&[u8]> {
        if segment != self.segment || offset < self.start {
            return None;
        }
        let from = usize::try_from(offset - self.start).ok()?;
        let rest = self.bytes.get(from..)?;
        let head = rest.get(..FRAME_HEADER)?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        rest.get(..FRAME_HEADER.checked_add(len)?)
    }

    /// Message `id` from its record at `offset` of `segment`: from the chunk when it holds
    /// the record, else read from `file` (a new chunk from `offset`).
    pub fn message(
        &mut self,
        segment: u64,
        offset: u64,
        id: u64,
        file: Option<File>,
    ) -> std::io::Result<PagedIn> {
        let read = match file {
            Some(file) if !self.covers(segment, offset) => {
                self.fill(&file, segment, offset)?;
                true
            }
            _ => false,
        };
        let frame = self
            .frame_at(segment, offset)
            .ok_or_else(|| invalid(segment, offset, "no whole record"))?;
        let Frame::Whole(payload, _) = decode_frame(frame) else {
            return Err(invalid(segment, offset, "no whole record"));
        };
        match Record::decode_payload(payload) {
            Ok(Record::Publish {
                targets, message, ..
            }) if targets.iter().any(|t| t.id == id) => Ok(PagedIn { message, read }),
            _ => Err(invalid(segment, offset, "not the record of the message")),
        }
    }

    /// Reads a chunk from `offset` (more when the record there is longer). A read that fails
    /// leaves no chunk: its zero-filled buffer would otherwise seem to hold records for the
    /// messages after it, which would then be read back as damaged (lost) instead of being
    /// read from the file again.
    fn fill(&mut self, file: &File, segment: u64, offset: u64) -> std::io::Result<()> {
        let filled = self.fill_from(file, segment, offset);
        if filled.is_err() {
            self.bytes.clear();
        }
        filled
    }

    fn fill_from(&mut self, file: &File, segment: u64, offset: u64) -> std::io::Result<()> {
        self.bytes.clear();
        self.segment = segment;
        self.start = offset;
        read_up_to(file, offset, CHUNK, &mut self.bytes)?;
        if let Some(head) = self.bytes.get(..FRAME_HEADER) {
            let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
            let whole = FRAME_HEADER.saturating_add(len);
            if whole > self.bytes.len() && len <= super::record::MAX_PAYLOAD {
                self.bytes.clear();
                read_up_to(file, offset, whole, &mut self.bytes)?;
            }
        }
        Ok(())
    }
}

/// Reads up to `want` bytes at `offset` into `out` (fewer at the end of the file).
fn read_up_to(file: &File, offset: u64, want: usize, out: &mut Vec<u8>) -> std::io::Result<()> {
    out.resize(want, 0);
    let mut got = 0;
    while got < want {
        match file.read_at(&mut out[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    out.truncate(got);
    Ok(())
}

fn invalid(segment: u64, offset: u64, what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("segment {segment} offset {offset}: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::record::test_publish;

    fn segment_file(name: &str, records: &[Record]) -> (std::path::PathBuf, Vec<u64>) {
        let path = std::env::temp_dir().join(format!("dlx-pagein-{}-{name}", std::process::id()));
        let mut bytes = Vec::new();
        let mut offsets = Vec::new();
        for r in records {
            offsets.push(bytes.len() as u64);
            r.encode(&mut bytes);
        }
        std::fs::write(&path, &bytes).unwrap();
        (path, offsets)
    }

    #[test]
    fn one_read_serves_the_records_after_it() {
        let records: Vec<Record> = (1..=50)
            .map(|id| test_publish(7, id, &format!("body-{id}")))
            .collect();
        let (path, offsets) = segment_file("ahead", &records);
        let mut reader = ChunkReader::default();
        let open = || Some(File::open(&path).unwrap());
        let first = reader.message(3, offsets[0], 1, open()).unwrap();
        assert!(first.read);
        assert_eq!(first.message.body(), b"body-1");
        for (i, offset) in offsets.iter().enumerate().skip(1) {
            assert!(reader.covers(3, *offset));
            let m = reader.message(3, *offset, i as u64 + 1, None).unwrap();
            assert!(!m.read, "record {i} comes from the chunk");
            assert_eq!(m.message.body(), format!("body-{}", i + 1).as_bytes());
        }
        assert!(!reader.covers(4, offsets[0]), "another segment");
        let err = reader.message(3, offsets[1], 99, None).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "wrong id");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_record_longer_than_a_chunk_is_read_whole() {
        let big = "x".repeat(CHUNK + 1000);
        let (path, offsets) =
            segment_file("big", &[test_publish(7, 1, "a"), test_publish(7, 2, &big)]);
        let mut reader = ChunkReader::default();
        let m = reader
            .message(0, offsets[1], 2, Some(File::open(&path).unwrap()))
            .unwrap();
        assert_eq!(m.message.body().len(), big.len());
        let err = reader
            .message(0, offsets[1] + 1, 2, Some(File::open(&path).unwrap()))
            .unwrap_err();
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::InvalidData,
            "not a record start"
        );
        std::fs::remove_file(&path).unwrap();
    }

    /// A read that fails (here: a file opened for writing only) leaves nothing behind that
    /// would answer for the records after it.
    #[test]
    fn a_failed_read_leaves_no_chunk() {
        let records: Vec<Record> = (1..=3)
            .map(|id| test_publish(7, id, &format!("body-{id}")))
            .collect();
        let (path, offsets) = segment_file("failed", &records);
        let mut reader = ChunkReader::default();
        let write_only = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert!(reader.message(3, offsets[0], 1, Some(write_only)).is_err());
        assert!(!reader.covers(3, offsets[1]));
        let m = reader
            .message(3, offsets[1], 2, Some(File::open(&path).unwrap()))
            .unwrap();
        assert_eq!(m.message.body(), b"body-2");
        std::fs::remove_file(&path).unwrap();
    }
}
