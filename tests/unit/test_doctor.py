"""`p2p-diloco doctor`: one ok / warn / fail line per check, the fix for anything not ok, exit status 1 on a
failure."""

from __future__ import annotations

import json
import socket

from p2p_diloco.cli import main
from p2p_diloco.doctor import GIB, Status, check_state_dir, memory_checks


def doctor_json(argv: list[str], capsys) -> tuple[int, dict[str, dict]]:
    code = main(["doctor", *argv, "--json"])
    checks = json.loads(capsys.readouterr().out)["checks"]
    return code, {c["name"]: c for c in checks}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_doctor_on_the_packaged_demo_reports_each_check(tmp_path, capsys):
    code, checks = doctor_json(["demo", "--state-dir", str(tmp_path / "state")], capsys)
    assert code == 0
    for name in (
        "python",
        "packages",
        "cuda",
        "bitsandbytes",
        "manifest",
        "model",
        "host memory",
        "state dir",
    ):
        assert checks[name]["status"] in ("ok", "warn"), checks[name]
    assert "run demo" in checks["manifest"]["detail"] and "parameters" in checks["model"]["detail"]
    assert checks["initial peers"]["status"] == "warn" and "--initial-peers" in checks["initial peers"]["fix"]
    assert checks["clock"] == {
        "name": "clock",
        "status": "warn",
        "detail": "not compared: no initial peer answers",
        "fix": "pass --initial-peers of a live bootstrap node or peer",
    }
    assert checks["reachability"]["status"] in ("ok", "warn")


def test_doctor_fails_an_unreachable_peer_with_the_fix(capsys):
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    code = main(["doctor", "demo", "--initial-peers", address, "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("fail"))
    assert "initial peer" in line and address in line and "Connection refused" in line
    assert "fix: check the address (the whole `bootstrap address:` line)" in out


def test_doctor_reports_a_broken_manifest_as_a_failure(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text('run_id = "t"\n[model]\nblock_size = "128"\n')
    code, checks = doctor_json([str(run)], capsys)
    assert code == 1 and checks["manifest"]["status"] == "fail"
    assert "[model] block_size = '128' (a string): must be an integer" in checks["manifest"]["detail"]


def test_memory_check_compares_the_measured_per_parameter_costs():
    params = 1_000_000_000  # 16 B/param training + 19.1 B/param beyond + 0.51 GiB: about 33 GiB on CPU
    (host,) = memory_checks(params, host_free=8 * GIB, gpu_free=None, eight_bit=False)
    assert host.status == Status.FAIL and "needs about 33.2 GiB" in host.detail and host.fix
    (host,) = memory_checks(params, host_free=64 * GIB, gpu_free=None, eight_bit=False)
    assert host.status == Status.OK
    host, gpu = memory_checks(params, host_free=64 * GIB, gpu_free=8 * GIB, eight_bit=True)
    assert host.status == Status.OK and gpu.status == Status.FAIL  # 10 B/param of 8-bit AdamW on CUDA
    assert "needs 9.3 GiB" in gpu.detail and "--micro-batch" in gpu.fix


def test_state_dir_check(tmp_path):
    file = tmp_path / "f"
    file.write_text("x")
    assert check_state_dir(str(file), 10).status == Status.FAIL
    fresh = check_state_dir(str(tmp_path / "new" / "state"), 1000)
    assert fresh.status == Status.OK and "(new)" in fresh.detail


def test_doctor_probes_a_custom_factory_as_join_would(tmp_path, capsys):
    run = tmp_path / "run.toml"
    head = 'run_id = "t"\n[diloco]\nfragments = 1\n[model]\nkind = "custom"\nblock_size = 16\n'
    run.write_text(head + 'factory = "tests.support.factories:good"\n')
    code, checks = doctor_json([str(run)], capsys)
    assert checks["model contract"]["status"] == "ok", checks["model contract"]
    assert "forward returns (logits, loss), vocabulary 256 covered" in checks["model contract"]["detail"]
    run.write_text(head + 'factory = "tests.support.factories:logits_only"\n')
    code, checks = doctor_json([str(run)], capsys)
    assert code == 1 and checks["model contract"]["status"] == "fail"
    assert (
        "logits_only" in checks["model contract"]["detail"]
        and "[model.config]" in checks["model contract"]["fix"]
    )
    run.write_text('run_id = "t"\n')  # the built-in gpt: nothing to probe
    assert "model contract" not in doctor_json([str(run)], capsys)[1]
