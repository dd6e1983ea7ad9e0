"""What the installed package carries for its user: the example manifests, usable by name.

A wheel user has no ``peers/`` folder; ``p2p-diloco join demo ...`` (or ``demo.toml``) names the packaged
``p2p_diloco/peers/demo.toml`` whenever no file of that name is in the working directory.
"""

from __future__ import annotations

from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent / "peers"


def packaged_manifests() -> list[str]:
    """Names of the manifests shipped with the package (``demo``, ``llama-tiny``, ``public``)."""
    return sorted(p.stem for p in PEERS_DIR.glob("*.toml"))


def packaged_manifest(name: str) -> Path | None:
    """The packaged manifest called `name` (with or without ``.toml``), None if there is none."""
    stem = name.removesuffix(".toml")
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    path = PEERS_DIR / f"{stem}.toml"
    return path if path.is_file() else None


def resolve_manifest(text: str) -> str:
    """`text` itself when it names an existing file (or is no packaged name), else the packaged manifest."""
    if Path(text).expanduser().exists():
        return text
    path = packaged_manifest(text)
    return str(path) if path is not None else text


def missing_manifest_hint(path: str | Path) -> str:
    """The message for a manifest path that does not exist."""
    names = ", ".join(packaged_manifests())
    return (
        f"manifest {path} does not exist; give the path of the run's .toml file "
        "(the organizer publishes it), "
        f"or the name of a packaged example ({names}), e.g. `p2p-diloco join demo ...`"
    )
