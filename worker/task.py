"""The submitit callable: one instance is pickled per attempt, every task of the job runs it.

A task is one rank, or (`ranks_per_task` > 1, the launcher's default: one task per node) a
node whose ranks it forks after importing the training program once (`worker.ranks`).

Why a frozen dataclass of plain values: it must pickle (and unpickle in a fresh interpreter)
without the supervisor's modules. It sets the torch.distributed environment from the task,
registers the node's metrics endpoint (local rank 0 of each node, per the contract), runs the
training entry point and turns its result into the process exit code the supervisor reads
(75 = checkpointed on USR2/TERM, requeue me). It has no `checkpoint` method on purpose: the
supervisor, not submitit, decides requeues.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import NoReturn

from contracts import exitcodes
from contracts.restart import (
    MEMORY_TIER_SLOTS,
    RestartOrder,
    exit_code_path,
    failed_exit,
    job_control_dir,
    leave_requested,
    mark_standby_ready,
    memory_tier_env,
    read_exit_codes,
    standby_ready,
)
from contracts.spec import RunSpec
from contracts.task import TrainContext, node_name
from worker.devices import missing_gpus
from worker.env import TaskInfo, dist_env, rank_infos, task_info
from worker.orders import OrderWatch
from worker.priority import lowest_priority
from worker.ranks import NODE_PROCESS_NAME, fork_ranks, leave, name_process, preload_module
from worker.registration import Registrar

log = logging.getLogger("nightwatch.worker")

#: How often a spare node looks for an order or for the end of the attempt it does not run.
SPARE_POLL_S = 0.2


class _EarlyStop:
    """Remember a USR2/TERM that lands before the trainer installs its own handlers.

    submitit's default USR2 handler would `scontrol requeue` the job behind our back, and the
    default TERM action kills without a checkpoint; nothing has trained yet, so leaving with 75
    loses no steps.

    A node task that runs no ranks (`leaving`: a spare, a standby or reserve node, a node
    waiting for a restart order) has nothing to save and leaves at once: one that only
    remembered the signal held its node until SLURM's KillWait killed it, and the next job,
    which needs the node, waited that long.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._leave_with: int | None = None
        self._context: dict[str, object] = {}

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        if self._leave_with is not None:
            self._leave_now(signum, self._leave_with)

    @contextlib.contextmanager
    def leaving(self, code: int, context: dict[str, object]) -> Iterator[None]:
        """While the body runs no ranks here: a stop signal (one seen before included) ends
        the task with `code`."""
        self._context = context
        if self.signum is not None:
            self._leave_now(self.signum, code)
        self._leave_with = code
        try:
            yield
        finally:
            self._leave_with = None

    def _leave_now(self, signum: int, code: int) -> NoReturn:
        log.info("stop signal %d on a node that runs no ranks: leaving (exit %d)", signum, code,
                 extra=self._context)  # fmt: skip
        leave(code)

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self)


