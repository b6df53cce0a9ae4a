//! Places inside a piece where the BPE provably never merges, so the piece can be
//! counted as the sum of its parts between them.
//!
//! Every merge of the BPE makes a token out of the two parts it joins, so a merge across
//! a position `p` of a piece makes a token that spans `p`: some `text[a..b]` with
//! `a < p < b` is in the vocabulary. Where no token of the vocabulary occurs spanning
//! `p`, no merge ever crosses it, the merges on each side never see the other side, and
//! the piece's count is the count of `text[..p]` plus that of `text[p..]`. A long piece
//! of CJK text (a whole clause is one piece) splits this way into words that are
//! mostly single tokens, or short pieces the memo knows, instead of going to the slower
//! counter for long pieces.
//!
//! [`Bounds::forced`] proves it at a char boundary `p` between the chars `c1` and `c2`
//! from two tables of the vocabulary, built once:
//! - a token spanning `p` that holds all of `c1` and all of `c2` holds the two chars
//!   side by side; every pair of whole chars side by side in some token is marked in a
//!   bit set by hash (a hash collision only marks more pairs, which only splits less);
//! - a token spanning `p` that holds only part of `c1` (it starts inside it) or part of
//!   `c2` (it ends inside it) has the bytes `text[p - 1]`, `text[p]` at one of its own
//!   char boundaries with a cut char next to it; every such byte pair of every token is
//!   marked in a table of the 65,536 byte pairs.
//!
//! If neither table has `p`'s entry, no token spans `p`. The tables only ever err
//! towards "may span" (a hash collision, a malformed token marked as cut), which costs
//! speed, never a count.

use bpe_openai::byte_pair_encoding::BytePairEncoding;

/// Bits of the whole-char pair set: 2^21 bits (256 KB) for the few tens of thousands
/// of pairs in a vocabulary, so few pairs that occur in no token collide with one that
/// does.
const PAIR_BITS: u32 = 21;

pub struct Bounds {
    /// Byte pairs `(x, y)` at a char boundary of some token next to a cut char, as bit
    /// `x * 256 + y`.
    cut: Vec<u64>,
    /// Pairs of whole chars side by side in some token, by hash.
    pairs: Vec<u64>,
}

/// Length of the UTF-8 char whose first byte is `b`, or 0 if `b` cannot start one.
#[inline(always)]
pub fn char_len(b: u8) -> usize {
    match b {
        0..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        0xf0..=0xf7 => 4,
        _ => 0,
    }
}

#[inline(always)]
fn is_cont(b: u8) -> bool {
    b & 0xc0 == 0x80
}

