"""WAN tier fixtures: emulated links (network namespaces, TUN delay, tbf rate, NAT) and processes in them.

Every test here needs root and working ``ip netns``; without them the whole tier is skipped with the
reason. The tier is marked ``wan`` (and ``slow``). Before the first test, runs left behind by a killed
earlier session (owner process gone) are removed (`cleanup_stale`).

Fixtures (all torn down at teardown, also when the test failed):
* `make_wan(peers, **kwargs) -> WanEmulator`: a started emulator (`module_make_wan`: module scope).
* `wait_for(predicate, timeout, what)`: poll a condition until a deadline.
* `ns_spawn(wan, peer, argv) -> NsProcess`: a process in a peer's namespace with its stdout lines
  collected and a line-command interface (`ask`); killed at teardown (the emulator's teardown also kills
  everything left in its namespaces); `module_ns_spawn` for module scope.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from p2p_diloco.wan import PeerSpec, WanEmulator, cleanup_stale, environment_problem
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
WAN_DIR = Path(__file__).resolve().parent

_PROBLEM: list[str | None] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "wan: WAN tier: peers in network namespaces with emulated latency, rate and NAT (needs root)",
    )


def wan_problem() -> str | None:
    """Why the tier cannot run here (cached), None if it can."""
    if not _PROBLEM:
        _PROBLEM.append(environment_problem())
    return _PROBLEM[0]


@pytest.fixture(autouse=True)
def _require_wan_environment(request: pytest.FixtureRequest) -> None:
    """Tests marked `wan` need root and namespaces; the pure ones here run anywhere."""
    if request.node.get_closest_marker("wan") is None:
        return
    problem = wan_problem()
    if problem is not None:
        pytest.skip(f"WAN tier: {problem}")


@pytest.fixture(scope="session")
def _remove_stale_runs() -> None:
    """Runs left behind by a killed earlier session (owner process gone) are removed first."""
    if wan_problem() is None:
        cleanup_stale()


@dataclass
class NsProcess:
    """A process in a namespace: stdout lines as they arrive, stderr in a file, stdin for commands."""

    popen: subprocess.Popen[str]
    name: str
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _consumed: int = 0

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def stderr_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no stderr)"

    def next_line(self, prefix: str, timeout: float) -> str:
        """The next not yet consumed stdout line starting with `prefix`; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(self._consumed, len(self.lines)):
                    if self.lines[i].startswith(prefix):
                        self._consumed = i + 1
                        return self.lines[i]
                left = deadline - time.monotonic()
                exited = self.popen.poll() is not None
                if left <= 0 or exited:
                    state = (
                        f"exited with {self.popen.returncode}"
                        if exited
                        else f"no such line in {timeout:.0f} s"
                    )
                    raise AssertionError(
                        f"{self.name}: waiting for {prefix!r}: {state}\n"
                        f"stdout tail: {self.lines[-8:]}\nstderr tail:\n{self.stderr_tail()}"
                    )
                self._cond.wait(timeout=min(left, 0.5))

    def ask(self, command: str, reply_prefix: str, timeout: float = 60.0) -> str:
        """Send one command line, return the rest of the reply line starting with `reply_prefix`."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return self.next_line(reply_prefix, timeout).removeprefix(reply_prefix).strip()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class WanFactory:
    def __init__(self) -> None:
        self.created: list[WanEmulator] = []

    def __call__(self, peers: Sequence[PeerSpec], **kwargs: object) -> WanEmulator:
        if (problem := wan_problem()) is not None:  # module fixtures run before the autouse skip
            pytest.skip(f"WAN tier: {problem}")
        wan = WanEmulator(peers, **kwargs)  # type: ignore[arg-type]
        self.created.append(wan)
        return wan.start()

    def close(self) -> None:
        for wan in reversed(self.created):
            wan.teardown()


@pytest.fixture
def make_wan(_remove_stale_runs: None) -> Iterator[WanFactory]:
    """Factory: `make_wan(peers, **WanEmulator kwargs)` -> a started emulator, torn down at teardown."""
    factory = WanFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def module_make_wan(_remove_stale_runs: None) -> Iterator[WanFactory]:
    """Like `make_wan`, shared by a module's tests."""
    factory = WanFactory()
    try:
        yield factory
    finally:
        factory.close()


class NsSpawner:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[NsProcess] = []

    def __call__(
        self, wan: WanEmulator, peer: str, argv: Sequence[str], name: str | None = None
    ) -> NsProcess:
        name = name or f"{peer}-{len(self.procs)}"
        stderr_path = self.log_dir / f"{name}.stderr"
        with open(stderr_path, "w") as stderr:
            popen = wan.spawn(
                peer,
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        proc = NsProcess(popen=popen, name=name, stderr_path=stderr_path)
        threading.Thread(target=proc._read, daemon=True).start()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


@pytest.fixture
def ns_spawn(tmp_path: Path) -> Iterator[NsSpawner]:
    """Factory: `ns_spawn(wan, peer, argv, name=None) -> NsProcess`, killed at teardown."""
    spawner = NsSpawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture(scope="module")
def module_ns_spawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsSpawner]:
    """Like `ns_spawn`, shared by a module's tests."""
    spawner = NsSpawner(tmp_path_factory.mktemp("ns-procs"))
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """`wait_for(predicate, timeout, what)`: see `wait_until`."""
    return wait_until
