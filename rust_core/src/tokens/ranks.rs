//! BPE token counts of pretokenizer pieces, with tiktoken's merge rule and fast rank
//! lookups.
//!
//! tiktoken encodes a piece by looking it up whole in the vocabulary and otherwise
//! merging byte pairs: start from single bytes and repeatedly merge the adjacent pair
//! whose concatenation has the lowest rank (the leftmost on ties) until no adjacent pair
//! is a token. [`Ranks::piece_count`] does the same, counting the parts left at the end.
//! What makes it fast is the lookup: a token of up to 15 bytes is packed with its length
//! into one `u128`, so looking up a slice of the text is a 16-byte load and a
//! multiply-fold hash, then a filter bit that turns most slices that are no token away,
//! and a probe of compact tables (see [`Ranks`]), with no allocation. Two-byte slices,
//! the merge loop's first lookups, are read from a direct table. Longer tokens (a few
//! percent of the vocabulary) are compared byte by byte.
//!
//! A piece with non-ASCII chars that is not one token (a CJK clause is a single piece)
//! is first cut at the char boundaries no token spans ([`Bounds`]); its parts are mostly
//! single tokens or short pieces the memo knows. Parts of up to 48 bytes are merged;
//! longer ones go to the `bpe` crate's backtracking counter, which is linear where the
//! merge loop is quadratic; it gives the same counts (it is built to, and the tests
//! check it against the merge loop).

use bpe_openai::byte_pair_encoding::BytePairEncoding;

use super::bounds::{char_len, Bounds};

/// Longest piece the merge loop handles (and the memo keeps); longer ones go to the
/// `bpe` crate, which is faster on them.
pub const MERGE_MAX: usize = PACKED_MAX;

/// Whether short pieces with non-ASCII chars are cut before merging.
const CUT_SHORT: bool = true;

/// Longest piece the merge loop counts; longer ones go to the `bpe` crate, whose
/// counter is linear where the loop is quadratic, and faster on them.
pub const MERGE_LONG: usize = 48;

/// Longest token packed into a `u128` key (the 16th byte holds the length).
const PACKED_MAX: usize = 15;

const K1: u64 = 0x9e37_79b9_7f4a_7c15;
const K2: u64 = 0xc2b2_ae3d_27d4_eb4f;

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = (a as u128).wrapping_mul(b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Bits of the token filter ([`Ranks`]): 2^21 bits, 256 KB.
const FILTER_BITS: u32 = 21;

/// The filter bit of a hash (bits the slot index and fingerprint use less).
#[inline(always)]
fn filter_bit(h: u64) -> usize {
    ((h >> 32) as usize) & ((1 << FILTER_BITS) - 1)
}

/// Longest token in the small table ([`Ranks`]).
const SMALL_MAX: usize = 5;
/// A small table entry: the token's bytes in bits 0 to 39, its length in 40 to 42, its
/// rank from bit 43 (never 0, as the length is at least 1).
const SMALL_RANK_SHIFT: u32 = 43;
const SMALL_KEY_MASK: u64 = (1 << SMALL_RANK_SHIFT) - 1;

/// The key of a small token: the low `len` bytes of `packed`, and `len`.
#[inline(always)]
fn small_key(packed: u64, len: usize) -> u64 {
    (packed & ((1 << (8 * len)) - 1)) | ((len as u64) << 40)
}

/// The hash bits a slot keeps, in the bits above its rank.
#[inline(always)]
fn fingerprint(h: u64) -> u32 {
    (h as u32) & !RANK_MASK
}

#[inline(always)]
fn hash_packed(key: u128) -> u64 {
    fold((key as u64) ^ K1, ((key >> 64) as u64) ^ K2)
}

fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = bytes.len() as u64;
    for chunk in bytes.chunks(16) {
        h = hash_packed(pack(chunk) ^ h as u128);
    }
    h
}

/// `bytes` (at most 16 of them) little-endian in a `u128`, the length in the top byte
/// when there are fewer than 16.
#[inline(always)]
fn pack(bytes: &[u8]) -> u128 {
    let mut buf = [0u8; 16];
    buf[..bytes.len()].copy_from_slice(bytes);
    if bytes.len() < 16 {
        buf[15] = bytes.len() as u8;
    }
    u128::from_le_bytes(buf)
}

/// `text[s..e]` packed as by [`pack`] (`e - s <= 15`), reading 16 bytes at once when the
/// text has them.
#[inline(always)]
fn pack_at(text: &[u8], s: usize, e: usize) -> u128 {
    let len = e - s;
    match text.get(s..s + 16) {
        Some(window) => {
            let mut buf = [0u8; 16];
            buf.copy_from_slice(window);
            let v = u128::from_le_bytes(buf);
            let mask = (1u128 << (8 * len)) - 1;
            (v & mask) | ((len as u128) << 120)
        }
        None => pack(&text[s..e]),
    }
}

