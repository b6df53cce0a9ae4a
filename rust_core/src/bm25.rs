//! An incremental BM25 (Okapi) index over short documents (conversation messages).
//!
//! Scoring, with `N` live documents, `n(t)` of them containing term `t`, `tf` the term's
//! count in the document, `|D|` its length in words and `avgdl` the mean length:
//!
//! ```text
//! idf(t)      = ln(1 + (N - n(t) + 0.5) / (n(t) + 0.5))        (never negative)
//! score(D, Q) = sum over distinct t in Q of
//!               idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |D| / avgdl))
//! ```
//!
//! with `k1 = 1.2`, `b = 0.75` by default (the usual Okapi values: term-frequency saturation
//! and length normalisation of Robertson & Zaragoza). Repeated query words count once, as in
//! keyword overlap. Only documents containing at least one query term are returned.
//!
//! Layout, chosen to stay small at a million messages:
//! - terms are interned in one string arena behind a `hashbrown::HashTable` of term ids (no
//!   per-term `String`),
//! - each term has one posting list of packed 6-byte `(doc, tf)` entries, appended in doc
//!   order, so adding documents never rebuilds anything,
//! - per document only its external id, its length and a liveness bit are kept,
//! - a bulk add ([`Bm25Index::add_batch`]) tokenizes and folds [`ADD_CHUNK`] documents at a
//!   time, so building a million-message index needs little beyond the index itself.
//!
//! Removal (and replacing a document by adding its id again) marks a tombstone and fixes
//! `N` and `avgdl` at once; document frequencies of lists holding dead entries are
//! recounted at query time, and once dead documents pass a quarter of the live ones (checked
//! at the end of every add and remove) every list is compacted and documents renumbered. Term
//! frequencies saturate at 65,535 (BM25's tf saturation makes the difference nil).
//!
//! Search is term-at-a-time into a dense score array, then a k-sized heap; ties are broken
//! by ascending document id so results are deterministic.
//!
//! Limits: documents (live plus dead not yet compacted) and distinct terms are numbered
//! with `u32`, so an index holds fewer than 2^32 of each; an add past either limit is an
//! error that leaves the index as it was. A document's length in words saturates at
//! 2^32 - 1 (a 12 GB message; BM25's length normalisation barely moves by then).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};
use crate::text::for_each_term;

/// Documents a bulk add tokenizes and folds in at a time, so its scratch memory (lowered
/// copies, term lists) stays near a few megabytes whatever the batch size.
pub const ADD_CHUNK: usize = 8_192;

/// Batches with at least this many documents are tokenized on all cores.
pub const PARALLEL_MIN_DOCS: usize = 64;

/// Tokenize `texts` (see [`DocTerms::new`]), on all cores when there are enough of them.
pub fn prepare_all<S: AsRef<str> + Sync>(texts: &[S], stop_words: bool) -> Vec<DocTerms> {
    prepare_all_terms(texts, stop_words, false)
}

/// [`prepare_all`] with the terms of [`DocTerms::with_terms`].
pub fn prepare_all_terms<S: AsRef<str> + Sync>(
    texts: &[S],
    stop_words: bool,
    cjk_bigrams: bool,
) -> Vec<DocTerms> {
    let prepare = |t: &S| DocTerms::with_terms(t.as_ref(), stop_words, cjk_bigrams);
    if texts.len() >= PARALLEL_MIN_DOCS {
        texts.par_iter().map(prepare).collect()
    } else {
        texts.iter().map(prepare).collect()
    }
}

/// Default term-frequency saturation.
pub const DEFAULT_K1: f64 = 1.2;
/// Default length normalisation.
pub const DEFAULT_B: f64 = 0.75;

/// One posting: a document index and the term's count in it, packed to 6 bytes.
#[derive(Clone, Copy)]
#[repr(C, packed(2))]
struct Posting {
    doc: u32,
    tf: u16,
}

/// The most documents (live and dead) and distinct terms an index holds. Ids are `u32`
/// and `u32::MAX` marks a dropped document while compacting, so both stay below it.
#[derive(Clone, Copy)]
struct Limits {
    docs: u32,
    terms: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            docs: u32::MAX,
            terms: u32::MAX,
        }
    }
}

/// Interned vocabulary: term id -> text via one arena, text -> id via a hash table.
#[derive(Default)]
struct Vocab {
    table: HashTable<u32>,
    arena: String,
    /// `starts[id]..starts[id + 1]` is term `id` in `arena`.
    starts: Vec<usize>,
    hasher: DefaultHashBuilder,
}

