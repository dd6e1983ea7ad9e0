"""Atomic file writes: the one helper behind every file that must never be seen half-written.

`atomic_file(path)` yields a binary file to write; on a clean exit it is flushed, fsynced and renamed
over `path` (``os.replace``: readers see the old file or the new one, never a mix). With `mode` the file
gets exactly those permission bits; with ``exclusive=True`` an existing `path` is never replaced
(`FileExistsError`, the new file is dropped). `atomic_path(path)` is the same for writers that take a
path rather than a file (safetensors' `save_file`, transformers' `save_pretrained` into a folder): it
yields the temporary path and renames whatever was written there. The temporary file or folder
(``.<name>.tmp<pid>`` in the same folder, so the rename stays on one filesystem) is removed on any
error, leaving `path` as it was. Layer 0: imports nothing from `p2p_diloco`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, exclusive: bool = False) -> Iterator[Path]:
    """A temporary path beside `path`, renamed over it on a clean exit (a file or a folder).

    A folder can replace only a missing or empty `path`; remove an old folder as the last step inside.
    ``exclusive=True``: `FileExistsError` if `path` exists by then (a file only), nothing replaced.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    _remove(tmp)  # left by an earlier process of the same pid that died while writing
    try:
        yield tmp
        if exclusive:
            os.link(tmp, path)  # fails if someone created `path` meanwhile: never clobber
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


@contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, mode: int | None = None, exclusive: bool = False
) -> Iterator[BinaryIO]:
    """Write `path` atomically: ``with atomic_file(path) as f: f.write(...)`` (or ``torch.save(x, f)``)."""
    with atomic_path(path, exclusive=exclusive) as tmp:
        # created with `mode` already (never readable by others, not even briefly), then set exactly
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(fd, mode)
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` atomically (`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)
