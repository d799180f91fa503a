"""Fakes for the reconciler's unit tests: a cluster and a metrics source the test steers.

They implement the same interfaces as `supervisor.slurm.Cluster` and
`supervisor.metrics_in.MetricSource`; the database, store, policy and actuator are real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from contracts.checkpoints import step_dir, write_meta
from supervisor.metrics_in import MetricSample, MetricsView, SourceHealth
from supervisor.slurm import (
    JobRequest,
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    NodeState,
    SourceUnavailable,
    Submission,
)

TINY_SPEC = {
    "name": "tiny",
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "vocab_size": 256,
    },
    "resources": {"device": "cpu", "nodes": 2, "gpus_per_node": 1},
    "parallelism": {"data": 2},
    "training": {"train_steps": 300, "micro_batch_size": 1, "global_batch_size": 8},
    "checkpoint": {"interval_steps": 50},
    # These tests follow remedies through a resubmission (sbatch); the restart inside the job
    # has its own (test_watchdog_restart_in_job.py).
    "recovery": {"restart_in_job": False},
}


class Crash(BaseException):
    """Stands for SIGKILL in the middle of an action: nothing after it runs."""


@dataclass
class FakeCluster:
    kind: str = "slurm"
    nodes_per_job: tuple[str, ...] = ("n1", "n2")
    states: dict[str, JobStatus] = field(default_factory=dict)
    submitted: list[tuple[str, JobRequest]] = field(default_factory=list)
    tasks: dict[str, Callable[[], object]] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    drain_reasons: dict[str, str] = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)
    poll_calls: int = 0
    down: bool = False
    crash_after_submit: bool = False
    crash_before_submit: bool = False
    next_id: int = 100

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        if self.crash_before_submit:
            self.crash_before_submit = False
            raise Crash()
        job_id = str(self.next_id)
        self.next_id += 1
        self.submitted.append((job_id, request))
        self.tasks[job_id] = fn
        nodes = tuple(n for n in self.nodes_per_job if n not in request.exclude)[: request.nodes]
        self.states[job_id] = JobStatus(job_id, JobState.PENDING, nodes)
        if self.crash_after_submit:
            self.crash_after_submit = False
            raise Crash()
        return Submission(job_id=job_id, log_dir=request.log_dir / job_id)

    def find_jobs(self, job_name: str) -> list[str]:
        return [j for j, r in self.submitted if r.job_name == job_name]

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        return False

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        return {
            j: LiveJob(r.job_name, self.states[j].nodes)
            for j, r in self.submitted
            if r.job_name.startswith(prefix) and self.states[j].state.active
        }

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        self.poll_calls += 1
        if self.down:
            raise SourceUnavailable("sacct: connection refused")
        return {j: self.states.get(j, JobStatus(j, JobState.UNKNOWN)) for j in job_ids}

    def set(self, job_id: str, state: JobState, exit_code: int | None = None) -> None:
        old = self.states[job_id]
        self.states[job_id] = JobStatus(job_id, state, old.nodes, exit_code=exit_code)

    def cancel(self, job_id: str) -> None:
        if self.down:
            raise SourceUnavailable("scancel failed")
        self.cancelled.append(job_id)
        self.set(job_id, JobState.CANCELLED)

    def requeue(self, job_id: str) -> None:
        raise NotImplementedError

    def signal(self, job_id: str, sig: str = "USR2") -> None:
        raise NotImplementedError

    def drain(self, node: str, reason: str) -> None:
        self.drained.append(node)
        self.drain_reasons[node] = reason

    def resume_node(self, node: str) -> None:
        if self.down:
            raise SourceUnavailable("scontrol failed")
        self.resumed.append(node)
        self.drain_reasons.pop(node, None)

    def nodes(self) -> dict[str, NodeInfo]:
        if self.down:
            raise SourceUnavailable("sinfo failed")
        return {
            n: NodeInfo(n, NodeState.DRAINED, self.drain_reasons[n])
            if n in self.drain_reasons
            else NodeInfo(n, NodeState.IDLE)
            for n in self.nodes_per_job
        }

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return []

    def active_jobs(self) -> list[str]:
        return [j for j, s in self.states.items() if s.state.active]


@dataclass
class FakeSource:
    """Per (run, attempt) sample lists the test appends to; `down` fails the whole source."""

    name: str = "prometheus"
    samples: dict[tuple[str, int], list[MetricSample]] = field(default_factory=dict)
    down: bool = False
    #: Each collection's probed keys and the time it was asked at.
    probes: list[tuple[float, tuple[tuple[str, int], ...]]] = field(default_factory=list)

    def collect(
        self, keys: Sequence[tuple[str, int]], now: float, probe: Collection[tuple[str, int]] = ()
    ) -> dict:
        if probe:
            self.probes.append((now, tuple(sorted(probe))))
        out = {}
        for k in keys:
            if self.down:
                out[k] = MetricsView(SourceHealth.DOWN)
            elif self.samples.get(k):
                out[k] = MetricsView(SourceHealth.UP, tuple(self.samples[k]))
            else:
                out[k] = MetricsView(SourceHealth.MISSING)
        return out


def write_checkpoint(root: Path, step: int, consumed: int, saved_at: float | None = None) -> None:
    """A complete checkpoint directory per docs/contracts.md (one small file listed)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.bin").write_bytes(b"x" * 16)
    layout = {"tensor": 1, "pipeline": 1, "data": 2}
    write_meta(d, step, consumed, 3.0, layout, saved_at=saved_at or time.time())
    (root / "latest").write_text(json.dumps(step))


class Hook:
    """A loopback webhook that fails the first `failures` posts, or hangs when `hang` is set."""

    def __init__(self, failures: int = 0, hang: float = 0.0) -> None:
        self.failures, self.hang = failures, hang
        self.received: list[dict] = []
        self.posts = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts += 1
                if hook.hang:
                    time.sleep(hook.hang)
                if hook.posts <= hook.failures:
                    self.send_response(503)
                else:
                    hook.received.append(json.loads(body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
