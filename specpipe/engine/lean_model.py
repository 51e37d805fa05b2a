"""A lean forward for transformers' LlamaModel under engine=fast: the same modules and weights,
the same expressions in the same order, without the per-layer machinery around them.

Why: with the linears prepacked and the attention/MLP blocks lean, a one-token fp32 step of
SmolLM2-135M on a 2-core AVX2 CPU still took ~42 ms for ~24 ms of matrix products. The rest was
mostly fixed cost per layer: module calls (each decoder layer also runs transformers' output
capturing hook), the decoder layer's keyword plumbing, and eight small ops per RMSNorm behind a
module call. A throwaway loop over the same products measured 33 ms, bit-identical logits.

`swap_lean_model` turns a `LlamaModel` instance into a `LeanLlamaModel` (a subclass that only
overrides `forward`), so its modules, state dict and `isinstance` checks stay transformers' own.
It is swapped only where every decoder layer and norm runs transformers' own forward and no
module carries a forward hook the lean loop would skip (transformers' output-capturing hooks
aside: the lean forward records hidden states itself); a hook registered on a layer after the
swap is not run by the lean loop (the engine owns the model from then on). Calls it does not cover
(training, attention weights, a selection of hidden states, tuple outputs) run the stock forward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaModel, LlamaRMSNorm,
                                                      eager_attention_forward)

from specpipe.engine.cpu_kernel import NORM_DTYPES, NORM_MAX_WIDTH
from specpipe.engine.blocks import FusedQKVAttention, rotary_tables
from specpipe.target import folded_attention_bias, tree_attention_forward

try:  # transformers keys the outputs a model class records by class name: LeanLlamaModel registers its own
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
except ImportError:  # releases that read the class attribute instead, which LeanLlamaModel inherits
    _CAN_RECORD_REGISTRY = None

# Keyword arguments the lean forward serves; any other (attention weights, packed-sequence
# lengths, ...) goes to the stock forward.
LEAN_KWARGS = frozenset({"output_hidden_states", "return_dict", "cache_position"})
# The most query rows the attention kernel serves: a step and a tree verify (4-13 us per layer of
# SmolLM2-135M at 1-4 rows against SDPA's 25-45 with its folding); a longer block (a drafter feeding its
# committed text) goes to SDPA, which splits it over threads by rows.
KERNEL_ATTENTION_MAX_ROWS = 64
TRANSFORMERS_HOOK = "output_capturing_hook"  # transformers' own hook; inert unless it collects


def rms_norm(norm: LlamaRMSNorm, hidden: Tensor) -> Tensor:
    """LlamaRMSNorm.forward without the module call. hidden [..., hidden_size].

    torch.rms_norm computes the same ops in C++ (in fp32 for a bf16/fp16 input, rounding its output
    once; bitwise equal: tested). fp32 scales inside it; other dtypes keep transformers' order
    (normalize in fp32, round, then scale), so the weight multiplies its rounded output: 2 ops per
    norm instead of 8, 61 norms per forward of SmolLM2-135M.
    """
    if hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * torch.rms_norm(hidden, norm.weight.shape, None, norm.variance_epsilon)


class LeanLlamaModel(LlamaModel):
    """LlamaModel whose forward runs each decoder layer's expressions inline (see module doc).

    `norm_kernel` (set by swap_lean_model): a C++ norm(x, weight, eps) that computes LlamaRMSNorm bitwise
    in one call (specpipe.engine.cpu_kernel), used while the hidden states and every norm's weight
    share one dtype it serves; None = torch.rms_norm."""

    norm_kernel = None
    # `attention_kernel` (set by swap_lean_model): CpuKernel.attention, which computes the attention of a
    # step of up to KERNEL_ATTENTION_MAX_ROWS query rows on the CPU (one token, a tree verify) in place
    # of SDPA, the folded tree mask and the transposes around it; None = tree_attention_forward's SDPA.
    attention_kernel = None

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values=None, inputs_embeds: Tensor | None = None,
                use_cache: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
        # input_ids [batch, q]; attention_mask [batch, kv] or [batch, 1, q, kv]; position_ids [batch, q]
        output_hidden_states = kwargs.get("output_hidden_states")
        if (self.training or not LEAN_KWARGS.issuperset(kwargs) or kwargs.get("return_dict") is False
                or output_hidden_states not in (None, True, False) or (input_ids is None) == (inputs_embeds is None)):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, **kwargs)
        if use_cache is None:
            use_cache = self.config.use_cache
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [batch, q, hidden]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + seen).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                  eager_attention_forward)
        lean_attention = {"attention_function": attention_function,
                          "rotary": rotary_tables(position_embeddings)}  # made once for every layer
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        if attention_function is tree_attention_forward and self._kernel_attends(hidden, mask):
            lean_attention["attention_function"] = KernelAttention(self.attention_kernel)
        elif (attention_function is tree_attention_forward and mask is not None and mask.dtype == torch.bool
                and mask.dim() == 4 and heads % kv_heads == 0):
            lean_attention["attention_bias"] = folded_attention_bias(mask, heads // kv_heads, hidden.dtype)
        recorded = [hidden] if output_hidden_states else None
        kernel = self.norm_kernel
        if kernel is not None and (hidden.dtype != self.norm.weight.dtype or hidden.device.type != "cpu"):
            kernel = None  # the norms' weights were cast or moved since the swap

        def normalize(norm: LlamaRMSNorm, states: Tensor) -> Tensor:
            if kernel is not None:
                return kernel(states, norm.weight, norm.variance_epsilon)
            return rms_norm(norm, states)

        for layer in self.layers[: self.config.num_hidden_layers]:
            # LlamaDecoderLayer.forward: pre-norm attention and MLP, each added to its input
            attention = layer.self_attn
            looked_up = lean_attention if type(attention) is FusedQKVAttention else {}
            attended, _ = attention.forward(
                hidden_states=normalize(layer.input_layernorm, hidden), attention_mask=mask,
                position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                position_embeddings=position_embeddings, **looked_up)
            hidden = hidden + attended
            hidden = hidden + layer.mlp.forward(normalize(layer.post_attention_layernorm, hidden))
            if recorded is not None:
                recorded.append(hidden)
        hidden = normalize(self.norm, hidden)
        if recorded is not None:
            recorded[-1] = hidden  # transformers ties the last recorded state to the normed output
        return BaseModelOutputWithPast(last_hidden_state=hidden,
                                       past_key_values=past_key_values if use_cache else None,
                                       hidden_states=tuple(recorded) if recorded is not None else None)


    def _kernel_attends(self, hidden: Tensor, mask: Tensor | None) -> bool:
        """Whether the attention kernel serves this forward: hidden [batch, q, hidden_size], mask as the
        attention function receives it. One sequence of a few rows on the CPU in fp32 or bf16, with an
        explicit boolean mask [1, 1, q, kv] or none for one row (a mask-free prefill is causal over many
        rows: SDPA's)."""
        batch, q = hidden.shape[:2]
        if (self.attention_kernel is None or batch != 1 or not 1 <= q <= KERNEL_ATTENTION_MAX_ROWS
                or hidden.dtype not in (torch.float32, torch.bfloat16) or hidden.device.type != "cpu"
                or self.config.num_attention_heads % self.config.num_key_value_heads):
            return False
        if mask is None:
            return q == 1
        return mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:3] == (1, 1, q)


