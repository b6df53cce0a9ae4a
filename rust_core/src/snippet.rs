//! Snippets of search hits: a short window of a message around the part that matches the
//! query best, with the query's terms marked.
//!
//! Terms are those of the search index ([`crate::text::for_each_term`]), found in the
//! original text (not its lower-cased copy), so the marks fall on the characters the
//! message really holds. The window holds at most `max_chars` characters of the text: the
//! one with the most distinct query terms (then the most matches, then the earliest),
//! starting a little before its first match and, where a space is near, at a word
//! boundary. Runs of white space are shown as one space; an ellipsis (`…`) marks each cut
//! end. Spans are `(start, end)` character offsets (Unicode scalar values, as Python
//! indexes a `str`) into the snippet, ascending and disjoint.

use hashbrown::HashMap;

use crate::text::{for_each_term, is_cjk, kept, WORD};

/// The default length of a snippet, in characters.
pub const DEFAULT_SNIPPET_CHARS: usize = 200;

/// Matches looked at per text: a snippet's work stays bounded on a huge message.
const MAX_MATCHES: usize = 1_000;

/// How far (characters) a window's ends move to reach a space.
const SNAP_CHARS: usize = 16;

/// A snippet and the spans of the query's terms in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snippet {
    pub text: String,
    pub spans: Vec<(usize, usize)>,
}

/// One match: character range in the text and which query term it is.
#[derive(Clone, Copy)]
struct Match {
    start: usize,
    end: usize,
    term: usize,
}

/// The snippet of `text` for `query` (see the module docs). `stop_words` and
/// `cjk_bigrams` must be the index's, so a hit's snippet marks what matched it.
pub fn snippet(
    text: &str,
    query: &str,
    max_chars: usize,
    stop_words: bool,
    cjk_bigrams: bool,
) -> Snippet {
    let lowered = query.to_lowercase();
    let mut terms: HashMap<&str, usize> = HashMap::new();
    for_each_term(&lowered, stop_words, cjk_bigrams, |t| {
        let next = terms.len();
        terms.entry(t).or_insert(next);
    });
    let (matches, total) = find_matches(text, &terms, stop_words, cjk_bigrams);
    if max_chars == 0 {
        return Snippet {
            text: String::new(),
            spans: Vec::new(),
        };
    }
    let (start, end) = choose_window(&matches, terms.len(), total, max_chars);
    let (start, end) = snap(text, &matches, start, end, total);
    build(text, &matches, start, end, total)
}

/// Every match of a query term in `text` (at most [`MAX_MATCHES`]) and the text's length
/// in characters.
fn find_matches(
    text: &str,
    terms: &HashMap<&str, usize>,
    stop_words: bool,
    cjk_bigrams: bool,
) -> (Vec<Match>, usize) {
    let mut matches: Vec<Match> = Vec::new();
    let mut chars_before = 0usize;
    let mut last_byte = 0usize;
    for m in WORD.find_iter(text) {
        chars_before += text[last_byte..m.start()].chars().count();
        last_byte = m.start();
        if terms.is_empty() || matches.len() >= MAX_MATCHES {
            continue;
        }
        let run = m.as_str();
        let mut seg_start_byte = 0;
        let mut seg_start_char = 0;
        let mut current: Option<bool> = None;
        for (count, (i, c)) in run.char_indices().enumerate() {
            let cjk = cjk_bigrams && is_cjk(c);
            if let Some(prev) = current {
                if prev != cjk {
                    let seg = &run[seg_start_byte..i];
                    segment_matches(
                        seg,
                        chars_before + seg_start_char,
                        prev,
                        terms,
                        stop_words,
                        &mut matches,
                    );
                    seg_start_byte = i;
                    seg_start_char = count;
                }
            }
            current = Some(cjk);
        }
        if let Some(prev) = current {
            let seg = &run[seg_start_byte..];
            segment_matches(
                seg,
                chars_before + seg_start_char,
                prev,
                terms,
                stop_words,
                &mut matches,
            );
        }
    }
    let total = chars_before + text[last_byte..].chars().count();
    matches.truncate(MAX_MATCHES);
    (matches, total)
}

fn segment_matches(
    seg: &str,
    at: usize,
    cjk: bool,
    terms: &HashMap<&str, usize>,
    stop_words: bool,
    out: &mut Vec<Match>,
) {
    if !cjk {
        let lowered = seg.to_lowercase();
        if kept(&lowered, stop_words) {
            if let Some(&term) = terms.get(lowered.as_str()) {
                let n = seg.chars().count();
                out.push(Match {
                    start: at,
                    end: at + n,
                    term,
                });
            }
        }
        return;
    }
    // CJK characters have no case: the pairs are looked up as they are.
    let starts: Vec<usize> = seg.char_indices().map(|(i, _)| i).collect();
    let mut push = |start: usize, end: usize, term: usize| match out.last_mut() {
        // Overlapping pairs (`東京`, `京都`) are one marked span.
        Some(last) if last.end > start && last.start <= start => last.end = last.end.max(end),
        _ => out.push(Match { start, end, term }),
    };
    if starts.len() == 1 {
        if let Some(&term) = terms.get(seg) {
            push(at, at + 1, term);
        }
        return;
    }
    for w in 0..starts.len().saturating_sub(1) {
        let end = starts.get(w + 2).copied().unwrap_or(seg.len());
        if let Some(&term) = terms.get(&seg[starts[w]..end]) {
            push(at + w, at + w + 2, term);
        }
    }
}

