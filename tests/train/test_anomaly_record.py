"""The trainer's record of its bad steps, from real CPU runs: exact steps and samples.

Pipeline 2 × data 2 (the loss lives on the last stage, each data rank holds half the batch):
a NaN batch, and a spike window that starts and ends inside steps, are named to the sample;
no other step is, but the first good one after each (its `clean` line); a resumed attempt
judges its first step against the trend its checkpoint kept. A run that keeps skipping
updates stops with exit 79 and says why.
"""

from __future__ import annotations

import pytest
from train_helpers import spec_dict

from contracts import anomalies, exitcodes
from contracts.checkpoints import list_checkpoints, read_save_timing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GBS = 8
NAN_STEP = 12  # consumes samples [88, 96)
SPIKE = (163, 170)  # the last 5 samples of step 21 and the first 2 of step 22


def test_bad_steps_are_named_to_the_sample_and_a_resume_keeps_judging(run_train, tmp_path) -> None:
    faults = [
        {"kind": "poison_data", "start_sample": 88, "end_sample": 96, "effect": "nan"},
        {
            "kind": "poison_data",
            "start_sample": SPIKE[0],
            "end_sample": SPIKE[1],
            "effect": "spike",
        },
    ]
    spec = spec_dict("anomaly", tp=1, pp=2, dp=2, steps=26, interval=10, faults=faults, layers=2)
    ckpt = tmp_path / "ck"
    node = {"SLURMD_NODENAME": "n1"}
    first = run_train(spec, ckpt, ["--attempt", "1", "--stop-at-step", "20"], env=node)
    assert first.wait(400) == [exitcodes.OK] * 4
    resumed = run_train(spec, ckpt, ["--attempt", "2"], env=node)
    assert resumed.wait(400) == [exitcodes.OK] * 4

    records = anomalies.read(ckpt)
    assert [(a.attempt, a.step, a.kind) for a in records] == [
        (1, NAN_STEP, anomalies.NONFINITE),
        (1, NAN_STEP + 1, anomalies.CLEAN),  # the episode is over
        (2, 21, anomalies.SPIKE),  # the first step after the resume from step 20
        (2, 22, anomalies.SPIKE),
        (2, 23, anomalies.CLEAN),
    ]
    nan, nan_over, spike_a, spike_b, spike_over = records
    assert nan_over.consumed == (96, 104) and not nan_over.samples
    assert spike_over.consumed == (176, 184) and spike_over.loss < spike_b.threshold
    assert nan.samples == ((88, 96),) and nan.update_skipped
    assert nan.nodes == ("n1",)  # the NaN samples' gradients: on the job's only node
    assert nan.consumed == (88, 96)
    assert spike_a.samples == ((163, 168),) and spike_b.samples == ((168, 170),)
    assert not spike_a.update_skipped and spike_a.loss > spike_a.threshold
    # The checkpoint the second attempt resumed from kept the trend it judged step 21 by.
    at_20 = next(c for c in list_checkpoints(ckpt) if c.step == 20)
    assert len(at_20.loss_trend) == 19  # steps 1-20 but the NaN one
    # The newest save's timing, which sizes the next attempt's stop-signal lead.
    timing = read_save_timing(ckpt)
    assert timing is not None and timing.step == 26 and timing.seconds > 0
    assert timing.step_seconds > 0 and not timing.async_save


def test_more_skipped_updates_than_the_budget_stop_the_run_with_exit_79(
    run_train, tmp_path
) -> None:
    faults = [{"kind": "poison_data", "start_sample": 40, "end_sample": 64, "effect": "nan"}]
    spec = spec_dict("budget", tp=1, pp=1, dp=2, steps=20, interval=10, faults=faults, layers=2)
    spec["recovery"] = {"skipped_updates_budget": 2, "skipped_updates_window_steps": 10}
    ckpt = tmp_path / "ck"
    run = run_train(spec, ckpt)
    assert run.wait(400) == [exitcodes.SKIP_BUDGET] * 2
    records = anomalies.read(ckpt)
    assert [(a.step, a.kind) for a in records] == [
        (6, anomalies.NONFINITE),
        (7, anomalies.NONFINITE),
        (8, anomalies.NONFINITE),
        (8, anomalies.STOP),
    ]
    stop = records[-1]
    assert stop.samples == ((56, 64),) and stop.skipped_updates == 3 and stop.window_steps == 10
    ends = [e for e in run.events() if e["event"] == "skip_budget_exceeded"]
    assert ends and ends[0]["skipped_updates"] == [6, 7, 8]
    assert [e["step"] for e in run.events() if e["event"] == "step"][-1] == 8
