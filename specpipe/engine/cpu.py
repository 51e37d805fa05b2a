"""What this CPU runs: ATen's vector ISA, the oneDNN kernel a prepacked linear gets, and so which
prepacked path each model dtype can take.

Why a probe and not a feature table: oneDNN's bf16 inner product needs avx512bw/vl/dq or
avx_ne_convert, and its prepacking raises on CPUs without them (most laptops and many cloud
CPUs have AVX2 only). `ONEDNN_MAX_CPU_ISA` and `ATEN_CPU_CAPABILITY` can also hold a newer CPU
back. Packing and running a tiny weight asks the library itself, whatever the reason.
"""
from __future__ import annotations

import os
import platform
import re
import sys
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

# What the CPU and ATen run, probed in a leaf module that the kernel's build asks too
from specpipe.engine.cpuinfo import aten_capability, cpu_model_and_flags, kernel_isa
from specpipe.engine.cpuinfo import first_line as _first_line

# Rows the weight layout is prepacked for. The packed weight serves any number of rows; packed
# for a verify-sized batch it measured as fast as a 1-row packing for 1 row and up to 2x faster
# for 4-16 rows.
PACKING_ROWS_HINT = 16

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# engine.fp32_split_rows=auto (see `auto_split_rows`): up to these rows split GEMMs beat oneDNN in SmolLM2-135M's whole
# lean forward (2-core VMs; AVX2: docs/notebook/run-09.md, AVX-512: docs/notebook/run-13.md).
AUTO_SPLIT_ROWS = 4  # x86 CPUs whose oneDNN fp32 kernel is AVX2 (or older)
AUTO_SPLIT_ROWS_AVX512 = 2
# engine.fp32_kernel_rows / bf16_kernel_rows = auto (see `auto_kernel_rows`): products of up to this many rows
# run specpipe's product kernel (specpipe.engine.cpu_kernel), which streams the weights once for all rows, up to
# where the stock products catch up with it (SmolLM2-135M on 2-core VMs, bench/engine_ab.py):
# - fp32 weights where oneDNN's fp32 kernel is AVX2: faster than split GEMMs and oneDNN up to 16 rows, about even
#   from 24 (docs/notebook/run-23.md).
AUTO_FP32_KERNEL_ROWS = 16
# - bf16 weights where oneDNN has no bf16 kernel (packed in fp32): the kernel on the bf16 weights faster than the
#   fp32 packing and bf16 F.linear up to 32 rows (docs/notebook/run-21.md).
AUTO_BF16_UPCAST_KERNEL_ROWS = 32
# - fp32 and bf16 weights where oneDNN's kernel is AVX-512 (the kernel's AVX-512 build): the whole forward faster
#   up to 8 rows, not from 12 (docs/notebook/run-24.md).
AUTO_KERNEL_ROWS_AVX512 = 8
# - bf16 weights where the kernel's build multiplies bf16 pairs (AVX512_BF16), 9-12 rows in one pass: faster up to
#   24 rows (docs/notebook/run-24.md, run-30.md).
AUTO_BF16_PAIR_KERNEL_ROWS = 24
# - bf16 weights in column blocks (engine.kernel_blocks, the AVX512_BF16 build): faster than oneDNN up to 96 rows,
#   slower at 128 (docs/notebook/run-57.md).
AUTO_BF16_BLOCK_KERNEL_ROWS = 64
# - bf16 weights in column blocks where oneDNN's bf16 kernel runs on AMX tiles (16 rows a pass): below 16 rows both
#   stream the same weights and the kernel's one pass costs less than oneDNN's per-call set-up; from 16 oneDNN wins.
#   The kernel's own tile products (engine.amx_rows) would stay faster further, but only a branched tree's verify
#   takes them (cpu_kernel.TileRows): a chain's, by the vector product, costs more than oneDNN's from 13 rows
#   (2-core AMX VM: docs/notebook/run-61.md, run-63.md).
AUTO_BF16_AMX_KERNEL_ROWS = 12


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> oneDNN's blocked layout for `_linear_pointwise` (raises where the CPU has no path)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] through a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_row_blocks(out_features: int, threads: int) -> int:
    """How many row blocks `split_linear` cuts a weight of `out_features` rows into: the most, up
    to one per thread, that divide it evenly."""
    return next(blocks for blocks in range(max(1, min(threads, out_features)), 0, -1) if out_features % blocks == 0)


