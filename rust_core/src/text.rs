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

static WORD: LazyLock<Regex> =
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

/// Calls `f` with each kept word of `lowered`, which must already be lower case.
pub fn for_each_word<'t>(lowered: &'t str, stop_words: bool, mut f: impl FnMut(&'t str)) {
    for m in WORD.find_iter(lowered) {
        let word = m.as_str();
        // Byte length is an upper bound on characters: only count when it could matter.
        if word.len() >= MIN_WORD_CHARS
            && (word.len() >= 4 * MIN_WORD_CHARS || word.chars().count() >= MIN_WORD_CHARS)
            && !(stop_words && is_stop_word(word))
        {
            f(word);
        }
    }
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
}
