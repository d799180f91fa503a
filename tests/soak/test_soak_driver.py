"""The driver's firing rules, with a scripted log and a recording injector (no services)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.soak import driver
from benchmarks.soak import faults as soak_faults
from benchmarks.soak.faults import FollowUp, JobView, NoTarget
from benchmarks.soak.progress import LogFollower
from benchmarks.soak.schedule import FaultKind, ScheduledFault, spec_fault
from benchmarks.soak.score import Injection
from benchmarks.soak.services import Cluster
from contracts.spec import RunSpec
from megatron_runs.faults import Faults


class Recorder:
    """Stands in for `faults.Injector`: records what it was asked to do."""

    def __init__(self) -> None:
        self.injected: list[tuple[FaultKind, int]] = []  # (kind, the driver's loop turn)
        self.followups: list[FollowUp] = []
        self.dead_nodes: list[str] = []
        self.turn = 0

    def inject(self, fault: ScheduledFault, job: JobView) -> str:
        self.injected.append((fault.kind, self.turn))
        return "done"

    def tick(self, now: float) -> list[str]:
        self.turn += 1
        return []

    def finish(self) -> list[str]:
        return ["cleaned up"]


def write_steps(log: Path, upto: int) -> None:
    lines = [{"ts": 1.0 + s, "event": "step", "step": s, "loss": 5.0, "attempt": 1, "job_id": "1"}
             for s in range(1, upto + 1)]  # fmt: skip
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))


def drive_scripted(
    tmp_path: Path, monkeypatch, faults: list[ScheduledFault], rec: Recorder | None = None
) -> tuple[Recorder, list, str]:
    """`driver.drive` over a log of 50 steps (one a second, all there at once), every loop
    turn 10 s later, the run succeeding at the 12th turn."""
    clock = iter(range(1000, 2000, 10))
    monkeypatch.setattr(driver.time, "time", lambda: float(next(clock)))
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    write_steps(tmp_path / "1_0_log.out", 50)
    turns = iter(range(100))
    rec = rec or Recorder()
    injections, state = driver.drive(
        faults,
        LogFollower(tmp_path, "*_0_log.out"),
        lambda: JobView("1", ("n1", "n2"), tmp_path),
        lambda: "succeeded" if next(turns) >= 12 else None,
        rec,  # type: ignore[arg-type]
        deadline=10**9,
        say=lambda msg: None,
    )
    return rec, injections, state


def test_every_fault_fires_when_its_step_is_first_reached_without_waiting_for_another(
    tmp_path: Path, monkeypatch
) -> None:
    """Issue 20: a rank crash scheduled at step 68 waited out a 30 s gap behind an earlier
    fault and was "not reached" though the run passed step 68 twice. Faults no longer wait
    for each other: the scorer tells them apart by cause."""
    faults = [
        ScheduledFault(FaultKind.POISON_DATA, 10, {}),
        ScheduledFault(FaultKind.RANK_CRASH, 12, {"rank": 0}),
        ScheduledFault(FaultKind.NODE_DEATH, 40, {"job_node": 0}),
        ScheduledFault(FaultKind.PREEMPTION, 99, {}),
    ]
    rec, injections, state = drive_scripted(tmp_path, monkeypatch, faults)
    assert state == "succeeded"
    assert rec.injected == [(FaultKind.RANK_CRASH, 0), (FaultKind.NODE_DEATH, 0)]  # 1st turn
    notes = [(i.fault.kind, i.note) for i in injections]
    assert notes[0] == (FaultKind.POISON_DATA, "armed in spec")
    assert notes[-1] == (
        FaultKind.PREEMPTION,
        "not reached: the run ended at step 50, before step 99",
    )
    assert [i.job_id for i in injections] == [None, "1", "1", None]


class Busy(Recorder):
    """No rank to crash for the first three tries (a recovery in progress)."""

    def inject(self, fault: ScheduledFault, job: JobView) -> str:
        self.tries = getattr(self, "tries", 0) + 1
        if self.tries <= 3:
            raise NoTarget("rank 0 of job 1 is not running")
        return super().inject(fault, job)


def test_an_external_fault_with_nothing_to_hit_yet_is_tried_again(
    tmp_path: Path, monkeypatch
) -> None:
    crash = ScheduledFault(FaultKind.RANK_CRASH, 12, {"rank": 0})
    rec, injections, _ = drive_scripted(tmp_path, monkeypatch, [crash], Busy())
    assert rec.injected == [(FaultKind.RANK_CRASH, 3)]  # the fourth turn
    assert injections[0].t is not None


class Never(Recorder):
    def inject(self, fault: ScheduledFault, job: JobView) -> str:
        raise NoTarget("rank 3 of job 1 is not running")


def test_an_external_fault_that_never_found_its_target_says_why(
    tmp_path: Path, monkeypatch
) -> None:
    crash = ScheduledFault(FaultKind.RANK_CRASH, 12, {"rank": 3})
    _, injections, _ = drive_scripted(tmp_path, monkeypatch, [crash], Never())
    (inj,) = injections
    assert inj.t is None and inj.note == "not injected: rank 3 of job 1 is not running"


def test_a_run_that_stops_stepping_ends_stalled_only_when_nothing_can_move_it(
    tmp_path: Path, monkeypatch
) -> None:
    """A hung baseline must not hold the soak for its whole collective timeout: no step for
    `stall_s`, with the collective timeout past the deadline, ends the wait."""
    clock = iter(range(1000, 3000, 10))
    monkeypatch.setattr(driver.time, "time", lambda: float(next(clock)))
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    write_steps(tmp_path / "1_0_log.out", 50)
    _, state = driver.drive(
        [],
        LogFollower(tmp_path, "*_0_log.out"),
        lambda: JobView("1", ("n1",), tmp_path),
        lambda: None,
        Recorder(),  # type: ignore[arg-type]
        deadline=1000 + 900,
        say=lambda msg: None,
        stall_s=300,
    )
    assert state == "stalled"
    assert driver.is_stalled(moved_t=1000, now=1300, deadline=1900, stall_s=300)
    assert not driver.is_stalled(moved_t=1000, now=1290, deadline=1900, stall_s=300)
    # a stuck rank would time out at 1000 + 1800, before this deadline: keep waiting
    assert not driver.is_stalled(moved_t=1000, now=1300, deadline=3000, stall_s=300)


def test_a_spec_side_node_fault_is_scored_on_the_node_the_trainer_pinned(tmp_path: Path) -> None:
    hang = ScheduledFault(FaultKind.HANG, 45, {"job_node": 1})
    nan = ScheduledFault(FaultKind.NAN_NODE, 90, {"job_node": 0})
    crash = ScheduledFault(FaultKind.RANK_CRASH, 48, {"rank": 0})
    done = [Injection(f, None, "armed in spec") for f in (hang, nan)] + [Injection(crash, 5.0)]
    spec = RunSpec.model_validate(
        {
            "name": "pin",
            "model": {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2,
                      "seq_length": 16, "vocab_size": 64},
            "training": {"train_steps": 100},
            "faults": [spec_fault(hang)],
        }
    )  # fmt: skip
    Faults.for_process(spec, "n5", 0, tmp_path, job_nodes=("n4", "n5")).node_effects(45)
    struck = driver.with_struck_nodes(done, tmp_path)
    assert [i.node for i in struck] == ["n5", None, None]  # the NaN node never struck
    assert struck[2] == done[2]


@pytest.mark.skipif(
    not (soak_faults.FREEZER_ROOT / "tasks").exists() or os.geteuid() != 0,
    reason="needs root and the cgroup v1 freezer (as scripts/devcluster's kill-node does)",
)
def test_a_rank_on_a_frozen_node_is_no_target(tmp_path: Path) -> None:
    """A job that moved off a dead node still lists its frozen ranks; the crash must go to
    the live rank (a SIGKILL to a frozen one waits for a thaw that never comes)."""
    cgroup = soak_faults.FREEZER_ROOT / f"nw-test-{os.getpid()}"
    cgroup.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        assert not soak_faults.frozen(str(proc.pid))
        (cgroup / "freezer.state").write_text("FROZEN")
        assert soak_faults.frozen(str(proc.pid))
        (cgroup / "freezer.state").write_text("THAWED")
        assert not soak_faults.frozen(str(proc.pid))
        assert not soak_faults.frozen(str(os.getpid()))
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        proc.kill()
        proc.wait()
        cgroup.rmdir()


def test_a_controller_that_did_not_answer_is_tried_again_and_a_refusal_is_not(
    tmp_path: Path,
) -> None:
    """`scontrol update` says "Unexpected message received" when slurmctld sent no reply in
    time: nothing to record as a failed injection, only a try at the next poll."""
    cluster = Cluster(tmp_path, 2, 26000)
    silent = "echo 'Unexpected message received for job 3' >&2; exit 1"
    with pytest.raises(NoTarget):
        soak_faults.slurm(cluster, "sh", "-c", silent)
    with pytest.raises(RuntimeError, match="Invalid job id"):
        soak_faults.slurm(cluster, "sh", "-c", "echo 'Invalid job id specified' >&2; exit 1")


def test_a_follow_up_the_controller_did_not_answer_stays_for_the_next_tick(
    tmp_path: Path,
) -> None:
    answers = iter([NoTarget("no answer"), None])
    done: list[str] = []

    def restore() -> None:
        answer = next(answers)
        if answer is not None:
            raise answer
        done.append("restored")

    injector = soak_faults.Injector(Cluster(tmp_path, 2, 26000))
    injector.followups.append(FollowUp(0.0, "limit restored", restore))
    assert injector.tick(1.0) == []
    assert injector.tick(2.0) == ["limit restored"]
    assert done == ["restored"] and injector.followups == []


def cgroup2_mount() -> Path | None:
    """The cgroup v2 hierarchy: the whole of /sys/fs/cgroup, or (hybrid hosts) `unified`."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists():
            return root
    return None


