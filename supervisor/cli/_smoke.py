"""`nightwatch validate --smoke`: the spec's features trained at a tiny size on this host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from contracts.spec import RunSpec


def smoke_check(spec: RunSpec, timeout_s: float, quiet: bool) -> dict[str, Any]:
    """Shrink, announce (unless `quiet`: --json prints only the report), run; the result as
    a dict for the JSON report."""
    from supervisor.smoke.plan import shrink
    from supervisor.smoke.run import local_gpus, run_smoke

    plan = shrink(spec, gpus=local_gpus())
    if not quiet:
        m, p = plan.spec.model, plan.spec.parallelism
        typer.echo(
            f"smoke: {plan.ranks} {plan.device.upper()} ranks, TP {p.tensor} × PP {p.pipeline}"
            f"{f' × VPP {p.virtual_pipeline}' if p.virtual_pipeline else ''} × DP {p.data}, "
            f"{m.num_layers} layer{'s' if m.num_layers > 1 else ''}, hidden {m.hidden_size}, "
            f"{m.num_attention_heads} heads / {m.kv_groups} KV groups, seq {m.seq_length}, "
            f"{plan.spec.training.train_steps} steps with a checkpoint and a resume"
        )
        for line in plan.downgraded:
            typer.echo(f"smoke: not as the real run: {line}")
    result = run_smoke(plan, timeout_s=timeout_s).as_dict()
    result["spec"] = plan.spec.model_dump(mode="json")
    if not quiet:
        print_result(result)
    return result


def print_result(result: dict[str, Any]) -> None:
    if result["ok"]:
        typer.echo(f"smoke: PASS in {result['seconds']} s")
        return
    typer.echo(f"smoke: FAIL in the {result['phase']} phase after {result['seconds']} s: "
               f"{result['error']}")  # fmt: skip
    for line in result["tail"]:
        typer.echo(f"  {line}")
    if result["log_dir"]:
        typer.echo(f"smoke: every rank's log is in {result['log_dir']}")
