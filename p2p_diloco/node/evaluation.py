"""Global evaluation in a real run: one peer at a time evaluates the global model and publishes the curve.

Who evaluates (`EvalMode`): ``auto`` (the default) evaluates while this peer holds the synchronizer
lease, unless a dedicated evaluator published recently; ``always`` (`join --evaluate`) evaluates
whatever its role and marks its records dedicated, so synchronizers leave the job to it; ``never``
(`join --no-evaluate`) only follows the history (for `--log-to`).

When: once it has read the published history (on its follow job, within `follow_seconds` of becoming
the evaluator), then every `every_updates` merged updates (the sum of the fragment versions) and at most once
per `min_seconds`. How: the owner thread decides (`GlobalEvaluator.ask`) and hands the training thread an
`EvalRequest` with the replica's own parameter tensors (`GlobalReplica.frozen` shares tensors that are
never changed in place); the training thread evaluates it between two inner steps (`EvalWorker`: so the
owner and the DHT I/O thread never wait for it, and a GPU peer evaluates on its device), bound into a
weightless model (`BorrowedWeights`: no copy), over `batches` batches of the run's held-out split
(`model.data.evaluate`, the same function the demo and the in-process swarm use), and posts the loss
back; the owner thread records the point (`GlobalEvaluator.finish`).

Threads: `GlobalEvaluator`'s state (history, counters, its own last point) belongs to the owner thread;
`EvalWorker` and its model to the training thread; the I/O thread only reads the DHT
(`read_histories`, stateless) and stores the record the owner thread encoded.

The history (`wire.observe.EvalHistory`, bounded to `MAX_EVAL_POINTS`) is published owner-signed under
`keys.eval_key` on the I/O thread, after merging every other permitted evaluator's record read from the
DHT (`wire.observe.admit_histories`: the run's synchronizers and `[trust] evaluators`; records of other
keys, and records with points dated in the future, are refused with a counter in `ignored`); a new
evaluator (a failover) therefore continues the curve, and no key outside the list can pause it. `tokens` of a
point is the number of merged tokens in the global model, estimated from this peer's contribution ledger:
exact between two of its own points, and for its first point the last published point plus the ledger's tokens
of the updates applied since that point's versions (updates a snapshot download skipped count nothing).
"""

from __future__ import annotations

