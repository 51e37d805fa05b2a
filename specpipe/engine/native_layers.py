"""The target's decoder layers over GGUF blocks, all of a forward's in one kernel call (`engine.native_layers`).

Where a target's linears are its GGUF file's blocks (engine.target_weights=native, int8, int4), the lean forward's
products take ~60% of a one-row step of a small model; the rest went to the ~20 torch ops around them per layer and
the Python between those. The kernel's `native_decoder_layer` runs a whole Llama decoder layer: the norms, the q|k|v
product, the rotary embedding, the rows' keys and values appended to their caches and the attention (one sequence's
or a batch's, each over its own cache), the output projection, the residual adds, the gate|up product, the SiLU gate
and the down product; `native_decoder_layers` runs every layer of a forward in one call. Each is the op the lean
loop runs, rounded as it rounds, so a layer's output and cache rows
are the lean loop's bit for bit (tests/test_native_layers.py): vanilla and speculation get the same logits either
way, and the switch changes only the speed.

It serves a forward where the lean loop would run every op of the layer in the kernel anyway: every product over
blocks (`native_rows`, or any rows under `engine.batch_invariant`), the kernel's norm and attention for these rows,
and a PositionIndexedCache (or a ragged batch of them). Elsewhere the lean loop runs as before.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specpipe.engine.blocks import FusedGatedMLP, FusedQKVAttention
from specpipe.engine.cpu_kernel_checks import serves_gate
from specpipe.engine.packed_weight import OneDNNLinear, PackedWeight


@dataclass(frozen=True)
class NativeLayer:
    """What a decoder layer hands the kernel in every forward: its norms, its four products' blocks, their GGUF
    type ids and fp32 biases (q|k|v, o, gate|up, down), and its attention's shape."""

    layer_idx: int
    input_norm: Tensor  # [width]
    post_norm: Tensor  # [width]
    eps: float
    blocks: tuple[Tensor, ...]  # 4 x [out, in / block values * block bytes] uint8
    formats: tuple[int, ...]
    biases: tuple[Tensor | None, ...]  # 4 x [out] fp32 or None
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    scale: float
    gate_kernel: bool  # the MLP's SiLU gate runs in the kernel where it serves the rows (CpuKernel.gate)
    native_rows: int  # the most rows all four products run over the blocks outside a row-invariant forward


def _single(linear: nn.Module) -> PackedWeight | None:
    if isinstance(linear, OneDNNLinear) and len(linear.packed.splits) == 1:
        return linear.packed
    return None


def native_layer(layer: nn.Module) -> NativeLayer | None:
    """`layer`'s NativeLayer where the kernel's layer computes what the lean loop computes for it (lean attention and
    MLP blocks, every product over GGUF blocks, RMSNorms of one epsilon), else None."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attention) is not FusedQKVAttention or type(mlp) is not FusedGatedMLP:
        return None
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not all(type(norm) is LlamaRMSNorm for norm in norms) or norms[0].variance_epsilon != norms[1].variance_epsilon:
        return None
    packs = (attention.qkv, _single(attention.o_proj), mlp.gate_up, _single(mlp.down_proj))
    if any(pack is None or pack.native_kernel is None or pack.native_blocks is None for pack in packs):
        return None
    if attention.kv_heads * attention.head_dim != attention.qkv.splits[2] or attention.head_dim % 2:
        return None
    return NativeLayer(
        layer_idx=attention.layer_idx, input_norm=norms[0].weight.detach(), post_norm=norms[1].weight.detach(),
        eps=float(norms[0].variance_epsilon), blocks=tuple(pack.native_blocks for pack in packs),
        formats=tuple(int(pack.native_format) for pack in packs), biases=tuple(pack.kernel_bias for pack in packs),
        heads=attention.query_heads, kv_heads=attention.kv_heads, head_dim=attention.head_dim,
        intermediate=mlp.intermediate_size,
        scale=attention.scaling if attention.scaling is not None else attention.head_dim ** -0.5,
        gate_kernel=mlp._gate_kernel is not None, native_rows=min(pack.native_rows for pack in packs))


def native_layers(model: nn.Module) -> dict[nn.Module, NativeLayer]:
    """Every decoder layer of `model` (a LlamaModel) the kernel's layer serves, by module."""
    found = {}
    for layer in getattr(model, "layers", ()):
        native = native_layer(layer)
        if native is not None:
            found[layer] = native
    return found


