"""Turns a tree-attention function into a transformers attention function (AttentionInterface).

transformers hands every attention implementation the full `[batch, 1, q, kv]` mask that
target.py built, with the q new keys appended at the end of the cache. A tree-attention
kernel only needs the tree part of it (`[batch, q, q]`) and where the tree starts
(cache_len = kv - q): the cache part is all visible by construction (TargetModel never
masks committed tokens), which is what lets the kernel skip reading it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (query [B, H, q, D], key/value [B, KVH, kv, D], tree_mask [B, q, q] | None, cache_lens [B], scale) -> [B, H, q, D]
TreeAttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor, float | None], Tensor]


def tree_inputs_from_hf_mask(attention_mask: Tensor | None, batch: int, q: int, kv: int, is_causal: bool = True,
                             device: torch.device | None = None) -> tuple[Tensor | None, Tensor]:
    """(tree_mask [batch, q, q] bool or None for a causal chain, cache_lens [batch] int32 on `device`) from
    transformers' mask [batch or 1, 1, q, kv] bool (True = attend) or None."""
    if kv < q:
        raise ValueError(f"tree attention needs the {q} queries' own keys at the end of the {kv} keys")
    cache_lens = torch.full((batch,), kv - q, dtype=torch.int32, device=device)  # [batch]
    if attention_mask is None:
        if is_causal:
            return None, cache_lens
        return torch.ones(batch, q, q, dtype=torch.bool, device=device), cache_lens  # bidirectional
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"tree attention takes a boolean attention mask (True = attend), got {attention_mask.dtype}:"
                         f" register it with transformers' sdpa_mask as mask function")
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != (q, kv) \
            or attention_mask.shape[0] not in (1, batch):
        raise ValueError(f"attention mask {tuple(attention_mask.shape)} is not [batch, 1, {q}, {kv}]")
    if attention_mask.device.type == "cpu" and not bool(attention_mask[:, 0, :, :kv - q].all()):
        # On a GPU this check would stall every layer; TargetModel never masks the cache.
        raise ValueError("tree attention assumes every query sees the whole cache, but the mask hides some of it "
                         "(left padding?): use attention=sdpa for such masks")
    tree_mask = attention_mask[:, 0, :, kv - q:].expand(batch, q, q)  # [batch, q, q]: a view, no copy
    return tree_mask, cache_lens


def make_attention_forward(tree_attention: TreeAttentionFn) -> Callable:
    """An attention function with transformers' signature around `tree_attention`."""

    def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[Tensor, None]:
        """query [B, H, q, D], key/value [B, KVH, kv, D] (cache then the q new keys),
        attention_mask [B, 1, q, kv] bool or None -> ([B, q, H, D], None) as sdpa_attention_forward returns.
        With `ragged_batch` (specpipe.target.RaggedBatch) the rows are several sequences', each attending its own
        cache: the kernel runs per sequence."""
        ragged_batch = kwargs.pop("ragged_batch", None)
        if ragged_batch is not None:
            return ragged_batch.attend(attention_forward, module, query, key, value, attention_mask, scaling=scaling,
                                       dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("tree attention is for inference: dropout must be 0 (call model.eval())")
        for unsupported in ("softcap", "sliding_window", "s_aux", "position_bias"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"tree attention does not support {unsupported}; use attention=sdpa for this model")
        batch, _, q, _ = query.shape
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        tree_mask, cache_lens = tree_inputs_from_hf_mask(attention_mask, batch, q, key.shape[2], is_causal,
                                                         device=query.device)
        out = tree_attention(query, key, value, tree_mask, cache_lens, scaling)  # [B, H, q, D]
        # transformers reshapes [B, q, H, D] straight to [B, q, H * D]: it must be contiguous.
        return out.transpose(1, 2).contiguous(), None

    return attention_forward