import logging
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
from p2p_diloco.owner import Owner
from p2p_diloco.wire.interfaces import KeyValueStore
from p2p_diloco.wire.keys import eval_key
from p2p_diloco.wire.observe import (
    MAX_EVAL_SKEW,
    AdmittedHistories,
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


@dataclass(frozen=True)
class EvalRequest:
    """One evaluation the owner thread asks the training thread for: the replica's tensors at `versions`
    (shared, never changed in place) and what the point will say besides its loss."""

    t: float  # DHT time of the decision: the point's time
    versions: tuple[int, ...]
    params: Mapping[str, torch.Tensor]
    term: int
    tokens: int  # merged tokens in the global model at `versions` (module docstring)
    ledger_total: int  # this peer's ledger tokens when asked (the next point counts from here)


class EvalWorker:
    """The training thread's side: evaluates `EvalRequest`s on a weightless model built at the first one
    (peers that never evaluate never pay for it)."""

    def __init__(
        self,
        manifest: RunManifest,
        options: EvalOptions,
        make_model: Callable[[], torch.nn.Module],  # a model to bind the replica into, on the peer's device
        eval_data,  # noqa: ANN001 - Tensor or TokenData, the run's held-out split
    ):
        self.manifest, self.options, self.make_model, self.eval_data = (
            manifest,
            options,
            make_model,
            eval_data,
        )
        self.model: BorrowedWeights | None = None

    def evaluate(self, request: EvalRequest) -> float:
        if self.model is None:
            self.model = BorrowedWeights(self.make_model())
        with self.model.bound(request.params) as model:
            return evaluate(
                model,
                self.eval_data,
                block_size=self.manifest.model.block_size,
                batch_size=self.options.batch_size,
                max_batches=self.options.batches,
            )


def read_histories(kv: KeyValueStore, key: str, manifest: RunManifest, now: float) -> HistoryRead:
    """Every evaluator's published history under `key`, decoded and screened (on the I/O thread)."""
    decoded: dict[str, EvalHistory] = {}
    bad = 0
    for writer, stored in kv.get(key, now).items():
        try:
            decoded[writer] = decode_eval_history(stored.value, manifest.diloco.fragments)
        except RecordError:
            bad += 1
    admitted = admit_histories(decoded, may_evaluate=manifest.may_evaluate, now=now, max_skew=MAX_EVAL_SKEW)
    return HistoryRead(admitted, bad)


@dataclass(frozen=True)
class HistoryRead:
    """What one read of the eval history records found: the admitted ones, and how many did not decode."""

    admitted: AdmittedHistories
    undecodable: int = 0


class GlobalEvaluator:
    """This peer's share of global evaluation (module docstring); every method on the owner thread."""

    def __init__(
        self,
        manifest: RunManifest,
        options: EvalOptions,
        *,
        peer_id: str,
        ledger: ContributionLedger | None,
        sinks: SafeSinks | None = None,
        event: Callable[..., None] = lambda kind, **fields: None,
        owner: Owner | None = None,
    ):
        self.manifest, self.options, self.peer_id = manifest, options, peer_id
        self.ledger, self.sinks, self.event = ledger, sinks, event
        self.owner = owner or Owner("peer-owner")
        self.key = eval_key(manifest.run_id, manifest.manifest_hash)
        self.history: tuple[EvalPoint, ...] = ()
        self.contributions: tuple[tuple[str, int, int], ...] = ()
        self.ignored: Counter[str] = Counter()
        self.dedicated_seen = 0.0  # DHT time of the newest point of another permitted dedicated evaluator
        self.evaluations = 0
        self.refreshed = False  # read the published history at least once (a first point continues it)
        self.asked: EvalRequest | None = None  # handed to the training thread, not finished yet
        self._last: EvalPoint | None = None  # this peer's own last point
        self._ledger_at_last = 0
        self._logged_t = 0.0  # newest point handed to the sinks

    # ---- who and when ------------------------------------------------------------------------------

    def wants_to_evaluate(self, now: float, holds_lease: bool) -> bool:
        mode = self.options.mode
        if mode is EvalMode.NEVER:
            return False
        if mode is EvalMode.ALWAYS:
            return True
        return holds_lease and now - self.dedicated_seen > DEDICATED_STALE

    def due(self, now: float, updates: int) -> bool:
        last = self._last
        if last is None:
            latest = self.history[-1] if self.history else None
            return latest is None or updates >= latest.updates + self.options.every_updates
        return (
            updates >= last.updates + self.options.every_updates and now >= last.t + self.options.min_seconds
        )

    # ---- one evaluation: asked here, run on the training thread, finished here -----------------------

    def ask(
        self,
        now: float,
        *,
        versions: tuple[int, ...],
        holds_lease: bool,
        term: int,
        frozen: Callable[[], tuple[Mapping[str, torch.Tensor], tuple[int, ...]]],
    ) -> EvalRequest | None:
        """An `EvalRequest` if this peer is the evaluator, one is due and none is under way; `frozen` (the
        replica's tensors and their versions, not copies) is only called then."""
        if self.asked is not None or not self.wants_to_evaluate(now, holds_lease) or not self.refreshed:
            return None  # busy, not the evaluator, or the history it would continue is not read yet
        updates = sum(versions)
        if not self.due(now, updates) or (updates == 0 and self.history):
            return None
        self.owner.check("GlobalEvaluator")
        params, at = frozen()
        total = self._ledger_total()
        self.asked = EvalRequest(now, tuple(at), params, term, self._merged_tokens(tuple(at), total), total)
        return self.asked

    def finish(self, request: EvalRequest, loss: float | None) -> EvalPoint | None:
        """The training thread's loss for `request` (None: it failed); the new point, if it is one."""
        self.owner.check("GlobalEvaluator")
        self.asked = None
        if loss is None:
            return None
        if loss != loss or loss in (float("inf"), float("-inf")):
            self.event("eval_failed", error=f"eval loss {loss}")
            return None
        point = EvalPoint(
            t=request.t,
            tokens=request.tokens,
            versions=request.versions,
            loss=float(loss),
            evaluator=self.peer_id,
            term=request.term,
        )
        self._last, self._ledger_at_last = point, request.ledger_total
        self.history = merge_points(self.history, [point])
        self.evaluations += 1
        self.event("global_eval", **{k: v for k, v in point.as_dict().items() if k not in ("evaluator", "t")})
        return point

    def _ledger_total(self) -> int:
        if self.ledger is None:
            return 0
        return sum(c.tokens for c in self.ledger.totals.values())

    def _merged_tokens(self, versions: tuple[int, ...], total: int) -> int:
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

    # ---- the history in the DHT (read and stored on the I/O thread) ---------------------------------

    def absorb(self, read: HistoryRead) -> None:
        """Merge every evaluator's published history into ours; log points the sinks have not seen."""
        self.owner.check("GlobalEvaluator")
        if read.undecodable:
            self.ignored["bad eval history"] += read.undecodable
        for writer, reason, detail in read.admitted.refused:
            if self.ignored[reason] == 0:  # the first of each reason; then only the counter
                log.info("eval history of %s refused: %s (%s)", writer, reason, detail)
            self.ignored[reason] += 1
        records = read.admitted.records
        for writer, history in records.items():
            if history.dedicated and writer != self.peer_id and history.points:
                self.dedicated_seen = max(self.dedicated_seen, history.points[-1].t)
        found = list(records.values())
        self.history = merge_points(self.history, merge_records(records))
        if found and not self.contributions:
            self.contributions = max(
                (h.contributions for h in found), key=lambda rows: sum(r[1] for r in rows)
            )
        self.refreshed = True
        self._log_new()

    def record(self) -> bytes:
        """This peer's history and leaderboard, encoded (stored under `key` with `HISTORY_TTL`)."""
        self.owner.check("GlobalEvaluator")
        history = EvalHistory(
            points=self.history,
            dedicated=self.options.mode is EvalMode.ALWAYS,
            contributions=self._leaderboard(),
        )
        return history.to_bytes()

    def _leaderboard(self) -> tuple[tuple[str, int, int], ...]:
        if self.ledger is None:
            return self.contributions
        rows = sorted(
            ((peer, c.tokens, c.updates) for peer, c in self.ledger.totals.items()),
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
