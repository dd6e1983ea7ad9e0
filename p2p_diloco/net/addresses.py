"""Parsing of user-given multiaddrs and peer IDs, with errors that name the bad part.

`multiaddr` (the PyPI package) does the final parse; a component-wise pre-check first gives messages
such as ``invalid IPv4 address '1.2.3'`` instead of the library's generic ones. Everything handed to
hivemind is `str(addr)`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import base58
import multiaddr
import multihash

from p2p_diloco.errors import ConfigError

EXAMPLE_ADDRESS = "/ip4/203.0.113.7/tcp/31337"
EXAMPLE_PEER_ADDRESS = "/ip4/203.0.113.7/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

# protocols whose component carries a value, and those that stand alone
_VALUED = {"ip4", "ip6", "tcp", "udp", "p2p", "ipfs", "dns", "dns4", "dns6", "dnsaddr", "ip6zone", "sni"}
_BARE = {"quic", "quic-v1", "webtransport", "ws", "wss", "tls", "noise", "p2p-circuit", "http", "https"}


def parse_peer_id(text: str, *, what: str = "peer id") -> str:
    """Validate a base58 libp2p peer ID (``Qm...`` or ``12D3KooW...``) and return it unchanged."""
    reason = _peer_id_problem(text)
    if reason:
        raise ConfigError(
            f"{what}: {text!r} is not a valid peer id: {reason}; peer ids look like Qm... or 12D3KooW..."
        )
    return text


def _peer_id_problem(text: str) -> str | None:
    if not text:
        return "it is empty"
    try:
        raw = base58.b58decode(text)
    except ValueError as exc:
        return f"not base58 ({exc})"
    try:
        multihash.decode(raw)
    except (ValueError, TypeError) as exc:
        return f"not a multihash ({exc})"
    return None


def _component_problem(proto: str, value: str | None) -> str | None:
    """Why one `/proto/value` component is invalid, or None if the pre-check finds nothing."""
    if proto == "ip4":
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            return f"invalid IPv4 address {value!r}"
    elif proto == "ip6":
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            return f"invalid IPv6 address {value!r}"
    elif proto in ("tcp", "udp"):
        if not (value or "").isdigit() or not 0 <= int(value or "-1") <= 65535:
            return f"invalid {proto} port {value!r} (expected 0-65535)"
    elif proto in ("p2p", "ipfs"):
        reason = _peer_id_problem(value or "")
        if reason:
            return f"invalid peer id {value!r} after /{proto}: {reason}"
    elif proto in ("dns", "dns4", "dns6", "dnsaddr"):
        if not value or any(c in value for c in " /"):
            return f"invalid host name {value!r} after /{proto}"
    return None


def _precheck(text: str) -> str | None:
    if not text:
        return "it is empty"
    if not text.startswith("/"):
        return "it must start with '/'"
    parts = text.split("/")[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]  # a trailing slash is harmless
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto in _VALUED:
            if i + 1 >= len(parts) or parts[i + 1] == "":
                return f"missing value after /{proto}"
            problem = _component_problem(proto, parts[i + 1])
            if problem:
                return problem
            i += 2
        elif proto in _BARE:
            i += 1
        elif proto == "":
            return "empty component ('//')"
        else:
            return None  # unknown to the pre-check: let the multiaddr package decide
    return None


def parse_multiaddr(text: str, *, what: str, example: str = EXAMPLE_ADDRESS) -> multiaddr.Multiaddr:
    """Parse `text` as a multiaddr; `ConfigError` naming `what`, the bad part and a good example."""
    if not isinstance(text, str):
        raise ConfigError(f"{what}: expected a multiaddr string, got {type(text).__name__}")
    text = text.strip()
    problem = _precheck(text)
    if problem is None:
        try:
            return multiaddr.Multiaddr(text)
        except (ValueError, multiaddr.exceptions.Error) as exc:
            problem = _library_reason(exc)
    raise ConfigError(
        f"{what}: {text!r} is not a valid multiaddr: {problem}; expected something like {example}"
    )


def _library_reason(exc: Exception) -> str:
    message = str(exc)
    if ": " in message and message.startswith("Invalid MultiAddr"):
        message = message.split(": ", 1)[1]
    return message.split(" (string:", 1)[0]


def parse_peer_address(text: str, *, what: str) -> multiaddr.Multiaddr:
    """A full peer address ending in ``/p2p/<peer id>`` (what `--initial-peers` needs)."""
    addr = parse_multiaddr(text, what=what, example=EXAMPLE_PEER_ADDRESS)
    names = [p.name for p in addr.protocols()]
    if "p2p" not in names and "ipfs" not in names:
        raise ConfigError(
            f"{what}: {text.strip()!r} has no /p2p/<peer id> part; a peer address names the peer, "
            f"e.g. {EXAMPLE_PEER_ADDRESS} (copy the `bootstrap address:` line the bootstrap printed)"
        )
    return addr


def peer_id_in(addr: multiaddr.Multiaddr) -> str:
    """The peer ID in the last /p2p/ component of `addr` (`ValueError` if there is none)."""
    for proto in ("p2p", "ipfs"):
        try:
            return addr.value_for_protocol(proto)
        except (multiaddr.exceptions.ProtocolLookupError, ValueError):
            continue
    raise ValueError(f"{addr} has no /p2p/ component")


def parse_peer_addresses(texts: Iterable[str], *, what: str) -> list[str]:
    """Validate several peer addresses and return them as strings ready for hivemind."""
    return [str(parse_peer_address(text, what=what)) for text in texts]


def parse_listen_addresses(texts: Iterable[str], *, what: str) -> list[str]:
    """Validate listen/announce addresses (no /p2p/ part) and return them as strings for hivemind."""
    out = []
    for text in texts:
        addr = parse_multiaddr(text, what=what)
        if any(p.name in ("p2p", "ipfs") for p in addr.protocols()):
            raise ConfigError(f"{what}: {text!r} must not contain /p2p/<peer id>; e.g. {EXAMPLE_ADDRESS}")
        out.append(str(addr))
    return out


def tcp_endpoints(texts: Iterable[str]) -> list[tuple[str, int]]:
    """(host, port) of the plain TCP addresses among `texts` (``/ip4|ip6/HOST/tcp/PORT[/p2p/ID]``); relayed,
    QUIC, websocket and unparsable ones are skipped."""
    out = []
    for text in texts:
        try:
            addr = multiaddr.Multiaddr(text)
            names = [p.name for p in addr.protocols()]
        except Exception:  # noqa: BLE001 - a heartbeat's self-reported address: skip what does not parse
            continue
        if names[:2] not in (["ip4", "tcp"], ["ip6", "tcp"]) or names[2:] not in ([], ["p2p"]):
            continue
        host = addr.value_for_protocol(multiaddr.protocols.protocol_with_name(names[0]).code)
        port = int(addr.value_for_protocol(multiaddr.protocols.P_TCP))
        out.append((host, port))
    return out
