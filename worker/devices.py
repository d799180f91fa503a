"""A GPU job that sees fewer GPUs than it asked for stops at once, before anything trains.

Without this check a GPU spec landing on a node with no usable GPU trained on CPU (the
training program falls back to gloo when CUDA is absent), hours slower and silently.
"""

from __future__ import annotations

import os


def missing_gpus(required: int, node: str) -> str | None:
    """None when this node shows at least `required` GPUs; else the one-line cause.

    Counted through NVML (the node task sets PYTORCH_NVML_BASED_CUDA_CHECK=1), which creates
    no CUDA context, so the node task may still fork its ranks afterwards.
    """
    if required <= 0:
        return None
    import torch

    found = torch.cuda.device_count()
    if found >= required:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"no GPU: node {node} sees {found} of the {required} GPUs this job needs "
        f"(CUDA_VISIBLE_DEVICES={visible!r})"
    )
