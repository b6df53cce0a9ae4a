//! A Bloom filter of request keys: "absent" for certain, "maybe" otherwise.
//!
//! contextd's embedded store asks it before every lookup of a recorded request id (see
//! `service/contextd/adapters/duckdb/request_filter.py`). It lives here so the build over
//! a million keys (at open, and again when the filter is full) hashes and sets bits
//! without the interpreter's lock, in a tight loop over an Arrow string column's buffers.
//!
//! Concurrency: the bits are `AtomicU64` words that only ever gain bits (`fetch_or`), so
//! any number of threads may call [`RequestFilter::maybe`] while one adds: a key whose
//! add returned has all its bits set for every later reader.
//!
//! Hash: `std`'s `DefaultHasher::new()` (SipHash-1-3 with fixed zero keys): well defined,
//! identical for every instance in a process (so the bulk build and the one-by-one adds
//! set the same bits) and needs no new dependency. Its output may differ between Rust
//! releases, which is fine: a filter never leaves the process that built it. Keys come
//! from the store itself (not chosen to collide), and a collision only costs a lookup.
//!
//! Probes: double hashing (Kirsch and Mitzenmacher) from the one 64-bit hash: probe `i`
//! is `(low + i * step) mod m` with `low` the low 32 bits and `step` the high 32 bits
//! made odd (no probe overflows 64 bits for k < 2^31).

use std::hash::{DefaultHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{CoreError, CoreResult};

/// The false-positive rate the filter is sized for at its capacity.
pub const FALSE_POSITIVES: f64 = 0.01;

/// A Bloom filter of strings sized for a capacity (see the module docs).
pub struct RequestFilter {
    words: Vec<AtomicU64>,
    m: u64,
    k: u32,
    capacity: u64,
}

/// The 64-bit hash of a key's UTF-8 bytes.
fn hash_key(key: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write(key);
    hasher.finish()
}

/// The Arrow offsets of a string column, as read from their buffer's bytes
/// (little-endian, as Arrow lays them out on every platform contextd runs on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetWidth {
    /// `string` / `utf8`: int32 offsets.
    I32,
    /// `large_string` / `large_utf8`: int64 offsets.
    I64,
}

impl OffsetWidth {
    fn bytes(self) -> usize {
        match self {
            OffsetWidth::I32 => 4,
            OffsetWidth::I64 => 8,
        }
    }

    /// Offset number `i` of `offsets` (its caller checked that it is in the buffer).
    fn read(self, offsets: &[u8], i: usize) -> i64 {
        let at = i * self.bytes();
        match self {
            OffsetWidth::I32 => {
                let mut b = [0u8; 4];
                b.copy_from_slice(&offsets[at..at + 4]);
                i64::from(i32::from_le_bytes(b))
            }
            OffsetWidth::I64 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&offsets[at..at + 8]);
                i64::from_le_bytes(b)
            }
        }
    }
}

impl RequestFilter {
    /// An empty filter sized for `capacity` keys (at least 1) at [`FALSE_POSITIVES`]:
    /// m = -n ln p / (ln 2)^2 bits (at least 64, a whole number of words) and
    /// k = round(m / n ln 2) probes (at least 1).
    pub fn with_capacity(capacity: u64) -> RequestFilter {
        let capacity = capacity.max(1);
        let ln2 = std::f64::consts::LN_2;
        let bits = (-(capacity as f64) * FALSE_POSITIVES.ln() / (ln2 * ln2)).ceil() as u64;
        let m = bits.max(64).div_ceil(64) * 64;
        let k = ((m as f64 / capacity as f64) * ln2).round().max(1.0) as u32;
        let words = (0..m / 64).map(|_| AtomicU64::new(0)).collect();
        RequestFilter {
            words,
            m,
            k,
            capacity,
        }
    }

    /// The number of keys it was sized for.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The number of probes per key.
    pub fn probes(&self) -> u32 {
        self.k
    }

    /// The bytes its bits take.
    pub fn nbytes(&self) -> usize {
        self.words.len() * 8
    }

