"""Megatron's optimizer as training uses it: AdamW that skips a step whose grads hold NaN/Inf,
on GPU with torch's fused kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron_runs import cpu_compat

CPU = cpu_compat.apply()

import torch  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)

from contracts.spec import RunSpec  # noqa: E402


def build_optimizer(spec: RunSpec, model: list, bf16: bool, fused_adam: bool = True) -> object:
    """Megatron's optimizer; on GPU with torch's fused AdamW kernel unless `fused_adam` is off
    (for benchmarks/train_baseline.py's A/B runs)."""
    t = spec.training
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=spec.parallelism.distributed_optimizer,
        # A constant scale of 1 turns on Megatron's found-inf check: a step whose grads hold
        # NaN/Inf is skipped instead of writing NaN into the weights. Megatron runs that check
        # only in its mixed-precision optimizers (bf16 or distributed); fp32 without the
        # distributed optimizer gets `_check_found_inf`.
        loss_scale=1.0,
    )
    optimizer = _check_found_inf(get_megatron_optimizer(cfg, model))
    if fused_adam:
        fuse_adam(optimizer)
    return optimizer


def fuse_adam(optimizer: object) -> None:
    """GPU: switch Megatron's torch AdamW (its fallback without apex/TransformerEngine, built with
    the foreach default) to torch's fused kernel: one pass over param, grad and both moments
    instead of a chain of foreach ops. Same update rule. Again after a checkpoint load, which
    restores the saved param-group flags and puts the `step` counters on the CPU. No-op on CPU."""
    if CPU:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device, torch.float32)


def _check_found_inf(optimizer: object) -> object:
    """Give Megatron's FP32Optimizer the found-inf skip its mixed-precision optimizers have.

    FP32Optimizer.prepare_grads always reports "no inf", so a NaN gradient is applied and the
    weights stay NaN for good (docs/benchmarks.md, T4); the step's grad norm is NaN too, which
    its skip threshold (`norm > threshold`) never catches. Like
    `_unscale_main_grads_and_check_for_nan`, the flag is max-reduced over the grad-stats group
    so every rank skips the same step; every rank takes part in that reduction, a stub
    optimizer (no params) included.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, FP32Optimizer):
            opt.prepare_grads = functools.partial(_prepare_grads_found_inf, opt, opt.prepare_grads)
    return optimizer


@torch.no_grad()
def _prepare_grads_found_inf(opt: FP32Optimizer, prepare: Callable[[], bool]) -> bool:
    """FP32Optimizer.prepare_grads (main_grad → grad), then: does any grad hold NaN/Inf?"""
    found = prepare()
    grads = [p.grad for g in opt.optimizer.param_groups for p in g["params"] if p.grad is not None]
    flag = torch.zeros(1, dtype=torch.float32, device=cpu_compat.collective_device())
    if grads:
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        flag.fill_(0.0 if bool(finite) else 1.0)
    torch.distributed.all_reduce(
        flag, op=torch.distributed.ReduceOp.MAX, group=opt.get_grad_stats_parallel_group()
    )
    return found or flag.item() > 0
