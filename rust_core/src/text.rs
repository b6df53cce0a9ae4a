//! Word tokenizer shared by keyword overlap and BM25.
//!
//! The keyword rule, made Unicode-aware: lower-case the text, split it into maximal runs of
//! letters, combining marks and numbers (general categories L, M and N), and keep runs
//! longer than two characters. Marks count as word characters so that scripts written
//! with combining vowel signs (Devanagari, Thai, ...) and decomposed accents (`e` +
//! U+0301) are not torn apart. Optionally drop English stop words. Lower-casing happens
//! before splitting because it can change the text (`İ` becomes `i` + U+0307), and the
//! Python reference does the same, so both agree on every input.

use std::sync::LazyLock;

use regex::Regex;

/// Words shorter than this many characters are dropped (the ASCII rule kept `len(word) > 2`).
pub const MIN_WORD_CHARS: usize = 3;

pub(crate) static WORD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[\p{L}\p{M}\p{N}]+").expect("valid word regex"));

/// English function words that carry no topic, all longer than two characters (shorter
/// words are dropped anyway). Sorted, so membership is a binary search.
pub const STOP_WORDS: [&str; 104] = [
    "about",
    "above",
    "after",
    "again",
    "against",
    "all",
    "and",
    "any",
    "are",
    "aren",
    "because",
    "been",
    "before",
    "being",
    "below",
    "between",
    "both",
    "but",
    "can",
    "couldn",
    "did",
    "didn",
    "does",
    "doesn",
    "doing",
    "don",
    "down",
    "during",
    "each",
    "few",
    "for",
    "from",
    "further",
    "had",
    "hadn",
    "has",
    "hasn",
    "have",
    "haven",
    "having",
    "her",
    "here",
    "hers",
    "herself",
    "him",
    "himself",
    "his",
    "how",
    "into",
    "isn",
    "its",
    "itself",
    "just",
    "more",
    "most",
    "myself",
    "nor",
    "not",
    "now",
    "off",
    "once",
    "only",
    "other",
    "our",
    "ours",
    "ourselves",
    "out",
    "over",
    "own",
    "same",
    "she",
    "should",
    "some",
    "such",
    "than",
    "that",
    "the",
    "their",
    "theirs",
    "them",
    "themselves",
    "then",
    "there",
    "these",
    "they",
    "this",
    "those",
    "through",
    "too",
    "under",
    "until",
    "very",
    "was",
    "were",
    "what",
    "when",
    "where",
    "which",
    "while",
    "who",
    "whom",
    "why",
    "will",
    "with",
];

/// Whether `word` (already lower case) is an English stop word.
pub fn is_stop_word(word: &str) -> bool {
    STOP_WORDS.binary_search(&word).is_ok()
}

/// Whether the keyword rule keeps `word` (lower case): long enough, and not a stop word
/// when those are dropped.
pub(crate) fn kept(word: &str, stop_words: bool) -> bool {
    // Byte length is an upper bound on characters: only count when it could matter.
    word.len() >= MIN_WORD_CHARS
        && (word.len() >= 4 * MIN_WORD_CHARS || word.chars().count() >= MIN_WORD_CHARS)
        && !(stop_words && is_stop_word(word))
}

/// Calls `f` with each kept word of `lowered`, which must already be lower case.
pub fn for_each_word<'t>(lowered: &'t str, stop_words: bool, mut f: impl FnMut(&'t str)) {
    for m in WORD.find_iter(lowered) {
        let word = m.as_str();
        if kept(word, stop_words) {
            f(word);
        }
    }
}

/// Whether `c` belongs to a script written without spaces between words: Han
/// ideographs (with their radicals, compatibility forms and extension planes), Hiragana,
/// Katakana (and its half-width forms), Bopomofo and Hangul (syllables and jamo), plus the
/// ideographic iteration and closing marks. In such text a run of letters is a phrase,
/// not a word, so [`for_each_term`] cuts it into overlapping pairs of characters.
pub fn is_cjk(c: char) -> bool {
    matches!(
        c as u32,
        0x1100..=0x11FF
            | 0x2E80..=0x2FDF
            | 0x3005..=0x3007
            | 0x3040..=0x30FF
            | 0x3100..=0x318F
            | 0x31A0..=0x31FF
            | 0x3400..=0x4DBF
            | 0x4E00..=0x9FFF
            | 0xA960..=0xA97F
            | 0xAC00..=0xD7FF
            | 0xF900..=0xFAFF
            | 0xFF66..=0xFFDC
            | 0x20000..=0x3FFFF
    )
}

/// Calls `f` with each overlapping pair of characters of `segment` (all CJK), or with
/// the segment itself when it is one character.
fn cjk_bigrams<'t>(segment: &'t str, f: &mut impl FnMut(&'t str)) {
    // `two_back` is where the pair ending before the current character starts.
    let mut two_back: Option<usize> = None;
    let mut one_back: Option<usize> = None;
    for (i, _) in segment.char_indices() {
        if let Some(start) = two_back {
            f(&segment[start..i]);
        }
        two_back = one_back;
        one_back = Some(i);
    }
    match two_back {
        Some(start) => f(&segment[start..]),
        None if !segment.is_empty() => f(segment),
        None => {}
    }
}

