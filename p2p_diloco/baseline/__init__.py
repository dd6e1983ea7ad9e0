"""The lock-step baseline: elastic data-parallel training on `hivemind.Optimizer`, and goodput accounting.

`worker` runs one baseline peer (`p2p-diloco baseline-worker`), `elastic` configures and observes
hivemind's optimizer, `ledger` keeps a worker's counters, `checkpoint` its restart file, and
`accounting.summarize_run` turns the event logs of any peers (baseline or DiLoCo) into goodput figures.
Only `accounting` is imported here: it is pure and cheap; the others pull in torch and hivemind.
"""

from p2p_diloco.baseline.accounting import COUNTER_FIELDS, counters_in_window, split_lifetimes, summarize_run

__all__ = ["COUNTER_FIELDS", "counters_in_window", "split_lifetimes", "summarize_run"]
