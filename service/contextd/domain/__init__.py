"""The domain: plain types and rules, with no I/O (no gRPC, no SQL, no network).

`model` holds agents, messages and contexts; `context` what a build reasons about (history
items, budgets, stats, status entries); `scopes`, `window`, `validation`, `idempotency`,
`batches`, `errors` and `clock` one rule each.
"""
