"""The bounded log of applied updates that other peers replay from (`UpdateLog`).

The log keeps decoded `UpdateRecord`s (header fields plus the update's codec payload, about one byte per
parameter of its fragment for int8), never re-encoded frames. It is bounded twice:

* bytes: the budget (`[limits] update_log_bytes`, by default 2 x the model's int8 size) is split over
  the fragments in proportion to their parameter counts, so a fragment keeps about two of its updates by
  default whatever the model size;
* count: at most `[limits] update_log_length` updates per fragment.

The oldest updates of a fragment drop out first; its latest update is always kept (a peer that loaded a
snapshot asks for it to learn the snapshot's term). A peer asking for updates that dropped out gets what
is left; its replay then leaves a gap, and it downloads a snapshot instead (`swarm.repair`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from p2p_diloco.protocol.messages import UpdateRecord

RECORD_OVERHEAD_BYTES = 512  # header fields, object overhead (an estimate; the payload dominates)
CONTRIBUTOR_BYTES = 96  # one (peer ID, weight) pair


def record_bytes(record: UpdateRecord) -> int:
    """What a record costs the log: its payload plus an estimate of its header."""
    return len(record.payload) + RECORD_OVERHEAD_BYTES + CONTRIBUTOR_BYTES * len(record.contributors)


class UpdateLog:
    """Per fragment, the latest applied updates within a byte budget and a count (module docstring)."""

    def __init__(self, fragment_sizes: Sequence[int], *, budget_bytes: int, max_length: int):
        if budget_bytes < 0 or max_length < 1:
            raise ValueError(
                f"budget_bytes must be >= 0 and max_length >= 1, got {budget_bytes}, {max_length}"
            )
        total = max(1, sum(fragment_sizes))
        self.budget_bytes = budget_bytes
        self.max_length = max_length
        self.fragment_budgets = [budget_bytes * n // total for n in fragment_sizes]
        self._records: list[deque[UpdateRecord]] = [deque() for _ in fragment_sizes]
        self._bytes = [0] * len(fragment_sizes)
        self.dropped = 0  # records dropped to stay within the bounds

    @property
    def num_fragments(self) -> int:
        return len(self._records)

    def append(self, record: UpdateRecord) -> None:
        p = record.fragment
        self._records[p].append(record)
        self._bytes[p] += record_bytes(record)
        self._trim(p)

    def _trim(self, p: int) -> None:
        records = self._records[p]
        while len(records) > 1 and (
            len(records) > self.max_length or self._bytes[p] > self.fragment_budgets[p]
        ):
            self._bytes[p] -= record_bytes(records.popleft())
            self.dropped += 1

    def after(self, fragment: int, after_version: int) -> list[UpdateRecord]:
        """The kept updates of `fragment` whose from_version is at least `after_version`, oldest first."""
        return [r for r in self._records[fragment] if r.from_version >= after_version]

    def records(self, fragment: int) -> list[UpdateRecord]:
        return list(self._records[fragment])

    def oldest_version(self, fragment: int) -> int | None:
        """The from_version of the oldest kept update of `fragment` (None if none is kept)."""
        records = self._records[fragment]
        return records[0].from_version if records else None

    def clear(self, fragment: int) -> None:
        self._records[fragment].clear()
        self._bytes[fragment] = 0

    def bytes(self, fragment: int | None = None) -> int:
        """Bytes held (`record_bytes`), for one fragment or all."""
        return sum(self._bytes) if fragment is None else self._bytes[fragment]

    def __len__(self) -> int:
        return sum(len(r) for r in self._records)
