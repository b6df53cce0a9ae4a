//! Token counting: exact OpenAI BPE counts and the seeds' estimators behind one enum.
//!
//! The exact encodings come from the `bpe-openai` crate, which compiles the
//! `o200k_base` / `cl100k_base` vocabularies into the binary at build time, so counting
//! never touches the network or the file system. Its counts equal `tiktoken`'s token for
//! token (the Python tests check this against `tiktoken` itself).

use std::str::FromStr;

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
    /// Seed 004's `(chars + 3) / 4`: an estimate, used where no tokenizer is public.
    Estimate,
    /// Seed 002's `chars / 4`: kept so the seed's numbers can be reproduced.
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
            Encoding::O200kBase => bpe_openai::o200k_base().count(text) as u64,
            Encoding::Cl100kBase => bpe_openai::cl100k_base().count(text) as u64,
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
}
