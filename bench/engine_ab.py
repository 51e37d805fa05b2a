"""Interleaved A/B of two engine settings on the target's verify forward, in one process.

The VM this project is developed on drifts by 15-25% within minutes, so "before" and "after" of an
engine change are two models in one process, their forwards taking turns over the same random
context and draft trees. Prints the median ms per forward for each q, the ratio after/before, and
how far the two models' logits are apart (the largest difference and whether every row's argmax agrees).

    chrt -f 1 .venv/bin/python bench/engine_ab.py --dtype fp32 --queries 1,2,4,8,16 \\
        --before engine.fp32_kernel_rows=0

`--before` / `--after` take config overrides (repeatable); each side loads its own copy of the model.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specpipe.cost import random_branches, random_chain
from specpipe.engine.base import REWRITE_ATTRIBUTE
from specpipe.pipelines.builder import build_target, compose_config, load_model
from specpipe.target import TargetModel


def build(dtype: str, overrides: list[str]) -> TargetModel:
    cfg = compose_config([f"model.dtype={dtype}", *overrides])
    target, _ = build_target(cfg, load_model(cfg.model))  # threads, engine and attention as a pipeline's
    print(f"  {' '.join(overrides) or '(defaults)'}: {getattr(target.model, REWRITE_ATTRIBUTE, 'engine=hf')}")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--queries", default="1,2,4,8,16", help="rows per forward: the root and q - 1 draft nodes")
    parser.add_argument("--tree", choices=("chain", "branched"), default="chain",
                        help="the draft nodes as one chain, or as two branches (on AMX CPUs only those take the tiles)")
    parser.add_argument("--kv-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--before", action="append", default=[])
    parser.add_argument("--after", action="append", default=[])
    args = parser.parse_args()
    queries = [int(q) for q in args.queries.split(",")]
    sides = {"before": build(args.dtype, args.before), "after": build(args.dtype, args.after)}
    vocab = next(iter(sides.values())).vocab_size
    context = torch.randint(0, vocab, (args.kv_length + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    caches = {}
    for name, target in sides.items():
        caches[name] = target.new_cache()
        target.prefill(context[:-1], caches[name])
    shape = random_chain if args.tree == "chain" else random_branches
    trees = {q: shape(q, vocab, torch.Generator().manual_seed(q)) for q in queries}

    def forward(name: str, q: int) -> tuple[float, torch.Tensor]:
        started = time.perf_counter()
        out = sides[name].forward_tree(context[-1], trees[q], caches[name])
        elapsed = time.perf_counter() - started
        caches[name].crop(args.kv_length)
        return elapsed, out.logits  # [q, vocab]

    for q in queries:
        before, after = forward("before", q)[1], forward("after", q)[1]
        differing = int((before.argmax(-1) != after.argmax(-1)).sum())
        print(f"q={q}: logits differ by at most {(before - after).abs().max().item():.3g}, "
              f"argmax differs in {differing} of {before.shape[0]} rows")
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for q in queries:
            for name in sides:
                times.setdefault((name, q), []).append(forward(name, q)[0])
    print(f"\n{args.dtype}, KV {args.kv_length}, {args.tree} trees, {args.rounds} interleaved rounds, median ms per forward")
    print("| q | before | after | after / before |\n|---:|---:|---:|---:|")
    for q in queries:
        before, after = (statistics.median(times[(name, q)]) * 1000 for name in ("before", "after"))
        print(f"| {q} | {before:.1f} | {after:.1f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
