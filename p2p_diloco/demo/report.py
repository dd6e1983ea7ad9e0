"""Turns `RunRecord`s into the demo's report: numbers (`summarize_record`), `report.json`, PNGs, text.

Plots (one PNG each): ``eval_loss.png`` (eval loss of the global model vs seconds and vs tokens),
``versions.png`` (global-model advances over time with kill marks, each synchronizer kill's stall
shaded and the new holder's first accepted delta marked), ``timeline.png`` (per learner: busy,
restarting, down, stopped).

Per system the report has ``stalls`` (one row per synchronizer kill, `demo.stalls`) and
``stall_summary``; a long chaos run (``--chaos-every``) adds ``checks`` (`demo.endgame`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from p2p_diloco.config import RunManifest
from p2p_diloco.demo import accounting, stalls
from p2p_diloco.demo.orchestrator import RunRecord
from p2p_diloco.demo.workers import BASELINE, DECOUPLED, DILOCO

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Event = Mapping[str, Any]

SYSTEMS = (DECOUPLED, BASELINE, DILOCO)  # report.json sections, in the order they are shown


def summarize_record(record: RunRecord, manifest: RunManifest, period: float | None = None) -> dict[str, Any]:
    """The report section of one system: goodput, uptime, final loss, tokens, bytes, failovers, timeline.

    `period` is the nominal round period for uptime; by default H inner steps at the median step time
    of this run (the interval at which each fragment gets a round). Compare systems with one period.
    """
    books = accounting.summarize(
        record.events,
        start=record.start,
        end=record.end,
        learners=record.learners,
        paced_as_compute=record.system != DECOUPLED,  # the baselines' throttled worker sleeps
    )
    all_events = [e for events in record.events.values() for e in events]
    if period is None:
        period = accounting.nominal_period(record.events, manifest.diloco.inner_steps) or 1.0
    advances = [
        a - record.start for a in accounting.version_advances(all_events) if record.start <= a <= record.end
    ]
    names = {peer_id: name for name, peer_id in record.peer_ids.items()}
    changes = _failover_log(record, all_events, names)
    stall_rows = _sync_kill_stalls(record, all_events, advances, names, manifest.diloco.synchronizer_shards)
    return {
        "goodput": books["goodput"],
        "uptime": accounting.uptime(advances, start=0.0, end=record.end - record.start, period=period),
        "final_eval_loss": record.final_eval_loss,
        "tokens": books["tokens"],
        "bytes_per_learner": books["bytes_per_learner"],
        "bytes_mean": books["bytes_mean"],
        "failovers": len(changes),
        "failover_log": changes,
        "compute_fraction": books["compute_fraction"],
        "blocked_fraction": books["blocked_fraction"],
        "nominal_round_seconds": period,
        "wall_seconds": record.end - record.start,
        "learners": record.learners,
        "kills": record.kills,
        "eval_curve": [{"t": t, "tokens": n, "loss": loss} for t, n, loss in record.eval_curve],
        "advances": advances,
        "timeline": {
            name: [(t - record.start, what) for t, what in marks] for name, marks in record.marks.items()
        },
        "per_peer": books["per_peer"],
        "stalls": stall_rows,
        "stall_summary": stalls.stall_summary(stall_rows),
        **({"checks": record.checks} if record.checks is not None else {}),
    }


def _failover_log(record: RunRecord, all_events: list[Event], names: dict[str, str]) -> list[dict[str, Any]]:
    """The failovers within the run, in seconds since its start, peers by learner name."""
    return [
        {
            **c,
            "t": c["t"] - record.start,
            "from": names.get(c["from"], c["from"]),
            "to": names.get(c["to"], c["to"]),
        }
        for c in accounting.failovers(all_events)
        if record.start <= c["t"] <= record.end
    ]


def _sync_kill_stalls(
    record: RunRecord, all_events: list[Event], advances: list[float], names: dict[str, str], shard_count: int
) -> list[dict[str, Any]]:
    """One row per synchronizer kill (`stalls.sync_kill_stalls`), each kill with the shards it held."""
    wall = record.end - record.start
    accepts = [
        {**a, "t": a["t"] - record.start, "peer": names.get(a["peer"], a["peer"])}
        for a in stalls.first_accepts(record.events)
    ]
    published = [{**e, "t": e["t"] - record.start} for e in all_events if e.get("event") == "published"]
    kills = [
        {**k, "shards": stalls.held_shards(published, k["peer_id"], float(k["t"]), shard_count)}
        if "peer_id" in k and "t" in k
        else k
        for k in record.kills
    ]
    return stalls.sync_kill_stalls(kills, advances, accepts, end=wall)


def print_summary(report: dict[str, Any], out: Path) -> None:
    for system in SYSTEMS:
        r = report.get(system)
        if not r:
            continue
        loss = r["final_eval_loss"]
        sent = r["bytes_mean"]["sent"] / 1e6
        received = r["bytes_mean"]["received"] / 1e6
        print(
            f"{system:9s}: goodput {r['goodput']:.3f}  uptime {r['uptime']:.3f}  final eval loss "
            f"{'n/a' if loss is None else f'{loss:.3f}'}  tokens {r['tokens']:.0f}  "
            f"failovers {r['failovers']}  MB/learner sent {sent:.1f} received {received:.1f}  "
            f"kills {len([k for k in r['kills'] if 'skipped' not in k])}"
        )
        for line in stall_lines(r) + check_lines(r.get("checks")):
            print(f"{'':11}{line}")
    print(f"report: {out / 'report.json'}; plots: {', '.join(sorted(p.name for p in out.glob('*.png')))}")


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def stall_lines(r: dict[str, Any]) -> list[str]:
    """The stall per synchronizer kill: one line per kill and worst/median (empty without sync kills)."""
    rows, summary = r.get("stalls") or [], r.get("stall_summary") or {}
    if not rows:
        return []
    lines = [
        f"sync kill at {row['t']:.1f} s ({row['learner']}): stall {row['stall']:.1f} s"
        + ("" if row["resolved"] else " (no update after it)")
        + f", first delta accepted by the new holder after {_seconds(row['to_first_accept'])}"
        + (f" ({row['new_holder']}, term {row['term']})" if row.get("new_holder") else "")
        for row in rows
    ]
    lines.append(
        f"stall per sync kill: worst {_seconds(summary['worst_stall'])}, "
        f"median {_seconds(summary['median_stall'])};"
        f" to first accepted delta: worst {_seconds(summary['worst_to_first_accept'])},"
        f" median {_seconds(summary['median_to_first_accept'])}"
    )
    return lines


def check_lines(checks: dict[str, Any] | None) -> list[str]:
    """The long chaos mode's verdicts in words (empty when the run had none)."""
    if not checks:
        return []
    faults = checks["faults"]
    lines = [
        "faults: "
        + (", ".join(f"{k} {n}" for k, n in faults["executed"].items()) or "none")
        + (f"; skipped {faults['skipped']}" if faults["skipped"] else "")
    ]
    for exit in checks.get("exits", []):
        lines.append(
            f"{exit['learner']} exited on its own at {exit['t']:.1f} s (code {exit['code']}): "
            f"{exit['last_line']}"
        )
    for restart in checks.get("bootstrap_restarts", []):
        lines.append(
            f"bootstrap restarted at {restart['t']:.1f} s: "
            + ("up again" if restart.get("up") is not None else "NOT up")
            + (", same address" if restart.get("same_address") else ", address CHANGED")
        )
    for row in checks.get("newcomers", []):
        lines.append(newcomer_line(row))
    if "replicas" in checks:
        rep = checks["replicas"]
        group = rep.get("largest_group") or {}
        lines.append(
            f"replicas: {rep['peers']} live peers (status), {'agree' if rep['agree'] else 'DISAGREE'}; "
            f"{group.get('peers', 0)} at versions {group.get('versions')} "
            f"(digest {', '.join(group.get('digests', [])) or 'n/a'}); "
            f"{rep['fragment_versions_compared']} fragment versions compared"
            + (f"; status error: {checks['status_error']}" if checks.get("status_error") else "")
            + ("" if checks.get("settled", True) else "; versions had not settled")
        )
    went_back = checks["versions_went_back"]
    lines.append(
        "versions never went back"
        if not went_back
        else f"versions WENT BACK {len(went_back)} times: {went_back[:3]}"
    )
    if "resume" in checks:
        resume = checks["resume"]
        lines.append(
            f"stopped all and restarted: {'resumed' if resume['resumed'] else 'DID NOT resume'} at "
            f"{resume['swarm_after']} (stopped at {resume['swarm_before']})"
            + (f"; not checked: {', '.join(resume['not_checked'])}" if resume.get("not_checked") else "")
        )
    lines.append(f"no global state lost: {'yes' if checks['no_state_lost'] else 'NO'}")
    return lines


