"""Protocol message records (pure data). Their byte encoding lives in `p2p_diloco.wire.frames`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeltaHeader:
    """Header of one learner's outer delta for one fragment.

    `anchor_version` is the global version of the fragment the learner last adopted; `tokens` and
    `steps` count what it trained since that adoption; `seq` increases with every delta the sender sends.
    `sender` is filled in by the receiver from the authenticated connection, never trusted from the wire.
    """

    run_id: str
    manifest_hash: str
    fragment: int
    anchor_version: int
    tokens: int
    steps: int
    seq: int
    sender: str = ""


@dataclass(frozen=True)
class UpdateRecord:
    """One outer update of one fragment, version `from_version` -> `from_version + 1`.

    `payload` is the merged outer gradient as a `wire.codec` frame (the manifest's codec: int8 by default,
    or sparse top-k); every replica decodes it, applies the Nesterov step itself and compares the result
    with `checksum`.
    """

    run_id: str
    manifest_hash: str
    fragment: int
    from_version: int
    term: int
    leader: str
    contributors: tuple[tuple[str, float], ...]
    checksum: str
    payload: bytes
    signature: bytes = b""  # the leader's, over `wire.frames.update_signing_bytes` (`wire.signing`)

    @property
    def to_version(self) -> int:
        return self.from_version + 1
