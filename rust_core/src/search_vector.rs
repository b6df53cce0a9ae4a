//! The PostgreSQL search vector of a message, as a tsvector literal, when it can be made
//! exactly: the server's side of `adapters/postgres/search_vector.py` (see its docstring
//! for why and for the cases left to the database).
//!
//! The database's expression is `to_tsvector('simple', regexp_replace(left(content,
//! 196608) || ' ' || left(tool_calls, 65536), '[^[:alnum:]]+', ' ', 'g'))`. For ASCII
//! text every maximal run of letters and digits is one word, lower-cased, at positions 1,
//! 2, ...; `None` for anything else PostgreSQL might read otherwise.

/// Characters of content and of tool_calls the database's expression reads.
pub const CONTENT_CHARS: usize = 196_608;
pub const TOOL_CALLS_CHARS: usize = 65_536;
/// PostgreSQL's limits: longest word it indexes (bytes), highest position, positions kept
/// per word.
const MAX_WORD: usize = 2046;
const MAX_POSITION: usize = 16_383;
const MAX_POSITIONS: usize = 256;

/// The first `chars` characters of `text` (all of it when shorter).
fn prefix(text: &str, chars: usize) -> &str {
    match text.char_indices().nth(chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// The literal ("'word':1,3 'other':2"), or `None` when only the database can
/// tell: any character outside ASCII, a word of leading digits followed by "e" (read as a
/// number in scientific notation), a word over PostgreSQL's length, more positions than
/// a tsvector keeps, or a word repeated more often than it records.
pub fn search_vector(content: &str, tool_calls: &str) -> Option<String> {
    let content = prefix(content, CONTENT_CHARS);
    let tool_calls = prefix(tool_calls, TOOL_CALLS_CHARS);
    if !content.is_ascii() || !tool_calls.is_ascii() {
        return None;
    }
    let content = content.to_ascii_lowercase();
    let tool_calls = tool_calls.to_ascii_lowercase();
    // Each word with its position (1, 2, ...).
    let mut words: Vec<(&[u8], u32)> = Vec::new();
    for part in [content.as_bytes(), tool_calls.as_bytes()] {
        for word in part
            .split(|b| !b.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            if word.len() > MAX_WORD {
                return None;
            }
            let digits = word.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits > 0 && word.get(digits) == Some(&b'e') {
                return None;
            }
            // At most MAX_POSITION + 1 words are counted before the check below.
            words.push((word, words.len() as u32 + 1));
            if words.len() > MAX_POSITION {
                return None;
            }
        }
    }
    // Each word once, with its positions in order ("'a':1,3 'b':2"): PostgreSQL reads
    // that faster than one entry per position. Words in byte order, the order a tsvector
    // keeps them (tsCompareString: bytes, then length): the database then finds them
    // sorted and unique instead of sorting them (a quick check, not a sort). Sorting the
    // (word, position) pairs gives both orders at once, without a map of words.
    words.sort_unstable();
    let mut out = String::with_capacity(content.len() + tool_calls.len() + 8 * words.len());
    // Positions in decimal by `itoa`: `write!` through `fmt` cost more than the rest of a word.
    let mut digits = itoa::Buffer::new();
    for group in words.chunk_by(|a, b| a.0 == b.0) {
        if group.len() > MAX_POSITIONS {
            return None;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push('\'');
        // ASCII letters and digits only: nothing needs escaping inside the quotes.
        out.extend(group[0].0.iter().map(|&b| b as char));
        out.push_str("':");
        for (k, &(_, position)) in group.iter().enumerate() {
            if k > 0 {
                out.push(',');
            }
            out.push_str(digits.format(position));
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_positions_and_refusals() {
        assert_eq!(
            search_vector("Foo, bar/FOO x1", "{\"a\": 2}").as_deref(),
            Some("'2':6 'a':5 'bar':2 'foo':1,3 'x1':4")
        );
        assert_eq!(search_vector("", "").as_deref(), Some(""));
        assert_eq!(search_vector("café", ""), None);
        assert_eq!(search_vector("8e2x", ""), None);
        assert_eq!(search_vector("x 12E5", ""), None);
        assert!(search_vector("e5 a1e5 12x", "").is_some());
        assert_eq!(search_vector(&"a".repeat(2047), ""), None);
        assert_eq!(search_vector(&"again ".repeat(257), ""), None);
        assert!(search_vector(&"again ".repeat(256), "").is_some());
        // Non-ASCII past the part the database reads does not matter.
        let long = format!("{}é", format!("{} ", "a".repeat(2000)).repeat(99));
        assert!(search_vector(&long, "").is_some());
        assert_eq!(search_vector(&format!("{}é", "a ".repeat(10)), ""), None);
        assert_eq!(
            search_vector("b10 a 9 b10 ab a", "").as_deref(),
            Some("'9':3 'a':2,6 'ab':5 'b10':1,4")
        );
        // Positions up to PostgreSQL's highest, and no further.
        assert!(search_vector(&"x ".repeat(MAX_POSITION), "").is_none()); // > 256 of one word
        let many: String = (0..MAX_POSITION).map(|i| format!("w{i} ")).collect();
        assert!(search_vector(&many, "").is_some());
        assert!(search_vector(&format!("{many} w"), "").is_none());
    }
}
