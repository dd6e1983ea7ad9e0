"""Two `p2p-diloco baseline-worker` processes for the baseline integration tests: their identities and
state dirs, the command line they share, a clean stop, and the goodput accounting over their logs."""

from __future__ import annotations

import signal
from pathlib import Path

from p2p_diloco.demo.accounting import summarize
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events

WORKERS = ("w1", "w2")


def prepare_workers(tmp_path: Path, manifest_text: str) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """The manifest file, and per worker its state dir and a fresh identity key."""
    manifest_path = tmp_path / "tiny.toml"
    manifest_path.write_text(manifest_text)
    dirs = {name: tmp_path / name for name in WORKERS}
    keys = {name: tmp_path / f"{name}.key" for name in WORKERS}
    for key in keys.values():
        write_identity(key)
    return manifest_path, dirs, keys


def worker_args(manifest_path: Path, bootstrap, key: Path, state_dir: Path, *extra: str) -> list[str]:  # noqa: ANN001
    """`baseline-worker` arguments for a fast two-worker run on loopback (`extra`: e.g. the mode)."""
    return [
        "baseline-worker", str(manifest_path), *extra, "--initial-peers", *bootstrap.addresses,
        "--identity", str(key), "--state-dir", str(state_dir), "--learners", "2",
        "--min-step-time", "0.1", "--matchmaking-time", "1", "--averaging-timeout", "5",
        "--peer-expiration", "5", "--progress-every", "0.5", "--checkpoint-every", "1",
    ]  # fmt: skip


def stop_workers(procs: dict, timeout: float) -> None:
    """SIGTERM every worker; each must exit 0."""
    for proc in procs.values():
        proc.signal(signal.SIGTERM)
    for name, proc in procs.items():
        assert proc.wait(timeout=timeout) == 0, f"{name} exit status; stderr:\n{proc.stderr_tail()}"


def accounting(dirs: dict[str, Path]) -> tuple[dict[str, list[dict]], dict]:
    """Both workers' event logs and the goodput report over the whole run (first start to last stop)."""
    logs = {n: read_events(d) for n, d in dirs.items()}
    begin = min(e["t"] for log in logs.values() for e in log if e["event"] == "start")
    end = max(e["t"] for log in logs.values() for e in log if e["event"] == "stopped")
    return logs, summarize(logs, start=begin, end=end)


# ---- synchronous DiLoCo (`baseline-worker --mode diloco`) event logs ------------------------------------

HEAL_EVENTS = ("global_models_differ", "reloaded")


def model_moves(events: list[dict]) -> list[dict]:
    """The events that change (or refuse to change) a DiLoCo worker's global model, in order."""
    return [e for e in events if e.get("event") in (*HEAL_EVENTS, "global_step")]


def heal_epoch(logs: dict[str, list[dict]]) -> int:
    """The last epoch a heal reached in any log: a ``reloaded`` event's epoch, or a
    ``global_models_differ`` event's epoch + 1 (its canonical member steps there, and the member that
    logged it loads that epoch or a later one); -1 if no worker healed."""
    reached = [
        e["epoch"] + (e["event"] == "global_models_differ")
        for events in logs.values()
        for e in events
        if e.get("event") in HEAL_EVENTS
    ]
    return max(reached, default=-1)


def rounds_after_heal(
    logs: dict[str, list[dict]], after: float = float("-inf")
) -> dict[int, dict[str, dict]]:
    """Per epoch past `heal_epoch`: the averaged ``global_step`` event of every worker that logged one
    for it (later than `after`), by worker name. A round of every worker is in it only once all of them
    stepped it."""
    heal = heal_epoch(logs)
    by_epoch: dict[int, dict[str, dict]] = {}
    for name, events in logs.items():
        for e in events:
            if (
                e.get("event") == "global_step"
                and e["outcome"] == "averaged"
                and e["epoch"] > heal
                and e["t"] > after
            ):
                by_epoch.setdefault(e["epoch"], {})[name] = e
    return by_epoch


def agreed_rounds(logs: dict[str, list[dict]], after: float = float("-inf")) -> list[int]:
    """The epochs past the last heal that every worker averaged (`rounds_after_heal`), ascending."""
    return sorted(e for e, steps in rounds_after_heal(logs, after).items() if len(steps) == len(logs))


def round_disagreements(logs: dict[str, list[dict]], after: float = float("-inf")) -> list[str]:
    """What is wrong with the rounds every worker averaged past the last heal: a group not of all of
    them, global models that differ, outer gradients that are one, a step that did not average."""
    wrong = []
    by_epoch = rounds_after_heal(logs, after)
    for epoch in agreed_rounds(logs, after):
        steps = list(by_epoch[epoch].values())
        sizes = {s["group_size"] for s in steps}
        digests = {s["digest"] for s in steps}
        local = {s["local_digest"] for s in steps}
        if sizes != {len(logs)}:
            wrong.append(f"epoch {epoch}: group sizes {sorted(sizes)}")
        if len(digests) != 1:
            wrong.append(f"epoch {epoch}: the global models differ ({sorted(digests)})")
        if len(local) != len(steps):
            wrong.append(f"epoch {epoch}: two workers computed one outer gradient")
        if digests & local:
            wrong.append(f"epoch {epoch}: the outer step did not average")
    return wrong
