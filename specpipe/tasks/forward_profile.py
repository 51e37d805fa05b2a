"""Where a target forward's time goes: torch profiler op self time per forward, for `task=bench_cost`.

The profiler sees ATen/oneDNN ops, and specpipe's own kernel calls under names given while profiling;
the time between them (Python in the model's modules, dispatch, allocation) is the forward's
unprofiled wall time minus the op total, so one table answers both "which ops dominate" and "how much
is not in any op".
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specpipe.cost import random_branches

BETWEEN_OPS = "(between ops: Python, dispatch)"
KERNEL_PRODUCT = "specpipe::weight_product"  # specpipe's CPU kernel (specpipe.engine.cpu_kernel)
KERNEL_NORM = "specpipe::rms_norm"
KERNEL_ATTENTION = "specpipe::tree_attention"
OTHER_OPS = "(other ops)"
TOTAL = "(wall time, unprofiled)"


def profile_forward(target, queries: int, kv_length: int = 256, repeats: int = 8, seed: int = 0) -> dict[str, float]:
    """op name -> milliseconds of self time per forward of `target.forward_tree` with q = `queries`
    (q - 1 draft nodes in two branches, as the cost curves are measured) over a `kv_length` cache, plus BETWEEN_OPS
    and TOTAL rows."""
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, target.vocab_size, (kv_length + 1,), generator=generator).tolist()
    tree = random_branches(queries, target.vocab_size, generator)
    cache = target.new_cache()
    target.prefill(context[:-1], cache)

    def forward() -> None:
        target.forward_tree(context[-1], tree, cache)
        cache.crop(kv_length)

    wall = []
    for index in range(repeats + 1):
        start = time.perf_counter()
        forward()
        if index:  # the first call warms up
            wall.append((time.perf_counter() - start) * 1000.0)
    with profile(activities=[ProfilerActivity.CPU]) as profiler, _kernel_calls_named(target.model):
        for _ in range(repeats):
            forward()
    per_op: dict[str, float] = defaultdict(float)
    for event in profiler.key_averages():
        if event.self_cpu_time_total > 0:
            per_op[event.key] += event.self_cpu_time_total / 1000.0 / repeats  # µs total -> ms per forward
    total = statistics.median(wall)
    per_op = dict(per_op)
    per_op[BETWEEN_OPS] = max(0.0, total - sum(per_op.values()))
    per_op[TOTAL] = total
    return per_op


@contextmanager
def _kernel_calls_named(model: torch.nn.Module):
    """While open, every call of specpipe's CPU kernel in `model` (products, norms, attention) is a profiler event of
    its own (KERNEL_PRODUCT, KERNEL_NORM, KERNEL_ATTENTION): the extension is called directly, not through torch's
    dispatcher, so the profiler would count its time as time between ops."""
    from specpipe.engine.lean_model import LeanLlamaModel
    from specpipe.engine.onednn import PackedWeight

    def named(function, name: str):
        def call(*args):
            with record_function(name):
                return function(*args)
        return call

    originals = []  # (module, attribute, the function it held)
    for module in model.modules():
        if isinstance(module, PackedWeight):  # every product the kernel runs: dense, row-invariant, native, blocks
            for attribute in ("kernel", "invariant_kernel", "native_kernel", "block_product"):
                if getattr(module, attribute) is not None:
                    originals.append((module, attribute, getattr(module, attribute)))
                    setattr(module, attribute, named(getattr(module, attribute), KERNEL_PRODUCT))
        elif isinstance(module, LeanLlamaModel):
            for attribute, name in (("norm_kernel", KERNEL_NORM), ("attention_kernel", KERNEL_ATTENTION)):
                if getattr(module, attribute) is not None:
                    originals.append((module, attribute, getattr(module, attribute)))
                    setattr(module, attribute, named(getattr(module, attribute), name))
    try:
        yield
    finally:
        for module, attribute, function in originals:
            setattr(module, attribute, function)


def top_ops(profiles: Sequence[dict[str, float]], count: int = 8) -> list[str]:
    """The `count` ops with the most time summed over `profiles`, then OTHER_OPS, BETWEEN_OPS, TOTAL."""
    summed: dict[str, float] = defaultdict(float)
    for per_op in profiles:
        for name, ms in per_op.items():
            if name not in (BETWEEN_OPS, TOTAL):
                summed[name] += ms
    return sorted(summed, key=summed.__getitem__, reverse=True)[:count] + [OTHER_OPS, BETWEEN_OPS, TOTAL]


def row_value(per_op: dict[str, float], name: str, shown: Sequence[str]) -> float:
    if name == OTHER_OPS:
        return sum(ms for op, ms in per_op.items() if op not in shown)
    return per_op.get(name, 0.0)
