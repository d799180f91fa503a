"""Check on GPUs (NCCL, bf16) what tests/train/test_anomaly_record.py checks on CPU: the
trainer names its bad steps to the sample, and `checkpoint.interval_auto` agrees on every rank.

One rank per local GPU (data parallel), a 125M-shaped GPT for 40 steps with a NaN batch at step
12 and a spike window that starts and ends inside steps 21-22. Prints the records, the interval
changes and one verdict line; exits 1 when a record is not exactly what the faults imply.

    python3 benchmarks/trainer_record_gpu.py --out $OUT/trainer_record_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contracts import anomalies
from contracts.checkpoints import read_save_timing
from worker.local_launch import launch

GBS = 16
NAN = (11 * GBS, 12 * GBS)  # step 12's samples
SPIKE = (20 * GBS + 11, 21 * GBS + 3)  # the last 5 of step 21, the first 3 of step 22


def spec(gpus: int) -> dict:
    return {
        "name": "trainer-record-gpu",
        "model": {
            "num_layers": 12,
            "hidden_size": 768,
            "num_attention_heads": 12,
            "seq_length": 1024,
            "vocab_size": 32768,
            "precision": "bf16",
        },
        "parallelism": {"tensor": 1, "pipeline": 1, "data": gpus},
        "resources": {"device": "gpu", "nodes": 1, "gpus_per_node": gpus},
        "training": {
            "train_steps": 40,
            "micro_batch_size": GBS // gpus,
            "global_batch_size": GBS,
            "lr": 3e-4,
            "min_lr": 3e-5,
            "lr_warmup_steps": 5,
            "log_interval": 1,
        },
        "data": {},
        "checkpoint": {
            "interval_steps": 5,
            "interval_auto": True,
            "interval_min_steps": 3,
            "interval_max_steps": 20,
            "mtbf_hours": 0.002,
        },
        "faults": [
            {"kind": "poison_data", "start_sample": NAN[0], "end_sample": NAN[1], "effect": "nan"},
            {"kind": "poison_data", "start_sample": SPIKE[0], "end_sample": SPIKE[1]},
        ],
    }


def expected() -> list[tuple[int, str, tuple[tuple[int, int], ...]]]:
    return [
        (12, anomalies.NONFINITE, (NAN,)),
        (13, anomalies.CLEAN, ()),  # the first good step after each episode
        (21, anomalies.SPIKE, ((SPIKE[0], 21 * GBS),)),
        (22, anomalies.SPIKE, ((21 * GBS, SPIKE[1]),)),
        (23, anomalies.CLEAN, ()),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    gpus = args.gpus or torch.cuda.device_count()
    work = Path(tempfile.mkdtemp(prefix="trainer-record-"))
    (work / "spec.yaml").write_text(yaml.safe_dump(spec(gpus)))
    run = launch(
        ["--spec", str(work / "spec.yaml"), "--checkpoint-dir", str(work / "ck"), "--attempt", "1"],
        gpus, work / "logs", env={"PYTHONWARNINGS": "ignore"}, python=sys.executable,
    )  # fmt: skip
    codes = run.wait(timeout=540)
    records = anomalies.read(work / "ck")
    got = [(a.step, a.kind, a.samples) for a in records]
    events = run.events()
    changes = [e for e in events if e["event"] == "checkpoint_interval"]
    saves = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    timing = read_save_timing(work / "ck")
    ok = codes == [0] * gpus and got == expected() and bool(changes)
    result = {
        "gpus": gpus,
        "device": torch.cuda.get_device_name(0),
        "exit_codes": codes,
        "records": [json.loads(a.to_json()) for a in records],
        "expected": expected(),
        "interval_changes": [(e["step"], e["was"], e["interval_steps"]) for e in changes],
        "saves": saves,
        "save_timing": timing.__dict__ if timing else None,
        "ok": ok,
    }
    print(json.dumps(result, indent=1, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if not ok:
        print("\n".join(p.read_text(errors="replace")[-3000:] for p in run.logs[:1]))
    print(f"verdict: {'exact' if ok else 'NOT exact'} on {gpus} × {result['device']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
