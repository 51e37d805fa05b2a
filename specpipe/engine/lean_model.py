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

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaModel, LlamaRMSNorm,
                                                      eager_attention_forward)

from specpipe.engine.base import row_invariance_active
from specpipe.engine.blocks import FusedQKVAttention, rotary_tables
from specpipe.engine.cpu_kernel_checks import NORM_DTYPES, NORM_MAX_WIDTH
from specpipe.engine.native_layers import native_layers, run_native_layers, serving_layers
from specpipe.engine.rotary import RotaryTables
from specpipe.kv_cache import PositionIndexedCache
from specpipe.target import folded_attention_bias, sdpa_forward, tree_attention_forward

try:  # transformers keys the outputs a model class records by class name: LeanLlamaModel registers its own
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
except ImportError:  # releases that read the class attribute instead, which LeanLlamaModel inherits
    _CAN_RECORD_REGISTRY = None

# Keyword arguments the lean forward serves; any other (attention weights, packed-sequence
# lengths, ...) goes to the stock forward.
LEAN_KWARGS = frozenset({"output_hidden_states", "return_dict", "cache_position", "ragged_batch"})
# The most query rows the attention kernel serves, per build of it (CpuKernel.isa) and dtype: a step and a
# tree verify (SDPA folds the heads and costs several times more there), and a prompt's causal block (the
# prefill, a drafter fed its committed text) up to where SDPA's flash path becomes faster for SmolLM2-135M's
# 9 heads over 3 KV heads (on a 2-core AVX-512 CPU, ATen held to AVX2 for avx2; docs/notebook/ has the
# measurements).
# Longer blocks go to SDPA.
KERNEL_ATTENTION_MAX_ROWS = {"avx512_bf16": {torch.bfloat16: 2048, torch.float32: 512},
                             "avx512": {torch.bfloat16: 512, torch.float32: 512},
                             "avx2": {torch.bfloat16: 64, torch.float32: 64}}
# Where oneDNN multiplies bf16 on AMX tiles, SDPA's flash path does too for a bf16 prompt's causal block: there it
# passes the kernel's attention from about 96 rows (a whole bf16 prefill of 256-384 tokens of SmolLM2-135M 17-21%
# faster, 2-core AMX CPU; fp32's prefills unchanged). Row-invariant forwards keep the kernel at any rows.
AMX_BF16_ATTENTION_MAX_ROWS = 64


def kernel_attention_max_rows(isa: str, bf16_on_tiles: bool = False) -> dict[torch.dtype, int]:
    """The most query rows the attention kernel's `isa` build serves per dtype (KERNEL_ATTENTION_MAX_ROWS), bf16's
    capped at AMX_BF16_ATTENTION_MAX_ROWS where oneDNN's bf16 products run on AMX tiles (`bf16_on_tiles`)."""
    rows = dict(KERNEL_ATTENTION_MAX_ROWS[isa])
    if bf16_on_tiles:
        rows[torch.bfloat16] = min(rows[torch.bfloat16], AMX_BF16_ATTENTION_MAX_ROWS)
    return rows
# The attention functions the kernel stands in for where it serves: the target's tree attention, and the
# plain SDPA the drafters' own layers (an EAGLE head) are configured with. Both compute exact attention
# under a boolean mask; the kernel sums in another order (a draft may flip a near-tie, the target's
# output is checked against its own verify forward either way).
KERNEL_REPLACES = (tree_attention_forward, sdpa_forward)
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
    # forward of up to KERNEL_ATTENTION_MAX_ROWS query rows on the CPU (one token, a tree verify, a prompt)
    # in place of SDPA, the folded tree mask and the transposes around it; None = tree_attention_forward's SDPA.
    attention_kernel = None
    attention_max_rows: Mapping[torch.dtype, int] = MappingProxyType({})  # dtype -> rows, for its build
    # `ragged_attention_kernel` (set by swap_lean_model): CpuKernel.ragged_attention, the attention of several
    # sequences' rows in one call (each appended to and attending its own cache); None = one call per sequence
    ragged_attention_kernel = None
    # `rotary_lookup` (set by swap_lean_model): RotaryTables over `rotary_emb`, the cos/sin of each position
    # looked up instead of computed per forward (bitwise the same); None = the module computes them
    rotary_lookup = None
    # `level_kernel` (set by swap_lean_model): the kernel's block_draft_level, for a drafter that runs a draft model's
    # whole level in one call (KernelDraftLevel); this forward never calls it
    level_kernel = None
    # `native_layer_kernel` (set by swap_lean_model, with the norm and attention kernels): CpuKernel.native_layers, the
    # decoder layers over GGUF blocks in one call, for the layers of `native_layer_table` (native_layers.NativeLayer by
    # module) in the forwards it serves (native_layers.serving_layers); None = op by op
    native_layer_kernel = None
    native_layer_table: Mapping[nn.Module, object] = MappingProxyType({})

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
        ragged_batch = kwargs.get("ragged_batch")  # several sequences' rows, each with its own cache and mask
        mask = None if ragged_batch is not None else create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=past_key_values,
            position_ids=position_ids)
        position_embeddings = (self.rotary_lookup or self.rotary_emb)(hidden, position_ids=position_ids)
        recorded = [hidden] if output_hidden_states else None
        normalize = norm_function(self.norm_kernel, self.norm.weight, hidden)
        # a list: slicing the ModuleList would build a new ModuleList (a registration per layer) at every forward
        layers = list(self.layers)[: self.config.num_hidden_layers]
        hidden = lean_decoder_layers(self, layers, hidden, normalize, mask,
                                     position_ids, past_key_values, use_cache, position_embeddings, recorded,
                                     ragged_batch)
        hidden = normalize(self.norm, hidden)
        if recorded is not None:
            recorded[-1] = hidden  # transformers ties the last recorded state to the normed output
        return BaseModelOutputWithPast(last_hidden_state=hidden,
                                       past_key_values=past_key_values if use_cache else None,
                                       hidden_states=tuple(recorded) if recorded is not None else None)


