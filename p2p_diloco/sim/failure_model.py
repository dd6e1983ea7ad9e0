"""The calibrated failure model of the paper-scale simulator, and the paper's goodput table it is checked on.

`FailureModel` holds every time constant the simulator uses; `CALIBRATED` is the instance fitted on
the two baseline rows of the paper's table (see `p2p_diloco.sim.calibrate` to re-fit or check it, and
docs/failure_model.md for the whole model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from p2p_diloco.errors import ConfigError

SECONDS_PER_YEAR = 365.25 * 24 * 3600.0

PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

# Goodput (%) from PAPER.md, chip MTBF 1 year, Poisson failures; keys are the simulator's variants.
PAPER_GOODPUT: dict[str, tuple[int, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic_dp": (88, 80, 69, 58, 40),
    "decoupled M=2": (94, 88, 80, 70, 54),
    "decoupled M=4": (96, 93, 89, 82, 73),
    "decoupled M=8": (98, 96, 94, 88, 80),
    "decoupled M=16": (99, 98, 96, 93, 86),
}
BASELINE_ROWS = ("dp", "elastic_dp")
PAPER_LEARNERS = (2, 4, 8, 16)


@dataclass(frozen=True)
class FailureModel:
    """Time constants of the simulated cluster, all in seconds unless named otherwise.

    Failures: every chip fails as an independent Poisson process with mean time between failures
    `mtbf_years` (the CLI's ``--mtbf-years``), so a job of n chips sees failures at rate n / MTBF.

    The fit (`python -m p2p_diloco.sim.calibrate --fit`) minimises the squared goodput error (points)
    over a row's five cells by Nelder-Mead, with the default horizons and seed 0 of `run_simulation`.

    Data-parallel without elasticity (`dp`), fitted on the paper's `data-parallel, no elasticity` row:
    - restart_seconds: after a failure the whole job stops, swaps a spare in for the failed host and
      restarts. Failures during a restart are handled by that same restart.
    - checkpoint_seconds: progress since the last checkpoint (one every this many seconds of progress)
      is lost at a failure; 0 means nothing is lost. The fit drives it to 0: any lost work makes
      goodput fall faster than 1/(1 + rate * restart) as the failure rate grows, while the paper's
      row falls slightly slower. The fitted restart leaves at most ~3.5 points of error on that row.

    Elastic data-parallel (`elastic_dp`, and each Decoupled DiLoCo learner), fitted on the paper's
    `elastic data-parallel` row:
    - shrink_seconds: a failure pauses every chip of the job while it drops the failed slice and
      reconfigures; failures during a reconfiguration are absorbed by it. The in-flight step is lost.
    - grow_seconds: pause of a reconfiguration that admits repaired slices back.
    - join_wait_seconds: a repaired slice waits at most this long to ride along with the next
      reconfiguration (free); if none comes, the job pauses `grow_seconds` to admit every waiting slice.
      This is what makes the cost of one failure fall from shrink+grow (rare failures) towards
      shrink alone (frequent failures), the bend the paper's elastic row shows.
    - slice_chips, repair_seconds: a failure takes its slice (one host) out of the job for
      `repair_seconds` (spare swapped in), then it waits to join as above. Fixed a priori, not fitted:
      the paper's 99% for 16 learners bounds their product to well under 1% of capacity.
    - step_seconds: one inner step; only sets the partial step lost at a failure.

    Decoupled DiLoCo (not fitted: its rows are predictions):
    - send_seconds: a learner sends one fragment delta every this many seconds of compute. This is a
      coarse quantum (real learners send every H/P steps); goodput does not depend on it as long as
      it is short compared with the horizon.
    - sync_seconds: merge + broadcast time of one fragment round on the synchronizer.
    - sim_fragments, min_quorum, max_staleness, grace_gamma, tau: synchronizer settings (PAPER.md
      uses P = 24; the simulator keeps fewer fragments to bound the event count; goodput does not
      depend on P here because every fragment carries the same share of work).
    """

    mtbf_years: float = 1.0
    restart_seconds: float = 76.8
    checkpoint_seconds: float = 0.0
    shrink_seconds: float = 16.7
    grow_seconds: float = 18.7
    join_wait_seconds: float = 68.5
    slice_chips: int = 16
    repair_seconds: float = 1800.0
    step_seconds: float = 2.0
    send_seconds: float = 300.0
    sync_seconds: float = 1.0
    sim_fragments: int = 4
    min_quorum: int = 1
    max_staleness: int = 4
    grace_gamma: float = 0.3
    tau: int = 2

    def __post_init__(self) -> None:
        positive = (
            "mtbf_years",
            "restart_seconds",
            "shrink_seconds",
            "repair_seconds",
            "step_seconds",
            "send_seconds",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("checkpoint_seconds", "grow_seconds", "join_wait_seconds", "sync_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.slice_chips < 1:
            raise ConfigError(f"slice_chips must be >= 1, got {self.slice_chips}")
        if self.sim_fragments < 1 or self.min_quorum < 1 or self.tau < 1:
            raise ConfigError("sim_fragments, min_quorum and tau must be >= 1")

    @property
    def chip_failure_rate(self) -> float:
        """Failures per second of one chip."""
        return 1.0 / (self.mtbf_years * SECONDS_PER_YEAR)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


CALIBRATED = FailureModel()
