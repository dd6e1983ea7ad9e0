"""`join --hot-spare`: run a peer with a hot spare beside it; when the peer dies, the spare takes over at
once.

The supervisor is a small process (it never imports torch): it starts the peer (`join` with the same
arguments) and a spare (`join --standby`, node/standby.py) in its own process group, and waits. When
the peer exits, `after_exit` decides, from the exit and the recent takeovers alone:

- ``promote``: the peer died (killed by a signal, crashed, or stopped with exit 3 when its DHT process
  died): the spare gets its takeover line and becomes the peer (same identity and state directory), and a
  new spare starts preparing. A peer killed by the OOM killer or a bug trains again within a couple of
  seconds instead of after a cold start.
- ``stop``: the peer finished (exit 0), or refused its arguments (exit 2: a spare with the same arguments
  would refuse them too), or we were asked to stop.
- ``give_up``: more than `MAX_TAKEOVERS` takeovers within `TAKEOVER_WINDOW` seconds: a crash loop that a
  spare cannot fix; the supervisor exits with the peer's status and says so.

A spare that dies on its own is replaced; after `MAX_SPARE_FAILURES` such deaths in a row (a broken
install, not bad luck) the supervisor says so and runs the peer without one.

SIGINT/SIGTERM to the supervisor stop the peer as they would stop a plain `join` (forwarded as SIGTERM;
it releases its lease and saves its state); SIGUSR1 is forwarded too (end training, keep serving). The
spare then gets end of input and exits without touching anything. A supervisor killed outright leaves
the peer running and the spare exiting (its input closes with the supervisor).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import FrameType
from typing import IO

EXIT_USAGE = 2  # a `join` that refused its arguments
TAKEOVER = "go"  # the line that makes a spare take over (node/standby.py reads it)
SPARE_NICENESS = 10  # added to the nice value of a spare's import and build threads
MAX_TAKEOVERS = 5
MAX_SPARE_FAILURES = 3  # spares dying on their own in a row: run without one rather than respawn forever
TAKEOVER_WINDOW = 60.0  # seconds
POLL_SECONDS = 0.1  # how often the supervisor looks at its children
STOP_SECONDS = 60.0  # a stopping peer gets this long to save its state before SIGKILL


class Verdict(StrEnum):
    PROMOTE = "promote"
    STOP = "stop"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def after_exit(returncode: int, *, stopping: bool, takeovers: Sequence[float], now: float) -> Decision:
    """What to do when the peer process exited with `returncode` (negative: killed by that signal)."""
    how = describe_exit(returncode)
    if stopping:
        return Decision(Verdict.STOP, f"asked to stop; the peer ended ({how})")
    if returncode == 0:
        return Decision(Verdict.STOP, "the peer finished (exit status 0)")
    if returncode == EXIT_USAGE:
        return Decision(
            Verdict.STOP,
            "the peer refused its arguments (exit status 2; its message says what to fix): a spare with the "
            "same arguments would refuse them too",
        )
    recent = [t for t in takeovers if now - t < TAKEOVER_WINDOW]
    if len(recent) >= MAX_TAKEOVERS:
        return Decision(
            Verdict.GIVE_UP,
            f"the peer died ({how}) after {len(recent)} takeovers in the last "
            f"{TAKEOVER_WINDOW:.0f} s: a crash loop a spare cannot fix; see the peer's output above",
        )
    return Decision(Verdict.PROMOTE, f"the peer died ({how}): the hot spare takes over")


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


Spawn = Callable[..., subprocess.Popen]


def tell_takeover(spare: subprocess.Popen) -> bool:
    """Give a spare (started with ``stdin=PIPE``) its takeover line; False if it is gone or not listening."""
    if spare.stdin is None or spare.poll() is not None:
        return False
    try:
        spare.stdin.write(f"{TAKEOVER}\n".encode())
        spare.stdin.close()
    except OSError:  # it died just now (broken pipe)
        return False
    return True


def dismiss(spare: subprocess.Popen) -> None:
    """End a spare that will not take over: end of input, and SIGTERM for one still preparing (it would
    read its end of input only once prepared); it has touched nothing, so nothing is lost."""
    if spare.stdin is not None:
        try:
            spare.stdin.close()
        except OSError:
            pass
    if spare.poll() is None:
        spare.terminate()
    try:
        spare.wait(timeout=10)
    except subprocess.TimeoutExpired:
        spare.kill()
        spare.wait()


def _spawn(argv: Sequence[str], stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(list(argv), stdin=stdin)  # our process group: a group kill takes all


class Supervisor:
    """Runs `argv` (a `join` command line) with a hot spare (`argv` + ``--standby``); see the module doc."""

    def __init__(self, argv: Sequence[str], *, spawn: Spawn = _spawn, out: IO[str] = sys.stderr):
        self.argv = list(argv)
        self.spawn = spawn
        self.out = out
        self.stopping = False
        self.takeovers: list[float] = []
        self.spare_failures = 0  # spares that died before any takeover, in a row
        self.peer: subprocess.Popen | None = None
        self.spare: subprocess.Popen | None = None

    def say(self, text: str) -> None:
        print(f"p2p-diloco join --hot-spare: {text}", file=self.out, flush=True)

    def _new_spare(self) -> subprocess.Popen:
        return self.spawn([*self.argv, "--standby"], stdin=subprocess.PIPE)

    def _forward(self, sig: int) -> None:
        if self.peer is not None and self.peer.poll() is None:
            self.peer.send_signal(sig)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True  # the loop forwards it: a handler must not race the loop over the children

    def _on_usr1(self, signum: int, _frame: FrameType | None) -> None:
        self._forward(signal.SIGUSR1)

    def _dismiss_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            dismiss(spare)

    def _promote(self) -> bool:
        """Tell the spare to take over; False when it cannot be told (it died: a cold peer replaces it)."""
        spare, self.spare = self.spare, None
        if spare is not None and tell_takeover(spare):
            self.peer = spare
            return True
        self.peer = self.spawn(self.argv)
        return False

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, handler)
            for sig, handler in (
                (signal.SIGTERM, self._on_stop),
                (signal.SIGINT, self._on_stop),
                (signal.SIGUSR1, self._on_usr1),
            )
        }
        try:
            return self._loop()
        finally:
            self._dismiss_spare()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        self.peer = self.spawn(self.argv)
        self.spare = self._new_spare()
        stop_deadline: float | None = None
        while True:
            if self.stopping and stop_deadline is None:  # also covers a signal that came before the spawn
                self._forward(signal.SIGTERM)
                stop_deadline = time.monotonic() + STOP_SECONDS
                self._dismiss_spare()
            if stop_deadline is not None and time.monotonic() > stop_deadline and self.peer.poll() is None:
                self.say(f"the peer did not stop within {STOP_SECONDS:.0f} s: killing it")
                self.peer.kill()
            if self.spare is not None and self.spare.poll() is not None:
                code = self.spare.returncode
                self.spare_failures += 1
                if code == EXIT_USAGE or self.spare_failures >= MAX_SPARE_FAILURES:
                    why = (
                        "refused its arguments (exit status 2)"
                        if code == EXIT_USAGE
                        else (
                            f"failed {self.spare_failures} times in a row "
                            f"({describe_exit(code)}; see its output above)"
                        )
                    )
                    self.say(f"the spare {why}; running without one")
                    self.spare = None
                else:
                    self.say(f"the spare ended ({describe_exit(code)}); starting another")
                    self.spare = self._new_spare()
            try:
                code = self.peer.wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                continue
            now = time.monotonic()
            decision = after_exit(code, stopping=self.stopping, takeovers=self.takeovers, now=now)
            self.say(decision.reason)
            if decision.verdict is not Verdict.PROMOTE:
                return exit_status(code)
            self.takeovers.append(now)
            self.spare_failures = 0  # a new spare starts below: it gets its own tries
            if not self._promote():
                self.say("no spare was ready: started the peer cold")
            self.spare = self._new_spare()
