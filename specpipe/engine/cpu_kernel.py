"""specpipe's CPU kernel: loads the C++ extension (specpipe/kernels/cpu/, built once per machine and torch
installation) that engine=fast calls for the few-row work of a decoding step or a tree verify.

What it carries (each file's header says more):
- `product`, `quantized_product`: the matrix product over bf16, fp32 or int8 weights for a few rows, the
  weights streamed once for any number of rows (product.h). For bf16 weights on CPUs whose oneDNN has no bf16
  kernel, and for fp32 weights where oneDNN's fp32 kernel is AVX2, oneDNN and split GEMMs read the weights
  below the memory's speed for a few rows; specpipe.engine.cpu.auto_kernel_rows says which rows each CPU class
  gives the kernel (docs/notebook/ has the measurements).
- `gguf_product`, `gguf_widen`: the product over weights in GGUF blocks, widened in registers bitwise as
  gguf-py dequantizes them (gguf.h).
- `blocks` (the AVX512_BF16 build): bf16 and int8 weights repacked once in column blocks, their product, a
  draft head's decoder layer and a whole draft level in one call, and the blocks' product on AMX tiles where
  the CPU has them (blocks.h, draft_level.h; `TileRows`).
- `norm`: LlamaRMSNorm in one call, bitwise transformers' (norm.h); `attention`, `ragged_attention`: the
  attention of a step or a verify over the KV cache and the tree mask, to SDPA's float rounding (attention.h);
  `gate`: the MLP's silu(gate) * up, bitwise torch's where `serves_gate` says so (gate.h). Each is checked
  against torch when the kernel loads, and left unused (with the reason) where it disagrees.

Where ATen runs AVX-512 the kernel is built with 16-lane vectors, with pair products of bf16 values where the
CPU has AVX512_BF16, else with AVX2/FMA (`kernel_isa`; ATEN_CPU_CAPABILITY=avx2 holds it back, so one variable
tests the AVX2 build on any CPU). Sums run in another order than oneDNN's or ATen's, so products differ from
theirs by float rounding, like any other GEMM.

Built with torch's extension builder (g++ and ninja) into the specpipe cache, in a folder of this user's alone,
its SHA-256 recorded beside it and checked before every load (`specpipe.native_cache`); the build's name hashes
the source files' contents, the flags and the torch installation (`build_name`). Where it cannot be built or
run (no compiler, another ISA, a cache folder other users could write) `CpuKernel.reason` says why and
engine=fast keeps its other paths.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from specpipe import native_cache
from specpipe.engine import cpuinfo
from specpipe.engine.cpuinfo import aten_capability, cpu_flags
from specpipe.engine.cpuinfo import first_line as _first_line

# The kernel's C++ source: files of the package (pyproject.toml's package-data ships them); KERNEL_ENTRY is the
# one translation unit torch's builder compiles, which includes the others.
KERNEL_SOURCES = Path(__file__).resolve().parent.parent / "kernels" / "cpu"
KERNEL_ENTRY = "kernel.cpp"
SOURCE_SUFFIXES = (".cpp", ".h")


def kernel_sources(folder: Path | None = None) -> dict[str, bytes]:
    """The kernel's source files (name -> contents) in `folder` (KERNEL_SOURCES by default); FileNotFoundError
    where the entry file is missing (an installation without the package's data files)."""
    folder = KERNEL_SOURCES if folder is None else Path(folder)
    sources = {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.suffix in SOURCE_SUFFIXES
               and path.is_file()} if folder.is_dir() else {}
    if KERNEL_ENTRY not in sources:
        raise FileNotFoundError(f"specpipe's CPU kernel source {folder / KERNEL_ENTRY} is missing: reinstall specpipe "
                                f"(its package data ships specpipe/kernels/cpu)")
    return sources


# What the norm serves: a single row of ATen's grain size (32768) or more is summed by ATen in two
# passes over threads, an order the norm does not repeat; every released LLM's hidden size is below this.
NORM_MAX_WIDTH = 16384
NORM_DTYPES = (torch.float32, torch.bfloat16)

# -ffp-contract=off: no multiply and add fused into one rounding behind the source's back (the norm
# rounds like torch's separate ops; the product's FMAs are written out)
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# The instruction sets the product is built for: 16-lane vectors where ATen itself runs AVX-512, else
# 8-lane AVX2 (ATEN_CPU_CAPABILITY=avx2 holds both back, so one variable tests the AVX2 build on any CPU).
ISA_FLAGS = {"avx2": ("-mavx2", "-mfma", "-mf16c"), "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f"),
             "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512bf16")}
