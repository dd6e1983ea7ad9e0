"""hivemind DHT (real p2pd) across emulated 100 ms RTT links, and a peer behind NAT joining through the
bootstrap node acting as relay.

One topology for the module: ``boot``, ``a``, ``b`` and ``c`` public, ``n`` behind a MASQUERADE NAT;
every access link has 25 ms one-way delay, so any two peers are 100 ms apart. ``boot`` runs the real
``p2p-diloco bootstrap``; the others run ``tests/wan/dht_node.py`` (`create_dht`, owner-signed records).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2p_diloco.wan import LinkSpec, PeerSpec, WanEmulator, nat_problem

pytestmark = [pytest.mark.wan, pytest.mark.slow, pytest.mark.soak]

DHT_NODE = str(Path(__file__).resolve().parent / "dht_node.py")
ONE_WAY_MS = 25.0
RTT_S = 4 * ONE_WAY_MS / 1000.0
START_TIMEOUT = 90.0
RECORD_TTL = 300


@dataclass
class Swarm:
    wan: WanEmulator
    bootstrap: str  # the bootstrap's multiaddr
    nodes: dict  # name -> NsProcess of a running dht_node.py
    peer_ids: dict
    spawn: object

    def start_node(self, name: str, *extra: str):
        argv = [sys.executable, DHT_NODE, "--initial-peers", self.bootstrap, *extra]
        node = self.spawn(self.wan, name, argv, name=f"dht-{name}")
        self.peer_ids[name] = node.next_line("peer_id ", START_TIMEOUT).split()[1]
        node.next_line("ready", START_TIMEOUT)
        self.nodes[name] = node
        return node


@pytest.fixture(scope="module")
def swarm(module_make_wan, module_ns_spawn) -> Swarm:
    peers = [PeerSpec(name, LinkSpec(ONE_WAY_MS)) for name in ("boot", "a", "b", "c")]
    nat_ok = nat_problem() is None
    if nat_ok:
        peers.append(PeerSpec("n", LinkSpec(ONE_WAY_MS), nat=True))
    wan = module_make_wan(peers)
    listen = f"/ip4/{wan.address('boot')}/tcp/31337"
    boot = module_ns_spawn(
        wan, "boot", [sys.executable, "-m", "p2p_diloco", "bootstrap", "--listen", listen], name="boot"
    )
    address = boot.next_line("bootstrap address: ", START_TIMEOUT).removeprefix("bootstrap address: ")
    return Swarm(wan=wan, bootstrap=address, nodes={}, peer_ids={}, spawn=module_ns_spawn)


def _get(node, key: str) -> dict[str, str]:
    return json.loads(node.ask(f"get {key}", "got "))


def test_signed_records_across_100ms_links(swarm, wait_for):
    for name in ("a", "b"):
        swarm.start_node(name)
    for name in ("a", "b"):
        assert swarm.nodes[name].ask(f"store wan-records value-{name} {RECORD_TTL}", "stored ") == "true"
    expected = {swarm.peer_ids["a"]: "value-a", swarm.peer_ids["b"]: "value-b"}
    for name in ("a", "b"):
        wait_for(
            lambda name=name: _get(swarm.nodes[name], "wan-records") == expected, 30, f"{name} reads both"
        )
    started = time.monotonic()
    _get(swarm.nodes["a"], "wan-records")
    # a fresh (latest=True) lookup asks remote peers: at least one emulated round trip
    assert time.monotonic() - started >= RTT_S * 0.9


@pytest.mark.skipif(nat_problem() is not None, reason=f"NAT emulation: {nat_problem()}")
def test_nat_peer_joins_through_bootstrap_relay(swarm, wait_for):
    if "a" not in swarm.nodes:
        swarm.start_node("a")
    nat = swarm.start_node(
        "n",
        "--client-mode",
        "--auto-relay",
        "--trusted-relays",
        swarm.bootstrap,
        "--force-reachability",
        "private",
    )
    nat_id = swarm.peer_ids["n"]
    assert nat.ask(f"store wan-nat from-nat {RECORD_TTL}", "stored ") == "true"
    assert swarm.nodes["a"].ask(f"store wan-nat from-a {RECORD_TTL}", "stored ") == "true"
    expected = {nat_id: "from-nat", swarm.peer_ids["a"]: "from-a"}
    wait_for(lambda: _get(nat, "wan-nat") == expected, 30, "the NAT peer reads both records")
    wait_for(lambda: _get(swarm.nodes["a"], "wan-nat") == expected, 30, "a reads the NAT peer's record")

    # n announces only private addresses (nobody can dial those: test_emulator), yet c, which has never
    # talked to n, reaches it through the bootstrap's relay circuit once n holds a relay reservation
    announced = [line.split(" ", 1)[1] for line in nat.lines if line.startswith("address ")]
    assert announced and all("/ip4/192.168." in a or "/ip4/127." in a for a in announced), announced
    c = swarm.start_node("c")
    circuit = f"{swarm.bootstrap}/p2p-circuit/p2p/{nat_id}"
    replies: list[str] = []

    def relayed_dial() -> bool:
        replies.append(c.ask(f"dial {nat_id} {circuit}", "dial "))
        return replies[-1].startswith("ok")

    wait_for(relayed_dial, 90, "a relayed dial from c to n", 1.0)
    # the stream runs over the relay circuit, or over a direct connection hole-punched through it (DCUtR)
    via = replies[-1].split(" ", 1)[1]
    assert "/p2p-circuit" in via or via.startswith(f"/ip4/{swarm.wan.public_address('n')}/"), replies
