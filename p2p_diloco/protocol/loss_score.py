"""Contributions scored by loss (issue #41 item 2): what each delta of a closing round buys in loss per token
it claims, on a batch its sender cannot know in advance; a delta that makes the loss worse beyond the noise of
that batch is refused, and every checked delta moves its key's score, which caps the key's merge weight and
orders a union round's gather set. Pure bookkeeping: the loss itself is measured by `model.probe.LossProbe`
(any `LossMeter`), time is passed in.

**The batch.** `score_seed` digests (run, fragment, version, term, the sorted digests of every delta the round
closed with); the meter draws `[robust] score_batch` windows of the run's held-out data from it (and from a
secret salt of its own in real processes, `node.assembly`). A sender knows neither the other deltas of the
round nor the salt, so it cannot know the batch in advance or grind its delta until the batch suits it; given
them the batch is deterministic (tests, the simulator).

**The measurement** (`LossChange`): the global model alone (the fragment as the replica holds it) and the
model with the delta taken as an outer step on its fragment, ``theta - score_step x outer_lr x delta`` (about
its share of a merge: a delta pointing uphill shows at any step, while an honest delta's overshoot when taken
alone at the full outer lr, which grows with the step's square, mostly does not), each evaluated on the batch,
window by window; the paired per-window differences give the mean change and its standard error.
The base pass is done once per round, so a round of n scored deltas costs n + 1 forward passes of
`score_batch` windows (scripts/bench_loss_score.py measures it).

**The verdict** (`judge_round`), per delta:

1. refused `loss check` if the loss rises by more than `loss_tolerance` (relative), whatever the noise;
2. refused `loss worse` if the mean change exceeds `score_z` standard errors of its batch: worse beyond the
   noise;
3. otherwise accepted, with a *value* in [-1, 1]: the loss it bought per token it claims, scaled to a full
   H-step claim (``gain x full_tokens / tokens``), over the larger of the lower median of the scaled gains of
   the round's deltas not refused and `score_z` times its own scaled standard error. An honest delta of a
   round of honest ones scores about 1 while the round's gains stand out of the noise, a delta that buys less
   per claimed token (claims work it did not do) scores less, and once gains sink into the noise values
   become z-scores over `score_z`, near 0 for honest deltas and negative for harmful ones. A refused delta's
   value is -1.

**The score** (`LossScores`): per key, the exponentially weighted mean of its values (`score_decay` the weight
of the past, 0 for a key never scored), kept by each peer that held the lease from the loss checks it ran
itself: no other peer's word moves it. A key whose score is negative (its checked deltas on balance made the
loss worse) is capped at ``score_factor(score) = max(SCORE_FLOOR, 1 + score)`` of its claim (`capped`:
weight = min(`Standing.earned`'s weight, that cap), in both merge paths) and ranks behind every key whose
score is not negative in a union round's gather order (`protocol.gather`). A score of 0 or more leaves
weights as `Standing.earned` makes them: scores only take weight away.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.robust_config import RobustTag
from p2p_diloco.protocol.standing import Earned, counted_of, lower_median

# The least a key's merge weight is capped at, as a share of its claim: a merge needs a positive total weight.
SCORE_FLOOR = 0.05


@dataclass(frozen=True)
class LossChange:
    """One delta measured on a round's batch: the batch's mean loss on the global model alone (`base`), the
    mean per-window change with the delta as an outer step (`mean`, negative when it helps) and that mean's
    standard error over the batch's windows (`stderr`, of the paired differences)."""

    base: float
    mean: float
    stderr: float
    windows: int

    @property
    def relative(self) -> float:
        """The change of the batch's mean loss relative to the base."""
        return self.mean / max(abs(self.base), 1e-12)

    @property
    def z(self) -> float:
        """The change in standard errors of the batch (0 for no change, infinite for a sure one)."""
        if self.stderr > 0:
            return self.mean / self.stderr
        return 0.0 if self.mean == 0 else math.copysign(math.inf, self.mean)


class LossMeter(Protocol):
    """What the synchronizer asks to measure a round's deltas (`model.probe.LossProbe`)."""

    def measure(self, deltas: Sequence[Mapping[str, Tensor]], seed: bytes) -> list[LossChange]: ...


@dataclass(frozen=True)
class LossVerdict:
    """A scored delta: accepted or refused (`decision`), and the value it adds to its key's score."""

    decision: Decision
    value: float


def delta_digest(payload: bytes) -> bytes:
    """The digest a delta brings to its round's seed: BLAKE2b of its codec payload."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def score_seed(run_id: str, fragment: int, version: int, term: int, digests: Iterable[bytes]) -> bytes:
    """The seed of the round (`fragment` closing at `version` in `term`) whose deltas have `digests`: the
    meter draws the round's batch from it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{run_id}/{fragment}/{version}/{term}".encode())
    for digest in sorted(digests):
        h.update(digest)
    return h.digest()


