"""The synchronizer role: validate incoming deltas, run the fragment rounds, merge, build updates.

Sans-IO like the learner: `handle_delta` takes a frame and returns the reply reason, `poll` returns
the update records to publish. It never mutates the replica: the peer applies its own updates through
the same path as everyone else, which keeps the holder's replica identical to all others.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.merge import merge_deltas, validate_delta
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.sync_round import Contribution, SynchronizerRounds
from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import decode_delta

REJECT_WRONG_RUN = "wrong run"
REJECT_WRONG_MANIFEST = "wrong manifest"
REJECT_UNKNOWN_FRAGMENT = "unknown fragment"
REJECT_NOT_ALLOWED = "not allowed"


@dataclass(frozen=True)
class MergeOutcome:
    record: UpdateRecord
    reason: str


class Synchronizer:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        *,
        term: int,
        embedding_names: Collection[str] = (),
        shapes: dict[str, tuple[int, ...]],
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.term = term
        self.embedding_names = frozenset(embedding_names)
        self.expected = [{n: tuple(shapes[n]) for n in plan.names(p)} for p in range(plan.num_fragments)]
        cfg = manifest.diloco
        self.rounds = SynchronizerRounds(
            plan.num_fragments,
            replica.versions(),
            min_quorum=cfg.min_quorum,
            max_staleness=cfg.max_staleness,
            gamma=cfg.grace_gamma,
            tau=cfg.max_in_flight,
        )
        self.rounds_done = 0
        self.rejections: Counter[str] = Counter()
        self.rejections_by_sender: Counter[tuple[str, str]] = Counter()
        self.decisions: deque[str] = deque(maxlen=64)
        self.accepted_tokens: Counter[str] = Counter()

    def _reject(self, sender: str, tag: str, detail: str = "") -> str:
        self.rejections[tag] += 1
        self.rejections_by_sender[(sender, tag)] += 1
        reason = f"{tag}: {detail}" if detail else tag
        self.decisions.append(f"reject delta from {sender}: {reason}")
        return reason

    def handle_delta(self, sender: str, frame: bytes, now: float) -> str:
        """Validate and offer one delta frame; returns the reply for the sender. Never raises on bad input."""
        wire = self.manifest.wire
        try:
            header, payload = decode_delta(frame, max_bytes=wire.max_message_bytes)
        except DecodeError as exc:
            return self._reject(sender, exc.reason, str(exc))
        if header.run_id != self.manifest.run_id:
            return self._reject(sender, REJECT_WRONG_RUN, f"{header.run_id!r} != {self.manifest.run_id!r}")
        if header.manifest_hash != self.manifest.manifest_hash:
            return self._reject(sender, REJECT_WRONG_MANIFEST, "peer runs a different manifest; update it")
        if self.manifest.allowlist and sender not in self.manifest.allowlist:
            return self._reject(sender, REJECT_NOT_ALLOWED, "sender is not in the run's allowlist")
        p = header.fragment
        if not 0 <= p < self.plan.num_fragments:
            return self._reject(sender, REJECT_UNKNOWN_FRAGMENT, f"{p} not in [0, {self.plan.num_fragments})")
        try:
            tensors = decode_tensors(
                payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes
            )
        except DecodeError as exc:
            return self._reject(sender, exc.reason, str(exc))
        check = validate_delta(tensors, self.expected[p], norm_bound=wire.norm_bound)
        if check.action != "accept":
            return self._reject(sender, check.reason.split(":")[0], check.reason)
        contribution = Contribution(
            sender=sender,
            anchor_version=header.anchor_version,
            tokens=header.tokens,
            steps=header.steps,
            received_at=now,
            payload=tensors,
        )
        decision = self.rounds.offer(p, contribution, now)
        if decision.action != "accept":
            return self._reject(sender, decision.reason.split(":")[0].split(" (")[0], decision.reason)
        self.decisions.append(f"fragment {p}: {decision.reason} from {sender}")
        return decision.reason

    def observe_step_time(self, seconds: float) -> None:
        self.rounds.observe_step_time(seconds)

    def poll(self, now: float, live_learners: frozenset[str], cap: float) -> list[MergeOutcome]:
        """Close every round whose quorum and grace allow it; returns the updates to publish."""
        outcomes = []
        for p, decision in self.rounds.ready(now, live_learners, cap):
            if decision.action != "close":
                continue
            contributions = self.rounds.close(p, now)
            if not contributions:
                continue
            record = self._merge(
                p, contributions, live=len(live_learners | {c.sender for c in contributions})
            )
            self.rounds_done += 1
            self.decisions.append(
                f"fragment {p} v{record.from_version}->{record.to_version}: {decision.reason}"
            )
            outcomes.append(MergeOutcome(record=record, reason=decision.reason))
        return outcomes

    def finish(self, fragment: int, sync_seconds: float) -> None:
        """The update of `fragment` was applied locally and pushed; records the version and sync time."""
        self.rounds.finish(fragment, self.replica.versions()[fragment], sync_seconds)

    def _merge(self, p: int, contributions: list[Contribution], *, live: int) -> UpdateRecord:
        contributions = sorted(contributions, key=lambda c: c.sender)
        weights = [c.weight for c in contributions]
        merged = merge_deltas(
            [c.payload for c in contributions],
            weights,
            rule=self.manifest.diloco.merge_rule,
            embedding_names=self.embedding_names,
        )
        if self.manifest.diloco.outer_scaling == "contributors" and len(contributions) < live:
            scale = torch.tensor(len(contributions) / live, dtype=torch.float32)
            merged = {name: t * scale for name, t in merged.items()}
        wire = self.manifest.wire
        payload = encode_tensors(merged, codec=wire.codec, block_size=wire.block_size)
        # Everyone applies the decoded (quantized) gradient, the holder included, so replicas agree.
        decoded = decode_tensors(payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes)
        cfg = self.manifest.diloco
        pending = self.replica.compute_update(p, decoded, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        for c in contributions:
            self.accepted_tokens[c.sender] += c.tokens
        return UpdateRecord(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            from_version=self.replica.versions()[p],
            term=self.term,
            leader=self.peer_id,
            contributors=tuple((c.sender, float(w)) for c, w in zip(contributions, weights)),
            checksum=pending.checksum,
            payload=payload,
        )


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