# engine.weight_prefetch: the cache hint of the product's software prefetch of the weights (SPECPIPE_WEIGHT_HINT in
# specpipe/kernels/cpu/product.h)
WEIGHT_PREFETCH_HINTS = {"nta": "_MM_HINT_NTA", "t0": "_MM_HINT_T0"}
# engine.block_lookahead_kb: at most half of a Zen 5 core's 1 MiB L2 ahead of the line it reads
MAX_BLOCK_LOOKAHEAD_KB = 512
# engine.block_lookahead_rows: the source's default, and the most rows a column-block pass takes (kBlockMaxRows)
DEFAULT_BLOCK_LOOKAHEAD_ROWS = 5
MAX_BLOCK_LOOKAHEAD_ROWS = 16
# engine.block_lookahead_rows=auto on AMX CPUs: their own prefetchers keep too few lines in flight for a pass of one
# row, so the lookahead runs from one row on (the same sums: logits bitwise equal); where the prefetchers keep enough,
# the lookahead makes 1-4 rows slower, so other CPUs keep the source's 5.
# 1: bf16 forwards of 1-4 rows in 26-34% less time than from 5 (docs/notebook/run-63.md; fp32: run-64.md).
AUTO_AMX_BLOCK_LOOKAHEAD_ROWS = 1


def auto_block_lookahead_rows() -> int:
    """engine.block_lookahead_rows=auto: from 1 row on CPUs with AMX tiles, from 5 elsewhere (see the constants)."""
    return AUTO_AMX_BLOCK_LOOKAHEAD_ROWS if "amx_bf16" in cpu_flags() else DEFAULT_BLOCK_LOOKAHEAD_ROWS


# engine.amx_rows=auto on CPUs with AMX tiles: a branched tree's verify runs its column blocks' products of this many
# rows and more on the tiles (TileRows); with fewer rows the vector product is the faster.
# 7: a branched verify's forward took 0.97x the time from 7 rows, 1.02-1.07x from 6 (docs/notebook/run-65.md).
AUTO_AMX_ROWS = 7


def auto_amx_rows() -> int:
    """engine.amx_rows=auto: AUTO_AMX_ROWS where the CPU has AMX tiles, else 0 (never, and nothing to warn about)."""
    return AUTO_AMX_ROWS if "amx_bf16" in cpu_flags() else 0


def kernel_isa() -> str:
    """Which build of the kernel this machine gets ('avx2', 'avx512' or 'avx512_bf16'; specpipe.engine.cpuinfo's
    kernel_isa over this module's cpu_flags() and aten_capability())."""
    return cpuinfo.kernel_isa(cpu_flags(), aten_capability())


class TileRows:
    """From how many rows the column blocks' products run on AMX tiles: `min_rows` inside `permitted()`, never outside.

    The tiles' fp32 sums are not bitwise the vector product's, so a forward whose rows must
    give bitwise a one-token step's bf16 logits keeps the vector product: a chain's verify, which is how a bf16
    pipeline that drafts chains emits exactly `vanilla`'s tokens. A branched tree's verify cannot promise that anyway
    (its attention's sums depend on where a row's ancestors sit in the block), so the target permits the tiles
    there (specpipe.target.TargetModel.forward_tree). The permission is per thread: requests decoded in parallel
    threads share one model."""

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self._local = threading.local()

    def rows(self) -> int:
        """`min_rows` where this thread's forward may take the tiles, else 0 (never)."""
        return self.min_rows if getattr(self._local, "permitted", False) else 0

    @contextlib.contextmanager
    def permitted(self) -> Iterator[None]:
        before = getattr(self._local, "permitted", False)
        self._local.permitted = True
        try:
            yield
        finally:
            self._local.permitted = before


