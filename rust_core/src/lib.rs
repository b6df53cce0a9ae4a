//! contextd's pure core: token estimation and counting, the model registry, budget
//! trimming and relevance scoring.
//!
//! Everything here is a pure function or a small value type with no I/O, so it can be
//! tested with `cargo test` alone. The Python bindings live in `python.rs` behind the
//! `python` feature; they only borrow or convert arguments and release the interpreter
//! around large inputs.

pub mod bm25;
pub mod build_wire;
pub mod error;
pub mod estimate;
pub mod models;
pub mod pairs;
pub mod relevance;
pub mod request_filter;
pub mod search_vector;
pub mod snippet;
pub mod specifics;
pub mod text;
pub mod tokens;
pub mod trim;
pub mod wire;

#[cfg(feature = "python")]
mod python;

pub use bm25::Bm25Index;
pub use error::{CoreError, CoreResult};
pub use estimate::{estimate_tokens, estimate_tokens_chars_div4};
pub use models::{list_models, model_info, ModelInfo};
pub use pairs::{pair_orphans, Orphans};
pub use relevance::{keyword_scores, keyword_select};
pub use request_filter::RequestFilter;
pub use snippet::{snippet, Snippet};
pub use specifics::extract_specifics;
pub use text::{tokenize, tokenize_terms};
pub use tokens::{count_tokens, count_tokens_batch, Encoding};
pub use trim::{trim_to_budget, Messages, Role, Trimmed};

/// The tests' random numbers: a deterministic xorshift, so failures reproduce.
#[cfg(test)]
pub(crate) mod test_rng {
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }
}

#[cfg(test)]
mod tests {
    //! Every entry point that reads text, over arbitrary Unicode: the audit for panics on
    //! input (slicing off a char boundary, overflowing casts) as a test.

    use super::*;

    use crate::test_rng::Rng;

    /// The shared generator's text for these tests.
    impl Rng {
        /// A char from the whole scalar range, or one of the kinds the tokenizers and
        /// patterns treat specially (case changes that change length, marks, spaces).
        fn char(&mut self) -> char {
            const SPECIAL: &str = "aZ7 \t\r\n'/.\\-_`:İẞﬃΣſǅʰ\u{301}\u{903}٣\u{a0}\u{85}\u{2028}\u{3000}\u{200d}\u{feff}é中🙂";
            match self.below(4) {
                0 => char::from_u32(self.below(0x11_0000) as u32).unwrap_or('\u{fffd}'),
                1 => char::from_u32(self.below(0x800) as u32).unwrap_or('?'),
                _ => SPECIAL
                    .chars()
                    .nth(self.below(SPECIAL.chars().count()))
                    .unwrap_or('x'),
            }
        }

        fn text(&mut self) -> String {
            (0..self.below(48)).map(|_| self.char()).collect()
        }
    }

    #[test]
    fn text_entry_points_accept_arbitrary_unicode() {
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        for round in 0..3_000 {
            let text = rng.text();
            let other = rng.text();
            for enc in Encoding::NAMES {
                let n = count_tokens(&text, enc).unwrap();
                assert!(n <= text.len() as u64, "{enc} {text:?}");
            }
            assert_eq!(
                count_tokens(&text, "o200k_base").unwrap(),
                bpe_openai::o200k_base().count(text.as_str()) as u64,
                "{text:?}"
            );
            let lowered = text.to_lowercase();
            for w in tokenize(&text, round % 2 == 0) {
                assert!(lowered.contains(&w), "{w:?} of {text:?}");
            }
            let docs = [text.as_str(), other.as_str()];
            assert_eq!(keyword_scores(&other, &docs, false).len(), 2);
            let mut ix = Bm25Index::new(1.2, 0.75, round % 2 == 1).unwrap();
            ix.add_batch(&[1, 2], &docs).unwrap();
            for (id, score) in ix.search(&other, usize::MAX) {
                assert!(
                    (id == 1 || id == 2) && score.is_finite(),
                    "{text:?} {other:?}"
                );
            }
            let cut = snippet(&text, &other, 1 + round % 40, false, true);
            for &(a, b) in &cut.spans {
                assert!(a < b && b <= cut.text.chars().count(), "{text:?} {other:?}");
            }
            for s in extract_specifics(&text) {
                assert!(!s.is_empty(), "{text:?}");
            }
            if let Err(err) = model_info(&text) {
                assert_eq!(err, CoreError::UnknownModel(text.clone()));
            }
        }
    }
}
