"""Islands: one learner made of several processes (torchrun ranks), data-parallel inside, DiLoCo outside.

`torchrun --nproc-per-node N -m p2p_diloco join MANIFEST ...` (or `p2p-diloco join --nproc N ...`, which
execs exactly that) starts N ranks. They form one learner: every inner step is one DDP step over the N
ranks (gloo on CPU, NCCL on CUDA). Only rank 0 runs a `PeerNode`: it joins the DHT, holds the replica,
sends deltas and may synchronize; its state dir is the island's. Ranks != 0 run `run_follower`, the
inner loop only.

Keeping the ranks identical. DDP keeps parameters equal across optimizer steps; rank 0 alone changes
them outside the optimizer (adoption of a merged update, snapshot loads at start or repair), always
through `Learner.adopt` / `Learner.load_global_into_model`, which `IslandLearner` overrides to mark the
fragment dirty. Before each step rank 0 broadcasts a control tensor ``[command, step, dirty_0..dirty_P-1]``;
every rank then receives a broadcast of each dirty fragment's tensors from rank 0 and compares an exact
checksum of all its parameters with the others' (`params_checksum`, all-gathered); a mismatch marks
every fragment dirty for the next step (self-repair) and is counted. Command STOP (rank 0 stopped
training or is shutting down) ends the followers after that last broadcast; every rank then writes
``island-rank{r}.json`` (step, parameter digest, checks) into the state dir, and each rank writes
``island-rank{r}.pid`` at start (tests and operators find the ranks there).

Counting: one island step is one optimizer step over N local batches. `Learner.step` counts island
steps (the fragment schedule, `--max-steps` and the heartbeat's step use it), while the work counters a
delta carries count every rank: N steps of batch x block tokens each per island step. A delta's
tokens/steps thus stays the manifest's batch x block (what the synchronizer's token-claim check
expects) and its merge weight tokens^2/steps equals that of one learner that made N times the steps.
Data: rank r samples shard r of N of the corpus, with a seed rank 0 draws and broadcasts, so ranks
never share a window.

Failure: a rank that dies breaks the collectives; torchrun then stops the others (its default), rank 0
persists on the way out, and a restarted island rejoins like any learner (replay or snapshot). Followers
ignore SIGTERM/SIGINT (rank 0 decides, and sends STOP) but watch rank 0's pid, shared at start, and
leave at once when it is gone: gloo does not always wake a rank blocked on a dead peer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2p_diloco.errors import ConfigError
from p2p_diloco.files import write_atomic
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.shards import TokenData
from p2p_diloco.model.trainer import make_trainer
from p2p_diloco.node.options import CUDA_TORCH, NodeOptions
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments

log = logging.getLogger(__name__)

CMD_STOP = 0
CMD_TRAIN = 1
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # rank 0 may spend long on catch-up while the others wait
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class IslandEnv:
    """This process's place in a torchrun job (the RANK, WORLD_SIZE, LOCAL_RANK variables)."""

    rank: int
    world_size: int
    local_rank: int


def island_env(environ: Mapping[str, str] = os.environ) -> IslandEnv | None:
    """The torchrun job this process is part of; None outside torchrun or for a job of one rank."""
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    try:
        env = IslandEnv(
            int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", environ["RANK"]))
        )
    except ValueError as exc:
        raise ConfigError(f"torchrun variables RANK/WORLD_SIZE/LOCAL_RANK must be integers: {exc}") from exc
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ConfigError(f"RANK={env.rank} must be in [0, WORLD_SIZE={env.world_size})")
    return env if env.world_size > 1 else None


def check_island_gpus(ranks: int, device_count: int | None = None) -> None:
    """`ConfigError` with the fix unless this machine has a CUDA device for each of `ranks` local ranks
    (rank r takes cuda:r; NCCL refuses two ranks on one device). `device_count`: injected by tests."""
    count = torch.cuda.device_count() if device_count is None else device_count
    if ranks <= count:
        return
    if count == 0:
        raise ConfigError(
            f"--device cuda with {ranks} ranks, but torch sees no CUDA device here: install a CUDA build "
            f"of torch ({CUDA_TORCH}), or run the island on the CPU with --device cpu"
        )
    raise ConfigError(
        f"--device cuda with {ranks} ranks per machine: rank r takes cuda:r, but this machine has {count} "
        f"CUDA device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1}); use --nproc {count} (one rank "
        "per GPU), or --device cpu for an island on the CPU"
    )


