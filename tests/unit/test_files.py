"""`p2p_diloco.files`: atomic writes replace the file whole or leave it as it was, with no temporary left."""

from __future__ import annotations

import pytest

from p2p_diloco.files import atomic_file, atomic_path, write_atomic


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


def test_a_private_file_has_exactly_its_mode_and_an_exclusive_write_never_replaces(tmp_path):
    path = tmp_path / "peer.key"
    with atomic_file(path, mode=0o600, exclusive=True) as f:
        f.write(b"secret")
    assert path.read_bytes() == b"secret" and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError), atomic_file(path, mode=0o600, exclusive=True) as f:
        f.write(b"another")
    assert path.read_bytes() == b"secret"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.key"]


def test_atomic_path_renames_a_written_folder_and_removes_it_on_error(tmp_path):
    out = tmp_path / "model"
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        assert not out.exists()
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(RuntimeError, match="tokenizer"), atomic_path(tmp_path / "other") as tmp:
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("no tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
