"""Train through a stop signal until the next attempt's job is ready to take over.

A walltime warning (USR2) comes the stop signal's lead before the time limit, a preemption
(TERM) the partition's grace time before the kill. Leaving at once hands the run to a job
that still has to import the training program: every second of that import is a second no
one trains. So the ranks announce the stop (the supervisor prepares that job at once) and
train on, interval saves included, until the standby job prepared for the next attempt says
its nodes are ready (`contracts.restart.standby_ready`), or until the time SLURM leaves runs
short. Then they save and leave with 75, and the requeue's order starts the next attempt on
warm nodes.

Global rank 0 decides when to leave and the step's all-reduce carries its decision, so every
rank leaves at the same step boundary; it leaves on the newest save, without another, when the
steps since cost less to train again than a save. Pure: the caller passes the clock and the
readiness.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

#: What the ranks keep in hand when they must leave: the last step and save are budgeted
#: twice over (as the stop signal's lead is, `supervisor.launcher.signal_lead`), then this.
MARGIN_S = 10.0


def signal_code(signum: int, world: int) -> float:
    """A rank's stop signal as the step's all-reduce sums it: none 0, USR2 1, any other
    (TERM) `world + 1`, so that `signal_seen` reads the sum of `world` ranks' codes back."""
    if not signum:
        return 0.0
    return 1.0 if signum == signal.SIGUSR2 else float(world + 1)


def signal_seen(total: float, world: int) -> int:
    """The stop signal the ranks' summed codes carry: TERM when any rank saw one (its kill
    comes first), else USR2 when any rank saw that, else 0."""
    if total >= world + 1:
        return signal.SIGTERM
    return signal.SIGUSR2 if total > 0 else 0


def allowed_seconds(signum: int, signal_lead_s: float, grace_s: float) -> float:
    """The seconds SLURM leaves after stop signal `signum`: the lead a walltime warning was
    submitted with (USR2; it comes up to a minute early, never late), a preemption's grace
    (TERM); 0 for any other signal."""
    if signum == signal.SIGUSR2:
        return signal_lead_s
    if signum == signal.SIGTERM:
        return grace_s
    return 0.0


def train_on_seconds(allowed_s: float, save_s: float, step_s: float) -> float:
    """How long after the signal the ranks may still train before they save and leave: the
    seconds SLURM leaves, less twice the save and the step, less `MARGIN_S` (0: leave now)."""
    return max(0.0, allowed_s - 2.0 * (save_s + step_s) - MARGIN_S)


#: Rank 0's word in the step's all-reduce: go on, save and leave, leave on the newest save.
GO_ON, SAVE_AND_LEAVE, LEAVE_UNSAVED = 0, 1, 2


def leave_code(steps_since_save: int, step_s: float, save_s: float) -> int:
    """How to leave at a step `steps_since_save` past the newest save: without saving when
    training those steps again costs less than a save (an interval save just ran: saving
    again one step later cost a 1.3B run 12.5 s on GPU, for one step of 0.3 s)."""
    return LEAVE_UNSAVED if steps_since_save * step_s < save_s else SAVE_AND_LEAVE


@dataclass
class Handover:
    """Rank 0's watch between a stop signal and leaving.

    `ready`: whether the next attempt's standby nodes are all ready (None: no standby job
    will come, so the ranks train on until the deadline)."""

    ready: Callable[[], bool] | None
    deadline: float | None = None

    def begin(self, now: float, seconds: float) -> None:
        """A signal was seen at `now` (monotonic): leave within `seconds` (a later signal
        only brings the deadline nearer)."""
        deadline = now + seconds
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def due(self, now: float) -> bool:
        """Whether to leave at this step: the deadline passed, or the successor is ready."""
        if self.deadline is None:
            return False
        return now >= self.deadline or (self.ready is not None and self.ready())