/// Slots of a memo: direct-mapped, so a lookup is one probe and an insert overwrites,
/// with no growth, no clearing and a fixed 68 KB per thread and encoding.
const MEMO_SLOTS: usize = 1 << 12;

/// Per-thread memory of the counts of short multi-token pieces (see
/// [`Ranks::piece_count`]): the packed piece and its count, in the slot its hash picks.
/// A packed piece is never 0 (its length byte is at least 2 here), so 0 marks a free
/// slot.
pub struct Memo {
    keys: Box<[u128; MEMO_SLOTS]>,
    counts: Box<[u8; MEMO_SLOTS]>,
}

impl Default for Memo {
    fn default() -> Self {
        Memo {
            keys: Box::new([0; MEMO_SLOTS]),
            counts: Box::new([0; MEMO_SLOTS]),
        }
    }
}

/// Bits of a slot that hold a rank: enough for o200k_base's 200,000 tokens.
const RANK_BITS: u32 = 18;
const RANK_MASK: u32 = (1 << RANK_BITS) - 1;
/// A free slot (its rank bits are past every vocabulary).
const EMPTY: u32 = u32::MAX;
/// `keys` entry of a token longer than [`PACKED_MAX`] (no packed key has a top byte of
/// 0xff), whose bytes are compared in the `bpe` crate's copy instead.
const LONG: u128 = u128::MAX;

/// Ranks of one vocabulary, for lookups by byte slice.
///
/// A lookup first tests the slice's bit in a filter of every token's hash (256 KB): most
/// lookups are for slices that are not tokens, and most of those end there. A slice of
/// up to 5 bytes is then looked up in a table holding each short token whole in one
/// `u64`; a longer one in an open-addressing table of `u32` slots, each a rank and 14
/// bits of its key's hash, where only a slot whose hash bits match sends it on to the
/// token's key. That table is about 76% full (1 MB for o200k_base): a probe stays within
/// a cache line or two, and a smaller table stays in the CPU's caches better.
pub struct Ranks {
    slots: Vec<u32>,
    /// `64 - log2(slots.len())`: the hash's top bits pick the first slot.
    shift: u32,
    /// Each token's bytes packed by [`pack`], by rank, or [`LONG`].
    keys: Vec<u128>,
    bpe: &'static BytePairEncoding,
    bounds: Bounds,
    /// One bit per hash of every token (bits 32 to 52 of its hash): a slice whose bit
    /// is clear is no token, known from a 256 KB table that stays in the CPU's cache,
    /// without reading the 2 MB slot table. The merge loop mostly looks up slices that
    /// are not tokens.
    filter: Vec<u64>,
    /// Tokens of up to [`SMALL_MAX`] bytes, each in one `u64` with its length and rank
    /// ([`small_key`]), by open addressing: a lookup of a short slice (most of the merge
    /// loop's) reads one cache line, where the main table reads a slot and then the
    /// token's key.
    small: Vec<u64>,
    /// `64 - log2(small.len())`.
    small_shift: u32,
    /// Rank of every two-byte slice (`u32::MAX` if not a token), by `b0 * 256 + b1`:
    /// the merge loop starts with a lookup of each adjacent byte pair, and this 256 KB
    /// table answers those from the CPU's cache where the hash table would not.
    pairs: Vec<u32>,
}

