"""`nightwatch demo`: the whole loop on one machine, with no SLURM and no Prometheus server.

It starts the supervisor in this process (SQLite under a fresh home, the API on a free
loopback port so the workers can register their metrics endpoints, the reconciler with
submitit's local executor and the direct-scrape source), submits a tiny CPU Megatron-Core run
whose data has a poisoned window, prints progress and every event as it happens (detection →
rollback + skip → recovery), and ends with the run's report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from supervisor.cli._app import app

# Global batch 8: step s reads samples [8(s-1), 8s). Checkpoints every 10 steps; the poisoned
# window spans steps 36-59 (longer than the metrics' 16-step window, so the spike is seen as
# sustained however fast the steps run), so the watchdog must roll back to step 30 and skip it.
BATCH = 8
POISON = (35 * BATCH, 59 * BATCH)


def demo_spec(
    steps: int, prefix: str, tokenizer: str, blend: list[str] | None = None
) -> dict[str, Any]:
    """The tiny CPU run (examples/tiny-cpu.yaml's shape) with a poisoned data window; on a
    3:1 blend of `blend`'s two datasets when given (`nightwatch demo`: the corpus's halves)."""
    return {
        "name": "demo-tiny-cpu",
        "model": {
            "num_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 64,
            "vocab_size": 4096,
            "precision": "fp32",
        },
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 1, "distributed_optimizer": False},
        "resources": {"device": "cpu", "nodes": 1, "gpus_per_node": 4, "cpus_per_task": 1},
        "training": {
            "train_steps": steps,
            "micro_batch_size": 2,
            "global_batch_size": BATCH,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "lr_warmup_steps": 10,
            # A validation loss on 5 % of the documents held out: the report lists it, and
            # the watchdog checks that the rollback's first evaluation did not jump.
            "eval_interval": 10,
            "eval_iters": 2,
        },
        "data": {
            **(
                {"blend": [{"prefix": blend[0], "weight": 3}, {"prefix": blend[1], "weight": 1}]}
                if blend
                else {"prefix": prefix}
            ),
            "tokenizer": tokenizer,
            "split": "95,5",
        },
        "checkpoint": {"interval_steps": 10, "keep_last": 5},
        # Practice: skip well past the bad window (DOMAIN.md: hundreds of batches at scale).
        "recovery": {
            "loss_spike_sustain_steps": 2,
            "rollback_skip_steps": 24,
            "hang_floor_seconds": 120,
        },
        "faults": [
            {"kind": "poison_data", "start_sample": POISON[0], "end_sample": POISON[1]},
        ],
    }


class _Server:
    """The API in a thread of this process, on loopback (workers register endpoints here)."""

    def __init__(self, app_: Any, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(
            app_, host="127.0.0.1", port=port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 (inherited by the local jobs' controllers, whose tracebacks on
    cancel are expected) to a file while the demo runs; the demo itself prints to stdout."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _progress(step: int | None, target: int, loss: float | None, eta: float | None) -> str:
    done = "-" if step is None else str(step)
    loss_s = "-" if loss is None else f"{loss:.3f}"
    eta_s = "-" if eta is None else f"{eta:.0f} s"
    return f"  step {done:>4}/{target}  loss {loss_s:>7}  ETA {eta_s}"


@app.command()
def demo(
    home: Annotated[
        Path | None, typer.Option(help="Working directory (default: a new temp dir)")
    ] = None,
    steps: Annotated[int, typer.Option(min=60, help="Training steps of the demo run")] = 80,
    timeout_min: Annotated[float, typer.Option(help="Give up after this many minutes")] = 10.0,
) -> None:
    """Run a tiny CPU training with a poisoned data window and watch the watchdog cure it."""
    from contracts.logs import JsonFormatter
    from contracts.spec import RunSpec
    from supervisor import store
    from supervisor.api.app import create_app
    from supervisor.api.routes.report import report_data
    from supervisor.db import Database
    from supervisor.models import RunState
    from supervisor.report import build_report, render_text
    from supervisor.settings import Settings
    from supervisor.slurm import LocalCluster
    from supervisor.watchdog.reconciler import build_reconciler
    from worker.local_launch import free_port

    warnings.filterwarnings("ignore")  # Megatron's optional-dependency notices are noise here
    home = (home or Path(tempfile.mkdtemp(prefix="nightwatch-demo-"))).resolve()
    home.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(home / "supervisor.log")
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("nightwatch")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False

    port = free_port()
    settings = Settings(
        home=home,
        executor="local",
        tick_seconds=1.0,
        port=port,
        public_url=f"http://127.0.0.1:{port}",
    )
    typer.echo(f"nightwatch demo — home {home} (logs: supervisor.log, jobs-stderr.log, runs/)")
    typer.echo("preparing the demo corpus (tokenizer + Megatron indexed dataset)…")
    from megatron_runs.data_prep import halves, prepare

    data = prepare(None, home / "data" / "demo", 4096)
    blend = halves(data)
    db = Database(settings.db_url)
    db.upgrade()
    api = create_app(settings, database=db)
    cluster = LocalCluster()
    reconciler = build_reconciler(
        settings,
        db,
        registry=api.state.registry,
        supervisor_metrics=api.state.metrics,
        cluster=cluster,
    )
    spec = RunSpec.model_validate(demo_spec(steps, data.prefix, data.tokenizer_path, blend))
    with db.write_session() as s:
        run, _ = store.create_run(s, spec, created_by="demo")
    run_id = run.id
    typer.echo(
        f"submitted run {run_id}: {steps} steps, TP 2 × PP 2 on 4 CPU processes, a 3:1 blend "
        f"of the corpus's halves with 5 % held out for a validation loss every 10 steps; "
        f"samples [{POISON[0]}, {POISON[1]}) are poisoned (steps {POISON[0] // BATCH + 1}-"
        f"{POISON[1] // BATCH})"
    )
    deadline = time.monotonic() + timeout_min * 60
    cursor = 0
    last_line = ""
    state = RunState.PENDING
    with _Server(api, port), _stderr_to(home / "jobs-stderr.log"):
        while time.monotonic() < deadline:
            started = time.monotonic()
            reconciler.tick()
            with db.session() as s:
                current = store.get_run(s, run_id)
                state, attempt, target = (
                    current.state,
                    current.current_attempt,
                    current.target_steps,
                )
                events = store.list_events(s, run_id, after=cursor, limit=100)
            for event in events:
                cursor = event.id
                typer.echo(f"  [{event.kind.value}] {event.message}")
            history = reconciler.source.history  # type: ignore[attr-defined]
            view = history.view((run_id, attempt), time.time())
            latest = view.latest
            if latest is not None and latest.last_step_ts:
                times = list(latest.step_time.values())
                eta = (target - (latest.step or 0)) * statistics.median(times) if times else None
                line = _progress(latest.step, target, latest.loss, eta) + f"  attempt {attempt}"
                if line != last_line:
                    typer.echo(line)
                    last_line = line
            if state.terminal or state is RunState.NEEDS_ATTENTION:
                break
            time.sleep(max(0.0, settings.tick_seconds - (time.monotonic() - started)))
        with db.session() as s:
            current = store.get_run(s, run_id)
            for attempt_row in store.get_attempts(s, run_id):
                if attempt_row.job_id and attempt_row.ended_at is None:
                    cluster.cancel(attempt_row.job_id)
            report = build_report(report_data(s, run_id, None, time.time(), home))
    reconciler.notifier.close(timeout_s=1)
    typer.echo("")
    typer.echo(render_text(report))
    if state is not RunState.SUCCEEDED:
        typer.echo(f"demo did not finish: run is {state.value}", err=True)
        raise typer.Exit(1)
