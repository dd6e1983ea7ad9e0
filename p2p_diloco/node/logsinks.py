"""`join --log-to`: a peer's numbers in the tools people already use (TensorBoard, Weights & Biases).

A sink takes scalars under a name, at a step (inner steps for the peer's own numbers, merged tokens
for the global eval history) and a wall time. `parse_log_to` checks a ``--log-to`` value before the peer
starts; `open_sink` refuses a target whose package is missing with the ``pip install`` line that fixes
it, so nothing is downloaded behind the user's back. Sinks are called from the training thread and the
DHT I/O thread, so they serialize their calls; a sink that fails stops logging, never the peer.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from p2p_diloco.errors import ConfigError

log = logging.getLogger(__name__)


class LogTarget(StrEnum):
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


@dataclass(frozen=True)
class LogSpec:
    """One ``--log-to`` value: TensorBoard into a directory, or a W&B project (offline by default)."""

    target: LogTarget
    where: str  # the event directory (tensorboard) or the project name (wandb)


def parse_log_to(value: str) -> LogSpec:
    """``tensorboard:DIR`` or ``wandb[:PROJECT]``; `ConfigError` naming the accepted forms."""
    name, _, where = value.partition(":")
    try:
        target = LogTarget(name)
    except ValueError:
        raise ConfigError(
            f"--log-to {value!r}: expected tensorboard:DIR or wandb[:PROJECT] (targets: "
            f"{', '.join(t.value for t in LogTarget)})"
        ) from None
    if target is LogTarget.TENSORBOARD and not where:
        raise ConfigError("--log-to tensorboard:DIR needs the directory for the event files")
    return LogSpec(target, where or "p2p-diloco")


class MetricSink(Protocol):
    def log(self, values: dict[str, float], step: int, wall_time: float) -> None: ...

    def close(self) -> None: ...


def missing_package(target: LogTarget) -> str | None:
    """The install hint if `target`'s package is not importable here, else None."""
    module = "tensorboard" if target is LogTarget.TENSORBOARD else "wandb"
    if importlib.util.find_spec(module) is None:
        return f"--log-to {target.value} needs the {module} package: pip install 'p2p_diloco[{module}]'"
    return None


PEER_SCALARS = "peer/"  # the peer's own numbers, at its inner step, which starts at 0 in every process


def last_peer_step(path: Path) -> int | None:
    """The highest step of a ``peer/`` scalar in the event files under `path` (None: no such scalar)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last = None
    for events in sorted(path.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            if any(v.tag.startswith(PEER_SCALARS) for v in event.summary.value):
                last = event.step if last is None else max(last, event.step)
    return last


class TensorBoardSink:
    """Scalars into TensorBoard event files under `directory/<peer ID prefix>` (torch's SummaryWriter).

    A restarted peer counts its inner steps from 0 again: its ``peer/`` scalars continue after the last
    step its earlier processes wrote there, so the curves follow each other instead of overlapping (the
    ``global/`` ones are at merged tokens, which the run keeps)."""

    def __init__(self, directory: str, peer_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(directory) / peer_id[:16]
        last = last_peer_step(self.path) if self.path.is_dir() else None
        self.step_offset = 0 if last is None else last + 1
        self.writer = SummaryWriter(log_dir=str(self.path))

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        for name, value in values.items():
            at = step + self.step_offset if name.startswith(PEER_SCALARS) else step
            self.writer.add_scalar(name, value, global_step=at, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode_line(project: str, mode: str) -> str:
    """What a W&B sink tells the user about where its numbers go."""
    if mode == "offline":
        return (
            f"W&B: logging project {project} offline into ./wandb (WANDB_MODE=offline, the default here); "
            "`wandb sync ./wandb/offline-run-*` uploads it, WANDB_MODE=online logs live"
        )
    return f"W&B: logging project {project} with WANDB_MODE={mode}"


class WandbSink:
    """Scalars into a Weights & Biases run (offline unless WANDB_MODE says otherwise)."""

    def __init__(self, project: str, run_id: str, peer_id: str):
        import os

        import wandb

        mode = os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project=project, group=run_id, name=peer_id[:16], reinit=True)
        print(wandb_mode_line(project, mode), file=sys.stderr, flush=True)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log({**values, "wall_time": wall_time, "step": step})

    def close(self) -> None:
        self.run.finish()


class SafeSinks:
    """Every open sink behind one lock; a sink that raises is closed and dropped (logged once)."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        with self._lock:
            for sink in list(self.sinks):
                try:
                    sink.log(values, step, wall_time)
                except Exception as exc:  # noqa: BLE001 - logging never stops the peer
                    log.warning("log sink %s failed, dropped: %r", type(sink).__name__, exc)
                    self.sinks.remove(sink)

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception:  # noqa: BLE001
                    pass
            self.sinks.clear()


def open_sink(spec: LogSpec, run_id: str, peer_id: str) -> MetricSink:
    hint = missing_package(spec.target)
    if hint is not None:
        raise ConfigError(hint)
    if spec.target is LogTarget.TENSORBOARD:
        return TensorBoardSink(spec.where, peer_id)
    return WandbSink(spec.where, run_id, peer_id)


def open_sinks(specs: tuple[LogSpec, ...], run_id: str, peer_id: str) -> SafeSinks:
    return SafeSinks([open_sink(spec, run_id, peer_id) for spec in specs])
