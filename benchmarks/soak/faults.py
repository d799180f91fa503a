"""External faults, done to the running system exactly as the world would do them.

Spec-side faults (poisoned data, sick nodes) are injected by the training program itself; the
rest happen here: SIGKILL one rank's process (a crash), freeze a node (a dead host), the
signal a preemption sends, a walltime cut short, a truncated newest checkpoint, and restarts
of Prometheus, slurmctld and the supervisor. Each injection returns a note for the record;
the restarts that end a fault are follow-ups run by `tick()` when due.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.soak.schedule import FaultKind, ScheduledFault
from benchmarks.soak.services import Cluster, Supervisor
from megatron_runs.faults import truncate_largest
from supervisor.launcher import parse_reserve_name
from worker.ranks import rank_process_name

PREEMPT_GRACE_S = 30.0


class NoTarget(Exception):
    """Nothing to do the fault to yet (no job, or not running): try again at the next poll."""


@dataclass
class FollowUp:
    """Something to do later (bring a service back), once `due` has passed and `ready()`."""

    due: float
    label: str
    action: Callable[[], None]
    ready: Callable[[], bool] = lambda: True


@dataclass(frozen=True)
class JobView:
    """The system's current SLURM job as the driver sees it."""

    job_id: str | None
    nodes: tuple[str, ...]
    checkpoint_dir: Path


#: What SLURM's tools say when the controller did not answer within its MessageTimeout (busy,
#: or restarting): `scontrol update` says "Unexpected message received" when no reply came.
CONTROLLER_SILENT = (
    "Unexpected message received",
    "Socket timed out",
    "Unable to contact slurm controller",
)