def kernel_attends(attention_kernel, max_rows: Mapping[torch.dtype, int], config, hidden: Tensor,
                   mask: Tensor | None, any_rows: bool = False) -> bool:
    """Whether `attention_kernel` (None: not loaded) serves a forward of a model with `config`: hidden
    [batch, q, hidden_size], mask as the attention function receives it. One sequence of up to
    `max_rows[dtype]` rows (KERNEL_ATTENTION_MAX_ROWS of the kernel's build) on the CPU, with an explicit
    boolean mask [1, 1, q, kv], or none: one row, or a causal block (a prefill; `lean_decoder_layers` gives
    the kernel its mask). `any_rows`: however many rows (a row-invariant forward, which SDPA cannot give), where
    the kernel's build serves the dtype at all."""
    batch, q = hidden.shape[:2]
    most = max_rows.get(hidden.dtype, 0)
    if (attention_kernel is None or batch != 1 or not 1 <= q <= (q if any_rows and most else most)
            or hidden.device.type != "cpu" or config.num_attention_heads % config.num_key_value_heads):
        return False
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:3] == (1, 1, q))


def norm_function(norm_kernel, norm_weight: Tensor, hidden: Tensor) -> Callable[[nn.Module, Tensor], Tensor]:
    """What computes norm(states) for the lean loop: the kernel's RMSNorm where it was given and still serves
    (the norms' weights, like `norm_weight`, not cast or moved since the swap), else torch.rms_norm. A
    norm that is nn.Identity (EAGLE-1's first layer has no input norm) passes its input through."""
    kernel = norm_kernel
    if kernel is not None and (hidden.dtype != norm_weight.dtype or hidden.device.type != "cpu"):
        kernel = None

    def normalize(norm: nn.Module, states: Tensor) -> Tensor:
        if type(norm) is nn.Identity:
            return states
        if kernel is not None:
            return kernel(states, norm.weight, norm.variance_epsilon)
        return rms_norm(norm, states)
    return normalize