    fn probe_bits(&self, h: u64) -> impl Iterator<Item = u64> + '_ {
        let low = h & 0xffff_ffff;
        let step = (h >> 32) | 1;
        (0..u64::from(self.k)).map(move |i| (low + i * step) % self.m)
    }

    fn add_hash(&self, h: u64) {
        for bit in self.probe_bits(h) {
            // Release: a reader that sees this bit (Acquire) sees the earlier ones too.
            self.words[(bit >> 6) as usize].fetch_or(1 << (bit & 63), Ordering::Release);
        }
    }

    /// Set the bits of `key`.
    pub fn add(&self, key: &[u8]) {
        self.add_hash(hash_key(key));
    }

    /// False: `key` was never added (certain). True: it may have been.
    pub fn maybe(&self, key: &[u8]) -> bool {
        self.probe_bits(hash_key(key)).all(|bit| {
            self.words[(bit >> 6) as usize].load(Ordering::Acquire) >> (bit & 63) & 1 == 1
        })
    }

    /// Add every value of an Arrow string column given as its buffers: `data` (the
    /// values' bytes), `offsets` (the offsets' bytes, `width` each) and the array's
    /// `offset` and `length` (a slice of a larger array reads offsets `offset ..=
    /// offset + length`). Null slots are not told apart (no validity bitmap is read):
    /// Arrow gives them empty or arbitrary valid ranges, and adding one only costs a
    /// false positive. Every offset is checked against the buffers before any bit is set:
    /// a malformed column is refused whole, never read out of bounds.
    pub fn add_column(
        &self,
        data: &[u8],
        offsets: &[u8],
        width: OffsetWidth,
        offset: usize,
        length: usize,
    ) -> CoreResult<()> {
        if length == 0 {
            return Ok(());
        }
        let needed = offset
            .checked_add(length)
            .and_then(|end| end.checked_add(1))
            .and_then(|n| n.checked_mul(width.bytes()))
            .ok_or_else(|| CoreError::InvalidArgument("offset + length overflows".into()))?;
        if offsets.len() < needed {
            return Err(CoreError::InvalidArgument(format!(
                "the offsets buffer holds {} bytes; offset {offset} and length {length} need {needed}",
                offsets.len()
            )));
        }
        let mut previous = width.read(offsets, offset);
        for i in offset + 1..=offset + length {
            let next = width.read(offsets, i);
            if previous < 0 || next < previous || next as u64 > data.len() as u64 {
                return Err(CoreError::InvalidArgument(format!(
                    "offsets {previous}..{next} at {i} do not fit a data buffer of {} bytes",
                    data.len()
                )));
            }
            previous = next;
        }
        let mut start = width.read(offsets, offset) as usize;
        for i in offset + 1..=offset + length {
            let end = width.read(offsets, i) as usize;
            self.add_hash(hash_key(&data[start..end]));
            start = end;
        }
        Ok(())
    }

    /// The bits as little-endian bytes (a copy; for tests comparing two filters).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.words
            .iter()
            .flat_map(|w| w.load(Ordering::Acquire).to_le_bytes())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    fn keys(n: usize, seed: u64) -> Vec<String> {
        let mut rng = Rng(seed);
        (0..n)
            .map(|i| format!("{i:08x}-{:016x}\tdefault", rng.below(usize::MAX)))
            .collect()
    }

    /// An Arrow string column's buffers for `keys`, with `width` offsets.
    fn column(keys: &[String], width: OffsetWidth) -> (Vec<u8>, Vec<u8>) {
        let mut data = Vec::new();
        let mut offsets = Vec::new();
        let mut push = |n: usize| match width {
            OffsetWidth::I32 => offsets.extend_from_slice(&(n as i32).to_le_bytes()),
            OffsetWidth::I64 => offsets.extend_from_slice(&(n as i64).to_le_bytes()),
        };
        push(0);
        for key in keys {
            data.extend_from_slice(key.as_bytes());
            push(data.len());
        }
        (data, offsets)
    }

    #[test]
    fn sizes_as_the_python_filter_did() {
        let f = RequestFilter::with_capacity(1_000_000);
        assert_eq!(f.probes(), 7);
        assert!(f.nbytes() > 1_190_000 && f.nbytes() < 1_200_100);
        let tiny = RequestFilter::with_capacity(0);
        assert_eq!((tiny.capacity(), tiny.nbytes()), (1, 8));
    }

    #[test]
    fn no_false_negatives_and_about_one_percent_false_positives() {
        let n = 50_000;
        let f = RequestFilter::with_capacity(n as u64);
        let added = keys(n, 7);
        for key in &added {
            f.add(key.as_bytes());
        }
        assert!(added.iter().all(|k| f.maybe(k.as_bytes())));
        let fresh = keys(n, 99)
            .iter()
            .filter(|k| f.maybe(format!("x{k}").as_bytes()))
            .count();
        // 1% expected at capacity: 500.
        assert!((250..=750).contains(&fresh), "{fresh} false positives");
    }

    #[test]
    fn the_bulk_add_sets_the_bits_of_adding_one_by_one() {
        let added = keys(5_000, 3);
        for width in [OffsetWidth::I32, OffsetWidth::I64] {
            let (data, offsets) = column(&added, width);
            let bulk = RequestFilter::with_capacity(10_000);
            bulk.add_column(&data, &offsets, width, 0, added.len())
                .unwrap();
            let one = RequestFilter::with_capacity(10_000);
            for key in &added {
                one.add(key.as_bytes());
            }
            assert_eq!(bulk.to_bytes(), one.to_bytes());
        }
    }

    #[test]
    fn a_slice_adds_only_its_own_values() {
        let added = keys(100, 5);
        let (data, offsets) = column(&added, OffsetWidth::I32);
        let f = RequestFilter::with_capacity(1_000);
        f.add_column(&data, &offsets, OffsetWidth::I32, 10, 20)
            .unwrap();
        let one = RequestFilter::with_capacity(1_000);
        for key in &added[10..30] {
            one.add(key.as_bytes());
        }
        assert_eq!(f.to_bytes(), one.to_bytes());
        assert!(!f.maybe(added[9].as_bytes()) || !f.maybe(added[30].as_bytes()));
        // Data that does not start at byte 0 (Arrow slices keep the whole data buffer).
        let g = RequestFilter::with_capacity(1_000);
        g.add_column(&data, &offsets, OffsetWidth::I32, 99, 1)
            .unwrap();
        assert!(g.maybe(added[99].as_bytes()));
        g.add_column(&data, &offsets, OffsetWidth::I32, 100, 0)
            .unwrap();
    }

    #[test]
    fn malformed_columns_are_refused_before_any_bit_is_set() {
        let added = keys(10, 1);
        let (data, offsets) = column(&added, OffsetWidth::I32);
        let f = RequestFilter::with_capacity(100);
        let empty = f.to_bytes();
        // Past the offsets.
        assert!(f
            .add_column(&data, &offsets, OffsetWidth::I32, 5, 6)
            .is_err());
        assert!(f
            .add_column(&data, &offsets, OffsetWidth::I32, usize::MAX, 2)
            .is_err());
        // Past the data.
        assert!(f
            .add_column(&data[..20], &offsets, OffsetWidth::I32, 0, 10)
            .is_err());
        // Decreasing offsets.
        let mut bad = offsets.clone();
        bad[8..12].copy_from_slice(&1i32.to_le_bytes());
        assert!(f.add_column(&data, &bad, OffsetWidth::I32, 0, 10).is_err());
        assert_eq!(f.to_bytes(), empty);
    }

    #[test]
    fn readers_on_other_threads_see_every_added_key() {
        let added = keys(20_000, 11);
        let f = RequestFilter::with_capacity(40_000);
        std::thread::scope(|s| {
            s.spawn(|| {
                for key in &added {
                    f.add(key.as_bytes());
                }
            });
            s.spawn(|| {
                for key in added.iter().rev() {
                    let _ = f.maybe(key.as_bytes()); // never torn: atomic words
                }
            });
        });
        assert!(added.iter().all(|k| f.maybe(k.as_bytes())));
    }
}
