//! Extraction of "specifics": the exact strings a summary must not paraphrase away.
//!
//! When old messages are summarised, a model keeps the gist and loses the details an agent
//! needs later: which file, which command, which order, which amount, which error. This
//! pulls those out verbatim so they can be kept beside the summary (the ledger).
//!
//! Kinds (see [`Kind`]): error lines and exception types, commands (shell prompt lines,
//! inline code, and the `command`-like values of tool-call arguments), URLs, ids (git SHAs,
//! UUIDs, ticket and order ids such as `ORD-4471-XK`, issue numbers such as `#2291`),
//! versions (`v0.18.2`, `1.2.3`), numbers with units and currencies (`€986.31`, `12 ms`,
//! `3.5 GB`, `409 passed`), file paths, and identifiers (CamelCase, snake_case, ...).
//!
//! What is skipped on purpose: tool-call ids (`toolu_…`, `call_…`, the `id` fields of tool
//! calls), base64 and other high-entropy blobs (a charset, entropy and character-class
//! test), and any path or URL longer than [`MAX_ENTRY_CHARS`]; error lines and commands
//! longer than that are cut (with `…`).
//!
//! JSON (a text that is a JSON object or array, such as tool-call arguments, including
//! OpenAI's arguments encoded as a JSON string inside JSON) is read string by string with
//! its escapes decoded, so a URL never ends in an escape's backslash and `\n` never glues
//! an `n` onto a path. Matching is on ASCII word boundaries, so specifics inside Chinese or
//! Japanese text are found too.
//!
//! A match inside a span already claimed by a more specific kind is skipped, so
//! `src/my_mod.rs` does not also yield `my_mod`. The result is in order of first
//! appearance, without duplicates. Linear in the text (claims are looked up in a B-tree).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;

/// Longest entry: longer paths and URLs are skipped, longer lines and commands are cut.
pub const MAX_ENTRY_CHARS: usize = 240;
/// Kept for callers of the earlier name: the cut applied to error lines.
pub const MAX_LINE_CHARS: usize = MAX_ENTRY_CHARS;
/// JSON strings decoded inside JSON strings are read this deep (OpenAI arguments are 2).
const MAX_JSON_DEPTH: usize = 4;
/// Lines of a multi-line command value reported (a script's first lines say what it does).
const MAX_COMMAND_LINES: usize = 8;

/// What a specific is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Error,
    Command,
    Url,
    Id,
    Version,
    Number,
    Path,
    Identifier,
}

impl Kind {
    /// The name Python sees.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Error => "error",
            Kind::Command => "command",
            Kind::Url => "url",
            Kind::Id => "id",
            Kind::Version => "version",
            Kind::Number => "number",
            Kind::Path => "path",
            Kind::Identifier => "identifier",
        }
    }
}

/// One specific: its kind and its exact text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Specific {
    pub kind: Kind,
    pub text: String,
}

struct Patterns {
    data_uri: Regex,
    blob_run: Regex,
    tool_call_id: Regex,
    prompt_line: Regex,
    error_marker: Regex,
    url: Regex,
    code: Regex,
    uuid: Regex,
    version: Regex,
    ticket: Regex,
    issue: Regex,
    commit: Regex,
    bare_command: Regex,
    sha: Regex,
    currency: Regex,
    number: Regex,
    path: Regex,
    exception: Regex,
    ident: Regex,
    json_string: Regex,
}

