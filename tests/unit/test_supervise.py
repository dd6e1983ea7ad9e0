"""`join --hot-spare`'s supervisor: the decision after a peer's exit, and the loop driven with fake processes."""

from __future__ import annotations

import io
import signal
import subprocess

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.join_command import supervised_argv
from p2p_diloco.node.supervise import (
    MAX_TAKEOVERS,
    TAKEOVER_WINDOW,
    Supervisor,
    Verdict,
    after_exit,
    exit_status,
)


def test_a_peer_killed_by_a_signal_or_crashing_is_replaced_by_the_spare():
    for code in (-signal.SIGKILL, 1, 3):
        decision = after_exit(code, stopping=False, takeovers=[], now=100.0)
        assert decision.verdict is Verdict.PROMOTE, decision
    assert "SIGKILL" in after_exit(-signal.SIGKILL, stopping=False, takeovers=[], now=0.0).reason


def test_a_finished_peer_a_refused_configuration_or_a_requested_stop_end_the_supervisor():
    assert after_exit(0, stopping=False, takeovers=[], now=0.0).verdict is Verdict.STOP
    refused = after_exit(2, stopping=False, takeovers=[], now=0.0)
    assert refused.verdict is Verdict.STOP and "arguments" in refused.reason
    assert after_exit(-signal.SIGKILL, stopping=True, takeovers=[], now=0.0).verdict is Verdict.STOP


def test_a_crash_loop_gives_up_but_old_takeovers_do_not_count():
    now = 1000.0
    recent = [now - i for i in range(MAX_TAKEOVERS)]
    looping = after_exit(1, stopping=False, takeovers=recent, now=now)
    assert looping.verdict is Verdict.GIVE_UP and "crash loop" in looping.reason
    old = [now - TAKEOVER_WINDOW - 1 - i for i in range(MAX_TAKEOVERS)]
    assert after_exit(1, stopping=False, takeovers=old, now=now).verdict is Verdict.PROMOTE


def test_exit_status_of_a_signalled_child_is_128_plus_the_signal():
    assert exit_status(-9) == 137 and exit_status(3) == 3 and exit_status(0) == 0


def test_the_supervised_command_is_this_join_without_hot_spare():
    argv = supervised_argv(["join", "m.toml", "--hot-spare", "--identity", "k"])
    assert argv[1:] == ["-m", "p2p_diloco", "join", "m.toml", "--identity", "k"]
    with pytest.raises(ConfigError, match="join"):
        supervised_argv(["bootstrap"])


class FakeProcess:
    """A child whose life the test scripts: `codes` are what successive `poll`/`wait` calls see (None:
    still running; once an exit code is seen it stays); an empty script runs forever."""

    def __init__(self, argv, stdin=None, codes=()):  # noqa: ANN001
        self.argv = list(argv)
        self.stdin = _Pipe() if stdin == subprocess.PIPE else None
        self.codes = list(codes)
        self.returncode: int | None = None
        self.signals: list[int] = []

    @property
    def spare(self) -> bool:
        return self.argv[-1] == "--standby"

    def poll(self) -> int | None:
        if self.returncode is None and self.codes:
            self.returncode = self.codes.pop(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.returncode = 0  # a peer stops cleanly on SIGTERM

    def terminate(self) -> None:
        self.signals.append(signal.SIGTERM)
        self.returncode = -signal.SIGTERM

    def kill(self) -> None:
        self.returncode = -9


class _Pipe:
    def __init__(self) -> None:
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def scripted(*scripts: list) -> tuple[list[FakeProcess], object]:  # noqa: ANN001
    spawned: list[FakeProcess] = []
    queue = list(scripts)

    def spawn(argv, stdin=None):  # noqa: ANN001
        process = FakeProcess(argv, stdin, codes=queue.pop(0) if queue else [])
        spawned.append(process)
        return process

    return spawned, spawn


JOIN = ["python", "-m", "p2p_diloco", "join", "m.toml"]


def test_the_loop_promotes_the_prepared_spare_then_stops_when_the_promoted_peer_finishes():
    # peer: killed at its second look; spare: runs, then (as the peer) finishes; the next spare: runs
    spawned, spawn = scripted([None, -signal.SIGKILL], [None] * 6 + [0], [])
    out = io.StringIO()
    assert Supervisor(JOIN, spawn=spawn, out=out).run() == 0
    first, spare, next_spare = spawned
    assert not first.spare and spare.spare and next_spare.spare
    assert spare.stdin.written == b"go\n"  # told to take over: it, not a cold process, ran on
    assert next_spare.stdin.written == b"" and next_spare.stdin.closed  # dismissed with end of input
    assert "killed by SIGKILL" in out.getvalue() and "finished" in out.getvalue()


def test_a_spare_that_died_before_its_takeover_is_replaced_by_a_cold_peer():
    # peer dies with 1; the spare is alive at the loop's look, dead (5) when promoted; the cold peer finishes
    spawned, spawn = scripted([None, 1], [None, None, 5], [None, 0], [])
    out = io.StringIO()
    assert Supervisor(JOIN, spawn=spawn, out=out).run() == 0
    assert [p.spare for p in spawned] == [False, True, False, True]
    assert spawned[1].stdin.written == b""
    assert "no spare was ready" in out.getvalue()


def test_a_stop_request_goes_to_the_peer_as_sigterm_and_the_spare_is_dismissed():
    spawned, base = scripted([], [])
    supervisor: Supervisor

    def spawn(argv, stdin=None):  # noqa: ANN001
        process = base(argv, stdin)
        if len(spawned) == 2:  # SIGTERM arrives once peer and spare run
            supervisor.stopping = True
        return process

    supervisor = Supervisor(JOIN, spawn=spawn, out=io.StringIO())
    assert supervisor.run() == 0
    peer, spare = spawned
    assert peer.signals == [signal.SIGTERM]
    assert spare.stdin.closed and spare.stdin.written == b"" and spare.signals == [signal.SIGTERM]


def test_a_spare_takes_over_only_on_the_takeover_line_and_refuses_an_island():
    from p2p_diloco.node.standby import check_standby_args, read_takeover

    assert read_takeover(io.StringIO("go\n")) is True
    assert read_takeover(io.StringIO("")) is False  # its supervisor is gone
    assert read_takeover(io.StringIO("stop\n")) is False
    check_standby_args(True, 1, False)
    check_standby_args(False, 4, True)
    with pytest.raises(ConfigError, match="island"):
        check_standby_args(True, 2, False)
    with pytest.raises(ConfigError, match="island"):
        check_standby_args(True, 1, True)


def test_spares_that_keep_dying_are_not_respawned_forever():
    # the peer runs a while, then finishes; every spare dies at once with exit status 1 (a broken install)
    spawned, spawn = scripted([None] * 10 + [0], [1], [1], [1], [1])
    out = io.StringIO()
    assert Supervisor(JOIN, spawn=spawn, out=out).run() == 0
    assert [p.spare for p in spawned] == [False, True, True, True]  # three tries, then none
    assert "failed 3 times in a row" in out.getvalue() and "running without one" in out.getvalue()