class BlockProduct(NamedTuple):
    """The kernel's product over weights in column blocks (its AVX512_BF16 build): `pack(weight [out, in] bf16)`
    or `pack_int8(codes [out, in] int8)` -> the blocks (once per weight), `product(x [..., in] bf16, blocks, out,
    scale [out] fp32 or None, bias [out] fp32 or None)` -> [..., out] bf16 (int8 codes take their scale). Each
    row's output is the same whatever rows come with it. `decoder_layer`: a draft head's whole Llama decoder
    layer over such weights in one call (the source's block_decoder_layer; specpipe.engine.lean_model.BlockLayers).
    `draft_level`: an EAGLE head's whole level (fc, its decoder layers, its output layer's log-probs) in one call (the
    source's block_draft_level; specpipe.engine.lean_model.KernelDraftLevel)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    pack_int8: Callable[[torch.Tensor], torch.Tensor]
    product: Callable[..., torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor] | None = None
    draft_level: Callable[..., list[torch.Tensor]] | None = None


class CpuKernel:
    """Loads (building it once per machine) the weight product, and the RMSNorm and the decoding
    attention beside it; `product` is None and `reason` says why where they are not available, `norm`
    is None (and `norm_reason` says why) where the norm is not bitwise torch's on this machine,
    `attention` is None (and `attention_reason` says why) where it disagrees with SDPA, `gate` is None (and
    `gate_reason` says why) where it is not bitwise F.silu(gate) * up here. One instance per engine apply:
    nothing is kept at module level."""

    def __init__(self, build_dir: Path | None = None, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
                 attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS,
                 amx_rows: int = 0) -> None:
        self.product = None
        # gguf_product(x [..., in], blocks [out, in / block values * block bytes] uint8, format, in, bias [out] fp32 or
        # None) -> [..., out]: the product over weights in GGUF blocks (gguf_weights.NATIVE_FORMATS), widened in
        # registers as gguf-py dequantizes them; gguf_widen(blocks, format, in) -> the fp32 weights [out, in]. Set and
        # cleared with `product`
        self.gguf_product = None
        self.gguf_widen = None
        # quantized_product(x [..., in], weight [out, in] int8, scale [out] fp32, bias [out] fp32 or None) ->
        # [..., out]: the product over int8 weights (specpipe.engine.quantize); set and cleared with `product`
        self.quantized_product = None
        self.blocks: BlockProduct | None = None  # bf16 weights in column blocks: the AVX512_BF16 build only
        # with `amx_rows` > 0: whether the blocks' products of that many rows and more run on AMX tiles
        # (amx_block_product) inside `tiles.permitted()`, and if not, why
        self.amx = False
        self.amx_reason = ""
        self.tiles: TileRows | None = None
        self.norm = None  # norm(x [..., n], weight [n], eps) -> [..., n], as LlamaRMSNorm computes it
        # attention(query [1, heads, q, hd], key, value [1, kv_heads, kv, hd], mask [q, kv] bool or None,
        # scale) -> [1, q, heads, hd]: a decoding step's or a tree verify's attention (fp32 sums)
        self.attention = None
        # ragged_attention(...): `attention` for several sequences' rows of one forward, each appended to and
        # attending its own cache (the C++ ragged_tree_attention; set and cleared with `attention`)
        self.ragged_attention = None
        # gate(gate_up [..., 2n]) -> [..., n]: silu(gate) * up, bitwise torch's where `serves_gate` says so
        self.gate = None
        self.reason = ""
        self.norm_reason = ""
        self.attention_reason = ""
        self.gate_reason = ""
        self.isa = kernel_isa()
        # which build of the source: part of the engine's description, so a cost curve measured with
        # another version of the kernel (or another ISA's build) is not reused
        try:
            self.build = build_name(self.isa, weight_prefetch, block_lookahead_kb, attention_pairs,
                                    block_lookahead_rows)
        except FileNotFoundError as error:  # an installation without the kernel's source files
            self.build = ""
            self.reason = f"specpipe's CPU kernel cannot be built: {error}"
            return
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self.reason = f"specpipe's CPU kernel is for x86 CPUs, this is {platform.machine()}"
            return
        if not {"avx2", "fma"} <= cpu_flags():
            self.reason = "this CPU has no AVX2/FMA for specpipe's CPU kernel"
            return
        try:
            module = _build(build_dir, self.isa, weight_prefetch, block_lookahead_kb, attention_pairs,
                            block_lookahead_rows)
            self.product, self.quantized_product = module.weight_product, module.quantized_product
            self.gguf_product, self.gguf_widen = module.gguf_product, module.gguf_widen
            if self.isa == "avx512_bf16":
                self.blocks = BlockProduct(module.pair_blocks, module.int8_pair_blocks, module.block_product,
                                           module.block_decoder_layer, module.block_draft_level)
            _self_check(self.product, self.quantized_product, self.blocks)
            _gguf_check(self.gguf_product, self.gguf_widen)
            if amx_rows > 0:
                self._take_amx(module, amx_rows)
        except native_cache.UnsafeFolder as error:  # said whole: the folder and the fix
            self.product = self.quantized_product = self.blocks = None
            self.reason = f"specpipe's CPU kernel is not built or loaded: {error}"
            return
        except Exception as error:  # a missing compiler or ninja, a failed build: engine=fast goes on without it
            self.product = self.quantized_product = self.blocks = self.gguf_product = self.gguf_widen = None
            self.reason = f"specpipe's CPU kernel could not be built or run ({_first_line(error)[:300]})"
            return
        # The norm repeats torch's order of sums (ATen's AVX2 cascade sum): where this torch sums in
        # another order, it would round differently from transformers' norm, so it is checked here
        mismatch = _norm_mismatch(module.rms_norm)
        if mismatch:
            self.norm_reason = f"its RMSNorm is not bitwise torch's here ({mismatch})"
        else:
            self.norm = module.rms_norm
        mismatch = _attention_mismatch(module.tree_attention) or _ragged_mismatch(module.ragged_tree_attention,
                                                                                  module.tree_attention)
        if mismatch:
            self.attention_reason = f"its attention disagrees with SDPA here ({mismatch})"
        else:
            self.attention = module.tree_attention
            self.ragged_attention = module.ragged_tree_attention
        try:
            mismatch = _gate_mismatch(module.silu_gate)
        except RuntimeError as error:  # e.g. a torch without Sleef's exp among its symbols
            mismatch = _first_line(error)[:200]
        if mismatch:
            self.gate_reason = f"its SiLU gate is not bitwise torch's here ({mismatch})"
        else:
            self.gate = module.silu_gate


    def _take_amx(self, module, min_rows: int) -> None:
        """The blocks' products of `min_rows` rows and more on AMX tiles, inside `self.tiles.permitted()`, where this
        CPU has them, Linux grants them and they pass the check."""
        if self.blocks is None:
            self.amx_reason = f"AMX tiles multiply the column blocks, which the kernel's {self.isa} build lacks"
        elif "amx_bf16" not in cpu_flags():
            self.amx_reason = "this CPU has no AMX tiles"
        elif not module.amx_request():
            self.amx_reason = "Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        else:
            def tiles_from(rows: int):  # BlockProduct.product's signature, the tiles from `rows` rows
                return lambda x, blocks, out_features, scale, bias: module.amx_block_product(
                    x, blocks, out_features, scale, bias, rows)

            mismatch = _amx_mismatch(tiles_from(1), self.blocks)
            if mismatch:
                self.amx_reason = f"its AMX product disagrees with the column blocks' here ({mismatch})"
            else:
                tiles, vector_product = TileRows(min_rows), self.blocks.product

                def tiles_where_permitted(x, blocks, out_features, scale, bias):
                    rows = tiles.rows()
                    if rows == 0:
                        return vector_product(x, blocks, out_features, scale, bias)
                    return module.amx_block_product(x, blocks, out_features, scale, bias, rows)

                self.blocks = self.blocks._replace(product=tiles_where_permitted)
                self.tiles = tiles
                self.amx = True


def build_flags(isa: str, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
                attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS) -> list[str]:
    """The compiler flags of one build: the ISA's, the cache hint of the product's weight prefetch, how far
    ahead the column-block product asks L2 for the weight (KiB, 0 = not) and from how many rows on, and
    whether the AVX512_BF16 build's bf16 attention multiplies bf16 weights by pairs of value rows
    (attend_heads_paired)."""
    if weight_prefetch not in WEIGHT_PREFETCH_HINTS:
        raise ValueError(f"weight_prefetch must be one of {sorted(WEIGHT_PREFETCH_HINTS)}, got {weight_prefetch!r}")
    if not (type(block_lookahead_kb) is int and 0 <= block_lookahead_kb <= MAX_BLOCK_LOOKAHEAD_KB):
        raise ValueError(f"block_lookahead_kb must be an integer from 0 to {MAX_BLOCK_LOOKAHEAD_KB}, "
                         f"got {block_lookahead_kb!r}")
    if not (type(block_lookahead_rows) is int and 1 <= block_lookahead_rows <= MAX_BLOCK_LOOKAHEAD_ROWS):
        raise ValueError(f"block_lookahead_rows must be an integer from 1 to {MAX_BLOCK_LOOKAHEAD_ROWS}, "
                         f"got {block_lookahead_rows!r}")
    rows = () if block_lookahead_rows == DEFAULT_BLOCK_LOOKAHEAD_ROWS else (
        f"-DSPECPIPE_BLOCK_LOOKAHEAD_ROWS={block_lookahead_rows}",)
    return [*_CFLAGS, *ISA_FLAGS[isa], f"-DSPECPIPE_WEIGHT_HINT={WEIGHT_PREFETCH_HINTS[weight_prefetch]}",
            f"-DSPECPIPE_BLOCK_LOOKAHEAD_BYTES={1024 * block_lookahead_kb}",
            *(() if _checked_switch("attention_pairs", attention_pairs) else ("-DSPECPIPE_ATTENTION_PAIRS=0",)), *rows]


def _checked_switch(name: str, value: bool) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def build_name(isa: str | None = None, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
               attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS,
               sources: dict[str, bytes] | None = None) -> str:
    """The extension's name: its ISA (kernel_isa() by default), then a SHA-256 in 12 hex digits of the source
    files' names and contents (`sources`, else kernel_sources()), its flags, torch's version and torch's
    installation folder. The folder: the build compiles against that torch's headers and links its libraries,
    and torch's builder rebuilt a build shared by two virtualenvs (same version, other include paths) at every
    switch between them."""
    isa = isa or kernel_isa()
    flags = " ".join(build_flags(isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows))
    installation = os.path.dirname(os.path.abspath(torch.__file__))
    digest = hashlib.sha256()
    for file_name, text in sorted((kernel_sources() if sources is None else sources).items()):
        digest.update(f"{file_name}\0{len(text)}\0".encode())
        digest.update(text)
    digest.update("\0".join((flags, torch.__version__, installation)).encode())
    return f"specpipe_kernel_{isa}_{digest.hexdigest()[:12]}"


def _build(build_dir: Path | None, isa: str, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
           attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS):
    from torch.utils import cpp_extension

    from specpipe.models import cache_root

    sources = kernel_sources()  # read once: what is hashed into the name is what is compiled
    name = build_name(isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows, sources)
    # a folder of this user's alone (UnsafeFolder otherwise): a library others could put there would run here
    folder = native_cache.private_folder((build_dir or cache_root() / "kernels") / name)
    library = folder / f"{name}{_library_suffix()}"
    with _one_build_at_a_time(folder):
        if native_cache.verified(library):  # the file specpipe built, byte for byte: imported as it is
            return _import_library(name, library)
        # Anything else there is not loaded, nor linked: ninja takes outputs newer than their inputs as
        # up to date, so every output is removed and torch's builder builds from the source, whose files are
        # written into this folder (as hashed into its name) and compiled from there.
        _remove_build_outputs(folder)
        for file_name, text in sources.items():
            (folder / file_name).write_bytes(text)
        versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        if versioner is not None:  # torch's record of a build by this process: without it, built again too
            versioner.entries.pop(name, None)
        # ninja from the environment's own bin folder (the `ninja` wheel) when the shell's PATH lacks it
        # (.venv/bin/python run without activating the environment), for the build only
        path = os.environ.get("PATH", "")
        bin_folder = str(Path(sys.executable).parent)
        if bin_folder not in path.split(os.pathsep):
            os.environ["PATH"] = bin_folder + os.pathsep + path if path else bin_folder
        try:
            module = cpp_extension.load(
                name=name, sources=[str(folder / KERNEL_ENTRY)], build_directory=str(folder),
                extra_cflags=build_flags(isa, weight_prefetch, block_lookahead_kb, attention_pairs,
                                         block_lookahead_rows), extra_ldflags=["-fopenmp"], verbose=False)
        finally:
            os.environ["PATH"] = path
        if library.is_file():
            native_cache.record_checksum(library)  # what the next run checks before it imports this file
        return module


def _library_suffix() -> str:
    """The file suffix of the extension torch's builder links ('.so' on Linux)."""
    from torch.utils import cpp_extension

    return getattr(cpp_extension, "LIB_EXT", ".so")


