"""End to end without SLURM: `nightwatch demo` trains a tiny CPU Megatron-Core GPT with a
poisoned data window under the real supervisor (SQLite, API, reconciler, local executor,
direct scrapes) and must cure it by rollback + skip, then finish on the pre-fault trend."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from sqlalchemy import select

from supervisor.cli.demo import POISON, demo
from supervisor.db import Database
from supervisor.models import Checkpoint, Incident, IncidentState, Run, RunState

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_demo_rolls_back_past_the_poison_and_finishes(tmp_path: Path) -> None:
    demo(home=tmp_path, steps=80, timeout_min=12.0)
    db = Database(f"sqlite:///{tmp_path / 'nightwatch.db'}")
    with db.session() as s:
        (run,) = s.scalars(select(Run)).all()
        assert run.state is RunState.SUCCEEDED
        (incident,) = s.scalars(select(Incident)).all()
        assert incident.kind == "loss_spike" and incident.remedy == "rollback"
        assert incident.state is IncidentState.RECOVERED and incident.steps_lost is not None
        # The skip covers the whole poisoned window, and the rollback went to before it.
        ((lo, hi),) = run.skip_ranges_json
        assert lo <= POISON[0] and hi >= POISON[1]
        assert run.resume_step is not None and run.resume_step * 8 <= POISON[0]
        losses = {c.step: c.loss for c in s.scalars(select(Checkpoint))}
    db.dispose()
    before, final = losses[run.resume_step], losses[80]
    assert before is not None and final is not None and math.isfinite(final)
    # The curve continues the pre-fault trend: lower than before the fault, nowhere near a spike.
    assert final < before, losses
