"""Sparse rounds under union aggregation (issue #30): the synchronizer chooses which learner-signed deltas a
round merges, and every replica checks those deltas and merges them itself.

Under a sparse codec a learner signs each delta (`swarm.outbox`, `wire.delta_signature`). The synchronizer
admits a delta only with a valid signature of its sender (`intake_problem`), and publishes an update that
lists the deltas it merged (learner, seq, payload digest, weight: at most the tokens the learner signed) under
its own signature and carries the delta frames themselves (`wire.delta_bundle`). Nothing is re-sparsified and
nothing is left in an outer residual: the update is exactly `protocol.union_merge` of the listed deltas
(median-norm clipped, token-weighted where indices overlap), scaled as the dense path scales an update of
fewer contributors than live learners (`[diloco] outer_scaling`, with the `live` count the record names).

`open_record` is what every replica runs on such an update (pushed, replayed, or its own): the listing matches
the record's contributors and seqs, names at most `[diloco] gather` deltas (`protocol.gather`) and no learner
it also names as left out, every bundled frame decodes strictly, is the listed delta (run, manifest, fragment,
learner, seq, digest), carries its learner's valid signature, its weight is the signed tokens at most (the
holder's earned weight, `Standing.earned`: see `merging.Merger.merge_union`), its anchor is not ahead of the
update; then it decodes and merges with the listed weights. Any failure refuses the whole record with its tag
(`DeltaRefusal`, `UpdateTag` or a decoder's), which the caller counts against the peer that sent it; the
replica is not touched. `merge_signed` is the one merge both sides compute, so the replicas' results are
bit-identical to the synchronizer's (the record's checksum proves it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.messages import DeltaHeader, ListedDelta, UpdateRecord, UpdateTag
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.protocol.standing import counted_of
from p2p_diloco.protocol.union_merge import SparseContribution, union_merge
from p2p_diloco.wire.codecs.codec import decode_sparse, decode_tensors
from p2p_diloco.wire.delta_bundle import decode_bundle
from p2p_diloco.wire.delta_signature import (
    DeltaRefusal,
    SignedDelta,
    check_listed_delta,
    delta_signing_bytes,
    payload_digest,
)
from p2p_diloco.wire.frames import decode_delta
from p2p_diloco.wire.signing import SignatureCheck

Problem = tuple[str, str]  # (tag, detail)


@dataclass(frozen=True)
class SignedEntry:
    """One admitted delta of a sparse round: its learner, header (with the signature), codec payload and
    the whole frame as the learner sent it (what the update bundles)."""

    learner: str
    header: DeltaHeader
    payload: bytes
    frame: bytes

    @property
    def listed(self) -> ListedDelta:
        return ListedDelta(self.learner, self.header.seq, payload_digest(self.payload), self.header.tokens)


def signed_fields(learner: str, header: DeltaHeader, payload: bytes) -> SignedDelta:
    """What `learner` signed for this delta (`wire.delta_signature`)."""
    h = header
    return SignedDelta(
        h.run_id,
        h.manifest_hash,
        learner,
        h.fragment,
        h.anchor_version,
        h.seq,
        h.tokens,
        payload_digest(payload),
    )


def intake_problem(
    check: SignatureCheck | None, sender: str, header: DeltaHeader, payload: bytes
) -> Problem | None:
    """Why a synchronizer must not admit this delta of a sparse round (unsigned, badly signed, or no tokens
    to weigh it by; `check` None: it cannot check signatures), or None. Listing a delta that does not check
    would make every replica refuse the update, so the synchronizer checks it as they will."""
    if check is None:
        return DeltaRefusal.BAD_SIGNATURE, "this synchronizer has no signature check"
    if not header.signature:
        return DeltaRefusal.BAD_SIGNATURE, f"delta {header.seq} of fragment {header.fragment} is not signed"
    if header.tokens < 1:
        return DeltaRefusal.WEIGHT_MISMATCH, f"delta {header.seq} counts no tokens to weigh it by"
    signed = signed_fields(sender, header, payload)
    if signed.problem() is not None or not check.verify(
        sender, delta_signing_bytes(signed), header.signature
    ):
        return DeltaRefusal.BAD_SIGNATURE, f"delta {header.seq} of fragment {header.fragment}: not {sender}'s"
    return None


def weight_cap(manifest: RunManifest) -> int | None:
    """The most tokens one delta weighs in a union merge (None: no cap, robust checks off): H full inner
    steps, as `RobustGuard.check_counters` clips a dense delta's weight. From the manifest alone, so every
    replica weighs a listed delta alike; the listing itself names the tokens the learner signed."""
    guard = RobustGuard.from_manifest(manifest)
    if not guard.config.enabled:
        return None
    return guard.tokens_per_step * min(guard.max_steps, guard.inner_steps)


def merge_signed(
    entries: Sequence[SignedEntry],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    manifest: RunManifest,
    live: int,
    weights: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """The round's outer gradient: the union merge of `entries` (weights: the listed ones, `weights`, which
    the listing check bounds by the signed tokens; else the signed tokens; at most `weight_cap`), scaled by
    (counted / live) under `outer_scaling = "contributors"` when the round counts fewer than `live`
    contributors (else by counted / entries), counted the sum of weight / signed claim (`counted_of`: a
    newcomer's earned weight counts less than one contributor).
    Raises DecodeError on a payload the strict sparse decoder refuses."""
    wire = manifest.wire
    cap = weight_cap(manifest)
    listed = [e.header.tokens for e in entries] if weights is None else list(weights)
    contributions = [
        SparseContribution(
            e.learner,
            e.header.seq,
            float(w if cap is None else min(w, cap)),
            decode_sparse(e.payload, expected_shapes=shapes, max_bytes=wire.max_message_bytes),
        )
        for e, w in zip(entries, listed, strict=True)
    ]
    merged = union_merge(contributions, shapes).tensors
    # the contributors the round counts (`Standing.earned`): listed weight / signed claim, each at most 1
    claims = [float(e.header.tokens if cap is None else min(e.header.tokens, cap)) for e in entries]
    counted = counted_of([c.weight for c in contributions], claims)
    over = live if manifest.diloco.outer_scaling == "contributors" else len(entries)
    diloco.scale_to_live(list(merged.values()), counted, over)
    return merged


def listing_problem(record: UpdateRecord) -> Problem | None:
    """Why a sparse round's record does not list its deltas consistently with its header, or None."""
    if not record.deltas:
        return UpdateTag.WRONG_CODEC, "a sparse round's update must list the signed deltas it merged"
    if record.contributors != tuple(
        (d.learner, float(d.weight)) for d in record.deltas
    ) or record.seqs != tuple(d.seq for d in record.deltas):
        return DeltaRefusal.WEIGHT_MISMATCH, "contributors and seqs differ from the listed deltas"
    if record.live < len(record.deltas):
        return (
            UpdateTag.IMPLAUSIBLE_WEIGHT,
            f"{len(record.deltas)} deltas but only {record.live} live learners",
        )
    both = {who for who, _ in record.left_out} & {d.learner for d in record.deltas}
    if both:
        return DeltaRefusal.WRONG_DELTA, f"{sorted(both)[0]} is both listed and left out"
    return None


def open_record(
    record: UpdateRecord,
    check: SignatureCheck,
    manifest: RunManifest,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor] | Problem:
    """The outer gradient of a sparse round's `record`, merged here from the deltas it lists, or the
    (tag, detail) for which every replica refuses it (see the module docstring)."""
    problem = listing_problem(record)
    if problem is not None:
        return problem
    if len(record.deltas) > manifest.diloco.gather:  # what bounds every replica's down bytes per round
        return UpdateTag.TOO_LARGE, f"{len(record.deltas)} deltas listed, gather is {manifest.diloco.gather}"
    max_bytes = manifest.wire.max_message_bytes
    try:
        frames = decode_bundle(record.payload, max_bytes=max_bytes)
    except DecodeError as exc:
        return exc.reason, f"update bundle: {exc.detail}"
    if len(frames) != len(record.deltas):
        return DeltaRefusal.WRONG_DELTA, f"{len(record.deltas)} deltas listed, {len(frames)} bundled"
    entries = []
    for listed, frame in zip(record.deltas, frames):
        try:
            header, payload = decode_delta(frame, max_bytes=max_bytes)
        except DecodeError as exc:
            return exc.reason, f"bundled delta {listed.learner}/{listed.seq}: {exc.detail}"
        refusal = check_listed_delta(
            check,
            listed,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            fragment=record.fragment,
            signed=signed_fields(listed.learner, header, payload),
            signature=header.signature,
            payload=payload,
        )
        if refusal is not None:
            return refusal
        if header.anchor_version > record.from_version:
            detail = f"{listed.learner}/{listed.seq} anchored at v{header.anchor_version}, after the update"
            return DeltaRefusal.WRONG_DELTA, detail
        entries.append(SignedEntry(listed.learner, header, payload, frame))
    try:
        weights = [d.weight for d in record.deltas]
        return merge_signed(entries, shapes, manifest=manifest, live=record.live, weights=weights)
    except DecodeError as exc:
        return exc.reason, f"bundled delta payload: {exc.detail}"
    except ValueError as exc:  # union_merge's input checks (e.g. a non-finite value)
        return UpdateTag.NOT_FINITE, f"bundled deltas do not merge: {exc}"


def entry_of(learner: str, frame: bytes, max_bytes: int) -> SignedEntry:
    """The `SignedEntry` of a delta frame the synchronizer admitted (it decoded before, so it decodes)."""
    header, payload = decode_delta(frame, max_bytes=max_bytes)
    return SignedEntry(learner, header, payload, frame)


def outer_grad_of(
    record: UpdateRecord, check: SignatureCheck, manifest: RunManifest, shapes: Mapping[str, tuple[int, ...]]
) -> Mapping[str, torch.Tensor | QuantizedTensor] | Problem:
    """The outer gradient every replica applies for `record`, or why it refuses it: a sparse round's merged
    here (`open_record`); a dense one's decoded from its payload (int8 stays int8 until the outer step)."""
    if manifest.wire.codec.sparse:
        return open_record(record, check, manifest, shapes)
    try:
        return decode_tensors(
            record.payload, expected_shapes=shapes, max_bytes=manifest.wire.max_message_bytes, lazy=True
        )
    except DecodeError as exc:
        return exc.reason, f"update payload: {exc.detail}"
