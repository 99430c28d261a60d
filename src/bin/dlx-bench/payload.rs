//! Benchmark message bodies and what the consumers learn from them.
//!
//! Every body starts with a 20-byte stamp (send time, producer, sequence number) and is padded
//! to the requested size. Consumers decode the stamp to measure publish-to-consume latency and
//! record the (producer, sequence) id in an [`IdTracker`], which tells at the end whether each
//! published message arrived exactly once. Pure code: no clock, no I/O.

/// Bytes of the stamp at the start of every body: send time (u64), producer (u32), seq (u64).
pub const STAMP_LEN: usize = 20;

/// Highest sequence number a tracker accepts (guards against garbage bodies).
const MAX_SEQ: u64 = 1 << 32;

/// What a body carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// Nanoseconds since the benchmark process started, when the message was published.
    pub sent_nanos: u64,
    pub producer: u32,
    pub seq: u64,
}

/// A body of `size` bytes (at least [`STAMP_LEN`]) starting with the stamp, zero padded.
pub fn encode(stamp: Stamp, size: usize) -> Vec<u8> {
    let mut body = vec![0u8; size.max(STAMP_LEN)];
    body[0..8].copy_from_slice(&stamp.sent_nanos.to_le_bytes());
    body[8..12].copy_from_slice(&stamp.producer.to_le_bytes());
    body[12..20].copy_from_slice(&stamp.seq.to_le_bytes());
    body
}

/// The stamp of a body, or None if it is too short to be one of ours.
pub fn decode(body: &[u8]) -> Option<Stamp> {
    let sent_nanos = u64::from_le_bytes(body.get(0..8)?.try_into().ok()?);
    let producer = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?);
    let seq = u64::from_le_bytes(body.get(12..20)?.try_into().ok()?);
    Some(Stamp {
        sent_nanos,
        producer,
        seq,
    })
}

/// Which (producer, seq) ids were seen, as one bitmap per producer.
#[derive(Clone, Debug, Default)]
pub struct IdTracker {
    seen: Vec<Vec<u64>>,
    /// Messages recorded, duplicates included.
    pub received: u64,
    /// Messages seen a second (or later) time.
    pub duplicates: u64,
    /// Bodies that carried no usable stamp.
    pub malformed: u64,
}

/// The verdict on a run: what was expected against what arrived.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub expected: u64,
    pub distinct: u64,
    pub duplicates: u64,
    pub missing: u64,
    /// Ids that were not expected (beyond what a producer reports having published).
    pub unexpected: u64,
    pub malformed: u64,
    /// Up to ten missing ids as (producer, seq), for the report.
    pub missing_examples: Vec<(u32, u64)>,
}

impl Verdict {
    /// True when every expected message arrived exactly once and nothing else did.
    pub fn exactly_once(&self) -> bool {
        self.missing == 0 && self.duplicates == 0 && self.unexpected == 0 && self.malformed == 0
    }
}

impl IdTracker {
    /// Records one arrival; returns false if the id was already seen (or is unusable).
    pub fn record(&mut self, producer: u32, seq: u64) -> bool {
        self.received += 1;
        if seq >= MAX_SEQ || producer > 65_535 {
            self.malformed += 1;
            return false;
        }
        let p = producer as usize;
        if self.seen.len() <= p {
            self.seen.resize_with(p + 1, Vec::new);
        }
        let bits = &mut self.seen[p];
        let word = (seq / 64) as usize;
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        let mask = 1u64 << (seq % 64);
        if bits[word] & mask != 0 {
            self.duplicates += 1;
            false
        } else {
            bits[word] |= mask;
            true
        }
    }

    /// Records a body; bodies without a stamp count as malformed.
    pub fn record_body(&mut self, body: &[u8]) -> Option<Stamp> {
        match decode(body) {
            Some(stamp) => {
                self.record(stamp.producer, stamp.seq);
                Some(stamp)
            }
            None => {
                self.received += 1;
                self.malformed += 1;
                None
            }
        }
    }

    /// Adds another tracker's arrivals; an id both saw counts as a duplicate.
    pub fn merge(&mut self, other: &IdTracker) {
        self.received += other.received;
        self.duplicates += other.duplicates;
        self.malformed += other.malformed;
        if self.seen.len() < other.seen.len() {
            self.seen.resize_with(other.seen.len(), Vec::new);
        }
        for (mine, theirs) in self.seen.iter_mut().zip(&other.seen) {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            for (a, b) in mine.iter_mut().zip(theirs) {
                self.duplicates += u64::from((*a & *b).count_ones());
                *a |= *b;
            }
        }
    }

