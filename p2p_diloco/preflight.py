"""Checks of a command line before a command starts anything: each mistake a `ConfigError` (exit status 2)
that says what is wrong and how to fix it, within a second instead of a daemon's error after 20 s.

* a manifest named like a packaged one (``demo``, ``llama-tiny``, ``public``) is the packaged file;
* a manifest swallowed by ``--initial-peers`` (which takes every word after it) or left out;
* ``join`` without ``--identity`` (the hint names ``keygen``), ``--state-dir`` naming a file;
* a TCP/UDP port to listen on that another process holds (a second ``bootstrap`` on the same port would
  otherwise start: p2pd sets SO_REUSEPORT), ``dashboard --port`` and ``--metrics-port`` in use;
* ``--initial-peers`` none of which accepts a TCP connection (`check_reachable`).

`given_fields(cls, args)` takes the flags whose name is an options dataclass's field as they are, so a
command translates by hand only the ones it parses or derives.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import errno
import os
import re
import socket
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import tcp_endpoints
from p2p_diloco.packaged import PEERS_DIR, packaged_manifest, resolve_manifest

# commands whose `manifest` positional comes with a `--initial-peers` that may swallow it
MANIFEST_POSITIONAL = ("join", "status", "dashboard", "export", "baseline-worker", "model-digest", "doctor")
OPTIONAL_MANIFEST = ("doctor",)  # checks the machine without one (a manifest swallowed is still refused)
NEEDS_IDENTITY = ("join", "baseline-worker")
PROBE_TIMEOUT = 3.0  # seconds a TCP connection to one initial peer may take
_MULTIADDR_START = re.compile(r"^/(ip4|ip6|dns|dns4|dns6|dnsaddr|p2p|ipfs)/")
_UDP = re.compile(r"^/(ip4|ip6)/([^/]+)/udp/(\d+)(/|$)")


def check_arguments(args: argparse.Namespace) -> None:
    """Rewrite packaged manifest names to their files and refuse the mistakes the module doc lists."""
    command = args.command
    for name in ("manifest",):
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, resolve_manifest(value))
            note_packaged_example(getattr(args, name))
    if command in MANIFEST_POSITIONAL and getattr(args, "manifest", "") is None:
        peers = getattr(args, "initial_peers", None) or []
        if command not in OPTIONAL_MANIFEST or any(not_an_address(p) for p in peers):
            raise ConfigError(missing_manifest(command, peers))
    if command in NEEDS_IDENTITY and not getattr(args, "identity", None):
        raise ConfigError(
            "--identity KEY is missing: it is the private key that fixes your peer ID. Create one once with "
            "`p2p-diloco keygen --out me.key` and pass --identity me.key (keep it: the same key and "
            "--state-dir let a restart pick up where it left off)"
        )
    state_dir = getattr(args, "state_dir", None)
    if state_dir:
        check_state_dir(state_dir)
    if command in ("join", "bootstrap") and not getattr(args, "standby", False):  # a spare's peer holds it
        default = None if command == "join" else ("/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1")
        check_listen_free(getattr(args, "listen", None) or default or (), what="--listen")
    if command == "join" and getattr(args, "metrics_port", 0):
        check_port_free(args.metrics_host, args.metrics_port, what="--metrics-port", flag="--metrics-port")
    if command == "dashboard":
        check_port_free(args.host, args.port, what=f"--port {args.port}", flag="--port")
    if command in ("status", "dashboard", "bootstrap") and getattr(args, "initial_peers", None):
        check_reachable(args.initial_peers)  # `join` checks in `node.join` (its manifest's list too)


def note_packaged_example(path: str) -> None:
    """One line for an unsigned packaged example (``demo``), instead of the organizer's warning that
    `load_run_manifest` prints for unsigned manifests, which tells how to sign the file (here, inside
    site-packages: nothing for a volunteer to do)."""
    from p2p_diloco.net import manifest_signature

    resolved = Path(path).resolve()
    if resolved.parent != PEERS_DIR or manifest_signature.has_warned(resolved) or not resolved.is_file():
        return
    if tomllib.loads(resolved.read_text()).get("trust", {}).get("authority"):
        return  # a signed example is verified, not warned about
    manifest_signature.mark_warned(resolved)  # load_run_manifest's own warning: once per process and file
    if os.environ.get("RANK", "0") == "0":  # island ranks other than 0: their rank 0 says it
        print(
            f"note: {resolved.stem} is a packaged example manifest, unsigned: fine for trying p2p-diloco, "
            "not for a run open to strangers (those use a signed manifest from their organizer)",
            file=sys.stderr,
            flush=True,
        )


def not_an_address(word: str) -> bool:
    """Whether `word` given to --initial-peers is rather a manifest (a file, a .toml, a packaged name)."""
    if word.endswith(".toml") or Path(word).is_file() or packaged_manifest(word) is not None:
        return True
    return not _MULTIADDR_START.match(word)


def missing_manifest(command: str, initial_peers: Sequence[str]) -> str:
    """The message for a `command` whose manifest argument is missing (swallowed or left out)."""
    swallowed = [p for p in initial_peers if not_an_address(p)]
    if swallowed:
        word = swallowed[0]
        return (
            f"{word!r} was read as an --initial-peers address, so {command} has no manifest: --initial-peers "
            f"takes every word after it. Put the manifest first (p2p-diloco {command} {word} --initial-peers "
            f"ADDR ...), or end the addresses with -- ({command} --initial-peers ADDR -- {word}), or write "
            "--initial-peers=ADDR once per address"
        )
    return (
        "the run manifest is missing: give the path of the run's .toml file, or a packaged example by name "
        f"(p2p-diloco {command} demo ...)"
    )


def check_state_dir(path: str) -> None:
    """`ConfigError` if `path` is a file or lies under a file."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"--state-dir {path} is a file, not a directory; give a directory (it is created if missing), "
            f"e.g. --state-dir {p.with_name(p.name + '-state')}"
        )
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--state-dir {path}: {parent} is a file; give a path under a directory")
            break


