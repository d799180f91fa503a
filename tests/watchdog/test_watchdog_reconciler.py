"""The reconcile loop on a real store (SQLite and PostgreSQL) with a fake SLURM and metrics."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select
from watchdog_curves import Faults, simulate
from watchdog_fakes import TINY_SPEC, Crash, FakeCluster, FakeSource, write_checkpoint

from contracts import anomalies, exitcodes
from contracts.checkpoints import SaveTiming, pinned, write_save_timing
from contracts.paths import attempt_log_dir, checkpoint_dir
from contracts.spec import RunSpec
from supervisor import accounting, store
from supervisor.db import Database
from supervisor.metrics_in import MetricSample
from supervisor.models import (
    Action,
    ActionState,
    Attempt,
    AttemptState,
    Event,
    EventKind,
    Incident,
    IncidentState,
    Node,
    NodeHealth,
    Run,
    RunState,
)
from supervisor.slurm import JobState, JobStatus, SourceUnavailable
from supervisor.watchdog.blame import log_cause
from supervisor.watchdog.observe import job_view
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from supervisor.watchdog.snapshot import Cause, FindingKind, RemedyKind
from supervisor.watchdog.telemetry import WatchdogMetrics


def make(
    db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource, **kw: object
) -> Reconciler:
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60, **kw)  # type: ignore[arg-type]
    return Reconciler(db, cluster, source, config, registry=CollectorRegistry())


def new_run(db: Database, spec: dict | None = None) -> str:
    with db.write_session() as s:
        run, _ = store.create_run(s, RunSpec.model_validate(spec or TINY_SPEC))
        return run.id


def get_run(db: Database, run_id: str) -> Run:
    with db.session() as s:
        return store.get_run(s, run_id)


def rows(db: Database, model: type, run_id: str) -> list:
    with db.session() as s:
        return list(s.scalars(select(model).where(model.run_id == run_id).order_by(model.id)))


def running(db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource) -> tuple:
    """A run submitted and running as attempt 1 on n1, n2."""
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    return rec, run_id, job


def test_pending_run_is_submitted_once_and_followed(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    for _ in range(3):
        rec.tick()
    assert len(cluster.submitted) == 1
    run = get_run(db, run_id)
    assert run.state is RunState.RUNNING and run.current_attempt == 1
    (attempt,) = rows(db, Attempt, run_id)
    assert attempt.job_id == job and attempt.nodes_json == ["n1", "n2"]
    # One batched poll per tick, whatever the number of runs.
    polls = cluster.poll_calls
    for _ in range(4):
        new_run(db)
    rec.tick()
    rec.tick()
    assert cluster.poll_calls == polls + 2


def nan_samples(run_id: str, attempt: int = 1) -> list[MetricSample]:
    return simulate(1, steps=130, steps_per_sample=2, faults=Faults(nan_from=121))


def test_nan_rolls_back_before_onset_skips_and_recovers(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    for step in (50, 100):
        write_checkpoint(ckpt, step, step * 8)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    result = rec.tick()
    remedy = result.remedies[run_id]
    assert remedy.kind is RemedyKind.ROLLBACK and remedy.to_step == 100
    assert cluster.cancelled == [job]
    (_, request) = cluster.submitted[-1]
    assert request.job_name == f"nw-{run_id}-a2"
    run = get_run(db, run_id)
    assert run.state is RunState.RECOVERING and run.current_attempt == 2
    assert run.skip_ranges_json == [[120 * 8, 122 * 8]]
    attempts = rows(db, Attempt, run_id)
    assert attempts[-1].resume_step == 100 and attempts[-1].skip_ranges_json == [[960, 976]]
    (incident,) = rows(db, Incident, run_id)
    assert incident.state is IncidentState.REMEDYING and incident.remedy == "rollback"
    intent, outcome = (
        [e for e in rows(db, Event, run_id) if e.kind is k]
        for k in (EventKind.ACTION_INTENT, EventKind.ACTION_OUTCOME)
    )
    assert any("rollback" in e.message for e in intent)
    assert any("rollback" in e.message and "done" in e.message for e in outcome)

    # Ticks that see the same evidence do nothing more: attempt 1 is no longer current.
    rec.tick()
    assert len(cluster.submitted) == 2 and cluster.cancelled == [job]

    # Attempt 2 runs from step 100 and gets past it: recovered.
    job2 = cluster.submitted[-1][0]
    cluster.set(job2, JobState.RUNNING)
    now = time.time()
    source.samples[(run_id, 2)] = [
        MetricSample(t=now - 2, step=100, loss=3.0, samples_consumed=800),
        MetricSample(t=now - 1, step=103, loss=3.0, samples_consumed=840),
    ]
    rec.tick()
    (incident,) = rows(db, Incident, run_id)
    assert incident.state is IncidentState.RECOVERED
    assert incident.steps_lost == 30  # reached 130, resumed from 100
    assert get_run(db, run_id).state is RunState.RUNNING
    text = generate_latest(rec.registry).decode()
    assert "nightwatch_supervisor_mttr_seconds_count 1.0" in text
    assert 'nightwatch_supervisor_remedies_total{kind="rollback"} 1.0' in text
    assert f'nightwatch_supervisor_run_recovery_budget_left{{run_id="{run_id}"}} 4.0' in text
    assert f'nightwatch_supervisor_run_ettr_ratio{{run_id="{run_id}"}}' in text


def test_incident_closed_at_completion_still_counts_steps_lost(
    db: Database, tmp_path: Path
) -> None:
    """A short attempt can finish before Prometheus ever scrapes it (seen on the real stack
    after a hang restart): the incident is closed at completion, and its steps lost (known
    since the remedy) must not be left out."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 100, 800)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    assert rec.tick().remedies[run_id].kind is RemedyKind.ROLLBACK
    assert pinned(ckpt) == {100}
    job2 = cluster.submitted[-1][0]
    cluster.set(job2, JobState.RUNNING)
    rec.tick()  # no sample of attempt 2 ever arrives
    write_checkpoint(ckpt, 300, 2400, saved_at=time.time() + 1)
    cluster.set(job2, JobState.COMPLETED, exit_code=0)
    rec.tick()
    assert get_run(db, run_id).state is RunState.SUCCEEDED
    assert pinned(ckpt) == set()  # a finished run resumes no more
    (incident,) = rows(db, Incident, run_id)
    assert incident.state is IncidentState.RECOVERED and incident.recovered_ts is not None
    assert incident.steps_lost == 30  # reached 130, resumed from 100


