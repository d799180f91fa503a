"""The distributed optimizer's state in model space, each data-parallel rank saving its own slice.

megatron-core 0.19.2 still offers the `fully_sharded_model_space` format (optimizer state keyed
like the model's parameters, so it loads onto any TP × PP × DP layout, with no gather on
save), but builds it on `ShardedTensor.flattened_range`, which the same version rejects
("ShardedTensor.flattened_range is not supported"): every save in that format fails. What
0.19.2 supports instead is irregular sharding, several shards of one key per rank (its
`dp_reshardable` format uses it). So here a rank's DP slice of a parameter, a flat range of
the parameter's TP-local tensor, is cut into the few rectangles it covers in row-major order,
each an ordinary ShardedTensor at its place in the global tensor and a view of the optimizer's
own tensor: a save copies nothing and talks to no other rank before the write, and a load
reads whatever rectangles the saving layout wrote.

`install(optimizer)` puts this format in place of megatron's on each distributed optimizer;
keys and the load path (`load_parameter_state_from_fs_model_space`) stay megatron's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

FORMAT = "fully_sharded_model_space"

#: A rectangle of a tensor: offset and shape per axis, and where it starts in row-major order.
Rect = tuple[tuple[int, ...], tuple[int, ...], int]


def rectangles(shape: tuple[int, ...], start: int, stop: int) -> list[Rect]:
    """The elements [start, stop) of a row-major tensor of `shape` as rectangles, in order:
    a partial leading row, whole rows, a partial trailing row (recursively per axis)."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    row = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)
    out: list[Rect] = []
    first, last = start // row, stop // row  # rows holding start, and stop's row
    if start % row and first == (stop - 1) // row:  # inside one row
        return _in_row(first, row, rest, start, stop)
    if start % row:
        out += _in_row(first, row, rest, start, (first + 1) * row)
        first += 1
    if last > first:
        out.append(((first, *zeros), (last - first, *rest), first * row))
    if stop % row:
        out += _in_row(last, row, rest, last * row, stop)
    return out


def _in_row(index: int, row: int, rest: tuple[int, ...], start: int, stop: int) -> list[Rect]:
    base = index * row
    return [
        ((index, *off), (1, *shape), base + flat)
        for off, shape, flat in rectangles(rest, start - base, stop - base)
    ]


def install(optimizer: object) -> None:
    """Save and load each distributed optimizer's `fully_sharded_model_space` state this way."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "sharded_param_state_fs_model_space"):
            continue
        if getattr(opt.sharded_param_state_fs_model_space, "_nightwatch", False):
            continue
        load = opt.load_parameter_state_from_fs_model_space

        def save_fn(model_sd: dict, is_loading: bool = False, metadata: dict | None = None,
                    _opt: object = opt) -> dict:  # fmt: skip
            return _param_state(_opt, model_sd)

        def load_fn(state: dict, _load: object = load) -> None:
            _load({i: {k: _joined(v) for k, v in tensors.items()} for i, tensors in state.items()})

        save_fn._nightwatch = True  # type: ignore[attr-defined]
        opt.sharded_param_state_fs_model_space = save_fn
        opt.load_parameter_state_from_fs_model_space = load_fn


def _joined(parts: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """A slice's rectangles, loaded, as the flat tensor they cut up (they are in order)."""
    if isinstance(parts, torch.Tensor):
        return parts
    return torch.cat([p.reshape(-1) for p in parts])


def _param_state(opt: object, model_sd: dict) -> dict:
    """Megatron's `sharded_param_state_fs_model_space` structure (one dict per parameter, in
    buffer order) with a list of rectangles where megatron puts one flattened tensor."""
    tensors_only, _ = extract_sharded_tensors_and_factories(model_sd)
    by_param = {sh.data: sh for sh in nested_values(tensors_only)}
    state: dict[int, dict[str, list[ShardedTensor]]] = {}
    for model_param, piece in _params(opt):
        sharded = by_param[model_param]
        replica_id = (*sharded.replica_id[:2], opt.distributed_optimizer_instance_id)
        tensors = opt._get_main_param_and_optimizer_states(model_param)
        tensors["fp32_param"] = tensors.pop("param")
        tensors.pop("step", None)  # one step for all, restored from the param groups
        parts = _parts(sharded)
        state[len(state)] = {
            name: _slice(f"optimizer.state.{name}.", flat, parts, piece, replica_id)
            for name, flat in tensors.items()
        }
    return state


def _params(opt: object) -> Iterator[tuple[torch.nn.Parameter, slice]]:
    """Each model parameter this rank holds optimizer state for, with the flat range of it."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    yield model_param, slice(ranges["param"].start, ranges["param"].end)


def _parts(sharded: ShardedTensor | ShardedTensorFactory) -> list[tuple[ShardedTensor, int]]:
    """The checkpoint tensors a parameter is stored as, each with its row-major start in the
    parameter: itself, or what its factory builds (SwiGLU's fc1: W and V halves)."""
    if isinstance(sharded, ShardedTensor):
        return [(sharded, 0)]
    data = sharded.data
    built = nested_values(sharded.build_fn(sharded.key, data, sharded.replica_id, None))
    parts = []
    for sh in built:
        if not sh.data.is_contiguous() or sh.data.untyped_storage().data_ptr() != (
            data.untyped_storage().data_ptr()
        ):
            raise ValueError(f"{sharded.key}: factory part is not a contiguous view")
        parts.append((sh, (sh.data.data_ptr() - data.data_ptr()) // data.element_size()))
    return sorted(parts, key=lambda part: part[1])


def _slice(
    prefix: str,
    flat: torch.Tensor,
    parts: list[tuple[ShardedTensor, int]],
    piece: slice,
    replica_id: tuple[int, ...],
) -> list[ShardedTensor]:
    """`flat` (the elements `piece` of the parameter) as rectangles of the global tensors."""
    out = []
    for sh, base in parts:
        lo = max(piece.start, base)
        hi = min(piece.stop, base + math.prod(sh.local_shape))
        lead = (1,) * sh.prepend_axis_num  # a stacked tensor's leading axes, as unit axes
        for offset, shape, first in rectangles(tuple(sh.local_shape), lo - base, hi - base):
            at = base + first - piece.start
            data = flat[at : at + math.prod(shape)].view(*lead, *shape)
            global_offset = tuple(
                g + o for g, o in zip(sh.global_offset, (0,) * len(lead) + offset, strict=True)
            )
            rect = ShardedTensor(
                key=prefix + sh.key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                global_shape=tuple(sh.global_shape), global_offset=global_offset,
                axis_fragmentations=None, replica_id=replica_id,
            )  # fmt: skip
            out.append(rect)
    return out