/// The bit of two whole chars side by side (`bytes`, 2 to 8 of them): their bytes
/// little-endian in a `u64` (UTF-8 splits them one way only, so the bytes name the
/// pair), hashed to [`PAIR_BITS`] bits.
#[inline(always)]
fn pair_bit(bytes: &[u8]) -> usize {
    let mut buf = [0u8; 8];
    buf[..bytes.len()].copy_from_slice(bytes);
    let key = u64::from_le_bytes(buf);
    let p = (key as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let h = (p as u64) ^ ((p >> 64) as u64);
    (h >> (64 - PAIR_BITS)) as usize
}

impl Bounds {
    /// The tables of `bpe`'s vocabulary.
    pub fn new(bpe: &BytePairEncoding) -> Self {
        let mut cut = vec![0u64; 65_536 / 64];
        let mut pairs = vec![0u64; (1 << PAIR_BITS) / 64];
        let set = |bits: &mut Vec<u64>, i: usize| bits[i / 64] |= 1 << (i % 64);
        for rank in 0..bpe.num_tokens() as u32 {
            let t = bpe.token_bytes(rank);
            // Start of the last whole char before `q`, if there is one.
            let mut prev_start: Option<usize> = (!t.is_empty() && !is_cont(t[0])).then_some(0);
            for q in 1..t.len() {
                if is_cont(t[q]) {
                    continue;
                }
                // `q` is a char boundary inside the token: is the char before it whole,
                // and the one after it?
                let before = prev_start.filter(|&j| {
                    char_len(t[j]) == q - j && t[j + 1..q].iter().all(|&b| is_cont(b))
                });
                let n = char_len(t[q]);
                let after_whole =
                    n > 0 && q + n <= t.len() && t[q + 1..q + n].iter().all(|&b| is_cont(b));
                match before {
                    Some(j) if after_whole => set(&mut pairs, pair_bit(&t[j..q + n])),
                    _ => set(&mut cut, usize::from(t[q - 1]) * 256 + usize::from(t[q])),
                }
                prev_start = Some(q);
            }
        }
        Bounds { cut, pairs }
    }

    /// Whether no token of the vocabulary occurs in `text` spanning the char boundary
    /// `p`, where `text[c1..p]` and `text[p..c2]` are the chars on either side (`text`
    /// is valid UTF-8).
    #[inline(always)]
    pub fn forced(&self, text: &[u8], c1: usize, p: usize, c2: usize) -> bool {
        let i = usize::from(text[p - 1]) * 256 + usize::from(text[p]);
        if self.cut[i / 64] & (1 << (i % 64)) != 0 {
            return false;
        }
        let i = pair_bit(&text[c1..c2]);
        self.pairs[i / 64] & (1 << (i % 64)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hashbrown::HashSet;

    use crate::test_rng::Rng;

    /// A char from a mix that makes multi-char tokens and cut chars likely: frequent and
    /// rare Han, kana, Hangul, CJK and Latin punctuation, Latin letters with and without
    /// accents, digits, spaces, emoji and other 4-byte chars.
    fn mixed_char(rng: &mut Rng) -> char {
        const COMMON: &str = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单亚";
        const KANA: &str = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんがぎぐげござじずぜぞだぢづでどばびぶべぼぱぴぷぺぽアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンガギグゲゴザジズゼゾダヂヅデドバビブベボパピプペポーッャュョ";
        const OTHER: &str = "，。、！？：；「」『』（）《》…—·　 abcxyzABéüñ0123456789-_/.'\"🙂🚀👍👨\u{200d}\u{301}ʰ";
        let pick = |s: &str, rng: &mut Rng| {
            let v: Vec<char> = s.chars().collect();
            v[rng.below(v.len())]
        };
        match rng.below(10) {
            0..=3 => pick(COMMON, rng),
            4..=5 => pick(KANA, rng),
            6 => char::from_u32(0x4e00 + rng.below(0x5200) as u32).unwrap(),
            7 => char::from_u32(0xac00 + rng.below(11_172) as u32).unwrap(),
            _ => pick(OTHER, rng),
        }
    }

    /// Every char boundary [`Bounds::forced`] accepts is spanned by no token: checked by
    /// brute force, every slice across the boundary against the whole vocabulary.
    #[test]
    fn forced_boundaries_are_spanned_by_no_token() {
        for tok in [bpe_openai::o200k_base(), bpe_openai::cl100k_base()] {
            let bpe = &tok.bpe;
            let bounds = Bounds::new(bpe);
            let vocab: HashSet<&[u8]> = (0..bpe.num_tokens() as u32)
                .map(|r| bpe.token_bytes(r))
                .collect();
            let max = vocab.iter().map(|t| t.len()).max().unwrap();
            let mut rng = Rng(0x5eed);
            let (mut forced, mut boundaries) = (0, 0);
            for _ in 0..400 {
                let text: String = (0..24).map(|_| mixed_char(&mut rng)).collect();
                let b = text.as_bytes();
                let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
                for w in starts.windows(3) {
                    let (c1, p, c2) = (w[0], w[1], w[2]);
                    boundaries += 1;
                    if !bounds.forced(b, c1, p, c2) {
                        continue;
                    }
                    forced += 1;
                    for a in p.saturating_sub(max)..p {
                        for e in p + 1..=(a + max).min(b.len()) {
                            assert!(
                                !vocab.contains(&b[a..e]),
                                "token {:?} spans a forced boundary in {text:?}",
                                String::from_utf8_lossy(&b[a..e])
                            );
                        }
                    }
                }
            }
            // The test means something only if many boundaries are forced.
            assert!(forced * 4 > boundaries, "{forced} of {boundaries}");
        }
    }

    /// Counts of long runs of CJK and mixed text, cut at forced boundaries, equal the
    /// `bpe` crate's (which equal tiktoken's): clauses of every length, Han-only runs
    /// (one piece each), and runs of one repeated char.
    #[test]
    fn cut_pieces_count_as_the_crate_does() {
        let mut rng = Rng(77);
        let mut texts: Vec<String> = Vec::new();
        for len in (1..300).step_by(7) {
            texts.push((0..len).map(|_| mixed_char(&mut rng)).collect());
            texts.push(
                (0..len)
                    .map(|_| loop {
                        let c = mixed_char(&mut rng);
                        if c as u32 >= 0x3040 && c as u32 <= 0xd7a3 {
                            break c;
                        }
                    })
                    .collect(),
            );
        }
        for c in ['的', 'ア', '한', '畐', 'é'] {
            texts.push(c.to_string().repeat(200));
        }
        for (tok, enc) in [
            (bpe_openai::o200k_base(), crate::tokens::Encoding::O200kBase),
            (
                bpe_openai::cl100k_base(),
                crate::tokens::Encoding::Cl100kBase,
            ),
        ] {
            for text in &texts {
                assert_eq!(enc.count(text), tok.count(text) as u64, "{enc:?} {text:?}");
            }
        }
    }
}
