//! Keyword-overlap relevance.
//!
//! A document's score is the number of distinct query words it contains (words as
//! [`crate::text`] defines them). It is a cheap, explainable filter: no corpus statistics,
//! so it works on a handful of messages where BM25's idf means nothing.
//!
//! Selection semantics: [`keyword_select`] keeps the documents with a score above zero,
//! in their original order. When no document matches (or the query has no words) it keeps
//! all of them: a filter that would hand the model an empty context because the user's
//! wording missed is worse than no filter.

use hashbrown::HashSet;
use rayon::prelude::*;

use crate::text::for_each_word;

/// Batches with at least this many documents are scored on all cores.
const PARALLEL_MIN_DOCS: usize = 256;

fn query_words(query: &str, stop_words: bool) -> Vec<String> {
    let lowered = query.to_lowercase();
    let mut seen: HashSet<&str> = HashSet::new();
    for_each_word(&lowered, stop_words, |w| {
        seen.insert(w);
    });
    seen.into_iter().map(str::to_owned).collect()
}

/// Saturates at `u32::MAX` (a query of more than four billion distinct words).
fn overlap(words: &[String], doc: &str, stop_words: bool) -> u32 {
    let lowered = doc.to_lowercase();
    let mut present: HashSet<&str> = HashSet::new();
    for_each_word(&lowered, stop_words, |w| {
        present.insert(w);
    });
    let shared = words
        .iter()
        .filter(|w| present.contains(w.as_str()))
        .count();
    u32::try_from(shared).unwrap_or(u32::MAX)
}

/// For each document, how many distinct query words it contains.
pub fn keyword_scores<S: AsRef<str> + Sync>(query: &str, docs: &[S], stop_words: bool) -> Vec<u32> {
    let words = query_words(query, stop_words);
    if words.is_empty() {
        return vec![0; docs.len()];
    }
    if docs.len() >= PARALLEL_MIN_DOCS {
        docs.par_iter()
            .map(|d| overlap(&words, d.as_ref(), stop_words))
            .collect()
    } else {
        docs.iter()
            .map(|d| overlap(&words, d.as_ref(), stop_words))
            .collect()
    }
}

/// Indices of the documents that share a word with the query, in order; all indices
/// when none does (see the module docs for why).
pub fn keyword_select<S: AsRef<str> + Sync>(
    query: &str,
    docs: &[S],
    stop_words: bool,
) -> Vec<usize> {
    let scores = keyword_scores(query, docs, stop_words);
    let hits: Vec<usize> = (0..docs.len()).filter(|&i| scores[i] > 0).collect();
    if hits.is_empty() {
        (0..docs.len()).collect()
    } else {
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_distinct_query_words_present() {
        let docs = ["the cat sat", "dog and cat and cat", "nothing here", ""];
        assert_eq!(keyword_scores("cat cat dog", &docs, false), [1, 2, 0, 0]);
        assert_eq!(keyword_select("cat cat dog", &docs, false), [0, 1]);
    }

    #[test]
    fn no_match_keeps_everything() {
        let docs = ["alpha", "beta"];
        assert_eq!(keyword_select("gamma", &docs, false), [0, 1]);
        assert_eq!(keyword_select("a b", &docs, false), [0, 1]);
        assert_eq!(keyword_scores("", &docs, false), [0, 0]);
    }

    #[test]
    fn stop_words_do_not_match_when_dropped() {
        let docs = ["the end", "the start"];
        assert_eq!(keyword_scores("the start", &docs, false), [1, 2]);
        assert_eq!(keyword_scores("the start", &docs, true), [0, 1]);
    }

    #[test]
    fn parallel_path_equals_serial() {
        let docs: Vec<String> = (0..1000)
            .map(|i| format!("doc {i} word{}", i % 7))
            .collect();
        let par = keyword_scores("word3 doc", &docs, false);
        let ser: Vec<u32> = docs
            .iter()
            .map(|d| keyword_scores("word3 doc", &[d], false)[0])
            .collect();
        assert_eq!(par, ser);
    }
}
