"""Pure launcher decisions: the request, the task and its environment from a plan."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from contracts.checkpoints import (
    SAVE_TIMING_PATH,
    SaveTiming,
    read_save_timing,
    write_save_timing,
    young_daly_steps,
)
from contracts.spec import RunSpec
from supervisor import launcher
from supervisor.accounting import mtbf_estimate
from supervisor.launcher import SubmitPlan, signal_lead


@pytest.fixture
def plan(toy_spec) -> SubmitPlan:
    spec = toy_spec("plan", steps=100)
    spec = spec.model_copy(
        update={"resources": spec.resources.model_copy(update={"exclude": ["n9"]})}
    )
    return SubmitPlan(
        run_id="r1",
        attempt=3,
        spec=spec,
        checkpoint_dir=Path("/ck"),
        log_dir=Path("/logs"),
        resume_step=40,
        skip_ranges=((100, 200),),
        exclude=("n2",),
        supervisor_url="http://127.0.0.1:8787",
        worker_token="tok",
    )


def test_job_request_from_plan(plan):
    req = launcher.job_request(plan)
    env = dict(launcher.training_task(plan).env)
    # One task per node holds the node's 2 ranks (and their CPUs) and forks them.
    assert (req.nodes, req.tasks_per_node, req.gpus_per_node) == (2, 1, None)
    assert (req.ranks_per_task, req.cpus_per_task) == (2, 2 * plan.spec.resources.cpus_per_task)
    assert launcher.training_task(plan).ranks_per_task == 2
    assert req.exclude == ("n2", "n9")  # the spec's and the plan's, merged
    assert req.job_name == "nw-r1-a3" and req.requeue is False
    assert env["NIGHTWATCH_URL"] == "http://127.0.0.1:8787"
    assert env["NIGHTWATCH_WORKER_TOKEN"] == "tok"
    assert (env["NIGHTWATCH_RUN_ID"], env["NIGHTWATCH_ATTEMPT"]) == ("r1", "3")
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU run hides the node's GPUs
    assert launcher.training_task(plan).gpus_required == 0
    bare = dict(launcher.job_env(replace(plan, supervisor_url=None, worker_token=None)))
    assert "NIGHTWATCH_URL" not in bare and "NIGHTWATCH_WORKER_TOKEN" not in bare


def test_a_job_with_spares_outlives_a_failed_node(plan):
    """Only a job that holds spares asks SLURM not to end it when a node fails: it moves the
    node's ranks to a spare inside the allocation (`worker.task`); without spares SLURM's
    default kill ends the job at once, which the watchdog sees as NODE_FAIL and resubmits."""
    assert launcher.job_request(plan).no_kill is False
    resources = plan.spec.resources.model_copy(update={"spare_nodes": 1})
    spared = replace(plan, spec=plan.spec.model_copy(update={"resources": resources}))
    req = launcher.job_request(spared)
    assert (req.nodes, req.no_kill) == (3, True)
    assert (launcher.job_request(plan).min_nodes, req.min_nodes) == (None, 2)  # spares optional


def test_a_gpu_spec_asks_for_its_gpus_whatever_host_the_supervisor_runs_on(plan):
    resources = plan.spec.resources.model_copy(
        update={"device": "gpu", "memory_gib": 200, "exclusive": True}
    )
    gpu = replace(
        plan,
        spec=plan.spec.model_copy(update={"resources": resources}),
        node_setup=launcher.NodeSetup("/opt/venv/bin/python", ("module load cuda/12.4",)),
    )
    req = launcher.job_request(gpu)
    assert (req.gpus_per_node, req.memory_gib, req.exclusive) == (2, 200, True)
    assert (req.python, req.setup) == ("/opt/venv/bin/python", ("module load cuda/12.4",))
    assert launcher.training_task(gpu).gpus_required == 2  # per node task: one per rank
    assert "CUDA_VISIBLE_DEVICES" not in launcher.job_env(gpu)


def test_gpus_required_follows_the_device(plan):
    gpu = RunSpec.model_validate({**_minimal(), "resources": {"gpus_per_node": 8}})
    cpu = RunSpec.model_validate({**_minimal(), "resources": {"device": "cpu", "gpus_per_node": 8}})
    assert gpu.resources.device == "gpu"  # the default: the product is for GPU clusters
    assert (launcher.gpus_required(gpu), launcher.gpus_required(cpu)) == (8, 0)


def _minimal() -> dict:
    return {
        "name": "m",
        "model": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "seq_length": 8,
                  "vocab_size": 64},
        "training": {"train_steps": 1},
    }  # fmt: skip


def test_training_task_carries_the_attempt_and_pickles(plan):
    task = launcher.training_task(plan)
    clone = pickle.loads(pickle.dumps(task))
    assert clone == task
    assert (clone.resume_step, clone.skip_ranges, clone.attempt) == (40, ((100, 200),), 3)
    assert RunSpec.model_validate_json(clone.spec_json) == plan.spec
    assert not hasattr(task, "checkpoint")  # submitit must not requeue on its own


def test_the_stop_signal_lead_covers_the_runs_measured_save_within_bounds() -> None:
    assert signal_lead(None, 24 * 60) == (90, "default 90 s (no save measured yet)")
    assert signal_lead(None, 4)[0] == 60  # never more than a quarter of a short limit, ≥ 60 s
    measured = SaveTiming(step=100, seconds=40.0, stall_seconds=0.4, step_seconds=1.2)
    lead, why = signal_lead(measured, 24 * 60)
    assert lead == 113 and "save 40.0 s at step 100" in why  # 2 × (40 + 1.2) + 30, rounded up
    assert signal_lead(SaveTiming(1, 1.0, 1.0, 0.1), 24 * 60)[0] == 60  # a fast save: the floor
    assert signal_lead(SaveTiming(1, 900.0, 1.0, 5.0), 24 * 60)[0] == 1800  # the cap
    assert signal_lead(SaveTiming(1, 900.0, 1.0, 5.0), 60)[0] == 900  # a quarter of 1 h


def test_save_timing_round_trips_and_a_missing_or_torn_file_is_none(tmp_path: Path) -> None:
    assert read_save_timing(tmp_path) is None
    timing = SaveTiming(step=20, seconds=3.5, stall_seconds=0.2, step_seconds=0.1, async_save=True)
    write_save_timing(tmp_path, timing)
    assert read_save_timing(tmp_path) == timing
    (tmp_path / SAVE_TIMING_PATH).write_text('{"step": 20, "sec')
    assert read_save_timing(tmp_path) is None


def test_young_daly_interval_and_the_mtbf_estimate() -> None:
    # 2 s per save, a failure a day, 1 s steps: sqrt(2 · 2 · 86400) ≈ 588 s of training.
    assert young_daly_steps(2.0, 86400.0, 1.0, 10, 5000) == 588
    assert young_daly_steps(2.0, 86400.0, 1.0, 10, 500) == 500  # the cap
    assert young_daly_steps(0.001, 60.0, 1.0, 10, 500) == 10  # the floor
    assert young_daly_steps(2.0, 86400.0, 0.0, 10, 500) == 500  # no step time: the cap
    # A day's prior counts as one fault-free stretch: no fault yet keeps it...
    assert mtbf_estimate(0.0, 0, 86400.0) == 86400.0
    # ...and 3 faults in 6 h of training bring it down: (6 h + 24 h) / 4.
    assert mtbf_estimate(6 * 3600.0, 3, 86400.0) == 7.5 * 3600