static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| {
    Patterns {
    data_uri: Regex::new(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]*").expect("data uri"),
    blob_run: Regex::new(r"[A-Za-z0-9+/=_-]{20,}").expect("blob run"),
    tool_call_id: Regex::new(r"(?-u:\b)(?:toolu|tooluse|call|fc)_[A-Za-z0-9_-]{6,}")
        .expect("tool call id"),
    prompt_line: Regex::new(r"(?m)^[ \t]*(?:\$|❯|PS>) +(\S[^\n]*)$").expect("prompt line"),
    error_marker: Regex::new(concat!(
        r"(?m)(?:",
        r"(?-u:\b)panic: ",
        r"|thread '[^'\n]{0,80}' panicked at ",
        r"|(?-u:\b)(?:fatal|FATAL)(?: error)?: ",
        r"|(?-u:\b)(?:error|Error|ERROR)(?:\[[A-Z]?\d+\])?: ",
        r"|^[ \t]*ERROR[ \t]",
        r"|^[ \t]*(?:FAILED|FAIL:?)[ \t]",
        r"|(?-u:\b)FAILED [\w./-]+::",
        r"|^[ \t]*[Ff]ailed to ",
        r"|(?-u:\b)(?:[A-Za-z_][\w]*\.)*[A-Z][A-Za-z0-9]*(?:Error|Exception|Exit|Interrupt|Warning|Fault): ",
        r"|^[ \t]*(?:[A-Za-z_][\w]*\.)*[A-Z][A-Za-z0-9]*(?:Error|Exception)[ \t]*$",
        r")",
    ))
    .expect("error marker"),
    url: Regex::new(r#"(?-u:\b)(?:https?|ftp|file|wss?)://[^\s<>"'`\\|{}^]+"#).expect("url"),
    code: Regex::new(r"`([^`\n]+)`").expect("code"),
    uuid: Regex::new(
        r"(?-u:\b)[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}(?-u:\b)",
    )
    .expect("uuid"),
    version: Regex::new(concat!(
        r"(?-u:\b)(?:v\d+(?:\.\d+){1,3}|\d+\.\d+\.\d+(?:\.\d+)?)",
        r"(?:-(?:alpha|beta|rc|dev|pre)[0-9.]*|\+[0-9A-Za-z.]+)?(?-u:\b)"
    ))
    .expect("version"),
    ticket: Regex::new(r"(?-u:\b)[A-Z][A-Z0-9]{1,11}(?:-[A-Za-z0-9]+)+(?-u:\b)").expect("ticket"),
    issue: Regex::new(r"(?:^|[^A-Za-z0-9_&#/])(#\d{1,7})(?-u:\b)").expect("issue"),
    commit: Regex::new(r"(?-u:\b)(?:commit|sha|SHA|revision|rev)[ :]+([0-9a-f]{7,40})(?-u:\b)")
        .expect("commit"),
    bare_command: Regex::new(concat!(
        r"(?m)(?:^|[\s(])((?:git|pytest|go|cargo|kubectl|npm|npx|yarn|pnpm|docker|make|python3?|",
        r"pip|uv|curl|wget|helm|terraform|psql|ruff|mypy|node|java|mvn|gradle|rustc|gcc|ssh|",
        r"scp|rsync|systemctl|journalctl|grep|rg|sed|awk|tar|chmod|ls|cat|tail|head)",
        r"(?: +[^\s]+){1,12})",
    ))
    .expect("bare command"),
    sha: Regex::new(r"(?-u:\b)[0-9a-f]{7,64}(?-u:\b)").expect("sha"),
    currency: Regex::new(concat!(
        r"(?:[€$£¥₹₩]|(?-u:\b)(?:USD|EUR|GBP|JPY|CNY|RMB|CHF|CAD|AUD) ?)-?\d[\d,]*(?:\.\d+)?",
        r"|\d[\d,]*(?:\.\d+)? ?(?:(?:USD|EUR|GBP|JPY|CNY|RMB|CHF|CAD|AUD)(?-u:\b)|[元円]|美元|欧元|日元)",
    ))
    .expect("currency"),
    number: Regex::new(concat!(
        r"\d+(?:[.,]\d+)? ?",
        r"(?:%|(?:ns|us|µs|ms|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?|days?|weeks?|",
        r"B|KB|KiB|MB|MiB|GB|GiB|TB|TiB|bytes?|tokens?|chars?|characters?|lines?|px|x|",
        r"GHz|MHz|Hz|rps|qps|req/s|MB/s|GB/s|ops/s|",
        r"passed|failed|errors?|warnings?|skipped|tests?|files?|rows?|records?|items?|",
        r"requests?|retries|attempts?|users?|messages?|commits?|workers?|threads?|cores?|",
        r"replicas?|nodes?|pods?|connections?)(?-u:\b)",
        r"|(?:件|個|个|人|秒|分钟|分|時間|小时|日|天|行|回|次|台|名))",
    ))
    .expect("number"),
    path: Regex::new(concat!(
        // absolute, home, ./ or ../ paths, and relative paths with at least one slash
        r"(?:(?:~|\.{1,2})?/)?(?:[A-Za-z0-9_.@+-]+/)+[A-Za-z0-9_.@+-]+/?",
        // or a Windows path
        r"|[A-Za-z]:\\(?:[A-Za-z0-9_.@+ -]+\\)*[A-Za-z0-9_.@+-]+",
        // or a bare file name with a common extension
        r"|(?-u:\b)[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.(?:rs|py|pyi|toml|json|jsonl|yaml|yml|md|txt|csv|tsv|log|sh|js|mjs|ts|tsx|jsx|go|mod|java|kt|c|h|cc|cpp|hpp|cs|rb|php|swift|sql|proto|html|css|xml|ini|cfg|conf|lock|env|parquet|db|sqlite|tar|gz|zip|pdf|png|jpg|svg)(?-u:\b)",
    ))
    .expect("path"),
    exception: Regex::new(
        r"(?-u:\b)[A-Z][A-Za-z0-9]*(?:Error|Exception)(?-u:\b)",
    )
    .expect("exception"),
    ident: Regex::new(concat!(
        r"(?-u:\b)(?:[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+", // CamelCase
        r"|[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+",               // camelCase
        r"|[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+",          // snake_case, SCREAMING_CASE
        r"|_+[A-Za-z][A-Za-z0-9_]*",                         // _private, __dunder__
        r"|[A-Za-z]+[0-9]+[A-Za-z0-9]*)(?-u:\b)",            // sha256, x86_64, v2
    ))
    .expect("ident"),
    json_string: Regex::new(r#""((?:[^"\\]|\\.)*)"(\s*:)?"#).expect("json string"),
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
        if start >= end || self.overlaps(start, end) {
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

/// Shannon entropy of the bytes of `s`, in bits per byte.
fn entropy(s: &str) -> f64 {
    let mut counts = [0u32; 256];
    for &b in s.as_bytes() {
        counts[usize::from(b)] += 1;
    }
    let n = s.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

fn class_of(b: u8) -> u8 {
    match b {
        b'A'..=b'Z' => 0,
        b'a'..=b'z' => 1,
        b'0'..=b'9' => 2,
        _ => 3,
    }
}

/// Whether a run of base64-alphabet characters is a blob (encoded data, a key, a token)
/// rather than a word, a path or an identifier: encoded data switches between upper
/// case, lower case and digits on about two characters in three and spreads over many
/// symbols, where identifiers and paths switch on a few word boundaries. Long hex (past a
/// SHA-256) and padded base64 count too.
fn is_blob(run: &str) -> bool {
    let bytes = run.as_bytes();
    let n = bytes.len();
    let hexlike = bytes.iter().all(|&b| b.is_ascii_hexdigit() || b == b'-');
    if hexlike {
        // SHAs and UUIDs are ids; hex past a SHA-256 is data.
        return n > 64 && !bytes.contains(&b'-');
    }
    if n >= 16 && run.ends_with('=') && n.is_multiple_of(4) && !run.contains('_') {
        return true;
    }
    if n < 20 {
        return false;
    }
    let switches = bytes
        .windows(2)
        .filter(|w| class_of(w[0]) != class_of(w[1]))
        .count();
    let rate = switches as f64 / (n - 1) as f64;
    let classes = [0u8, 1, 2]
        .iter()
        .filter(|&&c| bytes.iter().any(|&b| class_of(b) == c))
        .count();
    (classes == 3 && rate >= 0.45 && entropy(run) >= 3.9) || (n >= 200 && entropy(run) >= 4.5)
}

/// Cut `s` to [`MAX_ENTRY_CHARS`] characters, marking the cut with `…`.
fn cut(s: &str) -> String {
    if s.chars().count() <= MAX_ENTRY_CHARS {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(MAX_ENTRY_CHARS - 1).collect();
    out.push('…');
    out
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether no ASCII word character (nor a `.`) comes right before `start`.
fn free_before(text: &str, start: usize) -> bool {
    !start
        .checked_sub(1)
        .is_some_and(|i| is_word_byte(text.as_bytes()[i]) || text.as_bytes()[i] == b'.')
}

/// Whether `[start, end)` of `text` stands alone: no ASCII word character (or a `.`
/// continuing a number) right before or after it.
fn stands_alone(text: &str, start: usize, end: usize) -> bool {
    let b = text.as_bytes();
    let before = start.checked_sub(1).map(|i| b[i]);
    let after = b.get(end).copied();
    !before.is_some_and(|c| is_word_byte(c) || c == b'.')
        && !after.is_some_and(|c| {
            is_word_byte(c) || (c == b'.' && b.get(end + 1).is_some_and(u8::is_ascii_digit))
        })
}

/// Trailing characters that end a sentence rather than a URL.
fn trim_url(s: &str) -> &str {
    let mut s = s;
    loop {
        let trimmed = s.trim_end_matches(['.', ',', ';', ':', '!', '?', '\'', '"']);
        let unbalanced = |open: char, close: char| {
            trimmed.ends_with(close)
                && trimmed.matches(open).count() < trimmed.matches(close).count()
        };
        let trimmed = if unbalanced('(', ')') || unbalanced('[', ']') {
            &trimmed[..trimmed.len() - 1]
        } else {
            trimmed
        };
        if trimmed.len() == s.len() {
            return s;
        }
        s = trimmed;
    }
}

/// How much of a shell-command-shaped match (a known tool and the words after it) is the
/// command, in bytes: the tool, up to two subcommand words, then arguments that are
/// flags, paths, numbers or other non-prose tokens, stopping at the first prose word or
/// sentence end. `None` when no argument is non-prose (`make sure`, `go there`).
fn command_len(s: &str) -> Option<usize> {
    let mut end = 0;
    let mut plain_words = 0;
    let mut technical = false;
    let mut at = 0;
    for (i, word) in s.split(' ').enumerate() {
        let start = at;
        at += word.len() + 1;
        if word.is_empty() {
            continue;
        }
        // `./pkg/...` is Go's "and below", not a sentence's end.
        let stripped = if word.ends_with("/...") {
            word
        } else {
            word.trim_end_matches(['.', ',', ';', ':', ')', '!', '?'])
        };
        let is_plain = !stripped.is_empty() && stripped.bytes().all(|b| b.is_ascii_lowercase());
        if i > 0 && is_plain {
            plain_words += 1;
            if plain_words > 2 || technical {
                break;
            }
        } else if i > 0 {
            if stripped.is_empty() || !stripped.is_ascii() {
                break;
            }
            technical = true;
        }
        end = start + stripped.len();
        if stripped.len() < word.len() {
            break; // a sentence ends here
        }
    }
    technical.then_some(end)
}

/// Whether the text of a line before an error marker makes it code rather than output:
/// a string literal, an assignment, a block, or a line opening with a code keyword.
fn is_code_prefix(prefix: &str) -> bool {
    if prefix.contains(['"', '\'', '=', '{']) {
        return true;
    }
    let first = prefix.split_whitespace().next().unwrap_or("");
    matches!(
        first,
        "raise"
            | "throw"
            | "return"
            | "except"
            | "catch"
            | "if"
            | "elif"
            | "else"
            | "def"
            | "fn"
            | "func"
            | "class"
            | "//"
            | "#"
            | "--"
            | "*"
            | "let"
            | "const"
            | "var"
            | "assert"
            | "log"
            | "logger"
            | "print"
            | "println!"
            | "panic!"
    ) || first.starts_with("//")
        || first.starts_with('#')
}

/// Collects found specifics with their byte position in the scanned text.
struct Found {
    items: Vec<(usize, Specific)>,
}

impl Found {
    fn push(&mut self, at: usize, kind: Kind, text: String) {
        if !text.is_empty() {
            self.items.push((at, Specific { kind, text }));
        }
    }
}

/// The specifics of plain (non-JSON) text, in order of position.
fn scan_plain(text: &str, out: &mut Vec<Specific>) {
    let p = &*PATTERNS;
    let mut found = Found { items: Vec::new() };
    let mut claimed = Claimed::default();

    // Skipped: blobs and tool-call ids are claimed and yield nothing (data: URIs first,
    // then URLs, whose paths may look like encoded data, then the blobs).
    for m in p.data_uri.find_iter(text) {
        claimed.claim(m.start(), m.end());
    }
    for m in p.url.find_iter(text) {
        let s = trim_url(m.as_str());
        if s.chars().count() <= MAX_ENTRY_CHARS
            && s.len() > 8
            && claimed.claim(m.start(), m.start() + s.len())
        {
            found.push(m.start(), Kind::Url, s.to_owned());
        }
    }

    for m in p.blob_run.find_iter(text) {
        if is_blob(m.as_str()) {
            claimed.claim(m.start(), m.end());
        }
    }
    for m in p.tool_call_id.find_iter(text) {
        // An id has digits or capitals; `call_count` is a name, not an id.
        let tail = m.as_str().split_once('_').map_or("", |(_, t)| t);
        if tail
            .bytes()
            .any(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
        {
            claimed.claim(m.start(), m.end());
        }
    }
    // Commands at a shell prompt: the rest of the line.
    for c in p.prompt_line.captures_iter(text) {
        let (Some(whole), Some(cmd)) = (c.get(0), c.get(1)) else {
            continue;
        };
        let s = cmd.as_str().trim_end();
        if claimed.claim(whole.start(), whole.end()) {
            found.push(whole.start(), Kind::Command, cut(s));
        }
    }
    // Error lines: from the marker to the end of the line, unless the line is code.
    for m in p.error_marker.find_iter(text) {
        let line_start = text[..m.start()].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[m.start()..]
            .find('\n')
            .map_or(text.len(), |i| m.start() + i);
        if is_code_prefix(&text[line_start..m.start()]) {
            continue;
        }
        let start = m.start() + (m.as_str().len() - m.as_str().trim_start().len());
        let s = text[start..line_end].trim_end();
        if s.is_empty() || claimed.overlaps(start, start + s.len()) {
            continue;
        }
        claimed.claim(start, start + s.len());
        found.push(start, Kind::Error, cut(s));
    }
    for c in p.code.captures_iter(text) {
        let (Some(whole), Some(inner)) = (c.get(0), c.get(1)) else {
            continue;
        };
        let s = inner.as_str().trim();
        if !s.is_empty() && claimed.claim(whole.start(), whole.end()) {
            found.push(whole.start(), Kind::Command, cut(s));
        }
    }
    // A match may run past its command into prose and over the next command: resume
    // right after what was taken (or after the tool's name), not after the match.
    let mut pos = 0;
    while let Some(m) = p.bare_command.captures_at(text, pos).and_then(|c| c.get(1)) {
        let next_word = m.as_str().find(' ').map_or(m.end(), |i| m.start() + i);
        pos = next_word;
        if let Some(len) = command_len(m.as_str()) {
            let end = m.start() + len;
            if claimed.claim(m.start(), end) {
                found.push(m.start(), Kind::Command, cut(&text[m.start()..end]));
                pos = end;
            }
        }
    }
    let take = |found: &mut Found, claimed: &mut Claimed, start: usize, end: usize, kind| {
        let s = &text[start..end];
        if s.chars().count() <= MAX_ENTRY_CHARS && claimed.claim(start, end) {
            found.push(start, kind, s.to_owned());
        }
    };
    for m in p.uuid.find_iter(text) {
        take(&mut found, &mut claimed, m.start(), m.end(), Kind::Id);
    }
    for m in p.currency.find_iter(text) {
        let (start, end) = (m.start(), m.end());
        if !text.as_bytes()[start].is_ascii_digit() || free_before(text, start) {
            take(&mut found, &mut claimed, start, end, Kind::Number);
        }
    }
    for m in p.version.find_iter(text) {
        if stands_alone(text, m.start(), m.end()) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Version);
        }
    }
    for m in p.path.find_iter(text) {
        let s = m.as_str().trim_end_matches(['.', ',', ';', ':']);
        let before = m.start().checked_sub(1).map(|i| text.as_bytes()[i]);
        if looks_like_path(s) && !before.is_some_and(|b| b == b'-' || b == b'=') {
            take(
                &mut found,
                &mut claimed,
                m.start(),
                m.start() + s.len(),
                Kind::Path,
            );
        }
    }
    for m in p.ticket.find_iter(text) {
        let s = m.as_str();
        if s.bytes().any(|b| b.is_ascii_digit()) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Id);
        }
    }
    for c in p.issue.captures_iter(text) {
        if let Some(m) = c.get(1) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Id);
        }
    }
    for c in p.commit.captures_iter(text) {
        if let Some(m) = c.get(1) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Id);
        }
    }
    for m in p.sha.find_iter(text) {
        let s = m.as_str().as_bytes();
        if s.iter().any(u8::is_ascii_digit) && s.iter().any(u8::is_ascii_lowercase) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Id);
        }
    }
    for m in p.number.find_iter(text) {
        if free_before(text, m.start()) {
            take(&mut found, &mut claimed, m.start(), m.end(), Kind::Number);
        }
    }
    for m in p.exception.find_iter(text) {
        take(&mut found, &mut claimed, m.start(), m.end(), Kind::Error);
    }
    for m in p.ident.find_iter(text) {
        take(
            &mut found,
            &mut claimed,
            m.start(),
            m.end(),
            Kind::Identifier,
        );
    }
    found.items.sort_by_key(|&(start, _)| start);
    out.extend(found.items.into_iter().map(|(_, s)| s));
}

