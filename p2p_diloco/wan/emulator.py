"""The WAN emulator: peers in network namespaces behind one router, with per-link delay, rate and NAT.

Topology (every name starts with the run's unique prefix, e.g. ``pdw3fa2c1``)::

    <prefix>-<peer>  --veth-->  <prefix>-router <--veth-- <prefix>-<nat peer>-gw --veth-- <prefix>-<nat peer>
      10.0.i.2/24            10.0.i.1 ... 10.0.k.1           10.0.k.2 | 192.168.k.1       192.168.k.2

* **Delay**: the router routes every packet between peer subnets into a TUN device; the forwarder
  (`wan.forwarder`, a process in the router namespace) holds it for the sender's uplink plus the
  receiver's downlink one-way delay and writes it back, and the router forwards it to the receiver's
  veth. RTT between peers i and j is ``up_i + down_j + up_j + down_i`` (``2 (d_i + d_j)`` for
  symmetric links): a "100 ms RTT" between equal peers is ``delay_ms = 25`` on each link.
* **Rate**: a `tbf` qdisc on the peer's (or its NAT gateway's) uplink veth and on the router's veth
  towards it (this kernel has no netem; tbf works: FINDINGS.md).
* **NAT**: a ``nat=True`` peer sits behind a gateway namespace that MASQUERADEs its outbound traffic and
  drops inbound connections; the router has no route to the private subnet, so the peer can only dial out.

Only namespaces this emulator created carry traffic; nothing is connected to the host's network.
Teardown (idempotent) kills every process inside the run's namespaces and deletes them; it runs from
`teardown()`, the context manager, at interpreter exit, and on SIGTERM/SIGINT. A registry record in
`REGISTRY_DIR` names the owning process, so `cleanup_stale()` (and ``scripts/wan_emulator.py cleanup``)
can remove what a SIGKILLed owner left behind.

This module owns `WanEmulator` (one run: build, shape, describe, tear down); specs, address plan and
host checks are `wan.spec`, cleanup and teardown at exit `wan.cleanup`, all re-exported here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from p2p_diloco.files import write_atomic
from p2p_diloco.wan.cleanup import LIVE, cleanup, install_handlers, pid_alive, start_ticks
from p2p_diloco.wan.cleanup import cleanup_stale as cleanup_stale
from p2p_diloco.wan.cleanup import list_namespaces as list_namespaces
from p2p_diloco.wan.cleanup import namespace_pids as namespace_pids
from p2p_diloco.wan.forwarder import READY_LINE, ForwarderConfig
from p2p_diloco.wan.spec import (
    FAMILY,
    MAX_PEERS,
    PRIVATE_NET,
    PUBLIC_NET,
    REGISTRY_DIR,
    EmulatorError,
    LinkSpec,
    PeerSpec,
    nat_problem,
    new_prefix,
    run_cmd,
)
from p2p_diloco.wan.spec import KILL_GRACE_S as KILL_GRACE_S
from p2p_diloco.wan.spec import environment_problem as environment_problem


class WanEmulator:
    """Set up with `start()` (or ``with WanEmulator(peers) as wan:``), run commands in peers' namespaces."""

    def __init__(
        self,
        peers: Sequence[PeerSpec],
        *,
        prefix: str | None = None,
        mtu: int = 1500,
        owner_pid: int | None = None,
        handle_signals: bool = True,
    ):
        names = [p.name for p in peers]
        if len(set(names)) != len(names) or not 1 <= len(names) <= MAX_PEERS:
            raise ValueError(f"need 1..{MAX_PEERS} peers with distinct names, got {names}")
        self.peers: dict[str, PeerSpec] = {p.name: p for p in peers}
        self.index = {name: i + 1 for i, name in enumerate(names)}
        self.prefix = prefix or new_prefix()
        if not self.prefix.startswith(FAMILY) or len(self.prefix) > 10:
            raise ValueError(f"prefix must start with {FAMILY!r} and have at most 10 chars: {self.prefix!r}")
        self.mtu = mtu
        self.owner_pid = owner_pid or os.getpid()
        self.handle_signals = handle_signals
        self.router = f"{self.prefix}-router"
        self.forwarder: subprocess.Popen[str] | None = None
        self.processes: list[subprocess.Popen[Any]] = []
        self._forwarder_pid: int | None = None
        self._started = False
        self._torn_down = False
        self._lock = threading.Lock()

    # ---- names and addresses ----

    def namespace(self, peer: str) -> str:
        """The namespace an application of `peer` runs in (the private host for a NAT peer)."""
        self._check(peer)
        return f"{self.prefix}-{peer}"

    def gateway_namespace(self, peer: str) -> str:
        self._check(peer)
        return f"{self.prefix}-{peer}-gw"

    def address(self, peer: str) -> str:
        """The IPv4 address of `peer`'s own interface (private, unroutable from others, for NAT peers)."""
        i = self.index[peer]
        return f"{PRIVATE_NET}.{i}.2" if self.peers[peer].nat else f"{PUBLIC_NET}.{i}.2"

    def public_address(self, peer: str) -> str:
        """Where `peer`'s traffic appears to come from (its NAT gateway's address for a NAT peer)."""
        return f"{PUBLIC_NET}.{self.index[peer]}.2"

    def namespaces(self) -> list[str]:
        out = [self.router]
        for name, spec in self.peers.items():
            out.append(self.namespace(name))
            if spec.nat:
                out.append(self.gateway_namespace(name))
        return out

    def _check(self, peer: str) -> None:
        if peer not in self.peers:
            raise KeyError(f"no peer {peer!r} in this emulator (peers: {sorted(self.peers)})")

    def _ifname(self, kind: str, i: int) -> str:
        return f"{self.prefix}{kind}{i}"

    @property
    def tun_name(self) -> str:
        return f"{self.prefix}tun"

    @property
    def _registry_file(self) -> Path:
        return REGISTRY_DIR / f"{self.prefix}.json"

    @property
    def _forwarder_config_file(self) -> Path:
        return REGISTRY_DIR / f"{self.prefix}.forwarder.json"

    # ---- running things in namespaces ----

    def command(self, peer: str, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run in `peer`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(peer), *argv]

    def spawn(self, peer: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in `peer`'s namespace (own session); it is killed at teardown."""
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(peer, argv), **popen_kwargs)
        self.processes.append(proc)
        return proc

    def _ns_sh(self, namespace: str, script: str) -> None:
        run_cmd(["ip", "netns", "exec", namespace, "sh", "-ec", script])

    # ---- lifecycle ----

    def start(self) -> WanEmulator:
        if self._started:
            raise RuntimeError("emulator already started")
        if any(spec.nat for spec in self.peers.values()) and (problem := nat_problem()):
            raise EmulatorError(problem)
        self._started = True
        if self.handle_signals:
            install_handlers()
        LIVE.append(self)
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        self._write_record()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        self._write_record()
        return self

    def _write_record(self) -> None:
        record = {
            "prefix": self.prefix,
            "owner_pid": self.owner_pid,
            "owner_start": start_ticks(self.owner_pid),
            "forwarder_pid": self.forwarder.pid if self.forwarder else self._forwarder_pid,
            "mtu": self.mtu,
            "namespaces": self.namespaces(),
            "peers": [{"name": s.name, "nat": s.nat, **asdict(s.link)} for s in self.peers.values()],
        }
        write_atomic(self._registry_file, json.dumps(record, indent=1).encode())

    def detach(self) -> None:
        """Leave the emulation running after this process exits; the forwarder becomes its owner."""
        if self.forwarder is None:
            raise RuntimeError("not started")
        self.owner_pid = self.forwarder.pid
        self._write_record()
        if self in LIVE:
            LIVE.remove(self)
        self._torn_down = True  # this object no longer tears it down; `cleanup(prefix)` does

    @classmethod
    def attach(cls, prefix: str) -> WanEmulator:
        """An emulator object for a running (e.g. detached) run, for `shape` and `command`."""
        file = REGISTRY_DIR / f"{prefix}.json"
        try:
            record = json.loads(file.read_text())
        except OSError as exc:
            raise EmulatorError(
                f"no running emulation with prefix {prefix!r} ({file}: {exc.strerror})"
            ) from exc
        peers = [
            PeerSpec(p["name"], LinkSpec(p["delay_ms"], p["rate_mbit"], p["queue_ms"]), p["nat"])
            for p in record["peers"]
        ]
        emulator = cls(
            peers, prefix=prefix, mtu=record["mtu"], owner_pid=record["owner_pid"], handle_signals=False
        )
        emulator._started = emulator._torn_down = True  # attached: never tears down on its own
        emulator._forwarder_pid = record["forwarder_pid"]
        return emulator

    def _build(self) -> None:
        for ns in self.namespaces():
            run_cmd(["ip", "netns", "add", ns])
            self._ns_sh(
                ns,
                "ip link set lo up; echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6;"
                " echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
            )
        r = self.router
        self._ns_sh(
            r,
            "echo 1 > /proc/sys/net/ipv4/ip_forward; echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter;"
            " echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter",
        )
        run_cmd(["ip", "-n", r, "tuntap", "add", "dev", self.tun_name, "mode", "tun"])
        run_cmd(["ip", "-n", r, "link", "set", self.tun_name, "mtu", str(self.mtu), "up"])
        # delivered packets back from the TUN go by the main table; everything else between peers into it
        run_cmd(["ip", "-n", r, "rule", "add", "pref", "100", "iif", self.tun_name, "lookup", "main"])
        run_cmd(["ip", "-n", r, "rule", "add", "pref", "200", "to", f"{PUBLIC_NET}.0.0/16", "lookup", "100"])
        run_cmd(["ip", "-n", r, "route", "add", f"{PUBLIC_NET}.0.0/16", "dev", self.tun_name, "table", "100"])
        for name, spec in self.peers.items():
            i = self.index[name]
            edge = self.gateway_namespace(name) if spec.nat else self.namespace(name)
            self._veth(edge, self._ifname("u", i), r, self._ifname("d", i))
            run_cmd(["ip", "-n", edge, "addr", "add", f"{PUBLIC_NET}.{i}.2/24", "dev", self._ifname("u", i)])
            run_cmd(["ip", "-n", r, "addr", "add", f"{PUBLIC_NET}.{i}.1/24", "dev", self._ifname("d", i)])
            run_cmd(["ip", "-n", edge, "route", "add", "default", "via", f"{PUBLIC_NET}.{i}.1"])
            if spec.nat:
                self._build_nat(name, i)
            self._apply_rate(name)
        self._ns_sh(r, f"echo 0 > /proc/sys/net/ipv4/conf/{self.tun_name}/rp_filter")
        self._write_forwarder_config()
        self._start_forwarder()

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        run_cmd(
            ["ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b]
        )
        for ns, ifname in ((ns_a, if_a), (ns_b, if_b)):
            run_cmd(["ip", "-n", ns, "link", "set", ifname, "mtu", str(self.mtu), "up"])

    def _build_nat(self, name: str, i: int) -> None:
        gw, host = self.gateway_namespace(name), self.namespace(name)
        up, lan_gw, lan_host = self._ifname("u", i), self._ifname("g", i), self._ifname("h", i)
        self._veth(gw, lan_gw, host, lan_host)
        run_cmd(["ip", "-n", gw, "addr", "add", f"{PRIVATE_NET}.{i}.1/24", "dev", lan_gw])
        run_cmd(["ip", "-n", host, "addr", "add", f"{PRIVATE_NET}.{i}.2/24", "dev", lan_host])
        run_cmd(["ip", "-n", host, "route", "add", "default", "via", f"{PRIVATE_NET}.{i}.1"])
        self._ns_sh(
            gw,
            "echo 1 > /proc/sys/net/ipv4/ip_forward;"
            f" iptables -t nat -A POSTROUTING -o {up} -j MASQUERADE;"
            f" iptables -A FORWARD -i {up} -o {lan_gw} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT;"
            f" iptables -A FORWARD -i {up} -j DROP;"
            f" iptables -A INPUT -i {up} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT;"
            f" iptables -A INPUT -i {up} -j DROP",
        )

    def _apply_rate(self, name: str) -> None:
        spec, i = self.peers[name], self.index[name]
        edge = self.gateway_namespace(name) if spec.nat else self.namespace(name)
        for ns, ifname in ((edge, self._ifname("u", i)), (self.router, self._ifname("d", i))):
            run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", ifname, "root"], check=False)
            if spec.link.rate_mbit is None:
                continue
            rate_bytes = spec.link.rate_mbit * 1e6 / 8
            burst = max(32 * 1024, int(rate_bytes / 100))  # >= rate/HZ for any HZ <= 100... 1000
            limit = int(rate_bytes * spec.link.queue_ms / 1000) + burst
            shaping = ["rate", f"{spec.link.rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]
            run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "tbf", *shaping])

    def _write_forwarder_config(self) -> None:
        uplink, downlink = {}, {}
        for name, spec in self.peers.items():
            subnet = f"{PUBLIC_NET}.{self.index[name]}"
            uplink[subnet] = downlink[subnet] = spec.link.delay_ms / 1000.0
        config = ForwarderConfig(uplink_s=uplink, downlink_s=downlink)
        write_atomic(self._forwarder_config_file, config.to_json().encode())

    def _start_forwarder(self) -> None:
        forwarder = ["--tun", self.tun_name, "--config", str(self._forwarder_config_file)]
        argv = [
            "ip",
            "netns",
            "exec",
            self.router,
            sys.executable,
            "-m",
            "p2p_diloco.wan.forwarder",
            *forwarder,
        ]
        log_file = REGISTRY_DIR / f"{self.prefix}.forwarder.log"
        with open(log_file, "w") as log:
            self.forwarder = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
            )
        assert self.forwarder.stdout is not None
        line = self.forwarder.stdout.readline().strip()  # blocks until ready or exit
        if line != READY_LINE:
            raise EmulatorError(f"forwarder did not start: {line!r} {log_file.read_text().strip()}")
        self.forwarder.stdout.close()  # nothing more comes; a detached forwarder must not hit a dead pipe

    def shape(
        self, peer: str, *, delay_ms: float | None = None, rate_mbit: float | None | str = "keep"
    ) -> None:
        """Change `peer`'s link: a new one-way delay and/or rate (None removes the rate limit)."""
        spec = self.peers[peer]
        link = spec.link
        if delay_ms is not None:
            link = replace(link, delay_ms=delay_ms)
        if rate_mbit != "keep":
            link = replace(link, rate_mbit=rate_mbit)  # type: ignore[arg-type]
        self.peers[peer] = replace(spec, link=link)
        self._apply_rate(peer)
        self._write_forwarder_config()
        self._write_record()
        pid = self.forwarder.pid if self.forwarder is not None else self._forwarder_pid
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGHUP)

    def link_counters(self, peer: str) -> dict[str, int]:
        """Bytes on `peer`'s access link since it was created: ``sent`` (uplink) and ``received`` (downlink).

        Everything that crossed the link counts (IP headers, TCP, TLS, DHT traffic, retransmissions).
        """
        i = self.index[peer]
        edge = self.gateway_namespace(peer) if self.peers[peer].nat else self.namespace(peer)
        out = run_cmd(["ip", "-n", edge, "-j", "-s", "link", "show", "dev", self._ifname("u", i)]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"sent": int(stats["tx"]["bytes"]), "received": int(stats["rx"]["bytes"])}

    def describe_peer(self, peer: str) -> dict[str, Any]:
        spec = self.peers[peer]
        return {
            "namespace": self.namespace(peer),
            "address": self.address(peer),
            "public_address": self.public_address(peer),
            "nat": spec.nat,
            "delay_ms": spec.link.delay_ms,
            "rate_mbit": spec.link.rate_mbit,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "router": self.router,
            "forwarder_pid": self.forwarder.pid if self.forwarder else self._forwarder_pid,
            "peers": {name: self.describe_peer(name) for name in self.peers},
        }

    def teardown(self) -> None:
        """Kill this run's processes, delete its namespaces and registry files; safe to call twice."""
        with self._lock:
            if self._torn_down or not self._started:
                return
            self._torn_down = True
        for proc in [*self.processes, *([self.forwarder] if self.forwarder else [])]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        cleanup(self.prefix)
        if self in LIVE:
            LIVE.remove(self)

    def __enter__(self) -> WanEmulator:
        return self.start() if not self._started else self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()