impl Vocab {
    fn term<'a>(arena: &'a str, starts: &[usize], id: u32) -> &'a str {
        let id = id as usize;
        &arena[starts[id]..starts[id + 1]]
    }

    fn get(&self, word: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(word);
        self.table
            .find(hash, |&id| {
                Self::term(&self.arena, &self.starts, id) == word
            })
            .copied()
    }

    /// Number of distinct terms.
    fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Id of `word`, adding it if new; the flag says whether it was new. `None` when the
    /// next id would not fit a `u32` (callers check [`Limits`] first, so never in practice).
    fn intern(&mut self, word: &str) -> Option<(u32, bool)> {
        let hash = self.hasher.hash_one(word);
        let Vocab {
            table,
            arena,
            starts,
            hasher,
        } = self;
        if starts.is_empty() {
            starts.push(0);
        }
        if let Some(&id) = table.find(hash, |&id| Self::term(arena, starts, id) == word) {
            return Some((id, false));
        }
        let id = u32::try_from(starts.len() - 1).ok()?;
        arena.push_str(word);
        starts.push(arena.len());
        table.insert_unique(hash, id, |&i| hasher.hash_one(Self::term(arena, starts, i)));
        Some((id, true))
    }
}

/// The words of one document, counted, ready to append (computed without the index, so
/// many can be prepared in parallel).
#[derive(Debug, Clone, Default)]
pub struct DocTerms {
    lowered: String,
    /// `(start, end, tf)` byte ranges into `lowered`, one per distinct word. Offsets are
    /// `usize`: a `u32` would wrap past 4 GiB of text and slice the wrong bytes.
    terms: Vec<(usize, usize, u16)>,
    /// Words in the document, saturating at `u32::MAX`.
    len: u32,
}

impl DocTerms {
    /// Tokenize `text` (see [`crate::text`]) and count each distinct word.
    pub fn new(text: &str, stop_words: bool) -> Self {
        Self::with_terms(text, stop_words, false)
    }

    /// Tokenize `text` into the terms of [`crate::text::for_each_term`] (CJK runs as
    /// bigrams when `cjk_bigrams`) and count each distinct term.
    pub fn with_terms(text: &str, stop_words: bool, cjk_bigrams: bool) -> Self {
        let lowered = text.to_lowercase();
        let mut words: Vec<&str> = Vec::new();
        for_each_term(&lowered, stop_words, cjk_bigrams, |w| words.push(w));
        let len = u32::try_from(words.len()).unwrap_or(u32::MAX);
        words.sort_unstable();
        let base = lowered.as_ptr() as usize;
        let mut terms: Vec<(usize, usize, u16)> = Vec::new();
        for w in words {
            // `w` is a subslice of `lowered`, so this is its byte offset there.
            let start = w.as_ptr() as usize - base;
            match terms.last_mut() {
                Some(last) if &lowered[last.0..last.1] == w => {
                    last.2 = last.2.saturating_add(1);
                }
                _ => terms.push((start, start + w.len(), 1)),
            }
        }
        DocTerms {
            lowered,
            terms,
            len,
        }
    }

    /// The distinct words, in sorted order.
    fn words(&self) -> impl Iterator<Item = &str> {
        self.terms
            .iter()
            .map(|&(start, end, _)| &self.lowered[start..end])
    }
}

/// An incremental BM25 index; see the module docs.
pub struct Bm25Index {
    k1: f64,
    b: f64,
    stop_words: bool,
    cjk_bigrams: bool,
    vocab: Vocab,
    postings: Vec<Vec<Posting>>,
    doc_ids: Vec<i64>,
    doc_len: Vec<u32>,
    alive: Vec<bool>,
    /// Live documents by external id; `doc_ids` also holds the dead ones (until compacted).
    by_id: HashMap<i64, u32>,
    total_len: u64,
    limits: Limits,
}

#[derive(PartialEq)]
struct Hit {
    score: f64,
    id: i64,
}

impl Eq for Hit {}

impl Ord for Hit {
    /// "Better" is greater: higher score, then lower id.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.id.cmp(&self.id))
    }
}

impl PartialOrd for Hit {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Bm25Index {
    /// An empty index. `k1` must be finite and >= 0, `b` within [0, 1].
    pub fn new(k1: f64, b: f64, stop_words: bool) -> CoreResult<Self> {
        Self::with_terms(k1, b, stop_words, false)
    }

