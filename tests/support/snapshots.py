"""Fetching a fragment's state from a live peer the way a newcomer does (index, then checked chunks), for
tests that need a peer's exact Θ_p and m_p."""

from __future__ import annotations

import torch

from p2p_diloco.wire.snapshot_chunks import THETA, chunk_digest, chunk_layout, decode_index


def fetch_fragment_state(
    transport, peer: str, fragment: int, shapes: dict, timeout: float = 60.0, tries: int = 5
):  # noqa: ANN001, ANN201
    """(version, checksum, Θ_p, m_p) of `peer`'s fragment over `transport` (`request_snapshot`/`request_chunk`).

    A live peer's state moves on while its chunks are fetched; once the state it announced is no longer
    pinned, its chunks are refused: the whole fetch starts again from a fresh index (`tries` times)."""
    for attempt in range(tries):
        try:
            return _fetch_once(transport, peer, fragment, shapes, timeout)
        except ConnectionError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _fetch_once(transport, peer: str, fragment: int, shapes: dict, timeout: float):  # noqa: ANN001, ANN202
    index = decode_index(transport.request_snapshot(peer, fragment).result(timeout=timeout))
    params = {n: torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
    momentum = {n: torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
    for number, chunk in enumerate(chunk_layout(shapes, index.chunk_bytes)):
        data = transport.request_chunk(peer, fragment, number, index.checksum, chunk.nbytes).result(
            timeout=timeout
        )
        assert len(data) == chunk.nbytes and chunk_digest(data) == index.digests[number]
        target = (params if chunk.part == THETA else momentum)[chunk.name].view(-1)
        target[chunk.start : chunk.start + chunk.count] = torch.frombuffer(
            bytearray(data), dtype=torch.float32
        )
    return index.version, index.checksum, params, momentum
