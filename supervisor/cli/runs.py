"""Run commands over the REST API (`submit`, `runs`, `status`, `cancel`, `events`) and the
local `validate`."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from supervisor.cli._app import app
from supervisor.cli._common import FINAL_STATES, Api, JsonOption, echo_json, fail, load_spec


def _print_layout(report: dict[str, Any]) -> None:
    mem = report["memory_per_gpu_gb"]
    typer.echo(f"parameters            {report['parameters']:,} "
               f"({report['model_states_total_gb']} GB of model states)")  # fmt: skip
    typer.echo(f"world size            {report['world_size']} "
               f"(requested {report['requested_gpus']} GPUs)")  # fmt: skip
    typer.echo(f"microbatches / step   {report['microbatches_per_step']}")
    typer.echo(f"tokens / step         {report['tokens_per_step']:,}")
    if report["steps_for_token_budget"] is not None:
        typer.echo(f"steps for budget      {report['steps_for_token_budget']:,}")
    typer.echo("memory per GPU (GB)   " + ", ".join(
        f"{k} {mem[k]}" for k in
        ("weights", "gradients", "optimizer_states", "activations", "fragmentation", "overhead",
         "total")
    ) + f" of {mem['capacity']}")  # fmt: skip
    for p in report["problems"]:
        typer.echo(f"{p['severity']}: {p['field']}: {p['message']}")


@app.command()
def validate(
    spec: Path,
    as_json: JsonOption = False,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="Also train the spec's features at a tiny size on this host (CPU ranks, or "
            "the local GPUs) for 3 steps with a checkpoint and a resume; exit 1 if it fails.",
        ),
    ] = False,
    smoke_timeout: Annotated[
        float, typer.Option(min=10, help="Seconds the smoke check may take.")
    ] = 300.0,
) -> None:
    """Check a spec locally and print its layout report; exit 1 if it cannot run."""
    from supervisor.layout import layout_report

    run_spec = load_spec(spec)
    report = layout_report(run_spec).as_dict()
    if not as_json:
        _print_layout(report)
    if smoke and report["ok"]:
        from supervisor.cli._smoke import smoke_check

        report["smoke"] = smoke_check(run_spec, smoke_timeout, quiet=as_json)
    elif smoke and not as_json:
        typer.echo("smoke: skipped, the layout cannot run")
    if as_json:
        echo_json(report)
    if not report["ok"] or not report.get("smoke", {"ok": True})["ok"]:
        raise typer.Exit(1)


@app.command()
def submit(
    spec: Path,
    wait: Annotated[bool, typer.Option(help="Follow the run until it ends.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Default: a fresh UUID (safe to retry this command).")
    ] = None,
    poll_seconds: Annotated[float, typer.Option(min=0.1)] = 5.0,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the sbatch parameters and batch script of the first attempt "
            "(this host's settings); submit nothing.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Submit a run; prints its id (JSON: the run, at the end with --wait; with --dry-run the
    preview). With --wait, exit 0 only if it succeeds."""
    if dry_run:
        _print_preview(load_spec(spec), as_json)
        return
    body = json.loads(load_spec(spec).model_dump_json())
    api = Api()
    key = idempotency_key or str(uuid.uuid4())
    run = api.json("POST", "/v1/runs", json=body, headers={"Idempotency-Key": key})
    if not as_json:
        typer.echo(run["id"])
    elif not wait:
        echo_json(run)
    if not wait:
        return
    now, shown, after = run, None, 0
    state = now["state"]
    while state not in FINAL_STATES:
        time.sleep(poll_seconds)
        now = api.json("GET", f"/v1/runs/{run['id']}")
        page = api.json("GET", f"/v1/runs/{run['id']}/events", params={"after": after})
        for e in page["items"]:
            if e["kind"] in ("incident", "action_intent"):
                typer.echo(f"{run['id']}: {e['kind'].replace('_', ' ')}: {e['message']}", err=True)
        after = page["next_after"] or after
        line = progress_text(now["progress"])
        if now["state"] != state or line != shown:
            typer.echo(f"{run['id']}: {now['state']}  {line}".rstrip(), err=True)
        state, shown = now["state"], line
    if as_json:
        echo_json(now)
    if state != "succeeded":
        fail(f"run {run['id']} ended {state}")


def progress_text(p: dict[str, Any] | None) -> str:
    """`step 120/1000 (12%)  loss 3.21  1,234 tok/s  ETA 1h02m  ckpt 100  ETTR 0.97`."""
    if not p:
        return ""
    parts = [f"step {p['step']}/{p['target_steps']} ({100 * p['step'] // p['target_steps']}%)"]
    if p["loss"] is not None:
        parts.append(f"loss {p['loss']:.4g}")
    if p["tokens_per_second"]:
        parts.append(f"{p['tokens_per_second']:,.0f} tok/s")
    if p["eta_seconds"] is not None:
        parts.append(f"ETA {duration(p['eta_seconds'])}")
    if p["checkpoint_step"] is not None:
        parts.append(f"ckpt {p['checkpoint_step']}")
    if p["ettr"] is not None:
        parts.append(f"ETTR {p['ettr']:.2f}")
    return "  ".join(parts)


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _print_preview(spec: Any, as_json: bool) -> None:
    from supervisor.preview import sbatch_preview
    from supervisor.settings import Settings

    preview = sbatch_preview(spec, Settings.from_env())
    if as_json:
        echo_json(preview)
        return
    typer.echo(f"# sbatch parameters (run id {preview['run_id']} stands in for the real one)")
    for name, value in sorted(preview["parameters"].items()):
        typer.echo(f"#   {name} = {value}")
    typer.echo("# job environment: " + ", ".join(sorted(preview["environment"])))
    typer.echo(preview["script"], nl=False)