def test_replayed_remedy_is_a_noop(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    remedy = rec.tick().remedies[run_id]
    from supervisor.watchdog.actions import ActContext

    ctx = ActContext(run_id=run_id, attempt=1, job_id=job, job_active=True, step=130)
    assert rec.actuator.apply(ctx, remedy)
    assert len(cluster.submitted) == 2 and cluster.cancelled == [job]
    keys = [a.key for a in rows(db, Action, run_id)]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("when", ["before_submit", "after_submit"])
def test_crash_mid_remedy_resumes_without_duplicate_job(
    db: Database, tmp_path: Path, when: str
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    setattr(cluster, f"crash_{when}", True)
    with pytest.raises(Crash):
        rec.tick()
    # A fresh supervisor (no memory) over the same database and cluster.
    again = make(db, tmp_path, cluster, source, holder=rec.config.holder)
    again.tick()
    again.tick()
    a2 = [r for _, r in cluster.submitted if r.job_name == f"nw-{run_id}-a2"]
    assert len(a2) == 1
    assert cluster.cancelled == [job]
    run = get_run(db, run_id)
    assert run.current_attempt == 2 and run.state is RunState.RECOVERING
    actions = rows(db, Action, run_id)
    assert all(a.state is ActionState.DONE for a in actions), [(a.key, a.state) for a in actions]
    assert rows(db, Attempt, run_id)[-1].job_id == cluster.submitted[-1][0]


def test_slurm_unknown_is_never_destructive(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    cluster.down = True
    for _ in range(3):
        result = rec.tick()
        assert not result.slurm_up
        assert result.remedies[run_id].kind is RemedyKind.OBSERVE
    assert len(cluster.submitted) == 1 and cluster.cancelled == []
    assert get_run(db, run_id).state is RunState.RUNNING
    cluster.down = False
    assert rec.tick().remedies[run_id].kind is RemedyKind.ROLLBACK


def test_metrics_down_means_no_findings_and_no_actions(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    source.down = True
    for _ in range(3):
        result = rec.tick()
        assert result.findings == {} and result.remedies == {} and not result.metrics_up
    text = generate_latest(rec.registry).decode()
    assert 'nightwatch_supervisor_source_up{source="prometheus"} 0.0' in text
    assert len(cluster.submitted) == 1 and not cluster.cancelled
    assert not rows(db, Incident, run_id)


def test_preemption_requeues_and_completion_succeeds(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 150, 1200)
    cluster.set(job, JobState.PREEMPTED)
    assert rec.tick().remedies[run_id].kind is RemedyKind.REQUEUE
    assert cluster.cancelled == []  # it is not running: nothing to cancel
    job2, request = cluster.submitted[-1]
    assert request.job_name.endswith("-a2")
    assert rows(db, Attempt, run_id)[-1].resume_step is None  # newest checkpoint
    write_checkpoint(ckpt, 300, 2400)
    cluster.set(job2, JobState.COMPLETED, exit_code=0)
    rec.tick()
    assert get_run(db, run_id).state is RunState.SUCCEEDED
    rec.tick()
    assert len(cluster.submitted) == 2


def test_exit_75_is_recorded_as_preempted_and_requeued(db: Database, tmp_path: Path) -> None:
    """SLURM calls a job that checkpointed on USR2 and exited 75 FAILED; the attempt row must
    say preempted (docs/contracts.md), or the API and reports show a failure that never was."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    cluster.set(job, JobState.FAILED, exit_code=75)
    result = rec.tick()
    assert result.remedies[run_id].kind is RemedyKind.REQUEUE
    assert [f.kind for f in result.findings[run_id]] == [FindingKind.JOB_PREEMPTED]
    first, second = rows(db, Attempt, run_id)
    assert first.state is AttemptState.PREEMPTED and first.exit_code == 75
    assert second.resume_step is None  # the trainer picks the checkpoint it wrote on the signal
    (incident,) = rows(db, Incident, run_id)
    assert incident.kind == "job_preempted"  # what on-call reads: not a failure


def test_node_fail_excludes_the_node_and_resubmits(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(nodes_per_job=("n1", "n2", "n3")), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    old = cluster.states[job]
    cluster.states[job] = type(old)(job, JobState.NODE_FAIL, old.nodes, failed_nodes=("n2",))
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == ("n2",)
    _, request = cluster.submitted[-1]
    assert "n2" in request.exclude
    assert get_run(db, run_id).excluded_nodes_json == ["n2"]
    with db.session() as s:
        node = s.get(Node, "n2")
        assert node is not None and node.health is NodeHealth.EXCLUDED and node.strikes == 1


def test_cancel_request_cancels_the_job(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    with db.write_session() as s:
        store.request_cancel(s, run_id)
    rec.tick()
    assert cluster.cancelled == [job]
    assert get_run(db, run_id).state is RunState.CANCELLED
    attempt = rows(db, Attempt, run_id)[-1]
    assert attempt.state is AttemptState.CANCELLED and attempt.ended_at is not None
    assert attempt.end_reason == "cancelled by user"
    rec.tick()
    assert cluster.cancelled == [job]


def test_only_the_lease_holder_acts(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    first = make(db, tmp_path, cluster, source)
    second = make(db, tmp_path, cluster, source)
    new_run(db)
    assert first.tick().leader
    result = second.tick()
    assert not result.leader and result.submitted == []
    assert len(cluster.submitted) == 1


def test_checkpoint_saved_past_a_rollback_is_never_resumed(db: Database, tmp_path: Path) -> None:
    """The old job checkpoints step 120 on its way out after the rollback to 100: tainted."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 100, 800)
    source.samples[(run_id, 1)] = nan_samples(run_id)
    assert rec.tick().remedies[run_id].to_step == 100
    assert pinned(ckpt) == {100}  # before the job was stopped: it could prune it otherwise
    write_checkpoint(ckpt, 120, 960)  # written by the cancelled job, after the decision
    job2 = cluster.submitted[-1][0]
    cluster.set(job2, JobState.PREEMPTED)
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.REQUEUE and remedy.to_step == 100
    assert rows(db, Attempt, run_id)[-1].resume_step == 100
    # A checkpoint the resumed attempt writes itself is trusted again.
    job3 = cluster.submitted[-1][0]
    cluster.set(job3, JobState.RUNNING)
    rec.tick()
    write_checkpoint(ckpt, 150, 1200, saved_at=time.time() + 1)
    cluster.set(job3, JobState.TIMEOUT)
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.REQUEUE and remedy.to_step == 150


CAPTURED = Path(__file__).parent / "captured"


def test_peer_connection_closed_blames_the_killed_rank_never_an_address() -> None:
    """W1, recorded in the chaos soak: rank 3 on n2 was killed, its peers logged gloo
    `Connection closed by peer [127.0.0.1]:port`. Blame n2 (srun: task 3 Killed) as a plain
    crash (restart first), never the address 127.0.0.1 that SLURM does not know."""
    text = (CAPTURED / "gloo_peer_crash.txt").read_text()
    cause, _line, nodes = log_cause(text, 1, True, ("n1", "n2"))
    assert (cause, nodes) == (Cause.UNKNOWN, ("n2",))
    assert log_cause(text, 1, True, ())[2] == ()  # nodes unknown: name none
    nccl = "NCCL error: unhandled system error, remote process on gpu13.cluster exited"
    assert log_cause(nccl, 1, True, ("gpu12", "gpu13")) == (Cause.NODE, nccl, ("gpu13",))
    assert log_cause(nccl, 1, True, ("gpu12",))[2] == ()


class FailingSubmitCluster(FakeCluster):
    """sbatch rejects every submission once `failing` is set (as with an invalid node name)."""

    failing: bool = False
    tries: int = 0

    def submit(self, request, fn):  # type: ignore[no-untyped-def]
        if self.failing:
            self.tries += 1
            raise SourceUnavailable("sbatch: error: Invalid node name specified")
        return super().submit(request, fn)


def test_failed_resubmissions_back_off_and_escalate(db: Database, tmp_path: Path) -> None:
    """W2: a resubmission that keeps failing was retried every tick (attempts 2 → 100 in
    200 s); now it backs off, spends the restart budget and escalates."""
    cluster, source = FailingSubmitCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    now = [time.time()]
    rec.clock = lambda: now[0]
    cluster.failing = True
    cluster.set(job, JobState.FAILED, exit_code=76)
    per_tick = []
    for _ in range(100):  # 200 s of 2 s ticks
        now[0] += 2.0
        before = cluster.tries
        rec.tick()
        per_tick.append(cluster.tries - before)
    spec = RunSpec.model_validate(TINY_SPEC)
    assert get_run(db, run_id).state is RunState.NEEDS_ATTENTION
    assert 1 <= cluster.tries <= spec.recovery.max_restarts
    assert per_tick[1:4] == [0, 0, 0]  # backing off after the first failure
    assert len(rows(db, Attempt, run_id)) <= 1 + spec.recovery.max_restarts


def test_ettr_is_productive_steps_over_wall() -> None:
    """R1: only steps beyond the previous maximum are productive: a replay after a rollback,
    failed submissions and a stuck attempt do not raise it, so ETTR falls while stuck."""
    steps = accounting.productive_steps(None, [43, None, 30, 60])
    assert steps == 60
    assert accounting.productive_steps(30, [30]) == 0
    stuck = accounting.run_ettr(wall_s=260.0, productive_steps=30, mean_step_s=2.0)
    assert stuck == pytest.approx(60 / 260)
    assert accounting.run_ettr(wall_s=60.0, productive_steps=30, mean_step_s=2.0) == 1.0
    assert accounting.run_ettr(wall_s=60.0, productive_steps=30, mean_step_s=None) is None


class LoggedCluster(FakeCluster):
    """Serves the soak's recorded job log as every job's log."""

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return [CAPTURED / "gloo_peer_crash.txt"]


def test_peer_crash_in_the_log_restarts_and_never_excludes_an_address(
    db: Database, tmp_path: Path
) -> None:
    """W1 end to end: the soak's job (rank 3 on n2 killed, peers' gloo errors naming
    127.0.0.1) is restarted; nothing is excluded, so the resubmission is valid."""
    cluster, source = LoggedCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    cluster.set(job, JobState.FAILED, exit_code=1)
    result = rec.tick()
    remedy = result.remedies[run_id]
    assert remedy.kind is RemedyKind.RESTART, remedy
    assert result.findings[run_id][0].nodes == ("n2",)
    _, request = cluster.submitted[-1]
    assert request.exclude == () and get_run(db, run_id).excluded_nodes_json == []


def test_startup_hang_limit_is_learned_from_the_runs_own_startups(
    db: Database, tmp_path: Path
) -> None:
    """A job placed on a node that hangs before the first step must not wait 10 hang floors
    to be judged. Attempt 1 took 15 s to its first step, so attempt 2 is
    hung after max(2 floors, 3 × 15 s) = 120 s (floor 60 s), not after 600 s."""
    cluster, source = FakeCluster(), FakeSource()
    offset = [0.0]
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60)
    rec = Reconciler(
        db, cluster, source, config, registry=CollectorRegistry(),
        clock=lambda: time.time() + offset[0],
    )  # fmt: skip
    run_id = new_run(db)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    started = rows(db, Attempt, run_id)[-1].started_at.timestamp()
    first = MetricSample(t=started + 16, step=1, loss=5.0, last_step_ts=started + 15)
    source.samples[(run_id, 1)] = [first]
    rec.tick()
    cluster.set(job, JobState.FAILED, exit_code=1)
    assert rec.tick().remedies[run_id].kind is RemedyKind.RESTART
    job2 = cluster.submitted[-1][0]
    cluster.set(job2, JobState.RUNNING)
    rec.tick()
    started2 = rows(db, Attempt, run_id)[-1].started_at.timestamp()
    offset[0] = started2 + 110 - time.time()
    assert run_id not in rec.tick().findings
    offset[0] = started2 + 130 - time.time()
    (finding,) = rec.tick().findings[run_id]
    assert finding.kind is FindingKind.HANG and "no first step" in finding.summary


def test_failing_first_submission_backs_off_and_escalates(db: Database, tmp_path: Path) -> None:
    """W2 for a pending run: sbatch rejecting the first submission was retried every tick
    with a new attempt; now it backs off and escalates when the restart budget is spent."""
    cluster, source = FailingSubmitCluster(), FakeSource()
    cluster.failing = True
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db)
    now = [time.time()]
    rec.clock = lambda: now[0]
    per_tick = []
    for _ in range(100):  # 200 s of 2 s ticks
        now[0] += 2.0
        before = cluster.tries
        rec.tick()
        per_tick.append(cluster.tries - before)
    spec = RunSpec.model_validate(TINY_SPEC)
    assert get_run(db, run_id).state is RunState.NEEDS_ATTENTION
    assert cluster.tries == spec.recovery.max_restarts
    assert per_tick[:4] == [1, 0, 0, 0]


def _healthy(source: FakeSource, run_id: str) -> None:
    now = time.time()
    source.samples[(run_id, 1)] = [
        MetricSample(
            t=now - 2 + i / 2,
            step=10 + i,
            loss=3.0,
            samples_consumed=80 + 8 * i,
            last_step_ts=now - 2 + i / 2,
        )
        for i in range(4)
    ]


def _ettr_exported(rec: Reconciler, run_id: str) -> bool:
    text = generate_latest(rec.registry).decode()
    return f'nightwatch_supervisor_run_ettr_ratio{{run_id="{run_id}"}}' in text


def test_a_healthy_run_exports_its_ettr_without_any_incident(db: Database, tmp_path: Path) -> None:
    """The on-call dashboard's ETTR panel was empty for a run that never needed a remedy:
    the gauge was set only on remedies and recoveries."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    _healthy(source, run_id)
    rec.tick()
    assert not rows(db, Incident, run_id)
    assert _ettr_exported(rec, run_id)


def _two_running_runs(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Reconciler, FakeSource, list[str]]:
    """Two runs seen running (started) with no samples yet, and one ETTR refresh a tick."""
    monkeypatch.setattr("supervisor.watchdog.telemetry.ETTR_REFRESHES_PER_TICK", 1)
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    runs = [new_run(db), new_run(db)]
    rec.tick()
    for job, *_ in cluster.submitted:
        cluster.set(job, JobState.RUNNING)
    rec.tick()  # started, no samples: no refresh
    return rec, source, runs


def test_ettr_refreshes_spread_over_ticks(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's ETTR refreshes (DB reads) are capped per tick, so they never all land on one."""
    rec, source, runs = _two_running_runs(db, tmp_path, monkeypatch)
    for run_id in runs:
        _healthy(source, run_id)
    assert rec.tick().ettr_refreshes == 1
    assert sum(_ettr_exported(rec, r) for r in runs) == 1
    rec.tick()
    assert all(_ettr_exported(rec, r) for r in runs)


def test_a_run_without_samples_takes_no_ettr_refresh_slot(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, source, (quiet, busy) = _two_running_runs(db, tmp_path, monkeypatch)
    _healthy(source, busy)
    assert rec.tick().ettr_refreshes == 1
    assert _ettr_exported(rec, busy) and not _ettr_exported(rec, quiet)


def test_a_completing_job_keeps_the_attempts_nodes() -> None:
    """squeue lists a COMPLETING job on the nodes still tearing down (`COMPLETING|n1` after n2
    froze, on the devcluster): a remedy chosen then must see both of the attempt's nodes."""
    attempt = Attempt(
        run_id="r", number=1, job_id="7", executor="slurm", nodes_json=["n1", "n2"],
        state=AttemptState.RUNNING, submitted_at=datetime.now(UTC),
    )  # fmt: skip
    ending = JobStatus("7", JobState.RUNNING, ("n1",), raw_state="COMPLETING")
    view = job_view(ending, slurm_up=True, attempt=attempt, now=time.time(), lost_after_s=60)
    assert view.nodes == ("n1", "n2") and view.completing
    running = JobStatus("7", JobState.RUNNING, ("n1", "n3"), raw_state="RUNNING")
    view = job_view(running, slurm_up=True, attempt=attempt, now=time.time(), lost_after_s=60)
    assert view.nodes == ("n1", "n3")


def test_every_incident_and_remedy_kind_is_exported_at_zero_from_the_start() -> None:
    """`increase()` needs a sample before the first increment: a counter series born at 1
    hid the first incident of each kind from the dashboards' annotations."""
    registry = CollectorRegistry()
    WatchdogMetrics(registry)
    text = generate_latest(registry).decode()
    for kind in FindingKind:
        assert f'nightwatch_supervisor_incidents_total{{kind="{kind.value}"}} 0.0' in text
    for remedy in RemedyKind:
        line = f'nightwatch_supervisor_remedies_total{{kind="{remedy.value}"}} 0.0'
        assert (line in text) is (remedy is not RemedyKind.NONE)


def test_a_run_needing_attention_is_exported_by_name_until_it_ends(
    db: Database, tmp_path: Path
) -> None:
    """The page names the run: `run_needs_attention{run_id}` is 0 while the run is active, 1
    while it waits for a human, and gone once it ended."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)

    def value() -> float | None:
        return rec.registry.get_sample_value(
            "nightwatch_supervisor_run_needs_attention", {"run_id": run_id}
        )

    rec.tick()
    assert value() == 0
    with db.session() as s:
        store.transition_run(s, run_id, RunState.NEEDS_ATTENTION, reason="test")
    rec.tick()
    assert value() == 1
    with db.session() as s:
        store.transition_run(s, run_id, RunState.CANCELLED, reason="test")
    rec.tick()
    assert value() is None


def test_a_training_run_shows_its_progress_every_tick_it_moves(
    db: Database, tmp_path: Path
) -> None:
    """The run row carries what the watchdog last saw (step, loss, ETA…), written in one
    statement for all runs that moved, and left alone while nothing moved."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    assert get_run(db, run_id).progress_json is None
    _healthy(source, run_id)
    first = rec.tick()
    progress = get_run(db, run_id).progress_json
    target = get_run(db, run_id).target_steps
    assert first.progress[run_id] == progress
    assert (progress["step"], progress["target_steps"], progress["loss"]) == (13, target, 3.0)
    assert progress["step_seconds"] == 0.5 and progress["eta_seconds"] == round((target - 13) * 0.5)
    assert rec.tick().progress == {}  # the same samples: nothing written
    source.samples[(run_id, 1)] = [
        *source.samples[(run_id, 1)],
        MetricSample(
            t=time.time(), step=14, loss=2.5, samples_consumed=112, last_step_ts=time.time()
        ),
    ]
    assert rec.tick().progress[run_id]["step"] == 14
    assert get_run(db, run_id).progress_json["loss"] == 2.5


def _record(ckpt: Path, *records: anomalies.Anomaly) -> None:
    for a in records:
        anomalies.append(ckpt, a)


def _trained(run_id: str, upto: int, attempt: int = 1) -> list[MetricSample]:
    now = time.time()
    return [
        MetricSample(t=now - upto + s, step=s, loss=3.0, samples_consumed=8 * s, nonfinite_total=0)
        for s in range(1, upto + 1)
    ]


def test_a_contained_nan_batch_is_recorded_once_and_nothing_is_done(
    db: Database, tmp_path: Path
) -> None:
    """The trainer skipped the update of a NaN batch (samples [256, 264) at step 33): one
    `contained` incident with that evidence, no action, and none again after a supervisor
    restart (a new reconciler reads the same record)."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _job = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    samples = _trained(run_id, 40)
    samples[32:] = [dataclasses.replace(s, nonfinite_total=1.0) for s in samples[32:]]
    source.samples[(run_id, 1)] = samples
    nan = anomalies.Anomaly(
        1, 33, anomalies.NONFINITE, ((256, 264),), ("n1",), (256, 264), True, t=time.time() - 7
    )
    _record(ckpt, nan)
    restarted = make(db, tmp_path, cluster, source, holder=rec.config.holder)
    for reconciler in (rec, restarted):
        result = reconciler.tick()
        assert result.leader and run_id not in result.remedies
    (incident,) = rows(db, Incident, run_id)
    assert (incident.kind, incident.state, incident.remedy, incident.steps_lost) == (
        FindingKind.CONTAINED.value, IncidentState.RECOVERED, "none", 0,
    )  # fmt: skip
    ev = incident.evidence_json
    assert ev["bad_samples"] == [[256, 264]] and ev["steps"] == [33] and ev["cause"] == "data"
    assert cluster.cancelled == [] and len(cluster.submitted) == 1
    assert get_run(db, run_id).state is RunState.RUNNING
    # The dashboards' per-run incidents: while the run is watched, then gone.
    series = f'nightwatch_supervisor_run_incidents{{kind="contained",run_id="{run_id}"}} 1.0'
    assert series in generate_latest(rec.registry).decode()
    write_checkpoint(ckpt, 300, 2400)
    cluster.set(_job, JobState.COMPLETED, exit_code=0)
    rec.tick()
    assert "nightwatch_supervisor_run_incidents{" not in generate_latest(rec.registry).decode()


def test_the_trainers_budget_stop_rolls_back_past_exactly_its_samples(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 20, 160)
    bad = [
        anomalies.Anomaly(
            1,
            s,
            anomalies.NONFINITE,
            ((8 * s - 8, 8 * s),),
            (),
            (8 * s - 8, 8 * s),
            True,
            t=time.time(),
        )
        for s in (25, 26, 27, 28)
    ]
    stop = dataclasses.replace(bad[-1], kind=anomalies.STOP, skipped_updates=4, window_steps=100)
    _record(ckpt, *bad, stop)
    cluster.set(job, JobState.FAILED, exit_code=exitcodes.SKIP_BUDGET)
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.ROLLBACK and remedy.to_step == 20
    assert remedy.skip_ranges == ((192, 224),)
    assert remedy.finding is not None and remedy.finding.kind is FindingKind.NONFINITE
    assert get_run(db, run_id).skip_ranges_json == [[192, 224]]


def test_a_spike_the_run_trained_through_to_its_end_is_still_rolled_back(
    db: Database, tmp_path: Path
) -> None:
    """The job reached its target before the watchdog saw the spike at step 299 (the soak's
    fast steps can outrun a tick): the run is not done, its final model holds the spike."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 290, 2320)
    write_checkpoint(ckpt, 300, 2400)
    spike = anomalies.Anomaly(1, 299, anomalies.SPIKE, ((2384, 2392),), (), (2384, 2392),
                              loss=90.0, threshold=7.0, t=time.time())  # fmt: skip
    _record(ckpt, spike)
    cluster.set(job, JobState.COMPLETED, exit_code=0)
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.ROLLBACK and remedy.to_step == 290
    assert remedy.skip_ranges == ((2384, 2392),)
    run = get_run(db, run_id)
    assert run.state is RunState.RECOVERING and run.current_attempt == 2
    (incident,) = rows(db, Incident, run_id)
    assert (incident.kind, incident.remedy) == (FindingKind.LOSS_SPIKE.value, "rollback")
    assert cluster.submitted[-1][1].job_name.endswith("-a2")


def test_a_resubmission_sends_its_stop_signal_a_measured_save_ahead(
    db: Database, tmp_path: Path
) -> None:
    """The trainer recorded a 40 s save: the requeued attempt's USR2 comes 2 × (40 + 1) + 30 s
    before its time limit, not the default 90 s, and the submit action says why."""
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, job = running(db, tmp_path, cluster, source)
    assert cluster.submitted[-1][1].signal_delay_s == 90  # nothing measured yet
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 150, 1200)
    write_save_timing(
        ckpt, SaveTiming(step=150, seconds=40.0, stall_seconds=40.0, step_seconds=1.0)
    )
    cluster.set(job, JobState.PREEMPTED)
    assert rec.tick().remedies[run_id].kind is RemedyKind.REQUEUE
    assert cluster.submitted[-1][1].signal_delay_s == 112
    submits = [a for a in rows(db, Action, run_id) if a.kind == "submit"]
    assert submits[-1].result_json["signal_lead_s"] == 112
    assert "save 40.0 s at step 150" in submits[-1].result_json["signal_lead"]


def test_an_auto_interval_run_gets_its_mtbf_and_each_interval_change_is_one_event(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    spec = {**TINY_SPEC, "checkpoint": {**TINY_SPEC.get("checkpoint", {}), "interval_auto": True,
                                          "mtbf_hours": 2.0}}  # fmt: skip
    run_id = new_run(db, spec)
    rec.tick()
    (submit,) = [a for a in rows(db, Action, run_id) if a.kind == "submit"]
    assert submit.result_json["mtbf_s"] == 7200  # no training, no fault yet: the prior
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(spec))

    def interval_events() -> list[int]:
        return [e.data_json["interval_steps"] for e in rows(db, Event, run_id)
                if e.kind is EventKind.CHECKPOINT and "interval_steps" in e.data_json]  # fmt: skip

    timing = SaveTiming(
        step=10, seconds=0.4, stall_seconds=0.4, step_seconds=0.2, interval_steps=37
    )
    write_save_timing(ckpt, timing)
    rec.tick()
    rec.tick()
    assert interval_events() == [37]
    restarted = make(db, tmp_path, cluster, source, holder=rec.config.holder)
    assert restarted.tick().leader  # a restarted supervisor: nothing new
    assert interval_events() == [37]
    write_save_timing(ckpt, dataclasses.replace(timing, step=47, interval_steps=41))
    rec.tick()
    assert interval_events() == [37, 41]


def test_a_fault_the_trainer_or_a_node_task_records_wakes_the_loop_before_the_tick_is_due(
    db: Database, tmp_path: Path
) -> None:
    """Between ticks the loop watches the trainer's record of bad steps and the folder the
    ranks' exit codes land in: a change there starts the next tick at once, while a quiet
    run waits for the tick that is due (here 60 s away)."""
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source, tick_seconds=60.0)
    spec = {**TINY_SPEC, "recovery": {"restart_in_job": True}}
    run_id = new_run(db, spec)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    source.samples[(run_id, 1)] = _trained(run_id, 20)
    folder = attempt_log_dir(tmp_path / "home", run_id, 1) / job
    folder.mkdir(parents=True)
    ticks = _count_ticks(rec)
    rec.start()
    try:
        _wait_for(lambda: len(ticks) == 1)
        time.sleep(1.0)  # quiet: nothing changed, no tick before the one due
        assert len(ticks) == 1
        ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(spec))
        _record(ckpt, anomalies.Anomaly(1, 21, anomalies.SPIKE, ((160, 168),), t=time.time()))
        _wait_for(lambda: len(ticks) == 2)
        (folder / f"{job}_3_exit_code").write_text(str(exitcodes.ERROR))
        _wait_for(lambda: len(ticks) == 3)
        time.sleep(1.0)
        assert len(ticks) == 3  # each change woke the loop once
    finally:
        rec.stop()


