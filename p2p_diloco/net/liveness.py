"""Is a peer's process there? Plain TCP connects to its announced addresses, and libp2p's dial errors.

Only a refused connection proves the process is gone (nobody listens on its port); a frozen process's
kernel still accepts connections and a lost link times out, so neither is "down". The probe does not go
through libp2p: after one failed dial libp2p answers "dial backoff" for a while, whatever the cause.
`swarm.election.succession` acts on the result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from p2p_diloco.wire.interfaces import Liveness

PROBE_TIMEOUT = 1.0
# libp2p's dial error when an address refused the connection: nobody listens there, the process is gone.
# A timeout (frozen process, lost link) proves nothing, so a mix of refusals and timeouts is not "down".
_REFUSED = "connection refused"


async def _probe_endpoint(host: str, port: int) -> Liveness:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT)
    except ConnectionRefusedError:
        return Liveness.DOWN
    except (TimeoutError, OSError):
        return Liveness.UNKNOWN
    writer.close()
    return Liveness.ALIVE


async def probe_endpoints(endpoints: Sequence[tuple[str, int]]) -> Liveness:
    seen = set(await asyncio.gather(*(_probe_endpoint(host, port) for host, port in endpoints)))
    if Liveness.ALIVE in seen:
        return Liveness.ALIVE
    return Liveness.DOWN if seen == {Liveness.DOWN} else Liveness.UNKNOWN


def refused(exc: BaseException) -> bool:
    """Whether a failed call's error says the peer's address refused the connection (and nothing timed
    out): its process is gone. The text is the libp2p daemon's. After one failed dial libp2p answers "dial
    backoff" for a while, whatever the cause: `probe` does not depend on this text."""
    text = str(exc).lower()
    return _REFUSED in text and "timeout" not in text and "timed out" not in text