class KernelAttention:
    """An attention function (transformers' signature, as tree_attention_forward's) over CpuKernel.attention:
    query [1, heads, q, head_dim], key/value [1, kv_heads, kv, head_dim], attention_mask [1, 1, q, kv] bool or
    None -> ([1, q, heads, head_dim], None)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        mask = attention_mask[0, 0] if attention_mask is not None else None  # [q, kv]
        return self.kernel(query, key, value, mask, scale), None


def _hooked(module: nn.Module) -> bool:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(getattr(hook, "__name__", "") != TRANSFORMERS_HOOK for hook in hooks)


def lean_model_applies(model: nn.Module) -> bool:
    """True when `model` is a LlamaModel the lean forward computes exactly (see module doc)."""
    if type(model) is not LlamaModel:  # exactly: a subclass may compute something else
        return False
    layers = list(model.layers)
    norms = [model.norm, *(layer.input_layernorm for layer in layers),
             *(layer.post_attention_layernorm for layer in layers)]
    return (all(type(layer).forward is LlamaDecoderLayer.forward for layer in layers)
            and all(type(norm).forward is LlamaRMSNorm.forward for norm in norms)
            and not any(_hooked(module) for module in model.modules()))


def _norm_kernel_serves(model: LlamaModel) -> bool:
    """Whether every norm of `model` has one 1-D weight of one dtype and width the kernel's norm serves."""
    weights = [model.norm.weight, *(norm.weight for layer in model.layers
                                    for norm in (layer.input_layernorm, layer.post_attention_layernorm))]
    return (len({weight.dtype for weight in weights}) == 1 and weights[0].dtype in NORM_DTYPES
            and all(weight.dim() == 1 and weight.shape == weights[0].shape for weight in weights)
            and weights[0].shape[0] <= NORM_MAX_WIDTH)


def swap_lean_model(model: nn.Module, norm_kernel=None, attention_kernel=None) -> int:
    """Turns every LlamaModel inside `model` the lean forward serves into a LeanLlamaModel; returns how many.
    `norm_kernel`: CpuKernel.norm, for the models whose norms it serves; `attention_kernel`:
    CpuKernel.attention, for their decoding steps and tree verifies."""
    swapped = 0
    for module in list(model.modules()):
        if lean_model_applies(module):
            module.__class__ = LeanLlamaModel
            module.norm_kernel = norm_kernel if norm_kernel is not None and _norm_kernel_serves(module) else None
            module.attention_kernel = attention_kernel
            if _CAN_RECORD_REGISTRY is not None:  # the stock forward (fallback) still records attentions
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
            swapped += 1
    return swapped
