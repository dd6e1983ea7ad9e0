"""The project's key-value store over a hivemind DHT: owner-signed, schema-checked expiring records.

`create_dht` starts a `hivemind.DHT` whose p2pd identity and whose `RSASignatureValidator` key are the
same RSA key (an ephemeral one when no identity file is given). A record's subkey is then the writer's
owner tag (``[owner:ssh-rsa ...]``), which hivemind only accepts with a valid signature by that key, and
the owner tag determines the peer ID (`identity.peer_id_of_public_key`). So:

* `DhtKeyValueStore.store(key, subkey=<own peer ID>, ...)` writes under this peer's owner tag;
  a subkey other than the own peer ID is refused (no peer can write under another's ID);
* `DhtKeyValueStore.get` maps owner tags back to plain peer IDs and drops anything without one; with a
  `net.admission.RecordAdmission` it also ignores records of peers the run does not allow and keeps at
  most `max_subkeys` per key (a flood of identities costs a reader bounded work and state).

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
from hivemind.utils import MPFuture

from p2p_diloco.net.addresses import parse_listen_addresses, parse_peer_addresses
from p2p_diloco.net.admission import DROP_EXCESS, DROP_NOT_ADMITTED, RecordAdmission
from p2p_diloco.net.identity import peer_id_of, peer_id_of_public_key, signing_key, write_identity
from p2p_diloco.net.lifeline import dies_with_parent
from p2p_diloco.wire.interfaces import StoredValue

log = logging.getLogger(__name__)

# hivemind hands every call to its DHT process over a multiprocessing pipe that uvloop made non-blocking:
# a message over 16384 bytes goes as two writes, the process can read the first and hit EAGAIN on the
# second, and from then on it reads the stream out of step and dies (EOFError). A value of at most 12 KiB
# keeps the whole pickled call (key, owner tag, expiration, future) under that size.
MAX_RECORD_BYTES = 12 * 1024
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
EXIT_DHT_DIED = 3  # exit status of a `join` or `bootstrap` whose hivemind DHT process died under it
DHT_SHUTDOWN_TIMEOUT = 3.0  # hivemind's default grace period before it terminates the DHT process

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

    def alive(self) -> bool:
        """Whether hivemind's DHT process still runs (it can die on its own; then every call times out)."""
        return self.dht.is_alive()

    def visible_addresses(self, latest: bool = False) -> list[str]:
        """This peer's full multiaddrs (with /p2p/ID) as other peers should dial them."""
        return [str(addr) for addr in self.dht.get_visible_maddrs(latest=latest)]

    def shutdown(self, timeout: float = DHT_SHUTDOWN_TIMEOUT) -> None:
        """Stop the DHT process; it is gone (killed if need be) within about `timeout` + 2 seconds."""
        _stop_dht(self.dht, timeout)
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None


def identity_check_needed(key_peer_id: str, *, previous_peer_id: str | None, holds_state_dir: bool) -> bool:
    """Whether hivemind must check that the identity `key_peer_id` is not in use by a live peer.

    hivemind's check (`P2P.is_identity_taken`) starts a whole extra anonymous p2pd, bootstraps it and
    dials the peer ID: on a loaded machine that costs seconds of every restart. It is skipped only
    when we know who used the key last: this process holds the exclusive lock of a state directory
    (`holds_state_dir`) whose ``peer_state.json`` says this same peer ID ran from it before
    (`previous_peer_id`). Then the previous user of the key was our own predecessor on this host,
    and it is gone: a live predecessor, or the DHT child it forked (which inherits the lock), would
    still hold the lock. A key whose state directory has no record of it (a fresh state directory,
    or one that another key wrote) is still checked, so a key copied to a second machine while its
    first peer runs gets hivemind's clear error. Not covered: copying a key *and* its state directory
    to another machine while the original still runs, which this rule treats as a restart.
    """
    return not (holds_state_dir and previous_peer_id is not None and previous_peer_id == key_peer_id)


