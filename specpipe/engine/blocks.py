"""Lean drop-ins for transformers' Llama attention and MLP blocks, for engine=fast.

Why: with the linears prepacked, a one-token CPU forward of SmolLM2-135M still spent ~40% of
its time outside the matrix products, in the ~180 small ops and ~13 module calls per layer
of the stock blocks (three projection calls that each look up a shared product, rotary
embedding applied to q and k separately, one split per MLP member). These blocks compute the
same expressions in the same order on the already-fused products: one q|k|v product, rotary
over the q and k heads in one pass, one gate|up product.

Only blocks whose forward is exactly `LlamaAttention.forward` / `LlamaMLP.forward` (checked by
identity, not by name) with fused oneDNN projections are swapped; every other block keeps
transformers' own forward. The decoder layers, the model, the cache API and the attention
plug-in point (`AttentionInterface`) stay transformers' own.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, eager_attention_forward

from specpipe.engine.cpu_kernel_checks import serves_gate
from specpipe.engine.packed_weight import OneDNNLinear, PackedWeight


def rotary_tables(position_embeddings: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """(cos, sin) [batch, q, head_dim] -> (cos, signed_sin) [batch, q, 1, head_dim], broadcast over the
    heads, signed_sin being sin with its first half negated: then rotate_half(x) * sin equals
    cat(x2, x1) * signed_sin bit for bit ((-a) * b == a * (-b) in IEEE arithmetic), one op fewer per
    layer, and the lean model forward makes the tables once for all layers."""
    cos, sin = position_embeddings
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed_sin.unsqueeze(2)


def _direct_product(linear: nn.Module) -> Callable[[Tensor], Tensor]:
    """What computes linear(x): a lone OneDNNLinear's own product without the module call, else the module."""
    if isinstance(linear, OneDNNLinear) and len(linear.packed.splits) == 1:
        return linear.packed.product
    return linear


def _shared_packing(module: nn.Module, names: tuple[str, ...]) -> PackedWeight | None:
    """The PackedWeight that `names` (in that order) are members 0, 1, ... of, or None."""
    members = [getattr(module, name, None) for name in names]
    if not all(isinstance(member, OneDNNLinear) for member in members):
        return None
    packed = members[0].packed
    if any(member.packed is not packed or member.index != index for index, member in enumerate(members)) \
            or len(packed.splits) != len(names):
        return None
    return packed


class FusedQKVAttention(nn.Module):
    """LlamaAttention's forward over one q|k|v product; attributes transformers' attention
    functions read (config, layer_idx, is_causal, scaling, num_key_value_groups) are kept."""

    def __init__(self, attention: LlamaAttention, qkv: PackedWeight) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.is_causal = attention.is_causal
        self.qkv = qkv
        self.o_proj = attention.o_proj
        self._o_product = _direct_product(self.o_proj)
        self.query_heads = qkv.splits[0] // self.head_dim
        self.kv_heads = qkv.splits[1] // self.head_dim
        self.half_head = self.head_dim // 2

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None = None, past_key_values=None,
                attention_function: Callable | None = None, rotary: tuple[Tensor, Tensor] | None = None,
                **kwargs) -> tuple[Tensor, None]:
        # hidden_states [batch, q, hidden]; cos, sin [batch, q, head_dim]. `attention_function`: the
        # attention implementation when the caller has looked it up (the lean model forward does, once
        # per forward: reading config._attn_implementation costs ~20 us, 30 times per step); `rotary`:
        # rotary_tables(position_embeddings) when the caller has made them
        batch, q, _ = hidden_states.shape
        rotated_heads = self.query_heads + self.kv_heads
        qkv = self.qkv.product(hidden_states).view(batch, q, rotated_heads + self.kv_heads, self.head_dim)
        cos, signed_sin = rotary if rotary is not None else rotary_tables(position_embeddings)  # [batch, q, 1, hd]
        query_key = qkv[:, :, :rotated_heads]  # [batch, q, heads + kv_heads, head_dim]
        half = self.half_head
        swapped = torch.cat((query_key[..., half:], query_key[..., :half]), dim=-1)
        query_key = query_key * cos + swapped * signed_sin  # apply_rotary_pos_emb, q and k at once
        query = query_key[:, :, : self.query_heads].transpose(1, 2)  # [batch, heads, q, head_dim]
        key = query_key[:, :, self.query_heads :].transpose(1, 2)  # [batch, kv_heads, q, head_dim]
        value = qkv[:, :, rotated_heads:].transpose(1, 2)  # [batch, kv_heads, q, head_dim]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention = attention_function or ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                                eager_attention_forward)
        out, _ = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self._o_product(out.reshape(batch, q, -1)), None  # out [batch, q, heads, head_dim]


class FusedGatedMLP(nn.Module):
    """LlamaMLP's forward (SiLU-gated) over one gate|up product; `gate_kernel` (CpuKernel.gate) computes
    silu(gate) * up in one call over both threads for the rows where it is bitwise torch's (decoding steps and
    verifies: ATen ran the two ops apart on one thread, ~20 us a 9-row verify per layer)."""

    def __init__(self, mlp: LlamaMLP, gate_up: PackedWeight, gate_kernel: Callable[[Tensor], Tensor] | None = None) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.intermediate_size = gate_up.splits[0]
        self.down_proj = mlp.down_proj
        self._down_product = _direct_product(self.down_proj)
        self._gate_kernel = gate_kernel

    def forward(self, x: Tensor) -> Tensor:
        # x [batch, q, hidden] -> gate_up [batch, q, 2 * intermediate] -> [batch, q, hidden]
        gate_up = self.gate_up.product(x)
        if self._gate_kernel is not None and serves_gate(gate_up.numel() // gate_up.shape[-1], self.intermediate_size):
            return self._down_product(self._gate_kernel(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self._down_product(F.silu(gate) * up)


def _lean_block(module: nn.Module, gate_kernel: Callable[[Tensor], Tensor] | None = None) -> nn.Module | None:
    if type(module).forward is LlamaAttention.forward:
        qkv = _shared_packing(module, ("q_proj", "k_proj", "v_proj"))
        if qkv is not None and not module.training and qkv.splits[1] == qkv.splits[2]:
            return FusedQKVAttention(module, qkv)
    if type(module).forward is LlamaMLP.forward and isinstance(module.act_fn, (nn.SiLU, SiLUActivation)):
        gate_up = _shared_packing(module, ("gate_proj", "up_proj"))
        if gate_up is not None and isinstance(module.down_proj, OneDNNLinear):
            return FusedGatedMLP(module, gate_up, gate_kernel)
    return None


def swap_lean_blocks(model: nn.Module, gate_kernel: Callable[[Tensor], Tensor] | None = None) -> int:
    """Replaces every supported attention/MLP block in place (the MLPs' gates over `gate_kernel`, CpuKernel.gate,
    where it serves); returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            lean = _lean_block(child, gate_kernel)
            if lean is not None:
                setattr(parent, name, lean)
                swapped += 1
    return swapped
