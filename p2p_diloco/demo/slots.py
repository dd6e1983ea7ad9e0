"""One learner slot of a demo run and what the orchestrator reads of it.

A `Slot` is a stable identity and state directory that successive worker processes take on (after a
kill, the restart keeps both), with the marks of its life (launch, up, kill, stop) and its last
progress event; its `EventTail` reads the new complete lines of the state dir's ``events.jsonl`` as
the worker appends them.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class EventTail:
    """Reads new complete lines of a state dir's ``events.jsonl`` as they are appended."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        new = []
        for line in chunk[: end + 1].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.events.extend(new)
        return new


@dataclass
class Slot:
    """One learner slot: a stable identity and state dir; successive processes."""

    index: int
    name: str
    identity: Path
    peer_id: str
    state_dir: Path
    log_path: Path
    tail: EventTail
    proc: subprocess.Popen | None = None
    launched_at: float = 0.0
    last_progress: dict[str, Any] = field(default_factory=dict)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (time, "launch"|"up"|"kill"|"stop")
    restart_at: float | None = None
    kills: int = 0
    spare: subprocess.Popen | None = None  # a hot spare (`join --standby`) that the next launch promotes

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