/// Decode the body of a JSON string literal (`None` when its escapes are malformed).
fn decode_json_string(body: &str) -> Option<String> {
    if !body.contains('\\') {
        return Some(body.to_owned());
    }
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next()? {
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'b' | 'f' => out.push(' '),
            'u' => {
                let hex: String = chars.by_ref().take(4).collect();
                let code = u32::from_str_radix(&hex, 16).ok()?;
                // A lone surrogate half (of an escaped pair) stands in as a space.
                out.push(char::from_u32(code).unwrap_or(' '));
            }
            other => out.push(other),
        }
    }
    Some(out)
}

/// Whether `text` is shaped like a JSON object or array (then read as JSON).
fn looks_like_json(text: &str) -> bool {
    let t = text.trim();
    (t.starts_with('{') && t.ends_with('}')) || (t.starts_with('[') && t.ends_with(']'))
}

/// Keys whose string value is a command, reported whole.
fn is_command_key(key: &str) -> bool {
    matches!(
        key,
        "command"
            | "cmd"
            | "commands"
            | "script"
            | "shell"
            | "bash"
            | "sh"
            | "run"
            | "code"
            | "query"
            | "sql"
    )
}

/// Keys whose values are never specifics: tool-call ids and plumbing.
fn is_skipped_key(key: &str) -> bool {
    matches!(
        key,
        "id" | "tool_call_id"
            | "tool_use_id"
            | "call_id"
            | "type"
            | "role"
            | "name"
            | "signature"
            | "data"
            | "image_url"
            | "source"
            | "media_type"
    )
}

