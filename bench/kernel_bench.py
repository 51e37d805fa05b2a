"""Tree-attention kernel benchmark (needs a CUDA GPU).

Times one verify-attention call (one layer) of specpipe's Triton kernel against the two ways
torch can do the same thing: SDPA with a boolean [q, cache + q] mask (what `attention=sdpa`
runs: transformers repeats the kv heads, then calls SDPA with the mask) and FlexAttention
with a block mask built from the tree. Every output is checked against the torch reference
before anything is timed. Times are medians of `triton.testing.do_bench`, in microseconds.

    python bench/kernel_bench.py --out kernel_bench.md
    python bench/kernel_bench.py --cache-lens 1024 4096 --tree-sizes 16 64 --dtype fp16
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads (Llama-3-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take a while)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: time the kernel's tuning overrides (upcast, num_splits, num_warps) per shape")
    return parser.parse_args(argv)


def random_tree_mask(n: int, generator: torch.Generator) -> torch.Tensor:
    """[n, n] bool ancestor-or-self mask of a random tree (each node's parent: any earlier node or the root)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_flex(tree_mask: torch.Tensor, cache_len: int, q: int, kv: int):
    """A compiled FlexAttention call whose block mask encodes [whole cache | tree]; None where unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    tree = tree_mask[0]  # [q, q] on the GPU, captured by the mask function

    def mask_mod(b, h, q_idx, kv_idx):
        node = kv_idx - cache_len  # which tree node a key is (negative: the cache)
        in_tree = (node >= 0) & (node < q)
        return (kv_idx < cache_len) | (in_tree & tree[q_idx, node.clamp(0, q - 1)])

    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=q, KV_LEN=kv, device=tree.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda query, key, value, scale: compiled(query, key, value, block_mask=block_mask, scale=scale,
                                                     enable_gqa=True)


def bench_case(cache_len: int, n: int, args, tree_attention, tree_attention_reference, do_bench,
               device: str = "cuda") -> dict:
    """One table row: {"cache", "tree", and per candidate its median time (us) or why there is none}."""
    generator = torch.Generator().manual_seed(args.seed + 1000 * n + cache_len)
    dtype, device = DTYPES[args.dtype], torch.device(device)
    kv = cache_len + n
    query = torch.randn(1, args.heads, n, args.head_dim, generator=generator).to(device, dtype)  # [1, H, q, D]
    key = torch.randn(1, args.kv_heads, kv, args.head_dim, generator=generator).to(device, dtype)  # [1, KVH, kv, D]
    value = torch.randn(1, args.kv_heads, kv, args.head_dim, generator=generator).to(device, dtype)
    tree_mask = random_tree_mask(n, generator)[None].to(device)  # [1, q, q]
    cache_lens = torch.tensor([cache_len], dtype=torch.int32, device=device)  # [1]
    scale = 1.0 / math.sqrt(args.head_dim)
    full_mask = torch.ones(1, 1, n, kv, dtype=torch.bool, device=device)  # [1, 1, q, kv]: built once per forward
    full_mask[0, 0, :, cache_len:] = tree_mask[0]
    group = args.heads // args.kv_heads

    def sdpa():  # as transformers' SDPA path runs it with a mask: repeat the kv heads, then SDPA
        k = key.repeat_interleave(group, dim=1)  # [1, H, kv, D]
        v = value.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=full_mask, scale=scale)

    candidates = {"triton": lambda: tree_attention(query, key, value, tree_mask, cache_lens, scale), "sdpa": sdpa}
    if not args.no_flex:
        try:
            flex = make_flex(tree_mask, cache_len, n, kv)
        except Exception as error:  # an old torch, or an unsupported shape
            flex, candidates["flex"] = None, f"n/a ({type(error).__name__})"
        if flex is not None:
            candidates["flex"] = lambda: flex(query, key, value, scale)
    expected = tree_attention_reference(query, key, value, tree_mask, cache_lens.cpu(), scale).float()
    tolerance = 2e-2 if dtype != torch.float32 else 1e-3
    row = {"cache": cache_len, "tree": n}
    for name, fn in candidates.items():
        if isinstance(fn, str):
            row[name] = fn
            continue
        try:
            out = fn().float()
        except Exception as error:
            row[name] = f"n/a ({type(error).__name__})"
            continue
        error = (out - expected).abs().max().item()
        if not error <= tolerance * (1 + expected.abs().max().item()):
            row[name] = f"MISMATCH ({error:.3g})"
            row["mismatch"] = True
            continue
        row[name] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0  # ms -> us
    return row


SWEEP = [dict(upcast=upcast, num_splits=splits, num_warps=warps)
         for upcast in (True, False) for splits in (None, 1, 16) for warps in (None, 8)]


def sweep_case(cache_len: int, n: int, args, tree_attention, tree_attention_reference, do_bench,
               device: str = "cuda") -> list[str]:
    """Table rows: the kernel's time under each tuning override of SWEEP (checked against the reference)."""
    generator = torch.Generator().manual_seed(args.seed + 1000 * n + cache_len)
    dtype, device = DTYPES[args.dtype], torch.device(device)
    query = torch.randn(1, args.heads, n, args.head_dim, generator=generator).to(device, dtype)  # [1, H, q, D]
    key = torch.randn(1, args.kv_heads, cache_len + n, args.head_dim, generator=generator).to(device, dtype)
    value = torch.randn(1, args.kv_heads, cache_len + n, args.head_dim, generator=generator).to(device, dtype)
    tree_mask = random_tree_mask(n, generator)[None].to(device)  # [1, q, q]
    cache_lens = torch.tensor([cache_len], dtype=torch.int32, device=device)
    expected = tree_attention_reference(query, key, value, tree_mask, cache_lens.cpu()).float()
    tolerance = 2e-2 if dtype != torch.float32 else 1e-3
    rows = []
    for options in SWEEP:
        def run():
            return tree_attention(query, key, value, tree_mask, cache_lens, **options)
        try:
            error = (run().float() - expected).abs().max().item()
            time = "MISMATCH" if error > tolerance * (1 + expected.abs().max().item()) else \
                f"{do_bench(run, warmup=25, rep=100, return_mode='median') * 1000.0:.1f}"
        except Exception as failure:
            error, time = float("nan"), f"n/a ({type(failure).__name__})"
        label = ", ".join(f"{k}={'auto' if v is None else v}" for k, v in options.items())
        rows.append(f"| {cache_len} | {n} | {label} | {time} | {error:.2g} |")
        print(rows[-1], flush=True)
    return rows


def cell(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def ratio(row: dict, other: str) -> str:
    a, b = row.get(other), row.get("triton")
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench.py times GPU kernels and needs a CUDA device; this machine has none "
              "(the kernel's correctness tests run on CPU under TRITON_INTERPRET=1: "
              "pytest tests/test_tree_attention_kernel.py)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_bench.py: unset TRITON_INTERPRET (interpreted kernels cannot be timed)", file=sys.stderr)
        return 2
    try:
        from triton.testing import do_bench
    except ImportError as error:
        print(f"kernel_bench.py needs Triton ({error}): pip install triton", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        print(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}", file=sys.stderr)
        return 2
    import triton

    from specpipe.kernels.reference import tree_attention_reference
    from specpipe.kernels.tree_attention import tree_attention

    for limit in ("recompile_limit", "cache_size_limit"):  # one FlexAttention compile per shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 1024)
    if args.sweep:
        lines = [f"Kernel tuning sweep: {args.heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
                 f"{args.dtype}. {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
                 f"{triton.__version__}. Median microseconds; max abs error against the reference.", "",
                 "| cache | tree | overrides | us | max error |", "|---|---|---|---|---|"]
        print("\n".join(lines), flush=True)
        for cache_len in args.cache_lens:
            for n in args.tree_sizes:
                lines += sweep_case(cache_len, n, args, tree_attention, tree_attention_reference, do_bench)
        if args.out:
            with open(args.out, "w") as file:
                file.write("\n".join(lines) + "\n")
        return 0
    columns = ["triton", "sdpa"] + ([] if args.no_flex else ["flex"])
    lines = [
        f"Tree attention, one layer: {args.heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"{args.dtype}, batch 1, random trees. {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}. Median microseconds (triton.testing.do_bench); ratios = their time / ours.",
        "",
        "| cache | tree | " + " | ".join(f"{c} (us)" for c in columns) + " | "
        + " | ".join(f"{c} / triton" for c in columns[1:]) + " |",
        "|" + "---|" * (2 + 2 * len(columns) - 1),
    ]
    print("\n".join(lines), flush=True)
    mismatch = False
    for cache_len in args.cache_lens:
        for n in args.tree_sizes:
            row = bench_case(cache_len, n, args, tree_attention, tree_attention_reference, do_bench)
            mismatch |= row.get("mismatch", False)
            line = (f"| {cache_len} | {n} | " + " | ".join(cell(row.get(c, "-")) for c in columns) + " | "
                    + " | ".join(ratio(row, c) for c in columns[1:]) + " |")
            print(line, flush=True)
            lines.append(line)
    if args.out:
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    if mismatch:
        print("some outputs disagree with the reference (MISMATCH cells): their times were not taken", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