def row_blocks(weight: torch.Tensor, threads: int) -> torch.Tensor:
    """weight [out, in] -> a view [blocks, out / blocks, in], `weight_row_blocks(out, threads)` blocks."""
    out_features, in_features = weight.shape
    blocks = weight_row_blocks(out_features, threads)
    return weight.view(blocks, out_features // blocks, in_features)


def split_linear(x: torch.Tensor, blocked_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias [out]) -> [..., out], as one batched GEMM over the row blocks
    `blocked_weight` [blocks, out / blocks, in] (from `row_blocks`), one block per thread.

    Why: for the few rows of a decoding step the BLAS runs a matrix-vector product on one thread
    and oneDNN's AVX2 kernel streams the weights well below the memory's bandwidth; a batch of one
    block per thread keeps every core streaming its own block. Inside the whole forward it wins up
    to AUTO_SPLIT_ROWS rows on an AVX2 CPU.
    """
    blocks, block_rows, in_features = blocked_weight.shape
    out_features = blocks * block_rows
    rows = x.numel() // in_features
    if rows == 1 and x.is_contiguous():
        # a decoding step's one row: the same [blocks, in, 1] view as below, made by one op instead
        # of three (this runs ~120 times per step, where every op's fixed cost shows)
        columns = x.as_strided((blocks, in_features, 1), (0, 1, in_features), x.storage_offset())
    else:
        # [in, rows] as the transpose of x's rows, not a copy: this layout runs BLAS's fast path (a
        # contiguous [in, 1] column measured 4x slower for one row)
        columns = x.reshape(rows, in_features).t().expand(blocks, in_features, rows)  # [blocks, in, rows]
    product = torch.bmm(blocked_weight, columns)  # [blocks, out / blocks, rows]
    out = product.view(out_features) if rows == 1 else product.view(out_features, rows).t().contiguous()
    if bias is not None:
        out += bias  # out is a fresh tensor: bmm's output or its contiguous copy
    return out.view(*x.shape[:-1], out_features)  # [..., out]


def auto_split_rows(onednn_kernel: str) -> int:
    """engine.fp32_split_rows=auto: how many rows split GEMMs serve on a CPU whose oneDNN fp32 kernel is
    `onednn_kernel` (see AUTO_SPLIT_ROWS). 0 on AMX CPUs and off x86, where they were not measured."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    if not x86 or "amx" in onednn_kernel:
        return 0
    return AUTO_SPLIT_ROWS_AVX512 if "avx512" in onednn_kernel else AUTO_SPLIT_ROWS


def auto_kernel_rows(path: "LinearPath", kernel_isa: str) -> int:
    """engine.fp32_kernel_rows / bf16_kernel_rows = auto: how many rows specpipe's kernel (built for
    `kernel_isa`, specpipe.engine.cpu_kernel_build.kernel_isa) serves for a model whose linears take `path` on
    this CPU (see AUTO_FP32_KERNEL_ROWS and the constants beside it): 16 fp32 rows where oneDNN's fp32
    kernel is AVX2, 32 bf16 rows where bf16 weights are packed in fp32, 8 rows where oneDNN's kernel is
    AVX-512 (24 bf16 rows where the kernel multiplies bf16 pairs, 64 in column blocks), 12 bf16 rows in column blocks
    where oneDNN's bf16 kernel is AMX (with or without the blocks' own tiles), and 0 for AMX's other cases,
    under oneDNN's other bf16 kernels and off x86, where the kernel was not measured against oneDNN (or does not
    exist)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    if path.dtype == torch.bfloat16 and path.compute_dtype == torch.float32:
        return AUTO_BF16_UPCAST_KERNEL_ROWS
    if "amx" in path.kernel:
        blocks = path.dtype == torch.bfloat16 and kernel_isa == "avx512_bf16" and path.kernel_blocks
        if not blocks:
            return 0
        return AUTO_BF16_AMX_KERNEL_ROWS
    if "avx512" in path.kernel:
        pairs = path.dtype == torch.bfloat16 and kernel_isa == "avx512_bf16"
        if pairs:
            return AUTO_BF16_BLOCK_KERNEL_ROWS if path.kernel_blocks else AUTO_BF16_PAIR_KERNEL_ROWS
        return AUTO_KERNEL_ROWS_AVX512
    return AUTO_FP32_KERNEL_ROWS if path.dtype == torch.float32 else 0


@dataclass(frozen=True)
class LinearPath:
    """How linears of a model in `dtype` run under engine=fast.

    `compute_dtype` is the dtype the weight is packed in and the product is computed in; when
    it differs from `dtype`, inputs are upcast and outputs cast back (a bf16 GEMM accumulates in
    fp32 and rounds its output to bf16 too, so only the order of the sums differs). Products of
    at most `small_rows` rows then run as transformers' own `F.linear` on the weights in `dtype`
    instead: a one-token step streams half the bytes that way. fp32 products of at most
    `split_rows` rows run as `split_linear` on a plain copy of the weights instead.
    """

    dtype: torch.dtype
    compute_dtype: torch.dtype
    kernel: str  # the oneDNN implementation that ran the probe, e.g. "brg_matmul:avx2"
    reason: str  # why this path, for the log line
    small_rows: int = 0
    split_rows: int = 0
    # products of up to this many rows run specpipe.engine.cpu_kernel on the weights in the model's own dtype
    kernel_rows: int = 0
    kernel_build: str = ""  # that kernel's build (CpuKernel.build)
    kernel_blocks: bool = False  # bf16 weights repacked in column blocks for it (CpuKernel.blocks)
    # a branched tree's verify runs the blocks' products of this many rows and more on AMX tiles (CpuKernel.amx,
    # cpu_kernel.TileRows); 0 = none
    kernel_amx_rows: int = 0

    def describe(self) -> str:
        name, compute = DTYPE_NAMES.get(self.dtype, str(self.dtype)), DTYPE_NAMES.get(self.compute_dtype)
        paths = []  # fewest rows first
        if self.kernel_rows:
            how = "summed in fp32" if self.dtype != torch.float32 else "streamed once for all rows"
            if self.kernel_blocks:
                tiles = (f" (on AMX tiles from {self.kernel_amx_rows} rows in branched trees)" if self.kernel_amx_rows
                         else "")
                how = f"in column blocks{tiles}, {how}"
            paths.append(f"{name} weights {how} (specpipe's CPU kernel {self.kernel_build}) for up to "
                         f"{self.kernel_rows} rows")
        if self.small_rows > self.kernel_rows:
            paths.append(f"{name} F.linear for up to {self.small_rows} rows")
        if self.split_rows > max(self.small_rows, self.kernel_rows):
            paths.append(f"{compute} GEMMs split over the threads by weight rows for up to {self.split_rows} rows")
        packed = f"prepacked {compute} oneDNN" + (f" (inputs upcast from {name})" if compute != name else "")
        paths.append(f"{packed} above" if paths else packed)
        return f"{name} linears: {', '.join(paths)}, kernel {self.kernel}; {self.reason}"


def _run_probe(dtype: torch.dtype) -> str:
    """Packs and runs a tiny linear in `dtype`, checks it against F.linear, and returns the oneDNN
    kernel that ran it. Raises RuntimeError when this CPU (or the ISA cap) has no such path."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=generator).to(dtype)  # [out, in]
    x = torch.randn(2, 64, generator=generator).to(dtype)  # [rows, in]
    with _captured_stdout() as captured, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        out = packed_linear(x, pack_weight(weight), None)
    expected = F.linear(x.float(), weight.float())
    if not torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2):
        raise RuntimeError(f"prepacked {dtype} linear disagrees with F.linear (max diff "
                           f"{(out.float() - expected).abs().max():.3g})")
    kernels = re.findall(r",(?:inner_product|matmul),([^,]+),", captured.text)
    return kernels[-1] if kernels else "unknown"


