//! Token counting: exact OpenAI BPE counts and the character estimators behind one enum.
//!
//! The exact encodings come from the `bpe-openai` crate, which compiles the
//! `o200k_base` / `cl100k_base` vocabularies into the binary at build time, so counting
//! never touches the network or the file system. Its counts equal `tiktoken`'s token for
//! token (the Python tests check this against `tiktoken` itself).
//!
//! A count is the sum, over the pretokenizer's pieces, of each piece's BPE count, as in
//! tiktoken. Both halves are done here rather than with the crate's `Tokenizer::count`,
//! for speed on text seen for the first time (no cache is involved):
//! - the pretokenizer regexes are written out by hand over a table of Unicode character
//!   classes ([`scan`], [`classes`]), checked piece for piece against the crate's regex;
//! - a piece that is one token is found with one hash lookup, a short one is merged with
//!   tiktoken's rule over fast rank tables; a piece with non-ASCII chars (a CJK clause)
//!   is first cut where the vocabulary proves no merge can cross ([`bounds`]), and only
//!   long uncut parts go to the crate's backtracking counter ([`ranks`]).

use std::cell::RefCell;
use std::str::FromStr;
use std::sync::OnceLock;

use rayon::prelude::*;

mod bounds;
mod classes;
mod ranks;
mod scan;

use ranks::{Memo, Ranks};

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
            Encoding::O200kBase => count_exact(true, text),
            Encoding::Cl100kBase => count_exact(false, text),
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

/// One exact encoding's tables, built on first use.
struct Exact {
    o200k: bool,
    ranks: Ranks,
}

fn exact(o200k: bool) -> &'static Exact {
    static O200K: OnceLock<Exact> = OnceLock::new();
    static CL100K: OnceLock<Exact> = OnceLock::new();
    let (cell, tok) = if o200k {
        (&O200K, bpe_openai::o200k_base())
    } else {
        (&CL100K, bpe_openai::cl100k_base())
    };
    cell.get_or_init(|| Exact {
        o200k,
        ranks: Ranks::new(&tok.bpe),
    })
}

/// Exact token count of `text` with o200k_base (`o200k`) or cl100k_base: the sum over
/// the pretokenizer's pieces ([`scan`]) of each piece's BPE count ([`Ranks`]), which is
/// what tiktoken computes. Neither encoding normalizes its input, so there is no
/// normalization to repeat here.
fn count_exact(o200k: bool, text: &str) -> u64 {
    MEMOS
        .try_with(|memos| count_with(o200k, &mut memos.borrow_mut()[usize::from(o200k)], text))
        // Only while this thread is being torn down: count without the memo.
        .unwrap_or_else(|_| count_with(o200k, &mut Memo::default(), text))
}

thread_local! {
    /// One memo per exact encoding (index 0: cl100k_base, 1: o200k_base) and per thread,
    /// so rayon workers and Python threads never contend for it.
    static MEMOS: RefCell<[Memo; 2]> = RefCell::default();
}

