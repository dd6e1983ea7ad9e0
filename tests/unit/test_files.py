"""`p2p_diloco.files`: atomic writes replace the file whole or leave it as it was, with no temporary left."""

from __future__ import annotations

import pytest

from p2p_diloco.files import atomic_file, write_atomic


def test_write_atomic_creates_and_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, b"one")
    assert path.read_bytes() == b"one"
    with atomic_file(str(path)) as f:
        f.write(b"tw")
        f.write(b"o")
    assert path.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_error_while_writing_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "replica.pt"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError, match="disk"), atomic_file(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica.pt"]
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "never.pt"):
        raise RuntimeError("before any byte")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica.pt"]
