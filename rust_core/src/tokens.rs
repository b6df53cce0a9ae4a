//! Token counting: exact OpenAI BPE counts and the character estimators behind one enum.
//!
//! The exact encodings come from the `bpe-openai` crate, which compiles the
//! `o200k_base` / `cl100k_base` vocabularies into the binary at build time, so counting
//! never touches the network or the file system. Its counts equal `tiktoken`'s token for
//! token (the Python tests check this against `tiktoken` itself).
//!
//! A count is the sum, over the pretokenizer's pieces, of each piece's BPE count. Two
//! things make it faster than `bpe_openai::Tokenizer::count` while giving the same
//! pieces and so the same counts:
//! - most text is ASCII, and for ASCII the pretokenizer regex reduces to a few rules on
//!   byte classes, which [`ascii_piece_end`] applies directly; anything that depends on a
//!   non-ASCII character is left to the crate's regex;
//! - most pieces are short, frequent words, so a bounded per-thread cache from piece to
//!   count ([`PieceCache`]) skips the BPE for repeats, as tiktoken's and Hugging Face
//!   tokenizers' caches do.

use std::cell::RefCell;
use std::str::FromStr;

use bpe_openai::byte_pair_encoding::BytePairEncoding;
use bpe_openai::Tokenizer;
use hashbrown::HashMap;
use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};
use crate::estimate::{estimate_tokens, estimate_tokens_chars_div4};

/// A way of turning text into a token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// OpenAI's `o200k_base` (GPT-4o, GPT-4.1, o-series, GPT-5): exact.
    O200kBase,
    /// OpenAI's `cl100k_base` (GPT-4, GPT-3.5): exact.
    Cl100kBase,
    /// The character estimate `(chars + 3) / 4`: an estimate, used where no tokenizer is public.
    Estimate,
    /// `chars / 4`: the plain estimate, kept for reproducing older figures.
    CharsDiv4,
}

/// Batches whose total size is below this many bytes are counted on the calling thread:
/// below it, handing work to rayon's pool costs more than it saves.
pub const PARALLEL_MIN_BYTES: usize = 64 * 1024;

impl Encoding {
    /// Every accepted name, in the order error messages list them.
    pub const NAMES: [&'static str; 4] = ["o200k_base", "cl100k_base", "estimate", "chars_div4"];

    /// The name this encoding is parsed from.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
            Encoding::Estimate => "estimate",
            Encoding::CharsDiv4 => "chars_div4",
        }
    }

    /// Whether counts are exact (a real tokenizer) rather than a character-based estimate.
    pub fn is_exact(self) -> bool {
        matches!(self, Encoding::O200kBase | Encoding::Cl100kBase)
    }

    /// Token count of one text.
    pub fn count(self, text: &str) -> u64 {
        match self {
            Encoding::O200kBase | Encoding::Cl100kBase => {
                let o200k = self == Encoding::O200kBase;
                let slot = usize::from(o200k);
                CACHES
                    .try_with(|caches| count_exact(o200k, &mut caches.borrow_mut()[slot], text))
                    // Only while this thread is being torn down: count without the cache.
                    .unwrap_or_else(|_| count_exact(o200k, &mut PieceCache::default(), text))
            }
            Encoding::Estimate => estimate_tokens(text),
            Encoding::CharsDiv4 => estimate_tokens_chars_div4(text),
        }
    }

    /// Token counts of many texts, in order. Large batches of exact counts are spread over
    /// all cores (the tokenizers are immutable statics, so sharing them is free).
    pub fn count_batch<S: AsRef<str> + Sync>(self, texts: &[S]) -> Vec<u64> {
        let bytes: usize = texts.iter().map(|t| t.as_ref().len()).sum();
        if texts.len() > 1 && self.is_exact() && bytes >= PARALLEL_MIN_BYTES {
            texts.par_iter().map(|t| self.count(t.as_ref())).collect()
        } else {
            texts.iter().map(|t| self.count(t.as_ref())).collect()
        }
    }
}

