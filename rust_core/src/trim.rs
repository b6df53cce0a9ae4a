//! Budget trimming: which suffix of a conversation fits a token budget.
//!
//! Input is columnar (one slice per field, one entry per message, oldest first) so the
//! Python side hands over a few flat lists instead of one object per message, and the
//! output is flat index lists for the same reason.
//!
//! The rules, in the order they are applied:
//!
//! 1. A message longer than `max_chars` characters is truncated to `max_chars`,
//!    and from then on costs `truncated_tokens[i]` if given, else the estimate of
//!    `max_chars` characters, `(max_chars + 3) / 4` (never more than its full count).
//! 2. Messages are kept newest first, as one contiguous suffix: a conversation with a
//!    hole in it reads as if the model forgot something mid-stream.
//! 3. The suffix may only start where no tool group is cut in two, and never at a
//!    `tool_result` (a result whose call is missing is rejected by the model APIs).
//!    Parallel calls share a group, so a tool_use and all its results stay or go together.
//! 4. The kept total never exceeds the budget.
//! 5. If not even the newest message fits alone, it is kept cut down to fit (the caller
//!    truncates it to the reported character count) rather than sending an empty context.
//!
//! Group contract (a precondition): the caller assigns one id (>= 0) per message that
//! calls tools (its head: a tool_use, or an assistant or other turn carrying tool calls)
//! and gives its tool_results the same id (it derives them from tool_call ids); `-1` means
//! no group. Each group's head comes before all of its results; other messages may sit
//! between them. That contract is what lets the walk stop early: walking back from the
//! newest message, a group is "open" from its newest member until its head is reached,
//! and a cut is allowed only where no group is open. The walk stops at the first message
//! that breaks the budget, so it visits only the newest messages whose total fits the
//! budget (the kept ones, plus any of a group left open when the budget ran out) and one
//! more: the call costs O(that suffix), not O(history). The Python bindings read the
//! columns in place for the same reason.
//!
//! Input that breaks the contract still yields a suffix within the budget that does not
//! start with a tool_result, but it may split a group: a result placed before its
//! head closes the group early, so the cut can fall between them. Results with no
//! head at all keep their group open, so nothing older than them is kept. The walk cannot
//! tell such an orphan from a result whose head lies beyond the budget without reading
//! the whole history, so callers repair orphans first: contextd's builder gives an
//! orphan result the user role and no group (it is sent as text) before trimming.

use hashbrown::HashSet;

use crate::error::{CoreError, CoreResult};

/// The default per-message character limit.
pub const DEFAULT_MAX_CHARS: u64 = 4000;

/// Message roles as they arrive over the wire (small integers keep the columns flat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// A user turn.
    User = 1,
    /// An assistant turn without tool calls.
    Assistant = 2,
    /// An assistant turn that calls one or more tools.
    ToolUse = 3,
    /// A tool's answer to a call.
    ToolResult = 4,
}

impl TryFrom<u8> for Role {
    type Error = CoreError;

    fn try_from(code: u8) -> CoreResult<Self> {
        match code {
            1 => Ok(Role::User),
            2 => Ok(Role::Assistant),
            3 => Ok(Role::ToolUse),
            4 => Ok(Role::ToolResult),
            other => Err(CoreError::InvalidArgument(format!(
                "role code {other} is not one of 1 (user), 2 (assistant), 3 (tool_use), 4 (tool_result)"
            ))),
        }
    }
}

/// The conversation, one entry per message in each column, oldest first.
#[derive(Debug, Clone, Copy)]
pub struct Messages<'a> {
    /// Role codes (see [`Role`]).
    pub roles: &'a [u8],
    /// Token count of each message as it is.
    pub tokens: &'a [u64],
    /// Length of each message in characters (Unicode scalar values).
    pub chars: &'a [u64],
    /// Tool group of each message, `-1` for none.
    pub groups: &'a [i64],
    /// Optional token count of each message once truncated to `max_chars`; entries of
    /// messages within the limit are ignored.
    pub truncated_tokens: Option<&'a [u64]>,
}

/// What to keep.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Trimmed {
    /// Indices of kept messages, ascending (a contiguous suffix).
    pub kept: Vec<usize>,
    /// Indices of kept messages that must be truncated, ascending.
    pub truncated: Vec<usize>,
    /// For each entry of `truncated`, the number of characters to cut it to.
    pub truncated_chars: Vec<u64>,
    /// Token cost of what is kept, after truncation.
    pub total_tokens: u64,
}

