"""Global evaluation in a real run: one peer at a time evaluates the global model and publishes the curve.

Who evaluates (`EvalMode`): ``auto`` (the default) evaluates while this peer holds the synchronizer
lease, unless a dedicated evaluator published recently; ``always`` (`join --evaluate`) evaluates
whatever its role and marks its records dedicated, so synchronizers leave the job to it; ``never``
(`join --no-evaluate`) only follows the history (for `--log-to`).

When: once it has read the published history (on its follow job, within `follow_seconds` of becoming
the evaluator), then every `every_updates` merged updates (the sum of the fragment versions) and at most once per
`min_seconds`. How: on the training thread between two inner steps (so the peer's owner thread and
the DHT I/O thread never wait for it, and a GPU peer evaluates on its device), on the replica's own
parameter tensors, read on the owner thread (`GlobalReplica.frozen` shares tensors that are never changed
in place) and bound into a weightless model for the evaluation (`BorrowedWeights`: no copy), over
`batches` batches of the run's held-out split (`model.data.evaluate`, the same function the demo and the
in-process swarm use).

The history (`wire.observe.EvalHistory`, bounded to `MAX_EVAL_POINTS`) is published owner-signed under
`keys.eval_key` on the I/O thread, after merging every other permitted evaluator's record read from the
DHT (`wire.observe.admit_histories`: the run's synchronizers and `[trust] evaluators`; records of other
keys, and records with points dated in the future, are refused with a counter in `ignored`); a new
evaluator (a failover) therefore continues the curve, and no key outside the list can pause it. `tokens` of a point is the number of merged
tokens in the global model, estimated from this peer's contribution ledger: exact between two of its
own points, and for its first point the last published point plus the ledger's tokens of the updates
applied since that point's versions (updates a snapshot download skipped count nothing).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import evaluate
from p2p_diloco.node.ledger import ContributionLedger, read_ledger
from p2p_diloco.node.logsinks import SafeSinks
from p2p_diloco.wire.interfaces import Clock, KeyValueStore
from p2p_diloco.wire.keys import eval_key
from p2p_diloco.wire.observe import (
    MAX_EVAL_SKEW,
    EvalHistory,
    EvalPoint,
    admit_histories,
    decode_eval_history,
    merge_points,
    merge_records,
)
from p2p_diloco.wire.records import RecordError

log = logging.getLogger(__name__)

HISTORY_TTL = 7 * 24 * 3600.0  # an eval history record lives this long after its last publication
DEDICATED_STALE = (
    120.0  # a dedicated evaluator silent this long no longer keeps synchronizers from evaluating
)


class EvalMode(StrEnum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class EvalOptions:
    """Who evaluates the global model, how often and on how much held-out data (`join --evaluate ...`)."""

    mode: EvalMode = EvalMode.AUTO
    every_updates: int = 20  # merged updates (all fragments) between two evaluations
    min_seconds: float = 5.0  # and at least this long between two
    batches: int = 4  # eval batches of `batch_size` windows each
    batch_size: int = 8
    follow_seconds: float = 5.0  # how often a peer that logs the history reads it from the DHT


class BorrowedWeights:
    """A model that holds no weights of its own between evaluations: `bound(params)` points its parameters
    at the replica's tensors for the duration of a `with` block (no copy on a CPU peer; one transient
    device copy elsewhere), and at empty `meta` tensors after it. A model kept loaded would hold a copy
    of the replica (4 B/param on the evaluating peer, issue #14) or, bound and left so, old versions of
    it. Tied parameters (one tensor under two names) are bound to the same tensor."""

    def __init__(self, model: torch.nn.Module):
        model.requires_grad_(False)
        canonical = {id(p): name for name, p in model.named_parameters()}
        # state_dict key -> (named_parameters name, device, dtype); buffers stay the model's own
        self.slots = {
            key: (canonical[id(p)], p.device, p.dtype)
            for key, p in model.named_parameters(remove_duplicate=False)
        }
        self.model = model
        self._release()

    def _assign(self, tensors: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(tensors, strict=False, assign=True)
        if unexpected or any(key in self.slots for key in missing):
            raise RuntimeError(f"eval model binding: missing {missing}, unexpected {unexpected}")

    def _release(self) -> None:
        self._assign(
            {
                key: torch.empty(p.shape, dtype=p.dtype, device="meta")
                for key, p in self.model.named_parameters(remove_duplicate=False)
            }
        )

    @contextmanager
    def bound(self, params: Mapping[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
        placed: dict[str, torch.Tensor] = {}
        for name, device, dtype in self.slots.values():
            if name not in placed:
                placed[name] = params[name].to(device=device, dtype=dtype)
        self._assign({key: placed[name] for key, (name, _, _) in self.slots.items()})
        del placed
        try:
            yield self.model
        finally:
            self._release()


class GlobalEvaluator:
    """This peer's share of global evaluation (module docstring). `maybe_evaluate` on the training
    thread; `refresh` and `publish` on the I/O thread."""

    def __init__(
        self,
        manifest: RunManifest,
        options: EvalOptions,
        *,
        peer_id: str,
        kv: KeyValueStore,
        clock: Clock,
        make_model: Callable[[], torch.nn.Module],  # a model to load the replica into, on the peer's device
        eval_data,  # noqa: ANN001 - Tensor or TokenData, the run's held-out split
        versions: Callable[[], tuple[int, ...]],
        snapshot: Callable[[], tuple[dict[str, torch.Tensor], tuple[int, ...]]],
        holds_lease: Callable[[], bool],
        term: Callable[[], int],
        ledger: ContributionLedger | None,
        sinks: SafeSinks | None = None,
        event: Callable[..., None] = lambda kind, **fields: None,
    ):
        self.manifest, self.options, self.peer_id = manifest, options, peer_id
        self.kv, self.clock = kv, clock
        self.make_model, self.eval_data = make_model, eval_data
        self.eval_model: BorrowedWeights | None = None  # built at the first evaluation: others never pay
        self.versions, self.snapshot = versions, snapshot  # cheap reads; the replica's tensors, not copies
        self.holds_lease, self.term = holds_lease, term
        self.ledger, self.sinks, self.event = ledger, sinks, event
        self.key = eval_key(manifest.run_id, manifest.manifest_hash)
        self.history: tuple[EvalPoint, ...] = ()
        self.contributions: tuple[tuple[str, int, int], ...] = ()
        self.ignored: Counter[str] = Counter()
        self.dedicated_seen = 0.0  # DHT time of the newest point of another permitted dedicated evaluator
        self.evaluations = 0
        self.refreshed = False  # read the published history at least once (a first point continues it)
        self._lock = threading.Lock()
        self._last: EvalPoint | None = None  # this peer's own last point
        self._ledger_at_last = 0
        self._logged_t = 0.0  # newest point handed to the sinks

    # ---- who and when ------------------------------------------------------------------------------

    def wants_to_evaluate(self, now: float) -> bool:
        mode = self.options.mode
        if mode is EvalMode.NEVER:
            return False
        if mode is EvalMode.ALWAYS:
            return True
        return self.holds_lease() and now - self.dedicated_seen > DEDICATED_STALE

    def due(self, now: float, updates: int) -> bool:
        last = self._last
        if last is None:
            latest = self.history[-1] if self.history else None
            return latest is None or updates >= latest.updates + self.options.every_updates
        return (
            updates >= last.updates + self.options.every_updates and now >= last.t + self.options.min_seconds
        )

    # ---- the evaluation (training thread) ---------------------------------------------------------

    def maybe_evaluate(self) -> EvalPoint | None:
        """Evaluate the global model if this peer is the evaluator and one is due; the new point."""
        now = self.clock.now()
        if not self.wants_to_evaluate(now) or not self.refreshed:
            return None  # not the evaluator, or the history it would continue is not read yet
        updates = sum(self.versions())
        if not self.due(now, updates) or (updates == 0 and self.history):
            return None
        params, versions = self.snapshot()
        if self.eval_model is None:
            self.eval_model = BorrowedWeights(self.make_model())
        with self.eval_model.bound(params) as model:
            loss = evaluate(
                model,
                self.eval_data,
                block_size=self.manifest.model.block_size,
                batch_size=self.options.batch_size,
                max_batches=self.options.batches,
            )
        if loss != loss or loss in (float("inf"), float("-inf")):
            self.event("eval_failed", error=f"eval loss {loss}")
            return None
        point = EvalPoint(
            t=now,
            tokens=self._merged_tokens(versions),
            versions=tuple(versions),
            loss=float(loss),
            evaluator=self.peer_id,
            term=self.term(),
        )
        with self._lock:
            self._last, self._ledger_at_last = point, self._ledger_total()
            self.history = merge_points(self.history, [point])
        self.evaluations += 1
        self.event("global_eval", **{k: v for k, v in point.as_dict().items() if k not in ("evaluator", "t")})
        return point

    def _ledger_total(self) -> int:
        if self.ledger is None:
            return 0
        return sum(c.tokens for c in list(self.ledger.totals.values()))

    def _merged_tokens(self, versions: tuple[int, ...]) -> int:
        total = self._ledger_total()
        if self._last is not None:
            return self._last.tokens + max(0, total - self._ledger_at_last)
        before = max(self.history, key=lambda p: (p.updates, p.t)) if self.history else None
        if before is None or self.ledger is None:
            return total if before is None else before.tokens
        since = sum(
            tokens
            for entry in read_ledger(Path(self.ledger.path).parent)
            if 0 <= entry.fragment < len(before.versions) and entry.version > before.versions[entry.fragment]
            for _, _, tokens in entry.contributors
        )
        return before.tokens + since

    # ---- the history in the DHT (I/O thread) -------------------------------------------------------

    def refresh(self) -> None:
        """Merge every evaluator's published history into ours; log points the sinks have not seen."""
        now = self.clock.now()
        decoded: dict[str, EvalHistory] = {}
        for writer, stored in self.kv.get(self.key, now).items():
            try:
                decoded[writer] = decode_eval_history(stored.value, self.manifest.diloco.fragments)
            except RecordError:
                self.ignored["bad eval history"] += 1
        admitted = admit_histories(
            decoded,
            may_evaluate=self.manifest.may_evaluate,
            now=now,
            max_skew=MAX_EVAL_SKEW,
        )
        for writer, reason, detail in admitted.refused:
            if self.ignored[reason] == 0:  # the first of each reason; then only the counter
                log.info("eval history of %s refused: %s (%s)", writer, reason, detail)
            self.ignored[reason] += 1
        records = admitted.records
        for writer, history in records.items():
            if history.dedicated and writer != self.peer_id and history.points:
                self.dedicated_seen = max(self.dedicated_seen, history.points[-1].t)
        found = list(records.values())
        with self._lock:
            self.history = merge_points(self.history, merge_records(records))
            if found and not self.contributions:
                self.contributions = max(
                    (h.contributions for h in found), key=lambda rows: sum(r[1] for r in rows)
                )
        self.refreshed = True
        self._log_new()

    def publish(self) -> None:
        """Merge, then store this peer's history and leaderboard (after an evaluation of its own)."""
        try:
            self.refresh()
        except Exception as exc:  # noqa: BLE001 - publish what we have
            log.info("eval history read failed: %r", exc)
        with self._lock:
            history = EvalHistory(
                points=self.history,
                dedicated=self.options.mode is EvalMode.ALWAYS,
                contributions=self._leaderboard(),
            )
        now = self.clock.now()
        self.kv.store(self.key, self.peer_id, history.to_bytes(), now + HISTORY_TTL)

    def _leaderboard(self) -> tuple[tuple[str, int, int], ...]:
        if self.ledger is None:
            return self.contributions
        rows = sorted(
            ((peer, c.tokens, c.updates) for peer, c in list(self.ledger.totals.items())),
            key=lambda r: (-r[1], r[0]),
        )
        self.contributions = tuple(rows)
        return self.contributions

    def _log_new(self) -> None:
        if not self.sinks:
            return
        for point in self.history:
            if point.t > self._logged_t:
                self.sinks.log(
                    {"global/eval_loss": point.loss, "global/perplexity": point.perplexity},
                    step=point.tokens,
                    wall_time=point.t,
                )
                self._logged_t = point.t
