"""Atomic file writes: the one helper behind every file that must never be seen half-written.

`atomic_file(path)` yields a binary file to write; on a clean exit it is flushed, fsynced and renamed
over `path` (``os.replace``: readers see the old file or the new one, never a mix). The temporary file
(``.<name>.tmp<pid>`` in the same folder, so the rename stays on one filesystem) is removed on any
error, leaving `path` as it was. Layer 0: imports nothing from `p2p_diloco`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write `path` atomically: ``with atomic_file(path) as f: f.write(...)`` (or ``torch.save(x, f)``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` atomically (`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)