def probe_linear_path(dtype: torch.dtype, prefer_fp32_compute: bool = False, small_rows: int = 0,
                      split_rows: int | str = "auto") -> LinearPath | str:
    """The fastest prepacked path for linears in `dtype` on this CPU, or the reason there is none.

    bf16 prefers oneDNN's own bf16 kernels (half the weight bytes); where the CPU has none, the
    weights are packed in fp32 and inputs upcast, and products of up to `small_rows` rows keep
    bf16 `F.linear`. Measured on an AVX2 CPU (SmolLM2-135M, KV 256): the fp32 packing costs what
    fp32 costs (~65-80 ms for 1-4 tokens, ~130 for 16) while bf16 `F.linear` takes ~40-45 ms for 1
    token (half the bytes to stream) but ~290 ms for 16 (no bf16 arithmetic on AVX2).

    fp32 models run products of up to `split_rows` rows as `split_linear` on plain weights ("auto":
    `auto_split_rows(kernel)`). bf16 weights packed in fp32 take split GEMMs for the rows above
    `small_rows` up to `split_rows` (faster there than the fp32 packing with ISAs held to AVX2).
    """
    if not onednn_available():
        return "this torch build has no oneDNN linear"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} has no prepacked oneDNN path here"
    if dtype == torch.bfloat16 and not prefer_fp32_compute:
        try:
            kernel = _run_probe(torch.bfloat16)
            if not kernel.startswith("ref"):
                return LinearPath(dtype, dtype, kernel, "oneDNN runs bf16 natively on this CPU")
            # oneDNN's reference kernels are correct but orders of magnitude slower (e.g. a CPU
            # with AVX-512 held to AVX2 by ONEDNN_MAX_CPU_ISA)
            native_failure = f"its bf16 kernel is the reference implementation {kernel}"
        except RuntimeError as error:
            native_failure = _first_line(error)
    try:
        kernel = _run_probe(torch.float32)
    except RuntimeError as error:
        return f"oneDNN cannot run a prepacked fp32 linear here ({_first_line(error)})"
    if split_rows == "auto":
        split_rows = auto_split_rows(kernel)
        split_why = (f"split GEMMs outran oneDNN's {kernel} for up to {split_rows} rows on such CPUs" if split_rows
                     else f"oneDNN {kernel} for every fp32 product")
    else:
        split_why = f"engine.fp32_split_rows={split_rows}"
    if dtype == torch.float32:
        return LinearPath(dtype, dtype, kernel, f"ATen capability {aten_capability()}, {split_why}",
                          split_rows=int(split_rows))
    # bf16 F.linear serves up to small_rows rows, so fp32 split GEMMs only the rows above that
    split_rows = int(split_rows) if int(split_rows) > small_rows else 0
    why = ("fp32 compute was asked for (engine.bf16_compute=fp32)" if prefer_fp32_compute
           else f"this CPU has no oneDNN bf16 kernel ({native_failure}); weights prepacked in fp32")
    return LinearPath(dtype, torch.float32, kernel, f"{why}; {split_why}", small_rows, split_rows)


