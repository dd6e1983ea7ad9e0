"""`ByteCounter`: payload bytes a peer sends and receives through its transport (demo accounting)."""

from __future__ import annotations

import concurrent.futures


class ByteCounter:
    """Counts frame bytes this peer sends and receives over the transport (deltas, updates, fetches and
    what it serves); calls to itself and DHT traffic are not counted. Read by the progress events."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.sent = 0
        self.received = 0

    def _count(self, other: str, sent: int = 0, received: int = 0) -> None:
        if other != self.peer_id:
            self.sent += sent
            self.received += received

    def counting_transport(self, inner):  # noqa: ANN001, ANN201 - same interface as `inner`
        counter = self

        class Counting:
            def __getattr__(self, name: str):  # noqa: ANN204
                return getattr(inner, name)

            def send_delta(self, to_peer: str, frame: bytes, on_reply=None) -> None:  # noqa: ANN001
                counter._count(to_peer, sent=len(frame))
                inner.send_delta(to_peer, frame, on_reply)

            def push_update(self, to_peer: str, frame: bytes, on_reply=None) -> None:  # noqa: ANN001
                counter._count(to_peer, sent=len(frame))
                inner.push_update(to_peer, frame, on_reply)

            def request_updates(self, from_peer: str, fragment: int, after_version: int):  # noqa: ANN202
                future = inner.request_updates(from_peer, fragment, after_version)
                counter._on_done(
                    future, lambda frames: counter._count(from_peer, received=sum(map(len, frames)))
                )
                return future

            def request_snapshot(self, from_peer: str, fragment: int):  # noqa: ANN202
                future = inner.request_snapshot(from_peer, fragment)
                counter._on_done(future, lambda frame: counter._count(from_peer, received=len(frame)))
                return future

            def request_chunk(self, from_peer: str, *args):  # noqa: ANN002, ANN202
                future = inner.request_chunk(from_peer, *args)
                counter._on_done(future, lambda data: counter._count(from_peer, received=len(data)))
                return future

        return Counting()

    @staticmethod
    def _on_done(value, count) -> None:  # noqa: ANN001
        """Count a result now, or when its future settles (a failed fetch counts nothing)."""
        if not isinstance(value, concurrent.futures.Future):
            count(value)
            return
        value.add_done_callback(lambda f: None if f.cancelled() or f.exception() else count(f.result()))

    def counting_handlers(self, inner):  # noqa: ANN001, ANN201 - same interface as `inner`
        counter = self

        class Counting:
            def __getattr__(self, name: str):  # noqa: ANN204
                return getattr(inner, name)

            def handle_delta(self, sender: str, frame: bytes):  # noqa: ANN202
                counter._count(sender, received=len(frame))
                return inner.handle_delta(sender, frame)

            def handle_update(self, sender: str, frame: bytes):  # noqa: ANN202
                counter._count(sender, received=len(frame))
                return inner.handle_update(sender, frame)

            def serve_updates(self, requester: str, fragment: int, after_version: int):  # noqa: ANN202
                frames = inner.serve_updates(requester, fragment, after_version)
                counter._on_done(frames, lambda got: counter._count(requester, sent=sum(map(len, got))))
                return frames

            def serve_snapshot(self, requester: str, fragment: int):  # noqa: ANN202
                frame = inner.serve_snapshot(requester, fragment)
                counter._on_done(frame, lambda got: counter._count(requester, sent=len(got)))
                return frame

            def serve_chunk(self, requester: str, *args):  # noqa: ANN002, ANN202
                data = inner.serve_chunk(requester, *args)
                counter._count(requester, sent=len(data))
                return data

        return Counting()
