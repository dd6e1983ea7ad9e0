"""Issue #43 item 2: `p2p-diloco doctor` without a manifest checks the machine and exits 0 when it is fine."""

from __future__ import annotations

import json
import socket

from p2p_diloco.cli import main
from p2p_diloco.doctor.checks import Status
from p2p_diloco.doctor.clock import system_clock


def test_doctor_without_a_manifest_checks_the_machine(capsys):
    code = main(["doctor", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    checks = {c["name"]: c for c in json.loads(captured.out)["checks"]}
    for name in ("python", "packages", "cuda", "bitsandbytes", "host memory", "clock", "state dir"):
        assert checks[name]["status"] in ("ok", "warn"), checks[name]
    assert "GiB available" in checks["host memory"]["detail"]
    assert "GiB free here" in checks["state dir"]["detail"]  # the disk
    assert checks["manifest"]["status"] == "warn" and "machine alone" in checks["manifest"]["detail"]


def test_doctor_without_a_manifest_tries_the_address_given(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    code = main(["doctor", "--initial-peers", address, "--timeout", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert any(line.startswith("fail") and address in line for line in out.splitlines())


def test_doctor_still_refuses_a_manifest_swallowed_by_initial_peers(capsys):
    assert main(["doctor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "demo"]) == 2
    assert "read as an --initial-peers address" in capsys.readouterr().err


def test_the_clock_without_a_run_says_the_time_and_ntp():
    assert system_clock(True).status == Status.OK and "kept by NTP" in system_clock(True).detail
    unsynced = system_clock(False)
    assert unsynced.status == Status.WARN and "timedatectl set-ntp true" in unsynced.fix