def judge_round(
    changes: Sequence[LossChange],
    tokens: Sequence[int],
    *,
    full_tokens: int,
    z: float,
    tolerance: float,
) -> list[LossVerdict]:
    """The verdict on each delta of one round, measured on the round's batch (`changes`) with the tokens
    it claims as the counter checks weighed them (`tokens`); `full_tokens`: an H-step claim (module
    docstring)."""
    scale = [full_tokens / max(1, t) for t in tokens]
    gains = [-c.mean * k for c, k in zip(changes, scale, strict=True)]
    refusals = [_refusal(c, z, tolerance) for c in changes]
    kept = [g for g, refusal in zip(gains, refusals) if refusal is None]
    reference = max(0.0, lower_median(kept)) if kept else 0.0
    verdicts = []
    for change, k, gain, refusal in zip(changes, scale, gains, refusals):
        if refusal is not None:
            verdicts.append(LossVerdict(refusal, -1.0))
            continue
        norm = max(reference, z * change.stderr * k)
        value = 0.0 if norm <= 0 else max(-1.0, min(1.0, gain / norm))
        detail = f"{_shown(change)}, value {value:+.2f}"
        verdicts.append(LossVerdict(Decision(Action.ACCEPT, RobustTag.PLAUSIBLE, detail), value))
    return verdicts


def _shown(change: LossChange) -> str:
    return f"loss {change.relative:+.2%} ({change.z:+.1f} standard errors of {change.windows} windows)"


def _refusal(change: LossChange, z: float, tolerance: float) -> Decision | None:
    """Rules 1 and 2 of the verdict (module docstring), or None."""
    if change.relative > tolerance:
        detail = f"{_shown(change)} with this delta alone, tolerance {tolerance:.1%}"
        return Decision(Action.REJECT, RobustTag.LOSS_CHECK, detail)
    if change.mean > z * change.stderr:
        detail = f"{_shown(change)} with this delta alone: worse beyond {z:g} standard errors"
        return Decision(Action.REJECT, RobustTag.LOSS_WORSE, detail)
    return None


def score_factor(score: float) -> float:
    """The share of its claim a key with `score` may weigh at most: 1 for a score of 0 or more, 1 + score
    below, never under `SCORE_FLOOR`."""
    return max(SCORE_FLOOR, min(1.0, 1.0 + score))


def capped(earned: Earned, claims: Sequence[tuple[str, float]], cap: Callable[[str], float]) -> Earned:
    """`earned` (`Standing.earned` of `claims`) with each weight at most `cap(sender)` x its claim (the loss
    score's cap, `LossScores.factor`), and the contributors the round then counts (sum of weight / claim);
    `earned` itself when no cap binds."""
    values = [float(w) for _, w in claims]
    weights = [min(w, cap(peer) * v) for (peer, _), w, v in zip(claims, earned.weights, values, strict=True)]
    if weights == list(earned.weights):
        return earned
    return Earned(tuple(weights), counted_of(weights, values))


class LossScores:
    """Each key's score (module docstring) as this peer's own loss checks set it; time is passed in, memory is
    bounded by the keys scored within `forget_after` seconds."""

    def __init__(self, *, decay: float, forget_after: float):
        self.decay = decay
        self.forget_after = forget_after
        self._scores: dict[str, tuple[float, float]] = {}  # key -> (score, when last scored)

    def note(self, peer: str, value: float, now: float) -> float:
        """Fold one checked delta's value into `peer`'s score; returns the new score."""
        old = self._scores.get(peer, (0.0, now))[0]
        new = self.decay * old + (1.0 - self.decay) * value
        self._scores[peer] = (new, now)
        self._forget(now)
        return new

    def score(self, peer: str) -> float:
        """`peer`'s score: 0 for a key this peer never scored."""
        return self._scores.get(peer, (0.0, 0.0))[0]

    def factor(self, peer: str) -> float:
        """The cap on `peer`'s merge weight, as a share of its claim (`score_factor`)."""
        return score_factor(self.score(peer))

    def __len__(self) -> int:
        return len(self._scores)

    def _forget(self, now: float) -> None:
        horizon = now - self.forget_after
        for peer in [p for p, (_, at) in self._scores.items() if at < horizon]:
            del self._scores[peer]


@dataclass(frozen=True)
class Scored:
    """One delta offered to `score_round`: its sender, the tokens the counter checks left it, its tensors and
    its digest (`delta_digest`)."""

    sender: str
    tokens: int
    tensors: Mapping[str, Tensor]
    digest: bytes


def score_round(
    meter: LossMeter,
    scores: LossScores,
    deltas: Sequence[Scored],
    *,
    seed: bytes,
    full_tokens: int,
    z: float,
    tolerance: float,
    now: float,
) -> list[LossVerdict]:
    """Measure `deltas` on the batch of `seed`, judge them (`judge_round`) and fold each value into its
    sender's score; the verdicts in order."""
    if not deltas:
        return []
    changes = meter.measure([d.tensors for d in deltas], seed)
    verdicts = judge_round(
        changes, [d.tokens for d in deltas], full_tokens=full_tokens, z=z, tolerance=tolerance
    )
    for d, verdict in zip(deltas, verdicts, strict=True):
        scores.note(d.sender, verdict.value, now)
    return verdicts
