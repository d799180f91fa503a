"""Process exit codes of the training program (docs/contracts.md, "Exit codes").

The worker and the supervisor decide between requeue, restart and escalate from these codes,
so they are named once here and nowhere else.
"""

from __future__ import annotations

OK = 0
"""Reached `train_steps` (or `stop_at_step`) and saved the final checkpoint."""

ERROR = 1
"""Any other error; the traceback is in the log."""

REQUEUE = 75
"""Stopped on USR2/TERM after saving a checkpoint at the next step boundary (EX_TEMPFAIL)."""

INJECTED_CRASH = 76
"""Crash injected by the spec's `faults` section (one-shot `crash` or node `crash`)."""

NO_GPU = 78
"""A GPU run's rank found fewer GPUs than the job was given (EX_CONFIG): a node or
configuration fault that a restart on the same request cannot cure."""

SKIP_BUDGET = 79
"""More updates skipped (non-finite) within the spec's window than its budget allows; the
trainer's `skip_budget` line in `.health/anomalies.jsonl` names the steps, samples and nodes."""

CLEAN_EXITS = frozenset({OK, REQUEUE})
"""A rank that ended with one of these did not fail: it finished, or saved on a stop signal."""
