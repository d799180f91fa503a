"""GPU runs through the production path: `nightwatch serve` + REST, real SLURM with GPU gres,
Prometheus, NCCL and bf16 on the device machine (docs/benchmarks.md, "GPU path").

It starts the dev cluster with one slurmd per group of GPUs (`--gpu-devices`: distinct
physical GPUs per node), the supervisor on SQLite, and submits GPU specs over the API:

* `clean`: a 2-node job (every GPU), trained to the end; checks that the ranks of different
  nodes ran on distinct GPUs (the UUIDs the ranks log) and reports the attempt's start-up.
* one run per fault (`--faults`), each on one node with the other as the spare an exclusion
  moves to, tied to its cause as on CPU: the incident's detection latency, its MTTR, steps lost,
  the remedy, and the restarted attempt's start-up broken into its parts from the training log;
  once per `--restart-paths` (in_job: the ranks restart inside the running job from the memory
  tier; in_job_disk: the same, loading from disk; resubmit: a new job; no_successor: in the
  job, but a requeue submits its job only once the ranks stopped), so the paths are measured
  side by side in one call. `preempt` is SLURM's preemption as the soak makes it (TERM to the
  job at step 25): the ranks save and leave with 75 and the run is requeued, into the successor
  prepared meanwhile (in_job) or a job submitted then (no_successor); with `--gpu-shared` the
  dev cluster's nodes all use the host's GPUs, so a 1-GPU host has a node for the successor.
  `preempt_crash` adds a rank crash 8 steps after the TERM, while the ranks train through.

Results go to OUT/result.json and a table on stdout. The host must have been prepared with
`scripts/gpu-host` (its environment exported), as the device machine has no package registry.

    eval "$(scripts/gpu-host .carry)"
    python3 benchmarks/gpu_e2e.py --out $OUT --faults crash nan_node poison
    python3 benchmarks/gpu_e2e.py --out $OUT --nodes 1 --model 1.3b --steps 30 --no-clean \
        --faults crash --restart-paths in_job resubmit
    python3 benchmarks/gpu_e2e.py --out $OUT --nodes 2 --gpu-shared --model 1.3b --steps 40 \
        --no-clean --faults preempt --restart-paths in_job no_successor train_through
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
NIGHTWATCH = [sys.executable, "-m", "supervisor.cli"]
TERMINAL = {"succeeded", "failed", "cancelled", "needs_attention"}

#: GPT sizes: (layers, hidden, heads, seq). `350m` has 24 × 1024 (≈ 350M parameters with a
#: 32k vocabulary): its checkpoint with optimizer states is ≈ 5 GB.
MODELS = {
    "1.3b": (24, 2048, 16, 2048),
    "350m": (24, 1024, 16, 2048),
    "125m": (12, 768, 12, 1024),
    "tiny": (2, 128, 4, 256),
}
#: How a remedy's next attempt starts (`recovery.restart_in_job`, `checkpoint.in_memory`,
#: `recovery.prepare_successor`, `recovery.preemption_grace_seconds`): inside the running job
#: loading from the memory tier, inside the job loading from disk, or as a new job (cancel +
#: sbatch), the path every remedy took before; for a preemption, with a grace the ranks train
#: through until the successor is ready (`megatron_runs.handover`).
RESTART_PATHS = {
    "in_job": (True, True, True, 0.0),
    "in_job_disk": (True, False, True, 0.0),
    "resubmit": (False, True, False, 0.0),
    "no_successor": (True, True, False, 0.0),
    "train_through": (True, True, True, 120.0),
}
#: The step at which `preempt` sends TERM to the run's job.
PREEMPT_AT_STEP = 25
#: The least time from the TERM to the kill: SLURM's KillWait default, which ends a
#: preempted job with no grace time.
KILL_WAIT_S = 30.0


@dataclass
class Stack:
    url: str
    token: str
    home: Path
    data: dict[str, str]
    env: dict[str, str]

    def api(self, method: str, path: str, body: Any = None) -> Any:
        response = httpx.request(
            method, self.url + path, json=body, timeout=30,
            headers={"Authorization": f"Bearer {self.token}"},
        )  # fmt: skip
        response.raise_for_status()
        return response.json()

    def wait_run(self, run_id: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            run = self.api("GET", f"/v1/runs/{run_id}")
            if run["state"] in TERMINAL:
                return run
            time.sleep(1)
        return run


def nightwatch(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [*NIGHTWATCH, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"nightwatch {' '.join(args)} failed: {out.stderr[-3000:]}")
    return out.stdout


def devcluster(cluster: Path, port: int, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "devcluster"), "--dir", str(cluster),
         "--base-port", str(port), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"devcluster {' '.join(args)} failed: {out.stderr[-3000:]}")
    return out.stdout


@contextmanager
def stack(args: argparse.Namespace, gpus_per_node: int) -> Iterator[Stack]:
    home = Path(tempfile.mkdtemp(prefix="nw-gpu-"))
    cluster = Path(tempfile.mkdtemp(prefix="nwc-"))
    port = args.base_port
    url = f"http://127.0.0.1:{port + 50}"
    env = {**os.environ, "NIGHTWATCH_HOME": str(home), "PYTHONPATH": str(ROOT)}
    token = nightwatch(
        env, "token", "create", "--name", "gpu-e2e", "--scope", "admin", "--scope", "submit",
        "--scope", "read",
    ).strip()  # fmt: skip
    prepare = subprocess.Popen(
        [*NIGHTWATCH, "data", "prepare", "--out", str(home / "data"), "--vocab-size", "32768"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    t0 = time.monotonic()
    hardware = ["--cpus-per-node", str(args.cpus_per_node), "--memory-mb", str(args.memory_mb)]
    if args.device == "gpu":
        hardware += ["--gpus-per-node", str(gpus_per_node), "--gpu-devices"]
        if args.gpu_shared:
            hardware.append("--gpu-shared")
    started = devcluster(
        cluster, port, "start", "--nodes", str(args.nodes), "--no-accounting", *hardware,
        "--sd-url", f"{url}/v1/prometheus/targets", "--sd-token", token,
    )  # fmt: skip
    print(f"cluster up in {time.monotonic() - t0:.1f} s", flush=True)
    prepared, errors = prepare.communicate(timeout=600)
    if prepare.returncode != 0:
        raise SystemExit(f"data prepare failed: {errors[-3000:]}")
    print(f"data ready in {time.monotonic() - t0:.1f} s", flush=True)
    data = dict(line.split(": ", 1) for line in prepared.strip().splitlines())
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in started.splitlines()
        if line.startswith("export ")
    )
    env.update(
        SLURM_CONF=exports["SLURM_CONF"],
        NIGHTWATCH_PROMETHEUS_URL=exports["NIGHTWATCH_PROMETHEUS_URL"],
        NIGHTWATCH_PUBLIC_URL=url,
        NIGHTWATCH_PORT=str(port + 50),
        NIGHTWATCH_EXECUTOR="slurm",
        NIGHTWATCH_TICK_SECONDS="1",
    )
    log = (home / "serve.log").open("wb")
    server = subprocess.Popen(
        [*NIGHTWATCH, "serve"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    s = Stack(url, token, home, {k.removeprefix("data."): v for k, v in data.items()}, env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                s.api("GET", "/v1/runs")
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((home / "serve.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield s
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        log.close()
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, timeout=30)
        devcluster(cluster, port, "stop")
        # Checkpoints of a 350M model are GBs a run: leave the disk as it was found.
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(cluster, ignore_errors=True)


def gpu_spec(
    name: str,
    data: dict[str, str],
    args: argparse.Namespace,
    nodes: int,
    gpus: int,
    **extra: Any,
) -> dict[str, Any]:
    layers, hidden, heads, seq = MODELS[args.model]
    steps = args.steps
    spec: dict[str, Any] = {
        "name": name,
        "model": {
            "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": seq, "vocab_size": 32768,
            "precision": "bf16" if args.device == "gpu" else "fp32",
        },
        "parallelism": {"tensor": 1, "pipeline": 1, "data": nodes * gpus},
        "resources": {
            "device": args.device, "nodes": nodes, "gpus_per_node": gpus,
            "cpus_per_task": args.cpus_per_rank,
            "time_limit_minutes": 60,
        },
        "training": {
            "train_steps": steps, "micro_batch_size": 4, "global_batch_size": 8 * nodes * gpus,
            "lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 5,
        },
        "data": data,
        "checkpoint": {"interval_steps": 10, "keep_last": 3},
        "recovery": {"hang_floor_seconds": args.hang_floor},
    }  # fmt: skip
    for section, values in extra.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    return spec


#: Each fault as the spec's `faults` section, on a one-node job unless it names `nodes`.
FAULTS: dict[str, dict[str, Any]] = {
    "crash": {"faults": [{"kind": "crash", "step": 25, "rank": 0}]},
    "nan_node": {"faults": [{"kind": "node", "job_node": 0, "effect": "nan_grads",
                             "after_step": 25}]},
    "poison": {"faults": [{"kind": "poison_data", "start_sample": 200, "end_sample": 216,
                           "effect": "nan"}]},
    "spike": {"faults": [{"kind": "poison_data", "start_sample": 200, "end_sample": 224,
                          "effect": "spike"}]},
    "hang": {"faults": [{"kind": "node", "job_node": 0, "effect": "hang", "after_step": 25}]},
    # A rank hung while its peer on the other node waits for it inside an NCCL all-reduce;
    # the job needs both nodes, so an exclusion leaves it nowhere to go.
    "hang_collective": {"nodes": 2, "faults": [{"kind": "node", "job_node": 1,
                                                "effect": "hang", "after_step": 25}]},
    # A slow node shows only beside a peer: a 2-node job.
    "straggler": {"nodes": 2, "faults": [{"kind": "node", "job_node": 1, "effect": "slow",
                                          "after_step": 15, "slow_factor": 4.0}]},
    "corrupt": {"faults": [{"kind": "corrupt_checkpoint", "step": 20},
                           {"kind": "crash", "step": 25, "rank": 0}]},
    # Not the trainer's: the benchmark sends SLURM's preemption signal (`preempt_job`). One
    # checkpoint kept, every 20 steps: a 1.3B model's is 17 GB, the lent 1-GPU host's disk 64.
    "preempt": {"checkpoint": {"interval_steps": 20, "keep_last": 1}},
    # A rank crashes while the ranks train on through the preemption's grace: the restart
    # belongs in the prepared successor, not in the job SLURM is about to kill.
    "preempt_crash": {"checkpoint": {"interval_steps": 20, "keep_last": 1},
                      "faults": [{"kind": "crash", "step": PREEMPT_AT_STEP + 8, "rank": 0}]},
}  # fmt: skip
#: The faults whose run `preempt_job` preempts.
PREEMPTED = frozenset({"preempt", "preempt_crash"})


def keep_training_logs(home: Path, out: Path, limit: int = 1_000_000) -> None:
    """Copy every attempt's task logs (their last `limit` bytes) into `out`, named by run
    and attempt: what the ranks said is the only record of a timeline the watchdog misjudged."""
    runs = home / "runs"
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(runs.glob("*/logs/**/*_log.out")):
        # one flat folder: `run_a<attempt>_<job>_<task>_log.out`
        target = out / "_".join(path.relative_to(runs).parts).replace("_logs_", "_")
        target.write_bytes(path.read_bytes()[-limit:])


def training_log(home: Path, run_id: str) -> list[dict[str, Any]]:
    """Every JSON line of every attempt's task logs, in time order."""
    lines = []
    for path in sorted((home / "runs" / run_id / "logs").rglob("*_log.out")):
        for raw in path.read_text(errors="replace").splitlines():
            start = raw.find("{")
            if start < 0:
                continue
            try:
                record = json.loads(raw[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "ts" in record:
                lines.append(record)
    return sorted(lines, key=lambda r: r["ts"])


#: The node task's first line of an attempt: a submitted job's, or an order's inside a job.
BEGIN_MARKS = ("task begin", "restart in job")


def startup(records: list[dict[str, Any]], attempt: int, submitted: float) -> dict[str, float]:
    """One attempt's start-up, from its submission to its first step, in parts (seconds):
    SLURM's start (to the node task's first line), the imports and forks (to the trainer's
    entry), the trainer's own set-up phases (distributed/NCCL init, model and optimizer,
    checkpoint load, the rest) and the first step (with any compilation)."""
    mine = [r for r in records if r.get("attempt") == attempt]
    # a standby job's node tasks begin (as the attempt's) before their order: the order counts
    ordered = next((r for r in mine if str(r.get("msg", "")).startswith(BEGIN_MARKS[1])), None)
    begin = ordered or next(
        (r for r in mine if str(r.get("msg", "")).startswith(BEGIN_MARKS)), None
    )
    train = next((r for r in mine if r.get("event") == "train_start"), None)
    step = next((r for r in mine if r.get("event") == "step"), None)
    parts: dict[str, float] = {}
    if begin is not None:
        parts["slurm_start"] = begin["ts"] - submitted
    if train is not None and begin is not None:
        parts["imports_and_fork"] = train["entered"] - begin["ts"]
        parts.update(train["setup_seconds"])
    if step is not None and train is not None:
        parts["first_step"] = step["ts"] - train["ts"]
    if step is not None:
        parts["total_to_first_step"] = step["ts"] - submitted
    return {k: round(v, 2) for k, v in parts.items()}


def gpu_uuids(records: list[dict[str, Any]], attempt: int) -> dict[str, list[str]]:
    """node → the GPU UUIDs its ranks ran on (the worker's `task device` line)."""
    out: dict[str, list[str]] = {}
    for r in records:
        msg = str(r.get("msg", ""))
        if r.get("attempt") == attempt and msg.startswith("task device"):
            fields = dict(part.split("=", 1) for part in msg.split()[2:])
            out.setdefault(fields["node"], []).append(fields["gpu"])
    return out


def incidents(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    import sqlite3

    con = sqlite3.connect(stack.home / "nightwatch.db")
    con.row_factory = sqlite3.Row
    rows = con.execute(
        "SELECT kind, remedy, fault_ts, detected_ts, recovered_ts, steps_lost, state, "
        "evidence_json FROM incidents WHERE run_id = ? ORDER BY id", (run_id,),
    ).fetchall()  # fmt: skip
    con.close()
    out = []
    for row in rows:
        fields = dict(row)
        fields["evidence"] = json.loads(fields.pop("evidence_json") or "{}")
        out.append(fields)
    return out


def _epoch(iso: str) -> float:
    """An API or SQLite timestamp (naive ones are UTC) as seconds since the epoch."""
    t = datetime.fromisoformat(iso)
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def seconds_between(a: str | None, b: str | None) -> float | None:
    if not a or not b:
        return None
    return round(_epoch(b) - _epoch(a), 2)


def preempt_job(
    stack: Stack, run_id: str, step: int, grace_s: float, out: dict[str, float]
) -> None:
    """Once the run reached `step`: TERM to its job, then once the grace time (at least
    `KILL_WAIT_S`) is over, if it still runs, a cancel (TERM, then KILL after the dev
    cluster's KillWait), as SLURM preempts without a requeue (the times in `out`)."""
    while True:
        run = stack.api("GET", f"/v1/runs/{run_id}")
        if run["state"] in TERMINAL:
            return
        steps = [r["step"] for r in training_log(stack.home, run_id) if r.get("event") == "step"]
        if steps and max(steps) >= step and run["attempts"]:
            job = str(run["attempts"][-1]["job_id"])
            out["term_t"] = time.time()
            subprocess.run(["scancel", "--signal=TERM", job], env=stack.env, timeout=30)
            break
        time.sleep(0.2)
    time.sleep(max(grace_s, KILL_WAIT_S))
    state = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], env=stack.env, timeout=30,
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if state == "RUNNING":
        out["kill_t"] = time.time()
        subprocess.run(["scancel", job], env=stack.env, timeout=30)


def one_run(
    stack: Stack, name: str, spec: dict[str, Any], timeout_s: float, preempt: bool = False
) -> dict[str, Any]:
    run_id = stack.api("POST", "/v1/runs", spec)["id"]
    t0 = time.monotonic()
    term: dict[str, float] = {}
    grace = float(spec.get("recovery", {}).get("preemption_grace_seconds", 0.0))
    watcher = threading.Thread(
        target=preempt_job, args=(stack, run_id, PREEMPT_AT_STEP, grace, term), daemon=True
    )
    if preempt:
        watcher.start()
    run = stack.wait_run(run_id, timeout_s)
    records = training_log(stack.home, run_id)
    attempts = [
        {
            "attempt": a["number"], "state": a["state"], "job_id": a["job_id"],
            "nodes": a["nodes"], "exit_code": a["exit_code"],
            "startup": startup(records, a["number"], _epoch(a["submitted_at"])),
            "gpus": gpu_uuids(records, a["number"]),
        }
        for a in run["attempts"]
    ]  # fmt: skip
    found = incidents(stack, run_id)
    for inc in found:
        inc["detection_s"] = seconds_between(inc["fault_ts"], inc["detected_ts"])
        inc["mttr_s"] = seconds_between(inc["detected_ts"], inc["recovered_ts"])
    losses = [r["loss"] for r in records if r.get("event") == "step" and r.get("loss") is not None]
    # A 1.3B run's checkpoints are tens of GB: the next run needs the disk.
    shutil.rmtree(stack.home / "runs" / run_id / "checkpoints", ignore_errors=True)
    result = {
        "name": name, "run_id": run_id, "state": run["state"], "wall_s": round(
            time.monotonic() - t0, 1), "last_step": run["last_step"], "attempts": attempts,
        "incidents": found, "final_loss": losses[-1] if losses else None,
    }  # fmt: skip
    if "kill_t" in term:
        result["term_to_kill_s"] = round(term["kill_t"] - term["term_t"], 2)
    if "term_t" in term:
        later = [r for r in records if r.get("event") == "step" and r.get("attempt", 0) > 1]
        result["term_to_first_step_s"] = (
            round(later[0]["ts"] - term["term_t"], 2) if later else None
        )
        # where that went before the requeue: the signal's way to the step, then its save
        stop = next((r for r in records if r.get("event") == "stopping_on_signal"), None)
        end = next((r for r in records if r.get("event") == "train_end"), None)
        if stop is not None and end is not None:
            result["term_to_stopping_s"] = round(stop["ts"] - term["term_t"], 2)
            result["stopping_to_train_end_s"] = round(end["ts"] - stop["ts"], 2)
        # what the preemption cost: no step from the old attempt's last to the new one's first
        first = [r for r in records if r.get("event") == "step" and r.get("attempt", 0) == 1]
        if first and later:
            result["steps_after_term"] = len({r["step"] for r in first if r["ts"] > term["term_t"]})
            result["last_to_first_step_s"] = round(later[0]["ts"] - first[-1]["ts"], 2)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="350m")
    parser.add_argument(
        "--device", choices=("gpu", "cpu"), default="gpu",
        help="cpu: the same runs on CPU ranks (--ranks-per-node), for a side-by-side table",
    )  # fmt: skip
    parser.add_argument("--ranks-per-node", type=int, default=1, help="with --device cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--faults", nargs="*", default=[], choices=sorted(FAULTS))
    parser.add_argument(
        "--spare-nodes", type=int, default=0,
        help="resources.spare_nodes of the fault runs (in_job path): a node fault moves there",
    )  # fmt: skip
    parser.add_argument(
        "--restart-paths", nargs="+", default=["in_job"], choices=sorted(RESTART_PATHS),
        help="run each fault once per path (in_job: restart inside the job from the memory "
        "tier; in_job_disk: inside the job from disk; resubmit: sbatch)",
    )  # fmt: skip
    parser.add_argument("--no-clean", action="store_true")
    parser.add_argument(
        "--gpu-shared", action="store_true",
        help="every node of the dev cluster uses all the host's GPUs (one-node jobs in turn)",
    )  # fmt: skip
    parser.add_argument("--cpus-per-node", type=int, default=16)
    parser.add_argument("--cpus-per-rank", type=int, default=4)
    parser.add_argument("--memory-mb", type=int, default=100_000)
    parser.add_argument("--base-port", type=int, default=23000)
    parser.add_argument("--run-timeout", type=float, default=240)
    parser.add_argument(
        "--hang-floor", type=float, default=30.0,
        help="recovery.hang_floor_seconds: below a save's length, a save judged as a hang shows",
    )  # fmt: skip
    args = parser.parse_args()
    import torch

    if args.device == "gpu":
        gpus = torch.cuda.device_count()
        if gpus < args.nodes and not args.gpu_shared:
            raise SystemExit(f"{gpus} GPUs for {args.nodes} nodes")
        per_node = gpus if args.gpu_shared else gpus // args.nodes
        card = torch.cuda.get_device_name(0)
    else:
        per_node, card = args.ranks_per_node, f"cpu ({os.cpu_count()} cores)"
        gpus = per_node * args.nodes
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "card": card, "gpus": gpus, "nodes": args.nodes, "gpus_per_node": per_node,
        "model": args.model, "runs": [],
    }  # fmt: skip
    with stack(args, per_node) as s:
        if not args.no_clean:
            spec = gpu_spec("gpu-clean", s.data, args, args.nodes, per_node)
            results["runs"].append(one_run(s, "clean", spec, args.run_timeout))
        for fault in args.faults:
            for path in args.restart_paths:
                sections = dict(FAULTS[fault])
                nodes = sections.pop("nodes", 1)
                in_job, in_memory, successor, grace = RESTART_PATHS[path]
                sections["recovery"] = {
                    "restart_in_job": in_job,
                    "prepare_successor": successor,
                    "preemption_grace_seconds": grace,
                }
                sections["checkpoint"] = {**sections.get("checkpoint", {}), "in_memory": in_memory}
                if in_job and args.spare_nodes:
                    sections["resources"] = {"spare_nodes": args.spare_nodes}
                spec = gpu_spec(f"gpu-{fault}-{path}", s.data, args, nodes, per_node, **sections)
                results["runs"].append(
                    one_run(s, f"{fault}/{path}", spec, args.run_timeout, fault in PREEMPTED)
                )
                (args.out / "result.json").write_text(json.dumps(results, indent=2))
        (args.out / "result.json").write_text(json.dumps(results, indent=2))
        (args.out / "serve.log").write_bytes((s.home / "serve.log").read_bytes()[-4_000_000:])
        keep_training_logs(s.home, args.out / "logs")
    print(f"{'run':18s} {'state':16s} {'steps':>5s} {'attempts':>8s}  incidents")
    for r in results["runs"]:
        incs = ", ".join(f"{i['kind']}→{i['remedy']} det {i['detection_s']}s mttr {i['mttr_s']}s"
                         for i in r["incidents"])  # fmt: skip
        print(f"{r['name']:18s} {r['state']:16s} {r['last_step']!s:>5s} "
              f"{len(r['attempts']):>8d}  {incs}")  # fmt: skip


if __name__ == "__main__":
    main()
