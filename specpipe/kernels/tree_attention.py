"""Triton tree attention for the verify forward, and its transformers attention function.

The queries are the q tree nodes; the keys/values of sequence b are its KV cache
([0, cache_lens[b])) followed by the q nodes themselves ([cache_lens[b], cache_lens[b] + q));
anything after that is padding. Every node sees the whole cache; among the nodes it sees
those `tree_mask[b, node]` marks (its ancestors and itself). Semantics are exactly
`specpipe.kernels.reference.tree_attention_reference`.

How the work is laid out (why it looks like this):
- Grouped-query attention: the GROUP query heads that share a kv head are packed into the
  row dimension of one program (row = group_head * q + node). A verify has few queries
  (8-128 nodes), so per-head programs would each re-read the same K/V from memory; packed,
  one program reads each K/V block once for the whole group.
- Split-KV (flash-decoding): with so few rows there are only batch * kv_heads programs per
  row block, far too few to fill a GPU, so the cache can be cut into NUM_SPLITS chunks
  processed in parallel; each writes an unnormalized partial result with its running max
  and sum, and a second small kernel merges them.
- The cache part needs no mask (only bounds); the tree mask is read only for the q tree
  keys. A causal chain (prefill, one-token steps) needs no mask tensor at all.
- 16-bit q/k/v stay 16-bit for the two dots (fp32 accumulation; the softmax weights are
  rounded to the inputs' dtype for the second one, as flash attention does): on a GPU's tensor
  cores that is several times faster for large trees than upcasting them to fp32 and running tf32
  dots. Softmax state is fp32. fp32 inputs use "ieee" dots so
  fp32 models stay exact. Triton's interpreter computes bf16 wrongly, so there everything is
  upcast right after tl.load (`upcast=True` does the same on a GPU).

Importing this module imports Triton and registers the attention function under
TRITON_TREE_ATTENTION; specpipe imports it only when `attention=triton` is chosen.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specpipe.kernels.hf_adapter import make_attention_forward
from specpipe.kernels.reference import check_tree_attention_inputs

TRITON_TREE_ATTENTION = "specpipe_tree_triton"
LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is the native instruction): scores * log2(e)


@triton.jit
def _online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """One key block of online softmax. s [BLOCK_M, BLOCK_N] fp32 log2-scaled scores (-inf = hidden),
    v [BLOCK_N, BLOCK_D] fp32 (or the inputs' 16-bit dtype: then p is rounded to it for the dot);
    m_i, l_i [BLOCK_M] running max and sum; acc [BLOCK_M, BLOCK_D] fp32."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    # A row that has seen no key yet has max -inf; subtracting it would give NaN (-inf - -inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]: rescales what was accumulated under the old max
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]; hidden keys give exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, cache_lens_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,  # split-KV partials (unused when NUM_SPLITS == 1)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mb, stride_mm, stride_mn,
    kv_heads, q_len, head_dim, scale_log2,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)  # block of packed (group head, node) rows
    pid_bh = tl.program_id(1)  # batch * kv_heads + kv head
    pid_s = tl.program_id(2)  # cache split
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    cache_len = tl.load(cache_lens_ptr + b).to(tl.int32)
    n_rows = GROUP * q_len

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < n_rows
    node = rows % q_len  # [BLOCK_M] query index within the tree
    head = kv_head * GROUP + rows // q_len  # [BLOCK_M] query head (repeat_kv order: kv head h serves h*GROUP..)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < head_dim

    q_ptrs = q_ptr + b * stride_qb + head[:, None] * stride_qh + node[:, None] * stride_qm + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D] unnormalized output
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh

    # The cache: all of it visible, so only bounds are masked. This split's chunk is block-aligned
    # so that no block straddles two splits.
    chunk = tl.cdiv(tl.cdiv(cache_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, cache_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :] * stride_kn + d[:, None] * stride_kd,
                    mask=d_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(col_ok[None, :], s, float("-inf"))
        v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)

    # The tree nodes, in the last split only. A causal block never needs nodes past its own last
    # node; when its rows wrap into the next head they may need all of them.
    n_tree = q_len
    if CAUSAL:
        first_node = (pid_m * BLOCK_M) % q_len
        n_tree = tl.where(first_node + BLOCK_M <= q_len, first_node + BLOCK_M, q_len)
    tree_end = tl.where(pid_s == NUM_SPLITS - 1, cache_len + n_tree, cache_len)
    for start in range(cache_len, tree_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        t = cols - cache_len  # [BLOCK_N] the tree node each key belongs to
        col_ok = t < n_tree
        if CAUSAL:
            visible = t[None, :] <= node[:, None]  # [BLOCK_M, BLOCK_N]
        else:
            m_ptrs = mask_ptr + b * stride_mb + node[:, None] * stride_mm + t[None, :] * stride_mn
            visible = tl.load(m_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0) != 0  # [BLOCK_M, BLOCK_N]
        visible = visible & col_ok[None, :]
        k = tl.load(k_base + cols[None, :] * stride_kn + d[:, None] * stride_kd,
                    mask=d_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)

    if NUM_SPLITS == 1:
        # A row that saw nothing (padding, or an empty cache with a hidden self) gets zeros, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D]
        o_ptrs = o_ptr + b * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_om + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials are contiguous fp32: [batch * kv_heads, NUM_SPLITS, n_rows] (+ [.., BLOCK_D] for acc).
        part = (pid_bh * NUM_SPLITS + pid_s) * n_rows + rows  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, o_ptr,
    stride_ob, stride_oh, stride_om, stride_od,
    kv_heads, q_len, head_dim,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    n_rows = GROUP * q_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < n_rows
    node = rows % q_len  # [BLOCK_M]
    head = kv_head * GROUP + rows // q_len  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    base = pid_bh * NUM_SPLITS * n_rows + rows  # [BLOCK_M] partial index of split 0

    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    for split in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + split * n_rows, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # [BLOCK_M]: splits that saw nothing weigh 0
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]
    for split in range(NUM_SPLITS):
        idx = base + split * n_rows  # [BLOCK_M]
        weight = tl.exp2(tl.load(part_m_ptr + idx, mask=row_ok, other=float("-inf")) - m_safe)  # [BLOCK_M]
        l_sum += weight * tl.load(part_l_ptr + idx, mask=row_ok, other=0.0)
        acc += weight[:, None] * tl.load(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None],
                                         other=0.0)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]  # [BLOCK_M, BLOCK_D]
    o_ptrs = o_ptr + b * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_om + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < head_dim))