def _import_library(name: str, library: Path):
    """The extension module `name` from the verified file `library`, imported as torch's builder imports
    the module it built (importlib's extension loader), without asking the builder whether to rebuild."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU kernel from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_build_outputs(folder: Path) -> None:
    """Everything in a kernel build folder but the flock held around this build: the library, its record,
    the sources it was built from, objects, ninja's files, torch's lock of a killed build."""
    for entry in folder.iterdir():
        if entry.name == ".build.lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _one_build_at_a_time(folder: Path):
    """Holds an flock on `folder/.build.lock` around the check, build or load of the kernel.

    torch marks a build in progress with a plain `lock` file. A build killed midway leaves it behind, and
    every later run then waits on it forever without a word. The flock goes away with its process, so a
    `lock` found while holding it is such a leftover: it is removed."""
    with native_cache.exclusive(folder, "the CPU kernel"):
        leftover = folder / "lock"
        if leftover.exists():
            print(f"specpipe: removing {leftover}, left by a kernel build that was killed", file=sys.stderr)
            leftover.unlink(missing_ok=True)
        yield


def _self_check(product, quantized_product, blocks: BlockProduct | None = None) -> None:
    """The built kernel against an fp32 product on awkward sizes (a vector tail, odd features, 1-33 rows),
    with fp32 and bf16 inputs and a bias, over bf16, fp32 and int8 weights, and over bf16 weights in column
    blocks where given."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 75, generator=generator).bfloat16()  # [out, in]
    bias = torch.randn(37, generator=generator)  # [out]
    codes = torch.randint(-127, 128, (37, 75), generator=generator, dtype=torch.int8)  # [out, in]
    scale = torch.rand(37, generator=generator) / 64  # [out]
    for rows in (1, 3, 7, 8, 11, 16, 19, 33):
        x = torch.randn(rows, 75, generator=generator)  # [rows, in]
        for x_rows, tolerance in ((x, 1e-4), (x.bfloat16(), 2 ** -7)):
            expected = (x_rows.float() @ codes.float().t()) * scale + bias
            quantized = quantized_product(x_rows, codes, scale, bias).float()
            if not torch.allclose(quantized, expected, rtol=tolerance, atol=1e-3):
                raise RuntimeError(f"the kernel disagrees with an fp32 product of int8 weights for {rows} "
                                   f"{x_rows.dtype} rows")
            if blocks is not None and x_rows.dtype == torch.bfloat16:
                out = blocks.product(x_rows, blocks.pack_int8(codes), codes.shape[0], scale, bias).float()
                if not torch.allclose(out, expected, rtol=tolerance, atol=1e-3):
                    raise RuntimeError(f"the kernel's column blocks disagree with an fp32 product of int8 weights "
                                       f"for {rows} bf16 rows")
        expected = x @ weight.float().t()
        if not torch.allclose(product(x, weight, None), expected, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product of bf16 weights for {rows} rows")
        if not torch.allclose(product(x, weight.float(), bias), expected + bias, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product of fp32 weights for {rows} rows")
        x = x.bfloat16()
        expected = (x.float() @ weight.float().t() + bias).bfloat16()
        if not torch.allclose(product(x, weight, bias).float(), expected.float(), rtol=2 ** -7, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product for {rows} bf16 rows")
        if blocks is not None:
            out = blocks.product(x, blocks.pack(weight), weight.shape[0], None, bias)
            if not torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-4):
                raise RuntimeError(f"the kernel's column blocks disagree with an fp32 product for {rows} bf16 rows")



def _gguf_check(gguf_product, gguf_widen) -> None:
    """The GGUF product's weights bitwise gguf-py's dequantization (every format it reads), its sums near an fp32
    product of them, and each row's output the same with any rows beside it."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from specpipe.engine.gguf_weights import BLOCK_VALUES, NATIVE_FORMATS, random_blocks

    generator = torch.Generator().manual_seed(3)
    codes = np.random.default_rng(3)
    for name, type_id in NATIVE_FORMATS.items():
        in_features = 2 * BLOCK_VALUES[name] + (64 if BLOCK_VALUES[name] == 32 else 0)
        raw = random_blocks(name, 37, in_features, codes)  # [out, row bytes] uint8
        blocks = torch.from_numpy(raw)
        expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(type_id)))
        widened = gguf_widen(blocks, type_id, in_features)
        if not torch.equal(widened, expected):
            raise RuntimeError(f"the kernel widens {name} blocks otherwise than gguf-py dequantizes them")
        bias = torch.randn(37, generator=generator)
        x = torch.randn(11, in_features, generator=generator)
        out = gguf_product(x, blocks, type_id, in_features, bias)
        if not torch.allclose(out, x @ expected.t() + bias, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel's product over {name} blocks disagrees with an fp32 product")
        alone = torch.cat([gguf_product(x[row:row + 1], blocks, type_id, in_features, bias) for row in range(11)])
        if not torch.equal(out, alone):
            raise RuntimeError(f"the kernel's product over {name} blocks gives a row other sums beside others")


def _amx_mismatch(amx_product, blocks: BlockProduct) -> str:
    """How the AMX product disagrees with the column blocks' (fp32 sums of bf16 products both, in the order of k,
    maybe not bitwise alike) or with itself across row counts (a row's output must not depend on the rows beside
    it); '' where it agrees. Widths of 16 pairs and more (the tiles' step), odd features, 1-33 rows, int8 blocks."""
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((37, 96), (16, 32), (50, 576)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()  # [out, in]
        bias = torch.randn(out_features, generator=generator)  # [out]
        packed = blocks.pack(weight)
        x = torch.randn(33, in_features, generator=generator).bfloat16()  # [rows, in]
        alone = torch.cat([amx_product(x[row:row + 1], packed, out_features, None, bias) for row in range(33)])
        for rows in (1, 3, 16, 19, 33):
            out = amx_product(x[:rows], packed, out_features, None, bias)  # [rows, out]
            if not torch.equal(out, alone[:rows]):
                return f"{rows} rows of {in_features} inputs differ from the same rows one at a time"
            expected = blocks.product(x[:rows], packed, out_features, None, bias)
            if not torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3):
                gap = (out.float() - expected.float()).abs().max()
                return f"{rows} rows of {in_features} inputs: off by up to {gap:.3g}"
    codes = torch.randint(-127, 128, (37, 96), generator=generator, dtype=torch.int8)  # [out, in]
    scale = torch.rand(37, generator=generator) / 64  # [out]
    x = torch.randn(5, 96, generator=generator).bfloat16()  # [rows, in]
    packed = blocks.pack_int8(codes)
    if not torch.equal(amx_product(x, packed, 37, scale, None), blocks.product(x, packed, 37, scale, None)):
        return "int8 blocks (the column blocks' own product) differ"
    return ""


def sdpa_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """What the kernel's tree_attention computes, by SDPA in fp32 over repeated KV heads: query [1, heads, q,
    hd], key, value [1, kv_heads, kv, hd], mask [q, kv] bool or None -> [1, q, heads, hd] fp32."""
    groups = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(groups, 1).float(), value.repeat_interleave(groups, 1).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys, values, attn_mask=None if mask is None else mask[None, None], scale=scale)
    return out.transpose(1, 2)


def _attention_mismatch(attention) -> str:
    """'' when the built attention agrees with SDPA (fp32 and bf16; head sizes of the vector paths and
    an odd one; a tree mask; KV rows strided as in the cache), else which case did not."""
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for head_dim, q, kv in ((64, 1, 37), (128, 3, 20), (64, 5, 9), (24, 2, 17)):
            cache = torch.randn(2, 1, 2, 64, head_dim, generator=generator).to(dtype)  # K, V [1, kv_heads, 64, hd]
            key, value = cache[0, :, :, :kv], cache[1, :, :, :kv]
            query = torch.randn(1, 6, q, head_dim, generator=generator).to(dtype) * 2
            mask = None
            if q > 1:  # the committed keys, then an ancestor mask over the new ones
                mask = torch.ones(q, kv, dtype=torch.bool)
                mask[:, kv - q:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.5).tril()
            scale = head_dim ** -0.5
            error = (attention(query, key, value, mask, scale).float() - sdpa_reference(query, key, value, mask, scale))
            if not error.abs().max() <= tolerance:
                return f"{dtype} head_dim {head_dim}, {q} rows over {kv} keys: max error {error.abs().max():.3g}"
    return ""


def _ragged_mismatch(ragged, attention) -> str:
    """'' when the ragged attention gives every sequence bitwise what `attention` gives it alone (fp32, bf16; one
    row and tree rows; caches of other lengths) and appends its rows to its buffers, else what did not."""
    generator = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        rows, cached = [1, 4, 1, 3], [9, 30, 0, 17]
        total = sum(rows)
        query = torch.randn(1, 6, total, 64, generator=generator).to(dtype)
        key, value = (torch.randn(1, 2, total, 64, generator=generator).to(dtype) for _ in range(2))
        buffers = [[torch.randn(1, 2, 48, 64, generator=generator).to(dtype) for _ in range(2)] for _ in rows]
        masks, expected, start = [], [], 0
        for (key_buffer, value_buffer), q, length in zip(buffers, rows, cached):
            end = start + q
            mask = torch.ones(q, length + q, dtype=torch.bool)
            if q > 1:
                mask[:, length:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.5).tril()
            keys = torch.cat([key_buffer[:, :, :length], key[:, :, start:end]], dim=2)
            values = torch.cat([value_buffer[:, :, :length], value[:, :, start:end]], dim=2)
            expected.append(attention(query[:, :, start:end], keys, values, mask if q > 1 else None, 0.125))
            masks.append(mask if q > 1 else torch.empty(0, dtype=torch.bool))
            start = end
        starts = [0]
        for q in rows:
            starts.append(starts[-1] + q)
        out = ragged(query, key, value, [b[0] for b in buffers], [b[1] for b in buffers], cached, starts, masks, 0.125)
        if not torch.equal(out, torch.cat(expected, dim=1)):
            return f"{dtype}: the ragged rows differ from each sequence's attention alone"
        if not torch.equal(buffers[1][0][:, :, 30:34], key[:, :, 1:5]):
            return f"{dtype}: the ragged call did not append a sequence's keys to its buffer"
    return ""


# ATen runs an elementwise op of fewer values than its grain size on one thread, each row's values in
# vector steps of two vectors (64 bf16 on AVX-512): there F.silu rounds every value as the kernel's gate
# does. Over more values, a thread's share can start mid-row, and ATen's scalar tail (std::exp, not its
# vector exp) can round a value differently.
GATE_ALIGNMENT = 64
ATEN_GRAIN_SIZE = 32768


def serves_gate(rows: int, intermediate: int) -> bool:
    """Whether CpuKernel.gate is bitwise F.silu(gate) * up for `rows` rows of `intermediate` values."""
    return intermediate % GATE_ALIGNMENT == 0 and rows * intermediate < ATEN_GRAIN_SIZE


def _gate_mismatch(gate) -> str:
    """'' when `gate` equals F.silu(gate) * up bitwise (NaN for NaN) for every bf16 value as the gate, in fp32
    and bf16, in the layout the lean MLP hands it (gate and up the halves of one product's rows), else which
    case did not."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    for dtype in (torch.float32, torch.bfloat16):
        values = every_bf16.to(dtype)
        if dtype == torch.float32:  # and fp32 values between the bf16 ones
            values = torch.cat((values, torch.randn(1 << 14, generator=generator) * 8))
        for intermediate in (1536, GATE_ALIGNMENT):
            rows = (ATEN_GRAIN_SIZE - 1) // intermediate
            for start in range(0, values.numel(), rows * intermediate):
                gates = values[start:start + rows * intermediate]
                gates = torch.cat((gates, torch.zeros(-gates.numel() % intermediate, dtype=dtype)))  # whole rows
                ups = (torch.randn(gates.numel(), generator=generator) * 4).to(dtype)
                gate_up = torch.cat((gates.view(-1, intermediate), ups.view(-1, intermediate)), dim=1)
                gate_part, up = gate_up.split(intermediate, dim=-1)
                expected, got = F.silu(gate_part) * up, gate(gate_up)
                if not bool(((got == expected) | (got.isnan() & expected.isnan())).all()):
                    return f"{dtype}, {gate_up.shape[0]} rows of {intermediate}"
    return ""


def _norm_mismatch(norm) -> str:
    """'' when `norm` equals transformers' RMSNorm bitwise on widths with and without a vector tail, short
    rows (the scalar sum), the widest row the lean model hands it (several cascade levels) and a
    prefill's many rows."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(0)
    for dtype in NORM_DTYPES:
        for width, rows, scale in ((576, 1, 1.0), (576, 7, 40.0), (5, 3, 1.0), (75, 2, 1e-3), (4096, 2, 3.0),
                                   (NORM_MAX_WIDTH, 1, 1.0), (64, 400, 2.0)):
            x = (torch.randn(rows, width, generator=generator) * scale).to(dtype)  # [rows, width]
            reference = LlamaRMSNorm(width, eps=1e-5)
            reference.weight.data = (torch.rand(width, generator=generator) * 2).to(dtype)  # [width]
            with torch.no_grad():
                expected = reference(x)
            if not torch.equal(norm(x, reference.weight.data, 1e-5), expected):
                return f"{dtype} width {width}, {rows} rows"
    return ""
