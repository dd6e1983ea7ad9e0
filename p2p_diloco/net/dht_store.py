"""The project's key-value store over a hivemind DHT: owner-signed, schema-checked expiring records.

`create_dht` starts a `hivemind.DHT` whose p2pd identity and whose `RSASignatureValidator` key are the
same RSA key (an ephemeral one when no identity file is given). A record's subkey is then the writer's
owner tag (``[owner:ssh-rsa ...]``), which hivemind only accepts with a valid signature by that key, and
the owner tag determines the peer ID (`identity.peer_id_of_public_key`). So:

* `DhtKeyValueStore.store(key, subkey=<own peer ID>, ...)` writes under this peer's owner tag;
  a subkey other than the own peer ID is refused (no peer can write under another's ID);
* `DhtKeyValueStore.get` maps owner tags back to plain peer IDs and drops anything without one.

Signatures are checked by hivemind on every store request a node receives and on every record a get
returns. The schema (owner-tag subkey, bytes value of at most `MAX_RECORD_BYTES`, not expired) is
checked by `get` on what it reads, per subkey. It is deliberately not a DHT-level `SchemaValidator`:
hivemind validates a key's subkeys as one dictionary, so a node with the schema drops the *whole* key
as returned by any node that holds one junk subkey, and run-agnostic nodes (the bootstrap) cannot
refuse junk for a run they do not know. Measured: with run peers schema-checking, one unsigned junk
subkey stored by an outsider hid a peer's record from every reader once that peer went offline.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase

from p2p_diloco.net.addresses import parse_listen_addresses, parse_peer_addresses
from p2p_diloco.net.identity import peer_id_of, peer_id_of_public_key, signing_key, write_identity
from p2p_diloco.swarm.interfaces import StoredValue

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 * 1024
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)

_OWNER_TAG_RE = re.compile(b"^" + RSASignatureValidator.PUBLIC_KEY_REGEX + b"$", re.DOTALL)

# reasons `get` drops a subkey (counted in `DhtKeyValueStore.dropped`)
DROP_NO_OWNER = "no owner tag"
DROP_BAD_OWNER = "bad owner key"
DROP_NOT_BYTES = "value not bytes"
DROP_TOO_LARGE = "value too large"
DROP_EXPIRED = "expired"
DROP_NOT_DICT = "not a subkey dictionary"


@dataclass
class DhtPeer:
    """A running DHT node: the hivemind DHT, this peer's ID and the validator that signs its records."""

    dht: hivemind.DHT
    peer_id: str
    signer: RSASignatureValidator
    identity_path: Path | None
    _tempdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def owner_tag(self) -> bytes:
        return self.signer.local_public_key

    def visible_addresses(self, latest: bool = False) -> list[str]:
        """This peer's full multiaddrs (with /p2p/ID) as other peers should dial them."""
        return [str(addr) for addr in self.dht.get_visible_maddrs(latest=latest)]

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None