def _count_ticks(rec: Reconciler) -> list[float]:
    """The wall times of the loop's ticks, appended as they start."""
    ticks: list[float] = []
    tick = rec.tick

    def counted() -> object:
        ticks.append(time.time())
        return tick()

    rec.tick = counted  # type: ignore[method-assign]
    return ticks


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the loop did not wake"
        time.sleep(0.02)


def test_the_loop_ticks_when_a_hang_verdict_becomes_possible(db: Database, tmp_path: Path) -> None:
    """A run whose last step was 58 s ago under a 60 s hang limit: the loop's next tick comes
    when the limit runs out (`hang_probe_at`: 2 s away), not at the tick that is due in 60 s,
    and asks the source to read the run's endpoints then (a probe, once for this stall). No
    verdict comes (the samples never show the stillness): the loop looks again at the next
    sample (`hang_due`) while one still could (a failing node settling as dark)."""
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source, tick_seconds=60.0)
    run_id = new_run(db)
    rec.tick()
    cluster.set(cluster.submitted[-1][0], JobState.RUNNING)
    last = time.time() - 58.0
    source.samples[(run_id, 1)] = [
        MetricSample(t=last - 20 + s, step=s, loss=3.0, samples_consumed=8 * s,
                     nonfinite_total=0, last_step_ts=last - 20 + s)
        for s in range(1, 21)
    ]  # fmt: skip
    ticks = _count_ticks(rec)
    rec.start()
    try:
        _wait_for(lambda: len(ticks) >= 2)
        assert ticks[1] >= last + 60  # the limit
        # No verdict: the loop looks again as the next sample can be read, not 60 s later
        # (when it stops looking: test_watchdog_detectors, `hang_due`).
        _wait_for(lambda: len(ticks) >= 4)
    finally:
        rec.stop()
    ((asked_at, probed),) = source.probes  # this stall's endpoints read once, at the limit
    assert probed == ((run_id, 1),) and asked_at >= last + 60
    assert ticks[2] >= last + 60 + 1.0  # the next scrape (1 s apart here)
