"""The driver's firing rules, with a scripted log and a recording injector (no services)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.soak import driver
from benchmarks.soak.faults import FollowUp, JobView
from benchmarks.soak.progress import LogFollower
from benchmarks.soak.schedule import FaultKind, ScheduledFault, spec_fault
from benchmarks.soak.score import Injection
from megatron_runs.faults import Faults
from supervisor.spec import RunSpec


class Recorder:
    """Stands in for `faults.Injector`: records what it was asked to do."""

    def __init__(self) -> None:
        self.injected: list[tuple[FaultKind, float]] = []
        self.followups: list[FollowUp] = []
        self.dead_nodes: list[str] = []

    def inject(self, fault: ScheduledFault, job: JobView) -> str:
        self.injected.append((fault.kind, driver.time.time()))
        return "done"

    def tick(self, now: float) -> list[str]:
        return []

    def finish(self) -> list[str]:
        return ["cleaned up"]


def write_steps(log: Path, upto: int) -> None:
    lines = [{"ts": 1.0 + s, "event": "step", "step": s, "loss": 5.0, "attempt": 1, "job_id": "1"}
             for s in range(1, upto + 1)]  # fmt: skip
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))


def drive_scripted(
    tmp_path: Path, monkeypatch, faults: list[ScheduledFault]
) -> tuple[Recorder, list, str]:
    """`driver.drive` over a log of 50 steps (one a second, all there at once), every loop
    turn 10 s later, the run succeeding at the 12th turn, a 30 s gap between faults."""
    clock = iter(range(1000, 2000, 10))
    monkeypatch.setattr(driver.time, "time", lambda: float(next(clock)))
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    write_steps(tmp_path / "1_0_log.out", 50)
    turns = iter(range(100))
    rec = Recorder()
    injections, state = driver.drive(
        faults,
        LogFollower(tmp_path, "*_0_log.out"),
        lambda: JobView("1", ("n1", "n2"), tmp_path),
        lambda: "succeeded" if next(turns) >= 12 else None,
        rec,  # type: ignore[arg-type]
        deadline=10**9,
        say=lambda msg: None,
        min_gap_s=30,
    )
    return rec, injections, state


def test_spec_faults_are_armed_and_external_faults_wait_their_gap(
    tmp_path: Path, monkeypatch
) -> None:
    faults = [
        ScheduledFault(FaultKind.POISON_DATA, 10, {}),
        ScheduledFault(FaultKind.RANK_CRASH, 12, {"rank": 0}),
        ScheduledFault(FaultKind.NODE_DEATH, 40, {"job_node": 0}),
        ScheduledFault(FaultKind.PREEMPTION, 99, {}),
    ]
    rec, injections, state = drive_scripted(tmp_path, monkeypatch, faults)
    assert state == "succeeded"
    assert [k for k, _ in rec.injected] == [FaultKind.RANK_CRASH, FaultKind.NODE_DEATH]
    (_, crash_t), (_, death_t) = rec.injected
    assert death_t - crash_t >= 30
    kinds = [(i.fault.kind, i.note) for i in injections]
    assert kinds[0] == (FaultKind.POISON_DATA, "armed in spec")
    assert kinds[-1] == (FaultKind.PREEMPTION, "not reached")


def test_a_delayed_external_fault_waits_behind_a_spec_fault_due_within_the_gap(
    tmp_path: Path, monkeypatch
) -> None:
    """Seen in the seed-7 soak: a supervisor kill held back by a walltime cut fired at step
    837, one step before a hang armed at 838, and the hang's restart was scored in both
    windows. The external fault now goes after the spec-side one, a gap later."""
    faults = [
        ScheduledFault(FaultKind.SUPERVISOR_KILL, 20, {}),
        ScheduledFault(FaultKind.HANG, 45, {"job_node": 1}),
        ScheduledFault(FaultKind.RANK_CRASH, 48, {"rank": 0}),
    ]
    rec, injections, _ = drive_scripted(tmp_path, monkeypatch, faults)
    order = [i.fault.kind for i in injections]
    assert order == [FaultKind.HANG, FaultKind.SUPERVISOR_KILL, FaultKind.RANK_CRASH]
    assert [k for k, _ in rec.injected] == [FaultKind.SUPERVISOR_KILL, FaultKind.RANK_CRASH]


def test_only_a_fault_held_back_past_half_its_distance_gives_way() -> None:
    """The short soak's crash at step 27 fires on time although the NaN node armed at 71 is
    only seconds of training away; the seed-7 kill scheduled at 473, held back to 837, gives
    way to the hang at 838."""
    crash = ScheduledFault(FaultKind.RANK_CRASH, 27, {"rank": 3})
    nan = ScheduledFault(FaultKind.NAN_NODE, 71, {"job_node": 0})
    assert driver._gives_way_to([crash, nan], 27) is None
    assert driver._gives_way_to([crash, nan], 48) is None
    assert driver._gives_way_to([crash, nan], 50) == nan
    kill = ScheduledFault(FaultKind.SUPERVISOR_KILL, 473, {})
    hang = ScheduledFault(FaultKind.HANG, 838, {"job_node": 1})
    assert driver._gives_way_to([kill, hang], 837) == hang
    assert driver._gives_way_to([kill, ScheduledFault(FaultKind.PREEMPTION, 838)], 837) is None


def test_slow_faults_settle_longer_before_the_next_one() -> None:
    assert driver.settle_s(ScheduledFault(FaultKind.RANK_CRASH, 5, {}), 30) == 30
    assert driver.settle_s(ScheduledFault(FaultKind.WALLTIME, 5, {}), 30) == 180
    prom = ScheduledFault(FaultKind.PROMETHEUS_RESTART, 5, {"down_s": 20})
    assert driver.settle_s(prom, 30) == 50


def test_a_run_that_stops_stepping_ends_stalled_only_when_nothing_can_move_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The baseline sat 1,700 s in a hang in the seventh session's soak: no step for
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
