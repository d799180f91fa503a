"""The training task's context: what the worker hands the training entry point (docs/contracts.md).

An entry module (default `megatron_runs.train`) exposes `train(spec, ctx) -> result` where `ctx`
is a `TrainContext` and `result.exit_code` is one of `contracts.exitcodes`. Everything about one
attempt that is not in the spec travels here, so the worker and every trainer share one copy.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainContext:
    """One attempt of one run on one rank's node."""

    run_id: str
    attempt: int
    node: str
    checkpoint_dir: Path
    resume_step: int | None = None
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    metrics_port: int | None = None
    on_metrics_ready: Callable[[str, int], None] | None = None
    stop_at_step: int | None = None
    #: The run's mean time between failures as the supervisor estimates it (the
    #: `checkpoint.interval_auto` interval's input; None: the spec's prior).
    mtbf_seconds: float | None = None
    #: The lead of the job's walltime warning (USR2), as it was submitted: how long the ranks
    #: may train on after it (`megatron_runs.handover`). 0: unknown, they leave at once.
    signal_lead_s: float = 0.0
    #: Whether ranks training on after a stop signal may leave now: the next attempt's standby
    #: nodes are all ready, or the supervisor is stopping this job (None: neither will say).
    handover_ready: Callable[[], bool] | None = None


def node_name() -> str:
    """The node's name for metrics, faults, exclusions (docs/contracts.md "Node identity")."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