@dataclass(frozen=True)
class TrainingTask:
    run_id: str
    attempt: int
    spec_json: str
    checkpoint_dir: str
    resume_step: int | None = None
    skip_ranges: tuple[tuple[int, int], ...] = ()
    stop_at_step: int | None = None
    mtbf_seconds: float | None = None
    metrics: bool = True
    entry: str = "megatron_runs.train"
    env: tuple[tuple[str, str], ...] = ()
    ranks_per_task: int = 1
    #: GPUs this task must see (one per rank on a GPU run, 0 on a CPU run).
    gpus_required: int = 0
    #: The run's directory, where the supervisor writes restart orders for this job
    #: (`contracts.restart`); None: no restart inside the job.
    run_dir: str | None = None
    #: How long a node task whose ranks failed waits for a restart order before it ends
    #: (and its job with it); 0: it ends at once, as without restarts inside the job.
    restart_wait_s: float = 0.0
    #: An attempt started by an order: its job folder (logs, exit codes), not submitit's.
    job_folder: str | None = None
    #: The attempt an order started inside the job (0: the job's first, as submitted): each
    #: such attempt rendezvous on a port of its own (`worker.env.master_port`), the same on
    #: every node, whichever orders before it the node saw.
    generation: int = 0
    #: Nodes of the job that run ranks when it starts (its first ones); the others are
    #: spares (`resources.spare_nodes`). 0: every node.
    active_nodes: int = 0
    #: The nodes an order named for this attempt, in rank order (empty: as at the start).
    nodes: tuple[str, ...] = ()
    #: The node task keeps an in-memory checkpoint tier for its ranks (restarts inside the
    #: job only: `megatron_runs.memory_tier`).
    memory_tier: bool = False
    #: A job submitted ahead of its attempt, while the one before it stops (`contracts.restart`,
    #: "A successor prepared"): every node imports the training program, then waits up to
    #: `standby_wait_s` for the order that starts attempt `attempt` (and ends without one).
    standby: bool = False
    standby_wait_s: float = 0.0
    #: The lead of the job's walltime warning (sbatch `--signal=USR2@lead`): the ranks train
    #: on through it (`megatron_runs.handover`). 0: unknown, they leave at once.
    signal_lead_s: float = 0.0
    #: A reserve job's task (`supervisor.launcher.ReserveFor`): the running job whose spares
    #: its nodes are. Its node tasks act as that job's: they read its orders, start as spares
    #: of its current attempt (`nodes`, `job_folder`) and run the ranks an order gives them
    #: with its job id (logs, exit codes, rendezvous port).
    reserve_for: str | None = None

    def __call__(self) -> NoReturn:
        early = _EarlyStop()
        early.install()
        # The launcher's environment (docs/contracts.md), set before torch is imported.
        os.environ.update(dict(self.env))
        _configure_logging()
        info = task_info()
        log.info("task begin node=%s", node_name(), extra=self._context(info.job_id))
        if self.reserve_for is not None:
            log.info("reserve job %s: spare of job %s", info.job_id, self.reserve_for,
                     extra=self._context(self.reserve_for))  # fmt: skip
            info = replace(info, job_id=self.reserve_for)
        # torch.cuda.is_available() (cpu_compat calls it on import) asks the driver for its
        # devices unless told to ask NVML, and a CUDA driver touched before a fork fails in the
        # children: every forked rank on a GPU node would fail to select its device.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        ranks = rank_infos(info, self.ranks_per_task)
        missing = missing_gpus(self.gpus_required, node_name())
        if missing is not None:
            log.error(missing, extra=self._context(ranks[0].job_id))
            for rank in ranks:
                _record_exit(rank, exitcodes.NO_GPU)
            leave(exitcodes.NO_GPU)
        if len(ranks) == 1 and not self.restart_wait_s:
            leave(self._rank(ranks[0], early))
        code = 1
        try:
            # a node that runs no ranks yet imports with what CPU training leaves idle
            idle = self._scheduled(info) is None
            context = self._context(info.job_id)
            leaving = (
                early.leaving(exitcodes.REQUEUE, context) if idle else contextlib.nullcontext()
            )
            with (
                leaving,
                lowest_priority(idle, context, needed=self._needed(info) if idle else None),
            ):
                preload_module(self.entry)
            name_process(NODE_PROCESS_NAME)
            code = self._node(info, early)
        except BaseException:
            traceback.print_exc()  # the node task itself failed: every rank counts as failed
            for rank in ranks:
                _record_exit(rank, code)
        leave(code)

    def _node(self, info: TaskInfo, early: _EarlyStop) -> int:
        """Run this attempt's ranks on the node, then each attempt the supervisor orders into
        the job: an order kills the ranks still running (a hang, a rollback) and forks the
        new attempt's; ranks that failed wait `restart_wait_s` for one. A node the attempt
        does not use (a spare) waits for the order that uses it, or for the attempt's end.
        The node's outcome once no order came (or restarts inside the job are off)."""
        task = self
        tiers = _memory_tiers(self.ranks_per_task) if self.memory_tier and self.orders else {}
        while True:
            watch = task._order_watch(info)
            placed = task._scheduled(info)
            if placed is None:
                assert watch is not None  # spares exist only with restarts inside the job
                with early.leaving(exitcodes.REQUEUE, task._context(info.job_id)):
                    order = task._spare(info, watch)
                if order is None:
                    return exitcodes.OK
            else:
                ranks = rank_infos(placed, task.ranks_per_task)
                code = fork_ranks(
                    ranks,
                    functools.partial(task._rank, early=early, tiers=tiers),
                    leave,
                    interrupt=watch.newer if watch else None,
                    on_ended=_record_unrecorded_exit if watch else None,
                )
                order = watch.order if watch else None
                if code is not None:
                    if watch is None or code in exitcodes.CLEAN_EXITS:
                        return task._outcome(info, ranks, code)
                    context = task._context(info.job_id)
                    log.warning("ranks failed (exit %d): waiting %.0f s for a restart order",
                                code, task.restart_wait_s, extra=context)  # fmt: skip
                    outcome = task._outcome(info, ranks, code)
                    with early.leaving(outcome, context):
                        order = watch.wait(task.restart_wait_s)
                    if order is None:
                        return outcome
            assert order is not None
            task = task._ordered(order, info.job_id)
            log.info("restart in job: attempt %d from step %s", order.attempt,
                     order.resume_step, extra=task._context(info.job_id))  # fmt: skip

    def _outcome(self, info: TaskInfo, ranks: Sequence[TaskInfo], code: int) -> int:
        """The node's outcome, with its ranks' codes of the attempt it ends with copied into
        the job's own folder: the job's record of how its tasks ended (the local executor's
        only one) is the last attempt's, not the first's."""
        if self.job_folder is not None and info.folder:
            mine = {r.global_rank for r in ranks}
            for rank, rank_code in read_exit_codes(Path(self.job_folder), info.job_id):
                if rank in mine:
                    exit_code_path(Path(info.folder), info.job_id, rank).write_text(str(rank_code))
        return code

    def _order_watch(self, info: TaskInfo) -> OrderWatch | None:
        """A watch on the job's restart orders (None: no restarts inside this job)."""
        if not self.orders:
            return None
        return OrderWatch(job_control_dir(Path(self.run_dir), info.job_id), self.follows)

    def _needed(self, info: TaskInfo) -> Callable[[], bool] | None:
        """Whether an order that runs ranks on this node came (None: no orders here)."""
        watch = self._order_watch(info)
        if watch is None:
            return None

        def needed() -> bool:
            if not watch.newer():
                return False
            assert watch.order is not None
            return node_name() in self._ordered(watch.order, info.job_id)._nodes(info)

        return needed

    @property
    def orders(self) -> bool:
        """Whether the supervisor's orders reach this job's node tasks (restarts inside it)."""
        return bool(self.run_dir and self.restart_wait_s)

    @property
    def follows(self) -> int:
        """The attempt after which this node task acts on orders: a standby job's order
        starts its own attempt, any other job's the next one."""
        return self.attempt - 1 if self.standby else self.attempt

    def _spare(self, info: TaskInfo, watch: OrderWatch) -> RestartOrder | None:
        """Idle through an attempt that runs on other nodes: the next order (which may use
        this node), or None once the attempt's ranks all ended and no order followed within
        `restart_wait_s` (at once when they all ended cleanly: the job is done). A standby
        job's nodes wait `standby_wait_s` for the order that starts their attempt."""
        if self.standby:
            if self.run_dir and node_name() in self._nodes(info):
                mark_standby_ready(Path(self.run_dir), self.attempt, node_name())
            log.info("standby: waiting %.0f s for the order", self.standby_wait_s,
                     extra=self._context(info.job_id))  # fmt: skip
            return watch.wait(self.standby_wait_s)
        world = len(self._nodes(info)) * self.ranks_per_task
        folder = Path(self.job_folder or info.folder or ".")
        log.info("spare node: waiting for an order", extra=self._context(info.job_id))
        ended_at: float | None = None
        while not watch.newer():
            if ended_at is None:
                codes = read_exit_codes(folder, info.job_id)
                if len(codes) >= world:
                    if failed_exit(codes) is None:
                        return None
                    ended_at = time.monotonic()
            elif time.monotonic() - ended_at >= self.restart_wait_s:
                return None
            time.sleep(SPARE_POLL_S)
        return watch.order

    def _ordered(self, order: RestartOrder, job_id: str) -> TrainingTask:
        """This task as the order's attempt: its resume point, skips, nodes and folder."""
        env = {**dict(self.env), "NIGHTWATCH_ATTEMPT": str(order.attempt)}
        return replace(
            self,
            attempt=order.attempt,
            resume_step=order.resume_step,
            skip_ranges=tuple(order.skip_ranges),
            stop_at_step=order.stop_at_step,
            mtbf_seconds=order.mtbf_seconds,
            env=tuple(sorted(env.items())),
            job_folder=str(Path(order.log_dir) / job_id),
            generation=order.attempt,
            nodes=tuple(order.nodes) or self.nodes,
            standby=False,
        )

    def _nodes(self, info: TaskInfo) -> tuple[str, ...]:
        """The nodes that run this attempt's ranks, in rank order: the order's, else the
        job's first `active_nodes` (all of them without spares)."""
        if self.nodes:
            return self.nodes
        hosts = tuple(info.hostnames)
        return hosts[: self.active_nodes] if self.active_nodes else hosts

    def _scheduled(self, info: TaskInfo) -> TaskInfo | None:
        """The node's task as this attempt sees it (its place among the attempt's nodes, its
        folder and rendezvous generation), or None on a node the attempt does not use."""
        if self.job_folder is not None:
            Path(self.job_folder).mkdir(parents=True, exist_ok=True)
            info = replace(info, folder=self.job_folder, generation=self.generation)
        if self.standby:
            return None
        if not self.active_nodes and not self.nodes:
            return info
        nodes = self._nodes(info)
        if node_name() not in nodes:
            return None
        return replace(
            info,
            hostnames=nodes,
            global_rank=nodes.index(node_name()),
            num_tasks=len(nodes),
            num_nodes=len(nodes),
        )

    def _handover_ready(self, job_id: str, nodes: int) -> Callable[[], bool] | None:
        """For ranks training on through a stop signal: whether the next attempt's standby
        nodes are all ready, or the supervisor is stopping this job (None: no orders here)."""
        if not self.orders:
            return None
        run_dir, after = Path(self.run_dir), self.attempt + 1
        control = job_control_dir(run_dir, job_id)

        def ready() -> bool:
            return standby_ready(run_dir, after, nodes) or leave_requested(control)

        return ready

    def _context(self, job_id: str) -> dict[str, object]:
        return {"run_id": self.run_id, "attempt": self.attempt, "job_id": job_id}

    def _rank(
        self, info: TaskInfo, early: _EarlyStop, tiers: dict[int, tuple[int, ...]] | None = None
    ) -> int:
        """Train as one rank; the exit code, recorded beside the job's logs."""
        code = 1
        if self.job_folder is not None:
            _log_to(Path(self.job_folder), info.job_id, info.global_rank // self.ranks_per_task)
        os.environ.update(dict(self.env))
        if tiers:
            os.environ.update(memory_tier_env(tiers[info.local_rank]))
        try:
            code = self._run(info, early)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()  # the crash blame reads it from the task's log
        finally:
            _record_exit(info, code)
        return code

    def _run(self, info: TaskInfo, early: _EarlyStop) -> int:
        os.environ.update(dist_env(info))
        # the attempt's job, which a reserve job's rank is not in (SLURM_JOB_ID is the reserve's)
        os.environ["NIGHTWATCH_JOB_ID"] = info.job_id
        node = node_name()
        context = self._context(info.job_id)
        log.info(
            "task start node=%s rank=%d/%d local_rank=%d master=%s:%s",
            node,
            info.global_rank,
            info.num_tasks,
            info.local_rank,
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
            extra=context,
        )
        gpu = _select_device(info.local_rank)
        if gpu is not None:
            log.info("task device node=%s rank=%d gpu=%s", node, info.global_rank, gpu,
                     extra=context)  # fmt: skip
        module = importlib.import_module(self.entry)
        spec = RunSpec.model_validate_json(self.spec_json)
        registrar = _registrar(self.run_id, self.attempt, node)
        ctx = TrainContext(
            run_id=self.run_id,
            attempt=self.attempt,
            node=node,
            checkpoint_dir=Path(self.checkpoint_dir),
            resume_step=self.resume_step,
            skip_ranges=[tuple(r) for r in self.skip_ranges],
            metrics_port=0 if self.metrics else None,
            on_metrics_ready=registrar.start if registrar else None,
            stop_at_step=self.stop_at_step,
            mtbf_seconds=self.mtbf_seconds,
            signal_lead_s=self.signal_lead_s,
            handover_ready=self._handover_ready(info.job_id, spec.resources.nodes),
        )
        if early.signum is not None:
            log.warning("stop signal %d before training started", early.signum, extra=context)
            return exitcodes.REQUEUE
        try:
            result = module.train(spec, ctx)
        finally:
            if registrar:
                registrar.stop()
            # A walltime/preemption warning after training ended is moot; SIG_IGN (unlike a
            # Python handler) survives interpreter shutdown, so it cannot kill a finished task.
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        code = int(getattr(result, "exit_code", 0) or 0)
        log.info("task end exit_code=%d", code, extra=context)
        return code


def _memory_tiers(ranks_per_node: int) -> dict[int, tuple[int, ...]]:
    """Per local rank, the memfds of its in-memory checkpoint slots: created here, before the
    ranks are forked (who inherit them), and held open by the node task so that what a rank
    saved there outlives it; they are freed with the task, at the job's end."""
    return {
        local: tuple(
            os.memfd_create(f"nw-memory-tier-{local}-{slot}") for slot in range(MEMORY_TIER_SLOTS)
        )
        for local in range(ranks_per_node)
    }


def _record_exit(info: TaskInfo, code: int) -> None:
    """`<job folder>/<job>_<rank>_exit_code`: the local executor's only record of task codes
    (its controller exits 0 whatever the tasks did); on SLURM it is evidence beside sacct, and
    in a job that outlives its ranks (restarts inside the job) it is how the attempt ends."""
    if info.folder:
        exit_code_path(Path(info.folder), info.job_id, info.global_rank).write_text(str(code))


def _record_unrecorded_exit(info: TaskInfo, code: int) -> None:
    """The code of a rank that ended without recording it (killed by a signal, or `os._exit`):
    the supervisor learns from these files that the attempt ended while the job runs on."""
    path = exit_code_path(Path(info.folder), info.job_id, info.global_rank) if info.folder else None
    if path is not None and not path.exists():
        _record_exit(info, code)


def _log_to(folder: Path, job_id: str, task: int) -> None:
    """Send this rank's output to the attempt's own log file, named as submitit names a task's
    (`<job>_<task>_log.out`, stderr with stdout as the launcher asks), where every reader of an
    attempt's logs looks."""
    sys.stdout.flush()
    sys.stderr.flush()
    path = folder / f"{job_id}_{task}_log.out"
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)


def _registrar(run_id: str, attempt: int, node: str) -> Registrar | None:
    """A registrar when the launcher passed a supervisor URL (docs/contracts.md)."""
    url = os.environ.get("NIGHTWATCH_URL")
    if not url:
        return None
    return Registrar(url, os.environ.get("NIGHTWATCH_WORKER_TOKEN"), run_id, attempt, node)


def _select_device(local_rank: int) -> str | None:
    """One GPU per rank when there are GPUs (CPU, gloo, otherwise); the GPU's UUID, which
    tells ranks on distinct GPUs from ranks sharing one whatever the indices say."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return str(torch.cuda.get_device_properties(index).uuid)


def _configure_logging() -> None:
    from contracts.logs import configure_logging

    configure_logging()