def lean_decoder_layers(owner: nn.Module, layers, hidden: Tensor, normalize: Callable[[nn.Module, Tensor], Tensor],
                        mask: Tensor | None, position_ids: Tensor, past_key_values, use_cache: bool,
                        position_embeddings: tuple[Tensor, Tensor], recorded: list[Tensor] | None = None,
                        ragged_batch=None) -> Tensor:
    """LlamaDecoderLayer.forward of each of `layers` inline (pre-norm attention and MLP, each added to its
    input): hidden [batch, q, hidden_size] -> [batch, q, hidden_size]; each layer's output is appended to
    `recorded` where given. `owner` carries the model's `config` and `attention_kernel` (None: SDPA); the
    attention function, the rotary tables and the folded tree mask are made once for every layer.
    `ragged_batch` (specpipe.target.RaggedBatch): the rows are several sequences', each attending its own cache
    (`mask` and `past_key_values` are then None)."""
    config = owner.config
    attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    lean_attention = {"attention_function": attention_function,
                      "rotary": rotary_tables(position_embeddings)}  # made once for every layer
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if ragged_batch is not None:
        return _ragged_layers(owner, layers, hidden, normalize, position_ids, position_embeddings, recorded,
                              ragged_batch, lean_attention)
    kernel_serves = attention_function in KERNEL_REPLACES and kernel_attends(
        owner.attention_kernel, owner.attention_max_rows, config, hidden, mask, row_invariance_active(owner))
    if kernel_serves:
        lean_attention["attention_function"] = KernelAttention(owner.attention_kernel)
        q = hidden.shape[1]
        if mask is None and q > 1:  # causal over the block: row r sees the cached rows and block rows <= r
            cached = past_key_values.get_seq_length() if past_key_values is not None else 0
            mask = torch.ones(q, cached + q, dtype=torch.bool, device=hidden.device).tril(cached)[None, None]
        natives = _native_layers_serving(owner, layers, hidden, lean_attention["rotary"])
        if natives is not None and use_cache and isinstance(past_key_values, PositionIndexedCache):
            return run_native_layers(owner.native_layer_kernel, natives, hidden, lean_attention["rotary"],
                                     [past_key_values], [hidden.shape[1]], [mask[0, 0] if mask is not None else None],
                                     recorded)
    elif (attention_function is tree_attention_forward and mask is not None and mask.dtype == torch.bool
            and mask.dim() == 4 and heads % kv_heads == 0):
        lean_attention["attention_bias"] = folded_attention_bias(mask, heads // kv_heads, hidden.dtype)
    for layer in layers:
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
    return hidden


def _ragged_layers(owner: nn.Module, layers, hidden: Tensor, normalize: Callable[[nn.Module, Tensor], Tensor],
                   position_ids: Tensor, position_embeddings: tuple[Tensor, Tensor], recorded: list[Tensor] | None,
                   ragged_batch, lean_attention: dict) -> Tensor:
    """`lean_decoder_layers` over several sequences' rows: the products over all rows, each sequence's attention
    over its own cache through the kernel's attention where it serves every sequence's rows, else SDPA."""
    attention_function = lean_attention["attention_function"]
    if attention_function in KERNEL_REPLACES and all(
            kernel_attends(owner.attention_kernel, owner.attention_max_rows, owner.config, hidden[:, :rows], None,
                           row_invariance_active(owner))
            for rows in ragged_batch.rows):
        ragged_kernel = getattr(owner, "ragged_attention_kernel", None)
        natives = _native_layers_serving(owner, layers, hidden, lean_attention["rotary"])
        if ragged_kernel is not None and natives is not None:
            return run_native_layers(owner.native_layer_kernel, natives, hidden, lean_attention["rotary"],
                                     ragged_batch.caches, ragged_batch.rows, ragged_batch.masks, recorded)
        if ragged_kernel is not None:
            lean_attention = dict(lean_attention, attention_function=RaggedKernelAttention(ragged_kernel, ragged_batch))
        else:
            lean_attention = dict(lean_attention, attention_function=functools.partial(
                ragged_batch.attend, KernelAttention(owner.attention_kernel)))
    else:
        lean_attention = dict(lean_attention, attention_function=functools.partial(ragged_batch.attend,
                                                                                   attention_function))
    for layer in layers:
        attention = layer.self_attn
        looked_up = lean_attention if type(attention) is FusedQKVAttention else {"ragged_batch": ragged_batch}
        attended, _ = attention.forward(
            hidden_states=normalize(layer.input_layernorm, hidden), attention_mask=None, position_ids=position_ids,
            past_key_values=None, use_cache=False, position_embeddings=position_embeddings, **looked_up)
        hidden = hidden + attended
        hidden = hidden + layer.mlp.forward(normalize(layer.post_attention_layernorm, hidden))
        if recorded is not None:
            recorded.append(hidden)
    return hidden


def _native_layers_serving(owner: nn.Module, layers, hidden: Tensor, rotary: tuple[Tensor, Tensor]):
    """The NativeLayers of `layers` where `owner`'s kernel layer serves this forward (its norm kernel too), else None."""
    if getattr(owner, "native_layer_kernel", None) is None or getattr(owner, "norm_kernel", None) is None:
        return None
    return serving_layers(owner.native_layer_table, layers, hidden, rotary, row_invariance_active(owner))


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


class RaggedKernelAttention:
    """An attention function (transformers' signature) for the rows of a RaggedBatch, over
    CpuKernel.ragged_attention: each sequence's new keys and values written into its own cache and its rows'
    attention computed in one call for the whole batch (one Python call per layer instead of one per sequence)."""

    def __init__(self, kernel, batch) -> None:
        self.kernel = kernel
        self.batch = batch
        self.masks = [mask if mask is not None else torch.empty(0, dtype=torch.bool) for mask in batch.masks]

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
        # query [1, heads, R, head_dim], key/value [1, kv_heads, R, head_dim] -> [1, R, heads, head_dim]
        key_buffers, value_buffers, cached = [], [], []
        like = key[:, :, :0]
        for cache, rows in zip(self.batch.caches, self.batch.rows):
            key_buffer, value_buffer, start = cache.rows_to_write(module.layer_idx, like, rows)
            key_buffers.append(key_buffer)
            value_buffers.append(value_buffer)
            cached.append(start)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return self.kernel(query, key, value, key_buffers, value_buffers, cached, self.batch.starts, self.masks,
                           scale), None


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


def _norm_kernel_serves(model: nn.Module) -> bool:
    """Whether every RMSNorm of `model` has one 1-D weight of one dtype and width the kernel's norm serves."""
    weights = [module.weight for module in model.modules() if isinstance(module, LlamaRMSNorm)]
    return (bool(weights) and len({weight.dtype for weight in weights}) == 1 and weights[0].dtype in NORM_DTYPES
            and all(weight.dim() == 1 and weight.shape == weights[0].shape for weight in weights)
            and weights[0].shape[0] <= NORM_MAX_WIDTH)


def rotary_lookup(model: nn.Module) -> RotaryTables | None:
    """Tables of `model.rotary_emb`'s cos/sin per position where they serve it (a fixed-frequency Llama RoPE)."""
    rotary = getattr(model, "rotary_emb", None)
    return RotaryTables(rotary) if rotary is not None and RotaryTables.serves(rotary) else None


def swap_lean_model(model: nn.Module, norm_kernel=None, attention_kernel=None, attention_isa: str = "avx2",
                    layer_kernel=None, level_kernel=None, draft_model: bool = False,
                    ragged_attention_kernel=None, native_layer_kernel=None, bf16_on_tiles: bool = False) -> int:
    """Turns every LlamaModel inside `model` the lean forward serves into a LeanLlamaModel; returns how many.
    `norm_kernel`: CpuKernel.norm, for the models whose norms it serves; `attention_kernel`:
    CpuKernel.attention, for their forwards of up to kernel_attention_max_rows(attention_isa, bf16_on_tiles) rows
    (`attention_isa`: the build's CpuKernel.isa; `bf16_on_tiles`: oneDNN's bf16 products run on AMX tiles), and
    `ragged_attention_kernel` (CpuKernel.ragged_attention) for their forwards of several sequences' rows;
    `layer_kernel`: the kernel's block_decoder_layer (BlockProduct.decoder_layer), for draft heads' layers only
    (BlockLayers); `level_kernel`: the kernel's block_draft_level (BlockProduct.draft_level), for a draft's whole
    level (KernelDraftLevel): an EAGLE head's, and with `draft_model` (the model only drafts) a LlamaModel's. Each
    also gets `rotary_lookup` (RotaryTables, where they serve its rotary embedding). `native_layer_kernel`:
    CpuKernel.native_layers, for the decoder layers over GGUF blocks of the models whose norms and attention the
    kernel runs (native_layers)."""
    max_rows = MappingProxyType(kernel_attention_max_rows(attention_isa, bf16_on_tiles))
    swapped = 0
    for module in list(model.modules()):
        if getattr(module, "accepts_lean_kernels", False):  # a draft head with a lean loop of its own (EagleNet)
            module.norm_kernel = norm_kernel if norm_kernel is not None and _norm_kernel_serves(module) else None
            module.attention_kernel, module.attention_max_rows = attention_kernel, max_rows
            module.ragged_attention_kernel = ragged_attention_kernel
            module.layer_kernel = layer_kernel
            module.level_kernel = level_kernel if layer_kernel is not None else None
            module.rotary_lookup = rotary_lookup(module)
            swapped += 1
        elif lean_model_applies(module):
            module.__class__ = LeanLlamaModel
            module.norm_kernel = norm_kernel if norm_kernel is not None and _norm_kernel_serves(module) else None
            module.attention_kernel, module.attention_max_rows = attention_kernel, max_rows
            module.ragged_attention_kernel = ragged_attention_kernel
            module.rotary_lookup = rotary_lookup(module)
            # offered to the drafter that runs a draft model's levels itself (DraftModelDrafter); never a target's
            module.level_kernel = level_kernel if layer_kernel is not None and draft_model else None
            table = (native_layers(module) if native_layer_kernel is not None and module.norm_kernel is not None
                     and attention_kernel is not None and ragged_attention_kernel is not None else {})
            module.native_layer_table = MappingProxyType(table)
            module.native_layer_kernel = native_layer_kernel if table else None
            if _CAN_RECORD_REGISTRY is not None:  # the stock forward (fallback) still records attentions
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
            swapped += 1
    return swapped