# The interpreter is chosen when the kernel is decorated (TRITON_INTERPRET=1 at import time).
INTERPRETED = type(_tree_attention_kernel).__name__ == "InterpretedFunction"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(device: torch.device, programs: int, max_cache: int, block_n: int) -> int:
    """Enough cache splits to give every SM about two programs, each split at least 4 key blocks."""
    if device.type != "cuda" or INTERPRETED:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, max_cache // (4 * block_n), 64))


def _launch_config(n_rows: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps). Not timed on a GPU yet: chosen so that ptxas (sm_80,
    sm_90) reports no register spills, since the fp32 copies of Q and the accumulator hold most registers."""
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16 along every dim
    wide = dtype == torch.float32 or block_d > 128  # fp32 "ieee" dots and big heads need smaller tiles
    block_m = min(32 if wide else 64, max(16, triton.next_power_of_2(n_rows)))
    block_n = 64 if block_d <= 64 and dtype != torch.float32 else 32
    if dtype == torch.float32:
        num_warps = 8 if block_d > 128 else 4
    else:
        num_warps = 8 if block_m * block_d >= 4096 else 4
    return block_m, block_n, block_d, num_warps


def tree_attention(query: Tensor, key: Tensor, value: Tensor, tree_mask: Tensor | None, cache_lens: Tensor,
                   scale: float | None = None, *, num_splits: int | None = None, block_m: int | None = None,
                   block_n: int | None = None, precision: str | None = None, num_warps: int | None = None,
                   upcast: bool = False) -> Tensor:
    """Attention of q tree-node queries over [cache | tree nodes] keys, with the Triton kernel.

    query      [batch, heads, q, head_dim] fp32/fp16/bf16, any strides
    key, value [batch, kv_heads, kv, head_dim] (kv >= max(cache_lens) + q; kv_heads divides heads)
    tree_mask  [batch, q, q] bool: node i sees node j. None = causal chain (prefill, one-token steps)
    cache_lens [batch] int, on query's device: where each sequence's tree nodes start among its keys
    scale      softmax scale; None = 1/sqrt(head_dim)
    num_splits, block_m, block_n, precision, num_warps, upcast: tuning overrides (None = chosen here);
               block sizes are powers of two >= 16, precision a tl.dot input_precision ("ieee", "tf32",
               ...); upcast=True runs 16-bit q/k/v as fp32 (tf32) dots instead of 16-bit ones
    returns    [batch, heads, q, head_dim] in query's dtype, a view of a contiguous [batch, q, heads, head_dim]
               buffer (what transformers wants back); a query that sees no key gets zeros
    """
    check_tree_attention_inputs(query, key, value, tree_mask, cache_lens)
    if not INTERPRETED and query.device.type != "cuda":
        raise ValueError(f"the Triton tree-attention kernel needs CUDA tensors (got {query.device}); on CPU use "
                         f"attention=sdpa, or TRITON_INTERPRET=1 (set before specpipe is imported) to interpret it")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16) or key.dtype != query.dtype \
            or value.dtype != query.dtype:
        raise ValueError(f"query/key/value must share one of fp32/fp16/bf16, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    batch, heads, q, head_dim = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.empty(batch, q, heads, head_dim, dtype=query.dtype, device=query.device)  # [B, q, H, D]
    out_bhqd = out.transpose(1, 2)  # [B, H, q, D] view
    if out.numel() == 0:
        return out_bhqd

    n_rows = group * q
    default_m, default_n, block_d, default_warps = _launch_config(n_rows, head_dim, query.dtype)
    block_m, block_n, num_warps = block_m or default_m, block_n or default_n, num_warps or default_warps
    # The interpreter computes bf16 wrongly, so it always upcasts.
    upcast = True if INTERPRETED or query.dtype == torch.float32 else bool(upcast)
    m_blocks = triton.cdiv(n_rows, block_m)
    splits = num_splits or _default_num_splits(query.device, m_blocks * batch * kv_heads, kv - q, block_n)
    precision = precision or ("ieee" if query.dtype == torch.float32 else "tf32")

    cache_lens = cache_lens.to(device=query.device)
    causal = tree_mask is None
    # Triton loads bytes, not bools; view() keeps the strides (the adapter passes a slice of a bigger mask).
    mask = cache_lens if causal else tree_mask.to(query.device).view(torch.uint8)  # [B, q, q] (or unused)
    mask_strides = (0, 0, 0) if causal else mask.stride()
    if splits > 1:
        part_m = torch.empty(batch * kv_heads, splits, n_rows, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)  # [B * KVH, splits, rows]
        part_acc = torch.empty(batch * kv_heads, splits, n_rows, block_d, dtype=torch.float32,
                               device=query.device)  # [B * KVH, splits, rows, BLOCK_D]
    else:
        part_m = part_l = part_acc = out  # never touched
    _tree_attention_kernel[(m_blocks, batch * kv_heads, splits)](
        query, key, value, out_bhqd, mask, cache_lens,
        part_acc, part_m, part_l,
        *query.stride(), *key.stride(), *value.stride(), *out_bhqd.stride(), *mask_strides,
        kv_heads, q, head_dim, scale * LOG2E,
        GROUP=group, NUM_SPLITS=splits, CAUSAL=causal,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(m_blocks, batch * kv_heads)](
            part_acc, part_m, part_l, out_bhqd, *out_bhqd.stride(), kv_heads, q, head_dim,
            GROUP=group, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_D=block_d,
        )
    return out_bhqd


tree_attention_forward = make_attention_forward(tree_attention)
AttentionInterface.register(TRITON_TREE_ATTENTION, tree_attention_forward)
# Prefill passes no mask: build it the way SDPA's own path does (None when plain causal).
ALL_MASK_ATTENTION_FUNCTIONS.register(TRITON_TREE_ATTENTION, sdpa_mask)
