"""Robust aggregation: screening validated deltas before a merge, and cooling down repeat offenders.

`merge.validate_delta` proves a delta well formed (names, shapes, finite, under the absolute norm bound).
`RobustGuard` decides whether it is *plausible*, one rule at a time, each a `Decision(action, tag, detail)`
with action ACCEPT, CLIP (usable after clipping) or REJECT and a `RobustTag` named below:

1. cool-down (`admit`): a sender with `offence_limit` offences within `offence_window` seconds is
   ignored for `cooldown` seconds (COOL_DOWN). Offences are all rejections except NON_OFFENCES, which
   honest peers hit when they lag or are misconfigured, or by chance (direction outliers).
2. counters (`check_counters`): claimed tokens per step must equal the manifest's batch x block within
   `token_tolerance` (TOKEN_CLAIM, reject: a learner cannot claim more weight than it trained); steps
   beyond `max_steps_factor` x H are clipped to that, tokens with them (STEP_CLAIM, clip).
3. replay (`check_replay`): a payload this sender already sent is refused (REPLAY).
4. norm, per tensor (`screen`): an RMS above `prior_factor` x inner_lr x steps is refused (AdamW moves a
   coordinate by about lr per step at most; measured honest RMS <= 0.94 lr/step); once `min_history`
   accepted norms of the tensor are known, a norm per claimed step above `reject_factor` x their median
   is refused and one above `clip_factor` x median is scaled down to it (NORM_OUTLIER, NORM_CLIPPED).
   Norms are compared per step (steps capped at `max_steps_factor` x H) because honest deltas differ in
   steps: a throttled learner sends 8-step deltas while a fast one, whose fragment was still in flight,
   sends 100-step ones; compared as raw norms the fast honest learners were refused and cooled down in
   the demo. An AdamW delta grows at most linearly with its steps, so per step a longer honest delta is
   never larger; a sender can widen its own bound only by claiming steps, which also must match its
   token claim and are capped. The history is kept across rounds, so the bound works with one
   contribution per round (K = 1).
5. direction, per fragment (DIRECTION_OUTLIER): in `screen`, the mean cosine of the sender's last
   `direction_window` deltas (this one included) with their fragments' references must reach
   `min_cosine` + min(0.1, `noise_z` / sqrt(numel x n)) for a mean of n cosines: a random delta's
   cosine has standard deviation 1/sqrt(numel), and one honest delta can point away from the others
   (each learner trains on its own shard), so a single low cosine is not enough (measured on the demo
   run: 2 % of honest deltas below 4 sigma of noise, no window of 5 below 0.055). The reference is an
   exponential average (decay `reference_decay`) of the directions of applied updates
   (`observe_update`), used once it holds `reference_min_updates` of them. A long memory matters: when
   the outer step overshoots (3 learners at the demo's outer lr) the last few updates point past the
   optimum and honest deltas point back; with decay 0.8 an honest learner was cooled down there, with
   0.95 none of 9 honest 1M-token runs had a single rejection. The reference is reset when two
   different senders in a row fail against it (an honest majority disagreeing means the reference, not
   they, is off). In `screen_round`, with `round_min` or more contributions, a delta whose cosine
   with more than half of the other deltas of its round is below the single-delta threshold is
   dropped. (A coordinate-wise median does worse here: random noise is the median of three in a third
   of the coordinates, so it has a cosine of about 0.3 with a median that includes it, and the median
   of the two others is their mean, which a sign flip among three cancels.) Until a fragment has a
   reference, the synchronizer holds its rounds open for up to `warmup_wait` seconds to gather
   `round_min` contributions, so the first updates are screened by the round.

The knobs (`RobustConfig`) and the tags (`RobustTag`) live in `protocol.robust_config`, re-exported here; the
direction references and the cosine in `protocol.direction`.
Pure: time comes in as `now`; no clock, no randomness.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from p2p_diloco.protocol import kernels
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.direction import DirectionReferences, cosine, cosine_matrix, fragment_norm
from p2p_diloco.protocol.loss_score import LossMeter, LossScores
from p2p_diloco.protocol.robust_config import NON_OFFENCES, STATISTICAL, RobustConfig, RobustTag
from p2p_diloco.protocol.standing import Standing

ACCEPT, CLIP, REJECT = Action.ACCEPT, Action.CLIP, Action.REJECT

__all__ = [
    "ACCEPT",
    "CLIP",
    "NON_OFFENCES",
    "REJECT",
    "CounterCheck",
    "RobustConfig",
    "RobustGuard",
    "RobustTag",
    "Screened",
    "cosine",
    "fragment_norm",
]


@dataclass(frozen=True)
class CounterCheck:
    decision: Decision
    tokens: int
    steps: int


@dataclass(frozen=True)
class Screened:
    decision: Decision
    tensors: dict[str, Tensor]  # the input, or a clipped copy when decision.action is CLIP


class RobustGuard:
    """Robust checks with their state: norm histories, direction references, offences, cool-downs.

    One guard per peer, shared by every `Synchronizer` the peer becomes, so histories survive its terms;
    it also sees every update the peer applies (`observe_update`), so a new holder starts with a warm
    direction reference.
    """

    def __init__(self, config: RobustConfig, *, tokens_per_step: int, inner_steps: int, inner_lr: float):
        self.config = config
        self.tokens_per_step = tokens_per_step
        self.max_steps = max(1, int(config.max_steps_factor * inner_steps))
        self.inner_steps = inner_steps
        self.inner_lr = inner_lr
        self._norms: dict[tuple[int, str], deque[float]] = {}
        self._references = DirectionReferences(config.reference_decay, config.reference_min_updates)
        self._direction_strikes: dict[int, set[str]] = {}
        self._cosines: dict[str, deque[float]] = {}
        self._seen: dict[str, tuple[deque[bytes], set[bytes]]] = {}
        self._offences: dict[str, deque[float]] = {}
        self._cool_until: dict[str, float] = {}
        self.cooldowns: list[tuple[float, str, str]] = []  # (start, sender, last offence)
        self.rejected: Counter[tuple[str, str]] = Counter()  # (sender, tag), every rejection reported
        # per statistical tag (direction outliers, loss worse): sender -> times (`note_rejection`)
        self._strikes: dict[str, dict[str, deque[float]]] = {}
        # model.probe.LossProbe when the loss check is on: a round's deltas -> their loss changes on its batch
        self.loss_probe: LossMeter | None = None
        self.standing = Standing(
            new_peer_rounds=config.new_peer_rounds if config.enabled else 0,
            active_window=config.active_window,
            newcomer_grace=config.newcomer_grace,
            newcomer_share=config.newcomer_share,
        )
        # each key's loss score from this peer's own loss checks (`protocol.loss_score`): caps its weight
        self.scores = LossScores(decay=config.score_decay, forget_after=self.standing.forget_after)

    @classmethod
    def from_manifest(cls, manifest, config: RobustConfig | None = None) -> RobustGuard:
        """`config` defaults to the manifest's `robust` section if it has one, else `RobustConfig()`."""
        cfg = config or getattr(manifest, "robust", None) or RobustConfig()
        d = manifest.diloco
        return cls(
            cfg,
            tokens_per_step=d.batch_size * manifest.model.block_size,
            inner_steps=d.inner_steps,
            inner_lr=d.inner_lr,
        )

    # ---- senders ------------------------------------------------------------------------------------

    def admit(self, sender: str, now: float) -> Decision:
        until = self._cool_until.get(sender)
        if until is not None and now < until:
            return Decision(REJECT, RobustTag.COOL_DOWN, f"{sender} is ignored for {until - now:.1f}s more")
        return Decision(ACCEPT, RobustTag.PLAUSIBLE, f"{sender} is not cooling down")

    def cool_down_left(self, sender: str, now: float) -> float:
        """Seconds `sender` stays cooled down (to 0.1 s, as its rejection says; 0 if it is not)."""
        until = self._cool_until.get(sender)
        return round(until - now, 1) if until is not None and now < until else 0.0

    def cooling(self, now: float) -> frozenset[str]:
        return frozenset(s for s, until in self._cool_until.items() if now < until)

    def note_rejection(self, sender: str, tag: str, now: float) -> Decision | None:
        """Count a rejection of `sender`'s input; returns a RobustTag.COOL_DOWN_STARTED decision when one
        begins."""
        self.rejected[(sender, tag)] += 1
        cfg = self.config
        if not cfg.enabled:
            return None
        if tag in STATISTICAL and self._repeated(self._strikes.setdefault(tag, {}), sender, now):
            plural = "s" if tag == RobustTag.DIRECTION_OUTLIER else " refusals"
            tag = f"{cfg.direction_offence_limit} {tag}{plural}"
        elif tag in NON_OFFENCES:
            return None
        times = self._offences.setdefault(sender, deque())
        times.append(now)
        while times and times[0] < now - cfg.offence_window:
            times.popleft()
        if len(times) < cfg.offence_limit:
            return None
        times.clear()
        self._cool_until[sender] = now + cfg.cooldown
        self.cooldowns.append((now, sender, tag))
        return Decision(
            REJECT,
            RobustTag.COOL_DOWN_STARTED,
            f"{sender} ignored for {cfg.cooldown:.0f}s after {cfg.offence_limit} "
            f"offences within {cfg.offence_window:.0f}s, the last {tag!r}",
        )

    def _repeated(self, table: dict[str, deque[float]], sender: str, now: float) -> bool:
        """Note one more event of `sender`; True (and restart) when `direction_offence_limit` fall within
        `offence_window`."""
        times = table.setdefault(sender, deque())
        times.append(now)
        while times and times[0] < now - self.config.offence_window:
            times.popleft()
        if len(times) < self.config.direction_offence_limit:
            return False
        times.clear()
        return True

    # ---- counters and replays -----------------------------------------------------------------------

    def check_counters(self, tokens: int, steps: int, *, for_weight: bool = False) -> CounterCheck:
        """Tokens per step must match the manifest; steps (and tokens with them) are clipped to
        `max_steps`, and for the merge weight (`for_weight`) to H: no claim out-weighs an honest learner
        that trained a full H steps (an honest delta that trained on while in flight loses the excess
        weight, not its place in the merge)."""
        if not self.config.enabled or steps <= 0:
            return CounterCheck(Decision(ACCEPT, RobustTag.PLAUSIBLE, "counters not checked"), tokens, steps)
        expected = self.tokens_per_step
        if abs(tokens / steps - expected) > self.config.token_tolerance * expected:
            return CounterCheck(
                Decision(
                    REJECT,
                    RobustTag.TOKEN_CLAIM,
                    f"{tokens} tokens in {steps} steps is {tokens / steps:.1f} per step, "
                    f"the manifest's batch x block is {expected}",
                ),
                tokens,
                steps,
            )
        cap = min(self.max_steps, self.inner_steps) if for_weight else self.max_steps
        if steps > cap:
            clipped = round(tokens * cap / steps)
            return CounterCheck(
                Decision(CLIP, RobustTag.STEP_CLAIM, f"{steps} steps clipped to {cap} for the weight"),
                clipped,
                cap,
            )
        return CounterCheck(
            Decision(ACCEPT, RobustTag.PLAUSIBLE, f"{tokens} tokens in {steps} steps"), tokens, steps
        )

    def check_replay(self, sender: str, payload: bytes) -> Decision:
        """Refuse a payload this sender sent before; remembers the last `replay_memory` payloads per
        sender."""
        if not self.config.enabled:
            return Decision(ACCEPT, RobustTag.PLAUSIBLE, "replays not checked")
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        order, seen = self._seen.setdefault(sender, (deque(), set()))
        if digest in seen:
            return Decision(REJECT, RobustTag.REPLAY, f"{sender} sent this delta before")
        order.append(digest)
        seen.add(digest)
        if len(order) > self.config.replay_memory:
            seen.discard(order.popleft())
        return Decision(ACCEPT, RobustTag.PLAUSIBLE, "new payload")

    # ---- norms and directions -----------------------------------------------------------------------

    def screen(self, fragment: int, tensors: Mapping[str, Tensor], steps: int, sender: str = "") -> Screened:
        """Norm rules per tensor, then the direction against the fragment's reference."""
        cfg = self.config
        tensors = dict(tensors)
        if not cfg.enabled:
            return Screened(Decision(ACCEPT, RobustTag.PLAUSIBLE, "robust checks disabled"), tensors)
        counted = self._counted_steps(steps)
        prior_rms = cfg.prior_factor * self.inner_lr * counted
        clipped = []
        for name, t in tensors.items():
            norm = kernels.norm64(t)
            rms = norm / math.sqrt(max(1, t.numel()))
            if rms > prior_rms:
                return Screened(
                    Decision(
                        REJECT,
                        RobustTag.NORM_OUTLIER,
                        f"{name} RMS {rms:.3g} > {prior_rms:.3g} ({cfg.prior_factor} x lr x {counted} steps)",
                    ),
                    tensors,
                )
            history = self._norms.get((fragment, name))
            if history is None or len(history) < cfg.min_history:
                continue
            median = statistics.median(history)  # of norms per step
            per_step = norm / counted
            if per_step > cfg.reject_factor * median:
                return Screened(
                    Decision(
                        REJECT,
                        RobustTag.NORM_OUTLIER,
                        f"{name} norm {norm:.3g} in {counted} steps is {per_step:.3g} per "
                        f"step > {cfg.reject_factor} x median {median:.3g}",
                    ),
                    tensors,
                )
            if per_step > cfg.clip_factor * median:
                tensors[name] = t * (cfg.clip_factor * median / per_step)
                clipped.append(f"{name} {per_step / median:.1f}x")
        direction = self._check_direction(fragment, tensors, sender)
        if direction.action != ACCEPT:
            return Screened(direction, tensors)
        if clipped:
            return Screened(
                Decision(
                    CLIP, RobustTag.NORM_CLIPPED, f"to {cfg.clip_factor} x median: {', '.join(clipped[:4])}"
                ),
                tensors,
            )
        return Screened(direction, tensors)

    def _threshold(self, tensors: Mapping[str, Tensor], n: int = 1) -> float:
        """Cosine a mean of `n` cosines must reach: `noise_z` standard deviations of random noise."""
        numel = sum(t.numel() for t in tensors.values())
        return self.config.min_cosine + min(0.1, self.config.noise_z / math.sqrt(max(1, numel * n)))

    def _check_direction(self, fragment: int, tensors: Mapping[str, Tensor], sender: str) -> Decision:
        cfg = self.config
        reference = self._references.usable(fragment)
        if reference is None:
            return Decision(
                ACCEPT, RobustTag.NO_REFERENCE, f"fragment {fragment} has no direction reference yet"
            )
        cos = cosine(tensors, reference)
        recent = self._cosines.setdefault(sender, deque(maxlen=cfg.direction_window))
        recent.append(-1.0 if cos is None else cos)  # a zero delta carries no direction: worst case
        mean = sum(recent) / len(recent)
        threshold = self._threshold(tensors, len(recent))
        shown = "zero delta" if cos is None else f"cosine {cos:.3f}"
        if mean >= threshold:
            self._direction_strikes.pop(fragment, None)
            return Decision(
                ACCEPT,
                RobustTag.PLAUSIBLE,
                f"{shown}, mean of last {len(recent)} {mean:.3f} with recent updates",
            )
        strikes = self._direction_strikes.setdefault(fragment, set())
        strikes.add(sender)
        if len(strikes) >= 2:  # two senders in a row disagree with it: distrust the reference instead
            self._references.reset(fragment)
            self._direction_strikes.pop(fragment, None)
        return Decision(
            REJECT,
            RobustTag.DIRECTION_OUTLIER,
            f"{shown}, mean of last {len(recent)} {mean:.3f} < {threshold:.3f} with recent updates",
        )

    def warming_up(self, fragment: int) -> bool:
        """Whether `fragment` never had a direction reference (after a reset rounds are not held again:
        that stalled the global model for `warmup_wait` each time honest learners disagreed with it)."""
        return self.config.enabled and not self._references.warmed(fragment)

    def direction_reference(self, fragment: int) -> Mapping[str, Tensor] | None:
        """The fragment's direction reference (bfloat16 per tensor; read it, never change it), or None."""
        return self._references.get(fragment)

    def has_reference(self, fragment: int) -> bool:
        """Whether `screen` checks directions of `fragment` (False also when the checks are disabled)."""
        return self.config.enabled and self._references.usable(fragment) is not None

    def screen_round(self, deltas: Sequence[Mapping[str, Tensor]]) -> list[Decision]:
        """Drop each delta whose cosine with more than half of the others is below the threshold."""
        if not self.config.enabled or len(deltas) < self.config.round_min:
            return [
                Decision(ACCEPT, RobustTag.NO_REFERENCE, f"fewer than {self.config.round_min} deltas")
            ] * len(deltas)
        cosines = cosine_matrix(deltas)
        decisions = []
        for i, delta in enumerate(deltas):
            threshold = self._threshold(delta)
            others = [c for j, c in enumerate(cosines[i]) if j != i]
            below = sum(1 for c in others if c is None or c < threshold)
            shown = ", ".join("none" if c is None else f"{c:.3f}" for c in others)
            if 2 * below > len(others):
                decisions.append(
                    Decision(
                        REJECT,
                        RobustTag.DIRECTION_OUTLIER,
                        f"cosine below {threshold:.3f} with {below} of the "
                        f"{len(others)} other deltas of the round ({shown})",
                    )
                )
            else:
                decisions.append(
                    Decision(ACCEPT, RobustTag.PLAUSIBLE, f"cosines with the round's others {shown}")
                )
        return decisions

    def _counted_steps(self, steps: int) -> int:
        return min(max(steps, 1), self.max_steps)

    def note_accepted(self, fragment: int, tensors: Mapping[str, Tensor], steps: int = 1) -> None:
        """Add an accepted (possibly clipped) delta's tensor norms per step to the fragment's histories."""
        counted = self._counted_steps(steps)
        for name, t in tensors.items():
            history = self._norms.setdefault((fragment, name), deque(maxlen=self.config.norm_history))
            history.append(kernels.norm64(t) / counted)

    def observe_update(
        self,
        fragment: int,
        outer_grad: Mapping[str, Tensor | kernels.QuantizedTensor],
        norm: float | None = None,
    ) -> None:
        """Fold the direction of an applied outer update into the fragment's reference (kept in bfloat16,
        `protocol.direction`); nothing while the checks are disabled. `norm`: the update's L2 norm if
        the caller computed it already."""
        if self.config.enabled:
            self._references.observe(fragment, outer_grad, norm)
