"""Jobs no run may have: the level-triggered half of cancelling.

Whatever was in flight when a supervisor died (an sbatch whose job id was never recorded, a
remedy cut between its cancel and its resubmission, a deposed replica's late submit), every
tick compares the jobs SLURM lists under Nightwatch's names with the runs' state: a run that
ended has no live job, an attempt that was superseded has none, an attempt has one job, and a
reserve job (spares for a running job) lives only while the job it reserves for is current and
no successor is prepared for it: a job that stops soon needs no more spares (its successor
takes over a node fault too), and on a full cluster the reserve's nodes are the ones the
successor waits for. A reserve whose node runs the current attempt's ranks (a node fault moved
them there) is no spare any more: it stays until that attempt ends, as the job's own nodes do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from supervisor.launcher import parse_job_name, parse_reserve_name
from supervisor.models import TERMINAL_RUN_STATES, Action, ActionState, Attempt, Run, RunState
from supervisor.slurm import LiveJob


@dataclass(frozen=True)
class RunJobs:
    """What a run may have running: its current attempt, the job that attempt recorded and
    the nodes its ranks run on."""

    state: RunState
    current_attempt: int
    job_id: str | None
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stray:
    run_id: str
    attempt: int
    job_id: str
    reason: str


def find_strays(live: Mapping[str, LiveJob], runs: Mapping[str, RunJobs]) -> list[Stray]:
    """The live jobs (by id) that their run must not have (pure). Names of runs this
    database does not hold are left alone (not ours to judge); an attempt whose job id is not
    recorded yet keeps the job its submission will adopt by name; a job named after an earlier
    attempt is the current attempt's when that attempt was started inside it."""
    out = []
    successors = live_successors(live, runs)
    for job_id, job in sorted(live.items()):
        name = job.name
        reserve = parse_reserve_name(name)
        if reserve is not None and reserve[0] in runs:
            run = runs[reserve[0]]
            if run.state.terminal:
                out.append(Stray(reserve[0], run.current_attempt, job_id, f"run {run.state.value}"))
            elif reserve[1] != run.job_id:
                why = f"reserve for job {reserve[1]}, and the run is not in it"
                out.append(Stray(reserve[0], run.current_attempt, job_id, why))
            elif reserve[1] not in live:
                why = f"reserve for job {reserve[1]}, which SLURM no longer runs"
                out.append(Stray(reserve[0], run.current_attempt, job_id, why))
            elif reserve[0] in successors and not set(job.nodes) & set(run.nodes):
                successor = successors[reserve[0]]
                why = f"reserve for job {reserve[1]}, whose successor {successor} is prepared"
                out.append(Stray(reserve[0], run.current_attempt, job_id, why))
            continue
        parsed = parse_job_name(name)
        if parsed is None or parsed[0] not in runs:
            continue
        run_id, attempt = parsed
        run = runs[run_id]
        if run.state.terminal:
            reason = f"run {run.state.value}"
        elif job_id == run.job_id:
            continue  # the current attempt runs in it (restarted inside the job it named)
        elif attempt < run.current_attempt:
            reason = f"attempt {attempt} superseded by attempt {run.current_attempt}"
        elif attempt == run.current_attempt and run.job_id not in (None, job_id):
            reason = f"attempt {attempt} already has job {run.job_id}"
        else:
            continue
        out.append(Stray(run_id, attempt, job_id, reason))
    return out


def live_successors(live: Mapping[str, LiveJob], runs: Mapping[str, RunJobs]) -> dict[str, str]:
    """Run → the live job named after its next attempt (a successor prepared while the
    current attempt runs on: `Actuator.prepare_successor`), for the runs that go on."""
    out = {}
    for job_id, job in sorted(live.items()):
        parsed = parse_job_name(job.name)
        if parsed is None or parsed[0] not in runs:
            continue
        run = runs[parsed[0]]
        if not run.state.terminal and parsed[1] == run.current_attempt + 1:
            out[parsed[0]] = job_id
    return out


def load_runs(session: Session, job_names: Iterable[str]) -> dict[str, RunJobs]:
    """The runs named by live jobs, with their current attempt's job id and nodes, in one
    query."""
    ids = sorted(
        {p[0] for name in job_names if (p := parse_job_name(name) or parse_reserve_name(name))}
    )
    if not ids:
        return {}
    current = and_(Attempt.run_id == Run.id, Attempt.number == Run.current_attempt)
    rows = session.execute(
        select(Run.id, Run.state, Run.current_attempt, Attempt.job_id, Attempt.nodes_json)
        .outerjoin(Attempt, current)
        .where(Run.id.in_(ids))
    ).all()
    return {
        r.id: RunJobs(r.state, r.current_attempt, r.job_id, tuple(r.nodes_json or ())) for r in rows
    }


def unfinished_on_ended_runs(session: Session) -> list[tuple[str, str, str]]:
    """(key, kind, target) of the actions a crash left unfinished on runs that ended: none is
    resumed any more (a cancel cut between the run's state change and its outcome, or a
    remedy whose run was cancelled before the cancel could abandon it)."""
    rows = session.execute(
        select(Action.key, Action.kind, Action.target)
        .join(Run, Run.id == Action.run_id)
        .where(Action.state == ActionState.INTENT, Run.state.in_(TERMINAL_RUN_STATES))
        .order_by(Action.id)
    ).all()
    return [(r.key, r.kind, r.target) for r in rows]