def check_port_free(host: str, port: int, *, what: str, flag: str, kind: int = socket.SOCK_STREAM) -> None:
    """`ConfigError` if `host:port` cannot be bound because another process holds it (0: any port)."""
    if not 0 < port <= 65535:  # 0: any free port; out of range: the command's own check says so
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as probe:
        if kind == socket.SOCK_STREAM:  # connections in TIME_WAIT do not hold a port; a listener does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                proto = "UDP" if kind == socket.SOCK_DGRAM else "TCP"
                raise ConfigError(
                    f"{what}: {proto} port {port} on {host} is already in use by another process (another "
                    f"bootstrap, join or server on this machine?); stop it, or choose a free port with "
                    f"{flag} (e.g. port {port + 1}, or 0 for any free port)"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"{what}: {host} is not an address of this machine; listen on 0.0.0.0 (every interface) "
                    "or one of this machine's addresses, and announce the public one with --announce"
                ) from None
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    f"{what}: port {port} needs privileges here; choose a port above 1023 with {flag}"
                ) from None


def check_listen_free(addresses: Iterable[str], *, what: str) -> None:
    """`check_port_free` for every TCP and UDP (QUIC) listen address with a fixed port."""
    addresses = list(addresses)
    for host, port in tcp_endpoints(addresses):
        check_port_free(host, port, what=f"{what} /ip4/{host}/tcp/{port}", flag=what)
    for text in addresses:
        match = _UDP.match(text)
        if match and int(match.group(3)):
            host, port = match.group(2), int(match.group(3))
            check_port_free(host, port, what=f"{what} {text}", flag=what, kind=socket.SOCK_DGRAM)


def _connect(host: str, port: int, timeout: float) -> str | None:
    """None if a TCP connection to host:port opens, else the reason in words."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:.0f} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def unreachable(addresses: Sequence[str], *, timeout: float = PROBE_TIMEOUT) -> dict[str, str] | None:
    """For peer addresses of which none opens a TCP connection: each address's reason; None when one
    answers or none is a plain TCP address (QUIC or relayed ones are not probed)."""
    probes = {a: tcp_endpoints([a]) for a in addresses}
    probes = {a: e[0] for a, e in probes.items() if e}
    if not probes or len(probes) < len(addresses):
        return None
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(probes))) as pool:
        futures = {a: pool.submit(_connect, host, port, timeout) for a, (host, port) in probes.items()}
        reasons = {a: f.result() for a, f in futures.items()}
    if any(reason is None for reason in reasons.values()):
        return None
    return {a: str(r) for a, r in reasons.items()}


def check_reachable(addresses: Sequence[str], *, what: str = "--initial-peers") -> None:
    """`ConfigError` when none of `addresses` accepts a TCP connection, naming each one's reason."""
    reasons = unreachable(addresses)
    if reasons:
        lines = "; ".join(f"{a}: {r}" for a, r in reasons.items())
        raise ConfigError(
            f"none of {what} answers ({lines}). Check the address (copy the whole `bootstrap address:` line "
            "the bootstrap node printed, /ip4/HOST/tcp/PORT/p2p/Qm...), that the node runs, and that no "
            "firewall blocks the port"
        )


def identity_taken(exc: BaseException) -> bool:
    """Whether a DHT start failed because a live peer uses the same identity (hivemind's check)."""
    return "already taken by another peer" in str(exc)


def explain_start_failure(exc: BaseException, identity: str | Path | None) -> str:
    """A DHT start failure (`ConnectionError`) in words a volunteer can act on, the daemon's text after."""
    text = str(exc)
    if identity_taken(exc):
        return (
            f"the key {identity} is already used by a live peer (another join or bootstrap with this "
            "--identity, on this machine or elsewhere): stop that process, or give this peer its own key "
            f"(p2p-diloco keygen --out peer2.key, then --identity peer2.key). [{text}]"
        )
    if "failed to connect to bootstrap peers" in text or "did not start within" in text:
        return (
            "no initial peer accepted a connection. Check the address: the whole `bootstrap address:` line "
            "the node printed, /ip4/HOST/tcp/PORT/p2p/Qm..., where a wrong peer ID after /p2p/ is refused "
            f"even though the port answers; and check that the node runs. [{text}]"
        )
    return text


def given_fields(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of the dataclass `cls` that `args` carries under the same name (a flag ``--max-steps``
    fills ``max_steps``), as parsed: the one translation of those flags."""
    values = vars(args)
    return {field.name: values[field.name] for field in dataclasses.fields(cls) if field.name in values}
