"""Where a peer's memory goes: a census of the large tensors and byte buffers its Python objects hold.

`kill -USR2 PID` on a running `join` writes `STATE_DIR/memory-census.json`: every tensor storage and
bytes-like buffer of at least 1 MiB, named by the first path that reaches it breadth first from the
peer node (`node.peer.book.log._records[].payload`; indices and parameter names are dropped, so one
log or one model sums under one path), then from the interrupted frames, then from every module;
what no path reaches is grouped as `<unreached>` by dtype. Next to it, the process's RSS and PSS: the
difference from the census's total (`unaccounted_bytes`) is the runtime's own code and data, the
allocators' free lists and native buffers.

Sizes are storage sizes: `kernels.fresh` reserves one untouched huge page beyond each large tensor
(counted here, not in PSS), and a memoryview over a tensor being served is counted again. A diagnostic
for operators and `scripts/bench_scale.py --census-at`; it only reads the peer's state, holds the
owner of the signal (the training thread) for a second or two, and its own bookkeeping can leave the
Python heap some tens of MB larger.
"""

from __future__ import annotations

import gc
import inspect
import json
import re
import sys
import time
import warnings
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.files import write_atomic

MIN_BYTES = 1 << 20


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # meta, sparse and other storage-less tensors
        return None


def _big_objects(min_bytes: int) -> list[tuple[int, object]]:
    """(bytes, object) of each large tensor storage (once per storage) and bytes-like buffer."""
    found: list[tuple[int, object]] = []
    storages: set[int] = set()
    buffers: set[int] = set()

    def take_buffer(obj: object) -> None:
        size = len(obj) if isinstance(obj, (bytes, bytearray)) else obj.nbytes  # type: ignore[attr-defined]
        if size >= min_bytes and id(obj) not in buffers:
            buffers.add(id(obj))
            found.append((size, obj))

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = _storage(obj)
            if storage is not None and storage[1] >= min_bytes and storage[0] not in storages:
                storages.add(storage[0])
                found.append((storage[1], obj))
            continue
        if isinstance(obj, (bytearray, memoryview)):
            take_buffer(obj)
        for ref in gc.get_referents(obj):  # bytes are not tracked by gc: found through what holds them
            if isinstance(ref, (bytes, bytearray, memoryview)):
                take_buffer(ref)
    return found


def _children(path: str, obj: object) -> list[tuple[str, object]]:
    """The objects `obj` refers to, each with the path that names it."""
    if isinstance(obj, dict):
        # identifier keys read as attributes; others (parameter names, numbers) as indices, which
        # `_group` drops: one model's tensors sum under one path
        return [
            (f"{path}.{k}" if isinstance(k, str) and k.isidentifier() else f"{path}[{k!r:.40}]", v)
            for k, v in obj.items()
        ]
    if isinstance(obj, (list, tuple, deque)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"{path}[*]", v) for v in obj]
    if inspect.isframe(obj):
        out = [(f"{path}<{obj.f_code.co_name}>.{k}", v) for k, v in obj.f_locals.items()]
        return out + ([(f"{path}<{obj.f_code.co_name}>", obj.f_back)] if obj.f_back is not None else [])
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and not inspect.ismodule(obj) and not isinstance(obj, type):
        out = [(f"{path}.{k}", v) for k, v in attributes.items()]
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                out.append((f"{path}.{name}", getattr(obj, name)))
        return out
    if inspect.ismodule(obj):
        return [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return [(f"{path}<{type(r).__name__}>", r) for r in gc.get_referents(obj)]


_LEAVES = (str, int, float, complex, bool, type(None), type, torch.dtype, torch.device)


def _walk(roots: dict[str, object], min_bytes: int) -> tuple[dict[int, tuple[str, int]], set[int]]:
    """Breadth first from each root in turn: the first path to each large tensor storage or buffer.
    Returns {storage or buffer key: (path, bytes)} and the ids of every object visited."""
    found: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    for name, root in roots.items():
        queue: deque[tuple[str, object]] = deque([(name, root)])
        while queue:
            path, obj = queue.popleft()
            if id(obj) in seen or isinstance(obj, _LEAVES):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                storage = _storage(obj)
                if storage is not None and storage[1] >= min_bytes and storage[0] not in found:
                    found[storage[0]] = (path, storage[1])
                if obj.grad is not None:
                    queue.append((f"{path}.grad", obj.grad))
                continue
            if isinstance(obj, (bytes, bytearray, memoryview)):
                size = len(obj) if not isinstance(obj, memoryview) else obj.nbytes
                if size >= min_bytes:
                    found.setdefault(id(obj), (path, size))
                continue
            try:
                queue.extend(_children(path, obj))
            except Exception:  # noqa: BLE001 - an object whose attributes raise is skipped, not fatal
                continue
    return found, seen


def _memory_kib() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss", "Anonymous"):
                out[name.lower()] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _group(path: str) -> str:
    """A path with its indices and dict keys dropped, so the records of one log sum together."""
    return re.sub(r"\[[^\]]*\]", "[]", path)


def census(roots: dict[str, object] | None = None, min_bytes: int = MIN_BYTES) -> dict[str, Any]:
    """Large tensors and buffers by the path that first reaches them from `roots` (then the caller's
    frames, then every module); what none reaches is grouped as `<unreached>` by dtype."""
    started = time.monotonic()
    gc.collect()
    caller = inspect.currentframe()
    everywhere = {**(roots or {}), "frames": caller.f_back if caller else None, "modules": dict(sys.modules)}
    del caller
    with warnings.catch_warnings():  # isinstance() on some torch objects warns of deprecations
        warnings.simplefilter("ignore")
        reached, _ = _walk(everywhere, min_bytes)
        keys = set(reached)
        groups: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for path, size in reached.values():
            groups[_group(path)] += size
            counts[_group(path)] += 1
        for size, obj in _big_objects(min_bytes):
            key = _storage(obj)[0] if isinstance(obj, torch.Tensor) else id(obj)  # type: ignore[index]
            if key in keys:
                continue
            keys.add(key)
            kind = str(obj.dtype) if isinstance(obj, torch.Tensor) else type(obj).__name__
            groups[f"<unreached> {kind}"] += size
            counts[f"<unreached> {kind}"] += 1
    memory = _memory_kib()
    total = sum(groups.values())
    return {
        "total_bytes": total,
        "rss_bytes": memory.get("rss", 0) * 1024,
        "pss_bytes": memory.get("pss", 0) * 1024,
        "unaccounted_bytes": memory.get("pss", 0) * 1024 - total,
        "groups": [
            {"path": path, "bytes": size, "objects": counts[path]} for path, size in groups.most_common()
        ],
        "seconds": round(time.monotonic() - started, 2),
    }


def write_census(path: Path, roots: dict[str, object] | None = None) -> None:
    """Write `census(roots)` to `path` (atomically: a reader never sees half a file)."""
    write_atomic(path, json.dumps(census(roots), indent=1).encode())