impl Ranks {
    /// The tables of `bpe`'s vocabulary (its token ids are tiktoken's ranks).
    pub fn new(bpe: &'static BytePairEncoding) -> Self {
        let n = bpe.num_tokens();
        // Both vocabularies fit; a bigger one would need wider slots, never wrong counts.
        assert!(
            n < RANK_MASK as usize,
            "vocabulary too large for the rank table"
        );
        let bits = (n * 5 / 4).next_power_of_two().trailing_zeros();
        let mut slots = vec![EMPTY; 1 << bits];
        let mut filter = vec![0u64; (1 << FILTER_BITS) / 64];
        let mut keys = Vec::with_capacity(n);
        let shift = 64 - bits;
        for rank in 0..n as u32 {
            let bytes = bpe.token_bytes(rank);
            let h = if bytes.len() <= PACKED_MAX {
                let key = pack(bytes);
                keys.push(key);
                hash_packed(key)
            } else {
                keys.push(LONG);
                hash_bytes(bytes)
            };
            let mut i = (h >> shift) as usize;
            while slots[i] != EMPTY {
                i = (i + 1) & (slots.len() - 1);
            }
            slots[i] = fingerprint(h) | rank;
            let f = filter_bit(h);
            filter[f / 64] |= 1 << (f % 64);
        }
        let n_small = (0..n as u32)
            .filter(|&r| bpe.token_bytes(r).len() <= SMALL_MAX)
            .count();
        let small_bits = (n_small * 2).next_power_of_two().trailing_zeros();
        let small_shift = 64 - small_bits;
        let mut small = vec![0u64; 1 << small_bits];
        for rank in 0..n as u32 {
            let bytes = bpe.token_bytes(rank);
            if bytes.len() <= SMALL_MAX {
                let key = small_key(pack(bytes) as u64, bytes.len());
                let mut i = (key.wrapping_mul(K1) >> small_shift) as usize;
                while small[i] != 0 {
                    i = (i + 1) & (small.len() - 1);
                }
                small[i] = key | (u64::from(rank) << SMALL_RANK_SHIFT);
            }
        }
        let mut pairs = vec![u32::MAX; 65_536];
        for rank in 0..n as u32 {
            if let &[b0, b1] = bpe.token_bytes(rank) {
                pairs[usize::from(b0) * 256 + usize::from(b1)] = rank;
            }
        }
        Ranks {
            slots,
            shift,
            keys,
            bpe,
            bounds: Bounds::new(bpe),
            filter,
            small,
            small_shift,
            pairs,
        }
    }

