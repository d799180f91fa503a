"""Chaos soak: a seeded fault schedule against Nightwatch and a naive baseline, on the real stack.

Real parts: a local SLURM cluster (scripts/devcluster, one slurmd per node, nodes frozen to
die), Prometheus discovering workers through the supervisor, a PostgreSQL-backed supervisor
(API + reconciler, SIGKILLed on schedule), and CPU Megatron-Core GPT training (TP 1 × PP 2 ×
DP 2 over 2 nodes, and a spare node in Nightwatch's job that a node fault moves to). In order:
Nightwatch under the schedule, the exact reference (the baseline's script without faults,
planned from Nightwatch's history so that it sees the same samples and applies the same
updates: `benchmarks/soak/reference.py`), the baseline under the same schedule. Prints the
seed and the schedule first and the side-by-side table last; writes everything to
`<out>/result.json`. `--minutes` is turned into steps at the pace of a short clean run of the
soak's job timed first (`baseline.measure_pace`), unless `--step-seconds` gives it.

    .venv/bin/python benchmarks/chaos_soak.py --seed 7 --minutes 20       # the full soak
    .venv/bin/python benchmarks/chaos_soak.py --short                     # ≈ 5 min, make test
    .venv/bin/python benchmarks/chaos_soak.py --short --seeds 1-20        # a seed sweep
    .venv/bin/python benchmarks/chaos_soak.py --clean --minutes 30        # no faults
    .venv/bin/python benchmarks/chaos_soak.py --clean --no-reference --steps 19000   # half the time
    .venv/bin/python benchmarks/chaos_soak.py --no-reference --steps 9000  # MTTRs, no loss check
    .venv/bin/python benchmarks/chaos_soak.py --faults poison_data,hang --steps 200
    # in two processes (a lent machine's calls are 10 min each): Nightwatch, then its reference
    .venv/bin/python benchmarks/chaos_soak.py --seed 7 --no-reference --systems nightwatch
    .venv/bin/python benchmarks/chaos_soak.py --seed 7 --systems nightwatch \
        --nightwatch-from out/soak/<stamp>-seed7/nightwatch_run.json

Exit status 0 when Nightwatch met the acceptance properties the chosen mode can show (see
`acceptance`), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak.baseline import (
    PACE_STEPS,
    PaceError,
    load_reference,
    measure_pace,
    run_baseline,
    run_reference,
    save_reference,
)
from benchmarks.soak.driver import SystemRun
from benchmarks.soak.faults import PREEMPT_GRACE_S
from benchmarks.soak.nightwatch import run_nightwatch
from benchmarks.soak.record import RUN_RECORD, RecordMismatch, from_record, to_record
from benchmarks.soak.reference import PlanError, ReferencePlan, Segment
from benchmarks.soak.reference import plan as reference_plan
from benchmarks.soak.schedule import (
    NODE_FAULTS,
    SHORT_KINDS,
    FaultKind,
    Schedule,
    SoakShape,
    draw,
    parse_kinds,
)
from benchmarks.soak.score import SystemScore, comparison, score_system
from benchmarks.soak.services import (
    REPO,
    Cluster,
    Supervisor,
    create_database,
    drop_database,
)
from supervisor.auth import Scope

JOB_NODES, PER_NODE = 2, 2
#: Idle nodes the job holds by default (`resources.spare_nodes`, `--spare-nodes`): a node fault
#: moves to one inside the running job; once they are used up, the next node fault resubmits
#: (and the new job holds as many again).
SPARE_NODES = 1
HANG_FLOOR_S = 1.0
#: The slowest step this VM has shown (s): Nightwatch's time budget when the soak's length is
#: given in steps and no pace was measured.
SLOWEST_STEP_S = 0.2
ROLLBACK_SKIP_STEPS = 8


@dataclass(frozen=True)
class Mode:
    kinds: tuple[FaultKind, ...]
    train_steps: int | None  # None: --minutes at the pace measured on this machine
    checkpoint_interval: int
    systems: tuple[str, ...]
    distributed_optimizer: bool = True
    spare_nodes: int = SPARE_NODES


def mode_from_args(args: argparse.Namespace) -> Mode:
    """--short / --clean / --faults / --minutes → what to run (pure); the steps stay open
    when --minutes waits for the measured pace."""
    default = SHORT_KINDS if args.short else tuple(FaultKind)
    kinds = () if args.clean else tuple(parse_kinds(args.faults, default))
    if args.steps:
        steps = args.steps
    elif args.short:
        steps = 150
    elif args.step_seconds:
        steps = steps_for(args.minutes, args.step_seconds)
    else:
        steps = None
    systems = ("nightwatch",) if (args.clean or args.short) else ("nightwatch", "baseline")
    if args.systems:
        systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    return Mode(
        kinds, steps, args.checkpoint_interval, systems, args.distributed_optimizer,
        args.spare_nodes,
    )  # fmt: skip


def steps_for(minutes: float, step_seconds: float) -> int:
    """Training steps that take `minutes` at `step_seconds` a step (pure)."""
    return max(1, int(minutes * 60 / step_seconds))


def cluster_size(mode: Mode) -> int:
    """Nodes of the dev cluster (pure): the job's and its spares, one for each node fault
    (each takes a node for good), and one for a node SLURM still completes when a
    resubmission is placed."""
    node_faults = sum(1 for k in mode.kinds if k in NODE_FAULTS)
    return JOB_NODES + mode.spare_nodes + node_faults + 1


def soak_spec(mode: Mode, schedule: Schedule | None, data: dict[str, str]) -> dict[str, Any]:
    """The run: a small GPT on CPU, TP 1 × PP 2 × DP 2 over 2 nodes and a spare (pure)."""
    node_faults = sum(1 for f in schedule.faults if f.kind in NODE_FAULTS) if schedule else 0
    return {
        "name": "chaos-soak",
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 64,
            "vocab_size": 4096,
            "precision": "fp32",
        },
        "parallelism": {
            "tensor": 1,
            "pipeline": 2,
            "data": 2,
            "distributed_optimizer": mode.distributed_optimizer,
        },
        "resources": {
            "device": "cpu",
            "nodes": JOB_NODES,
            "spare_nodes": mode.spare_nodes,
            "gpus_per_node": PER_NODE,
            "cpus_per_task": 1,
            # Longer than any soak: a clean run must not end at a walltime (the supervisor's
            # requeue there is a remedy); the walltime fault cuts the limit itself.
            "time_limit_minutes": 24 * 60,
        },
        "training": {
            "train_steps": mode.train_steps,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "lr": 1.0e-3,
            "min_lr": 1.0e-4,
            "lr_warmup_steps": 10,
        },
        "data": data,
        # A rollback's target must outlive the detection (seconds): 30 s of saves.
        "checkpoint": {
            "interval_steps": mode.checkpoint_interval,
            "keep_last": 3,
            "keep_seconds": 30.0,
        },
        # A CPU step is 0.06-0.2 s (by VM): the no-progress floor is only the least limit
        # (≥ 5 steps); the limit grows to hang_gap_factor (3) × the longest gap between two
        # steps the run has shown (saves, stalls under load: 1.03 s was the longest seen on
        # the slowest VM, 0.55 s over the 30,000 steps of a clean reference). A frozen node is
        # still excluded: the hang's verdict waits while a node fails its scrapes and is not
        # yet dark (`metrics_in.dark_after`); without that wait it would name nobody.
        # The trainer names a poisoned window's samples exactly (skip_margin_samples 0: just
        # them); rollback_skip_steps only widens a window known from scrapes alone.
        "recovery": {
            "hang_floor_seconds": HANG_FLOOR_S,
            # The driver's preemption kills PREEMPT_GRACE_S after its TERM, as a partition's
            # GraceTime would: the spec says so, as an operator copies the partition's.
            "preemption_grace_seconds": PREEMPT_GRACE_S,
            "max_excluded_nodes": max(2, node_faults),
            "rollback_skip_steps": ROLLBACK_SKIP_STEPS,
        },
        "faults": schedule.spec_faults() if schedule else [],
    }


#: Issue 6's effective-training-time floor, for the full schedule (every fault kind).
ETTR_MIN = 0.95


def acceptance(
    nightwatch: SystemScore,
    clean: bool,
    ettr_min: float | None = None,
    compare_loss: bool = True,
) -> list[str]:
    """The properties of issue 6 a run of this length can show; returns what failed. The
    loss must equal the exact reference's at every step (no tolerance: see `reference.py`)."""
    failed = []
    if ettr_min is not None and (nightwatch.ettr or 0.0) < ettr_min:
        failed.append(f"ETTR {nightwatch.ettr} below {ettr_min:.0%}")
    if not nightwatch.reached_target:
        failed.append(f"stopped at step {nightwatch.final_step} of {nightwatch.target_steps}")
    if compare_loss and not nightwatch.loss_equal:
        first = nightwatch.loss_mismatches[:1]
        failed.append(
            f"loss differs from the exact reference at {nightwatch.loss_steps_unequal} of "
            f"{nightwatch.loss_steps_compared} steps (first: step, loss, reference {first}); "
            f"final {nightwatch.final_loss} vs {nightwatch.reference_loss}"
        )
    elif not compare_loss and not clean:
        failed.append("final loss not compared: no fault-free reference (--no-reference)")
    if nightwatch.escalations:
        failed.append(f"{nightwatch.escalations} escalation(s)")
    if nightwatch.false_positives:
        failed.append(f"{nightwatch.false_positives} false positive(s)")
    if clean and nightwatch.remedies:
        failed.append(f"{nightwatch.remedies} remedies in a clean run")
    for f in nightwatch.faults:
        if not f.triggered:
            failed.append(f"{f.kind} at step {f.at_step} never happened ({f.note})")
        elif not f.right_action:
            why = f" ({f.note})" if f.note else ""
            failed.append(f"{f.kind}: cured by {f.cured_by}, remedies {f.remedies}{why}")
        elif not f.recovered:
            failed.append(f"{f.kind}: no recovery seen")
        elif f.samples_skipped > f.skip_allowance:
            failed.append(
                f"{f.kind}: {f.samples_skipped} samples skipped, more than the window and its "
                f"margin ({f.skip_allowance})"
            )
        elif f.cured_by == "contained" and f.steps_lost:
            failed.append(f"{f.kind}: contained, yet {f.steps_lost} steps lost")
    return failed


