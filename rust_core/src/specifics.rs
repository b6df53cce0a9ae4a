//! Extraction of "specifics": the exact strings a summary must not paraphrase away.
//!
//! When old messages are summarised, a model tends to keep the gist and lose the details an
//! agent needs later: which file, which command, which error. This pulls those out verbatim
//! so the summariser can be told to keep them (or they can be appended to the summary).
//!
//! Kinds, from most to least specific: URLs, inline code in backticks (usually a shell
//! command or a symbol), file paths, numbers with units, identifiers (CamelCase,
//! camelCase, snake_case, or words with digits such as `sha256`), and error lines (whole
//! lines containing `Error`, `Exception`, `Traceback` or `failed`). A match that lies inside
//! a span already claimed by a more specific kind is skipped, so `src/my_mod.rs` does not
//! also yield `my_mod`. Error lines are reported whole in addition to what they contain.
//! The result is in order of first appearance, without duplicates.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;

/// Longest error line reported; longer lines are cut (on a character boundary).
pub const MAX_LINE_CHARS: usize = 300;

struct Patterns {
    url: Regex,
    code: Regex,
    path: Regex,
    number: Regex,
    ident: Regex,
    error_line: Regex,
}

static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| {
    Patterns {
    url: Regex::new(r#"\b(?:https?|ftp|file)://[^\s<>"'`)\]]+"#).expect("url"),
    code: Regex::new(r"`([^`\n]+)`").expect("code"),
    path: Regex::new(concat!(
        // absolute, home, ./ or ../ paths, and relative paths with at least one slash
        r"(?:(?:~|\.{1,2})?/)?(?:[\w.@+-]+/)+[\w.@+-]+/?",
        // or a Windows path
        r"|[A-Za-z]:\\(?:[\w.@+ -]+\\)*[\w.@+-]+",
        // or a bare file name with a common extension
        r"|\b[\w-]+(?:\.[\w-]+)*\.(?:rs|py|pyi|toml|json|jsonl|yaml|yml|md|txt|csv|tsv|log|sh|js|ts|tsx|jsx|go|java|kt|c|h|cc|cpp|hpp|cs|rb|php|swift|sql|proto|html|css|xml|ini|cfg|conf|lock|env|parquet|db|sqlite|tar|gz|zip)\b",
    ))
    .expect("path"),
    number: Regex::new(concat!(
        r"\b\d+(?:[.,]\d+)?\s?",
        r"(?:%|(?:ns|us|µs|ms|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?|days?|",
        r"B|KB|KiB|MB|MiB|GB|GiB|TB|TiB|bytes?|tokens?|chars?|lines?|px|k|K|M|x|",
        r"GHz|MHz|Hz|rps|qps|req/s)\b)"
    ))
    .expect("number"),
    ident: Regex::new(concat!(
        r"\b(?:[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+",  // CamelCase
        r"|[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+",          // camelCase
        r"|[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+",     // snake_case, SCREAMING_CASE
        r"|_+[A-Za-z][A-Za-z0-9_]*",                    // _private, __dunder__
        r"|[A-Za-z]+[0-9]+[A-Za-z0-9]*)\b",             // sha256, x86_64, v2
    ))
    .expect("ident"),
    error_line: Regex::new(r"(?m)^.*(?:Error|Exception|Traceback|failed|FAILED|Failed).*$")
        .expect("error line"),
}
});

/// Byte spans already claimed by a more specific match: disjoint and non-empty, keyed by
/// start. Disjoint spans sorted by start are sorted by end too, so of the spans starting
/// before `end` only the last can reach past `start`: an overlap test is one lookup, not a
/// scan (which made long texts quadratic).
#[derive(Default)]
struct Claimed(BTreeMap<usize, usize>);

impl Claimed {
    /// Whether `[start, end)` overlaps a claimed span.
    fn overlaps(&self, start: usize, end: usize) -> bool {
        self.0
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| start < e)
    }

    /// Claim `[start, end)` unless it overlaps a claimed span; says whether it did.
    fn claim(&mut self, start: usize, end: usize) -> bool {
        debug_assert!(start < end, "matches are never empty");
        if self.overlaps(start, end) {
            return false;
        }
        self.0.insert(start, end);
        true
    }
}

/// Whether a path-shaped match is a path rather than prose such as "and/or" or
/// "input/output": it needs a dot, a leading `/` or `~/`, three or more segments, or a
/// segment with something other than letters.
fn looks_like_path(s: &str) -> bool {
    s.contains('.')
        || (s.starts_with('/') && s.len() > 1)
        || s.starts_with("~/")
        || s.split('/').filter(|seg| !seg.is_empty()).count() >= 3
        || s.contains('\\')
        || !s.split('/').all(|seg| seg.chars().all(char::is_alphabetic))
}

