"""The deltas an update record of a sparse round lists, as its JSON header carries them, checked strictly.

Under union aggregation the record of a sparse round carries no merged payload: it lists the deltas it
merged, each ``[learner, seq, payload digest (64 lower-case hex digits), weight (the tokens the learner
signed)]``, sorted by (learner, seq) with no pair twice, so one set of deltas has exactly one listing and the
record's signature covers exactly that set. Every replica fetches the listed deltas, checks each one
(`wire.delta_signature.check_listed_delta`) and merges them itself (`protocol.union_merge`).

A round offered more than `[diloco] gather` deltas also names the ones it left out (`left_out_problem`:
``[learner, seq]`` pairs sorted by learner), so their learners send that work again (`protocol.gather`).

`listing_problem` has the shape of `wire.frames`' header checks (None when valid, else what is wrong), so a
header schema can use it as it is; `listing_fields` and `parse_listing` convert both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2p_diloco.wire.bounds import MAX_CONTRIBUTORS, MAX_COUNTER
from p2p_diloco.wire.delta_signature import DIGEST_BYTES, ListedDelta, identifier_problem

_HEX = frozenset("0123456789abcdef")


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, list) or len(entry) != 4:
        return "entries must be [learner, seq, digest, weight]"
    learner, seq, digest, weight = entry
    problem = identifier_problem(learner)
    if problem is not None:
        return f"learner {str(learner)[:40]!r} {problem}"
    if type(seq) is not int or not 0 <= seq <= MAX_COUNTER:
        return f"seq of {learner} must be an integer in [0, {MAX_COUNTER}]"
    if not isinstance(digest, str) or len(digest) != 2 * DIGEST_BYTES or not set(digest) <= _HEX:
        return f"digest of {learner}/{seq} must be {2 * DIGEST_BYTES} lower-case hex digits"
    if type(weight) is not int or not 1 <= weight <= MAX_COUNTER:
        return f"weight of {learner}/{seq} must be an integer (tokens) in [1, {MAX_COUNTER}]"
    return None


def listing_problem(value: Any) -> str | None:
    """None when `value` is a canonical listing (1..MAX_CONTRIBUTORS entries, valid, strictly sorted by
    (learner, seq)); else what is wrong."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CONTRIBUTORS:
        return f"must be a list of 1-{MAX_CONTRIBUTORS} [learner, seq, digest, weight] entries"
    previous: tuple[str, int] | None = None
    for entry in value:
        problem = _entry_problem(entry)
        if problem is not None:
            return problem
        key = (entry[0], entry[1])
        if previous is not None and key <= previous:
            return f"entries must be sorted by (learner, seq), each once: {key} after {previous}"
        previous = key
    return None


def listing_fields(listed: Sequence[ListedDelta]) -> list[list[Any]]:
    """The canonical JSON form of `listed` (sorted); ValueError if it is not a valid listing."""
    fields = [
        [d.learner, d.seq, d.digest.hex(), d.weight] for d in sorted(listed, key=lambda d: (d.learner, d.seq))
    ]
    problem = listing_problem(fields)
    if problem is not None:
        raise ValueError(f"cannot list these deltas: {problem}")
    return fields


def parse_listing(value: Any) -> tuple[ListedDelta, ...]:
    """The deltas of a listing that `listing_problem` accepted; ValueError otherwise."""
    problem = listing_problem(value)
    if problem is not None:
        raise ValueError(f"not a delta listing: {problem}")
    return tuple(
        ListedDelta(learner, seq, bytes.fromhex(digest), weight) for learner, seq, digest, weight in value
    )


def left_out_problem(value: Any) -> str | None:
    """None when `value` is a canonical list of the deltas a sparse round left out past its gather set
    (`protocol.gather`): 1..MAX_CONTRIBUTORS `[learner, seq]` pairs, strictly sorted, each learner once (a
    round keeps one delta per learner); else what is wrong."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CONTRIBUTORS:
        return f"must be a list of 1-{MAX_CONTRIBUTORS} [learner, seq] pairs"
    previous: str | None = None
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 2:
            return "entries must be [learner, seq] pairs"
        learner, seq = entry
        problem = identifier_problem(learner)
        if problem is not None:
            return f"learner {str(learner)[:40]!r} {problem}"
        if type(seq) is not int or not 0 <= seq <= MAX_COUNTER:
            return f"seq of {learner} must be an integer in [0, {MAX_COUNTER}]"
        if previous is not None and learner <= previous:
            return f"entries must be sorted by learner, each once: {learner!r} after {previous!r}"
        previous = learner
    return None