    /// An empty index whose documents and queries are cut into the terms of
    /// [`crate::text::for_each_term`]: with `cjk_bigrams`, CJK runs become overlapping
    /// pairs of characters, so text without spaces between words is searchable.
    pub fn with_terms(k1: f64, b: f64, stop_words: bool, cjk_bigrams: bool) -> CoreResult<Self> {
        if !(k1.is_finite() && k1 >= 0.0) {
            return Err(CoreError::InvalidArgument(format!(
                "k1 must be a finite number >= 0, got {k1}"
            )));
        }
        if !(0.0..=1.0).contains(&b) {
            return Err(CoreError::InvalidArgument(format!(
                "b must be within [0, 1], got {b}"
            )));
        }
        Ok(Bm25Index {
            k1,
            b,
            stop_words,
            cjk_bigrams,
            vocab: Vocab::default(),
            postings: Vec::new(),
            doc_ids: Vec::new(),
            doc_len: Vec::new(),
            alive: Vec::new(),
            by_id: HashMap::new(),
            total_len: 0,
            limits: Limits::default(),
        })
    }

    /// An empty index with small limits, to test what happens when one is reached.
    #[cfg(test)]
    fn with_limits(docs: u32, terms: u32) -> Self {
        let mut ix = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).expect("valid defaults");
        ix.limits = Limits { docs, terms };
        ix
    }

    /// Term-frequency saturation parameter.
    pub fn k1(&self) -> f64 {
        self.k1
    }

    /// Length normalisation parameter.
    pub fn b(&self) -> f64 {
        self.b
    }

    /// Whether English stop words are dropped from documents and queries.
    pub fn stop_words(&self) -> bool {
        self.stop_words
    }

    /// Number of live documents.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the index holds no live document.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Number of dead (removed or replaced, not yet compacted) documents still stored.
    fn dead(&self) -> usize {
        self.doc_ids.len() - self.by_id.len()
    }

    /// Whether a live document has this id.
    pub fn contains(&self, id: i64) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Number of distinct terms ever indexed.
    pub fn vocabulary_size(&self) -> usize {
        self.postings.len()
    }

    /// Whether CJK runs are cut into bigrams (see [`Bm25Index::with_terms`]).
    pub fn cjk_bigrams(&self) -> bool {
        self.cjk_bigrams
    }

    /// Tokenize a document with this index's settings (no index access: parallelisable).
    pub fn prepare(&self, text: &str) -> DocTerms {
        DocTerms::with_terms(text, self.stop_words, self.cjk_bigrams)
    }

    /// About how many bytes the index holds (allocated capacity of its tables), so a
    /// caller keeping many indexes can bound their memory.
    pub fn memory_bytes(&self) -> usize {
        let postings: usize = self
            .postings
            .iter()
            .map(|l| l.capacity() * std::mem::size_of::<Posting>())
            .sum();
        postings
            + self.postings.capacity() * std::mem::size_of::<Vec<Posting>>()
            + self.vocab.arena.capacity()
            + self.vocab.starts.capacity() * std::mem::size_of::<usize>()
            + self.vocab.table.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.doc_ids.capacity() * std::mem::size_of::<i64>()
            + self.doc_len.capacity() * std::mem::size_of::<u32>()
            + self.alive.capacity()
            + self.by_id.capacity() * (std::mem::size_of::<(i64, u32)>() + 1)
    }

    /// Add a prepared document. An existing document with the same id is replaced.
    pub fn add_prepared(&mut self, id: i64, doc: &DocTerms) -> CoreResult<()> {
        let added = self.insert_prepared(id, doc);
        self.maybe_compact();
        added
    }

    /// [`Bm25Index::add_prepared`] without the compaction check (a batch checks once).
    fn insert_prepared(&mut self, id: i64, doc: &DocTerms) -> CoreResult<()> {
        // Both limits are checked before anything changes, so a full index keeps the
        // document an add would have replaced, and never holds half a document.
        let limits = self.limits;
        let idx = u32::try_from(self.doc_ids.len())
            .ok()
            .filter(|&i| i < limits.docs)
            .ok_or_else(|| {
                CoreError::InvalidArgument(format!("index is full ({} documents)", limits.docs))
            })?;
        let vocab_full = || {
            CoreError::InvalidArgument(format!(
                "index vocabulary is full ({} distinct words)",
                limits.terms
            ))
        };
        let room = (limits.terms as usize)
            .checked_sub(self.vocab.len())
            .ok_or_else(vocab_full)?;
        // Counting the new words costs a lookup each: only done near the limit.
        if doc.terms.len() > room
            && doc.words().filter(|w| self.vocab.get(w).is_none()).count() > room
        {
            return Err(vocab_full());
        }
        self.remove_one(id);
        for (word, &(_, _, tf)) in doc.words().zip(&doc.terms) {
            let (term, new) = self.vocab.intern(word).ok_or_else(vocab_full)?;
            if new {
                self.postings.push(Vec::with_capacity(1));
            }
            self.postings[term as usize].push(Posting { doc: idx, tf });
        }
        self.doc_ids.push(id);
        self.doc_len.push(doc.len);
        self.alive.push(true);
        self.by_id.insert(id, idx);
        self.total_len += u64::from(doc.len);
        Ok(())
    }

