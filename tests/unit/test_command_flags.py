"""Each command's flags reach its options once: a same-named flag fills its field as parsed
(`preflight.given_fields`), the rest are translated by the command (`join`, `baseline-worker`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.baseline.command import options_from_args as baseline_options
from p2p_diloco.cli import build_parser
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.join import options_from_args as join_options
from p2p_diloco.preflight import given_fields


def common(tmp_path: Path, command: str) -> list[str]:
    manifest = tmp_path / "run.toml"
    manifest.write_text('run_id = "flags"\n[diloco]\nbatch_size = 8\n')
    key = tmp_path / "peer.key"
    if not key.exists():
        write_identity(key)
    return [command, str(manifest), "--identity", str(key), "--state-dir", str(tmp_path / "s")]


def test_given_fields_takes_only_fields_the_arguments_carry():
    @dataclass
    class Options:
        threads: int = 1
        verbose: bool = False
        flush_timeout: float = 5.0

    args = argparse.Namespace(threads=4, verbose=True, nproc=2)
    assert given_fields(Options, args) == {"threads": 4, "verbose": True}


def test_every_join_flag_named_like_an_option_reaches_it(tmp_path):
    flags = ["--threads", "3", "--train-nice", "7", "--persist-every", "9", "--progress-every", "2"]
    flags += ["--min-step-time", "0.5", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"]
    flags += ["--display", "plain", "--micro-batch", "4", "--max-steps", "11", "--device", "cpu"]
    flags += ["--verbose", "--behind-nat", "--announce", "/ip4/1.2.3.4/tcp/5"]
    options = join_options(build_parser().parse_args([*common(tmp_path, "join"), *flags]))
    assert (options.threads, options.train_nice, options.persist_every, options.progress_every) == (
        3,
        7,
        9,
        2,
    )
    assert (options.min_step_time, options.metrics_port, options.metrics_host) == (0.5, 9100, "0.0.0.0")
    assert (options.display, options.micro_batch, options.max_steps, options.device) == (
        "plain",
        4,
        11,
        "cpu",
    )
    assert options.verbose and options.behind_nat and not options.may_sync
    assert options.announce == ("/ip4/1.2.3.4/tcp/5",) and options.state_dir == tmp_path / "s"
    assert options.flush_timeout == 5.0  # not a flag: the default


def test_every_baseline_flag_named_like_an_option_reaches_it(tmp_path):
    flags = ["--threads", "2", "--min-step-time", "0.1", "--progress-every", "3", "--checkpoint-every", "4"]
    flags += ["--max-steps", "5", "--matchmaking-time", "2.5", "--averaging-timeout", "7"]
    flags += ["--average-state-every", "3", "--peer-expiration", "6", "--compression", "fp16", "--verbose"]
    options = baseline_options(build_parser().parse_args([*common(tmp_path, "baseline-worker"), *flags]))
    assert (options.threads, options.min_step_time, options.progress_every) == (2, 0.1, 3)
    assert (options.checkpoint_every, options.max_steps) == (4, 5)
    elastic = options.elastic
    assert (elastic.matchmaking_time, elastic.averaging_timeout, elastic.average_state_every) == (2.5, 7, 3)
    assert (elastic.peer_expiration, elastic.compression, elastic.verbose) == (6, "fp16", True)
    assert elastic.target_batch_size == 4 * 8 and elastic.load_state_timeout == 30.0  # derived