def newcomer_line(row: dict[str, Any]) -> str:
    """One newcomer through a restarted bootstrap node (`demo.checks.newcomer_check`), in words."""
    reached = row.get("reached_after")
    return (
        f"{row['name']} through the restarted bootstrap (launched at {row['launched']:.1f} s): "
        + (
            f"at the swarm's versions {row['swarm_at_start']} {reached:.1f} s after its start"
            if reached is not None
            else f"did NOT reach the swarm's versions {row.get('swarm_at_start')}"
        )
        + f" (bound {row.get('bound', 0):.1f} s), published from 0: {row['published_from_zero']}"
        + (" ok" if row["ok"] else f" NOT ok: {row.get('why')}")
    )


def plot_all(report: dict[str, Any], out: Path) -> None:
    """``eval_loss.png``, ``versions.png`` and ``timeline.png`` in `out` (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEMS if report.get(s)]
    for plot, name in (
        (plot_eval_loss, "eval_loss"),
        (plot_versions, "versions"),
        (plot_timeline, "timeline"),
    ):
        fig = plot(plt, report, systems)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)


def plot_eval_loss(plt: ModuleType, report: dict[str, Any], systems: list[str]) -> Figure:
    """The global model's eval loss vs seconds (kills dotted) and vs tokens, one line per system."""
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for system in systems:
        curve = report[system]["eval_curve"]
        if curve:
            by_time.plot([c["t"] for c in curve], [c["loss"] for c in curve], marker="o", label=system)
            by_tokens.plot([c["tokens"] for c in curve], [c["loss"] for c in curve], marker="o", label=system)
    for system in systems:
        for kill in report[system]["kills"]:
            if "skipped" not in kill:
                by_time.axvline(kill["t"], color="red", alpha=0.3, linestyle=":")
    by_time.set_xlabel("seconds")
    by_tokens.set_xlabel("tokens trained (all learners)")
    for ax in (by_time, by_tokens):
        ax.set_ylabel("global model eval loss")
        ax.legend()
    return fig


