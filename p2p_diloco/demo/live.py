"""The demo's live view: a rich table when stdout is a terminal, a plain line every few seconds otherwise.

Per learner: state (up, starting, down), role, step, loss, tokens/s and fragment versions; with the
failures so far.
"""

from __future__ import annotations

import sys
import time
from typing import Any

PLAIN_EVERY = 10.0


def _rows(run: Any) -> list[tuple[str, ...]]:
    rows = []
    for slot in run.slots:
        p = slot.last_progress
        last = slot.marks[-1][1] if slot.marks else ""
        state = "down" if not slot.alive else {"up": "up", "pause": "stopped"}.get(last, "starting")
        loss = p.get("loss")
        rows.append(
            (
                slot.name,
                state,
                str(p.get("role", "-")),
                str(p.get("step", p.get("steps", "-"))),
                f"{loss:.3f}" if isinstance(loss, float) else "-",
                f"{p.get('tokens_per_s', 0) or 0:.0f}",
                ",".join(str(v) for v in p.get("versions", [])) or str(p.get("global_epoch", "-")),
                str(slot.kills),
            )
        )
    return rows


class LiveView:
    """Call `update(run)` every tick; `close()` at the end."""

    def __init__(self, title: str):
        self.title = title
        self.tty = sys.stdout.isatty()
        self._live = None
        self._last_plain = 0.0

    def update(self, run: Any) -> None:
        elapsed = time.time() - run.start_time if run.start_time else 0.0
        if self.tty:
            from rich.live import Live
            from rich.table import Table

            table = Table(
                title=f"{self.title}: {elapsed:.0f}/{run.schedule.duration:.0f} s, failures {len(run.kills)}"
            )
            for column in ("peer", "state", "role", "step", "loss", "tok/s", "versions", "kills"):
                table.add_column(column)
            for row in _rows(run):
                table.add_row(*row)
            if self._live is None:
                self._live = Live(table, refresh_per_second=2)
                self._live.start()
            else:
                self._live.update(table)
            return
        if time.monotonic() - self._last_plain >= PLAIN_EVERY:
            self._last_plain = time.monotonic()
            peers = "; ".join(f"{r[0]} {r[1]} {r[2]} step {r[3]} loss {r[4]} v {r[6]}" for r in _rows(run))
            print(f"[{self.title} {elapsed:5.0f} s, failures {len(run.kills)}] {peers}", flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