/// The specifics of `text`, in order of first appearance, without duplicates.
pub fn extract_specifics(text: &str) -> Vec<String> {
    let p = &*PATTERNS;
    let mut found: Vec<(usize, String)> = Vec::new();
    let mut claimed = Claimed::default();
    // Error lines first, so that on a tie in position the whole line precedes its parts.
    for m in p.error_line.find_iter(text) {
        let line = m.as_str().trim();
        let cut: String = line.chars().take(MAX_LINE_CHARS).collect();
        found.push((m.start(), cut));
    }
    let mut take = |start: usize, end: usize, s: &str, claimed: &mut Claimed| {
        if claimed.claim(start, end) {
            found.push((start, s.to_owned()));
        }
    };
    for m in p.url.find_iter(text) {
        let s = m.as_str().trim_end_matches(['.', ',', ';', ':', '!', '?']);
        take(m.start(), m.start() + s.len(), s, &mut claimed);
    }
    for c in p.code.captures_iter(text) {
        // Group 0 always matches and group 1 is not optional: `else` is never taken.
        let (Some(whole), Some(inner)) = (c.get(0), c.get(1)) else {
            continue;
        };
        let s = inner.as_str().trim();
        if !s.is_empty() {
            take(whole.start(), whole.end(), s, &mut claimed);
        }
    }
    for m in p.path.find_iter(text) {
        let s = m.as_str().trim_end_matches(['.', ',', ';', ':']);
        if looks_like_path(s) {
            take(m.start(), m.start() + s.len(), s, &mut claimed);
        }
    }
    for m in p.number.find_iter(text) {
        take(m.start(), m.end(), m.as_str(), &mut claimed);
    }
    for m in p.ident.find_iter(text) {
        take(m.start(), m.end(), m.as_str(), &mut claimed);
    }
    found.sort_by_key(|&(start, _)| start);
    let mut seen = hashbrown::HashSet::new();
    found
        .into_iter()
        .filter_map(|(_, s)| seen.insert(s.clone()).then_some(s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_each_kind() {
        let text = "Edit src/main.rs and ~/notes/todo.md, then run `cargo test --release` \
                    (see https://docs.rs/regex/latest/regex/.). It took 350 ms and 1.5 GB; \
                    HttpServer calls parse_args and sha256 in getUserById.";
        assert_eq!(
            extract_specifics(text),
            [
                "src/main.rs",
                "~/notes/todo.md",
                "cargo test --release",
                "https://docs.rs/regex/latest/regex/",
                "350 ms",
                "1.5 GB",
                "HttpServer",
                "parse_args",
                "sha256",
                "getUserById",
            ]
        );
    }

    #[test]
    fn error_lines_are_kept_whole_and_deduplicated() {
        let text = "ok\nTraceback (most recent call last):\n  File \"app.py\", line 3\n\
                    ValueError: bad input\nok\nValueError: bad input\nbuild failed";
        let got = extract_specifics(text);
        assert!(got.contains(&"Traceback (most recent call last):".to_string()));
        assert!(got.contains(&"ValueError: bad input".to_string()));
        assert!(got.contains(&"build failed".to_string()));
        assert!(got.contains(&"app.py".to_string()));
        assert_eq!(
            got.iter().filter(|s| *s == "ValueError: bad input").count(),
            1
        );
    }

    #[test]
    fn prose_yields_nothing() {
        assert!(extract_specifics("We talked about the weather and/or lunch.").is_empty());
        assert!(extract_specifics("input/output is fine").is_empty());
        assert_eq!(extract_specifics("in src/utils/io"), ["src/utils/io"]);
        assert_eq!(
            extract_specifics(r"C:\Users\me\x.txt"),
            [r"C:\Users\me\x.txt"]
        );
        assert!(extract_specifics("").is_empty());
    }

    /// The scan `Claimed` replaced.
    fn overlaps_naive(claimed: &[(usize, usize)], start: usize, end: usize) -> bool {
        claimed.iter().any(|&(s, e)| start < e && s < end)
    }

    #[test]
    fn claimed_spans_agree_with_a_scan() {
        let mut fast = Claimed::default();
        let mut naive: Vec<(usize, usize)> = Vec::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m) as usize
        };
        for _ in 0..20_000 {
            let start = next(5_000);
            let end = start + 1 + next(40);
            let expected = !overlaps_naive(&naive, start, end);
            if expected {
                naive.push((start, end));
            }
            assert_eq!(fast.claim(start, end), expected, "[{start}, {end})");
        }
        assert!(naive.len() > 100, "the test claims many spans");
    }

    #[test]
    fn long_text_is_linear_and_matches_its_paragraph() {
        // Repeating a paragraph adds no new specifics (deduplicated, in order of first
        // appearance), so a megabyte of it must give the paragraph's own result. About
        // 50,000 spans are claimed: a scan over them per candidate was quadratic.
        let paragraph = "Edit src/main.rs and ~/notes/todo.md, then run `cargo test` \
                         (see https://docs.rs/regex/). It took 350 ms and 1.5 GB; HttpServer \
                         calls parse_args and sha256 in getUserById.\nValueError: bad input\n";
        let long = paragraph.repeat((1 << 20) / paragraph.len() + 1);
        assert!(long.len() >= 1 << 20);
        let started = std::time::Instant::now();
        assert_eq!(extract_specifics(&long), extract_specifics(paragraph));
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn identifiers_inside_paths_are_not_repeated() {
        assert_eq!(
            extract_specifics("open ./my_pkg/data_v2.json"),
            ["./my_pkg/data_v2.json"]
        );
    }
}