    /// Tokenize and add one document (replacing any with the same id).
    pub fn add(&mut self, id: i64, text: &str) -> CoreResult<()> {
        let doc = self.prepare(text);
        self.add_prepared(id, &doc)
    }

    /// Add many documents, in order (a later duplicate id replaces an earlier one), as
    /// [`Bm25Index::add_batch_with_head`] with nothing prepared yet.
    pub fn add_batch<S: AsRef<str> + Sync>(&mut self, ids: &[i64], texts: &[S]) -> CoreResult<()> {
        self.add_batch_with_head(ids, texts, Vec::new())
    }

    /// Add many documents, in order, whose first `head.len()` are already prepared (so a
    /// caller can tokenize the first chunk before taking a lock on the index).
    ///
    /// The rest is tokenized [`ADD_CHUNK`] documents at a time, each chunk in parallel
    /// while the previous one is folded into the postings, and dropped once folded: the
    /// working memory is two chunks, not the batch. Afterwards, if the batch spanned
    /// several chunks, spare capacity is released (see [`Bm25Index::shrink_to_fit`]).
    pub fn add_batch_with_head<S: AsRef<str> + Sync>(
        &mut self,
        ids: &[i64],
        texts: &[S],
        head: Vec<DocTerms>,
    ) -> CoreResult<()> {
        if ids.len() != texts.len() || head.len() > texts.len() {
            return Err(CoreError::LengthMismatch {
                column: "texts",
                expected: ids.len(),
                actual: texts.len(),
            });
        }
        let stop_words = self.stop_words;
        let cjk_bigrams = self.cjk_bigrams;
        let n = texts.len();
        self.reserve(n);
        let mut ready = head;
        let mut at = 0;
        if ready.is_empty() && n > 0 {
            ready = prepare_all_terms(&texts[..n.min(ADD_CHUNK)], stop_words, cjk_bigrams);
        }
        while at < n {
            let end = at + ready.len();
            let upcoming = &texts[end..n.min(end + ADD_CHUNK)];
            let batch_ids = &ids[at..end];
            let (folded, next) = if upcoming.is_empty() {
                (self.fold(batch_ids, &ready), Vec::new())
            } else {
                rayon::join(
                    || self.fold(batch_ids, &ready),
                    || prepare_all_terms(upcoming, stop_words, cjk_bigrams),
                )
            };
            if let Err(err) = folded {
                self.maybe_compact();
                return Err(err);
            }
            at = end;
            ready = next;
        }
        self.maybe_compact();
        if n > ADD_CHUNK {
            self.shrink_to_fit();
        }
        Ok(())
    }

    fn fold(&mut self, ids: &[i64], docs: &[DocTerms]) -> CoreResult<()> {
        ids.iter()
            .zip(docs)
            .try_for_each(|(&id, doc)| self.insert_prepared(id, doc))
    }

    /// Make room for `additional` more documents in the per-document tables, so a bulk
    /// add grows them once instead of doubling (and rehashing) along the way.
    pub fn reserve(&mut self, additional: usize) {
        self.doc_ids.reserve(additional);
        self.doc_len.reserve(additional);
        self.alive.reserve(additional);
        self.by_id.reserve(additional);
    }

    /// Release most spare capacity left by growth: posting lists grow by doubling, so up
    /// to half of a list can be unused. Each list keeps an eighth of headroom, so the
    /// next adds do not immediately copy every list they touch.
    pub fn shrink_to_fit(&mut self) {
        for list in &mut self.postings {
            list.shrink_to(list.len() + list.len() / 8);
        }
        self.postings.shrink_to_fit();
        self.vocab.arena.shrink_to_fit();
        self.vocab.starts.shrink_to_fit();
        self.doc_ids.shrink_to_fit();
        self.doc_len.shrink_to_fit();
        self.alive.shrink_to_fit();
    }

