"""Shared fixtures for integration tests: real processes and real hivemind daemons on 127.0.0.1.

Fixtures (all cleaned up at teardown, also when the test failed):
* `wait_for(predicate, timeout, what)`: poll a condition until a deadline; the failure names `what`.
* `spawn(cmd, env=None, cwd=REPO_ROOT) -> ProcessHandle`: a process in its own process group with its stdout lines collected;
  teardown kills the whole group (its DHT child and p2pd too); failed waits show its stderr tail.
* `cli(*args)`: the command line for `python -m p2p_diloco ARGS`.
* `start_bootstrap(name=...) -> BootstrapNode`: `p2p-diloco bootstrap` on 127.0.0.1 port 0, returned
  once its ``bootstrap address:`` lines are out; `bootstrap_node` is one shared by a test module.
* `dht_peers(**create_dht_kwargs) -> DhtPeer`: in-process DHT peers on loopback (`module_dht_peers`:
  shared by a module).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
PROCESS_START_TIMEOUT = 30.0


@dataclass
class ProcessHandle:
    """A spawned process: its stdout lines as they arrive, its stderr in a file, its process group."""

    popen: subprocess.Popen[str]
    cmd: Sequence[str]
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _reader: threading.Thread | None = None

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no stderr)"

    def wait_for_lines(self, prefix: str, timeout: float, count: int = 1) -> list[str]:
        """The first `count` stdout lines starting with `prefix`; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [line for line in self.lines if line.startswith(prefix)]
                if len(found) >= count:
                    return found
                exited = self.popen.poll() is not None and not (self._reader and self._reader.is_alive())
                left = deadline - time.monotonic()
                if exited or left <= 0:
                    state = (
                        f"exited with {self.popen.returncode}"
                        if exited
                        else f"no such line in {timeout:.0f} s"
                    )
                    raise AssertionError(
                        f"{' '.join(self.cmd)}: waiting for {prefix!r}: {state}\n"
                        f"stdout: {self.lines[-10:]}\nstderr tail:\n{self.stderr_tail()}"
                    )
                self._cond.wait(timeout=min(left, 0.5))

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status; a process still running after `timeout` fails the test with its stderr tail."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{' '.join(self.cmd)}: still running {timeout:.0f} s later\nstderr tail:\n{self.stderr_tail()}"
            ) from None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill_group(self) -> None:
        """SIGKILL every process in the group (the daemons it started too)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def python_cmd(*args: str) -> list[str]:
    """`python -m p2p_diloco ARGS` with this interpreter."""
    return [sys.executable, "-m", "p2p_diloco", *args]


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """`wait_for(predicate, timeout, what)`: see `wait_until`."""
    return wait_until


@pytest.fixture
def cli() -> Callable[..., list[str]]:
    return python_cmd


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., ProcessHandle]]:
    """Factory: `spawn(cmd, env=None, cwd=REPO_ROOT) -> ProcessHandle`; every group is killed at teardown."""
    with _Spawner(tmp_path) as spawner:
        yield spawner


class _Spawner:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.handles: list[ProcessHandle] = []

    def __call__(
        self, cmd: Sequence[str], env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
    ) -> ProcessHandle:
        stderr_path = self.log_dir / f"proc-{len(self.handles)}.stderr"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(stderr_path, "w") as stderr:
            popen = subprocess.Popen(
                list(cmd),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=cwd,
                env=full_env,
                start_new_session=True,  # own process group: teardown kills p2pd and DHT children too
            )
        handle = ProcessHandle(popen=popen, cmd=list(cmd), stderr_path=stderr_path)
        handle._reader = threading.Thread(target=handle._read_stdout, daemon=True)
        handle._reader.start()
        self.handles.append(handle)
        return handle

    def __enter__(self) -> _Spawner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self.handles:
            handle.kill_group()


@dataclass
class BootstrapNode:
    handle: ProcessHandle
    addresses: list[str]
    peer_id: str
    identity: Path


def launch_bootstrap(
    spawner: Callable[..., ProcessHandle], workdir: Path, name: str = "bootstrap"
) -> BootstrapNode:
    """Keygen + `p2p-diloco bootstrap` on 127.0.0.1 port 0; returns once its addresses are printed."""
    from p2p_diloco.net.identity import write_identity

    identity = workdir / f"{name}.key"
    peer_id = write_identity(identity, force=True)
    handle = spawner(python_cmd("bootstrap", "--identity", str(identity), "--listen", LOOPBACK_LISTEN))
    lines = handle.wait_for_lines("bootstrap address: ", timeout=PROCESS_START_TIMEOUT)
    addresses = [line.removeprefix("bootstrap address: ").strip() for line in lines]
    return BootstrapNode(handle=handle, addresses=addresses, peer_id=peer_id, identity=identity)


@pytest.fixture(scope="module")
def bootstrap_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootstrapNode]:
    """One bootstrap shared by the tests of a module (killed at the module's end)."""
    workdir = tmp_path_factory.mktemp("bootstrap")
    with _Spawner(workdir) as spawner:
        yield launch_bootstrap(spawner, workdir)


@pytest.fixture
def start_bootstrap(spawn: Callable[..., ProcessHandle], tmp_path: Path) -> Callable[..., BootstrapNode]:
    """Factory: `start_bootstrap(name="bootstrap") -> BootstrapNode`, killed at teardown."""

    def start(name: str = "bootstrap") -> BootstrapNode:
        return launch_bootstrap(spawn, tmp_path, name)

    return start


class _DhtPeers:
    def __init__(self) -> None:
        self.peers: list = []

    def __call__(self, **kwargs):
        from p2p_diloco.net.dht_store import create_dht

        kwargs.setdefault("host_maddrs", [LOOPBACK_LISTEN])
        peer = create_dht(**kwargs)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for peer in reversed(self.peers):
            peer.shutdown()


@pytest.fixture
def dht_peers() -> Iterator[_DhtPeers]:
    """Factory: `dht_peers(initial_peers=..., identity_path=..., ...) -> DhtPeer` (loopback by default)."""
    peers = _DhtPeers()
    try:
        yield peers
    finally:
        peers.close()


@pytest.fixture(scope="module")
def module_dht_peers() -> Iterator[_DhtPeers]:
    """Like `dht_peers`, shared by a module's tests."""
    peers = _DhtPeers()
    try:
        yield peers
    finally:
        peers.close()