def exact_reference(
    nightwatch: SystemRun | None,
    spec: dict[str, Any],
    args: argparse.Namespace,
    cluster: Cluster,
    supervisor: Supervisor,
    out: Path,
    say: Callable[[str], None],
) -> SystemRun | None:
    """The reference for Nightwatch's final model (a clean run's, without Nightwatch), trained
    or reused; None when Nightwatch's history cannot be replayed (said why)."""
    gbs = int(spec["training"]["global_batch_size"])
    try:
        plan = (
            reference_plan(nightwatch.progress, spec["faults"], gbs)
            if nightwatch is not None
            else ReferencePlan((Segment(0, int(spec["training"]["train_steps"])),))
        )
    except PlanError as exc:
        say(f"no exact reference: {exc}")
        return None
    say(f"reference plan: {json.dumps(plan.to_dict())}")
    if args.reference_from:
        ref = load_reference(args.reference_from, spec, plan)
        say(f"reference reused from {args.reference_from}")
        return ref
    ref = run_reference(
        spec, plan, cluster, out / "reference", supervisor.home,
        budget_s=args.minutes * 60 * 3 + 600, say=say,
    )  # fmt: skip
    save_reference(ref, out / "reference")
    return ref


def plan_of(run: SystemRun | None) -> ReferencePlan:
    """The plan a reference run was trained by (a clean one when none was recorded)."""
    recorded = (run.extra.get("plan") if run else None) or {}
    return ReferencePlan((), (), tuple(recorded.get("emulated_steps", ())))