/// The specifics of JSON text: each string value decoded and read (as JSON again when it
/// is JSON, as a command when its key says so, as plain text otherwise); keys are names,
/// not specifics. Text between strings (numbers, booleans) is read as plain text too.
fn scan_json(text: &str, depth: usize, out: &mut Vec<Specific>) {
    let p = &*PATTERNS;
    let mut key: Option<String> = None;
    let mut last = 0;
    for c in p.json_string.captures_iter(text) {
        let (Some(whole), Some(body)) = (c.get(0), c.get(1)) else {
            continue;
        };
        let between = &text[last..whole.start()];
        if between.bytes().any(|b| b.is_ascii_digit()) {
            scan_plain(between, out);
        }
        if between.contains([',', '{', '[']) {
            key = None; // a new member or element: the previous key's value has ended
        }
        last = whole.end();
        let Some(decoded) = decode_json_string(body.as_str()) else {
            continue;
        };
        if c.get(2).is_some() {
            key = Some(decoded);
            continue;
        }
        let k = key.as_deref().unwrap_or("");
        if is_skipped_key(k) {
            continue;
        }
        if depth < MAX_JSON_DEPTH && looks_like_json(&decoded) {
            scan_json(&decoded, depth + 1, out);
        } else if is_command_key(k) {
            let lines = decoded.lines().map(str::trim).filter(|l| !l.is_empty());
            for line in lines.take(MAX_COMMAND_LINES) {
                out.push(Specific {
                    kind: Kind::Command,
                    text: cut(line),
                });
            }
        } else {
            scan_plain(&decoded, out);
        }
    }
    let rest = &text[last..];
    if rest.bytes().any(|b| b.is_ascii_digit()) {
        scan_plain(rest, out);
    }
}