/// The terms of a search index: the words of [`for_each_word`], except that with
/// `cjk_bigrams` each run of CJK characters (see [`is_cjk`]) inside a word becomes its
/// overlapping pairs of characters (`東京都` gives `東京`, `京都`; one character alone is
/// its own term), so a query finds a phrase's words without a dictionary. The other parts
/// of such a word follow the word rule (`iphone手机` gives `iphone`, `手机`). Without
/// `cjk_bigrams` this is [`for_each_word`]. `lowered` must already be lower case.
pub fn for_each_term<'t>(
    lowered: &'t str,
    stop_words: bool,
    cjk_bigrams: bool,
    mut f: impl FnMut(&'t str),
) {
    if !cjk_bigrams {
        return for_each_word(lowered, stop_words, f);
    }
    for m in WORD.find_iter(lowered) {
        let run = m.as_str();
        if !run.chars().any(is_cjk) {
            if kept(run, stop_words) {
                f(run);
            }
            continue;
        }
        let mut start = 0;
        let mut current: Option<bool> = None;
        for (i, c) in run.char_indices() {
            let cjk = is_cjk(c);
            if let Some(prev) = current {
                if prev != cjk {
                    emit_segment(&run[start..i], prev, stop_words, &mut f);
                    start = i;
                }
            }
            current = Some(cjk);
        }
        if let Some(prev) = current {
            emit_segment(&run[start..], prev, stop_words, &mut f);
        }
    }
}

fn emit_segment<'t>(segment: &'t str, cjk: bool, stop_words: bool, f: &mut impl FnMut(&'t str)) {
    if cjk {
        cjk_bigrams(segment, f);
    } else if kept(segment, stop_words) {
        f(segment);
    }
}

/// The terms of `text` as a search index sees them (see [`for_each_term`]), in order,
/// duplicates included.
pub fn tokenize_terms(text: &str, stop_words: bool, cjk_bigrams: bool) -> Vec<String> {
    let lowered = text.to_lowercase();
    let mut out = Vec::new();
    for_each_term(&lowered, stop_words, cjk_bigrams, |w| {
        out.push(w.to_owned())
    });
    out
}

/// The kept words of `text`, in order, duplicates included.
pub fn tokenize(text: &str, stop_words: bool) -> Vec<String> {
    let lowered = text.to_lowercase();
    let mut out = Vec::new();
    for_each_word(&lowered, stop_words, |w| out.push(w.to_owned()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_words_are_sorted_unique_and_long() {
        assert!(STOP_WORDS.windows(2).all(|w| w[0] < w[1]));
        assert!(STOP_WORDS
            .iter()
            .all(|w| w.chars().count() >= MIN_WORD_CHARS));
    }

    #[test]
    fn splits_lowercases_and_drops_short_words() {
        assert_eq!(
            tokenize("The CAT sat on a mat_file-2024, ok?", false),
            ["the", "cat", "sat", "mat", "file", "2024"]
        );
        assert_eq!(tokenize("The cat and the hat", true), ["cat", "hat"]);
    }

    #[test]
    fn is_unicode_aware() {
        assert_eq!(tokenize("Grüße aus Köln", false), ["grüße", "aus", "köln"]);
        assert_eq!(tokenize("café", false), ["café"]);
        assert_eq!(tokenize("cafe\u{301} ok", false), ["cafe\u{301}"]);
        assert_eq!(tokenize("नमस्ते दुनिया", false), ["नमस्ते", "दुनिया"]);
        assert_eq!(tokenize("東京都 に 行く", false), ["東京都"]);
        // Three scalar values but more than three bytes.
        assert_eq!(tokenize("日本 日本語", false), ["日本語"]);
        assert_eq!(tokenize("ΟΔΟΣ", false), ["οδος"]);
    }

    #[test]
    fn cjk_runs_become_bigrams() {
        let terms = |t: &str| tokenize_terms(t, false, true);
        assert_eq!(
            terms("東京都に行く"),
            ["東京", "京都", "都に", "に行", "行く"]
        );
        assert_eq!(terms("猫 が"), ["猫", "が"]);
        assert_eq!(
            terms("iPhone手机 and 서울특별시"),
            ["iphone", "手机", "and", "서울", "울특", "특별", "별시"]
        );
        assert_eq!(terms("ab中cd"), ["中"]);
        // Other scripts are untouched, and without the option nothing changes.
        assert_eq!(terms("Grüße aus Köln"), tokenize("Grüße aus Köln", false));
        assert_eq!(
            tokenize_terms("東京都に行く", false, false),
            ["東京都に行く"]
        );
        assert_eq!(tokenize_terms("The cat 東京", true, true), ["cat", "東京"]);
    }
}