def rank_device(device: str, env: IslandEnv, device_count: int | None = None) -> str:
    """The device of this rank: `cuda` means cuda:LOCAL_RANK, which must exist (`check_island_gpus`); a
    fixed cuda:N would put ranks on one GPU."""
    if device == "cuda":
        check_island_gpus(env.local_rank + 1, device_count)
        return f"cuda:{env.local_rank}"
    if device.startswith("cuda:"):
        raise ConfigError(f"--device {device} in an island: use --device cuda (rank r takes cuda:LOCAL_RANK)")
    if device == "mps":
        raise ConfigError("--device mps: islands need gloo (cpu) or NCCL (cuda)")
    return device


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def torchrun_argv(nproc: int, argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The torchrun command that runs `p2p-diloco ARGV` (a `join` command line) on `nproc` local ranks,
    with ``--nproc N`` / ``--nproc=N`` removed from ARGV."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "p2p_diloco",
        *rest,
    ]


def params_checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """An exact, order-sensitive checksum of the tensors' bits (int64 scalar, computed on their device):
    equal on two ranks iff (with overwhelming probability) every bit of every tensor is equal."""
    total: torch.Tensor | None = None
    for index, tensor in enumerate(tensors):
        flat = tensor.detach().contiguous().view(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1 + index
        part = (bits * weights).sum()
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def params_digest(params: Mapping[str, torch.Tensor]) -> str:
    """blake2b of every parameter's bytes in name order (for the digest files; copies to the CPU)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Island:
    """The process group of one island and the collectives of the control protocol (module docstring).

    Every collective marks the island `broken` if it raises (a rank died); a broken island does no
    further collectives.
    """

    def __init__(self, env: IslandEnv, device: str, timeout: timedelta = COLLECTIVE_TIMEOUT):
        self.env = env
        self.device = device
        self.timeout = timeout
        self.broken = False
        self.checks = 0  # parameter comparisons across ranks (one after each broadcast)
        self.mismatches = 0
        self.fragments_broadcast = 0
        self.leader_pid: int | None = None  # rank 0's pid, shared at start (`prepare_island`)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def start(self) -> None:
        """Join the process group (torchrun's env:// rendezvous)."""
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        dist.init_process_group(backend_for(self.device), timeout=self.timeout)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may fail to tear down; the process exits anyway
                log.debug("destroy_process_group failed", exc_info=True)

    def _collective(self, fn, *args, **kwargs):
        if self.broken:
            raise ConnectionError("the island is broken: a rank left")
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.broken = True
            raise

    def share_seed(self, seed: int) -> int:
        """Rank 0's `seed` (a non-negative int below 2**62) on every rank."""
        t = torch.tensor([seed & (2**62 - 1)], dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, t, src=0)
        return int(t.item())

    def one_host(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Every rank on this machine (torchrun --standalone), so rank 0's pid means something here."""
        return int(environ.get("LOCAL_WORLD_SIZE", self.world_size)) == self.world_size

    def wrap(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP over the island; its construction broadcasts rank 0's parameters to every rank. Buffers are
        built identically and not broadcast in forward: ranks may differ in `--micro-batch`."""
        ids = [torch.device(self.device).index] if self.device.startswith("cuda") else None
        return self._collective(DistributedDataParallel, model, device_ids=ids, broadcast_buffers=False)

    def exchange_control(self, command: int, step: int, dirty: Sequence[int], num_fragments: int):
        """Rank 0 sends (command, step, dirty fragments); every rank returns what rank 0 sent."""
        t = torch.zeros(2 + num_fragments, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            t[0], t[1] = command, step
            for p in dirty:
                t[2 + p] = 1
        self._collective(dist.broadcast, t, src=0)
        values = t.tolist()
        return values[0], values[1], [p for p in range(num_fragments) if values[2 + p]]

    def sync_fragments(
        self, params: Mapping[str, torch.Tensor], plan: FragmentPlan, dirty: Sequence[int]
    ) -> bool:
        """Broadcast the dirty fragments from rank 0, then compare all parameters across ranks.
        Returns True when every rank holds the same bits."""
        with torch.no_grad():
            for p in dirty:
                for name in plan.names(p):
                    self._collective(dist.broadcast, params[name].data, src=0)
        self.fragments_broadcast += len(dirty)
        mine = params_checksum(params[name] for name in plan.all_names()).to(self.device).reshape(1)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._collective(dist.all_gather, gathered, mine)
        equal = len({int(t.item()) for t in gathered}) == 1
        self.checks += 1
        if not equal:
            self.mismatches += 1
            log.error(
                "island ranks diverged after broadcasting fragments %s: checksums %s",
                dirty,
                [int(t.item()) for t in gathered],
            )
        return equal

    def write_pid(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / f"island-rank{self.rank}.pid").write_text(f"{os.getpid()}\n")

    def write_digest(self, state_dir: Path, step: int, params: Mapping[str, torch.Tensor]) -> None:
        record = {
            "rank": self.rank,
            "world_size": self.world_size,
            "step": step,
            "digest": params_digest(params),
            "checks": self.checks,
            "mismatches": self.mismatches,
            "fragments_broadcast": self.fragments_broadcast,
        }
        path = state_dir / f"island-rank{self.rank}.json"
        write_atomic(path, (json.dumps(record) + "\n").encode())


def prepare_island(options: NodeOptions) -> tuple[NodeOptions, Island | None]:
    """Inside a torchrun job of several ranks: this rank's options (its device) and the started
    `Island`; outside one: the options unchanged and None."""
    env = island_env()
    if env is None:
        return options, None
    options = replace(options, device=rank_device(options.device, env))
    island = Island(env, options.device)
    island.start()
    island.write_pid(options.state_dir)
    island.leader_pid = island.share_seed(os.getpid())
    return options, island


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for torchrun to reap it counts as exited)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except ProcessLookupError:
        return True
    except OSError:  # no /proc (not Linux) or no permission: alive as far as we can tell
        return False
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def watch_leader(pid: int, period: float = 0.5) -> threading.Thread:
    """Exit this process (status 1) as soon as rank 0 is gone: a follower blocked in a collective with
    a dead rank 0 is not always woken by gloo, and torchrun would only SIGKILL it 30 s later."""

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(period)
        print(f"island: rank 0 (pid {pid}) is gone; leaving", file=sys.stderr, flush=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="island-leader-watch", daemon=True)
    thread.start()
    return thread


def run_follower(options: NodeOptions, island: Island) -> int:
    """A rank != 0: the inner loop only, in lock-step with rank 0 (module docstring). Returns 0 after
    rank 0's STOP; a dead peer rank raises out of the collective (torchrun then stops the island)."""
    stop_asked = False

    def on_stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stop_asked  # rank 0 decides when the island stops; we follow its STOP
        stop_asked = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # meant for rank 0 (finish training)
    if island.leader_pid is not None and island.one_host():
        watch_leader(island.leader_pid)
    manifest = options.manifest
    torch.set_num_threads(options.threads)
    corpus = load_corpus(manifest.data)
    model = build_model(manifest.model).to(options.device)
    params = dict(model.named_parameters())
    plan = plan_fragments(
        [(name, tuple(p.shape)) for name, p in params.items()],
        manifest.diloco.fragments,
        manifest.diloco.fragment_pattern,
    )
    optimizer = make_inner_optimizer(model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay)
    sampler = island_sampler(corpus.train, options, island, island.share_seed(0))
    ddp = island.wrap(model)
    trainer = make_trainer(
        manifest, ddp, optimizer, sampler, micro_batch=options.micro_batch, device=options.device
    )
    step = 0
    try:
        while True:
            command, step, dirty = island.exchange_control(CMD_TRAIN, 0, (), plan.num_fragments)
            if dirty:
                island.sync_fragments(params, plan, dirty)
            if command == CMD_STOP:
                break
            trainer.step()  # the same step as rank 0's learner (model/trainer.py)
    finally:
        island.write_digest(options.state_dir, step, params)
        island.close()
    print(
        f"island rank {island.rank}: stopped by rank 0 at step {step}"
        f"{' (after a stop signal)' if stop_asked else ''}",
        flush=True,
    )
    return 0


def island_sampler(
    data: torch.Tensor | TokenData, options: NodeOptions, island: Island, seed: int
) -> BatchSampler:
    """Rank r's sampler: shard r of `world_size`, seeded by rank 0's `seed` (shared by the island)."""
    manifest = options.manifest
    return BatchSampler(
        data,
        block_size=manifest.model.block_size,
        batch_size=manifest.diloco.batch_size,
        shard=island.rank,
        num_shards=island.world_size,
        seed=seed,
    )
