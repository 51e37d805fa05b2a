"""specpipe's CPU weight product over the embedded model's linears, by row count; optionally against the
kernel source of another commit, interleaved in one process.

A verify forward's cost above a few rows is mostly the products' arithmetic, and how the kernel groups
rows decides it. This times `weight_product` alone over SmolLM2-135M's 210 linears and its output layer
(random rows, min over rounds, ms per pass), for the kernel in the working tree and, with `--before REV`,
for the kernel source at git revision REV, built beside it under another name (each source builds once
into the specpipe cache). Rows of one table compare; runs on this VM drift by 15-25%.

    chrt -f 1 .venv/bin/python bench/kernel_rows.py --dtype bf16 --rows 1 4 8 12 16 --before HEAD~1

`--int8` adds the product over the same weights quantized to int8 (a drafter's, specpipe.engine.quantize);
`--cold` reads 300 MB of other memory before every pass, as a draft level runs right after a target forward
streamed the target's weights (`--model` a draft's or head's safetensors file then times its weights).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specpipe.engine import cpu_kernel_build
from specpipe.models import cache_root

KERNEL_FOLDER = "specpipe/kernels/cpu"


def sources_at(revision: str, into: Path) -> Path:
    """The kernel's source files (specpipe/kernels/cpu) at a git revision, written into the folder `into`."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{KERNEL_FOLDER}"], capture_output=True,
                             text=True)
    if listing.returncode != 0:
        sys.exit(f"{revision} has no {KERNEL_FOLDER}: --before takes revisions whose kernel lives in source files")
    for name in listing.stdout.split():
        text = subprocess.run(["git", "show", f"{revision}:{KERNEL_FOLDER}/{name}"], check=True,
                              capture_output=True).stdout
        (into / name).write_bytes(text)
    return into


def build_product(folder: Path):
    """weight_product of the kernel built from the sources in `folder` (this CPU's ISA, the default prefetch hint)."""
    kept = cpu_kernel_build.KERNEL_SOURCES
    cpu_kernel_build.KERNEL_SOURCES = folder  # the build's name hashes the sources, so other sources build apart
    try:
        return cpu_kernel_build.build_kernel(None, cpu_kernel_build.kernel_isa()).weight_product
    finally:
        cpu_kernel_build.KERNEL_SOURCES = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 10, 12, 16])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--before", help="a git revision whose kernel source to time beside the working tree's")
    parser.add_argument("--int8", action="store_true", help="also time the products over int8 codes of the weights")
    parser.add_argument("--cold", action="store_true", help="read 300 MB of other memory before every pass")
    parser.add_argument("--model", default=str(cache_root() / "models" / "smollm2_135m" / "model.safetensors"),
                        help="a safetensors file of a Llama model (default: the converted embedded model)")
    args = parser.parse_args()
    if not Path(args.model).is_file():
        sys.exit(f"{args.model} not found: run `make demo` (or any pipeline) once to convert the embedded "
                 f"model, or name a model's safetensors file with --model")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    state = load_file(args.model)
    weights = [tensor.to(dtype).contiguous() for name, tensor in state.items() if tensor.dim() == 2]  # [out, in]
    variants = {"working tree": build_product(cpu_kernel_build.KERNEL_SOURCES)}
    if args.before:
        with tempfile.TemporaryDirectory(prefix="kernel_before_") as before:  # the build copies what it compiles
            variants[args.before] = build_product(sources_at(args.before, Path(before)))
    if args.int8:
        from specpipe.engine.quantize import quantize_rows

        quantized_product = cpu_kernel_build.build_kernel(None, cpu_kernel_build.kernel_isa()).quantized_product
        codes = {id(weight): quantize_rows(weight) for weight in weights}  # (int8 [out, in], scale [out])
        variants["working tree, int8 weights"] = lambda x, weight, bias: quantized_product(x, *codes[id(weight)], bias)
    other_memory = torch.empty(300_000_000 if args.cold else 0, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    inputs = {rows: [torch.randn(rows, weight.shape[1], generator=generator).to(dtype) for weight in weights]
              for rows in args.rows}  # [rows, in] per weight
    best = {(name, rows): float("inf") for name in variants for rows in args.rows}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for rows in args.rows:
            for name, product in variants.items():  # the variants take turns within each row count
                other_memory.add_(1)  # --cold: the caches hold other data, as after a target forward
                started = time.perf_counter()
                for x, weight in zip(inputs[rows], weights):
                    product(x, weight, None)
                best[name, rows] = min(best[name, rows], 1000.0 * (time.perf_counter() - started))
    print(f"\n{args.dtype} weight products over {len(weights)} weights ({sum(w.numel() for w in weights) / 1e6:.1f}M "
          f"values), {torch.get_num_threads()} threads, min of {args.rounds} interleaved rounds, ms per pass"
          + (", each after reading 300 MB of other memory" if args.cold else ""))
    print("| kernel | " + " | ".join(str(rows) for rows in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for name in variants:
        print(f"| {name} | " + " | ".join(f"{best[name, rows]:.2f}" for rows in args.rows) + " |")


if __name__ == "__main__":
    main()
