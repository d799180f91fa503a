"""Bare Megatron-Core loop (SDPA attention, DDP + distributed optimizer), no Nightwatch hooks.

The reference the training program is measured against: same model and parallel setup as
`megatron_runs`, but random tokens, no metrics, no checksums, no checkpoints, no data
pipeline. One rank of a job (RANK / WORLD_SIZE / LOCAL_RANK from the environment); rank 0
prints one JSON line per step: {"event": "step", "step", "step_time"}.

    python benchmarks/train_baseline.py --spec SPEC --steps 30 [--no-fused]
        [--no-overlap-param-gather] [--no-fused-adam] [--no-gemm-bias] [--profile N]

`--no-fused` / `--no-overlap-param-gather` turn off the GPU defaults of `setup.build_model`
(fused bias-dropout-add and cross-entropy; param all-gather overlapped with the forward pass),
`--no-gemm-bias` the biases added inside the QKV / fc1 GEMMs, `--no-fused-adam` that of
`optimizer.build_optimizer` (torch's fused AdamW kernel), which gives the loop without them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_runs import cpu_compat

CPU = cpu_compat.apply()

import torch  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from contracts.spec import RunSpec  # noqa: E402
from megatron_runs import setup  # noqa: E402
from megatron_runs.data import MicroBatch  # noqa: E402
from megatron_runs.loop import forward_step  # noqa: E402
from megatron_runs.optimizer import build_optimizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-fused", action="store_true")
    ap.add_argument("--no-overlap-param-gather", action="store_true")
    ap.add_argument("--no-fused-adam", action="store_true")
    ap.add_argument("--no-gemm-bias", action="store_true")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="GPU: profile the last N steps on rank 0 and print the top kernels by CUDA time",
    )
    args = ap.parse_args()
    spec = RunSpec.from_file(args.spec)
    rank, _world, _local, device = setup.init_distributed()
    t, m = spec.training, spec.model
    setup.init_model_parallel(spec)
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    bf16 = m.precision == "bf16" and not CPU
    model, config = setup.build_model(
        spec,
        bf16,
        fused=not args.no_fused,
        overlap_param_gather=not args.no_overlap_param_gather,
        gemm_bias=not args.no_gemm_bias,
    )
    optimizer = build_optimizer(spec, model, bf16, fused_adam=not args.no_fused_adam)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    dp = ps.get_data_parallel_world_size()
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)

    def batches():
        # Seeded alike for every model chunk: each chunk's iterator yields the same samples.
        gen = torch.Generator(device="cpu").manual_seed(ps.get_data_parallel_rank())
        drawn = 0  # the loss function reports each sample's loss by its number
        while True:
            tok = torch.randint(
                0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen
            )
            yield MicroBatch(
                tokens=tok[:, :-1].to(device),
                labels=tok[:, 1:].to(device),
                loss_mask=torch.ones(t.micro_batch_size, m.seq_length, device=device),
                position_ids=torch.arange(m.seq_length, device=device).expand(
                    t.micro_batch_size, -1
                ),
                indices=list(range(drawn, drawn + t.micro_batch_size)),
            )
            drawn += t.micro_batch_size

    it = [batches() for _ in model] if len(model) > 1 else batches()
    fwd_bwd = get_forward_backward_func()
    profiler = None
    for step in range(1, args.steps + 1):
        if args.profile and rank == 0 and not CPU and step == args.steps - args.profile + 1:
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ).__enter__()
        t0 = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=it,
            model=model,
            num_microbatches=num_micro,
            seq_length=m.seq_length,
            micro_batch_size=t.micro_batch_size,
            decoder_seq_length=m.seq_length,
            forward_only=False,
        )
        optimizer.step()
        if not CPU:
            torch.cuda.synchronize()
        if rank == 0:
            line = {"event": "step", "step": step, "step_time": time.perf_counter() - t0}
            print(json.dumps(line), file=sys.stderr, flush=True)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        print(table, file=sys.stderr, flush=True)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)
