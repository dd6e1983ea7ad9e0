"""Run-authority helpers for tests: RSA identity key files (generated once per session, then copied) and
public manifests that name one as their `[trust]` authority."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.net.identity import KEY_FILE_MODE, peer_id_of, write_identity

_KEYS: dict[str, bytes] = {}  # name -> key file bytes: RSA keygen takes ~0.1 s, a copy nothing


@dataclass(frozen=True)
class KeyFile:
    path: Path
    peer_id: str


def key_file(folder: Path, name: str = "org") -> KeyFile:
    """`folder/NAME.key`: the session's key called `name` (the same peer ID in every test)."""
    path = Path(folder) / f"{name}.key"
    if name not in _KEYS:
        write_identity(path)
        _KEYS[name] = path.read_bytes()
    else:
        path.write_bytes(_KEYS[name])
        os.chmod(path, KEY_FILE_MODE)
    return KeyFile(path, peer_id_of(path))


def public_manifest_text(
    authority: str,
    *,
    run_id: str = "public-test",
    bootstrap: tuple[str, ...] = (),
    data: str = 'source = "builtin"',
) -> str:
    """A small public manifest: `authority` is its authority and only synchronizer; `data` the body of
    its `[data]` table."""
    addresses = ", ".join(f'"{a}"' for a in bootstrap)
    return (
        f'run_id = "{run_id}"\n'
        f"bootstrap = [{addresses}]\n\n"
        f'[trust]\nauthority = "{authority}"\nsynchronizers = ["{authority}"]\n\n'
        "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nblock_size = 8\n\n"
        f"[data]\n{data}\n"
    )


def write_public_manifest(folder: Path, authority: str, name: str = "run.toml", **kwargs) -> Path:  # noqa: ANN003
    """`folder/NAME`: `public_manifest_text(authority, **kwargs)`, not signed."""
    path = Path(folder) / name
    path.write_text(public_manifest_text(authority, **kwargs))
    return path
