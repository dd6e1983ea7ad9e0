"""Downloading one fragment's snapshot: its index from several sources, then its chunks spread over the
sources that announced the most common index, each chunk checked on arrival (`swarm.snapshots`
`ChunkedDownload`). `Repair` decides what to download and whether to install it (vouching, checksum).
"""

from __future__ import annotations

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.effects import FetchChunks, FetchSnapshots, Task
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.snapshots import ChunkedDownload
from p2p_diloco.swarm.updates import UpdateBook
from p2p_diloco.wire.snapshot_chunks import SnapshotIndex, chunk_layout, decode_index

Downloaded = tuple[SnapshotIndex, dict, dict]  # the index, Θ and m of one fragment
SNAPSHOT_BYTES_PER_PARAM = 8  # a snapshot holds Θ and m in fp32
MAX_INDEX_BYTES = 64 * 1024 * 1024


def download_windows(sizes: dict[int, int], budget: int) -> list[list[int]]:
    """The fragments (`sizes`: parameters per fragment) in groups to download side by side, in order: as
    many as fit `budget` bytes of Θ and m, at least one per group."""
    windows: list[list[int]] = []
    window_bytes = 0
    for p in sorted(sizes):
        need = SNAPSHOT_BYTES_PER_PARAM * sizes[p]
        if not windows or window_bytes + need > budget:
            windows.append([])
            window_bytes = 0
        windows[-1].append(p)
        window_bytes += need
    return windows


class SnapshotDownloader:
    def __init__(self, manifest: RunManifest, replica: GlobalReplica, book: UpdateBook, journal: Journal):
        self.manifest = manifest
        self.replica = replica
        self.book = book
        self.journal = journal

    def read_index(self, fragment: int, source: str, result: object) -> SnapshotIndex | None:
        """One source's index answer, checked (run, manifest, fragment, layout); None if unusable (noted,
        a malformed one counted against the source)."""
        try:
            if isinstance(result, BaseException):
                raise result
            index = decode_index(result, max_bytes=MAX_INDEX_BYTES)
            bad = self.book.check_record(index.run_id, index.manifest_hash, index.fragment)
            if bad or index.fragment != fragment:
                raise DecodeError(
                    bad[0] if bad else "wrong fragment", f"snapshot index of fragment {fragment}"
                )
            if len(chunk_layout(self.replica.shapes(fragment), index.chunk_bytes)) != index.count:
                raise DecodeError("bad index", f"{index.count} chunks do not fit fragment {fragment}")
            return index
        except DecodeError as exc:
            self.journal.reject(source, exc.reason, "snapshot index")
            self.journal.note(f"snapshot of fragment {fragment} from {source} failed: {exc}")
        except (ConnectionError, TimeoutError) as exc:
            self.journal.note(f"snapshot of fragment {fragment} from {source} failed: {exc}")
        return None

    def download(self, fragment: int, sources: list[str]) -> Task:
        """A checked download of `fragment` (`Downloaded`: index, Θ, m) and the bytes each source sent, from
        up to `[limits] snapshot_sources` of `sources` at once, or None. The sources announcing the most
        common index (ties: the first source's) share the chunks; a source that fails or sends a bad chunk
        is dropped and its chunks go to the others. The whole is checked against the index's checksum by
        `_install`."""
        limits = self.manifest.limits
        sources = list(dict.fromkeys(sources))[: limits.snapshot_sources]
        if not sources:
            return None
        answers = yield FetchSnapshots(tuple((fragment, source) for source in sources))
        groups: dict[SnapshotIndex, list[str]] = {}
        for source, result in zip(sources, answers):
            index = self.read_index(fragment, source, result)
            if index is not None:
                groups.setdefault(index, []).append(source)
        if not groups:
            return None
        index, group = max(groups.items(), key=lambda item: len(item[1]))  # first of the largest
        download = ChunkedDownload(
            index, self.replica.shapes(fragment), group, in_flight=limits.snapshot_chunks_in_flight
        )
        while not download.done:
            wanted = download.requests()
            if not wanted:
                self.journal.note(
                    f"snapshot of fragment {fragment}: every source failed ({download.failed}); "
                    f"{len(download.missing)} of {index.count} chunks missing"
                )
                return None
            fetches = tuple(
                (source, fragment, n, index.checksum, download.expected_bytes(n)) for source, n in wanted
            )
            results = yield FetchChunks(fetches)
            for (source, n), result in zip(wanted, results):
                if source not in download.sources:
                    download.release(source, n)
                elif isinstance(result, BaseException):
                    self.journal.note(f"chunk {n} of fragment {fragment} from {source} failed: {result}")
                    download.strike(source, n, str(result)[:200])
                elif (bad := download.accept(source, n, result)) is not None:
                    self.journal.reject(source, bad[0], f"snapshot of fragment {fragment}: {bad[1]}")
                    download.fail(source, bad[0])
        return (index, download.params, download.momentum), {
            s: b for s, b in download.bytes_from.items() if b
        }