def prepare_data(cache: Path, vocab: int) -> dict[str, str]:
    from megatron_runs.data_prep import prepare

    prepared = prepare(None, cache, vocab)
    return {"prefix": prepared.prefix, "tokenizer": prepared.tokenizer_path}


def log_to(path: Path) -> Callable[[str], None]:
    start = time.time()

    def say(msg: str) -> None:
        line = f"[{time.time() - start:7.1f}s] {msg}"
        print(line, flush=True)
        with path.open("a") as fh:
            fh.write(line + "\n")

    return say


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="default: random, printed")
    ap.add_argument(
        "--seeds",
        type=parse_seeds,
        default=None,
        help="a sweep: run the soak once per seed (e.g. 1-20 or 3,5,11), each in its own "
        "process, one line per seed and the pass count at the end (sweep.json in --out)",
    )
    ap.add_argument("--minutes", type=float, default=20.0, help="training length to aim for")
    ap.add_argument(
        "--step-seconds",
        type=float,
        default=None,
        help="CPU step time that turns --minutes into steps; by default measured before the "
        f"soak by a {PACE_STEPS}-step clean run of its job (this VM's step took 0.05-0.18 s "
        "on different days)",
    )
    ap.add_argument("--steps", type=int, default=None, help="train_steps (overrides --minutes)")
    ap.add_argument("--checkpoint-interval", type=int, default=10)
    ap.add_argument(
        "--spare-nodes",
        type=int,
        default=SPARE_NODES,
        help="idle nodes Nightwatch's job holds for node faults (resources.spare_nodes)",
    )
    ap.add_argument("--faults", default=None, help="comma-separated kinds (default: all)")
    ap.add_argument("--short", action="store_true", help="≈ 5 minutes, 3 fault kinds")
    ap.add_argument("--clean", action="store_true", help="no faults: zero remedies expected")
    ap.add_argument("--systems", default=None, help="nightwatch,baseline (default by mode)")
    ap.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Megatron's distributed optimizer (off isolates the watchdog from resume bugs)",
    )
    ap.add_argument(
        "--reference-from",
        type=Path,
        default=None,
        help="an earlier soak's reference/ directory of the same spec and plan (the same "
        "remedies' skips and resumes), reused instead of training the reference again",
    )
    ap.add_argument(
        "--nightwatch-from",
        type=Path,
        default=None,
        help=f"an earlier soak's {RUN_RECORD} of the same seed and options: Nightwatch's run "
        "is read from it, not run again (its reference and the baseline still are)",
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="no fault-free reference run: halves the soak's time and leaves the final loss "
        "uncompared, so only a clean soak (zero remedies needs none) can pass this way; a "
        "fault soak so run measures detection, MTTR and ETTR",
    )
    ap.add_argument("--out", type=Path, default=REPO / "out" / "soak")
    ap.add_argument("--base-port", type=int, default=17900, help="devcluster's first port")
    ap.add_argument(
        "--accounting",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SLURM's accounting (slurmdbd, MariaDB); --no-accounting where MariaDB is missing "
        "(the lent GPU machines: docs/devcluster.md)",
    )
    ap.add_argument(
        "--budget-factor",
        type=float,
        default=3.0,
        help="Nightwatch may take this × steps × the step time + 600 s (it runs before the "
        "reference), the baseline this × the reference's wall time",
    )
    return ap.parse_args(argv)