def plot_versions(plt: ModuleType, report: dict[str, Any], systems: list[str]) -> Figure:
    """Global updates over time per system, with its kills, failovers and synchronizer stalls marked."""
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for system in systems:
        advances = report[system]["advances"]
        ax.step(advances, range(1, len(advances) + 1), where="post", label=f"{system} global advances")
        _mark_kills_and_stalls(ax, report[system], len(advances))
    ax.set_xlabel(
        "seconds (red: synchronizer killed, shaded: its stall, purple: first delta the new holder accepted, "
        "black: learner killed, green: new synchronizer)",
        fontsize=8,
    )
    ax.set_ylabel("global updates")
    ax.legend()
    return fig


def _mark_kills_and_stalls(ax: Axes, r: dict[str, Any], updates: int) -> None:
    """One system's kills (red: the synchronizer's), new synchronizers, stalls and first accepts."""
    for kill in r["kills"]:
        if "skipped" not in kill:
            color = "red" if stalls.is_sync_kill(kill) else "black"
            ax.axvline(kill["t"], color=color, alpha=0.5, linestyle=":")
            what = {"stop_learner": "stop", "kill_bootstrap": "kill"}.get(kill.get("action", ""), "kill")
            ax.text(kill["t"], 0, f" {what} {kill['learner']}", fontsize=7, rotation=90, color=color)
    for change in r["failover_log"]:
        ax.axvline(change["t"], color="green", alpha=0.4)
    for row in r.get("stalls", []):
        lo = row["last_before"] if row["last_before"] is not None else 0.0
        hi = row["first_after"] if row["first_after"] is not None else r["wall_seconds"]
        ax.axvspan(lo, hi, color="red", alpha=0.12)
        ax.text(lo, updates * 0.9, f" {row['stall']:.1f} s", fontsize=7, color="red")
        if row.get("first_accept") is not None:
            ax.axvline(row["first_accept"], color="purple", alpha=0.6, linestyle="--")


def plot_timeline(plt: ModuleType, report: dict[str, Any], systems: list[str]) -> Figure:
    """Per system, per learner: busy, starting or catching up, down, stopped over the run."""
    fig, axes = plt.subplots(
        len(systems), 1, figsize=(11, 1 + 0.5 * report[systems[0]]["learners"] * len(systems))
    )
    axes = axes if len(systems) > 1 else [axes]
    for ax, system in zip(axes, systems, strict=True):
        r = report[system]
        wall = r["wall_seconds"]
        for row, (_name, marks) in enumerate(sorted(r["timeline"].items())):
            for lo, hi, color in _segments(marks, wall):
                ax.broken_barh([(lo, hi - lo)], (row - 0.4, 0.8), color=color)
        ax.set_yticks(range(len(r["timeline"])), sorted(r["timeline"]))
        ax.set_xlim(0, wall)
        ax.set_title(
            f"{system}: green busy, orange starting/catching up, red down, purple stopped", fontsize=9
        )
    axes[-1].set_xlabel("seconds")
    return fig


def _segments(marks: list[tuple[float, str]], wall: float) -> list[tuple[float, float, str]]:
    color_after = {
        "launch": "orange",
        "up": "green",
        "kill": "red",
        "exit": "red",
        "pause": "purple",
        "stop": None,
    }
    segments, state, since = [], None, 0.0
    for t, what in sorted(marks):
        t = min(max(t, 0.0), wall)
        if state is not None and t > since:
            segments.append((since, t, state))
        state, since = color_after.get(what), t
    if state is not None and wall > since:
        segments.append((since, wall, state))
    return segments
