"""Builds, caches and loads specpipe's CPU kernel (the C++ in specpipe/kernels/cpu/) for
specpipe.engine.cpu_kernel: torch's extension builder (g++ and ninja) compiles it once per machine and torch
installation into a folder of this user's alone in the specpipe cache, its SHA-256 recorded beside it and
checked before every load (`specpipe.native_cache`), so a library planted there is never run. The build's name
hashes the source files' contents, the flags and the torch installation (`build_name`), so each setting and
source version builds apart; where ATen runs AVX-512 the kernel is built with 16-lane vectors, with pair products
of bf16 values where the CPU has AVX512_BF16, else with AVX2/FMA (`kernel_isa`; ATEN_CPU_CAPABILITY=avx2 holds it
back, so one variable tests the AVX2 build on any CPU). `BlockProduct` names the column-block functions of the
AVX512_BF16 build.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from specpipe import native_cache
from specpipe.engine import cpuinfo
from specpipe.engine.cpuinfo import aten_capability, cpu_flags

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


def kernel_isa() -> str:
    """Which build of the kernel this machine gets ('avx2', 'avx512' or 'avx512_bf16'; specpipe.engine.cpuinfo's
    kernel_isa over this module's cpu_flags() and aten_capability())."""
    return cpuinfo.kernel_isa(cpu_flags(), aten_capability())


class BlockProduct(NamedTuple):
    """The kernel's product over weights in column blocks (its AVX512_BF16 build): `pack(weight [out, in] bf16)`
    or `pack_int8(codes [out, in] int8)` -> the blocks (once per weight), `product(x [..., in] bf16, blocks, out,
    scale [out] fp32 or None, bias [out] fp32 or None)` -> [..., out] bf16 (int8 codes take their scale). Each
    row's output is the same whatever rows come with it. `decoder_layer`: a draft head's whole Llama decoder
    layer over such weights in one call (the source's block_decoder_layer; specpipe.engine.draft_level.BlockLayers).
    `draft_level`: an EAGLE head's whole level (fc, its decoder layers, its output layer's log-probs) in one call (the
    source's block_draft_level, with the rows from which its products take AMX tiles: cpu_kernel.DraftLevelCall;
    specpipe.engine.draft_level.KernelDraftLevel)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    pack_int8: Callable[[torch.Tensor], torch.Tensor]
    product: Callable[..., torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor] | None = None
    draft_level: Callable[..., list[torch.Tensor]] | None = None


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


def build_kernel(build_dir: Path | None, isa: str, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
                 attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS):
    """The extension module of one build (`isa` and the settings as build_flags takes them) from its folder under
    `build_dir` (the specpipe cache's kernels/ by default): imported where the library there is the one specpipe
    built and recorded, else built there from the source first. native_cache.UnsafeFolder where others could
    write the folder."""
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
