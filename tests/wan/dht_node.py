"""A DHT peer for the WAN tier, run inside a namespace and driven over stdin/stdout (not a test module).

    python tests/wan/dht_node.py [--initial-peers MA ...] [--listen MA] [--client-mode] [--auto-relay]

Prints ``peer_id ID``, ``address MA`` lines and ``ready``; then answers one line per command:
``store KEY VALUE TTL`` -> ``stored true|false``, ``get KEY`` -> ``got {peer_id: value}``,
``addresses`` -> ``addresses [..]`` (latest visible multiaddrs), ``dial PEER_ID MADDR...`` -> ``dial ok ADDR`` or
``dial failed ERROR`` (connect to a peer at exactly these addresses and echo through its ``wan-echo``
stream handler, which every node serves), ``quit`` (or end of input) stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.dht_store import DhtKeyValueStore, create_dht

ECHO_PROTOCOL = "wan-echo"
DIAL_TIMEOUT = 30.0


async def _echo(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    data = await reader.readexactly(5)
    writer.write(data.upper())
    await writer.drain()
    writer.close()


async def _serve_echo(_dht: Any, node: Any) -> None:
    await node.p2p.add_binary_stream_handler(ECHO_PROTOCOL, _echo)


async def _dial(peer_id: str, maddrs: list[str], _dht: Any, node: Any) -> str:
    """Runs in the DHT process: connect at exactly `maddrs`, then echo over a new stream."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    target = PeerID.from_base58(peer_id)
    try:
        await asyncio.wait_for(node.p2p._client.connect(target, [Multiaddr(a) for a in maddrs]), DIAL_TIMEOUT)
        info, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(target, ECHO_PROTOCOL), DIAL_TIMEOUT
        )
        writer.write(b"hello")
        await writer.drain()
        reply = await asyncio.wait_for(reader.readexactly(5), DIAL_TIMEOUT)
        writer.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"failed {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"ok {info.addr}" if reply == b"HELLO" else f"failed bad echo {reply!r}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--auto-relay", action="store_true")
    parser.add_argument("--trusted-relays", nargs="*", default=[])
    parser.add_argument("--force-reachability", choices=["public", "private"])
    args = parser.parse_args()
    extra = {}
    if args.trusted_relays:
        extra["trusted_relays"] = args.trusted_relays
    if args.force_reachability:
        extra["force_reachability"] = args.force_reachability
    peer = create_dht(
        initial_peers=args.initial_peers,
        host_maddrs=[args.listen],
        client_mode=args.client_mode,
        use_auto_relay=args.auto_relay,
        startup_timeout=60.0,
        **extra,
    )
    kv = DhtKeyValueStore(peer, timeout=20.0)
    peer.dht.run_coroutine(_serve_echo)
    print(f"peer_id {peer.peer_id}")
    for address in peer.visible_addresses():
        print(f"address {address}")
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            if cmd[0] == "store":
                ok = kv.store(cmd[1], peer.peer_id, cmd[2].encode(), get_dht_time() + float(cmd[3]))
                print(f"stored {json.dumps(ok)}", flush=True)
            elif cmd[0] == "get":
                try:
                    found = {pid: item.value.decode() for pid, item in kv.get(cmd[1], get_dht_time()).items()}
                except TimeoutError:
                    found = {}
                print(f"got {json.dumps(found)}", flush=True)
            elif cmd[0] == "dial":
                result = peer.dht.run_coroutine(functools.partial(_dial, cmd[1], cmd[2:]))
                print(f"dial {result}", flush=True)
            elif cmd[0] == "addresses":
                print(f"addresses {json.dumps(peer.visible_addresses(latest=True))}", flush=True)
            else:
                print(f"error unknown command {cmd[0]!r}", flush=True)
    finally:
        peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