class PendingDht:
    """A DHT node whose process is starting (`start_dht`); `wait` returns the running `DhtPeer`.

    Between `start_dht` and `wait` the caller may do unrelated work (build its model) while p2pd
    starts and bootstraps in the DHT process; `abort` stops the node if that work fails.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        signer: RSASignatureValidator,
        key_file: Path,
        expected_peer_id: str,
        initial: Sequence[str],
        startup_timeout: float,
        tempdir: tempfile.TemporaryDirectory[str] | None,
    ):
        self.dht = dht
        self.signer = signer
        self.key_file = key_file
        self.expected_peer_id = expected_peer_id
        self.initial = list(initial)
        self.startup_timeout = startup_timeout
        self._tempdir = tempdir

    @property
    def peer_id(self) -> str:
        """The peer ID the node will have (known from the key before the node is up)."""
        return self.expected_peer_id

    def wait(self) -> DhtPeer:
        """The running node; `ConnectionError` if it failed or is not up `startup_timeout` seconds after
        this call (counted from here, not from `start_dht`: a slow model build must not eat the DHT's
        time; a node that came up meanwhile returns at once)."""
        dht, tempdir = self.dht, self._tempdir
        try:
            dht.wait_until_ready(timeout=self.startup_timeout)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, TimeoutError):
                raise ConnectionError(f"DHT node did not start within {self.startup_timeout:.0f} s") from exc
            if isinstance(exc, Exception):
                peers = ", ".join(self.initial) or "none"
                raise ConnectionError(f"DHT node failed to start (initial peers: {peers}): {exc}") from exc
            raise
        peer_id = dht.peer_id.to_base58()
        if peer_id != self.expected_peer_id:  # would break the owner-tag <-> peer ID binding
            self.abort()
            raise RuntimeError(f"p2pd reports peer id {peer_id}, identity file gives {self.expected_peer_id}")
        if tempdir is not None:
            self.key_file.unlink()  # p2pd has read it; an ephemeral key never needs to touch disk again
        self._tempdir = None
        return DhtPeer(
            dht=dht,
            peer_id=peer_id,
            signer=self.signer,
            identity_path=None if tempdir else self.key_file,
            _tempdir=tempdir,
        )

    def abort(self, timeout: float = DHT_SHUTDOWN_TIMEOUT) -> None:
        """Stop the node (if its process runs) and drop an ephemeral key; idempotent."""
        _stop_dht(self.dht, timeout)
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None


def start_dht(
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
    check_identity: bool = True,
    **dht_kwargs: Any,
) -> PendingDht:
    """Fork the DHT process of `create_dht` and return at once; `PendingDht.wait` gets the node.

    `check_identity=False` skips hivemind's check that no live peer uses the identity (see
    `identity_check_needed` for when that is sound); an ephemeral key is never checked.
    Raises `ConfigError` for bad addresses or identity files. The DHT process dies with the calling
    thread (`net.lifeline`): call this from a thread that lives as long as the node, such as the main one.
    """
    initial = parse_peer_addresses(initial_peers, what="--initial-peers")
    hosts = parse_listen_addresses(host_maddrs, what="--listen")
    announce = parse_listen_addresses(announce_maddrs, what="--announce")
    key_file, tempdir, expected_peer_id, signer = _dht_identity(identity_path)
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
        check_if_identity_free=check_identity and tempdir is None,  # a fresh key cannot be in use elsewhere
        **dht_kwargs,
    )
    pending = PendingDht(
        dht,
        signer=signer,
        key_file=key_file,
        expected_peer_id=expected_peer_id,
        initial=initial,
        startup_timeout=startup_timeout,
        tempdir=tempdir,
    )
    try:
        with dies_with_parent():  # no orphaned DHT process (holding the state dir) after a SIGKILL
            dht.run_in_background(await_ready=False)
    except BaseException:
        pending.abort()
        raise
    return pending


def _dht_identity(
    identity_path: str | Path | None,
) -> tuple[Path, tempfile.TemporaryDirectory | None, str, RSASignatureValidator]:
    """(key file, the temp dir holding it, its peer id, a signer with it): a fresh ephemeral key in a temp
    dir when `identity_path` is None. `ConfigError` for a missing or corrupt file (the temp dir removed)."""
    tempdir = None
    if identity_path is None:
        tempdir = tempfile.TemporaryDirectory(prefix="p2p-diloco-id-")
        key_file = Path(tempdir.name) / "ephemeral.key"
        write_identity(key_file)
    else:
        key_file = Path(identity_path)
    try:
        expected_peer_id = peer_id_of(key_file)
        signer = RSASignatureValidator(signing_key(key_file))
    except BaseException:
        if tempdir is not None:
            tempdir.cleanup()
        raise
    return key_file, tempdir, expected_peer_id, signer


def prepare_dht_process_state() -> None:
    """Set up now what hivemind sets up on a process's first DHT node: its inter-process futures (a
    shared-memory buffer, which starts torch's shm manager, a pipe and its reader thread). About 0.16 s
    on an idle core, more on a busy one; a hot spare (`node.standby`) pays it before its takeover."""
    warm = MPFuture()
    warm.cancel()


def create_dht(**options: Any) -> DhtPeer:
    """Start a DHT node whose peer ID and record-signing key come from `identity_path` (ephemeral if None)
    and wait for it: `start_dht(**options).wait()`, with `start_dht`'s keyword arguments.

    `client_mode=True` for peers that cannot accept connections (they still read and write);
    `use_auto_relay=True` lets a peer behind NAT become reachable through relays (e.g. the bootstrap).
    Raises `ConfigError` for bad addresses or identity files, `ConnectionError` if the node cannot start
    or reach its initial peers.
    """
    return start_dht(**options).wait()


def _stop_dht(dht: hivemind.DHT, timeout: float) -> None:
    """Shut the DHT process down within about `timeout` seconds: ask it politely, then SIGTERM, then
    SIGKILL. hivemind's own `shutdown` only sends SIGTERM after its grace period and does not wait."""
    if not dht.is_alive():
        return
    dht.shutdown_timeout = max(0.1, timeout)
    try:
        dht.shutdown()  # asks, waits up to shutdown_timeout, then SIGTERM
    except (OSError, ValueError) as exc:  # a broken pipe to a dying process
        log.debug("DHT shutdown request: %r", exc)
        dht.terminate()
    dht.join(1.0)
    if dht.is_alive():
        log.warning("DHT process did not exit after SIGTERM; killing it")
        dht.kill()
        dht.join(1.0)


