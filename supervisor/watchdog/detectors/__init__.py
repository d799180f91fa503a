"""Pure detectors: `(Snapshot, RecoverySpec) -> list[Finding]`, each with its evidence.

Rules every detector keeps:
- metrics-based detectors look only at an UP metrics view; stale, missing or failed data
  yields no finding (the policy reports it, nothing convicts or clears on it). The one
  exception is a hang whose staleness is itself the evidence: the node exporting the run's
  metrics went dark or exited while its peers, still answering, stood still
  (`silent_hung_nodes`);
- job-based detectors look only at an UP SLURM view;
- "sustained" is counted in distinct training steps, never in repeated scrapes of one step;
- the onset of a numeric fault is the trainer's own record of the step when it has one
  (`trainer`): the scrape-based numeric detectors defer to it; without one, the onset is
  bounded by the last sample seen healthy (a NaN seen with none before it: by the process's
  count of non-finite steps).
"""

from __future__ import annotations

from contracts.spec import RecoverySpec
from supervisor.watchdog.detectors.common import Detector, by_step
from supervisor.watchdog.detectors.evaluation import detect_eval_jump
from supervisor.watchdog.detectors.numeric import (
    detect_grad_explosion,
    detect_loss_spike,
    detect_nonfinite,
    spike_threshold,
)
from supervisor.watchdog.detectors.progress import (
    detect_hang,
    detect_startup_hang,
    detect_straggler,
    detect_throughput_drop,
    hang_due,
    hang_probe_at,
    median_step_time,
    startup_limit,
    straggler_due,
)
from supervisor.watchdog.detectors.state import (
    detect_checkpoint_problems,
    detect_job_state,
    detect_replica_mismatch,
    walltime_ends_within,
)
from supervisor.watchdog.detectors.trainer import (
    contained,
    detect_skip_budget,
    detect_trainer_anomalies,
    stopping_on_signal,
    unremedied_spikes,
)
from supervisor.watchdog.snapshot import Finding, Snapshot

ALL_DETECTORS: tuple[Detector, ...] = (
    detect_skip_budget,
    detect_job_state,
    detect_trainer_anomalies,
    detect_nonfinite,
    detect_loss_spike,
    detect_grad_explosion,
    detect_hang,
    detect_startup_hang,
    detect_replica_mismatch,
    detect_eval_jump,
    detect_straggler,
    detect_checkpoint_problems,
    detect_throughput_drop,
)


def detect_all(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Every detector's findings, most urgent first (the order of ALL_DETECTORS)."""
    return [f for detector in ALL_DETECTORS for f in detector(snap, rc)]


def verdict_due(snap: Snapshot, rc: RecoverySpec) -> float | None:
    """The soonest time (wall clock) a verdict that needs no new file can come if the run
    goes on as it is: a hang's (`hang_due`) or a straggler's (`straggler_due`)."""
    due = [t for t in (hang_due(snap, rc), straggler_due(snap, rc)) if t is not None]
    return min(due, default=None)


__all__ = [
    "ALL_DETECTORS",
    "by_step",
    "contained",
    "detect_all",
    "detect_checkpoint_problems",
    "detect_eval_jump",
    "detect_grad_explosion",
    "detect_hang",
    "detect_job_state",
    "detect_loss_spike",
    "detect_nonfinite",
    "detect_replica_mismatch",
    "detect_skip_budget",
    "detect_startup_hang",
    "detect_straggler",
    "detect_throughput_drop",
    "detect_trainer_anomalies",
    "hang_due",
    "hang_probe_at",
    "median_step_time",
    "spike_threshold",
    "startup_limit",
    "stopping_on_signal",
    "straggler_due",
    "unremedied_spikes",
    "verdict_due",
    "walltime_ends_within",
]