def parse_seeds(text: str) -> list[int]:
    """`1-20` or `3,5,11` (or both: `1-3,7`) → seeds in order."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a seed or a range of seeds: {part!r}") from None
        if last < first:
            raise argparse.ArgumentTypeError(f"empty range of seeds: {part!r}")
        seeds.extend(range(first, last + 1))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return seeds


def sweep(args: argparse.Namespace, argv: list[str]) -> int:
    """The soak once per seed, in turn (each in a process of its own, so one seed's failure or
    crash is that seed's alone); one line per seed, then the pass count. 0 only if all pass."""
    rest = _without_seeds(argv)
    out = args.out / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    lines, passed = [], 0
    for seed in args.seeds:
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, __file__, *rest, "--seed", str(seed), "--out", str(out)],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        results = sorted(out.glob(f"*-seed{seed}/result.json"))
        failed = (
            json.loads(results[-1].read_text())["acceptance_failed"]
            if results
            else [f"no result (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"]
        )
        ok = proc.returncode == 0 and not failed
        passed += ok
        line = f"seed {seed:>3}: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f} s"
        line += "" if ok else f" — {'; '.join(failed)}"
        lines.append(line)
        print(line, flush=True)
    total = f"passed {passed} of {len(args.seeds)} seeds"
    print(total, flush=True)
    (out / "sweep.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "lines": lines, "passed": passed,
                    "seeds": args.seeds}, indent=2)
    )  # fmt: skip
    return 0 if passed == len(args.seeds) else 1


