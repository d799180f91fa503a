"""Build the Megatron-Core GPT model of a RunSpec (needs `megatron.core` importable).

Core attention is torch `scaled_dot_product_attention(is_causal=True)` instead of the local
spec's unfused matmul + softmax: without TransformerEngine that is what reaches flash / cuDNN
kernels on GPU (measured 23 % → 46 % MFU at 1.3B, half the memory), and it is exact on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from contracts.spec import RunSpec


class SDPACoreAttention(MegatronModule):
    """Causal core attention through `torch.nn.functional.scaled_dot_product_attention`.

    Takes Megatron's [seq, batch, heads, head_dim] layout, returns [seq, batch, hidden/tp],
    the same contract as `DotProductAttention`; GQA key/value groups are expanded to heads.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError("SDPACoreAttention supports causal attention only")
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes neither packed sequences nor a bias")
        seq, batch = query.shape[0], query.shape[1]
        if self.heads != self.groups:
            repeat = self.heads // self.groups
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class GemmBiasColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear whose bias is added inside the GEMM (`F.linear` → cuBLAS addmm
    with a bias epilogue) instead of in a separate pass over the whole output.

    Megatron adds it as a broadcast `output + bias`, which runs as a non-vectorised elementwise
    kernel (≈ 5.7 % of a 1.3B step on H100, profiled: the QKV and fc1 outputs). The MLP asks fc1
    to return its bias unadded so that TE or the tanh GeLU can fuse it with the activation; here
    the bias is always added and none is returned, so the MLP applies torch's erf GeLU to the
    biased output: the same function with one rounding fewer. Used only where Megatron's own
    path adds nothing: TP 1 (at TP > 1 it overlaps the dgrad all-reduce with the wgrad GEMM),
    no sequence parallelism, no deferred embedding wgrad, no external weight, no CPU offloading.
    """

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (
            weight is not None
            or self.tp_group.size() > 1
            or self.sequence_parallel
            or self.gradient_accumulation_fusion
            or self.config.defer_embedding_wgrad_compute
            or self.config._cpu_offloading_context is not None
        ):
            return super().forward(input_, weight, runtime_gather_output)
        return torch.nn.functional.linear(input_, self.weight, self.bias), None


def transformer_config(
    spec: RunSpec, params_dtype: torch.dtype, use_cpu_init: bool, fused: bool = False
) -> TransformerConfig:
    """TransformerConfig with the layout sizes set (without them every PP stage builds all
    layers, training works and only the checkpoint save fails on duplicate keys).

    `fused` (GPU, bf16 only) turns on the two TE-free fusions of megatron-core that keep the
    model's arithmetic: bias-dropout-add and the vocab-parallel cross-entropy, each compiled by
    `torch.compile` (megatron.core.jit); the fused cross-entropy returns bf16 logit gradients.
    `bias_activation_fusion` stays off: its GeLU is the tanh approximation, not torch's erf one.
    """
    if fused and params_dtype != torch.bfloat16:
        raise ValueError("fused kernels need bf16 (the fused cross-entropy's grads are bf16)")
    m, p = spec.model, spec.parallelism
    llama = m.normalization == "RMSNorm"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_groups,
        ffn_hidden_size=m.ffn,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        # The interleaved schedule's p2p as Megatron-LM sets it (overlap_p2p_comm): unbatched,
        # each direction on its own group. Batched at pipeline 2, an activation and a gradient
        # from the same peer in one batch land in each other's buffers (seen on gloo: the
        # losses of the later microbatches drifted).
        overlap_p2p_comm=p.virtual_pipeline is not None,
        batch_p2p_comm=p.virtual_pipeline is None,
        sequence_parallel=p.sequence_parallel,
        normalization=m.normalization,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=torch.nn.functional.silu
        if m.activation == "swiglu"
        else torch.nn.functional.gelu,
        add_bias_linear=not llama,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_init,
        perform_initialization=True,
        init_method_std=0.02,
        bias_activation_fusion=False,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=fused,
        cross_entropy_fusion_impl="native",
        **_recompute(spec.training.recompute),
    )


def _recompute(mode: str) -> dict[str, object]:
    """Megatron-Core's recomputation settings for `training.recompute`."""
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}  # fmt: skip
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


