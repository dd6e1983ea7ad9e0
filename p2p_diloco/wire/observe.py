"""Byte encodings of the records that let a run see itself: global eval history and per-peer stats.

* `EvalHistory` (key `keys.eval_key`, subkey = the evaluator's peer ID, owner-signed): the bounded
  history of global evaluations that peer holds (its own points and those it read from others), plus
  the contribution leaderboard of its ledger. A newcomer, or the next evaluator after a failover, reads
  every subkey and merges them (`merge_points`), so the curve survives the loss of any one peer.
  Only records of permitted evaluators count (`admit_histories`: the run's synchronizers and listed
  evaluators), and only their points attributed to permitted evaluators: what another key writes under
  this key never reaches a curve, a leaderboard or the choice of who evaluates.
* `PeerStats` (key `keys.stats_key`, subkey = the peer's ID): facts the heartbeat does not carry
  (start time, device, bytes in and out), for the dashboard's peer table.

Decoding is strict like `wire.records`: anything that does not match the schema raises `RecordError`
and the reader ignores that record (with a counter); it never reaches a chart or crashes a reader.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.wire.records import MAX_TEXT, RecordError

MAX_EVAL_POINTS = 64  # points one history record keeps: the newest half, and the older ones thinned evenly
# Within the DHT's 12 KiB per value (net/dht_store.py: a larger call can kill hivemind's DHT process;
# the 30-minute chaos run lost every peer's DHT process once the history passed ~15 KiB).
MAX_EVAL_BYTES = 11 * 1024
MAX_CONTRIBUTORS = 32  # rows of the leaderboard one record carries (most tokens first)
MAX_FRAGMENTS = 4096
MAX_STATS_BYTES = 2 * 1024
MAX_LOSS = 1e4
# Clock skew tolerated on an eval point's time: a point dated further ahead refuses its record (a far-future
# point once paused every synchronizer's evaluation until restart)
MAX_EVAL_SKEW = 60.0


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of the global model: when, after how many merged tokens, at which fragment
    versions and synchronizer term, by whom, and its held-out loss (perplexity = exp(loss))."""

    t: float
    tokens: int
    versions: tuple[int, ...]
    loss: float
    evaluator: str
    term: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def updates(self) -> int:
        return sum(self.versions)

    def key(self) -> tuple[float, str]:
        return (self.t, self.evaluator)

    def as_dict(self) -> dict:
        return {
            "t": self.t,
            "tokens": self.tokens,
            "versions": list(self.versions),
            "updates": self.updates,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "evaluator": self.evaluator,
            "term": self.term,
        }


@dataclass(frozen=True)
class EvalHistory:
    """What one evaluator publishes: its history (oldest first) and its ledger's leaderboard.

    `dedicated` says the writer evaluates by choice (`join --evaluate`): a synchronizer then leaves
    evaluation to it (one evaluator at a time).
    """

    points: tuple[EvalPoint, ...]
    dedicated: bool = False
    contributions: tuple[tuple[str, int, int], ...] = ()  # (peer ID, merged tokens, updates)

    def to_bytes(self) -> bytes:
        points = list(thin(self.points, MAX_EVAL_POINTS))
        while True:
            raw = json.dumps(
                {
                    "dedicated": self.dedicated,
                    "points": [
                        [p.t, p.tokens, list(p.versions), p.loss, p.perplexity, p.evaluator, p.term]
                        for p in points
                    ],
                    "contributions": [list(c) for c in self.contributions[:MAX_CONTRIBUTORS]],
                },
                separators=(",", ":"),
            ).encode()
            if len(raw) <= MAX_EVAL_BYTES or not points:
                return raw
            points = points[
                len(points) // 8 + 1 :
            ]  # too many fragments for the full history: drop the oldest


def _finite(value, name: str, *, integer: bool = False, lo: float = 0.0, hi: float = math.inf) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or not math.isfinite(value) or not lo <= value <= hi:
        raise RecordError(f"{name} must be a finite {'integer' if integer else 'number'} in [{lo}, {hi}]")
    return value


