"""Where a peer's memory goes: a census of the large tensors and byte buffers its Python objects hold.

`kill -USR2 PID` on a running `join` writes `STATE_DIR/memory-census.json`: every tensor storage and
bytes-like buffer of at least 1 MiB reachable from Python, with the attribute path that holds it
(`PeerNode.peer.book.log._records[3].payload`, as far as it can be named), grouped and summed by
path, next to the process's resident and proportional set sizes. What the census does not find (the
allocator's free lists, native buffers, memory held by C threads) is the difference between its total
and the process's own memory: the JSON names that gap `unaccounted_bytes`.

A diagnostic for operators and for `scripts/bench_scale.py`; it reads, never changes, the peer's state,
and takes a second or two on a large process (it walks the whole heap).
"""

from __future__ import annotations

import gc
import inspect
import json
import re
import time
import warnings
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch

MIN_BYTES = 1 << 20
PATH_DEPTH = 8


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


def _owners(obj: object, ignore: set[int]) -> list[object]:
    """What refers to `obj`, less the census's own lists (`ignore`, which grows by this one) and frames."""
    referrers = gc.get_referrers(obj)
    ignore.add(id(referrers))
    return [
        r
        for r in referrers
        if id(r) not in ignore and not inspect.isframe(r) and not inspect.iscoroutine(r)
    ]


def _label(holder: object, child: object, ignore: set[int]) -> tuple[str, object | None]:
    """How `holder` names `child`, and the object to climb to next (None to stop)."""
    if isinstance(holder, dict):
        key = next((k for k, v in holder.items() if v is child), "?")
        for owner in _owners(holder, ignore):
            if getattr(owner, "__dict__", None) is holder:
                return f"{type(owner).__name__}.{key}", owner
        return f"[{key!r}]", holder
    if isinstance(holder, (list, tuple, deque)):
        index = next((i for i, v in enumerate(holder) if v is child), "?")
        return f"[{index}]", holder
    attributes = getattr(holder, "__dict__", None)
    if isinstance(attributes, dict):
        for name, value in attributes.items():
            if value is child:
                return f"{type(holder).__name__}.{name}", holder
    if hasattr(type(holder), "__slots__"):
        for name in dir(type(holder)):
            try:
                if getattr(holder, name, None) is child:
                    return f"{type(holder).__name__}.{name}", holder
            except Exception:  # noqa: BLE001 - a property may raise: it just does not name the child
                continue
    return f"<{type(holder).__name__}>", holder


def owner_path(obj: object, ignore: set[int], depth: int = PATH_DEPTH) -> str:
    parts: list[str] = []
    current: object = obj
    visited = {id(obj)}
    for _ in range(depth):
        holders = [h for h in _owners(current, ignore) if id(h) not in visited]
        ignore.add(id(holders))
        if not holders:
            break
        label, nxt = _label(holders[0], current, ignore)
        parts.append(label)
        if nxt is None or id(nxt) in visited:
            break
        visited.add(id(nxt))
        current = nxt
    return ".".join(reversed(parts)) or "<unreferenced>"


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


def census(min_bytes: int = MIN_BYTES) -> dict[str, Any]:
    started = time.monotonic()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch objects warns of deprecations
        warnings.simplefilter("ignore")
        found = _big_objects(min_bytes)
    ignore = {id(found)} | {id(pair) for pair in found}
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, obj in found:
        group = _group(owner_path(obj, ignore))
        groups[group] += size
        counts[group] += 1
    del found
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


def write_census(path: Path) -> None:
    """Write `census()` to `path` (atomically: a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(census(), indent=1))
    tmp.replace(path)
