"""Run megatron-core 0.19.2 on CPU-only torch (gloo), for tests and the laptop demo.

megatron-core assumes CUDA in a few dozen places it reaches from the code paths we use
(dense GPT, Megatron DDP, distributed optimizer, pipeline schedules, dist_checkpointing).
Rather than editing site-packages, this module patches at runtime, and only when CUDA is
absent:

* `torch.cuda` calls that raise without a GPU (`current_device`, `current_stream`, `Stream`,
  `synchronize`, RNG state) become CPU equivalents; the tensor-parallel RNG tracker then forks
  the CPU generator instead of the GPU one (same seeding scheme, so TP ranks still draw
  different dropout masks and identical data-parallel ones).
* A torch-function mode rewrites `device="cuda"` / `.cuda()` / `.to("cuda")` to CPU, and makes
  `tensor.type()` report the CUDA type name, because grad clipping and the distributed
  optimizer assert `param.type() == 'torch.cuda.FloatTensor'`.

* megatron-core decorates its fused kernels with `torch.compile` when its `jit` module is
  imported, and that call imports dynamo and inductor: about 1.5 s of every rank's start, paid
  again at every restart, for kernels a CPU run never compiles. Without CUDA the fusions are
  left as plain functions (megatron's own `disable_jit_fuser` choice, made before they are
  decorated).

Independently of CUDA, when `triton` is not installed, the MoE paged-stash kernel module
(imported unconditionally by the pipeline schedules and GPTModel, used only by MoE paged
stashing) is replaced by a stub whose kernels raise if ever called.

The patches were written against one megatron-core version; `apply()` refuses any other
rather than guessing, because a silent mismatch would produce a run that trains wrongly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from typing import Any

SUPPORTED_MEGATRON_CORE = "0.19.2"

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"
_applied = False


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not the version this patch layer was written for."""


def check_megatron_version() -> str:
    """Return the installed megatron-core version, refusing any but the supported one."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnsupportedMegatronVersion(
            f"megatron-core is not installed; install megatron-core=={SUPPORTED_MEGATRON_CORE}"
        ) from exc
    if version != SUPPORTED_MEGATRON_CORE:
        raise UnsupportedMegatronVersion(
            f"megatron_runs.cpu_compat was written for megatron-core=={SUPPORTED_MEGATRON_CORE}, "
            f"found {version}; pin megatron-core=={SUPPORTED_MEGATRON_CORE} or port the patches"
        )
    return version


def stub_triton_kernels() -> None:
    """Replace the triton-only MoE kernel module with a stub (dense models never call it)."""
    if _PAGED_STASH_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def _needs_triton(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("MoE paged stash needs triton, which is not installed")

    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.__doc__ = "Stub installed by megatron_runs.cpu_compat: triton is not installed."
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _needs_triton
    stub.paged_stash_pop_kernel = _needs_triton
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH_OPS] = stub


def apply() -> bool:
    """Install the patches when CUDA is absent; return whether CPU mode is active.

    Idempotent. Must run before `megatron.core` is imported (the triton stub has to be in
    `sys.modules` first).
    """
    global _applied
    import torch

    check_megatron_version()
    stub_triton_kernels()
    if torch.cuda.is_available():
        return False
    if not _applied:
        _import_megatron_without_jit_fusions(torch)
        _patch_torch_cuda(torch)
        _CpuDeviceMode().__enter__()
        _patch_megatron_rng()
        _applied = True
    return True


def collective_device() -> Any:
    """Where this process's collectives take their tensors: its GPU, or the CPU (gloo) once
    `apply` found none (`torch.cuda.current_device` then answers "cpu", no index)."""
    import torch

    return torch.device("cpu") if _applied else torch.device("cuda", torch.cuda.current_device())


def _leave_uncompiled(fn: Any = None, **_options: Any) -> Any:
    """`torch.compile` stand-in: the function itself, with or without decorator arguments."""
    return fn if fn is not None else _leave_uncompiled


def _import_megatron_without_jit_fusions(torch: Any) -> None:
    """Import megatron-core with `torch.compile` swapped out, so `megatron.core.jit` binds the
    plain-function decorator and no fusion imports dynamo; `torch.compile` is put back after."""
    compile_ = torch.compile
    torch.compile = _leave_uncompiled
    try:
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = compile_


class _NullStream:
    """Stands in for `torch.cuda.Stream`: CPU work is already ordered."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, _event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass


def _patch_torch_cuda(torch: Any) -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.current_stream = lambda *_a, **_k: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda *_a, **_k: _NullStream()
    cuda.synchronize = lambda *_a, **_k: None
    cuda.set_device = lambda *_a, **_k: None
    # The tracker seeds "the GPU" with cuda.manual_seed; the CPU generator stands in. No
    # manual_seed_all: torch.manual_seed calls it after seeding the CPU already.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda *_a, **_k: None
    cuda.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    cuda.memory_allocated = lambda *_a, **_k: 0
    cuda.max_memory_allocated = lambda *_a, **_k: 0


def _patch_megatron_rng() -> None:
    """Point the tensor-parallel RNG tracker at the CPU generator."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(*_args: Any, **_kwargs: Any) -> Any:
        return torch.get_rng_state()

    def set_state(new_state: Any, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


def _make_mode() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    tensor_type = torch.Tensor.type
    tensor_cuda = torch.Tensor.cuda
    tensor_to = torch.Tensor.to

    class CpuDeviceMode(TorchFunctionMode):
        """Maps CUDA device requests to CPU and reports CUDA type names."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is tensor_cuda:
                return args[0]
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1)
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                kwargs = {**kwargs, "device": "cpu"}
            if func is tensor_to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CpuDeviceMode


def _CpuDeviceMode() -> Any:
    return _make_mode()()