    fn remove_one(&mut self, id: i64) -> bool {
        let Some(idx) = self.by_id.remove(&id) else {
            return false;
        };
        let idx = idx as usize;
        self.alive[idx] = false;
        self.total_len -= u64::from(self.doc_len[idx]);
        true
    }

    /// Remove documents by id (unknown ids are ignored); returns how many were removed.
    pub fn remove(&mut self, ids: &[i64]) -> usize {
        let removed = ids.iter().filter(|&&id| self.remove_one(id)).count();
        self.maybe_compact();
        removed
    }

    /// Compact once dead documents (removed, or replaced by an add) pass a quarter of the
    /// live ones. Called at the end of every add and remove, so a store whose documents
    /// are replaced over and over stays bounded too.
    fn maybe_compact(&mut self) {
        let dead = self.dead();
        if dead > 0 && dead * 4 > self.len() {
            self.compact();
        }
    }

    /// Drop dead postings and renumber live documents densely.
    fn compact(&mut self) {
        let mut new_index = vec![u32::MAX; self.doc_ids.len()];
        let mut next = 0u32;
        for (old, &alive) in self.alive.iter().enumerate() {
            if alive {
                new_index[old] = next;
                next += 1;
            }
        }
        for list in &mut self.postings {
            list.retain(|p| new_index[p.doc as usize] != u32::MAX);
            for p in list.iter_mut() {
                p.doc = new_index[p.doc as usize];
            }
            list.shrink_to_fit();
        }
        let alive = std::mem::take(&mut self.alive);
        retain_alive(&mut self.doc_ids, &alive);
        retain_alive(&mut self.doc_len, &alive);
        self.alive = vec![true; self.doc_ids.len()];
        // Numbered from a `u32` counter: there are fewer than `limits.docs` documents.
        self.by_id = self
            .doc_ids
            .iter()
            .zip(0u32..)
            .map(|(&id, i)| (id, i))
            .collect();
    }

    /// The `k` best documents for `query`: `(id, score)` pairs, best first.
    pub fn search(&self, query: &str, k: usize) -> Vec<(i64, f64)> {
        self.search_within(query, k, None)
    }

    /// [`Bm25Index::search`] among the documents whose ids are in `within` only (in any
    /// order; ids the index does not hold are ignored), when given. The statistics (`N`,
    /// `avgdl`, document frequencies) stay those of the whole index, so a document scores
    /// the same whichever subset is searched.
    pub fn search_within(&self, query: &str, k: usize, within: Option<&[i64]>) -> Vec<(i64, f64)> {
        if k == 0 || self.is_empty() {
            return Vec::new();
        }
        let allowed: Option<Vec<bool>> = within.map(|ids| {
            let mut allowed = vec![false; self.doc_ids.len()];
            for id in ids {
                if let Some(&idx) = self.by_id.get(id) {
                    allowed[idx as usize] = true;
                }
            }
            allowed
        });
        let lowered = query.to_lowercase();
        let mut terms: Vec<u32> = Vec::new();
        for_each_term(&lowered, self.stop_words, self.cjk_bigrams, |w| {
            if let Some(t) = self.vocab.get(w) {
                terms.push(t);
            }
        });
        terms.sort_unstable();
        terms.dedup();
        if terms.is_empty() {
            return Vec::new();
        }
        let n = self.len() as f64;
        let dead = self.dead();
        let avgdl = self.total_len as f64 / n;
        let mut scores = vec![0.0f64; self.doc_ids.len()];
        let mut touched: Vec<u32> = Vec::new();
        for &t in &terms {
            let list = &self.postings[t as usize];
            let df = if dead == 0 {
                list.len()
            } else {
                list.iter().filter(|p| self.alive[p.doc as usize]).count()
            };
            if df == 0 {
                continue;
            }
            let df = df as f64;
            let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
            let scale = idf * (self.k1 + 1.0);
            for p in list {
                let doc = p.doc as usize;
                if !self.alive[doc] || allowed.as_ref().is_some_and(|a| !a[doc]) {
                    continue;
                }
                let tf = f64::from(p.tf);
                let norm = self.k1 * (1.0 - self.b + self.b * f64::from(self.doc_len[doc]) / avgdl);
                let s = &mut scores[doc];
                if *s == 0.0 {
                    touched.push(p.doc);
                }
                *s += scale * tf / (tf + norm);
            }
        }
        // No more hits than touched documents: a huge `k` must not size the heap.
        let k = k.min(touched.len());
        // Min-heap of the k best so far (Reverse order via the wrapper's Ord).
        let mut heap: BinaryHeap<std::cmp::Reverse<Hit>> = BinaryHeap::with_capacity(k + 1);
        for doc in touched {
            let hit = Hit {
                score: scores[doc as usize],
                id: self.doc_ids[doc as usize],
            };
            if heap.len() < k {
                heap.push(std::cmp::Reverse(hit));
            } else if let Some(worst) = heap.peek() {
                if hit > worst.0 {
                    heap.pop();
                    heap.push(std::cmp::Reverse(hit));
                }
            }
        }
        let mut hits: Vec<Hit> = heap.into_iter().map(|r| r.0).collect();
        hits.sort_unstable_by(|a, b| b.cmp(a));
        hits.into_iter().map(|h| (h.id, h.score)).collect()
    }
}

