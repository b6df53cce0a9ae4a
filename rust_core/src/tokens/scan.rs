//! The pretokenizers of o200k_base and cl100k_base, written out by hand.
//!
//! tiktoken splits text with a regex before the BPE; these functions find the same
//! pieces by looking at character classes ([`super::classes`]) instead of running a
//! regex engine, which is most of the time a tokenizer spends. Each function returns the
//! end of the piece that starts at `start`, which is what the regex would match there:
//! the alternatives are tried in the pattern's order, and the backtracking of each
//! (greedy runs giving back characters) is worked out in closed form below.
//!
//! cl100k_base:
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//! o200k_base, with `U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`, `L = [\p{Ll}\p{Lm}\p{Lo}\p{M}]`
//! and `C = (?i:'s|'t|'re|'ve|'m|'ll|'d)`:
//! `[^\r\n\p{L}\p{N}]?U*L+C?|[^\r\n\p{L}\p{N}]?U+L*C?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//! The tests compare every piece with the `bpe-openai` crate's regex, over every code
//! point in many contexts and over random text.

use super::classes::{
    is_prefix, is_punct, Table, ASCII, LETTER, LOWERISH, NEWLINE, NUMBER, SPACE, UPPERISH,
};

/// Flags of the char at `i` (`END` past the end) and its length in bytes.
#[inline(always)]
fn at(b: &[u8], i: usize, t: &Table) -> (u8, usize) {
    let Some(&c0) = b.get(i) else {
        return (END, 0);
    };
    if c0 < 0x80 {
        return (ASCII[c0 as usize], 1);
    }
    // `b` is valid UTF-8, so the continuation bytes are there.
    let cont = |k: usize| (b.get(i + k).copied().unwrap_or(0x80) & 0x3f) as u32;
    let (cp, len) = if c0 < 0xe0 {
        (((c0 as u32 & 0x1f) << 6) | cont(1), 2)
    } else if c0 < 0xf0 {
        (((c0 as u32 & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        (
            ((c0 as u32 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3),
            4,
        )
    };
    (t.flags_cp(cp), len)
}

/// Past the end of the text: in no class, and no prefix or punctuation either.
const END: u8 = 0x80;

#[inline(always)]
fn prefix(f: u8) -> bool {
    f & END == 0 && is_prefix(f)
}

#[inline(always)]
fn punct(f: u8) -> bool {
    f & END == 0 && is_punct(f)
}

/// End of the run of chars, from `i`, whose flags share a bit with `mask`.
#[inline(always)]
fn run(b: &[u8], mut i: usize, mask: u8, t: &Table) -> usize {
    loop {
        // ASCII first, byte by byte, without decoding.
        while let Some(&c) = b.get(i) {
            if c >= 0x80 || ASCII[c as usize] & mask == 0 {
                break;
            }
            i += 1;
        }
        let (f, len) = at(b, i, t);
        if f & mask == 0 || f & END != 0 {
            return i;
        }
        i += len;
    }
}

/// End of the run of punctuation (`[^\s\p{L}\p{N}]`) from `i`.
#[inline(always)]
fn punct_run(b: &[u8], mut i: usize, t: &Table) -> usize {
    loop {
        let (f, len) = at(b, i, t);
        if !punct(f) {
            return i;
        }
        i += len;
    }
}

/// Length of the contraction `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `i`, or 0. Case folding
/// adds one non-ASCII char: `ſ` (U+017F) folds to `s`.
#[inline]
fn contraction(b: &[u8], i: usize) -> usize {
    if b.get(i) != Some(&b'\'') {
        return 0;
    }
    let lower = |k: usize| b.get(i + k).map(u8::to_ascii_lowercase);
    match lower(1) {
        Some(b's' | b't' | b'm' | b'd') => 2,
        Some(b'r' | b'v') if lower(2) == Some(b'e') => 3,
        Some(b'l') if lower(2) == Some(b'l') => 3,
        Some(0xc5) if b.get(i + 2) == Some(&0xbf) => 3,
        _ => 0,
    }
}

/// The white space alternatives, shared by both patterns: `\s*[\r\n]+`, `\s+(?!\S)`,
/// `\s+`, for a piece starting at `s` with a white space char.
#[inline]
fn space_piece(b: &[u8], s: usize, t: &Table) -> usize {
    let mut i = s;
    let mut last_nl = None;
    let mut last_start = s;
    loop {
        let (f, len) = at(b, i, t);
        if f & SPACE == 0 || f & END != 0 {
            break;
        }
        if f & NEWLINE != 0 {
            last_nl = Some(i);
        }
        last_start = i;
        i += len;
    }
    if let Some(nl) = last_nl {
        // `\s*` gives back chars until `[\r\n]+` can match: at the last newline, which
        // is then the end (whatever follows it in the run is not a newline).
        nl + 1
    } else if i == b.len() || last_start == s {
        // `\s+(?!\S)` takes the run to the end of the text; a single char before a
        // non-space can only be `\s+`.
        i
    } else {
        // `\s+(?!\S)` gives back the last char, so a space stays to lead the next piece.
        last_start
    }
}

/// `\p{N}{1,3}` at `s`, whose char is a number.
#[inline]
fn digits(b: &[u8], s: usize, first_len: usize, t: &Table) -> usize {
    let mut i = s + first_len;
    for _ in 0..2 {
        let (f, len) = at(b, i, t);
        if f & NUMBER == 0 || f & END != 0 {
            break;
        }
        i += len;
    }
    i
}

/// Where `[^\r\n\p{L}\p{N}]` matches an ASCII byte.
#[inline(always)]
fn ascii_prefix(c: u8) -> bool {
    c < 0x80 && !c.is_ascii_alphanumeric() && c != b'\r' && c != b'\n'
}

/// Whether the char at `i` (or the end of the text) ends an ASCII word for sure: the
/// end, or an ASCII byte other than `'`. A non-ASCII char could be a letter or a mark
/// that continues the word, and `'` a contraction, so those go the long way.
#[inline(always)]
fn ends_ascii_word(b: &[u8], i: usize) -> bool {
    b.get(i).is_none_or(|&c| c < 0x80 && c != b'\'')
}

/// The common cl100k_base piece, an ASCII word with an optional ASCII prefix, without
/// decoding a char: `None` where the general scanner must decide.
#[inline(always)]
fn ascii_word_cl100k(b: &[u8], s: usize) -> Option<usize> {
    let c0 = b[s];
    let mut i = s;
    if !c0.is_ascii_alphabetic() {
        // A `'` may open a contraction, which comes first in the pattern.
        if !ascii_prefix(c0) || c0 == b'\'' || !b.get(s + 1)?.is_ascii_alphabetic() {
            return None;
        }
        i += 1;
    }
    while b.get(i).is_some_and(u8::is_ascii_alphabetic) {
        i += 1;
    }
    ends_ascii_word(b, i).then_some(i)
}

/// The common o200k_base piece, an ASCII word (`U*L+` or `U+`, all ASCII) with an
/// optional ASCII prefix, without decoding a char: `None` where the general scanner
/// must decide.
#[inline(always)]
fn ascii_word_o200k(b: &[u8], s: usize) -> Option<usize> {
    let c0 = b[s];
    let mut i = s;
    if !c0.is_ascii_alphabetic() {
        if !ascii_prefix(c0) || !b.get(s + 1)?.is_ascii_alphabetic() {
            return None;
        }
        i += 1;
    }
    while b.get(i).is_some_and(u8::is_ascii_uppercase) {
        i += 1;
    }
    while b.get(i).is_some_and(u8::is_ascii_lowercase) {
        i += 1;
    }
    ends_ascii_word(b, i).then_some(i)
}

/// End of the cl100k_base piece starting at `s` (`s < b.len()`, on a char boundary).
pub fn cl100k(b: &[u8], s: usize, t: &Table) -> usize {
    if let Some(e) = ascii_word_cl100k(b, s) {
        return e;
    }
    let (f0, l0) = at(b, s, t);
    let n = contraction(b, s);
    if n > 0 {
        return s + n;
    }
    if f0 & LETTER != 0 {
        return run(b, s + l0, LETTER, t);
    }
    let (f1, l1) = at(b, s + l0, t);
    if prefix(f0) && f1 & LETTER != 0 && f1 & END == 0 {
        return run(b, s + l0 + l1, LETTER, t);
    }
    if f0 & NUMBER != 0 {
        return digits(b, s, l0, t);
    }
    let punct_start = if punct(f0) {
        Some(s)
    } else if b[s] == b' ' && punct(f1) {
        Some(s + 1)
    } else {
        None
    };
    if let Some(p) = punct_start {
        let mut e = punct_run(b, p, t);
        while matches!(b.get(e), Some(b'\r' | b'\n')) {
            e += 1;
        }
        return e;
    }
    space_piece(b, s, t)
}

/// `U*L+` from `p` (o200k_base's first letter alternative, without prefix and suffix).
#[inline]
fn upper_lower(b: &[u8], p: usize, t: &Table) -> Result<usize, usize> {
    // The `U` run, remembering where the last char that is also in `L` ends: if no `L`
    // char follows the run, `U*` gives back chars until `L+` can take one, which is then
    // the last such char.
    let mut i = p;
    let mut last_lower_end = None;
    loop {
        while let Some(&c) = b.get(i) {
            if c >= 0x80 || ASCII[c as usize] & UPPERISH == 0 {
                break;
            }
            i += 1;
        }
        let (f, len) = at(b, i, t);
        if f & UPPERISH == 0 || f & END != 0 {
            break;
        }
        i += len;
        if f & LOWERISH != 0 {
            last_lower_end = Some(i);
        }
    }
    let (f, len) = at(b, i, t);
    if f & LOWERISH != 0 && f & END == 0 {
        Ok(run(b, i + len, LOWERISH, t))
    } else {
        // No match: the end of the `U` run, for the second alternative `U+L*`.
        last_lower_end.ok_or(i)
    }
}

/// End of the o200k_base piece starting at `s` (`s < b.len()`, on a char boundary).
pub fn o200k(b: &[u8], s: usize, t: &Table) -> usize {
    if let Some(e) = ascii_word_o200k(b, s) {
        return e;
    }
    let (f0, l0) = at(b, s, t);
    // The common case first: a word with no prefix.
    if f0 & LOWERISH != 0 && f0 & UPPERISH == 0 {
        let e = run(b, s + l0, LOWERISH, t);
        return e + contraction(b, e);
    }
    let has_prefix = prefix(f0);
    // First alternative, with the prefix and then without; then the second one.
    let mut upper_ends = [None, None];
    if has_prefix {
        match upper_lower(b, s + l0, t) {
            Ok(e) => return e + contraction(b, e),
            Err(k) => upper_ends[0] = (k > s + l0).then_some(k),
        }
    }
    match upper_lower(b, s, t) {
        Ok(e) => return e + contraction(b, e),
        Err(k) => upper_ends[1] = (k > s).then_some(k),
    }
    // `U+L*` where `U*L+` failed: the `U` run is followed by no `L` char, so it ends
    // where the run does.
    if let Some(e) = upper_ends[0].or(upper_ends[1]) {
        return e + contraction(b, e);
    }
    if f0 & NUMBER != 0 {
        return digits(b, s, l0, t);
    }
    let punct_start = if punct(f0) {
        Some(s)
    } else if b[s] == b' ' && punct(at(b, s + 1, t).0) {
        Some(s + 1)
    } else {
        None
    };
    if let Some(p) = punct_start {
        let mut e = punct_run(b, p, t);
        while matches!(b.get(e), Some(b'\r' | b'\n' | b'/')) {
            e += 1;
        }
        return e;
    }
    space_piece(b, s, t)
}