def create_dht(
    *,
    initial_peers: Sequence[str] = (),
    identity_path: str | Path | None = None,
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Sequence[str] = (),
    client_mode: bool = False,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    extra_validators: Sequence[RecordValidatorBase] = (),
    startup_timeout: float = 30.0,
    **dht_kwargs: Any,
) -> DhtPeer:
    """Start a DHT node whose peer ID and record-signing key come from `identity_path` (ephemeral if None).

    `client_mode=True` for peers that cannot accept connections (they still read and write);
    `use_auto_relay=True` lets a peer behind NAT become reachable through relays (e.g. the bootstrap).
    Raises `ConfigError` for bad addresses or identity files, `ConnectionError` if the node cannot start
    or reach its initial peers.
    """
    initial = parse_peer_addresses(initial_peers, what="--initial-peers")
    hosts = parse_listen_addresses(host_maddrs, what="--listen")
    announce = parse_listen_addresses(announce_maddrs, what="--announce")
    tempdir = None
    if identity_path is None:
        tempdir = tempfile.TemporaryDirectory(prefix="p2p-diloco-id-")
        key_file = Path(tempdir.name) / "ephemeral.key"
        write_identity(key_file)
    else:
        key_file = Path(identity_path)
    expected_peer_id = peer_id_of(key_file)  # ConfigError for a missing or corrupt file
    signer = RSASignatureValidator(signing_key(key_file))
    validators: list[RecordValidatorBase] = [signer, *extra_validators]
    dht = hivemind.DHT(
        initial_peers=initial or None,
        start=False,
        record_validators=validators,
        identity_path=str(key_file.resolve()),
        host_maddrs=hosts,
        announce_maddrs=announce or None,
        client_mode=client_mode,
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        check_if_identity_free=tempdir is None,  # a fresh key cannot be in use elsewhere
        **dht_kwargs,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=startup_timeout)
    except BaseException as exc:
        if dht.is_alive():
            dht.shutdown()
        if tempdir is not None:
            tempdir.cleanup()
        if isinstance(exc, TimeoutError):
            raise ConnectionError(f"DHT node did not start within {startup_timeout:.0f} s") from exc
        if isinstance(exc, Exception):
            peers = ", ".join(initial) or "none"
            raise ConnectionError(f"DHT node failed to start (initial peers: {peers}): {exc}") from exc
        raise
    peer_id = dht.peer_id.to_base58()
    if peer_id != expected_peer_id:  # would break the owner-tag <-> peer ID binding
        dht.shutdown()
        raise RuntimeError(f"p2pd reports peer id {peer_id}, identity file gives {expected_peer_id}")
    if tempdir is not None:
        key_file.unlink()  # p2pd has read it; an ephemeral key never needs to touch disk again
    return DhtPeer(
        dht=dht, peer_id=peer_id, signer=signer, identity_path=None if tempdir else key_file, _tempdir=tempdir
    )


class DhtKeyValueStore:
    """`KeyValueStore` over a hivemind DHT; subkeys are peer IDs, and a peer writes only its own.

    `get` asks the swarm for the freshest copies (``latest=True``) and raises `TimeoutError` if the DHT
    does not answer within `timeout`; `store` returns False then (hivemind's flag reflects only the last
    replica that answered: read back what matters).
    """

    def __init__(self, peer: DhtPeer, *, timeout: float = 10.0, max_value_bytes: int = MAX_RECORD_BYTES):
        self.peer = peer
        self.timeout = timeout
        self.max_value_bytes = max_value_bytes
        self.dropped: Counter[str] = Counter()

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        if subkey != self.peer.peer_id:
            raise ValueError(
                f"subkey must be this peer's ID {self.peer.peer_id} (records are owner-signed), got {subkey!r}"
            )
        if not isinstance(value, bytes):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        if len(value) > self.max_value_bytes:
            raise ValueError(
                f"value of {len(value)} bytes exceeds the {self.max_value_bytes}-byte record limit"
            )
        future = self.peer.dht.store(key, value, expiration, subkey=self.peer.owner_tag, return_future=True)
        try:
            return bool(future.result(timeout=self.timeout))
        except TimeoutError:
            future.cancel()
            log.warning("DHT store of %s timed out after %.1f s", key, self.timeout)
            return False

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        future = self.peer.dht.get(key, latest=True, return_future=True)
        try:
            found = future.result(timeout=self.timeout)
        except TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"DHT get of {key} got no answer within {self.timeout:.1f} s") from exc
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            self.dropped[DROP_NOT_DICT] += 1
            return {}
        out: dict[str, StoredValue] = {}
        for subkey, item in found.value.items():
            peer_id, reason = self._owner_of(subkey)
            if reason is None:
                reason = self._value_problem(item.value, item.expiration_time, now)
            if reason is not None:
                self.dropped[reason] += 1
                continue
            previous = out.get(peer_id)
            if previous is None or item.expiration_time > previous.expiration:
                out[peer_id] = StoredValue(value=item.value, expiration=float(item.expiration_time))
        return out

    @staticmethod
    def _owner_of(subkey: object) -> tuple[str, str | None]:
        if not isinstance(subkey, bytes):
            return "", DROP_NO_OWNER
        match = _OWNER_TAG_RE.match(subkey)
        if match is None:
            return "", DROP_NO_OWNER
        try:
            return peer_id_of_public_key(match.group(1)), None
        except (ValueError, TypeError):
            return "", DROP_BAD_OWNER

    def _value_problem(self, value: object, expiration: float, now: float) -> str | None:
        if not isinstance(value, bytes):
            return DROP_NOT_BYTES
        if len(value) > self.max_value_bytes:
            return DROP_TOO_LARGE
        if expiration <= now:
            return DROP_EXPIRED
        return None