def serving_layers(table: Mapping[nn.Module, NativeLayer], layers: Sequence[nn.Module], hidden: Tensor,
                   rotary: tuple[Tensor, Tensor], invariant: bool) -> list[NativeLayer] | None:
    """The NativeLayers of `layers` where the kernel's layer serves this forward (hidden [1, R, width], rotary's
    tables [1, R, 1, head_dim]): all of them have one, and every product of R rows would run over the blocks."""
    if not table or hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.dtype not in (torch.float32, torch.bfloat16):
        return None
    natives = [table.get(layer) for layer in layers]
    if not natives or any(native is None for native in natives):
        return None
    rows = hidden.shape[1]
    if not invariant and rows > min(native.native_rows for native in natives):
        return None
    if any(native.input_norm.dtype != hidden.dtype for native in natives):
        return None
    if len({(native.heads, native.kv_heads, native.head_dim, native.intermediate) for native in natives}) != 1:
        return None  # one kernel call runs them all, with one shape
    cos, signed_sin = rotary
    if cos.dtype != hidden.dtype or signed_sin.dtype != hidden.dtype or cos.shape[0] != 1:
        return None
    return natives


def run_native_layers(kernel: Callable, natives: Sequence[NativeLayer], hidden: Tensor, rotary: tuple[Tensor, Tensor],
                      caches: Sequence, rows: Sequence[int], masks: Sequence[Tensor | None],
                      recorded: list[Tensor] | None) -> Tensor:
    """The decoder layers `natives` over hidden [1, R, width] -> [1, R, width], in one kernel call
    (CpuKernel.native_layers): sequence b owns `rows[b]` rows in order, appended to and attending its own `caches[b]`
    (a PositionIndexedCache) under `masks[b]` [q_b, cached_b + q_b] bool (None: one row that sees everything). Each
    layer's output is appended to `recorded` where given."""
    cos, signed_sin = (table[0, :, 0].contiguous() for table in rotary)  # [R, head_dim]
    first = natives[0]
    like = hidden.new_empty(1, first.kv_heads, 0, first.head_dim)
    starts = [0]
    for count in rows:
        starts.append(starts[-1] + count)
    mask_rows = [mask if mask is not None else torch.empty(0, dtype=torch.bool) for mask in masks]
    key_buffers, value_buffers, cached = [], [], []  # layer-major: layer l's of every sequence, then layer l + 1's
    for native in natives:
        for cache, count in zip(caches, rows):
            key_buffer, value_buffer, start = cache.rows_to_write(native.layer_idx, like, count)
            key_buffers.append(key_buffer)
            value_buffers.append(value_buffer)
            cached.append(start)
    outputs = kernel(hidden[0].contiguous(), [native.input_norm for native in natives],
                     [native.post_norm for native in natives], [native.eps for native in natives],
                     [block for native in natives for block in native.blocks],
                     [form for native in natives for form in native.formats],
                     [bias for native in natives for bias in native.biases], first.heads, first.kv_heads,
                     first.intermediate,
                     [int(native.gate_kernel and serves_gate(starts[-1], native.intermediate)) for native in natives],
                     cos, signed_sin, key_buffers, value_buffers, cached, starts, mask_rows,
                     [native.scale for native in natives])
    if recorded is not None:
        recorded.extend(output[None] for output in outputs)
    return outputs[-1][None]
