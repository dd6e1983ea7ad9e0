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
* `round_outcome`: what a finished all-reduce means for the ledger (`ledger.AVERAGED` or `ledger.ALONE`;
  a failed one is retried and decided again, never applied alone while peers are at the same epoch,
  because a peer that applied its own outer gradient would differ from the others for good);
* `holds_canonical_model`: after an all-reduce whose members gathered different digests of their outer
  states (as when two peers each stepped alone at one epoch, neither seeing the other's record), which
  of them keeps its model: those with the least digest step; the others drop the round and load the
  state of one that stepped (it is then ahead), so diverged replicas meet again instead of averaging on
  different models for good;
* `epoch_group_bits`: the averager's group key bits for an epoch, so only peers of one epoch meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from p2p_diloco.baseline.ledger import AVERAGED
from p2p_diloco.protocol.outer_step import nesterov_step

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
) -> RoundView:
    """What a peer at `epoch` that finished its H steps does next (module docstring).

    `peers`: the records seen (this peer's own is ignored). A peer of this epoch is waited for until it
    reports its round done, or until it is `grace` seconds overdue (dead, most likely: a SIGKILLed peer's
    record stays until it expires). `waited`: seconds already spent waiting in this round, at most
    `wait_limit`. At epoch 0 the peer also waits (up to `wait_limit`) for `expected_peers` peers to show
    up, so a swarm starting together takes its first round together.
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
    elif (late or behind or missing) and waited < wait_limit:
        decision = Decision.WAIT
    elif done:
        decision = Decision.AVERAGE
    else:
        decision = Decision.ALONE
    return RoundView(
        decision, peers_at_epoch=len(same) + 1, peers_done=len(done), waiting_for=late + behind, ahead=ahead
    )


def round_outcome(epoch: int, gathered: Sequence[object] | None) -> str | None:
    """`AVERAGED` if the all-reduce ran with at least one other peer, all of them at `epoch` (the values
    they gathered); None if it failed (no group, an error, or a member of another epoch)."""
    if gathered is None or len(gathered) < 2:
        return None
    if any(not isinstance(g, dict) or g.get("epoch") != epoch for g in gathered):
        return None
    return AVERAGED


def holds_canonical_model(digest: str, gathered: Sequence[object]) -> bool:
    """Whether this member's global model (`digest`) is the one every member of the round keeps: the
    least digest gathered. The same answer on every member, since all gather the same values."""
    digests = [g.get("digest") for g in gathered if isinstance(g, dict) and isinstance(g.get("digest"), str)]
    return not digests or digest <= min(digests)


def epoch_group_bits(epoch: int) -> str:
    """The averager's group bits for `epoch`: its low `GROUP_BITS` bits, as '0'/'1' characters."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return format(epoch % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


@torch.no_grad()
def outer_gradients(global_params: Sequence[Tensor], local_params: Sequence[Tensor]) -> list[Tensor]:
    """Θ − θ per tensor (float32): points against the local progress, like a gradient."""
    if len(global_params) != len(local_params):
        raise ValueError(f"{len(global_params)} global tensors but {len(local_params)} local ones")
    return [g.detach().float() - p.detach().float() for g, p in zip(global_params, local_params, strict=True)]


@torch.no_grad()
def outer_step(
    global_params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    lr: float,
    mu: float,
) -> None:
    """Θ and the momentum buffers in place: Nesterov SGD with the outer gradients `grads`."""
    for param, buf, grad in zip(global_params, momentum, grads, strict=True):
        new_param, new_buf = nesterov_step(param.detach().float(), buf, grad.float(), lr=lr, momentum=mu)
        param.copy_(new_param)
        buf.copy_(new_buf)