/// The specifics of `text` with their kinds, in order of first appearance, without
/// duplicates (by text).
pub fn extract_tagged(text: &str) -> Vec<Specific> {
    let mut all = Vec::new();
    if looks_like_json(text) {
        scan_json(text, 0, &mut all);
    } else {
        scan_plain(text, &mut all);
    }
    let mut seen = hashbrown::HashSet::new();
    all.into_iter()
        .filter(|s| seen.insert(s.text.clone()))
        .collect()
}

/// The specifics of `text`, in order of first appearance, without duplicates.
pub fn extract_specifics(text: &str) -> Vec<String> {
    extract_tagged(text).into_iter().map(|s| s.text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<(&'static str, String)> {
        extract_tagged(text)
            .into_iter()
            .map(|s| (s.kind.as_str(), s.text))
            .collect()
    }

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
    fn one_line_with_eleven_specifics() {
        let text = "Commit 3f9a2c1 fixed ORD-4471-XK for ACCT-99812 (€986.31) in v0.18.2, \
                    see #2291 and https://ci.example.com/runs/77; `pytest -x -q` gave \
                    409 passed in 12 ms, then panic: runtime error: index out of range [5] \
                    with length 3";
        assert_eq!(
            extract_specifics(text),
            [
                "3f9a2c1",
                "ORD-4471-XK",
                "ACCT-99812",
                "€986.31",
                "v0.18.2",
                "#2291",
                "https://ci.example.com/runs/77",
                "pytest -x -q",
                "409 passed",
                "12 ms",
                "panic: runtime error: index out of range [5] with length 3",
            ]
        );
    }

    #[test]
    fn error_lines_are_kept_whole_and_code_is_not() {
        let text = "ok\nTraceback (most recent call last):\n  File \"app.py\", line 3\n\
                    ValueError: bad input\nok\nValueError: bad input\n\
                    error[E0382]: borrow of moved value: `x`\n\
                    FAILED tests/test_api.py::test_get - AssertionError: 1 != 2\n\
                    \x20   raise ValueError(\"Error: not an error line\")\n\
                    if err != nil { return fmt.Errorf(\"error: %w\", err) }\n";
        let got = kinds(text);
        let errors: Vec<&str> = got
            .iter()
            .filter(|(k, _)| *k == "error")
            .map(|(_, s)| s.as_str())
            .collect();
        assert_eq!(
            errors,
            [
                "ValueError: bad input",
                "error[E0382]: borrow of moved value: `x`",
                "FAILED tests/test_api.py::test_get - AssertionError: 1 != 2",
                "ValueError",
            ]
        );
        assert!(got.contains(&("path", "app.py".to_string())));
    }

    #[test]
    fn json_arguments_are_decoded() {
        let openai = r#"[{"id":"call_Xq3kP9zzA1","type":"function","function":{"name":"bash","arguments":"{\"command\": \"pytest -x -q tests/test_api.py\", \"url\": \"https://example.com/a?b=1\"}"}}]"#;
        assert_eq!(
            extract_specifics(openai),
            [
                "pytest -x -q tests/test_api.py",
                "https://example.com/a?b=1"
            ]
        );
        let anthropic = r#"[{"id":"toolu_01AbCdEf","name":"run","input":{"cmd":"git log -1\ncargo build","note":"see src/lib.rs\nnow"}}]"#;
        assert_eq!(
            extract_specifics(anthropic),
            ["git log -1", "cargo build", "src/lib.rs"]
        );
    }

    #[test]
    fn prompts_ids_and_cjk() {
        let text = "$ make test\n> quoted\nrun 550e8400-e29b-41d4-a716-446655440000 on 订单ORD-2024-0117的金额为986.31元, \
                    注文は¥12,800 です (toolu_01XyZabc123 skipped, call_abc123def too)";
        assert_eq!(
            extract_specifics(text),
            [
                "make test",
                "550e8400-e29b-41d4-a716-446655440000",
                "ORD-2024-0117",
                "986.31元",
                "¥12,800",
            ]
        );
    }

    #[test]
    fn bare_commands_commits_and_mid_line_failures() {
        let text = "bob: try pytest -x -q tests/test_io.py and also git log --oneline -n 5.\n\
                    make sure to go there; then kubectl rollout restart deploy/api-2\n\
                    go test ./internal/lease/... -run TestLease2 please\n\
                    fixed in commit 1215082, see 订单#9229; run 3: FAILED tests/a.py::test_b - x\n\
                    https://track.example.net/parcel/2b177f89ba";
        assert_eq!(
            extract_specifics(text),
            [
                "pytest -x -q tests/test_io.py",
                "git log --oneline -n 5",
                "kubectl rollout restart deploy/api-2",
                "go test ./internal/lease/... -run TestLease2",
                "1215082",
                "#9229",
                "FAILED tests/a.py::test_b - x",
                "https://track.example.net/parcel/2b177f89ba",
            ]
        );
    }

    #[test]
    fn blobs_are_skipped() {
        let b64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";
        let text = format!("attached {b64} and data:image/png;base64,{b64} then src/a.py");
        assert_eq!(extract_specifics(&text), ["src/a.py"]);
        assert!(!is_blob("service/contextd/adapters/postgres/schema"));
        assert!(!is_blob("getUserByIdAndOrganizationName"));
        assert!(!is_blob("3f9a2c1e8d7b6a5f4e3d2c1b0a9f8e7d6c5b4a39"));
        assert!(is_blob("VGhpcyBpcyBhIHRlc3Qgb2YgYmFzZTY0IGVuY29kaW5n"));
    }

    #[test]
    fn entries_are_capped() {
        let long_path = format!("/data/{}/x.txt", "a".repeat(400));
        assert!(extract_specifics(&long_path).is_empty());
        let long_error = format!("error: {}", "word ".repeat(200));
        let got = extract_specifics(&long_error);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].chars().count(), MAX_ENTRY_CHARS);
        assert!(got[0].ends_with('…'));
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
        // appearance), so a megabyte of it must give the paragraph's own result.
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