    /// Rank of the token `text[s..e]`, or `u32::MAX` if it is not one.
    #[inline(always)]
    fn rank(&self, text: &[u8], s: usize, e: usize) -> u32 {
        let packed = e - s <= PACKED_MAX;
        let (h, key) = if packed {
            let key = pack_at(text, s, e);
            (hash_packed(key), key)
        } else {
            (hash_bytes(&text[s..e]), LONG)
        };
        let f = filter_bit(h);
        if self.filter[f / 64] & (1 << (f % 64)) == 0 {
            return u32::MAX;
        }
        if e - s <= SMALL_MAX {
            return self.small_rank(key as u64, e - s);
        }
        let fp = fingerprint(h);
        let mask = self.slots.len() - 1;
        let mut i = (h >> self.shift) as usize;
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return u32::MAX;
            }
            if slot & !RANK_MASK == fp {
                let rank = slot & RANK_MASK;
                let k = self.keys[rank as usize];
                if k == key && (packed || self.bpe.token_bytes(rank) == &text[s..e]) {
                    return rank;
                }
            }
            i = (i + 1) & mask;
        }
    }

    /// Rank of the token of `len` (at most [`SMALL_MAX`]) bytes whose bytes are the low
    /// bytes of `packed`, or `u32::MAX`.
    #[inline(always)]
    fn small_rank(&self, packed: u64, len: usize) -> u32 {
        let key = small_key(packed, len);
        let mask = self.small.len() - 1;
        let mut i = (key.wrapping_mul(K1) >> self.small_shift) as usize;
        loop {
            let v = self.small[i];
            if v == 0 {
                return u32::MAX;
            }
            if v & SMALL_KEY_MASK == key {
                return (v >> SMALL_RANK_SHIFT) as u32;
            }
            i = (i + 1) & mask;
        }
    }

    /// Rank of the two-byte token `b0 b1`, or `u32::MAX` if it is not one.
    #[inline(always)]
    fn pair_rank(&self, b0: u8, b1: u8) -> u32 {
        self.pairs[usize::from(b0) * 256 + usize::from(b1)]
    }

    #[cfg(test)]
    pub fn memo_len(memo: &Memo) -> usize {
        memo.keys.iter().filter(|&&k| k != 0).count()
    }

    /// Number of tokens tiktoken encodes the piece `text[s..e]` into (`s < e`, both
    /// char boundaries of the valid UTF-8 `text`).
    ///
    /// `memo` remembers the counts of short pieces that are not single tokens (a
    /// made-up word, a run of emoji): a text repeats those far more often than it is
    /// long, and a lookup there is cheaper than merging again. A piece with non-ASCII
    /// chars that is not one token (a CJK clause, a Hangul word) is first cut where no
    /// merge can cross ([`Bounds`]), and its parts counted one by one.
    #[inline]
    pub fn piece_count(&self, memo: &mut Memo, text: &[u8], s: usize, e: usize) -> u64 {
        if e - s > MERGE_MAX {
            return if self.rank(text, s, e) != u32::MAX {
                1
            } else {
                self.cut_count(memo, text, s, e)
            };
        }
        self.short_count(memo, text, s, e, CUT_SHORT)
    }

    /// The count of a piece of at most [`MERGE_MAX`] bytes: one token, or known to the
    /// memo, or merged (after cutting it, if `cut` and it has non-ASCII chars).
    #[inline(always)]
    fn short_count(&self, memo: &mut Memo, text: &[u8], s: usize, e: usize, cut: bool) -> u64 {
        match e - s {
            // Every byte is a token of these byte-level vocabularies.
            1 => return 1,
            2 => {
                return if self.pair_rank(text[s], text[s + 1]) == u32::MAX {
                    2
                } else {
                    1
                }
            }
            _ => {}
        }
        if self.rank(text, s, e) != u32::MAX {
            return 1;
        }
        if e - s == 3 {
            // Not one token: two if either pair merges first, else three bytes.
            let merges = self.pair_rank(text[s], text[s + 1]) != u32::MAX
                || self.pair_rank(text[s + 1], text[s + 2]) != u32::MAX;
            return if merges { 2 } else { 3 };
        }
        let key = pack_at(text, s, e);
        let slot = (hash_packed(key) >> (64 - MEMO_SLOTS.trailing_zeros())) as usize;
        if memo.keys[slot] == key {
            return memo.counts[slot].into();
        }
        let count = if cut && !text[s..e].is_ascii() {
            self.cut_count(memo, text, s, e)
        } else {
            self.merge_count(text, s, e)
        };
        memo.keys[slot] = key;
        // At most one token per byte, so the count fits a u8.
        memo.counts[slot] = count as u8;
        count
    }

    /// The count of a piece that is not one token: the sum over its parts between the
    /// char boundaries no token spans ([`Bounds`]).
    fn cut_count(&self, memo: &mut Memo, text: &[u8], s: usize, e: usize) -> u64 {
        let step = |i: usize| (i + char_len(text[i]).max(1)).min(e);
        let mut total = 0;
        let mut part = s;
        let mut c1 = s;
        let mut p = step(s);
        while p < e {
            let c2 = step(p);
            if self.bounds.forced(text, c1, p, c2) {
                total += self.part_count(memo, text, part, p);
                part = p;
            }
            c1 = p;
            p = c2;
        }
        if part == s {
            // No cut: the whole piece, which is known not to be one token.
            return self.uncut_count(text, s, e);
        }
        total + self.part_count(memo, text, part, e)
    }

    /// The count of a part of a cut piece (no boundary inside it is forced).
    #[inline]
    fn part_count(&self, memo: &mut Memo, text: &[u8], s: usize, e: usize) -> u64 {
        if e - s <= MERGE_MAX {
            self.short_count(memo, text, s, e, false)
        } else if self.rank(text, s, e) != u32::MAX {
            1
        } else {
            self.uncut_count(text, s, e)
        }
    }

    /// The count of a piece that is not one token, by merging it (short) or with the
    /// `bpe` crate's counter (long: linear where the merge loop is quadratic).
    fn uncut_count(&self, text: &[u8], s: usize, e: usize) -> u64 {
        if e - s <= MERGE_LONG {
            self.merge_count(text, s, e)
        } else {
            self.bpe.count(&text[s..e]) as u64
        }
    }

    /// tiktoken's `byte_pair_merge` on `text[s..e]` (2 to [`MERGE_LONG`] bytes), counting
    /// the parts it ends with.
    fn merge_count(&self, text: &[u8], s: usize, e: usize) -> u64 {
        let n = e - s;
        // Part boundaries (offsets from `s`) and, for each part, the rank of it merged
        // with the next one.
        let mut pos = [0u8; MERGE_LONG + 1];
        let mut rank = [u32::MAX; MERGE_LONG + 1];
        for (i, p) in pos.iter_mut().enumerate().take(n + 1) {
            *p = i as u8;
        }
        for (i, r) in rank.iter_mut().enumerate().take(n - 1) {
            *r = self.pair_rank(text[s + i], text[s + i + 1]);
        }
        let mut parts = n;
        loop {
            // The lowest rank, then its first position (tiktoken merges the leftmost of
            // equal ranks).
            let live = &rank[..parts - 1];
            let best = live.iter().copied().min().unwrap_or(u32::MAX);
            if best == u32::MAX {
                return parts as u64;
            }
            let at = live.iter().position(|&r| r == best).unwrap_or(0);
            // Merge parts `at` and `at + 1`: drop boundary `at + 1`.
            pos.copy_within(at + 2..=parts, at + 1);
            rank.copy_within(at + 2..parts, at + 1);
            parts -= 1;
            rank[at] = if at + 2 <= parts {
                self.rank(text, s + pos[at] as usize, s + pos[at + 2] as usize)
            } else {
                u32::MAX
            };
            if at > 0 {
                rank[at - 1] = self.rank(text, s + pos[at - 1] as usize, s + pos[at + 1] as usize);
            }
        }
    }
}
