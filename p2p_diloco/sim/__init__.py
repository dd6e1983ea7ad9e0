"""Paper-scale discrete-event simulation of goodput under chip failures (`p2p-diloco simulate`).

No training happens here: chips fail as Poisson processes and jobs pause, restart or carry on
according to the calibrated `FailureModel`. Modules:
- `failure_model`: the calibrated constants and the paper's goodput table;
- `jobs`: one data-parallel job, restart-only (`dp`) or elastic (`elastic_dp`);
- `decoupled`: M elastic learners driving the real synchronizer rounds (`protocol.sync_round`);
- `goodput`: `run_simulation` and the CLI entry point;
- `calibrate`: re-fit the baseline constants and compare all 30 cells with the paper.
"""

from p2p_diloco.sim.failure_model import CALIBRATED, FailureModel

__all__ = ["CALIBRATED", "FailureModel", "run_simulation"]


def __getattr__(name: str):
    if name == "run_simulation":
        from p2p_diloco.sim.goodput import run_simulation

        return run_simulation
    raise AttributeError(name)