impl<'a> Messages<'a> {
    fn validate(&self) -> CoreResult<()> {
        let n = self.roles.len();
        let check = |column: &'static str, actual: usize| {
            if actual == n {
                Ok(())
            } else {
                Err(CoreError::LengthMismatch {
                    column,
                    expected: n,
                    actual,
                })
            }
        };
        check("tokens", self.tokens.len())?;
        check("chars", self.chars.len())?;
        check("groups", self.groups.len())?;
        if let Some(t) = self.truncated_tokens {
            check("truncated_tokens", t.len())?;
        }
        Ok(())
    }

    /// Cost of message `i` after rule 1.
    fn cost(&self, i: usize, max_chars: u64) -> u64 {
        if self.chars[i] > max_chars {
            let truncated = match self.truncated_tokens {
                Some(t) => t[i],
                None => max_chars.div_ceil(4),
            };
            truncated.min(self.tokens[i])
        } else {
            self.tokens[i]
        }
    }
}

/// Choose the suffix of `messages` that fits `budget` tokens (see the module docs).
pub fn trim_to_budget(messages: &Messages<'_>, budget: u64, max_chars: u64) -> CoreResult<Trimmed> {
    messages.validate()?;
    let n = messages.roles.len();
    let mut open: HashSet<i64> = HashSet::new();
    let mut total = 0u64;
    let mut start = n; // first kept index; n = nothing kept
    let mut kept_total = 0u64;
    for i in (0..n).rev() {
        // A sum past u64::MAX is past any budget. (Saturating instead would let costs
        // near u64::MAX add up to "u64::MAX" and fit a budget of u64::MAX.)
        match total.checked_add(messages.cost(i, max_chars)) {
            Some(t) if t <= budget => total = t,
            _ => break, // costs are non-negative: no older cut can fit either
        }
        let role = Role::try_from(messages.roles[i])?;
        let group = messages.groups[i];
        if group >= 0 {
            // Results open their group; any other member is the head that closes it.
            if role == Role::ToolResult {
                open.insert(group);
            } else {
                open.remove(&group);
            }
        }
        if open.is_empty() && role != Role::ToolResult {
            start = i;
            kept_total = total;
        }
    }
    if start == n {
        return newest_cut_to_fit(messages, budget, max_chars);
    }
    let mut out = Trimmed {
        kept: (start..n).collect(),
        total_tokens: kept_total,
        ..Trimmed::default()
    };
    for i in start..n {
        if messages.chars[i] > max_chars {
            out.truncated.push(i);
            out.truncated_chars.push(max_chars);
        }
    }
    Ok(out)
}