def _text(value, name: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT or not value.isprintable():
        raise RecordError(f"{name} must be a printable string of 1-{MAX_TEXT} characters")
    return value


def _object(raw: bytes, limit: int, fields: set[str]) -> dict:
    if not isinstance(raw, bytes | bytearray) or len(raw) > limit:
        raise RecordError(f"record is not bytes or larger than {limit} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RecordError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict) or set(value) != fields:
        raise RecordError(f"expected a JSON object with keys {sorted(fields)}")
    return value


def _point(row, num_fragments: int) -> EvalPoint:
    if not isinstance(row, list) or len(row) != 7:
        raise RecordError("an eval point is [t, tokens, versions, loss, perplexity, evaluator, term]")
    t, tokens, versions, loss, perplexity, evaluator, term = row
    if not isinstance(versions, list) or len(versions) != num_fragments:
        raise RecordError(f"an eval point lists {num_fragments} fragment versions")
    point = EvalPoint(
        t=float(_finite(t, "t")),
        tokens=int(_finite(tokens, "tokens", integer=True)),
        versions=tuple(int(_finite(v, "versions[]", integer=True)) for v in versions),
        loss=float(_finite(loss, "loss", hi=MAX_LOSS)),
        evaluator=_text(evaluator, "evaluator"),
        term=int(_finite(term, "term", integer=True)),
    )
    if not math.isclose(
        float(_finite(perplexity, "perplexity", hi=math.inf)), point.perplexity, rel_tol=1e-6
    ):
        raise RecordError("perplexity must be exp(loss)")
    return point


def decode_eval_history(raw: bytes, num_fragments: int) -> EvalHistory:
    """Strict: at most `MAX_EVAL_POINTS` points in time order, one version per fragment, finite numbers."""
    if not 0 < num_fragments <= MAX_FRAGMENTS:
        raise RecordError(f"num_fragments must be 1-{MAX_FRAGMENTS}")
    d = _object(raw, MAX_EVAL_BYTES, {"dedicated", "points", "contributions"})
    if not isinstance(d["dedicated"], bool):
        raise RecordError("dedicated must be a boolean")
    rows, contributions = d["points"], d["contributions"]
    if not isinstance(rows, list) or len(rows) > MAX_EVAL_POINTS:
        raise RecordError(f"points must be a list of at most {MAX_EVAL_POINTS}")
    points = tuple(_point(row, num_fragments) for row in rows)
    if any(a.t > b.t for a, b in zip(points, points[1:])):
        raise RecordError("points must be in time order")
    if not isinstance(contributions, list) or len(contributions) > MAX_CONTRIBUTORS:
        raise RecordError(f"contributions must be a list of at most {MAX_CONTRIBUTORS}")
    rows_out = []
    for row in contributions:
        if not isinstance(row, list) or len(row) != 3:
            raise RecordError("a contribution is [peer, tokens, updates]")
        rows_out.append(
            (
                _text(row[0], "contributions[].peer"),
                int(_finite(row[1], "contributions[].tokens", integer=True)),
                int(_finite(row[2], "contributions[].updates", integer=True)),
            )
        )
    return EvalHistory(points=points, dedicated=d["dedicated"], contributions=tuple(rows_out))


def thin(points: Sequence[EvalPoint], limit: int) -> tuple[EvalPoint, ...]:
    """At most `limit` of `points` (oldest first): the newest half as they are, and as many of the older
    ones, evenly spaced from the first, so a long run's curve keeps its shape in a small record."""
    points = tuple(points)
    if len(points) <= limit:
        return points
    recent = limit // 2
    older, keep = points[:-recent] if recent else points, limit - recent
    step = len(older) / keep
    return tuple(older[int(i * step)] for i in range(keep)) + (points[-recent:] if recent else ())


def merge_points(*histories: Iterable[EvalPoint], limit: int = MAX_EVAL_POINTS) -> tuple[EvalPoint, ...]:
    """The union of several histories, one point per (time, evaluator), oldest first, `thin`ned to
    `limit`."""
    merged = {p.key(): p for history in histories for p in history}
    return thin([merged[k] for k in sorted(merged)], limit)


def merge_records(records: dict[str, EvalHistory], limit: int = MAX_EVAL_POINTS) -> tuple[EvalPoint, ...]:
    """The points of several evaluators' records (writer = the signed subkey), `merge_points`-merged.

    A writer speaks for itself: where evaluator E's own record is readable, a point attributed to E in
    another writer's record is taken only if it is older than everything E's record still holds (E's
    record keeps only its newest points); E's own copy of a point wins over any relayed one. So a hostile
    writer cannot rewrite or add to a live evaluator's curve; points of evaluators whose records are gone are
    taken as relayed.
    """
    own = {writer for writer, h in records.items() if any(p.evaluator == writer for p in h.points)}
    since = {
        writer: min((p.t for p in h.points if p.evaluator == writer), default=math.inf)
        for writer, h in records.items()
    }
    relayed, first_hand = [], []
    for writer, history in records.items():
        for p in history.points:
            if p.evaluator == writer:
                first_hand.append(p)
            elif p.evaluator not in own or p.t < since[p.evaluator]:
                relayed.append(p)
    return merge_points(relayed, first_hand, limit=limit)  # a first-hand copy wins over a relayed one


class EvalRefusal(StrEnum):
    """Why a decoded eval history record, or some of its points, did not count (`admit_histories`)."""

    WRITER = "eval writer not permitted"  # the subkey's owner is no permitted evaluator: whole record
    FUTURE = (
        "eval point from the future"  # a point dated past now + skew: whole record (it would pause others)
    )
    UNATTRIBUTED = "eval point not attributable"  # a point naming an evaluator that is not permitted


@dataclass(frozen=True)
class AdmittedHistories:
    records: dict[str, EvalHistory]  # writer -> its record, keeping only points of permitted evaluators
    refused: tuple[tuple[str, EvalRefusal, str], ...]  # (writer, reason, detail)


def admit_histories(
    records: Mapping[str, EvalHistory], *, may_evaluate: Callable[[str], bool], now: float, max_skew: float
) -> AdmittedHistories:
    """The records whose points may count. A record counts only if its writer (the owner-signed subkey) is a
    permitted evaluator and none of its points is dated after `now + max_skew`; within it, a point counts
    only if the evaluator it names is permitted too (a permitted writer relays such points, never others).
    So an honest peer never re-publishes a point no permitted evaluator's signature stands behind."""
    admitted, refused = {}, []
    for writer, history in records.items():
        if not may_evaluate(writer):
            refused.append((writer, EvalRefusal.WRITER, f"{len(history.points)} points"))
            continue
        late = max((p.t for p in history.points), default=-math.inf)
        if late > now + max_skew:
            refused.append((writer, EvalRefusal.FUTURE, f"a point at t={late:.0f}, {late - now:.0f}s ahead"))
            continue
        kept = tuple(p for p in history.points if may_evaluate(p.evaluator))
        if len(kept) < len(history.points):
            dropped = len(history.points) - len(kept)
            refused.append((writer, EvalRefusal.UNATTRIBUTED, f"{dropped} points of unpermitted evaluators"))
        admitted[writer] = EvalHistory(kept, history.dedicated, history.contributions)
    return AdmittedHistories(admitted, tuple(refused))


@dataclass(frozen=True)
class PeerStats:
    """What a peer tells the dashboard besides its heartbeat: when it started (DHT time), its device and
    the bytes it has sent and received since."""

    started_at: float
    device: str
    bytes_sent: int
    bytes_received: int

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()


def decode_peer_stats(raw: bytes) -> PeerStats:
    d = _object(raw, MAX_STATS_BYTES, {"started_at", "device", "bytes_sent", "bytes_received"})
    device = _text(d["device"], "device")
    if len(device) > 32:
        raise RecordError("device must be at most 32 characters")
    return PeerStats(
        started_at=float(_finite(d["started_at"], "started_at")),
        device=device,
        bytes_sent=int(_finite(d["bytes_sent"], "bytes_sent", integer=True)),
        bytes_received=int(_finite(d["bytes_received"], "bytes_received", integer=True)),
    )
