"""`checkpoint.interval_auto` in a real run: rank 0 sizes the save interval by Young/Daly after
each save, the step's all-reduce carries it to every rank, and the saves follow it."""

from __future__ import annotations

import pytest
from train_helpers import spec_dict

from contracts import exitcodes
from contracts.checkpoints import read_save_timing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_save_interval_adapts_on_every_rank_within_its_bounds(run_train, tmp_path) -> None:
    spec = spec_dict("auto", tp=1, pp=1, dp=2, steps=30, interval=4, layers=2)
    # A failure every 1.8 s: saves of a few tens of ms every few steps.
    spec["checkpoint"].update(
        interval_auto=True, interval_min_steps=3, interval_max_steps=12, mtbf_hours=0.0005
    )
    ckpt = tmp_path / "ck"
    run = run_train(spec, ckpt, env={"SLURMD_NODENAME": "n1"})
    assert run.wait(240) == [exitcodes.OK] * 2  # the ranks agreed on every save
    events = run.events()
    changes = [e for e in events if e["event"] == "checkpoint_interval"]
    assert changes and all(3 <= e["interval_steps"] <= 12 for e in changes)
    saves = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert saves[0] == 4  # interval_steps until the first save was measured
    interval, since = 4, 0
    for step in saves:
        for change in changes:  # a change at a step decides that step's save already
            if since < change["step"] <= step:
                interval = change["interval_steps"]
        assert step % interval == 0 or step == 30, (step, interval, saves, changes)
        since = step
    # The last save's own proposal (the run ended before a step could carry it).
    timing = read_save_timing(ckpt)
    assert timing is not None and timing.step == 30 and 3 <= timing.interval_steps <= 12
