"""BuildContext: read a thread's window, fit it to the budget (trim, elide, summarize), and
render it for a provider."""
