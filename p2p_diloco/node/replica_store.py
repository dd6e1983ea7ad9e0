"""The replica on disk, without pickle: one safetensors file per fragment, written only when it changed.

Layout of ``STATE_DIR/replica/``: ``fragment-00000.safetensors`` ... one per fragment of the plan, each
holding ``theta/<name>`` and ``momentum/<name>`` (float32, little-endian) and, in the safetensors
metadata (strings): ``format`` (`FILE_FORMAT`), ``format_version``, ``fragment``, ``version``,
``checksum`` (`protocol.replica.fragment_checksum` of that fragment) and ``names`` (JSON list, plan order).

Writing (`ReplicaStore.save`): a fragment whose checksum equals the one last written is skipped; a changed
one is streamed from the tensors' memory (no serialized copy of the fragment) to a temporary file in the
same folder, fsynced, renamed over the old file and the folder fsynced. Every fragment file is whole and
self-checking, so a crash between two fragments leaves each fragment at the old or the new version, both
valid (versions are per fragment; the swarm brings the old ones up to date).

Reading (`load_replica`): every file is opened memory-mapped (`safetensors.safe_open`) and checked against
its checksum before it enters the replica; the peak is the replica plus one fragment. A missing, truncated,
foreign or bit-rotten file is refused with a `ReplicaFileError` naming the file and the problem.
`load_replica_salvaging` keeps the good fragments of a folder where some files are damaged: each damaged
fragment starts again from the initial weights at version 0, so the swarm brings only it up to date.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from p2p_diloco.files import atomic_file
from p2p_diloco.protocol.checksum import fragment_checksum
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import GlobalReplica

Fresh = Callable[[int], tuple[Mapping[str, Tensor], Mapping[str, Tensor]]]  # fragment -> (Θ, m) at v0

FILE_FORMAT = "p2p_diloco.replica.fragment"
FILE_FORMAT_VERSION = "2"
THETA, MOMENTUM = "theta/", "momentum/"
_ALIGN = 8  # the data section starts 8-byte aligned (safetensors pads the header with spaces)


class ReplicaFileError(ValueError):
    """A replica folder or file is missing, unreadable, of another format or plan, or corrupt."""


def fragment_file(directory: str | os.PathLike[str], fragment: int) -> Path:
    return Path(directory) / f"fragment-{fragment:05d}.safetensors"


def write_fragment(
    path: Path,
    fragment: int,
    version: int,
    checksum: str,
    names: tuple[str, ...] | list[str],
    params: Mapping[str, Tensor],
    momentum: Mapping[str, Tensor],
) -> None:
    """Write one fragment file atomically (module docstring), streaming each tensor's bytes."""
    tensors = [(THETA + n, params[n]) for n in names] + [(MOMENTUM + n, momentum[n]) for n in names]
    header: dict[str, object] = {
        "__metadata__": {
            "format": FILE_FORMAT,
            "format_version": FILE_FORMAT_VERSION,
            "fragment": str(fragment),
            "version": str(version),
            "checksum": checksum,
            "names": json.dumps(list(names)),
        }
    }
    offset = 0
    for key, t in tensors:
        size = t.numel() * 4
        header[key] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            data = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
            f.write(memoryview(data.numpy()).cast("B"))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_fragment(path: Path, fragment: int, names: tuple[str, ...]) -> tuple[int, dict, dict, str]:
    """(version, Θ, m, checksum) of one fragment file, tensors read through a memory map; the values are
    not yet checked against the checksum (`GlobalReplica.from_fragments` does that)."""
    if not path.exists():
        raise ReplicaFileError(f"replica file {path} does not exist (fragment {fragment})")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FILE_FORMAT:
                raise ReplicaFileError(f"{path} is not a p2p_diloco replica fragment file")
            if meta.get("format_version") != FILE_FORMAT_VERSION:
                raise ReplicaFileError(
                    f"{path} has format version {meta.get('format_version')}, expected {FILE_FORMAT_VERSION}"
                )
            if meta.get("fragment") != str(fragment) or json.loads(meta.get("names", "null")) != list(names):
                raise ReplicaFileError(
                    f"{path} was saved with a different fragment plan; "
                    "it belongs to another model or manifest"
                )
            keys = set(f.keys())
            expected = {THETA + n for n in names} | {MOMENTUM + n for n in names}
            if keys != expected:
                raise ReplicaFileError(f"{path}: holds {len(keys)} tensors, expected {len(expected)}")
            params = {n: f.get_tensor(THETA + n) for n in names}
            momentum = {n: f.get_tensor(MOMENTUM + n) for n in names}
            return int(meta["version"]), params, momentum, str(meta["checksum"])
    except ReplicaFileError:
        raise
    except Exception as exc:  # safetensors raises several types for truncated or foreign files
        raise ReplicaFileError(f"replica file {path} is unreadable: {exc}") from exc


