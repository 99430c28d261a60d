//! Segment files: `segments/NNNNNNNNNNNNNNNNNNNN.seg` (the number zero-padded so names sort in
//! order), written append-only; the writer moves to a new segment once the current one
//! reaches `segment_size`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The directory holding the segments.
pub fn segments_dir(dir: &Path) -> PathBuf {
    dir.join("segments")
}

pub fn segment_path(dir: &Path, number: u64) -> PathBuf {
    segments_dir(dir).join(format!("{number:020}.seg"))
}

/// Segment numbers present in `dir`, in order.
pub fn list(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut numbers = Vec::new();
    for entry in std::fs::read_dir(segments_dir(dir))? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name.strip_suffix(".seg").and_then(|n| n.parse().ok()) {
            numbers.push(n);
        }
    }
    numbers.sort_unstable();
    Ok(numbers)
}

/// The segment being appended to.
pub struct SegmentWriter {
    dir: PathBuf,
    segment_size: u64,
    number: u64,
    file: File,
    len: u64,
    /// `len` at the last sync (or at open): the bytes after it may not be on disk yet.
    synced: u64,
}

impl SegmentWriter {
    /// Opens segment `number` for appending (created if missing).
    pub fn open(dir: &Path, number: u64, segment_size: u64) -> std::io::Result<SegmentWriter> {
        std::fs::create_dir_all(segments_dir(dir))?;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(segment_path(dir, number))?;
        let len = file.metadata()?.len();
        Ok(SegmentWriter {
            dir: dir.to_path_buf(),
            segment_size,
            number,
            file,
            len,
            synced: len,
        })
    }

    pub fn number(&self) -> u64 {
        self.number
    }

    /// Bytes written to the current segment so far (where the next append starts).
    pub fn written(&self) -> u64 {
        self.len
    }

    /// True when `more` bytes, after `pending` bytes not written yet, would take a non-empty
    /// segment past `segment_size` (a record larger than a segment gets one of its own).
    pub fn should_rotate(&self, pending: usize, more: usize) -> bool {
        let used = self.len + pending as u64;
        used > 0 && used + more as u64 > self.segment_size
    }

    /// Syncs the current segment (when `fsync`) and starts the next one.
    pub fn rotate(&mut self, fsync: bool) -> std::io::Result<()> {
        if fsync {
            self.file.sync_data()?;
        }
        let next = SegmentWriter::open(&self.dir, self.number + 1, self.segment_size)?;
        if fsync {
            File::open(segments_dir(&self.dir))?.sync_all()?;
        }
        *self = next;
        Ok(())
    }

    /// Appends `bytes` whole, or not at all: a write that fails part way (a full disk) has
    /// its part cut off again, so the records written after it sit where the index says
    /// (`len`), not behind the stray bytes. If even the cut fails, the segment counts as
    /// full, so the next record starts a new one and the stray bytes stay this segment's
    /// torn tail (cut off by recovery, with nothing valid after them).
    pub fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if let Err(err) = self.file.write_all(bytes) {
            if let Err(cut) = self.file.set_len(self.len) {
                self.len = self.len.max(self.segment_size);
                return Err(std::io::Error::other(format!(
                    "{err}; cutting the partial record off failed too: {cut}"
                )));
            }
            return Err(err);
        }
        self.len += bytes.len() as u64;
        Ok(())
    }

    pub fn sync(&mut self) -> std::io::Result<()> {
        self.file.sync_data()?;
        self.synced = self.len;
        Ok(())
    }

    /// Whether bytes were appended to the current segment since its last sync.
    pub fn has_unsynced(&self) -> bool {
        self.len > self.synced
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_past_the_segment_size_and_lists_in_order() {
        let dir = std::env::temp_dir().join(format!("dlx-seg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = SegmentWriter::open(&dir, 0, 10).unwrap();
        assert!(
            !w.should_rotate(0, 100),
            "an empty segment takes any record"
        );
        assert!(w.should_rotate(8, 3), "bytes not written yet count");
        w.append(&[1; 8]).unwrap();
        assert!(!w.should_rotate(0, 2));
        assert!(w.should_rotate(0, 3));
        w.rotate(true).unwrap();
        assert_eq!(w.number(), 1);
        w.append(&[2; 4]).unwrap();
        assert_eq!(list(&dir).unwrap(), vec![0, 1]);
        assert_eq!(std::fs::read(segment_path(&dir, 0)).unwrap(), vec![1; 8]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
