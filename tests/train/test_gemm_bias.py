"""GemmBiasColumnParallelLinear computes the same model as Megatron's separate bias adds.

One CPU process (gloo, TP 1): a tiny GPT built with and without the GEMM-bias projections,
from the same weights and on the same tokens, must give the same loss and the same gradients
(the MLP must neither add fc1's bias twice nor skip it, and must still apply the GeLU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from train_helpers import spec_dict

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
from megatron_runs import cpu_compat
cpu_compat.apply()
import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron_runs.model import GemmBiasColumnParallelLinear, build_gpt, transformer_config
from contracts.spec import RunSpec

spec = RunSpec.model_validate(json.loads(sys.argv[1]))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1)
config = transformer_config(spec, torch.float32, use_cpu_init=True)
models = {}
for gemm_bias in (False, True):
    torch.manual_seed(0)
    models[gemm_bias] = build_gpt(spec, config, True, True, gemm_bias=gemm_bias)
plain, fused = models[False], models[True]
fused.load_state_dict(plain.state_dict())
with torch.no_grad():  # non-zero biases, or a bias added twice or never would go unseen
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        if name.endswith("bias"):
            p.normal_(0.0, 0.5)
            q.copy_(p)
g = torch.Generator().manual_seed(3)
tokens = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_length + 1), generator=g)
pos = torch.arange(spec.model.seq_length).expand(2, -1)
gemm_layers = sum(isinstance(m, GemmBiasColumnParallelLinear) for m in fused.modules())
out = {"gemm_bias_layers": gemm_layers}
for key, model in (("plain", plain), ("fused", fused)):
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    out[key] = loss.item()
grads = [
    (name, (p.grad - q.grad).abs().max().item(), p.grad.abs().max().item())
    for (name, p), q in zip(plain.named_parameters(), fused.parameters())
]
out["max_grad_diff"] = max(d for _, d, _ in grads)
out["bias_grads_nonzero"] = all(m > 0 for n, _, m in grads if n.endswith("bias"))
print(json.dumps(out))
"""


def test_gemm_bias_projections_compute_the_same_model() -> None:
    from worker.local_launch import free_port

    spec = spec_dict("gemm-bias", tp=1, pp=1, layers=2)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(spec), str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["gemm_bias_layers"] == 4  # QKV and fc1 of both layers
    assert abs(out["plain"] - out["fused"]) < 1e-5, out
    assert out["max_grad_diff"] < 1e-5, out
    assert out["bias_grads_nonzero"], out