    /// Distinct ids seen.
    pub fn distinct(&self) -> u64 {
        self.seen
            .iter()
            .flatten()
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    /// Compares the arrivals with what each producer published: producer `p` published
    /// sequence numbers `0..published[p]`.
    pub fn verdict(&self, published: &[u64]) -> Verdict {
        let mut v = Verdict {
            expected: published.iter().sum(),
            distinct: self.distinct(),
            duplicates: self.duplicates,
            malformed: self.malformed,
            ..Verdict::default()
        };
        for (p, &count) in published.iter().enumerate() {
            let bits = self.seen.get(p).map_or(&[][..], |b| &b[..]);
            for seq in 0..count {
                let word = (seq / 64) as usize;
                let present = bits
                    .get(word)
                    .is_some_and(|w| w & (1u64 << (seq % 64)) != 0);
                if !present {
                    v.missing += 1;
                    if v.missing_examples.len() < 10 {
                        v.missing_examples.push((p as u32, seq));
                    }
                }
            }
        }
        // Distinct ids inside the published ranges are expected - missing; the rest are extra.
        v.unexpected = v.distinct.saturating_sub(v.expected - v.missing);
        v
    }
}

/// Latency samples in nanoseconds.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    samples: Vec<u64>,
}

/// Percentiles of a latency sample, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencySummary {
    pub count: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latencies {
    pub fn push(&mut self, nanos: u64) {
        self.samples.push(nanos);
    }

    pub fn merge(&mut self, other: Latencies) {
        self.samples.extend(other.samples);
    }

    /// Nearest-rank percentiles (p50, p90, p99, max).
    pub fn summary(&mut self) -> LatencySummary {
        if self.samples.is_empty() {
            return LatencySummary::default();
        }
        self.samples.sort_unstable();
        let n = self.samples.len();
        let rank = |p: f64| -> f64 {
            let idx = ((p / 100.0) * n as f64).ceil() as usize;
            self.samples[idx.clamp(1, n) - 1] as f64 / 1000.0
        };
        LatencySummary {
            count: n,
            p50_us: rank(50.0),
            p90_us: rank(90.0),
            p99_us: rank(99.0),
            max_us: self.samples[n - 1] as f64 / 1000.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_round_trips_and_pads_to_size() {
        let s = Stamp {
            sent_nanos: 123_456_789,
            producer: 7,
            seq: 99,
        };
        let body = encode(s, 100);
        assert_eq!(body.len(), 100);
        assert_eq!(decode(&body), Some(s));
        assert!(body[STAMP_LEN..].iter().all(|b| *b == 0));
    }

    #[test]
    fn small_sizes_still_carry_the_stamp() {
        let s = Stamp {
            sent_nanos: 1,
            producer: 0,
            seq: 2,
        };
        assert_eq!(encode(s, 4).len(), STAMP_LEN);
        assert_eq!(decode(&encode(s, 0)), Some(s));
        assert_eq!(decode(&[1, 2, 3]), None);
    }

    #[test]
    fn tracker_finds_missing_and_duplicates() {
        let mut t = IdTracker::default();
        for seq in 0..10 {
            if seq != 4 {
                assert!(t.record(0, seq));
            }
        }
        assert!(!t.record(0, 3));
        for seq in 0..5 {
            t.record(1, seq);
        }
        let v = t.verdict(&[10, 5]);
        assert_eq!(v.expected, 15);
        assert_eq!(v.distinct, 14);
        assert_eq!(v.duplicates, 1);
        assert_eq!(v.missing, 1);
        assert_eq!(v.missing_examples, vec![(0, 4)]);
        assert!(!v.exactly_once());
    }

    #[test]
    fn merge_counts_ids_seen_by_two_consumers_as_duplicates() {
        let mut a = IdTracker::default();
        let mut b = IdTracker::default();
        for seq in 0..100 {
            if seq % 2 == 0 {
                a.record(0, seq);
            } else {
                b.record(0, seq);
            }
        }
        b.record(0, 10);
        a.merge(&b);
        let v = a.verdict(&[100]);
        assert_eq!(v.distinct, 100);
        assert_eq!(v.duplicates, 1);
        assert_eq!(v.missing, 0);
        assert_eq!(a.received, 101);
    }

    #[test]
    fn ids_beyond_what_was_published_are_unexpected() {
        let mut t = IdTracker::default();
        for seq in 0..5 {
            t.record(0, seq);
        }
        let v = t.verdict(&[3]);
        assert_eq!(v.missing, 0);
        assert_eq!(v.unexpected, 2);
        assert!(!v.exactly_once());
        let clean = t.verdict(&[5]);
        assert!(clean.exactly_once());
    }

    #[test]
    fn garbage_bodies_are_malformed() {
        let mut t = IdTracker::default();
        assert_eq!(t.record_body(b"short"), None);
        t.record(0, u64::MAX);
        assert_eq!(t.malformed, 2);
        assert!(!t.verdict(&[]).exactly_once());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut l = Latencies::default();
        for i in 1..=100u64 {
            l.push(i * 1000);
        }
        let s = l.summary();
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p90_us, 90.0);
        assert_eq!(s.p99_us, 99.0);
        assert_eq!(s.max_us, 100.0);
        assert_eq!(Latencies::default().summary(), LatencySummary::default());
    }
}