@pytest.mark.skipif(cgroup2_mount() is None, reason="no cgroup v2 hierarchy on this host")
def test_a_rank_frozen_through_cgroup_v2_is_no_target(tmp_path: Path, monkeypatch) -> None:
    """On a host without the v1 freezer (the lent GPU machines) devcluster freezes a node's
    cgroup v2 parent: the rank's own cgroup below it reads frozen."""
    root = cgroup2_mount()
    assert root is not None
    monkeypatch.setattr(soak_faults, "FREEZER_ROOT", tmp_path / "no-v1-freezer")
    monkeypatch.setattr(soak_faults, "CGROUP2_ROOT", root)
    node = root / f"nw-test-{os.getpid()}"
    (node / "step").mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (node / "step" / "cgroup.procs").write_text(str(proc.pid))
        assert not soak_faults.frozen(str(proc.pid))
        (node / "cgroup.freeze").write_text("1")
        for _ in range(100):  # freezing is asynchronous; cgroup.events says when it is done
            if "frozen 1" in (node / "cgroup.events").read_text():
                break
            time.sleep(0.01)
        assert soak_faults.frozen(str(proc.pid))
        (node / "cgroup.freeze").write_text("0")
        assert not soak_faults.frozen(str(proc.pid))
    finally:
        proc.kill()
        (node / "cgroup.freeze").write_text("0")
        proc.wait()
        (node / "step").rmdir()
        node.rmdir()
