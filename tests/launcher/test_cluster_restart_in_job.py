"""Restart inside the allocation on the real local SLURM cluster: the node tasks outlive their
ranks and start the attempt a restart order names, in the same job (`contracts.restart`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from contracts import exitcodes
from contracts.restart import (
    RestartOrder,
    failed_exit,
    job_control_dir,
    read_exit_codes,
    write_order,
)
from supervisor import launcher
from supervisor.slurm import JobState, NodeState, tail, wait_for

from .cluster_helpers import all_nodes_idle, latest, wait_until
from .conftest import devcluster

pytestmark = pytest.mark.integration


def _spec(toy_spec, name: str, wait_s: float = 60.0):
    spec = toy_spec(name, steps=16, interval=2)
    recovery = spec.recovery.model_copy(update={"restart_wait_seconds": wait_s})
    return spec.model_copy(update={"recovery": recovery})


def _plan(toy_plan, tmp_path: Path, spec, **env: str):
    return toy_plan(tmp_path, spec, toy_env=env, run_dir=tmp_path / "run")


def _with_spares(slurm, toy_spec, toy_plan, tmp_path: Path, name: str, spares: int):
    """A job of two nodes and `spares` spares, submitted once every node is idle (a job with
    spares starts on as many as are free); its plan, id and status once RUNNING."""
    spec = _spec(toy_spec, name)
    resources = spec.resources.model_copy(update={"spare_nodes": spares})
    plan = _plan(toy_plan, tmp_path, spec.model_copy(update={"resources": resources}))
    all_nodes_idle(slurm)
    job = launcher.submit(slurm, plan).job_id
    return plan, job, wait_for(slurm, job, lambda s: s.state is JobState.RUNNING, 60)


def _exits(folder: Path, job_id: str) -> list[tuple[int, int]]:
    return read_exit_codes(folder / job_id, job_id)


def _starts(folder: Path, job_id: str) -> list[int]:
    text = "".join(tail(p) for p in sorted((folder / job_id).glob(f"{job_id}_*_log.out")))
    return [int(m) for m in re.findall(r"starts at step (\d+)", text)]


def _held(folder: Path, job_id: str) -> list[tuple[int, str]]:
    text = "".join(tail(p) for p in sorted((folder / job_id).glob(f"{job_id}_*_log.out")))
    return [(int(r), held) for r, held in re.findall(r"rank (\d+) memory tier holds (.+)", text)]


def test_crashed_ranks_restart_in_the_same_job_from_the_ordered_step(
    slurm, tmp_path, toy_spec, toy_plan
):
    spec = _spec(toy_spec, "injob-crash")
    plan = _plan(toy_plan, tmp_path, spec, TOY_CRASH_AT="3:5:1")
    job = launcher.submit(slurm, plan).job_id
    wait_until("attempt 1's ranks ended", lambda: len(_exits(plan.log_dir, job)) == 4, 90)
    codes = _exits(plan.log_dir, job)
    assert failed_exit(codes) is not None
    assert (3, 9) in codes  # the crashed rank, with its own code (its peers: 1)
    assert slurm.poll([job])[job].state is JobState.RUNNING  # the nodes wait for an order
    resume = latest(plan.checkpoint_dir)
    assert resume == 4
    a2 = tmp_path / "logs-a2"
    order = RestartOrder(attempt=2, log_dir=str(a2), resume_step=resume)
    write_order(job_control_dir(tmp_path / "run", job), order)
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    assert latest(plan.checkpoint_dir) == 16
    assert sorted(code for _, code in _exits(a2, job)) == [exitcodes.OK] * 4
    assert _starts(a2, job) == [resume] * 4
    # each rank's memory tier slots outlived it, handed again to the rank in its place
    assert sorted(_held(plan.log_dir, job)) == [(r, "nothing") for r in range(4)]
    assert sorted((r, held.split(" step")[0]) for r, held in _held(a2, job)) == [
        (r, f"rank {r}") for r in range(4)
    ]


def test_an_order_stops_running_ranks_and_rolls_back_inside_the_job(
    slurm, tmp_path, toy_spec, toy_plan
):
    spec = _spec(toy_spec, "injob-rollback")
    plan = _plan(toy_plan, tmp_path, spec)
    job = launcher.submit(slurm, plan).job_id
    wait_until("step 6 saved", lambda: latest(plan.checkpoint_dir) >= 6, 90)
    order = RestartOrder(attempt=2, log_dir=str(tmp_path / "logs-a2"), resume_step=2)
    write_order(job_control_dir(tmp_path / "run", job), order)
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    first = "".join(tail(p) for p in (plan.log_dir / job).glob(f"{job}_*_log.out"))
    assert "task end" not in first  # attempt 1's ranks were killed mid-step
    # the job's own folder holds its last attempt's codes (the local executor reads them)
    assert sorted(_exits(plan.log_dir, job)) == sorted(_exits(tmp_path / "logs-a2", job))
    assert _starts(tmp_path / "logs-a2", job) == [2] * 4
    assert latest(plan.checkpoint_dir) == 16


def test_without_an_order_the_job_ends_with_the_ranks_failure(slurm, tmp_path, toy_spec, toy_plan):
    spec = _spec(toy_spec, "injob-noorder", wait_s=2.0)
    plan = _plan(toy_plan, tmp_path, spec, TOY_CRASH_AT="0:3")
    job = launcher.submit(slurm, plan).job_id
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.FAILED, done
    assert (0, 9) in _exits(plan.log_dir, job)  # recorded by its node task (it could not)


def test_a_spare_node_takes_a_bad_nodes_place_inside_the_job(slurm, tmp_path, toy_spec, toy_plan):
    plan, job, running = _with_spares(slurm, toy_spec, toy_plan, tmp_path, "injob-spare", 1)
    first, bad, spare = running.nodes
    wait_until("step 4 saved", lambda: latest(plan.checkpoint_dir) >= 4, 90)
    text = "".join(tail(p) for p in (plan.log_dir / job).glob(f"{job}_*_log.out"))
    assert f"on {spare}" not in text and f"on {bad}" in text  # the spare ran no rank
    a2 = tmp_path / "logs-a2"
    order = RestartOrder(attempt=2, log_dir=str(a2), resume_step=4, nodes=(first, spare))
    write_order(job_control_dir(tmp_path / "run", job), order)
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done  # the node left idle ended cleanly too
    text = "".join(tail(p) for p in (a2 / job).glob(f"{job}_*_log.out"))
    assert sorted(re.findall(r"rank \d/4 on (\w+) starts at step 4", text)) == sorted(
        [first, first, spare, spare]
    )
    assert latest(plan.checkpoint_dir) == 16


def test_spares_do_not_hold_a_job_back(slurm, tmp_path, toy_spec, toy_plan):
    """Two nodes and two spares on the three-node cluster: the job starts at once on the three
    (`--nodes=2-4`), the third a spare that runs no rank, and trains to the end."""
    plan, job, running = _with_spares(slurm, toy_spec, toy_plan, tmp_path, "injob-short", 2)
    assert len(running.nodes) == 3, running
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    assert latest(plan.checkpoint_dir) == 16
    text = "".join(tail(p) for p in (plan.log_dir / job).glob(f"{job}_*_log.out"))
    assert f"on {running.nodes[2]}" not in text  # the spare ran no rank


def test_a_spare_takes_a_dead_nodes_place_and_the_job_lives_on(
    slurm, cluster_dir, tmp_path, toy_spec, toy_plan
):
    """A job holding a spare is submitted `--no-kill`: when a node dies (its host frozen,
    then set DOWN by SLURM) the job and its step go on, and an order moves the dead node's
    ranks to the spare. SLURM's default would have ended the job on the node's failure."""
    plan, job, running = _with_spares(slurm, toy_spec, toy_plan, tmp_path, "injob-dead", 1)
    first, dead, spare = running.nodes
    wait_until("step 4 saved", lambda: latest(plan.checkpoint_dir) >= 4, 90)
    assert devcluster("kill-node", dead, cluster_dir=cluster_dir).returncode == 0
    try:
        down = lambda: slurm.nodes()[dead].state is NodeState.DOWN  # noqa: E731
        wait_until("the frozen node set down", down, 60)
        assert slurm.poll([job])[job].state is JobState.RUNNING
        a2 = tmp_path / "logs-a2"
        order = RestartOrder(attempt=2, log_dir=str(a2), resume_step=4, nodes=(first, spare))
        write_order(job_control_dir(tmp_path / "run", job), order)
        wait_until("attempt 2 trained to the end", lambda: latest(plan.checkpoint_dir) == 16, 90)
        text = "".join(tail(p) for p in (a2 / job).glob(f"{job}_*_log.out"))
        assert sorted(re.findall(r"rank \d/4 on (\w+) starts at step 4", text)) == sorted(
            [first, first, spare, spare]
        )
        wait_until("attempt 2's ranks ended", lambda: len(_exits(a2, job)) == 4, 60)
        assert sorted(_exits(a2, job)) == [(r, exitcodes.OK) for r in range(4)]
        done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=60)
        # the dead node left the allocation; the job ended as its live nodes did
        assert done.state is JobState.COMPLETED and done.nodes == (first, spare), done
    finally:
        revived = devcluster("revive-node", dead, cluster_dir=cluster_dir)
        assert revived.returncode == 0, revived.stderr


def test_a_reserve_jobs_node_joins_the_job_as_a_spare_and_runs_its_ranks(
    slurm, tmp_path, toy_spec, toy_plan
):
    """A reserve job (spares for a running job, `launcher.ReserveFor`) on the third node: its
    node task reads the main job's orders and, named by one, runs the main job's ranks on its
    rendezvous port and into its attempt's folder; the main job's node the order left idles
    as a spare, and both jobs end cleanly with the attempt."""
    spec = _spec(toy_spec, "injob-reserve")
    plan = _plan(toy_plan, tmp_path, spec)
    job = launcher.submit(slurm, plan).job_id
    first, second = wait_for(slurm, job, lambda s: s.state is JobState.RUNNING, 60).nodes
    reserve = launcher.ReserveFor(job, 1, 1, (first, second), plan.log_dir / job)
    reserve_plan = dataclasses.replace(plan, log_dir=tmp_path / "reserves", reserve=reserve)
    rid = launcher.submit(slurm, reserve_plan).job_id
    (third,) = wait_for(slurm, rid, lambda s: s.state is JobState.RUNNING, 60).nodes
    assert slurm.find_jobs(f"nw-{plan.run_id}-j{job}-r1") == [rid]
    wait_until("step 4 saved", lambda: latest(plan.checkpoint_dir) >= 4, 90)
    a2 = tmp_path / "logs-a2"
    order = RestartOrder(attempt=2, log_dir=str(a2), resume_step=4, nodes=(first, third))
    write_order(job_control_dir(tmp_path / "run", job), order)
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    assert wait_for(slurm, rid, lambda s: s.state.terminal, 60).state is JobState.COMPLETED
    text = "".join(tail(p) for p in (a2 / job).glob(f"{job}_*_log.out"))
    assert sorted(re.findall(r"rank \d/4 on (\w+) starts at step 4", text)) == sorted(
        [first, first, third, third]
    )
    assert sorted(_exits(a2, job)) == [(r, exitcodes.OK) for r in range(4)]
    assert latest(plan.checkpoint_dir) == 16


def test_a_standby_job_waits_for_its_order_then_runs_the_attempt(
    slurm, tmp_path, toy_spec, toy_plan
):
    """A successor prepared during a stop (`standby_wait_s`): its nodes run no rank until the
    order for its own attempt, then train from the ordered step in the job's folder."""
    spec = _spec(toy_spec, "standby")
    plan = _plan(toy_plan, tmp_path, spec)
    job = launcher.submit(slurm, plan).job_id
    wait_until("step 6 saved", lambda: latest(plan.checkpoint_dir) >= 6, 90)
    slurm.cancel(job)
    wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=60)
    a2 = tmp_path / "logs-a2"
    standby = toy_plan(tmp_path, spec, attempt=2, run_dir=tmp_path / "run", standby_wait_s=120.0)
    standby = dataclasses.replace(standby, log_dir=a2)
    successor = launcher.submit(slurm, standby).job_id
    wait_until("the standby nodes wait", lambda: "standby: waiting" in _node_log(a2, successor), 60)
    assert _starts(a2, successor) == [] and slurm.poll([successor])[successor].state.active
    order = RestartOrder(attempt=2, log_dir=str(a2), resume_step=6)
    write_order(job_control_dir(tmp_path / "run", successor), order)
    done = wait_for(slurm, successor, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    assert _starts(a2, successor) == [6] * 4
    assert sorted(code for _, code in _exits(a2, successor)) == [exitcodes.OK] * 4
    assert latest(plan.checkpoint_dir) == 16


def test_a_standby_job_without_an_order_ends_without_training(slurm, tmp_path, toy_spec, toy_plan):
    spec = _spec(toy_spec, "standby-none")
    plan = toy_plan(tmp_path, spec, attempt=2, run_dir=tmp_path / "run", standby_wait_s=2.0)
    job = launcher.submit(slurm, plan).job_id
    done = wait_for(slurm, job, lambda s: s.state.terminal, timeout_s=90)
    assert done.state is JobState.COMPLETED, done
    assert _starts(plan.log_dir, job) == [] and _exits(plan.log_dir, job) == []
    assert latest(plan.checkpoint_dir) == 0


def _node_log(folder: Path, job_id: str) -> str:
    return "".join(tail(p) for p in sorted((folder / job_id).glob(f"{job_id}_*_log.out")))


def test_a_cancelled_jobs_idle_node_tasks_leave_at_once(slurm, tmp_path, toy_spec, toy_plan):
    """scancel sends TERM, then SIGKILL after KillWait: node tasks that run no ranks (here a
    standby job's, waiting for their order) leave on the TERM with 75, so the nodes are free
    for the next job at once instead of after KillWait."""
    spec = _spec(toy_spec, "standby-cancel")
    plan = toy_plan(tmp_path, spec, attempt=2, run_dir=tmp_path / "run", standby_wait_s=120.0)
    job = launcher.submit(slurm, plan).job_id
    waiting = lambda: _node_log(plan.log_dir, job).count("standby: waiting") == 2  # noqa: E731
    wait_until("both standby nodes wait", waiting, 60)
    slurm.cancel(job)
    assert wait_for(slurm, job, lambda s: s.state.terminal, 60).state is JobState.CANCELLED
    left = "stop signal 15 on a node that runs no ranks: leaving (exit 75)"
    assert _node_log(plan.log_dir, job).count(left) == 2