/// Keep the entries of `v` whose `alive` flag is set.
fn retain_alive<T>(v: &mut Vec<T>, alive: &[bool]) {
    let mut flags = alive.iter();
    v.retain(|_| flags.next().copied().unwrap_or(false));
    v.shrink_to_fit();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(docs: &[(i64, &str)]) -> Bm25Index {
        let mut ix = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        for &(id, text) in docs {
            ix.add(id, text).unwrap();
        }
        ix
    }

    /// Straight from the formula, for a hand-checkable case.
    fn bm25(tf: f64, df: f64, n: f64, len: f64, avgdl: f64) -> f64 {
        let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
        idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len / avgdl))
    }

    #[test]
    fn posting_is_six_bytes() {
        assert_eq!(std::mem::size_of::<Posting>(), 6);
    }

    #[test]
    fn scores_follow_the_formula() {
        let ix = index(&[
            (10, "rust borrow checker rust"),
            (20, "python garbage collector"),
            (30, "rust and python bindings"),
        ]);
        // lengths 4, 3, 4 ("and" is kept: no stop words); avgdl 11/3.
        let avgdl = 11.0 / 3.0;
        let hits = ix.search("rust", 10);
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].0, 10);
        assert!((hits[0].1 - bm25(2.0, 2.0, 3.0, 4.0, avgdl)).abs() < 1e-12);
        assert_eq!(hits[1].0, 30);
        assert!((hits[1].1 - bm25(1.0, 2.0, 3.0, 4.0, avgdl)).abs() < 1e-12);
        let both = ix.search("rust python rust", 10);
        assert_eq!(both[0].0, 30);
        let expected = bm25(1.0, 2.0, 3.0, 4.0, avgdl) * 2.0;
        assert!((both[0].1 - expected).abs() < 1e-12);
    }

    #[test]
    fn top_k_orders_by_score_then_id() {
        let ix = index(&[(5, "same text"), (3, "same text"), (9, "same text here")]);
        let hits = ix.search("same", 2);
        assert_eq!(hits.iter().map(|h| h.0).collect::<Vec<_>>(), [3, 5]);
        assert!(ix.search("same", 0).is_empty());
        assert!(ix.search("absent", 5).is_empty());
        assert!(ix.search("", 5).is_empty());
    }

    #[test]
    fn remove_updates_statistics_and_replace_works() {
        let mut ix = index(&[(1, "alpha beta"), (2, "alpha gamma"), (3, "delta")]);
        let fresh = index(&[(2, "alpha gamma"), (3, "delta")]);
        assert_eq!(ix.remove(&[1, 99]), 1);
        assert_eq!(ix.len(), 2);
        assert!(!ix.contains(1) && ix.contains(2));
        assert_eq!(ix.search("alpha beta", 5), fresh.search("alpha beta", 5));
        ix.add(3, "alpha alpha").unwrap();
        let replaced = index(&[(2, "alpha gamma"), (3, "alpha alpha")]);
        assert_eq!(ix.search("alpha", 5), replaced.search("alpha", 5));
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn compaction_keeps_results() {
        let mut ix = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        for i in 0..100 {
            ix.add(i, &format!("word{} common text{}", i % 10, i % 3))
                .unwrap();
        }
        let mut fresh = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        for i in 60..100 {
            fresh
                .add(i, &format!("word{} common text{}", i % 10, i % 3))
                .unwrap();
        }
        ix.remove(&(0..60).collect::<Vec<_>>());
        assert_eq!(ix.dead(), 0, "compacted");
        assert_eq!(ix.doc_ids.len(), 40);
        for q in ["common", "word3 text1", "word7"] {
            assert_eq!(ix.search(q, 100), fresh.search(q, 100), "{q}");
        }
    }

    fn postings_total(ix: &Bm25Index) -> usize {
        ix.postings.iter().map(Vec::len).sum()
    }

    #[test]
    fn replacing_documents_compacts_too() {
        let text = |i: i64, round: i64| format!("word{} common text{} round{round}", i % 10, i % 3);
        let ids: Vec<i64> = (0..100).collect();
        let mut one = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        let mut batch = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        for round in 0..10 {
            for &i in &ids {
                one.add(i, &text(i, round)).unwrap();
            }
            let texts: Vec<String> = ids.iter().map(|&i| text(i, round)).collect();
            batch.add_batch(&ids, &texts).unwrap();
            let mut fresh = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
            fresh.add_batch(&ids, &texts).unwrap();
            for ix in [&one, &batch] {
                assert_eq!(ix.len(), 100);
                // Never more than a quarter dead: 4 words per document.
                assert!(
                    ix.dead() * 4 <= ix.len(),
                    "round {round}: {} dead",
                    ix.dead()
                );
                assert!(ix.doc_ids.len() <= 125);
                assert!(postings_total(ix) <= 125 * 4, "round {round}");
                for q in ["common", "word3 text1", &format!("round{round}"), "round0"] {
                    assert_eq!(ix.search(q, 200), fresh.search(q, 200), "{q}");
                }
            }
        }
    }

    #[test]
    fn chunked_batch_add_matches_one_by_one() {
        let n = 2 * ADD_CHUNK + 100;
        // Ids repeat every 5,000 documents, so the batch replaces some of its own entries,
        // across chunk boundaries too.
        let ids: Vec<i64> = (0..n as i64).map(|i| i % 5_000 + 7).collect();
        let texts: Vec<String> = (0..n)
            .map(|i| format!("message{} about topic{} and word{}", i % 97, i % 13, i % 5))
            .collect();
        let mut batch = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        batch.add(1, "already here topic3").unwrap();
        batch.add_batch(&ids, &texts).unwrap();
        let mut single = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        single.add(1, "already here topic3").unwrap();
        for (&id, text) in ids.iter().zip(&texts) {
            single.add(id, text).unwrap();
        }
        assert_eq!(batch.len(), single.len());
        assert_eq!(batch.vocabulary_size(), single.vocabulary_size());
        for q in ["topic3 word1", "message42", "about", "here"] {
            assert_eq!(batch.search(q, 50), single.search(q, 50), "{q}");
        }
        let head = prepare_all(&texts[..10], false);
        let mut headed = Bm25Index::new(DEFAULT_K1, DEFAULT_B, false).unwrap();
        headed.add(1, "already here topic3").unwrap();
        headed.add_batch_with_head(&ids, &texts, head).unwrap();
        assert_eq!(
            headed.search("topic3 word1", 50),
            batch.search("topic3 word1", 50)
        );
        assert!(headed.add_batch(&ids[..2], &texts[..3]).is_err());
    }

    #[test]
    fn huge_k_returns_every_hit() {
        let ix = index(&[(1, "alpha beta"), (2, "alpha"), (3, "gamma")]);
        let all = ix.search("alpha", 10);
        assert_eq!(all.len(), 2);
        // `k + 1` overflowed and sized the heap from `k` (a capacity overflow panic).
        for k in [usize::MAX, usize::MAX / 2 + 1, 1 << 40] {
            assert_eq!(ix.search("alpha", k), all, "k={k}");
        }
    }

    /// Search results and statistics, to check an index is unchanged.
    fn snapshot(ix: &Bm25Index) -> (usize, usize, Vec<(i64, f64)>) {
        (
            ix.len(),
            ix.vocabulary_size(),
            ix.search("alpha beta gamma delta epsilon", 100),
        )
    }

    #[test]
    fn a_full_index_rejects_documents_and_stays_whole() {
        let mut ix = Bm25Index::with_limits(3, 100);
        ix.add(1, "alpha").unwrap();
        ix.add(2, "beta").unwrap();
        ix.add(3, "gamma").unwrap();
        let before = snapshot(&ix);
        let err = ix.add(4, "delta").unwrap_err();
        assert_eq!(err.to_string(), "index is full (3 documents)");
        // Replacing an existing id needs a new slot too: the old document stays.
        assert!(ix.add(2, "delta").is_err());
        assert!(ix.add_batch(&[5, 6], &["delta", "epsilon"]).is_err());
        assert_eq!(snapshot(&ix), before);
        assert_eq!(ix.search("beta", 5).len(), 1);
        // Removing frees slots once compaction drops the dead ones.
        assert_eq!(ix.remove(&[1, 2]), 2);
        ix.add(4, "delta").unwrap();
        assert_eq!(ix.search("delta", 5).len(), 1);
    }

    #[test]
    fn a_full_vocabulary_rejects_new_words_only() {
        let mut ix = Bm25Index::with_limits(100, 3);
        ix.add(1, "alpha beta").unwrap();
        let before = snapshot(&ix);
        // Two new words where one fits: nothing of the document is added.
        let err = ix.add(2, "gamma delta alpha").unwrap_err();
        assert_eq!(
            err.to_string(),
            "index vocabulary is full (3 distinct words)"
        );
        assert_eq!(snapshot(&ix), before);
        // Known words need no room, even when the document has more words than is left.
        ix.add(3, "alpha beta alpha").unwrap();
        ix.add(4, "gamma alpha").unwrap();
        assert_eq!(ix.vocabulary_size(), 3);
        assert!(ix.add(5, "delta").is_err());
        ix.add(6, "gamma beta alpha").unwrap();
        assert_eq!(ix.len(), 4);
        assert_eq!(ix.search("gamma", 10).len(), 2);
    }

    #[test]
    fn multibyte_words_are_sliced_on_their_boundaries() {
        let doc = DocTerms::new("Ünïcödé 日本語 ǅemal 🙂x ünïcödé İstanbul", false);
        let words: Vec<&str> = doc.words().collect();
        // Sorted by bytes; `İ` lower-cases to `i` + U+0307, so the text changes length.
        assert_eq!(words, ["i\u{307}stanbul", "ünïcödé", "ǆemal", "日本語"]);
        let tfs: Vec<u16> = doc.terms.iter().map(|t| t.2).collect();
        assert_eq!(tfs, [1, 2, 1, 1]);
        assert_eq!(doc.len, 5);
    }

    /// A document past 4 GiB: word offsets were `u32` and wrapped, so the words were
    /// read from the wrong bytes. Needs about 9 GB of memory.
    #[test]
    #[ignore = "needs ~9 GB of memory; run with --release -- --ignored"]
    fn words_past_four_gib_are_read_from_their_own_bytes() {
        let mut text = " ".repeat((1usize << 32) + 3);
        text.push_str("ALPHA beta");
        let doc = DocTerms::new(&text, false);
        drop(text);
        assert_eq!(doc.words().collect::<Vec<_>>(), ["alpha", "beta"]);
        assert_eq!(doc.len, 2);
    }

    #[test]
    fn search_within_keeps_the_whole_index_statistics() {
        let ix = index(&[
            (1, "alpha beta"),
            (2, "alpha alpha gamma"),
            (3, "beta gamma"),
            (4, "alpha"),
        ]);
        let all = ix.search("alpha", 10);
        let some = ix.search_within("alpha", 10, Some(&[4, 2, 99]));
        let expected: Vec<(i64, f64)> = all
            .iter()
            .copied()
            .filter(|(id, _)| *id == 2 || *id == 4)
            .collect();
        assert_eq!(some, expected);
        assert!(ix.search_within("alpha", 10, Some(&[])).is_empty());
        assert_eq!(ix.search_within("alpha", 10, None), all);
    }

    #[test]
    fn cjk_text_is_found_by_its_bigrams() {
        let mut ix = Bm25Index::with_terms(DEFAULT_K1, DEFAULT_B, false, true).unwrap();
        ix.add(1, "東京都に行く予定です").unwrap();
        ix.add(2, "大阪に行った").unwrap();
        ix.add(3, "plain english text").unwrap();
        assert!(ix.cjk_bigrams());
        assert_eq!(
            ix.search("東京", 10)
                .iter()
                .map(|h| h.0)
                .collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(ix.search("に行", 10).len(), 2);
        assert_eq!(ix.search("english", 10)[0].0, 3);
        let plain = index(&[(1, "東京都に行く予定です")]);
        assert!(plain.search("東京", 10).is_empty());
        assert!(ix.memory_bytes() > plain.memory_bytes());
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Bm25Index::new(-1.0, 0.75, false).is_err());
        assert!(Bm25Index::new(f64::NAN, 0.75, false).is_err());
        assert!(Bm25Index::new(1.2, 1.5, false).is_err());
    }
}
