"""Peers re-dial their bootstrap nodes with a bounded backoff (#31); the DHT call is faked here."""

from __future__ import annotations

import concurrent.futures

from p2p_diloco.net.redial import FIRST_BACKOFF, HEALTHY_PERIOD, MAX_BACKOFF, Redialer

BOOT = "QmQn235nVFoPZQ2C7kaUVr6B3Zjsb2kDaZuXEBPbKjaC2E"
ME = "QmSk9FAVkgeqnY2fjTC2yok9bZiYP7GeyP1tYNKJMefiGN"


class FakeDht:
    def __init__(self) -> None:
        self.up = False
        self.calls = 0

    def run_coroutine(self, coro, return_future: bool = False):  # noqa: ANN001, ANN201
        assert return_future  # the caller's thread never waits on the DHT
        self.calls += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(dict.fromkeys(coro.args[0], self.up))
        return future


def test_a_down_bootstrap_is_pinged_with_a_doubling_bounded_backoff_and_checked_lazily_once_back():
    dht = FakeDht()
    redial = Redialer(dht, [f"/ip4/127.0.0.1/tcp/1/p2p/{BOOT}", f"/ip4/127.0.0.1/tcp/2/p2p/{ME}", "junk"], ME)
    assert list(redial.state) == [BOOT]  # its own address and unparsable ones are skipped
    t, pings = 0.0, []
    while t < 200.0:
        before = dht.calls
        redial.tick(t)
        if dht.calls > before:
            pings.append(t)
        t += 0.5
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert gaps[0] <= FIRST_BACKOFF + 1.0 and max(gaps) <= MAX_BACKOFF + 1.0
    assert gaps == sorted(gaps)  # backing off, never faster
    dht.up = True
    redial.tick(t + MAX_BACKOFF)  # due: checked, answered
    redial.tick(t + MAX_BACKOFF + 0.5)  # the answer is collected
    assert redial.redials == 1
    calls = dht.calls
    redial.tick(t + MAX_BACKOFF + 1.0)
    assert dht.calls == calls  # a connected node is checked only every HEALTHY_PERIOD
    redial.tick(t + MAX_BACKOFF + 0.5 + HEALTHY_PERIOD)
    assert dht.calls == calls + 1