impl FromStr for Encoding {
    type Err = CoreError;

    fn from_str(name: &str) -> CoreResult<Self> {
        match name {
            "o200k_base" => Ok(Encoding::O200kBase),
            "cl100k_base" => Ok(Encoding::Cl100kBase),
            "estimate" => Ok(Encoding::Estimate),
            "chars_div4" => Ok(Encoding::CharsDiv4),
            other => Err(CoreError::UnknownEncoding(other.to_owned())),
        }
    }
}

/// Count one text with the encoding named `encoding`.
pub fn count_tokens(text: &str, encoding: &str) -> CoreResult<u64> {
    Ok(encoding.parse::<Encoding>()?.count(text))
}

/// Count many texts with the encoding named `encoding`.
pub fn count_tokens_batch<S: AsRef<str> + Sync>(
    texts: &[S],
    encoding: &str,
) -> CoreResult<Vec<u64>> {
    Ok(encoding.parse::<Encoding>()?.count_batch(texts))
}

thread_local! {
    /// One piece cache per exact encoding (index 0: cl100k_base, 1: o200k_base) and per
    /// thread, so rayon workers and Python threads never contend for it.
    static CACHES: RefCell<[PieceCache; 2]> = RefCell::default();
}

/// Exact token count of `text` with o200k_base (`o200k`) or cl100k_base.
///
/// Same result as `bpe_openai`'s `Tokenizer::count`: the same pieces (its `split`, or the
/// equivalent [`ascii_piece_end`]) and the same BPE count for each. Neither encoding
/// normalizes its input (the crate's `nfc` flag is false for both), so there is no
/// normalization to repeat here.
fn count_exact(o200k: bool, cache: &mut PieceCache, text: &str) -> u64 {
    let tok: &Tokenizer = if o200k {
        bpe_openai::o200k_base()
    } else {
        bpe_openai::cl100k_base()
    };
    let bytes = text.as_bytes();
    let mut total = 0;
    let mut start = 0;
    while start < bytes.len() {
        let end = match ascii_piece_end(bytes, start, o200k) {
            Some(end) => end,
            // The regex is anchored at the start of what it is given, so its first piece
            // of the rest of the text is the piece its own `split` would yield here.
            // `start` is a char boundary: every piece ends on one.
            None => match tok.split(&text[start..]).next() {
                Some(piece) if !piece.is_empty() => start + piece.len(),
                // Never happens (every char matches some alternative, and no match is
                // empty); if it did, the rest would count as one piece rather than the
                // loop stopping short or never ending.
                _ => bytes.len(),
            },
        };
        total += cache.count(&tok.bpe, &bytes[start..end]);
        start = end;
    }
    total
}

/// What the pretokenizer regexes need to know about a byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Lower,
    Upper,
    Digit,
    /// `\r` or `\n`.
    Newline,
    /// Other ASCII white space (`\s`): space, tab, vertical tab, form feed.
    Space,
    /// Any other ASCII byte (punctuation, control characters): `[^\s\p{L}\p{N}]`.
    Punct,
    /// Part of a non-ASCII character: only the regex knows its Unicode classes.
    NonAscii,
    /// Past the end of the text.
    End,
}

fn class(bytes: &[u8], i: usize) -> Class {
    match bytes.get(i) {
        None => Class::End,
        Some(b'a'..=b'z') => Class::Lower,
        Some(b'A'..=b'Z') => Class::Upper,
        Some(b'0'..=b'9') => Class::Digit,
        Some(b'\r' | b'\n') => Class::Newline,
        Some(b' ' | b'\t' | 0x0b | 0x0c) => Class::Space,
        Some(0x80..) => Class::NonAscii,
        Some(_) => Class::Punct,
    }
}

/// The first index at or after `i` whose class fails `keep`.
fn run_end(bytes: &[u8], mut i: usize, keep: impl Fn(Class) -> bool) -> usize {
    while keep(class(bytes, i)) {
        i += 1;
    }
    i
}

