//! The character estimators of tokens.
//!
//! The estimate of a message is `(Unicode scalar values + 3) / 4`; the plain variant uses
//! `chars / 4`. Both count Unicode scalar values (Rust `char`s), never bytes, so that a
//! CJK or emoji-heavy message is not estimated at three or four times its size.

/// The character estimate: `(Unicode scalar values + 3) / 4`, i.e. chars / 4 rounded up.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// The plain character estimate: `chars / 4`, rounded down.
pub fn estimate_tokens_chars_div4(text: &str) -> u64 {
    text.chars().count() as u64 / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_text_is_zero_tokens() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens_chars_div4(""), 0);
    }

    #[test]
    fn rounds_up_per_seed_004() {
        assert_eq!(estimate_tokens("a"), 1);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        assert_eq!(estimate_tokens_chars_div4("abcde"), 1);
    }

    #[test]
    fn counts_scalar_values_not_bytes() {
        // 4 CJK characters are 12 bytes but 4 scalar values.
        assert_eq!(estimate_tokens("你好世界"), 1);
        // One emoji is 4 bytes, one scalar value.
        assert_eq!(estimate_tokens("🙂"), 1);
        assert_eq!(estimate_tokens("🙂🙂🙂🙂🙂"), 2);
    }
}
