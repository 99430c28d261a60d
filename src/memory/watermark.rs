//! The value of `limits.memory_high_watermark`: an absolute size (`536870912`, `"512MiB"`,
//! `"1GB"`) or a fraction of the memory available to the process (`0.4`).
//!
//! Units follow RabbitMQ's `vm_memory_high_watermark.absolute`: `k`/`K`/`KiB`, `M`/`MiB`,
//! `G`/`GiB`, `T`/`TiB` are powers of 1024; `kB`/`KB`, `MB`, `GB`, `TB` powers of 1000; `B`
//! or no unit means bytes. A number with a decimal point is a fraction and must lie strictly
//! between 0 and 1. Pure: [`Watermark::parse`] checks the text, [`Watermark::bytes`] turns it
//! into bytes given the memory limit (see [`super::system`]).

use std::fmt;

/// A parsed high watermark.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Watermark {
    /// This many bytes.
    Absolute(u64),
    /// This fraction (0 < f < 1) of the memory limit.
    Relative(f64),
}

/// Units with their multipliers; longer spellings first so that `MiB` is not read as `M`.
const UNITS: &[(&str, u64)] = &[
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("kB", 1_000),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("k", 1 << 10),
    ("K", 1 << 10),
    ("M", 1 << 20),
    ("G", 1 << 30),
    ("T", 1 << 40),
    ("B", 1),
];

impl Watermark {
    /// Reads the setting's text; the error says what is wrong (the caller names the key).
    pub fn parse(text: &str) -> Result<Watermark, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("is empty: give bytes (\"512MiB\") or a fraction (0.4)".into());
        }
        if text.contains('.') {
            let fraction: f64 = text
                .parse()
                .map_err(|_| format!("{text:?} is not a fraction such as 0.4 or a size"))?;
            if !(fraction > 0.0 && fraction < 1.0) {
                return Err(format!(
                    "{text} is not a fraction strictly between 0 and 1 (use an absolute size \
                     such as \"2GiB\" for more)"
                ));
            }
            return Ok(Watermark::Relative(fraction));
        }
        let bytes = parse_size(text)?;
        if bytes == 0 {
            return Err("must be more than 0 bytes".into());
        }
        Ok(Watermark::Absolute(bytes))
    }

    /// The watermark in bytes, for a process whose memory limit is `limit` bytes.
    pub fn bytes(self, limit: u64) -> u64 {
        match self {
            Watermark::Absolute(bytes) => bytes,
            // At most 2^64 × 1.0: the cast saturates, and a tiny limit still gives 1 byte.
            Watermark::Relative(fraction) => ((limit as f64 * fraction) as u64).max(1),
        }
    }
}

/// A size in bytes with an optional unit (the units above; `0` allowed): `"50MB"`,
/// `"512MiB"`, `"1048576"`. Shared by every size setting.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!("{text:?} does not start with a number"));
    }
    let unit = unit.trim();
    let multiplier = if unit.is_empty() {
        1
    } else {
        UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|(_, m)| *m)
            .ok_or_else(|| {
                format!(
                    "unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB, \
                     k, M, G or T)"
                )
            })?
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("{digits} is too large"))?;
    let bytes = number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text} is too large"))?;
    Ok(bytes)
}

impl fmt::Display for Watermark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Watermark::Absolute(bytes) => write!(f, "{bytes} bytes"),
            Watermark::Relative(fraction) => write!(f, "{fraction} of the memory limit"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_and_without_units() {
        for (text, bytes) in [
            ("536870912", 536_870_912),
            ("512MiB", 512 << 20),
            ("512 MiB", 512 << 20),
            ("1GB", 1_000_000_000),
            ("2G", 2 << 30),
            ("64k", 64 << 10),
            ("64kB", 64_000),
            ("64KB", 64_000),
            ("3KiB", 3 << 10),
            ("1TiB", 1 << 40),
            ("1TB", 1_000_000_000_000),
            ("100B", 100),
            (" 7M ", 7 << 20),
        ] {
            assert_eq!(
                Watermark::parse(text),
                Ok(Watermark::Absolute(bytes)),
                "{text}"
            );
        }
    }

    #[test]
    fn fractions_between_zero_and_one() {
        assert_eq!(Watermark::parse("0.4"), Ok(Watermark::Relative(0.4)));
        assert_eq!(Watermark::parse("0.999"), Ok(Watermark::Relative(0.999)));
        for text in ["0.0", "1.0", "1.5", "-0.4", "0.", ".", "0.4MiB", "nan.0"] {
            assert!(Watermark::parse(text).is_err(), "{text} accepted");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        let cases = [
            ("", "is empty"),
            ("0", "more than 0 bytes"),
            ("0MiB", "more than 0 bytes"),
            ("MiB", "does not start with a number"),
            ("-5", "does not start with a number"),
            ("5 parsecs", "unknown unit \"parsecs\""),
            ("5mib", "unknown unit \"mib\""),
            ("99999999999999999999", "too large"),
            ("20000000TiB", "too large"),
        ];
        for (text, expected) in cases {
            let error = Watermark::parse(text).unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    #[test]
    fn bytes_of_a_fraction_follow_the_limit() {
        let gib = 1u64 << 30;
        assert_eq!(Watermark::Relative(0.4).bytes(10 * gib), 4 * gib);
        assert_eq!(Watermark::Relative(0.5).bytes(1), 1);
        assert_eq!(Watermark::Absolute(123).bytes(10 * gib), 123);
        assert_eq!(Watermark::Relative(0.5).bytes(u64::MAX), u64::MAX / 2 + 1);
    }
}