class SequenceParallelNorm:
    """PyTorch's LayerNorm / RMSNorm for Megatron's local layer spec, also under sequence
    parallelism: megatron-core's wrapper refuses it because a norm over a sequence shard sees
    1/TP of the tokens, so its weight gradients must be summed over the TP group. Marking the
    parameters `sequence_parallel` is what makes `finalize_model_grads` do that."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object
    ) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(spec: RunSpec, gemm_bias: bool = False) -> ModuleSpec:
    """Megatron's local (no TE) layer spec with SDPA core attention; with `gemm_bias` (GPU) the
    QKV and fc1 projections add their bias inside the GEMM (`GemmBiasColumnParallelLinear`)."""
    layer = get_gpt_layer_local_spec(normalization=spec.model.normalization)
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    if gemm_bias:
        attention.linear_qkv = GemmBiasColumnParallelLinear
        mlp = layer.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=...)
        mlp_parts = dataclasses.replace(
            mlp.keywords["submodules"], linear_fc1=GemmBiasColumnParallelLinear
        )
        layer.submodules.mlp = functools.partial(mlp.func, *mlp.args, submodules=mlp_parts)
    return layer


def build_gpt(
    spec: RunSpec,
    config: TransformerConfig,
    pre_process: bool,
    post_process: bool,
    gemm_bias: bool = False,
    vp_stage: int | None = None,
) -> GPTModel:
    """One pipeline stage's GPTModel, or with `vp_stage` one model chunk of an interleaved
    pipeline (params in fp32; Float16Module casts for bf16)."""
    m = spec.model
    block = TransformerBlockSubmodules(
        layer_specs=[layer_spec(spec, gemm_bias)] * get_num_layers_to_build(config, vp_stage),
        layer_norm=SequenceParallelNorm,  # the final norm; megatron's default refuses SP
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings,
        position_embedding_type=m.position_embedding,
        vp_stage=vp_stage,
    )


def init_layout_independent(gpt: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Redraw every weight matrix from a generator keyed by (seed, global parameter name).

    Megatron draws initial weights in construction order, so a pipeline stage's layers get
    different values than the same layers in another PP layout: TP2×PP2 and TP1 would start
    from different models. Keyed by the global layer number, the full (unsharded) matrix is the
    same in every layout, and each TP rank keeps its shard. Biases and norm weights are
    constants (0 / 1) and already layout-independent. Standard deviations follow Megatron:
    `init_method_std`, divided by sqrt(2·layers) for the output projections.
    """
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    layer_of = {}
    for layer in gpt.decoder.layers:
        for p in layer.parameters():
            layer_of[id(p)] = layer.layer_number
    out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    for name, p in gpt.named_parameters():
        if p.dim() < 2:
            continue
        key = name
        if id(p) in layer_of:
            key = re.sub(r"^decoder\.layers\.\d+\.", f"layer{layer_of[id(p)]}.", name)
        if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            key = "embedding.word_embeddings.weight"
        std = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else None
        split = getattr(p, "tensor_model_parallel", False) and tp > 1
        dim = getattr(p, "partition_dim", 0) if split else 0
        shape = list(p.shape)
        if split:
            shape[dim] *= tp
        gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
        full = torch.empty(shape, device=p.device, dtype=torch.float32)
        full.normal_(0.0, std or config.init_method_std, generator=gen)
        if split:
            glu = config.gated_linear_unit and name.endswith("linear_fc1.weight")
            # GLU: each rank holds [its gate rows; its up rows], not a contiguous block.
            parts = full.chunk(2, dim=dim) if glu else (full,)
            full = torch.cat([part.chunk(tp, dim=dim)[tp_rank] for part in parts], dim=dim)
        with torch.no_grad():
            p.copy_(full)