def slurm(cluster: Cluster, *args: str, timeout_s: float = 15) -> str:
    """Run a SLURM tool; NoTarget (try again at the next poll) when the controller did not
    answer, RuntimeError when it refused."""
    out = subprocess.run(
        list(args), env={**os.environ, **cluster.env}, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    if out.returncode != 0:
        err = out.stderr.strip()
        if any(silent in err for silent in CONTROLLER_SILENT):
            raise NoTarget(f"the controller did not answer {' '.join(args)}: {err}")
        raise RuntimeError(f"{' '.join(args)}: {err}")
    return out.stdout


#: Where the cgroup v1 freezer is mounted (scripts/devcluster freezes a "node" there) and,
#: on a host without it, the cgroup v2 hierarchy (where devcluster freezes it instead).
FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
CGROUP2_ROOT = Path("/sys/fs/cgroup")


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _ppid(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[1]


def frozen(pid: str) -> bool:
    """Whether the process sits in a frozen cgroup (a node the soak killed): the v1 freezer's
    state, or on cgroup v2 the `frozen` event of its cgroup (set when an ancestor froze it)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    v1 = FREEZER_ROOT.exists()
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        try:
            if v1 and "freezer" in controllers.split(","):
                state = FREEZER_ROOT / path.lstrip("/") / "freezer.state"
                return state.read_text().strip() != "THAWED"
            if not v1 and hierarchy == "0":
                events = CGROUP2_ROOT / path.lstrip("/") / "cgroup.events"
                return "frozen 1" in events.read_text().splitlines()
        except OSError:
            return False
    return False


def rank_process(job_id: str, rank: int) -> int | None:
    """The training process of one global rank of a job: Nightwatch's node task forks its
    ranks and names each (`worker.ranks`: `nw-rank<N>` in /proc/<pid>/comm, the environment
    being the node task's); the baseline's ranks are SLURM tasks (SLURM_PROCID), and its
    python's own children (helpers) are not ranks; a rank on a node of a reserve job (spares
    that joined the job) is in that job, named for this one. The ranks of a node the soak
    froze are left out: a job that moved to a spare still lists them, and a SIGKILL there
    would wait for a thaw that never comes (the crash would never strike)."""
    named: set[str] = set()
    found: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or frozen(entry.name):
            continue
        env = _environ(entry.name)
        reserve = parse_reserve_name(env.get("SLURM_JOB_NAME", ""))
        if env.get("SLURM_JOB_ID") != job_id and (reserve is None or reserve[1] != job_id):
            continue  # neither the job nor a reserve job whose nodes run its ranks
        if "SLURM_STEP_ID" not in env or env.get("SLURM_STEP_ID") == "batch":
            continue
        try:
            comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if comm == rank_process_name(rank):
            named.add(entry.name)
        elif comm.startswith("nw-"):
            continue  # another rank, or a node task (its SLURM_PROCID is its node's)
        elif env.get("SLURM_PROCID") == str(rank) and b"python" in cmd:
            found.add(entry.name)
    # A rank's own helpers inherit its name or environment: the one whose parent is not one.
    candidates = named or found
    tops = [p for p in candidates if _ppid(p) not in candidates]
    return int(min(tops, key=int)) if tops else None


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    marker = ckpt_dir / "latest"
    try:
        step = int(marker.read_text().strip())
    except (OSError, ValueError):
        return None
    path = ckpt_dir / f"iter_{step:07d}"
    return path if path.is_dir() else None


#: Whole minutes a cut walltime leaves past the time used: at least 60 s left, so the USR2
#: warning (slurmctld checks limits and signals every ~30 s) arrives before TIMEOUT. With one
#: minute, a job 58 s into its minute was killed 2 s after the cut, before any warning, and
#: SLURM requeues no TIMEOUT: the baseline's chaining never had a chance.
WALLTIME_LEFT_MIN = 2


def elapsed_minutes(text: str) -> int:
    """squeue's TimeUsed (`[d-]h:m:s` or `m:s`) in whole minutes."""
    days, _, rest = text.strip().rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, _ = parts
    return int(days or 0) * 1440 + h * 60 + m


@dataclass
class Injector:
    """Does external faults to one system under test and undoes the temporary ones."""

    cluster: Cluster
    supervisor: Supervisor | None = None
    sd_url: str | None = None
    sd_token: str | None = None
    requeueable: bool = False
    followups: list[FollowUp] = field(default_factory=list)
    dead_nodes: list[str] = field(default_factory=list)

    def inject(self, fault: ScheduledFault, job: JobView) -> str:
        kind, p = fault.kind, fault.params
        if kind in (FaultKind.RANK_CRASH, FaultKind.CORRUPT_CHECKPOINT):
            pid = self._rank_pid(job, int(p["rank"]))
            note = ""
            if kind is FaultKind.CORRUPT_CHECKPOINT:
                note = self._corrupt(job.checkpoint_dir, p["checkpoint_step"]) + "; "
            os.kill(pid, signal.SIGKILL)
            return note + f"SIGKILL rank {p['rank']} (pid {pid}) of job {job.job_id}"
        if kind is FaultKind.NODE_DEATH:
            return self._node_death(job, int(p["job_node"]))
        if kind is FaultKind.PREEMPTION:
            return self._preempt(job)
        if kind is FaultKind.WALLTIME:
            return self._walltime(job)
        if kind is FaultKind.PROMETHEUS_RESTART:
            return self._prometheus(float(p["down_s"]))
        if kind is FaultKind.SLURMCTLD_RESTART:
            self.cluster.stop_slurmctld()
            self._later(float(p["down_s"]), "slurmctld back", self.cluster.start_slurm_only)
            return f"slurmctld stopped for {p['down_s']}s"
        if kind is FaultKind.SUPERVISOR_KILL:
            if self.supervisor is None:
                return "n/a: no supervisor"
            self.supervisor.kill()
            self._later(float(p["down_s"]), "supervisor back", self.supervisor.start)
            return f"supervisor SIGKILLed, back in {p['down_s']}s"
        raise ValueError(f"{kind} is injected by the training program, not the driver")

    def _rank_pid(self, job: JobView, rank: int) -> int:
        if job.job_id is None:
            raise NoTarget("no job to crash")
        pid = rank_process(job.job_id, rank)
        if pid is None:
            raise NoTarget(f"rank {rank} of job {job.job_id} is not running")
        return pid

    def _corrupt(self, ckpt_dir: Path, expected: int) -> str:
        ckpt = newest_checkpoint(ckpt_dir)
        if ckpt is None:
            return "no checkpoint to corrupt"
        victim = truncate_largest(ckpt)
        step = int(ckpt.name.removeprefix("iter_"))
        drift = "" if step == expected else f" (scheduled {expected})"
        return f"truncated {victim.name if victim else '-'} of step {step}{drift}"

    def _node_death(self, job: JobView, slot: int) -> str:
        """Freeze the node in the job's place `slot` (the last one in a smaller job)."""
        if not job.nodes:
            raise NoTarget("no job to kill a node of")
        node = job.nodes[min(slot, len(job.nodes) - 1)]
        self.cluster.kill_node(node)
        self.dead_nodes.append(node)
        return f"froze {node} (job node {slot})"

    def _preempt(self, job: JobView) -> str:
        """A preemption as SLURM does it: TERM to the job's tasks, a kill after the grace time
        (a requeueable job is requeued instead of cancelled, as PreemptMode=REQUEUE would)."""
        if job.job_id is None:
            raise NoTarget("no job to preempt")
        job_id = job.job_id
        started = slurm(self.cluster, "squeue", "-h", "-j", job_id, "-o", "%S").strip()
        slurm(self.cluster, "scancel", "--signal=TERM", job_id)

        def finish() -> None:
            # Only the run that was preempted: a requeued job runs again with a new start time.
            now = slurm(self.cluster, "squeue", "-h", "-j", job_id, "-o", "%T|%S").strip()
            if now == f"RUNNING|{started}":
                cmd = ["scontrol", "requeue", job_id] if self.requeueable else ["scancel", job_id]
                slurm(self.cluster, *cmd)

        self._later(PREEMPT_GRACE_S, "preemption grace over", finish)
        return f"TERM to job {job_id}, killed after {PREEMPT_GRACE_S:.0f}s if still running"

    def _walltime(self, job: JobView) -> str:
        """Cut the job's time limit to `WALLTIME_LEFT_MIN` minutes past the time used: SLURM's
        own walltime machinery (the USR2 warning, then TIMEOUT) does the rest. A requeued job
        keeps its limit, so for a requeueable job the original limit is put back once it was
        requeued."""
        if job.job_id is None:
            raise NoTarget("no job to cut the walltime of")
        job_id = job.job_id
        times = slurm(self.cluster, "squeue", "-h", "-j", job_id, "-o", "%M|%l|%S")
        used, limit, started = times.strip().split("|")
        minutes = elapsed_minutes(used) + WALLTIME_LEFT_MIN
        slurm(self.cluster, "scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")
        if self.requeueable:

            def requeued() -> bool:
                now = slurm(self.cluster, "squeue", "-h", "-j", job_id, "-o", "%T|%S").strip()
                return now != f"RUNNING|{started}"

            def restore() -> None:
                # SLURM requeues no TIMEOUT: a job whose own requeue came too late has ended,
                # and that is the system's outcome to score, not the driver's error.
                try:
                    slurm(
                        self.cluster, "scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"
                    )
                except RuntimeError as exc:
                    if "already finished" not in str(exc):
                        raise

            self.followups.append(
                FollowUp(time.time() + 5, "walltime limit restored", restore, ready=requeued)
            )
        return f"time limit of job {job_id} cut to {minutes} min (used {used}, was {limit})"

    def _prometheus(self, down_s: float) -> str:
        if self.sd_url is None:
            return "n/a: this system reads no metrics"
        self.cluster.stop_prometheus()
        url, token = self.sd_url, self.sd_token or ""
        self._later(down_s, "prometheus back", lambda: self.cluster.restart_prometheus(url, token))
        return f"prometheus stopped for {down_s:.0f}s"

    def _later(self, delay_s: float, label: str, action: Callable[[], None]) -> None:
        self.followups.append(FollowUp(time.time() + delay_s, label, action))

    def tick(self, now: float) -> list[str]:
        """Run the follow-ups that are due and ready; returns what was done."""
        done = []
        for f in list(self.followups):
            try:
                if f.due > now or not f.ready():
                    continue
                f.action()
            except NoTarget:
                continue  # the controller did not answer: again at the next tick
            self.followups.remove(f)
            done.append(f.label)
        return done

    def finish(self) -> list[str]:
        """Undo every temporary fault now (services back up), whatever is still pending."""
        done = []
        for f in list(self.followups):
            self.followups.remove(f)
            try:
                f.action()
                done.append(f.label)
            except Exception as exc:  # cleanup goes on; the failure is reported
                done.append(f"{f.label} failed: {exc}")
        return done

    def revive_all(self) -> None:
        for node in self.dead_nodes:
            self.cluster.revive_node(node)
        self.dead_nodes.clear()