/// Rule 5: nothing fits, so keep the newest message alone, cut to fit, if it may stand
/// alone (not a tool_result; a group's head with no results yet may). The cut keeps the
/// message's own tokens-per-character density, so dense text (CJK, code) is cut shorter
/// than prose would be.
fn newest_cut_to_fit(messages: &Messages<'_>, budget: u64, max_chars: u64) -> CoreResult<Trimmed> {
    let Some(i) = messages.roles.len().checked_sub(1) else {
        return Ok(Trimmed::default());
    };
    let stands_alone = Role::try_from(messages.roles[i])? != Role::ToolResult;
    let chars = messages.chars[i].min(max_chars);
    let cost = messages.cost(i, max_chars);
    if !stands_alone || budget == 0 || cost == 0 {
        return Ok(Trimmed::default());
    }
    // cost > budget here (else it would have been kept), so cut < chars; and
    // cut * cost / chars <= budget, so tokens <= budget. Both products fit a u128, and
    // both results fit a u64 (checked all the same: nothing here may panic or wrap).
    let cut =
        u64::try_from(u128::from(chars) * u128::from(budget) / u128::from(cost)).unwrap_or(chars);
    if cut == 0 {
        return Ok(Trimmed::default());
    }
    let tokens = u64::try_from((u128::from(cut) * u128::from(cost)).div_ceil(u128::from(chars)))
        .unwrap_or(budget);
    Ok(Trimmed {
        kept: vec![i],
        truncated: vec![i],
        truncated_chars: vec![cut],
        total_tokens: tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u8 = 1;
    const A: u8 = 2;
    const TU: u8 = 3;
    const TR: u8 = 4;

    fn run(roles: &[u8], tokens: &[u64], groups: &[i64], budget: u64) -> Trimmed {
        let chars: Vec<u64> = tokens.iter().map(|t| t * 4).collect();
        let m = Messages {
            roles,
            tokens,
            chars: &chars,
            groups,
            truncated_tokens: None,
        };
        trim_to_budget(&m, budget, DEFAULT_MAX_CHARS).unwrap()
    }

    #[test]
    fn keeps_newest_suffix_under_budget() {
        let r = run(&[U, A, U, A], &[10, 10, 10, 10], &[-1; 4], 25);
        assert_eq!(r.kept, vec![2, 3]);
        assert_eq!(r.total_tokens, 20);
        let all = run(&[U, A, U, A], &[10, 10, 10, 10], &[-1; 4], 40);
        assert_eq!(all.kept, vec![0, 1, 2, 3]);
    }

    #[test]
    fn tool_group_is_kept_whole_or_dropped_whole() {
        // user, tool_use(g0), result(g0), result(g0), assistant
        let roles = [U, TU, TR, TR, A];
        let groups = [-1, 0, 0, 0, -1];
        let tokens = [5, 10, 10, 10, 5];
        // 25 fits the two results and the answer, but that would orphan them.
        assert_eq!(run(&roles, &tokens, &groups, 25).kept, vec![4]);
        assert_eq!(run(&roles, &tokens, &groups, 35).kept, vec![1, 2, 3, 4]);
        assert_eq!(run(&roles, &tokens, &groups, 40).kept, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn an_assistant_turn_carrying_tool_calls_heads_its_group() {
        // user, assistant with tool_calls (g3), result(g3): OpenAI's shape of a call.
        let roles = [U, A, TR];
        let groups = [-1, 3, 3];
        assert_eq!(run(&roles, &[1, 1, 1], &groups, 10).kept, vec![0, 1, 2]);
        assert_eq!(run(&roles, &[1, 1, 1], &groups, 2).kept, vec![1, 2]);
        assert_eq!(
            run(&roles, &[1, 1, 1], &groups, 1).kept,
            Vec::<usize>::new()
        );
    }

    #[test]
    fn interleaved_messages_inside_a_group_stay_with_it() {
        let roles = [U, TU, U, TR];
        let groups = [-1, 7, -1, 7];
        assert_eq!(
            run(&roles, &[1, 1, 1, 1], &groups, 2).kept,
            Vec::<usize>::new()
        );
        assert_eq!(run(&roles, &[1, 1, 1, 1], &groups, 3).kept, vec![1, 2, 3]);
    }

    #[test]
    fn never_starts_with_an_ungrouped_tool_result() {
        let r = run(&[U, TR, A], &[1, 1, 1], &[-1, -1, -1], 2);
        assert_eq!(r.kept, vec![2]);
    }

    #[test]
    fn long_messages_are_truncated_and_recosted() {
        let m = Messages {
            roles: &[U, A],
            tokens: &[5000, 10],
            chars: &[20000, 40],
            groups: &[-1, -1],
            truncated_tokens: None,
        };
        let r = trim_to_budget(&m, 2000, 4000).unwrap();
        assert_eq!(r.kept, vec![0, 1]);
        assert_eq!(r.truncated, vec![0]);
        assert_eq!(r.truncated_chars, vec![4000]);
        assert_eq!(r.total_tokens, 1010);
        let given = Messages {
            truncated_tokens: Some(&[1500, 0]),
            ..m
        };
        assert_eq!(
            trim_to_budget(&given, 2000, 4000).unwrap().total_tokens,
            1510
        );
    }

    #[test]
    fn oversized_newest_message_is_cut_to_fit() {
        let m = Messages {
            roles: &[U, U],
            tokens: &[1, 1000],
            chars: &[4, 3000],
            groups: &[-1, -1],
            truncated_tokens: None,
        };
        let r = trim_to_budget(&m, 100, 4000).unwrap();
        assert_eq!(r.kept, vec![1]);
        assert_eq!(r.truncated, vec![1]);
        assert_eq!(r.truncated_chars, vec![300]);
        assert_eq!(r.total_tokens, 100);
        assert!(trim_to_budget(&m, 0, 4000).unwrap().kept.is_empty());
        // A tool_result cannot stand alone, so nothing is kept.
        let tr = Messages {
            roles: &[TU, TR],
            groups: &[0, 0],
            ..m
        };
        assert!(trim_to_budget(&tr, 100, 4000).unwrap().kept.is_empty());
    }

    #[test]
    fn walk_stops_early() {
        // Role 0 is invalid, but the walk never reaches it: work stops at the budget.
        let r = run(&[0, U, A], &[100, 1, 1], &[-1; 3], 2);
        assert_eq!(r.kept, vec![1, 2]);
        let m = Messages {
            roles: &[0, U],
            tokens: &[1, 1],
            chars: &[1, 1],
            groups: &[-1, -1],
            truncated_tokens: None,
        };
        assert!(trim_to_budget(&m, 10, 4000).is_err());
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let m = Messages {
            roles: &[U, A],
            tokens: &[1],
            chars: &[1, 1],
            groups: &[-1, -1],
            truncated_tokens: None,
        };
        assert!(matches!(
            trim_to_budget(&m, 10, 4000),
            Err(CoreError::LengthMismatch {
                column: "tokens",
                ..
            })
        ));
    }

    /// Exact cost of what `r` keeps, in u128 so nothing saturates: the sum of the kept
    /// costs, or for a message cut to fit (rule 5) its cost scaled to the cut, rounded up.
    fn kept_cost(m: &Messages<'_>, r: &Trimmed, max_chars: u64) -> u128 {
        r.kept
            .iter()
            .map(|&i| {
                let cost = u128::from(m.cost(i, max_chars));
                let chars = m.chars[i].min(max_chars);
                match r.truncated.iter().position(|&t| t == i) {
                    Some(k) if r.truncated_chars[k] < chars => {
                        (u128::from(r.truncated_chars[k]) * cost).div_ceil(u128::from(chars))
                    }
                    _ => cost,
                }
            })
            .sum()
    }

    #[test]
    fn costs_near_u64_max_never_add_up_past_the_budget() {
        // Saturating sums made u64::MAX + 1 "fit" a budget of u64::MAX.
        let m = Messages {
            roles: &[U, U],
            tokens: &[u64::MAX, 1],
            chars: &[1, 1],
            groups: &[-1, -1],
            truncated_tokens: None,
        };
        let r = trim_to_budget(&m, u64::MAX, u64::MAX).unwrap();
        assert_eq!(r.kept, vec![1]);
        assert_eq!(r.total_tokens, 1);
    }

    #[test]
    fn extreme_values_keep_every_rule() {
        const VALUES: [u64; 7] = [0, 1, 2, 3, u64::MAX / 2 + 1, u64::MAX - 1, u64::MAX];
        let mut cases = 0;
        for &t0 in &VALUES {
            for &t1 in &VALUES {
                for &c1 in &VALUES {
                    for &budget in &VALUES {
                        for max_chars in [0, 1, 4000, u64::MAX] {
                            let tokens = [t0, t1];
                            let chars = [1, c1];
                            let m = Messages {
                                roles: &[U, A],
                                tokens: &tokens,
                                chars: &chars,
                                groups: &[-1, -1],
                                truncated_tokens: Some(&[t0 / 2, t1 / 3]),
                            };
                            let r = trim_to_budget(&m, budget, max_chars).unwrap();
                            let ctx = format!("{tokens:?} {chars:?} {budget} {max_chars}: {r:?}");
                            assert!(r.total_tokens <= budget, "{ctx}");
                            assert_eq!(
                                u128::from(r.total_tokens),
                                kept_cost(&m, &r, max_chars),
                                "{ctx}"
                            );
                            assert!(r.kept.is_empty() || r.kept.last() == Some(&1), "{ctx}");
                            for (&i, &cut) in r.truncated.iter().zip(&r.truncated_chars) {
                                assert!(cut < chars[i] && cut <= max_chars, "{ctx}");
                            }
                            cases += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 7 * 7 * 7 * 7 * 4);
    }

    #[test]
    fn empty_conversation_keeps_nothing() {
        assert_eq!(run(&[], &[], &[], 100), Trimmed::default());
    }
}