/// End of the pretokenizer piece that starts at `start`, or `None` when it depends on a
/// non-ASCII character (the caller then asks the regex).
///
/// These are the o200k_base / cl100k_base patterns restricted to ASCII, where `\p{L}` is
/// `[A-Za-z]` (upper and lower case disjoint), `\p{N}` is `[0-9]` and `\s` is
/// `[ \t\n\x0b\x0c\r]`. The alternatives are tried in the patterns' order, as the
/// leftmost-first regex does:
/// 1. (cl100k only) a contraction: `'s|'t|'re|'ve|'m|'ll|'d`, any case;
/// 2. letters, after at most one char that is not a newline, letter or digit; o200k
///    takes upper case then lower case letters and then a contraction;
/// 3. one to three digits;
/// 4. an optional space, punctuation, then `\r`, `\n` (and `/` for o200k);
/// 5. white space up to its last newline; else white space to the end of the text; else
///    a white space run without its last char (`\s+(?!\S)`); else one white space char.
///
/// Every run is checked to end on an ASCII byte or the end of the text, because a
/// non-ASCII letter, digit, mark or space could extend it.
fn ascii_piece_end(bytes: &[u8], start: usize, o200k: bool) -> Option<usize> {
    use Class::*;
    let first = class(bytes, start);
    if !o200k {
        let n = contraction_len(bytes, start)?;
        if n > 0 {
            return Some(start + n);
        }
    }
    let letters = match first {
        Lower | Upper => Some(start),
        Space | Punct => match class(bytes, start + 1) {
            Lower | Upper => Some(start + 1),
            NonAscii => return None,
            _ => None,
        },
        _ => None,
    };
    if let Some(letters) = letters {
        let end = if o200k {
            let upper_end = run_end(bytes, letters, |c| c == Upper);
            run_end(bytes, upper_end, |c| c == Lower)
        } else {
            run_end(bytes, letters, |c| matches!(c, Lower | Upper))
        };
        if class(bytes, end) == NonAscii {
            return None;
        }
        return Some(if o200k {
            end + contraction_len(bytes, end)?
        } else {
            end
        });
    }
    match first {
        Digit => {
            // Look at no more than three digits, so a long number stays linear.
            let end = (start..start + 3)
                .find(|&i| class(bytes, i) != Digit)
                .unwrap_or(start + 3);
            (end == start + 3 || class(bytes, end) != NonAscii).then_some(end)
        }
        // The optional prefix is a literal space, not any white space.
        Punct | Space
            if first == Punct || (bytes[start] == b' ' && class(bytes, start + 1) == Punct) =>
        {
            let punct = if first == Punct { start } else { start + 1 };
            let end = run_end(bytes, punct, |c| c == Punct);
            if class(bytes, end) == NonAscii {
                return None;
            }
            let mut end = end;
            while matches!(bytes.get(end), Some(b'\r' | b'\n'))
                || (o200k && bytes.get(end) == Some(&b'/'))
            {
                end += 1;
            }
            Some(end)
        }
        Space | Newline => {
            let end = run_end(bytes, start, |c| matches!(c, Space | Newline));
            if class(bytes, end) == NonAscii {
                return None;
            }
            if let Some(last) = bytes[start..end]
                .iter()
                .rposition(|&b| matches!(b, b'\r' | b'\n'))
            {
                Some(start + last + 1)
            } else if end == bytes.len() || end == start + 1 {
                Some(end)
            } else {
                Some(end - 1)
            }
        }
        _ => None,
    }
}