def _without_seeds(argv: list[str]) -> list[str]:
    """The command line minus --seeds and --out (the sweep sets both per seed)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--seeds", "--out", "--seed"):
            skip = True
            continue
        if a.startswith(("--seeds=", "--out=", "--seed=")):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seeds is not None:
        return sweep(args, sys.argv[1:] if argv is None else argv)
    seed = args.seed if args.seed is not None else random.randrange(1, 10**6)
    try:
        mode = mode_from_args(args)
    except ValueError as exc:  # an unknown fault kind: a usage error, not a traceback
        print(f"chaos_soak.py: error: {exc}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / f"{stamp}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    say = log_to(out / "soak.log")
    nodes = cluster_size(mode)
    cluster = Cluster(out / "cluster", nodes, args.base_port, accounting=args.accounting)
    data_dir = (args.out / "data").resolve()  # specs take absolute paths only
    data = prepare_data(data_dir, 4096)
    recorded = None
    if args.nightwatch_from:
        try:
            recorded = json.loads(args.nightwatch_from.read_text())
            if mode.train_steps is None:  # the recorded run's length, not a new pace's
                mode = replace(mode, train_steps=int(recorded["spec"]["training"]["train_steps"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"chaos_soak.py: error: {args.nightwatch_from}: {exc}", file=sys.stderr)
            return 2
    supervisor = None
    runs: dict[str, SystemRun] = {}
    db_name = f"nw_soak_{seed}_{os.getpid()}"
    try:
        db_url = create_database(db_name)
        supervisor = Supervisor(
            out / "home", db_url, cluster.prometheus_url, cluster.slurm_conf, data_dir
        )
        tokens = {
            "admin": supervisor.token("soak", [Scope.ADMIN]),
            "read": supervisor.token("prometheus", [Scope.READ]),
        }
        cluster.start(f"{supervisor.url}/v1/prometheus/targets", tokens["read"])
        supervisor.start()
        say(f"stack up: {nodes} nodes, supervisor {supervisor.url}, {cluster.prometheus_url}")
        step_s = args.step_seconds
        if mode.train_steps is None:
            probe = soak_spec(replace(mode, train_steps=PACE_STEPS), None, data)
            try:
                step_s = measure_pace(probe, cluster, out / "pace", supervisor.home, say)
            except PaceError as exc:
                say(f"FAILED: {exc}")
                return 1
            mode = replace(mode, train_steps=steps_for(args.minutes, step_s))
            say(f"pace: {step_s:.4f} s a step → {mode.train_steps} steps for {args.minutes:g} min")
        shape = SoakShape(
            mode.train_steps, mode.checkpoint_interval, 8, JOB_NODES * PER_NODE,
            cluster.node_names, JOB_NODES,
        )  # fmt: skip
        schedule = draw(seed, shape, mode.kinds) if mode.kinds else None
        say(f"seed {seed} · {mode.train_steps} steps · systems {', '.join(mode.systems)}")
        say(schedule.render() if schedule else "clean soak: no faults")
        (out / "schedule.json").write_text(schedule.to_json() if schedule else "{}")
        spec = soak_spec(mode, schedule, data)
        clean_spec = {**spec, "faults": []}
        if recorded is not None:
            try:
                recorded = from_record(recorded, spec)
            except (ValueError, KeyError, RecordMismatch) as exc:
                print(f"chaos_soak.py: error: {args.nightwatch_from}: {exc}", file=sys.stderr)
                return 2
        # Before the reference (which follows Nightwatch's history), Nightwatch's budget is
        # a multiple of the expected training time.
        budget = args.budget_factor * mode.train_steps * (step_s or SLOWEST_STEP_S) + 600
        if "nightwatch" in mode.systems and recorded is not None:
            runs["nightwatch"] = recorded
            say(f"nightwatch's run read from {args.nightwatch_from}")
        elif "nightwatch" in mode.systems:
            runs["nightwatch"] = run_nightwatch(
                spec if schedule else clean_spec, schedule, cluster, supervisor, tokens,
                budget, say,
            )  # fmt: skip
            record = to_record(runs["nightwatch"], spec)
            (out / RUN_RECORD).write_text(json.dumps(record, default=str))
        # The others train as they would without Nightwatch: its supervisor and Prometheus,
        # idle now (its report is in), would still take CPU from their training.
        supervisor.stop()
        cluster.stop_prometheus()
        if args.no_reference:
            say("no reference run (--no-reference)")
        else:
            ref = exact_reference(runs.get("nightwatch"), spec, args, cluster, supervisor, out, say)
            if ref is not None:
                runs["reference"] = ref
                budget = args.budget_factor * (ref.end_t - ref.submit_t) + 120
                say(f"reference: step {ref.progress.max_step} in {ref.end_t - ref.submit_t:.0f}s")
        if "baseline" in mode.systems:
            runs["baseline"] = run_baseline(
                spec, schedule, cluster, out / "baseline", supervisor.home, budget, say
            )
    finally:
        if supervisor is not None:
            supervisor.stop()
            drop_database(db_name)
        try:
            cluster.stop()
        except Exception as exc:  # report, but the result is still written
            say(f"cluster stop failed: {exc}")
    ref = runs.get("reference")
    scores = [
        score_system(
            name,
            injections=r.injections,
            progress=r.progress,
            remedies=r.remedies,
            escalations=r.escalations,
            submit_t=r.submit_t,
            end_t=r.end_t,
            target_steps=r.target_steps,
            reference=ref.progress if ref else None,
            reference_submit_t=ref.submit_t if ref else None,
            emulated_steps=plan_of(ref).emulated_steps if name == "nightwatch" else (),
            pace_window=mode.checkpoint_interval,
            skip_margin=int(spec["recovery"].get("skip_margin_samples", 0)),
        )
        for name, r in runs.items()
        if name != "reference"
    ]
    table = comparison(scores)
    say("\n" + table)
    own = runs["nightwatch"].extra.get("report") if "nightwatch" in runs else None
    if own and "ettr" in own:
        say(
            f"nightwatch's own report: ETTR {own['ettr']}, {len(own['incidents'])} incidents, "
            f"{own['steps_lost']} steps lost, downtime {own['downtime_s']:.0f}s"
        )
    full = set(mode.kinds) == set(FaultKind)
    ettr_min = ETTR_MIN if full else None
    failed = (
        acceptance(scores[0], schedule is None, ettr_min=ettr_min, compare_loss=ref is not None)
        if scores
        else ["nothing scored"]
    )
    for line in failed:
        say(f"FAILED: {line}")
    result = {
        "seed": seed,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "schedule": schedule.to_dict() if schedule else None,
        "scores": [s.to_dict() for s in scores],
        "final_states": {k: r.final_state for k, r in runs.items()},
        "injections": {
            k: [
                {
                    "kind": i.fault.kind.value,
                    "t": i.t,
                    "note": i.note,
                    "node": i.node,
                    "job_id": i.job_id,
                }
                for i in r.injections
            ]
            for k, r in runs.items()
        },
        "extra": {k: r.extra for k, r in runs.items()},
        "acceptance_failed": failed,
        "mode": asdict(mode),
        "step_seconds": {"value": step_s, "measured": args.step_seconds is None and bool(step_s)},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    say(f"result: {out / 'result.json'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
