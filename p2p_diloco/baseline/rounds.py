"""Synchronous DiLoCo's pure parts: the outer step and the bookkeeping of one round. No hivemind, no clock.

Owns what `diloco.DilocoWorker` decides without touching the network, so it can be tested alone:

* `outer_gradients` (global − local, per tensor) and `outer_step`: the manifest's outer optimizer, the
  same float32 Nesterov kernel every replica of the decoupled system applies (`protocol.replica`);
* `decide_round`: at the end of its H inner steps a peer looks at the progress records of the others
  (`PeerProgress`, read from hivemind's progress tracker) and either waits for peers still training at
  its epoch (as OpenDiLoCo's ``WAIT_FOR_ALL``: until every one of them reported its round done, or is
  overdue by a grace period, extrapolating its last report, or `wait_limit` seconds passed, after which
  the slow ones are skipped; entering the matchmaking when a peer is merely *expected* within the window,
  as OpenDiLoCo does, left the throttled demo peer out of most rounds) and for peers whose
  record shows an earlier epoch (a record not yet refreshed, or a peer about to load the state of one
  that is ahead; a dead one's record expires), goes to the all-reduce with the peers that are done,
  reloads the state of a peer that is ahead, or steps alone when no other peer is done (the others
  then find it ahead and load its state);
* `settle_round`: what a member does once an all-reduce returned (`Settle`): step with the averaged
  outer gradient, decide the round again (it failed: no group, a member of another epoch, or a partial
  average, `partial_average`), or drop it and load the state of a member that stepped (the members
  gathered different digests of their outer states and this one's is not the least);
* `partial_average`: hivemind's all-reduce fills the parts of the average that a reducer never sent back
  with the member's own values and still reports success; such a member must not step (module rule 1);
* `epoch_group_bits`: the averager's group key bits for an epoch, so only peers of one epoch meet.

Why replicas converge (the rules the functions above implement; `diloco` applies them):

1. A member steps with an averaged outer gradient only if its all-reduce was complete (every part of
   the average came back from its reducer) and every member was at its epoch. Every member gets a part's
   average from the one reducer of that part, so all members with complete results hold the same average
   (float64 sums of float32 values, `outer_averager`); a member with a partial result retries the round
   (if the others stepped, it then finds them ahead: rule 4).
2. A member steps only if its outer-state digest is the least its group gathered: all stepping members
   of one all-reduce held one state and apply one average, so they hold one state afterwards.
3. A member whose digest was not the least is *lost* for that epoch: it never steps an all-reduce of
   the epoch again. It waits for a member that stepped to show up ahead and loads that member's state;
   after a grace it joins the epoch's all-reduce again (to let a member whose own try failed step), but
   only as a contributor. The holder of the least digest of an epoch is never lost, so the epoch ends.
4. A member behind loads from the most advanced peer and never steps an epoch it was not at.

So with two peers up, every round ends with both on one state, or one on a state the other holds after
its reload; the only way in for a difference is a step alone (a peer that saw no other peer of its epoch
done), and the next all-reduce the two share removes it (rules 2 and 3). With more peers, every
all-reduce group leaves its stepping members on one state; groups that stepped the same epoch apart
(a split matchmaking, steps alone) are joined by rules 2 and 3 the next time their members meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from p2p_diloco.protocol import diloco

GROUP_BITS = 16  # epochs modulo 2**16 name the matchmaking key: rounds that far apart never overlap


@dataclass(frozen=True)
class DilocoSettings:
    """What `baseline-worker --mode diloco` adds to the hivemind settings (`elastic.ElasticSettings`)."""

    inner_steps: int  # H: the manifest's inner steps per outer round
    outer_lr: float
    outer_momentum: float
    group_size: int  # peers expected: the all-reduce starts at once when that many joined
    wait_limit: float  # seconds to wait for slower peers before a round goes on without them

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.group_size < 1 or self.wait_limit < 0 or self.outer_lr <= 0:
            raise ValueError(f"bad synchronous DiLoCo settings: {self}")


class Decision(StrEnum):
    WAIT = "wait"  # peers at this epoch are still training: ask again soon
    AVERAGE = "average"  # go to the all-reduce
    RELOAD = "reload"  # a peer is ahead: load its state, drop this round's local work
    ALONE = "alone"  # nobody else at this epoch: the local outer gradient is the round's


@dataclass(frozen=True)
class PeerProgress:
    """One peer's progress record (hivemind's `LocalTrainingProgress`): samples since its last outer step."""

    peer_id: bytes
    epoch: int
    samples: int
    samples_per_second: float
    time: float  # when it reported


@dataclass(frozen=True)
class RoundView:
    decision: Decision
    peers_at_epoch: int  # this peer included
    peers_done: int  # other peers of this epoch that reported their round done
    waiting_for: int  # peers behind, and peers of this epoch neither done nor overdue by the grace
    ahead: int  # peers at a later epoch


def overdue(peer: PeerProgress, target_samples: int, now: float) -> float:
    """Seconds since `peer` should have finished its round, extrapolating its last report at its own
    speed: negative while it should still be training, -inf while its speed is unknown (a fresh start),
    0 once it reported its round done."""
    if peer.samples >= target_samples:
        return 0.0
    if peer.samples_per_second <= 0:
        return -float("inf")
    return now - peer.time - (target_samples - peer.samples) / peer.samples_per_second


def decide_round(
    me: bytes,
    epoch: int,
    peers: Sequence[PeerProgress],
    *,
    target_samples: int,
    now: float,
    grace: float,
    waited: float,
    wait_limit: float,
    expected_peers: int = 1,
    lost_for: float | None = None,
) -> RoundView:
    """What a peer at `epoch` that finished its H steps does next (module docstring).

    `peers`: the records seen (this peer's own is ignored). A peer of this epoch is waited for until it
    reports its round done, or until it is `grace` seconds overdue (dead, most likely: a SIGKILLed peer's
    record stays until it expires). `waited`: seconds already spent waiting in this round, at most
    `wait_limit`. At epoch 0 the peer also waits (up to `wait_limit`) for `expected_peers` peers to show
    up, so a swarm starting together takes its first round together. `lost_for`: seconds since this
    peer found its outer state not canonical at `epoch` (`settle_round`), None if it did not: it waits
    `grace` seconds for a member that stepped to show up ahead before it joins the epoch's all-reduce
    again (module rule 3).
    """
    others = [p for p in peers if p.peer_id != me]
    ahead = sum(p.epoch > epoch for p in others)
    behind = sum(p.epoch < epoch for p in others)
    same = [p for p in others if p.epoch == epoch]
    done = [p for p in same if p.samples >= target_samples]
    late = sum(p.samples < target_samples and overdue(p, target_samples, now) < grace for p in same)
    missing = epoch == 0 and len(same) + 1 < expected_peers
    if ahead:
        decision = Decision.RELOAD
    elif lost_for is not None and lost_for < grace:
        decision = Decision.WAIT
    elif (late or behind or missing) and waited < wait_limit:
        decision = Decision.WAIT
    elif done:
        decision = Decision.AVERAGE
    else:
        decision = Decision.ALONE
    return RoundView(
        decision, peers_at_epoch=len(same) + 1, peers_done=len(done), waiting_for=late + behind, ahead=ahead
    )


class Settle(StrEnum):
    STEP = "step"  # apply the averaged outer gradient: this member's outer state is the round's
    RETRY = "retry"  # the all-reduce failed: decide the round again
    RELOAD = "reload"  # another member's state is the round's: drop the round, load one that stepped


def partial_average(failed: int, total: int) -> str | None:
    """Why an all-reduce whose reducers left `failed` of `total` values unsent (hivemind filled them with
    this member's own values) must not be applied; None if every value came back."""
    if total <= 0 or failed < 0 or failed > total:
        return f"partial average: {failed} of {total} values unaccounted for"
    if failed == 0:
        return None
    return f"partial average: received {100.0 * (1 - failed / total):.1f}% of the averaged values"


def settle_round(epoch: int, digest: str, gathered: Sequence[object] | None, *, lost: bool = False) -> Settle:
    """What a member at `epoch` whose outer state has `digest` does with a finished all-reduce (module
    rules 1-3). `gathered`: what every member gathered (None: the all-reduce failed or was partial).

    RETRY unless at least two members, all at `epoch`; then STEP if `digest` is the least digest gathered
    (the same answer on every member, since all gather the same values), else RELOAD. `lost`: this
    member already found its state not canonical at this epoch: it never steps (RELOAD)."""
    if gathered is None or len(gathered) < 2:
        return Settle.RETRY
    if any(not isinstance(g, dict) or g.get("epoch") != epoch for g in gathered):
        return Settle.RETRY
    if lost:
        return Settle.RELOAD
    digests = [g["digest"] for g in gathered if isinstance(g.get("digest"), str)]
    return Settle.STEP if not digests or digest <= min(digests) else Settle.RELOAD


def epoch_group_bits(epoch: int) -> str:
    """The averager's group bits for `epoch`: its low `GROUP_BITS` bits, as '0'/'1' characters."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return format(epoch % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


@torch.no_grad()
def outer_gradients(global_params: Sequence[Tensor], local_params: Sequence[Tensor]) -> list[Tensor]:
    """Θ − θ per tensor (float32, `diloco.outer_delta`): points against the local progress, like a
    gradient."""
    if len(global_params) != len(local_params):
        raise ValueError(f"{len(global_params)} global tensors but {len(local_params)} local ones")
    pairs = zip(global_params, local_params, strict=True)
    return [diloco.outer_delta(g.detach().float(), p.detach().float()) for g, p in pairs]


@torch.no_grad()
def outer_step(
    global_params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    lr: float,
    mu: float,
) -> None:
    """Θ and the momentum buffers in place: the core's outer Nesterov step with the outer gradients
    `grads`."""
    for param, buf, grad in zip(global_params, momentum, grads, strict=True):
        new_param, new_buf = diloco.outer_step(param.detach().float(), buf, grad.float(), lr=lr, momentum=mu)
        param.copy_(new_param)
        buf.copy_(new_buf)