/// Length of the contraction (`'s|'t|'re|'ve|'m|'ll|'d`, any case) at `i`, 0 if there is
/// none, or `None` if a non-ASCII char decides it (`(?i)s` also matches `ſ`).
fn contraction_len(bytes: &[u8], i: usize) -> Option<usize> {
    if bytes.get(i) != Some(&b'\'') {
        return Some(0);
    }
    let at = |k: usize| bytes.get(i + k).map(u8::to_ascii_lowercase);
    let second = |want: u8| match at(2) {
        Some(b) if b == want => Some(3),
        Some(0x80..) => None,
        _ => Some(0),
    };
    match at(1) {
        Some(b's' | b't' | b'm' | b'd') => Some(2),
        Some(b'r' | b'v') => second(b'e'),
        Some(b'l') => second(b'l'),
        Some(0x80..) => None,
        _ => Some(0),
    }
}

/// Longest piece the cache holds: its bytes and length pack into one `u128` key, which
/// hashes and compares much faster than a heap-allocated byte string. Longer pieces are
/// rare and seldom repeat.
const CACHED_PIECE_MAX: usize = 15;

/// Entries at which a cache is emptied, so its memory stays bounded. It is hashbrown's
/// capacity for 2^16 buckets of 33 bytes, so a cache never takes more than about 2 MB.
/// Emptying is cheap and frequent pieces come back at once.
const CACHE_MAX_ENTRIES: usize = (1 << 16) / 8 * 7;

/// A bounded memo of BPE counts of pretokenizer pieces, for one encoding.
#[derive(Default)]
struct PieceCache {
    counts: HashMap<u128, u8>,
}

