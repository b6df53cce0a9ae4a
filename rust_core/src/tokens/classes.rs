//! What the OpenAI pretokenizer patterns need to know about a character, as bit flags,
//! looked up in a table instead of asking a regex.
//!
//! The table is built once, from the same Unicode data the `regex` crate uses for
//! `\p{L}`, `\p{N}`, `\s` and the rest (`regex-syntax`'s tables), so the hand-written
//! scanner and the crate's regex agree on every code point; the tests check that they do.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`: o200k_base's "upper case" letter run.
pub const UPPERISH: u8 = 1;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`: o200k_base's "lower case" letter run.
pub const LOWERISH: u8 = 2;
/// `\p{L}`.
pub const LETTER: u8 = 4;
/// `\p{N}`.
pub const NUMBER: u8 = 8;
/// `\s` (Unicode White_Space).
pub const SPACE: u8 = 16;
/// `\r` or `\n`.
pub const NEWLINE: u8 = 32;

/// Chars that may open a letter piece: `[^\r\n\p{L}\p{N}]`.
pub const fn is_prefix(f: u8) -> bool {
    f & (NEWLINE | LETTER | NUMBER) == 0
}

/// Chars of a punctuation run: `[^\s\p{L}\p{N}]`.
pub const fn is_punct(f: u8) -> bool {
    f & (SPACE | LETTER | NUMBER) == 0
}

/// Code points per block of the two-level table.
const BLOCK: usize = 256;

/// Flags of every code point: `blocks[index[cp / 256]][cp % 256]`; identical blocks
/// (most of the code space) are stored once.
pub struct Table {
    index: Vec<u16>,
    blocks: Vec<u8>,
}

impl Table {
    /// Flags of `c`.
    #[cfg(test)]
    pub fn flags(&self, c: char) -> u8 {
        self.flags_cp(c as u32)
    }

    /// Flags of the code point `cp` (below 0x110000).
    #[inline(always)]
    pub fn flags_cp(&self, cp: u32) -> u8 {
        let cp = cp as usize;
        // Both indexes are in bounds by construction (`index` covers every code point
        // and holds only block numbers that exist), so the checks never fail.
        let block = self.index[cp / BLOCK] as usize;
        self.blocks[block * BLOCK + cp % BLOCK]
    }
}

/// The ranges of one Unicode class written as a regex (`\p{Lu}`, `\s`).
fn ranges(pattern: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("a valid Unicode class");
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("{pattern} is not a Unicode class: {other:?}"),
    }
}

fn build() -> Table {
    let mut flat = vec![0u8; 0x11_0000];
    let classes: [(&str, u8); 10] = [
        (r"\p{Lu}", UPPERISH | LETTER),
        (r"\p{Lt}", UPPERISH | LETTER),
        (r"\p{Lm}", UPPERISH | LOWERISH | LETTER),
        (r"\p{Lo}", UPPERISH | LOWERISH | LETTER),
        (r"\p{Ll}", LOWERISH | LETTER),
        (r"\p{M}", UPPERISH | LOWERISH),
        (r"\p{L}", LETTER),
        (r"\p{N}", NUMBER),
        (r"\s", SPACE),
        (r"[\r\n]", NEWLINE),
    ];
    for (pattern, flag) in classes {
        for (lo, hi) in ranges(pattern) {
            for f in &mut flat[lo as usize..=hi as usize] {
                *f |= flag;
            }
        }
    }
    let mut index = Vec::with_capacity(flat.len() / BLOCK);
    let mut blocks: Vec<u8> = Vec::new();
    let mut seen: hashbrown::HashMap<&[u8], u16> = hashbrown::HashMap::new();
    for chunk in flat.chunks(BLOCK) {
        let next = seen.len() as u16;
        let id = *seen.entry(chunk).or_insert_with(|| {
            blocks.extend_from_slice(chunk);
            next
        });
        index.push(id);
    }
    Table { index, blocks }
}

/// The table, built on first use (a few milliseconds).
pub fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(build)
}

/// Flags of each ASCII byte, without the two-level lookup.
pub static ASCII: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        t[b] = if c.is_ascii_uppercase() {
            UPPERISH | LETTER
        } else if c.is_ascii_lowercase() {
            LOWERISH | LETTER
        } else if c.is_ascii_digit() {
            NUMBER
        } else if c == b'\r' || c == b'\n' {
            SPACE | NEWLINE
        } else if matches!(c, b' ' | b'\t' | 0x0b | 0x0c) {
            SPACE
        } else {
            0
        };
        b += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_table_agrees_with_the_unicode_one() {
        for b in 0u8..128 {
            assert_eq!(ASCII[b as usize], table().flags(b as char), "byte {b}");
        }
    }

    #[test]
    fn some_known_flags() {
        let t = table();
        assert_eq!(t.flags('中'), UPPERISH | LOWERISH | LETTER);
        assert_eq!(t.flags('\u{301}'), UPPERISH | LOWERISH);
        assert_eq!(t.flags('٣'), NUMBER);
        assert_eq!(t.flags('\u{3000}'), SPACE);
        assert_eq!(t.flags('\u{85}'), SPACE);
        assert_eq!(t.flags('🙂'), 0);
        assert_eq!(t.flags('ǅ'), UPPERISH | LETTER);
    }
}
