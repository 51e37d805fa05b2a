"""torch's own CPU weight-only ops against specpipe's kernel over GGUF blocks, 1-32 rows, two shapes of the embedded
model (gate|up and the output layer), us per product (best of 5, one process, 2 threads):

    python bench/weight_only_ops.py
"""
from __future__ import annotations

import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from specpipe.engine.cpu_kernel import CpuKernel


def best_us(call, repeats: int) -> float:
    call()
    call()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        times.append((time.perf_counter() - started) / repeats)
    return min(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    kernel = CpuKernel()
    if kernel.gguf_product is None:
        raise SystemExit(f"specpipe's CPU kernel does not serve here: {kernel.reason}")
    for out_features, in_features in ((3072, 576), (49152, 576)):
        weight = torch.randn(out_features, in_features) * 0.03
        q8_0 = torch.from_numpy(np.ascontiguousarray(quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)))
        q4_1 = torch.from_numpy(np.ascontiguousarray(quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_1)))
        scale = weight.abs().amax(1) / 127  # torch's int8pack: one scale per output row
        codes8 = torch.round(weight / scale[:, None]).to(torch.int8)
        group = 32  # torch's int4pack: per group of 32, w = (q - 8) * scale + zero, [in / group, out, 2] bf16
        grouped = weight.view(out_features, in_features // group, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        step = ((high - low) / 15).clamp(min=1e-8)
        codes4 = torch.clamp(torch.round((grouped - low[..., None]) / step[..., None]), 0, 15).to(torch.int32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4.view(out_features, in_features), 2)
        scales_zeros = torch.stack([step, low + 8 * step], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        repeats = 20 if out_features > 10000 else 200
        print(f"\n{out_features} x {in_features}, us per product")
        print("rows | gguf Q8_0 fp32 | gguf Q4_1 fp32 | aten int8pack fp32 | aten int8pack bf16 | aten int4pack bf16")
        for rows in (1, 2, 4, 8, 16, 32):
            x = torch.randn(rows, in_features)
            x16 = x.bfloat16()
            cells = [best_us(lambda: kernel.gguf_product(x, q8_0, 8, in_features, None), repeats),
                     best_us(lambda: kernel.gguf_product(x, q4_1, 3, in_features, None), repeats),
                     best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, codes8, scale), repeats),
                     best_us(lambda: torch.ops.aten._weight_int8pack_mm(x16, codes8, scale.bfloat16()), repeats),
                     best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed4, group, scales_zeros),
                             repeats)]
            print(rows, "|", " | ".join(f"{value:.0f}" for value in cells))


if __name__ == "__main__":
    main()