impl PieceCache {
    /// BPE count of one piece, from the cache when it was seen before.
    fn count(&mut self, bpe: &BytePairEncoding, piece: &[u8]) -> u64 {
        match piece.len() {
            // Every single byte is a token of these byte-level vocabularies.
            1 => 1,
            2..=CACHED_PIECE_MAX => {
                let mut key = [0u8; 16];
                key[..piece.len()].copy_from_slice(piece);
                key[15] = piece.len() as u8;
                let key = u128::from_le_bytes(key);
                if let Some(&n) = self.counts.get(&key) {
                    return n.into();
                }
                // At most one token per byte, so the count fits a u8.
                let n = bpe.count(piece) as u8;
                if self.counts.len() >= CACHE_MAX_ENTRIES {
                    self.counts.clear();
                }
                self.counts.insert(key, n);
                n.into()
            }
            _ => bpe.count(piece) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known counts, checked against tiktoken 0.14.
    #[test]
    fn known_o200k_counts() {
        assert_eq!(count_tokens("", "o200k_base").unwrap(), 0);
        assert_eq!(count_tokens("hello world", "o200k_base").unwrap(), 2);
        assert_eq!(
            count_tokens("The quick brown fox jumps over the lazy dog.", "o200k_base").unwrap(),
            10
        );
        assert_eq!(count_tokens("你好，世界", "o200k_base").unwrap(), 3);
    }

    #[test]
    fn known_cl100k_counts() {
        assert_eq!(count_tokens("hello world", "cl100k_base").unwrap(), 2);
        assert_eq!(
            count_tokens(
                "The quick brown fox jumps over the lazy dog.",
                "cl100k_base"
            )
            .unwrap(),
            10
        );
        assert_eq!(count_tokens("你好，世界", "cl100k_base").unwrap(), 6);
    }

    #[test]
    fn estimators_match_seeds() {
        assert_eq!(count_tokens("abcde", "estimate").unwrap(), 2);
        assert_eq!(count_tokens("abcde", "chars_div4").unwrap(), 1);
    }

    #[test]
    fn unknown_encoding_is_an_error_naming_the_choices() {
        let err = count_tokens("x", "p50k_base").unwrap_err();
        assert_eq!(err, CoreError::UnknownEncoding("p50k_base".into()));
        let msg = err.to_string();
        assert!(
            msg.contains("p50k_base") && msg.contains("o200k_base"),
            "{msg}"
        );
    }

    #[test]
    fn batch_equals_singles_on_both_paths() {
        let small = vec!["a b c".to_string(), "def ghi".to_string(), String::new()];
        let big: Vec<String> = (0..200)
            .map(|i| format!("message {i}: {}", "lorem ipsum dolor ".repeat(i % 50)))
            .collect();
        assert!(big.iter().map(String::len).sum::<usize>() >= PARALLEL_MIN_BYTES);
        for enc in Encoding::NAMES {
            for texts in [&small, &big] {
                let batch = count_tokens_batch(texts, enc).unwrap();
                let singles: Vec<u64> = texts
                    .iter()
                    .map(|t| count_tokens(t, enc).unwrap())
                    .collect();
                assert_eq!(batch, singles, "{enc}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for name in Encoding::NAMES {
            assert_eq!(name.parse::<Encoding>().unwrap().name(), name);
        }
    }

    fn tokenizer(o200k: bool) -> &'static Tokenizer {
        if o200k {
            bpe_openai::o200k_base()
        } else {
            bpe_openai::cl100k_base()
        }
    }

    /// The pieces `count_exact` counts: ASCII rules, else the regex.
    fn pieces(o200k: bool, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = ascii_piece_end(text.as_bytes(), start, o200k).unwrap_or_else(|| {
                start + tokenizer(o200k).split(&text[start..]).next().unwrap().len()
            });
            out.push(&text[start..end]);
            start = end;
        }
        out
    }

    #[track_caller]
    fn assert_same_pieces(text: &str) {
        for o200k in [true, false] {
            let want: Vec<&str> = tokenizer(o200k).split(text).collect();
            assert_eq!(pieces(o200k, text), want, "o200k={o200k} text={text:?}");
        }
    }

    /// Deterministic xorshift, so failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// Characters whose classes matter to the patterns, including non-ASCII ones that
    /// continue a run (letters of each category, a mark, a digit, spaces) or a
    /// contraction (`ſ` folds to `s`).
    const NON_ASCII: [char; 14] = [
        'é', 'É', 'ǅ', 'ʰ', '中', '\u{301}', '٣', '\u{a0}', '\u{85}', '\u{3000}', 'ſ', '—', '🙂',
        '\u{2028}',
    ];

    /// Longer runs than random characters make.
    const FRAGMENTS: [&str; 12] = [
        "hello", "WORLD", "McDonald", "  ", "\n\n", "'s", "'LL", "'re", "123456", "!!", "//",
        " \t ",
    ];

    #[test]
    fn ascii_rules_match_the_regex_on_all_short_strings() {
        let alphabet = [
            'a', 'Z', 's', 'L', 'e', '7', ' ', '\t', '\n', '\r', '\x0b', '!', '/', '\'', 'é', 'ſ',
            '\u{a0}', '٣',
        ];
        let mut text = String::new();
        for len in 1..=4u32 {
            for mut i in 0..alphabet.len().pow(len) {
                text.clear();
                for _ in 0..len {
                    text.push(alphabet[i % alphabet.len()]);
                    i /= alphabet.len();
                }
                assert_same_pieces(&text);
            }
        }
    }

    #[test]
    fn ascii_rules_match_the_regex_for_every_ascii_char() {
        for b in 0u8..128 {
            let c = b as char;
            for text in [
                format!("{c}"),
                format!("{c}{c}{c}"),
                format!("a{c}a"),
                format!("{c}ab"),
                format!("{c}AB "),
                format!(" {c}x"),
                format!("{c} "),
                format!("{c}\n"),
                format!("1{c}1"),
                format!("'{c}"),
                format!("{c}'s"),
                format!("  {c}  "),
                format!("{c}é"),
            ] {
                assert_same_pieces(&text);
            }
        }
    }

    #[test]
    fn ascii_rules_match_the_regex_on_random_strings() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut text = String::new();
        for _ in 0..30_000 {
            text.clear();
            for _ in 0..rng.below(64) {
                let i = rng.below(128 + 60);
                match i {
                    0..128 => text.push(i as u8 as char),
                    128..148 => text.push_str(FRAGMENTS[i % FRAGMENTS.len()]),
                    _ => text.push(NON_ASCII[i % NON_ASCII.len()]),
                }
            }
            assert_same_pieces(&text);
        }
    }

    /// Texts of every kind, including long pieces the cache skips.
    fn mixed_texts() -> Vec<String> {
        let mut texts: Vec<String> = [
            "",
            " ",
            "   ",
            "\n\n\n",
            " \n \n ",
            "\t\t  \t",
            "a  b   c    d  ",
            "hello   \n\n   world  ",
            "\r\nx\r\n",
            "I'm you're they've he'd it's WE'RE I'LL don'tcha 'sa ''",
            "HTTPServer parseJSON getHTTPResponseCode XMLHttpRequest",
            "3.14159 1e10 -42 0x1F 1,000,000 12345678901234567890",
            "fn main() {\n    println!(\"{}\", x / 2); // done\n}\n",
            "{\"id\": 17, \"tags\": [\"a\", \"b\"], \"ok\": null}",
            "https://example.com/a/b?q=1&r=2#frag <|endoftext|> C:\\Users\\x",
            "你好，世界 日本語のテキストです。 한국어",
            "🚀🚀 emoji 👨\u{200d}👩\u{200d}👧 café naïve Ünïcödé ſtraße ǅemal",
            "antidisestablishmentarianism Pneumonoultramicroscopicsilicovolcanoconiosis",
        ]
        .map(String::from)
        .to_vec();
        for unit in ["a", " ", "\n", "ab", "!", "0", "é", "你", "🙂", " a", "aA"] {
            texts.push(unit.repeat(3000));
        }
        let mut rng = Rng(42);
        let b64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        texts.push((0..50_000).map(|_| b64[rng.below(64)] as char).collect());
        texts
    }

    #[test]
    fn exact_counts_equal_the_crates_and_cache_hits_change_nothing() {
        let texts = mixed_texts();
        for o200k in [true, false] {
            let enc = if o200k {
                Encoding::O200kBase
            } else {
                Encoding::Cl100kBase
            };
            let want: Vec<u64> = texts
                .iter()
                .map(|t| tokenizer(o200k).count(t.as_str()) as u64)
                .collect();
            // Fresh cache, then the same cache again (all hits), then the thread's cache.
            let mut cache = PieceCache::default();
            for _ in 0..2 {
                let got: Vec<u64> = texts
                    .iter()
                    .map(|t| count_exact(o200k, &mut cache, t))
                    .collect();
                assert_eq!(got, want, "o200k={o200k}");
            }
            assert!(!cache.counts.is_empty());
            assert_eq!(enc.count_batch(&texts), want, "o200k={o200k}");
        }
    }

    #[test]
    fn single_bytes_are_single_tokens() {
        for o200k in [true, false] {
            for b in 0..=255u8 {
                assert_eq!(tokenizer(o200k).bpe.count(&[b]), 1, "byte {b}");
            }
        }
    }

    #[test]
    fn cache_stays_bounded() {
        let bpe = &tokenizer(true).bpe;
        let mut cache = PieceCache::default();
        for i in 0..CACHE_MAX_ENTRIES as u64 * 3 {
            let piece = format!("x{i:x}");
            assert_eq!(
                cache.count(bpe, piece.as_bytes()),
                bpe.count(piece.as_bytes()) as u64
            );
            assert!(cache.counts.len() <= CACHE_MAX_ENTRIES);
        }
        // Emptied rather than grown: the table never reallocates past its first size.
        assert_eq!(cache.counts.capacity(), CACHE_MAX_ENTRIES);
    }

    #[test]
    fn threads_count_the_same() {
        let texts = mixed_texts();
        let want: Vec<u64> = texts
            .iter()
            .map(|t| bpe_openai::o200k_base().count(t.as_str()) as u64)
            .collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..3 {
                        let got: Vec<u64> =
                            texts.iter().map(|t| Encoding::O200kBase.count(t)).collect();
                        assert_eq!(got, want);
                    }
                });
            }
        });
    }
}