class DhtKeyValueStore:
    """`KeyValueStore` over a hivemind DHT; subkeys are peer IDs, and a peer writes only its own.

    `get` asks the swarm for the freshest copies (``latest=True``) and raises `TimeoutError` if the DHT
    does not answer within `timeout`; `store` returns False then (hivemind's flag reflects only the last
    replica that answered: read back what matters). `admission` (None: every signed record) says whose
    records `get` reads and how many per key (`net.admission`); what it ignores is counted in `dropped`.
    """

    def __init__(
        self,
        peer: DhtPeer,
        *,
        timeout: float = 10.0,
        max_value_bytes: int = MAX_RECORD_BYTES,
        admission: RecordAdmission | None = None,
    ):
        self.peer = peer
        self.timeout = timeout
        self.max_value_bytes = max_value_bytes
        self.admission = admission
        self.dropped: Counter[str] = Counter()

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        if subkey != self.peer.peer_id:
            raise ValueError(
                f"subkey must be this peer's ID {self.peer.peer_id} (records are owner-signed), "
                f"got {subkey!r}"
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

    def get_many(self, keys: Sequence[str], now: float) -> list[dict[str, StoredValue]]:
        """`get` of every key, all lookups in flight at once (`wire.interfaces.ReadsMany`)."""
        futures = [self.peer.dht.get(key, latest=True, return_future=True) for key in keys]
        try:
            return [self._collect(key, future, now) for key, future in zip(keys, futures, strict=True)]
        finally:
            for future in futures:
                future.cancel()  # a no-op on those done; a timeout leaves none of the others waiting

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        return self._collect(key, self.peer.dht.get(key, latest=True, return_future=True), now)

    def _collect(self, key: str, future, now: float) -> dict[str, StoredValue]:  # noqa: ANN001
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
        admission = self.admission
        out: dict[str, StoredValue] = {}
        for subkey, item in found.value.items():
            peer_id, reason = self._owner_of(subkey)
            if reason is None and admission is not None and not admission.allows(key, peer_id):
                reason = DROP_NOT_ADMITTED
            if reason is None:
                reason = self._value_problem(item.value, item.expiration_time, now)
            if reason is not None:
                self.dropped[reason] += 1
                continue
            previous = out.get(peer_id)
            if previous is None or item.expiration_time > previous.expiration:
                out[peer_id] = StoredValue(value=item.value, expiration=float(item.expiration_time))
        if admission is not None:
            out, excess = admission.bound(key, out)
            if excess:
                self.dropped[DROP_EXCESS] += excess
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
