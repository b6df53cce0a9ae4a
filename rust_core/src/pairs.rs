//! Orphaned tool pairs in a window's columns: which tool_results have no call before them
//! in the window, and which calls have no result in it.
//!
//! A build repairs orphans before trimming (see `trim`'s group contract), and it must look
//! at the whole window: an orphan result anywhere would otherwise hold its group open.
//! In NumPy that took several passes and temporaries over every row (about 1.5 ms for a
//! million-message window); here it is one pass that skips rows of no group in blocks,
//! so a window costs about one read of its role and group columns, and only the few
//! grouped rows cost more.
//!
//! Columns (one entry per message, window order): `ids` (the stored ids, unique),
//! `roles` (role codes, see [`crate::Role`]) and `groups` (the store's tool group: a
//! tool-using message has the group of its own id, each tool_result the id of the
//! message that issued its call, `-1` for none).
//!
//! A *head* is a row whose group is its own id and whose role is not tool_result. A
//! tool_result is *answered* when the head of its group comes before it in the window;
//! else it is an orphan (a result of no group included). A head is an orphan when no
//! answered result names it.

use hashbrown::HashMap;

use crate::error::{CoreError, CoreResult};

/// The wire code of a tool_result (the trimmer's `Role`, one definition of the codes).
const TOOL_RESULT: u8 = crate::trim::Role::ToolResult as u8;

/// Rows per block whose "any tool row?" test is two vectorizable folds.
const BLOCK: usize = 256;

/// The orphans of a window, as ascending row positions.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Orphans {
    /// tool_results with no head of their group before them in the window.
    pub results: Vec<usize>,
    /// Heads none of whose results is answered in the window.
    pub calls: Vec<usize>,
}

/// Find the orphans of `ids`/`roles`/`groups` (see the module docs). Errors when the
/// columns differ in length.
pub fn pair_orphans(ids: &[i64], roles: &[u8], groups: &[i64]) -> CoreResult<Orphans> {
    let n = ids.len();
    if roles.len() != n || groups.len() != n {
        return Err(CoreError::InvalidArgument(format!(
            "columns differ in length: ids {n}, roles {}, groups {}",
            roles.len(),
            groups.len()
        )));
    }
    // Heads seen so far: id -> index into `heads` (position, heard).
    let mut index: HashMap<i64, usize> = HashMap::new();
    let mut heads: Vec<(usize, bool)> = Vec::new();
    let mut out = Orphans::default();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        // Two folds the compiler turns into SIMD on any x86-64 (no 64-bit compare
        // needed): every group negative iff their AND is (the sign bit of each), and no
        // tool_result among the roles.
        let ungrouped = groups[start..end].iter().fold(-1i64, |all, &g| all & g) < 0;
        let no_result = roles[start..end]
            .iter()
            .fold(0u8, |any, &r| any | u8::from(r == TOOL_RESULT))
            == 0;
        let plain = ungrouped && no_result;
        if !plain {
            for i in start..end {
                let (g, r) = (groups[i], roles[i]);
                if r == TOOL_RESULT {
                    match index.get(&g) {
                        Some(&h) if g >= 0 => heads[h].1 = true,
                        _ => out.results.push(i),
                    }
                } else if g >= 0 && g == ids[i] {
                    index.insert(g, heads.len());
                    heads.push((i, false));
                }
            }
        }
        start = end;
    }
    out.calls = heads
        .into_iter()
        .filter(|&(_, heard)| !heard)
        .map(|(at, _)| at)
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    const U: u8 = 1;
    const A: u8 = 2;
    const TU: u8 = 3;
    const TR: u8 = 4;

    /// The definition, row by row (quadratic): what the one pass must agree with.
    fn reference(ids: &[i64], roles: &[u8], groups: &[i64]) -> Orphans {
        let is_head = |j: usize| groups[j] >= 0 && groups[j] == ids[j] && roles[j] != TR;
        let answered =
            |i: usize| groups[i] >= 0 && (0..i).any(|j| is_head(j) && ids[j] == groups[i]);
        let results = (0..ids.len())
            .filter(|&i| roles[i] == TR && !answered(i))
            .collect();
        let calls = (0..ids.len())
            .filter(|&j| is_head(j))
            .filter(|&j| {
                !(0..ids.len()).any(|i| roles[i] == TR && groups[i] == ids[j] && answered(i))
            })
            .collect();
        Orphans { results, calls }
    }

    #[test]
    fn answered_pairs_are_not_orphans() {
        // user, tool_use (id 11), result of 11, assistant with calls (id 13), result of 13
        let ids = [10, 11, 12, 13, 14];
        let roles = [U, TU, TR, A, TR];
        let groups = [-1, 11, 11, 13, 13];
        assert_eq!(
            pair_orphans(&ids, &roles, &groups).unwrap(),
            Orphans::default()
        );
    }

    #[test]
    fn results_before_or_without_their_call_and_unanswered_calls_are_orphans() {
        // result of a call before the window, a call never answered, a result of no
        // group, a result before its call
        let ids = [20, 21, 22, 23, 24, 25];
        let roles = [TR, TU, TR, U, TR, TU];
        let groups = [5, 21, -1, -1, 25, 25];
        let found = pair_orphans(&ids, &roles, &groups).unwrap();
        assert_eq!(found.results, vec![0, 2, 4]);
        assert_eq!(found.calls, vec![1, 5]);
        assert_eq!(found, reference(&ids, &roles, &groups));
    }

    #[test]
    fn columns_of_different_lengths_are_an_error() {
        assert!(pair_orphans(&[1, 2], &[U], &[-1, -1]).is_err());
        assert!(pair_orphans(&[1], &[U], &[]).is_err());
        assert_eq!(pair_orphans(&[], &[], &[]).unwrap(), Orphans::default());
    }

    #[test]
    fn agrees_with_the_definition_on_random_windows() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..400 {
            // Long enough to cross blocks, with runs of plain rows between tool rows.
            let n = rng.below(300);
            let first = 1 + rng.below(1000) as i64;
            let ids: Vec<i64> = (0..n as i64).map(|k| first + 2 * k).collect();
            let mut roles = vec![U; n];
            let mut groups = vec![-1i64; n];
            for i in 0..n {
                if rng.below(4) != 0 {
                    roles[i] = [U, A][rng.below(2)];
                    continue;
                }
                match rng.below(6) {
                    0 | 1 => {
                        roles[i] = [TU, A][rng.below(2)];
                        groups[i] = ids[i];
                    }
                    2 | 3 if n > 0 => {
                        roles[i] = TR;
                        groups[i] = ids[rng.below(n)];
                    }
                    4 => {
                        roles[i] = TR;
                        groups[i] = [-1, 0, 3][rng.below(3)];
                    }
                    _ => {
                        roles[i] = A;
                        groups[i] = ids[rng.below(n)];
                    }
                }
            }
            let found = pair_orphans(&ids, &roles, &groups).unwrap();
            assert_eq!(found, reference(&ids, &roles, &groups));
        }
    }
}
