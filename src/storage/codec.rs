//! Little-endian primitives the record and definitions encodings are written with: a
//! [`Writer`] appending to a `Vec<u8>` and a [`Reader`] that returns [`Short`] instead of
//! panicking when the bytes run out (a record whose CRC matched can still be from a newer
//! version or a bug; it is refused, never trusted).

/// The bytes ended before a value did, or a value is out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Short;

/// Appends values to a buffer.
pub struct Writer<'a>(pub &'a mut Vec<u8>);

impl Writer<'_> {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Length-prefixed bytes (u32 length).
    pub fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    pub fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    pub fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            Some(x) => {
                self.u8(1);
                self.u64(x);
            }
            None => self.u8(0),
        }
    }
}

/// Reads values back from a slice.
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Short> {
        if self.bytes.len() < n {
            return Err(Short);
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8, Short> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, Short> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, Short> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], Short> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<&'a str, Short> {
        std::str::from_utf8(self.bytes()?).map_err(|_| Short)
    }
    pub fn bool(&mut self) -> Result<bool, Short> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Short),
        }
    }
    pub fn opt_u64(&mut self) -> Result<Option<u64>, Short> {
        Ok(if self.bool()? {
            Some(self.u64()?)
        } else {
            None
        })
    }
    /// A count of items that each take at least `min_item` bytes: refused when the rest of
    /// the input could not hold them (no allocation sized by a damaged length).
    pub fn count(&mut self, min_item: usize) -> Result<usize, Short> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item.max(1)) > self.bytes.len() {
            return Err(Short);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_short_input() {
        let mut buf = Vec::new();
        let mut w = Writer(&mut buf);
        w.u8(7);
        w.u64(1 << 40);
        w.str("héllo");
        w.opt_u64(None);
        w.opt_u64(Some(3));
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u64(), Ok(1 << 40));
        assert_eq!(r.str(), Ok("héllo"));
        assert_eq!(r.opt_u64(), Ok(None));
        assert_eq!(r.opt_u64(), Ok(Some(3)));
        assert!(r.is_empty());
        assert_eq!(Reader::new(&buf[..5]).u64(), Err(Short));
        let mut huge = Vec::new();
        Writer(&mut huge).u32(u32::MAX);
        assert_eq!(Reader::new(&huge).count(1), Err(Short));
        assert_eq!(Reader::new(&huge).bytes(), Err(Short));
    }
}
