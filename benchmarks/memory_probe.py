"""Entry point for `benchmarks/memory_calibration.py`: the training CLI, plus a thread that keeps
this rank's GPU memory peaks in `$NIGHTWATCH_MEMORY_PROBE/rank<R>.json` (written atomically every
0.2 s, so the file holds the peaks even when the rank is killed after its last step).

Three peaks: PyTorch's allocated and reserved bytes, and the device's used bytes
(total - free from the driver: PyTorch's pool plus the CUDA context, NCCL buffers and cuBLAS
workspaces), which is what runs out.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _watch(path: Path, device: int) -> None:
    import torch

    used_peak = 0
    while True:
        if torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info(device)
            used_peak = max(used_peak, total - free)
            peaks = {
                "allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device),
                "device_used": used_peak,
                "device_total": total,
            }
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(peaks))
            tmp.replace(path)
        time.sleep(0.2)


def main() -> None:
    from megatron_runs.train import main as train_main

    out = Path(os.environ["NIGHTWATCH_MEMORY_PROBE"])
    out.mkdir(parents=True, exist_ok=True)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    threading.Thread(target=_watch, args=(out / f"rank{rank}.json", local), daemon=True).start()
    code = train_main()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