/// The window `[start, end)` (characters) with the most distinct terms, then matches.
fn choose_window(
    matches: &[Match],
    n_terms: usize,
    total: usize,
    max_chars: usize,
) -> (usize, usize) {
    if total <= max_chars {
        return (0, total);
    }
    let latest = total - max_chars;
    let lead = max_chars / 5;
    let mut best = (0usize, 0usize, 0usize); // (distinct, count, start)
    let mut seen = vec![false; n_terms];
    for first in matches {
        let start = first.start.saturating_sub(lead).min(latest);
        let end = start + max_chars;
        seen.iter_mut().for_each(|s| *s = false);
        let (mut distinct, mut count) = (0, 0);
        for m in matches.iter().filter(|m| m.start >= start && m.end <= end) {
            count += 1;
            if !seen[m.term] {
                seen[m.term] = true;
                distinct += 1;
            }
        }
        if (distinct, count) > (best.0, best.1) {
            best = (distinct, count, start);
        }
    }
    (best.2, best.2 + max_chars)
}

/// Move the window's ends to a nearby space, never cutting a match it holds.
fn snap(text: &str, matches: &[Match], start: usize, end: usize, total: usize) -> (usize, usize) {
    let inside: Vec<&Match> = matches
        .iter()
        .filter(|m| m.start >= start && m.end <= end)
        .collect();
    let first = inside.first().map_or(end, |m| m.start);
    let last = inside.last().map_or(start, |m| m.end);
    let window: Vec<char> = text.chars().skip(start).take(end - start).collect();
    let mut new_start = start;
    if start > 0 {
        if let Some(p) = window
            .iter()
            .take(SNAP_CHARS)
            .position(|c| c.is_whitespace())
        {
            if start + p < first {
                new_start = start + p + 1;
            }
        }
    }
    let mut new_end = end;
    if end < total {
        let tail = window.len().saturating_sub(SNAP_CHARS);
        if let Some(p) = window[tail..].iter().rposition(|c| c.is_whitespace()) {
            if start + tail + p >= last && start + tail + p > new_start {
                new_end = start + tail + p;
            }
        }
    }
    (new_start, new_end)
}

fn build(text: &str, matches: &[Match], start: usize, end: usize, total: usize) -> Snippet {
    let mut out = String::new();
    let mut out_len = 0usize;
    if start > 0 {
        out.push('…');
        out_len += 1;
    }
    let body_start = out_len;
    // map[i]: where the window's character i lands in the snippet.
    let mut map: Vec<usize> = Vec::with_capacity(end - start + 1);
    let mut last_space = true;
    for c in text.chars().skip(start).take(end - start) {
        map.push(out_len);
        if c.is_whitespace() {
            if !last_space {
                out.push(' ');
                out_len += 1;
                last_space = true;
            }
        } else {
            out.push(c);
            out_len += 1;
            last_space = false;
        }
    }
    if out_len > body_start && out.ends_with(' ') {
        out.pop();
        out_len -= 1;
    }
    map.push(out_len);
    for m in map.iter_mut() {
        *m = (*m).min(out_len);
    }
    let spans = matches
        .iter()
        .filter(|m| m.start >= start && m.end <= end)
        .map(|m| (map[m.start - start], map[m.end - start]))
        .collect();
    if end < total {
        out.push('…');
    }
    Snippet { text: out, spans }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked(s: &Snippet) -> String {
        let chars: Vec<char> = s.text.chars().collect();
        let mut out = String::new();
        let mut at = 0;
        for &(a, b) in &s.spans {
            out.extend(&chars[at..a]);
            out.push('[');
            out.extend(&chars[a..b]);
            out.push(']');
            at = b;
        }
        out.extend(&chars[at..]);
        out
    }

    #[test]
    fn short_text_is_whole_with_terms_marked() {
        let s = snippet(
            "The Deploy failed:\n\n  deploy again",
            "deploy failure",
            200,
            false,
            true,
        );
        assert_eq!(marked(&s), "The [Deploy] failed: [deploy] again");
    }

    #[test]
    fn long_text_is_cut_around_the_best_part() {
        let text = format!(
            "{} the database migration failed with a timeout {} migration",
            "filler words here ".repeat(30),
            "more filler text ".repeat(30)
        );
        let s = snippet(&text, "migration timeout", 60, false, true);
        assert!(
            s.text.starts_with('…') && s.text.ends_with('…'),
            "{}",
            s.text
        );
        assert!(s.text.chars().count() <= 62);
        assert_eq!(s.spans.len(), 2, "{}", marked(&s));
        assert!(marked(&s).contains("[migration] failed with a [timeout]"));
    }

    #[test]
    fn cjk_and_mixed_case_are_marked_on_the_original_text() {
        let s = snippet(
            "来週東京都に行きます。ÜBER Straße",
            "東京 über",
            200,
            false,
            true,
        );
        assert_eq!(marked(&s), "来週[東京]都に行きます。[ÜBER] Straße");
        let s = snippet("東京都", "東京 京都", 200, false, true);
        assert_eq!(marked(&s), "[東京都]");
    }

    #[test]
    fn no_match_gives_the_head() {
        let s = snippet(&"word ".repeat(100), "absent", 20, false, true);
        assert!(s.spans.is_empty());
        assert!(s.text.ends_with('…') && !s.text.starts_with('…'));
        assert_eq!(snippet("abc", "abc", 0, false, true).text, "");
    }
}
