"""A hot spare: a `join` process that prepares everything but its place in the swarm, then waits to take over.

A killed peer restarted cold trains again only seconds later: Python, torch and hivemind imports, then the
model and its inner optimizer (torch imports its compiler stack there), 8-14 s on two loaded cores
(docs/results/goodput-final), on top of however long the process was down. A hot spare
(`join --standby`) does all of that in advance without using anything another live process of the same
peer could be using: it never opens the state directory and starts no DHT node, so it cannot fork the
peer's identity. Then it waits for one line on standard input:

- ``go``: take over: open the state directory (waiting for the lock while a dead predecessor's helpers
  exit), start the DHT node under the peer's identity, load the replica, catch up and train. From there
  on it is an ordinary peer.
- end of input (whoever started it is gone) or any other line: exit 0 having touched nothing.

The imports (`node.join_command.cli_join_entry`) and the build run on threads at a lower priority
(`node.priority`): a spare warming up beside live peers, or beside the takeover of the spare before it,
takes the CPU only when they leave it idle. It also sets up hivemind's inter-process futures and parses
the identity key, which the takeover would otherwise spend time on. On a GPU the spare keeps its model
in host memory and moves it at takeover, so it never takes the live peer's device memory (this path is
untested: no GPU here).

`join --hot-spare` (node/supervise.py) keeps one spare beside a peer; `demo --hot-spares` one per slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.gpt import make_inner_optimizer
from p2p_diloco.net.dht_store import prepare_dht_process_state
from p2p_diloco.net.identity import peer_id_of, signing_key
from p2p_diloco.node.assembly import PreparedModel, prepare_training
from p2p_diloco.node.options import NodeOptions
from p2p_diloco.node.priority import run_lowered
from p2p_diloco.node.supervise import SPARE_NICENESS, TAKEOVER  # the supervisor, torch-free, owns them

READY = "standby: ready"  # printed once prepared, for whoever watches the spare's output


@dataclass(frozen=True)
class Takeover:
    """What a spare brings to its takeover: the prepared model and when it was told to go."""

    prepared: PreparedModel
    promoted_at: float  # time.monotonic() at the takeover line


def prepare_quietly(manifest: RunManifest, threads: int, niceness: int = SPARE_NICENESS) -> PreparedModel:
    """`prepare_training` on the host, on a thread whose priority is lowered by `niceness`."""
    torch.set_num_threads(threads)
    return run_lowered(niceness, lambda: prepare_training(manifest, "cpu"), name="standby-build")


def read_takeover(stream: TextIO) -> bool:
    """Block until the takeover line (True) or end of input or any other line (False)."""
    line = stream.readline()
    return line.strip() == TAKEOVER


def on_device(prepared: PreparedModel, manifest: RunManifest, device: str) -> PreparedModel:
    """The prepared model moved to `device` with a fresh optimizer over the moved parameters."""
    if device == "cpu":
        return prepared
    prepared.model.to(device)
    prepared.optimizer = make_inner_optimizer(
        prepared.model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay
    )
    return prepared


def stand_by(options: NodeOptions, stdin: TextIO, out: TextIO) -> Takeover | None:
    """Prepare, say so on `out`, wait on `stdin`: the takeover, or None when told to leave."""
    prepared = prepare_quietly(options.manifest, options.threads)
    prepare_dht_process_state()
    peer_id_of(options.identity)  # the identity key parsed now: `net.identity` keeps it
    signing_key(options.identity)
    print(READY, file=out, flush=True)
    if not read_takeover(stdin):
        return None
    promoted_at = time.monotonic()
    return Takeover(on_device(prepared, options.manifest, options.device), promoted_at)


def check_standby_args(standby: bool, nproc: int, under_torchrun: bool) -> None:
    """`ConfigError` for the combinations a spare cannot serve."""
    if standby and (nproc > 1 or under_torchrun):
        raise ConfigError(
            "--standby prepares one process; an island learner (--nproc or torchrun) has no hot spare: "
            "drop --standby or run a single process"
        )
