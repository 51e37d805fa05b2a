"""Tree attention in plain torch: the reference the Triton kernel is tested against.

Written to be obviously right, not fast: it materializes the full visibility mask and the
full score matrix of every sequence. It shares its signature (and input checks) with
`specpipe.kernels.tree_attention.tree_attention`, and needs no Triton.

Layout of the keys of sequence b (L = key.shape[2], c = cache_lens[b], q = query.shape[2]):

    [0, c)        its KV cache: every query sees all of it
    [c, c + q)    the q tree nodes themselves, in query order: tree_mask[b] says who sees whom
    [c + q, L)    padding (shorter caches in a batch): never seen
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_tree_attention_inputs(query: Tensor, key: Tensor, value: Tensor, tree_mask: Tensor | None,
                                cache_lens: Tensor) -> None:
    """Raises ValueError on shapes that cannot mean a tree verify; values of cache_lens are checked
    only on the CPU (on a GPU reading them back would stall the stream every layer)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query/key/value must be 4D [batch, heads, len, head_dim], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batch, heads, q, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query "
                         f"{tuple(query.shape)} (same batch and head_dim expected)")
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"grouped-query attention needs kv_heads ({kv_heads}) to divide heads ({heads})")
    if tree_mask is not None and tuple(tree_mask.shape) != (batch, q, q):
        raise ValueError(f"tree_mask must be [batch, q, q] = {(batch, q, q)}, got {tuple(tree_mask.shape)}")
    if tuple(cache_lens.shape) != (batch,) or cache_lens.dtype.is_floating_point:
        raise ValueError(f"cache_lens must be an int tensor [batch] = [{batch}], got {cache_lens.dtype} "
                         f"{tuple(cache_lens.shape)}")
    if cache_lens.device.type == "cpu" and batch and q and (
            int(cache_lens.min()) < 0 or int(cache_lens.max()) + q > key.shape[2]):
        raise ValueError(f"cache_lens {cache_lens.tolist()} + {q} tree nodes exceed the {key.shape[2]} keys")


def visibility_mask(tree_mask: Tensor | None, cache_lens: Tensor, q: int, kv: int) -> Tensor:
    """[batch, q, kv] bool: which keys each query sees (cache, then its tree ancestors per tree_mask)."""
    batch = cache_lens.shape[0]
    if tree_mask is None:  # a causal chain: node i sees nodes 0..i
        tree_mask = torch.ones(q, q, dtype=torch.bool, device=cache_lens.device).tril().expand(batch, q, q)
    visible = torch.zeros(batch, q, kv, dtype=torch.bool, device=tree_mask.device)  # [batch, q, kv]
    for b, cache_len in enumerate(cache_lens.tolist()):
        visible[b, :, :cache_len] = True
        visible[b, :, cache_len:cache_len + q] = tree_mask[b]
    return visible


def tree_attention_reference(query: Tensor, key: Tensor, value: Tensor, tree_mask: Tensor | None,
                             cache_lens: Tensor, scale: float | None = None) -> Tensor:
    """Attention of q tree-node queries over [cache | tree nodes] keys.

    query      [batch, heads, q, head_dim]
    key, value [batch, kv_heads, kv, head_dim]   (kv >= max(cache_lens) + q; kv_heads divides heads)
    tree_mask  [batch, q, q] bool: node i sees node j (j must be an ancestor-or-self of i for a tree;
               any pattern works). None = causal chain (prefill, single-token steps).
    cache_lens [batch] int: where each sequence's tree nodes start among its keys
    scale      softmax scale; None = 1/sqrt(head_dim)
    returns    [batch, heads, q, head_dim] in query's dtype; a query that sees no key gets zeros
    """
    check_tree_attention_inputs(query, key, value, tree_mask, cache_lens)
    batch, heads, q, head_dim = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = heads // kv_heads
    # Query head h reads kv head h // group (transformers' repeat_kv order).
    k = key.float().repeat_interleave(group, dim=1)  # [batch, heads, kv, head_dim]
    v = value.float().repeat_interleave(group, dim=1)  # [batch, heads, kv, head_dim]
    scores = query.float() @ k.transpose(-1, -2) * scale  # [batch, heads, q, kv]
    visible = visibility_mask(tree_mask, cache_lens.cpu(), q, kv).to(query.device)  # [batch, q, kv]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [batch, heads, q, kv]
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key: softmax of all -inf is NaN
    return (probs @ v).to(query.dtype)  # [batch, heads, q, head_dim]