class ReplicaStore:
    """One replica folder: remembers the checksum last written per fragment, so `save` writes only the
    fragments that changed (the first save after a start rewrites every fragment whose file differs)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.saved: dict[int, str] = {}  # fragment -> checksum of the file on disk
        self.writes = 0  # fragment files written so far

    def exists(self) -> bool:
        return fragment_file(self.directory, 0).exists()

    def save(self, replica: GlobalReplica) -> int:
        """Write every fragment that changed since the last save; returns how many were written."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.saved:
            self.saved = self._on_disk(replica.num_fragments)
        written = 0
        for p in range(replica.num_fragments):
            checksum = replica.checksum(p)
            if self.saved.get(p) == checksum:
                continue
            version, params, momentum = replica.fragment_state(p)
            write_fragment(
                fragment_file(self.directory, p),
                p,
                version,
                checksum,
                replica.plan.names(p),
                params,
                momentum,
            )
            self.saved[p] = checksum
            written += 1
        if written:
            _fsync_dir(self.directory)
        self.writes += written
        return written

    def _on_disk(self, count: int) -> dict[int, str]:
        """The checksums recorded in the fragment files already there (unreadable ones are rewritten)."""
        found = {}
        for p in range(count):
            try:
                with safe_open(str(fragment_file(self.directory, p)), framework="pt") as f:
                    found[p] = (f.metadata() or {}).get("checksum", "")
            except Exception:  # noqa: BLE001 - absent or broken: written anew
                continue
        return found

    def load(self, plan: FragmentPlan) -> GlobalReplica:
        replica = load_replica(self.directory, plan)
        self.saved = {p: replica.checksum(p) for p in range(replica.num_fragments)}
        return replica

    def salvage(self, plan: FragmentPlan, fresh: Fresh, bad: Mapping[int, str]) -> GlobalReplica:
        """`load_replica_salvaging`; the fragments of `bad` are rewritten at the next save."""
        replica = load_replica_salvaging(self.directory, plan, fresh, bad)
        self.saved = {p: replica.checksum(p) for p in range(replica.num_fragments) if p not in bad}
        return replica


def save_replica(replica: GlobalReplica, directory: str | os.PathLike[str]) -> int:
    """Write the replica's fragments to `directory` (only those whose file differs); returns the count."""
    return ReplicaStore(directory).save(replica)


def load_replica(directory: str | os.PathLike[str], plan: FragmentPlan) -> GlobalReplica:
    """Read a replica written by `save_replica`; raises `ReplicaFileError` saying what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReplicaFileError(f"replica folder {directory} does not exist")
    extra = sorted(
        f.name
        for f in directory.glob("fragment-*.safetensors")
        if not f.name[9:14].isdigit() or int(f.name[9:14]) >= plan.num_fragments
    )
    if extra:
        raise ReplicaFileError(
            f"{directory} was saved with a different fragment plan ({extra[0]} is not a fragment of "
            f"this plan's {plan.num_fragments}); it belongs to another model or manifest"
        )

    def state(p: int) -> tuple[int, dict, dict, str]:
        return read_fragment(fragment_file(directory, p), p, plan.names(p))

    try:
        return GlobalReplica.from_fragments(plan, state)
    except ReplicaFileError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ReplicaFileError(f"{directory}: a fragment is corrupt: {exc}") from exc


def damaged_fragments(directory: str | os.PathLike[str], plan: FragmentPlan) -> dict[int, str]:
    """Each fragment whose file fails its own checks (`read_fragment`, then `GlobalReplica.from_fragments`
    on that fragment alone), with the reason."""
    bad = {}
    for p in range(plan.num_fragments):
        alone = FragmentPlan((plan.names(p),), (plan.numels[p],) if plan.numels else ())
        try:
            state = read_fragment(fragment_file(directory, p), p, plan.names(p))
            GlobalReplica.from_fragments(alone, lambda _, state=state: state)
        except (ValueError, TypeError, RuntimeError) as exc:  # ReplicaFileError is a ValueError
            bad[p] = str(exc).replace("fragment 0", f"fragment {p}")
    return bad


def load_replica_salvaging(
    directory: str | os.PathLike[str], plan: FragmentPlan, fresh: Fresh, bad: Mapping[int, str]
) -> GlobalReplica:
    """The replica of `directory` with each fragment of `bad` taken from `fresh` at version 0 instead of
    its damaged file (the good fragments keep their versions)."""

    def state(p: int) -> tuple[int, Mapping[str, Tensor], Mapping[str, Tensor], str]:
        if p not in bad:
            return read_fragment(fragment_file(directory, p), p, plan.names(p))
        params, momentum = fresh(p)
        return 0, params, momentum, fragment_checksum(plan.names(p), params, momentum, 0)

    return GlobalReplica.from_fragments(plan, state)