class _captured_stdout:
    """Captures what C code writes to file descriptor 1 (oneDNN's verbose lines) while open."""

    def __enter__(self) -> "_captured_stdout":
        sys.stdout.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(1)
        os.dup2(self._file.fileno(), 1)
        self.text = ""
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 1)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()


def cpu_description() -> dict:
    """CPU facts every benchmark report's machine line and the cost-curve cache key carry."""
    model, flags = cpu_model_and_flags()
    isa_flags = [flag for flag in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx_ne_convert", "amx_bf16")
                 if flag in flags]
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        path = probe_linear_path(dtype)
        if not isinstance(path, LinearPath):
            paths[DTYPE_NAMES[dtype]] = "none"
            continue
        # engine=fast's defaults on this CPU (whether specpipe's kernel builds is the engine's log line)
        isa = kernel_isa()
        blocks = isa == "avx512_bf16" and dtype == torch.bfloat16  # engine.kernel_blocks' default
        kernel_rows = auto_kernel_rows(replace(path, kernel_blocks=blocks), isa)
        paths[DTYPE_NAMES[dtype]] = (f"{DTYPE_NAMES[path.compute_dtype]}:{path.kernel}"
                                     + (f"+kernel<={kernel_rows}" if kernel_rows else "")
                                     + ("(column blocks)" if kernel_rows and blocks else "")
                                     + (f"+split<={path.split_rows}" if path.split_rows > kernel_rows else ""))
    return {"cpu_model": model, "aten_capability": aten_capability(), "isa_flags": isa_flags,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            # MKL runs split GEMMs' bmm and dispatches its own ISA: ONEDNN_MAX_CPU_ISA and
            # ATEN_CPU_CAPABILITY do not hold it back, MKL_ENABLE_INSTRUCTIONS does
            "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""), "onednn_linear": paths}