fn count_with(o200k: bool, memo: &mut Memo, text: &str) -> u64 {
    let enc = exact(o200k);
    let table = classes::table();
    let bytes = text.as_bytes();
    let mut total = 0;
    let mut start = 0;
    while start < bytes.len() {
        let end = if enc.o200k {
            scan::o200k(bytes, start, table)
        } else {
            scan::cl100k(bytes, start, table)
        };
        // Every piece holds at least one char; if a scanner ever failed that, the rest
        // would count as one piece rather than the loop never ending.
        let end = if end > start { end } else { bytes.len() };
        total += enc.ranks.piece_count(memo, bytes, start, end);
        start = end;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use bpe_openai::Tokenizer;

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

    /// The pieces `count_exact` counts.
    fn pieces(o200k: bool, text: &str) -> Vec<&str> {
        let table = classes::table();
        let mut out = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = if o200k {
                scan::o200k(text.as_bytes(), start, table)
            } else {
                scan::cl100k(text.as_bytes(), start, table)
            };
            assert!(end > start, "empty piece at {start} in {text:?}");
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

    use crate::test_rng::Rng;

    /// Characters whose classes matter to the patterns, including non-ASCII ones that
    /// continue a run (letters of each category, a mark, a digit, spaces) or a
    /// contraction (`ſ` folds to `s`).
    const NON_ASCII: [char; 16] = [
        'é', 'É', 'ǅ', 'ʰ', '中', '\u{301}', '٣', '\u{a0}', '\u{85}', '\u{3000}', 'ſ', '—', '🙂',
        '\u{2028}', 'K', '\u{200d}',
    ];

    /// Longer runs than random characters make.
    const FRAGMENTS: [&str; 12] = [
        "hello", "WORLD", "McDonald", "  ", "\n\n", "'s", "'LL", "'re", "123456", "!!", "//",
        " \t ",
    ];

    #[test]
    fn scanners_match_the_regex_on_all_short_strings() {
        let alphabet = [
            'a', 'Z', 's', 'L', 'e', '7', ' ', '\t', '\n', '\r', '\x0b', '!', '/', '\'', 'é', 'ſ',
            '\u{a0}', '٣', 'ʰ', '\u{301}', 'ǅ', '中',
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
    fn scanners_match_the_regex_for_every_assigned_code_point() {
        // Each code point in the contexts where its classes decide a piece's end: after
        // and before letters of each case, marks, digits, spaces, newlines, punctuation,
        // and inside contractions. Every code point of the planes where characters are
        // assigned (0 to 3, and 14), and a sample of the rest (unassigned or private use:
        // runs of one class), 64 code points per text to keep the test quick.
        let every =
            |cp: u32| cp < 0x4_0000 || (0xE_0000..0xE_1000).contains(&cp) || cp.is_multiple_of(97);
        let cps: Vec<char> = (0..0x11_0000u32)
            .filter(|&cp| every(cp))
            .filter_map(char::from_u32)
            .collect();
        let mut text = String::new();
        for chunk in cps.chunks(64) {
            text.clear();
            for &c in chunk {
                for ctx in [
                    "a", "A", "ʰ", "\u{301}", "1", "  ", "\n", "!", "'", "'r", "é",
                ] {
                    text.push_str(ctx);
                    text.push(c);
                    text.push(c);
                }
                text.push(' ');
            }
            assert_same_pieces(&text);
        }
    }

    #[test]
    fn scanners_match_the_regex_for_every_ascii_char() {
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
    fn scanners_match_the_regex_on_random_strings() {
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

    #[test]
    fn scanners_match_the_regex_on_random_unicode() {
        let mut rng = Rng(7);
        let mut text = String::new();
        for _ in 0..20_000 {
            text.clear();
            for _ in 0..rng.below(40) {
                let c = match rng.below(3) {
                    0 => char::from_u32(rng.below(0x11_0000) as u32),
                    1 => char::from_u32(rng.below(0x3000) as u32),
                    _ => Some(NON_ASCII[rng.below(NON_ASCII.len())]),
                };
                text.push(c.unwrap_or(' '));
            }
            assert_same_pieces(&text);
        }
    }

    /// Texts of every kind, including long pieces the merge loop hands on.
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
        for unit in [
            "a", " ", "\n", "ab", "!", "0", "é", "你", "🙂", " a", "aA", "的是",
        ] {
            texts.push(unit.repeat(3000));
        }
        let mut rng = Rng(42);
        let b64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        texts.push((0..50_000).map(|_| b64[rng.below(64)] as char).collect());
        // Runs of letters of every length across the merge loop's limit.
        let han = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下";
        let han: Vec<char> = han.chars().collect();
        for len in 1..80 {
            let word: String = (0..len)
                .map(|_| (b'a' + rng.below(26) as u8) as char)
                .collect();
            texts.push(format!(" {word} {}", word.to_uppercase()));
            let cjk: String = (0..len / 2 + 1)
                .map(|_| han[rng.below(han.len())])
                .collect();
            texts.push(cjk);
        }
        texts
    }

    #[test]
    fn exact_counts_equal_the_crates_and_memo_hits_change_nothing() {
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
            // A fresh memo, then the same memo again (hits), then the thread's memo.
            let mut memo = Memo::default();
            for _ in 0..2 {
                let got: Vec<u64> = texts
                    .iter()
                    .map(|t| count_with(o200k, &mut memo, t))
                    .collect();
                assert_eq!(got, want, "o200k={o200k}");
            }
            assert!(Ranks::memo_len(&memo) > 0);
            assert_eq!(enc.count_batch(&texts), want, "o200k={o200k}");
        }
    }

    #[test]
    fn merge_loop_equals_the_crates_counter_on_random_pieces() {
        // Pieces of every length up to the merge loop's limit, from byte alphabets that
        // make many merges (letters, CJK, emoji), so ties and long merge chains occur.
        let mut rng = Rng(99);
        for o200k in [true, false] {
            let enc = exact(o200k);
            let bpe = &tokenizer(o200k).bpe;
            for alphabet in [
                "abcdefghijklmnopqrstuvwxyz",
                "aaab",
                "的一是不了人我在有他",
                "🙂🚀👍",
                "QWERTYuiop+/0123",
            ] {
                let chars: Vec<char> = alphabet.chars().collect();
                for _ in 0..3_000 {
                    let mut piece = String::new();
                    let len = 1 + rng.below(ranks::MERGE_LONG);
                    while piece.len() < len {
                        piece.push(chars[rng.below(chars.len())]);
                    }
                    let bytes = piece.as_bytes();
                    assert_eq!(
                        enc.ranks
                            .piece_count(&mut Memo::default(), bytes, 0, bytes.len()),
                        bpe.count(bytes) as u64,
                        "o200k={o200k} {piece:?}"
                    );
                }
            }
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
