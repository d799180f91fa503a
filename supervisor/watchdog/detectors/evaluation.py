"""The validation loss after a resume: it must not jump above what the resumed checkpoint had.

A rollback is meant to put the run back in a state it was healthy in; the checkpoint records
the validation loss of the newest evaluation at or before its step, and the trainer exports it
(`eval_resumed_loss`) beside its own evaluations. The fixed valid set makes the two comparable.
"""

from __future__ import annotations

import math

from contracts.spec import RecoverySpec
from supervisor.watchdog.detectors.common import json_float, metrics_ok
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot


def detect_eval_jump(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """The attempt's earliest evaluation in the window above (1 + `eval_jump_ratio`) × the
    validation loss its resumed checkpoint recorded, or not finite. A fresh run, a checkpoint
    without an evaluation, or no evaluation yet: nothing to compare, no finding."""
    if not metrics_ok(snap):
        return []
    first = next((s for s in snap.metrics.samples if s.eval_step is not None), None)
    if first is None or first.eval_loss is None:
        return []
    baseline = first.eval_resumed_loss
    if baseline is None or not math.isfinite(baseline):
        return []
    limit = baseline * (1 + rc.eval_jump_ratio)
    if math.isfinite(first.eval_loss) and first.eval_loss <= limit:
        return []
    return [
        Finding(
            kind=FindingKind.EVAL_JUMP,
            summary=(
                f"validation loss {first.eval_loss:.4g} at step {first.eval_step} after the "
                f"resume, above {limit:.4g} ({1 + rc.eval_jump_ratio:g} × the resumed "
                f"checkpoint's {baseline:.4g})"
            ),
            cause=Cause.UNKNOWN,
            evidence={
                "eval_loss": json_float(first.eval_loss),
                "eval_step": first.eval_step,
                "resumed_eval_loss": baseline,
                "eval_jump_ratio": rc.eval_jump_ratio,
            },
            fault_time=first.t,
            first_bad_step=first.eval_step,
            nodes=snap.job.nodes,
        )
    ]
