"""`join --log-to`: parsing, the install hint for a missing package, TensorBoard event files (when the
package is installed), and a failing sink that is dropped instead of stopping the peer."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.node import logsinks
from p2p_diloco.node.evaluation import EvalMode
from p2p_diloco.node.join import observe_options_from_args
from p2p_diloco.node.logsinks import LogSpec, LogTarget, SafeSinks, open_sink, parse_log_to


def test_parse_log_to_accepts_the_documented_forms_and_names_them_when_wrong():
    assert parse_log_to("tensorboard:runs/x") == LogSpec(LogTarget.TENSORBOARD, "runs/x")
    assert parse_log_to("wandb") == LogSpec(LogTarget.WANDB, "p2p-diloco")
    assert parse_log_to("wandb:proj") == LogSpec(LogTarget.WANDB, "proj")
    with pytest.raises(ConfigError, match="tensorboard:DIR or wandb"):
        parse_log_to("mlflow:x")
    with pytest.raises(ConfigError, match="needs the directory"):
        parse_log_to("tensorboard")


def test_a_missing_package_is_refused_with_the_pip_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        logsinks.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'p2p_diloco\[wandb\]'"):
        open_sink(LogSpec(LogTarget.WANDB, "p"), "run", "QmPeer")
    args = argparse.Namespace(log_to=["wandb:p"], evaluate=False, no_evaluate=False)
    with pytest.raises(ConfigError, match=r"pip install"):
        observe_options_from_args(args)


def test_join_evaluation_flags():
    def parse(**kw):  # noqa: ANN003, ANN202
        return observe_options_from_args(
            argparse.Namespace(**{"evaluate": False, "no_evaluate": False, **kw})
        )

    assert parse().evaluation.mode is EvalMode.AUTO
    assert parse(evaluate=True, eval_every=3, eval_batches=2).evaluation.mode is EvalMode.ALWAYS
    assert parse(evaluate=True, eval_every=3).evaluation.every_updates == 3
    assert parse(no_evaluate=True).evaluation.mode is EvalMode.NEVER
    with pytest.raises(ConfigError, match="exclude each other"):
        parse(evaluate=True, no_evaluate=True)
    with pytest.raises(ConfigError, match=">= 1"):
        parse(eval_every=-1)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install 'p2p_diloco[tensorboard]')",
)
def test_tensorboard_sink_writes_scalars_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = open_sink(parse_log_to(f"tensorboard:{tmp_path}"), "run", "QmPeer1234567890abcdef")
    sink.log({"peer/loss": 3.0, "global/eval_loss": 2.5}, step=10, wall_time=1000.0)
    sink.log({"peer/loss": 2.0}, step=20, wall_time=1001.0)
    sink.close()
    events = EventAccumulator(str(tmp_path / "QmPeer1234567890")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("peer/loss")] == [(10, 3.0), (20, 2.0)]
    assert [e.value for e in events.Scalars("global/eval_loss")] == [2.5]


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install 'p2p_diloco[tensorboard]')",
)
def test_a_restarted_peer_continues_its_tensorboard_steps_instead_of_overlapping(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec, peer = parse_log_to(f"tensorboard:{tmp_path}"), "QmPeer1234567890abcdef"
    first = open_sink(spec, "run", peer)
    first.log({"peer/loss": 3.0}, step=0, wall_time=1000.0)
    first.log({"peer/loss": 2.5, "global/eval_loss": 2.9}, step=40, wall_time=1001.0)
    first.close()
    restarted = open_sink(spec, "run", peer)  # a new process: its inner steps count from 0 again
    restarted.log({"peer/loss": 2.4, "global/eval_loss": 2.7}, step=0, wall_time=1100.0)
    restarted.log({"peer/loss": 2.2}, step=10, wall_time=1101.0)
    restarted.close()
    events = EventAccumulator(str(tmp_path / peer[:16])).Reload()
    assert [e.step for e in events.Scalars("peer/loss")] == [0, 40, 41, 51]
    assert [e.step for e in events.Scalars("global/eval_loss")] == [40, 0]  # merged tokens, as given


def test_the_wandb_mode_is_stated():
    line = logsinks.wandb_mode_line("proj", "offline")
    assert "offline into ./wandb" in line and "wandb sync" in line and "WANDB_MODE=online" in line
    assert logsinks.wandb_mode_line("proj", "online") == "W&B: logging project proj with WANDB_MODE=online"


def test_a_failing_sink_is_dropped_and_the_others_keep_logging():
    class Good:
        def __init__(self) -> None:
            self.seen = 0

        def log(self, values, step, wall_time) -> None:  # noqa: ANN001
            self.seen += 1

        def close(self) -> None:
            pass

    class Bad(Good):
        def log(self, values, step, wall_time) -> None:  # noqa: ANN001
            raise OSError("disk full")

    good = Good()
    sinks = SafeSinks([Bad(), good])
    sinks.log({"x": 1.0}, 1, 0.0)
    sinks.log({"x": 1.0}, 2, 0.0)
    assert good.seen == 2 and len(sinks.sinks) == 1
    sinks.close()
    assert not sinks


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is not installed (pip install 'p2p_diloco[wandb]')",
)
def test_wandb_sink_logs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = open_sink(parse_log_to("wandb:p2p-diloco-test"), "run", "QmPeer1234567890abcdef")
    sink.log({"peer/loss": 3.0}, step=1, wall_time=1000.0)
    sink.close()
    assert any(tmp_path.rglob("*.wandb"))