@app.command("runs")
def list_runs(
    state: Annotated[list[str] | None, typer.Option(help="Filter; repeatable.")] = None,
    name: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1, max=200)] = 50,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    as_json: JsonOption = False,
) -> None:
    """List runs, newest first."""
    params: dict[str, Any] = {"limit": limit, "offset": offset, "state": state or []}
    if name:
        params["name"] = name
    page = Api().json("GET", "/v1/runs", params=params)
    if as_json:
        echo_json(page)
        return
    typer.echo(f"{'RUN':<15} {'STATE':<15} {'NAME':<24} {'STEP':>15} {'ETA':>8} "
               f"{'ATTEMPT':>7}  CREATED")  # fmt: skip
    for r in page["items"]:
        p = r["progress"] or {}
        step = p.get("step", r["last_step"])
        steps = f"{'-' if step is None else step}/{r['target_steps']}"
        eta = duration(p["eta_seconds"]) if p.get("eta_seconds") is not None else "-"
        typer.echo(f"{r['id']:<15} {r['state']:<15} {r['name']:<24} {steps:>15} {eta:>8} "
                   f"{r['current_attempt']:>7}  {r['created_at'][:19]}")  # fmt: skip
    typer.echo(f"{len(page['items'])} of {page['total']} runs", err=True)


@app.command()
def status(run: str, as_json: JsonOption = False) -> None:
    """Show one run and its attempts."""
    r = Api().json("GET", f"/v1/runs/{run}")
    if as_json:
        echo_json(r)
        return
    for key in (
        "id",
        "name",
        "state",
        "state_reason",
        "cancel_requested",
        "current_attempt",
        "last_step",
        "target_steps",
        "skip_ranges",
        "excluded_nodes",
        "created_at",
    ):
        typer.echo(f"{key:<17} {r[key]}")  # fmt: skip
    typer.echo(f"{'progress':<17} {progress_text(r['progress']) or '-'}")
    for a in r["attempts"]:
        typer.echo(f"attempt {a['number']}: job {a['job_id']} {a['state']} on {a['nodes']} "
                   f"exit {a['exit_code']} {a['end_reason'] or ''}".rstrip())  # fmt: skip


@app.command()
def cancel(run: str) -> None:
    """Cancel a run (immediate if not yet submitted)."""
    r = Api().json("POST", f"/v1/runs/{run}/cancel")
    note = " (cancel requested; the supervisor stops the job)" if r["state"] != "cancelled" else ""
    typer.echo(f"{r['id']}: {r['state']}{note}")


@app.command()
def resume(
    run: str,
    from_step: Annotated[
        int | None, typer.Option(min=0, help="A complete checkpoint's step; default the newest")
    ] = None,
) -> None:
    """Resume a run that needs attention (the supervisor starts a new attempt)."""
    body = {} if from_step is None else {"from_step": from_step}
    r = Api().json("POST", f"/v1/runs/{run}/resume", json=body)
    typer.echo(f"{r['id']}: resume requested; the supervisor starts the next attempt")


def _skip_range(text: str) -> tuple[int, int]:
    start, _, end = text.partition(":")
    try:
        return int(start), int(end)
    except ValueError:
        fail(f"--skip-samples takes START:END, got {text!r}")


@app.command()
def rollback(
    run: str,
    to_step: Annotated[int, typer.Option(min=0, help="A complete checkpoint's step")],
    skip_samples: Annotated[
        list[str] | None, typer.Option(help="START:END global sample range; repeatable")
    ] = None,
) -> None:
    """Stop the run's job and resume from a checkpoint, skipping sample ranges."""
    ranges = [list(_skip_range(t)) for t in skip_samples or []]
    body = {"to_step": to_step, "skip_samples": ranges}
    r = Api().json("POST", f"/v1/runs/{run}/rollback", json=body)
    typer.echo(f"{r['id']}: rollback to step {to_step} requested")


@app.command()
def events(
    run: str,
    after: Annotated[int, typer.Option(min=0)] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 1000,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events until the run ends")
    ] = False,
    poll_seconds: Annotated[float, typer.Option(min=0.1)] = 2.0,
    as_json: JsonOption = False,
) -> None:
    """Print a run's timeline: state changes, incidents, actions, with evidence (JSON: one
    page, or with --follow one event per line)."""
    api = Api()
    ended = False
    while True:
        page = api.json("GET", f"/v1/runs/{run}/events", params={"after": after, "limit": limit})
        if as_json and not follow:
            echo_json(page)
            return
        for e in page["items"]:
            if as_json:
                echo_json(e, lines=True)
                continue
            attempt = f"[{e['attempt']}] " if e["attempt"] is not None else ""
            data = f"  {json.dumps(e['data'])}" if e["data"] else ""
            typer.echo(f"{e['ts']}  {e['kind']:<15} {attempt}{e['message']}{data}")
        after = page["next_after"] or after
        if not follow or (ended and not page["items"]):
            return
        if not page["items"]:
            # Seen ended: one more read drains the events written before the state was read.
            ended = api.json("GET", f"/v1/runs/{run}")["state"] in FINAL_STATES
            if not ended:
                time.sleep(poll_seconds)
