"""specpipe's CPU kernel as engine=fast calls it: `CpuKernel` loads the C++ extension (specpipe/kernels/cpu/,
built once per machine and torch installation by specpipe.engine.cpu_kernel_build) and hands out its parts, each
checked against torch when it loads (specpipe.engine.cpu_kernel_checks) and left unused, with the reason, where it
disagrees. Why: a decoding step or a tree verify multiplies a few rows by weights streamed from memory, and for
bf16 weights on CPUs whose oneDNN has no bf16 kernel, and for fp32 weights where oneDNN's fp32 kernel is AVX2,
oneDNN and split GEMMs read the weights below the memory's speed for a few rows. The kernel's products stream the
weights once for any number of rows, over bf16, fp32 or int8 weights (product.h) and over weights in GGUF blocks
widened in registers bitwise as gguf-py dequantizes them (gguf.h); its AVX512_BF16 build also runs them over
weights repacked once in column blocks, a draft head's decoder layer and a whole draft level in one call, and the
blocks' products on AMX tiles where the CPU has them (blocks.h, draft_level.h; `TileRows`). Beside them: the
RMSNorm bitwise transformers' (norm.h), the attention of a step or a verify to SDPA's float rounding
(attention.h) and the MLP's SiLU gate bitwise torch's where `cpu_kernel_checks.serves_gate` says so (gate.h).
specpipe.engine.cpu.auto_kernel_rows says which rows each CPU class gives the kernel (docs/notebook/ has the
measurements). Sums run in another order than oneDNN's or ATen's, so products differ from theirs by float
rounding, like any other GEMM. Where the kernel cannot be built or run (no compiler, another ISA, a cache folder
other users could write) `CpuKernel.reason` says why and engine=fast keeps its other paths.
"""
from __future__ import annotations

import platform
from pathlib import Path
from typing import ContextManager

from specpipe import native_cache
from specpipe.engine.base import ThreadFlag
from specpipe.engine.cpu_kernel_build import (DEFAULT_BLOCK_LOOKAHEAD_ROWS, BlockProduct, build_kernel, build_name,
                                              kernel_isa)
from specpipe.engine.cpu_kernel_checks import (amx_mismatch, attention_mismatch, gate_mismatch, gguf_check,
                                               gguf_tiles_mismatch, invariant_mismatch, norm_mismatch, ragged_mismatch,
                                               self_check)
from specpipe.engine.cpuinfo import cpu_flags
from specpipe.engine.cpuinfo import first_line as _first_line

# engine.block_lookahead_rows=auto on AMX CPUs: their own prefetchers keep too few lines in flight for a pass of one
# row, so the lookahead runs from one row on (the same sums: logits bitwise equal); where the prefetchers keep enough,
# the lookahead makes 1-4 rows slower, so other CPUs keep the source's 5.
# 1: bf16 forwards of 1-4 rows in 26-34% less time than from 5 (docs/notebook/ has these and the fp32 ones).
AUTO_AMX_BLOCK_LOOKAHEAD_ROWS = 1


def auto_block_lookahead_rows() -> int:
    """engine.block_lookahead_rows=auto: from 1 row on CPUs with AMX tiles, from 5 elsewhere (see the constants)."""
    return AUTO_AMX_BLOCK_LOOKAHEAD_ROWS if "amx_bf16" in cpu_flags() else DEFAULT_BLOCK_LOOKAHEAD_ROWS


# engine.amx_rows=auto on CPUs with AMX tiles: a branched tree's verify runs its column blocks' products of this many
# rows and more on the tiles (TileRows); with fewer rows the vector product is the faster.
# 7: a branched verify's forward took 0.97x the time from 7 rows, 1.02-1.07x from 6 (docs/notebook/).
AUTO_AMX_ROWS = 7


def auto_amx_rows() -> int:
    """engine.amx_rows=auto: AUTO_AMX_ROWS where the CPU has AMX tiles, else 0 (never, and nothing to warn about)."""
    return AUTO_AMX_ROWS if "amx_bf16" in cpu_flags() else 0


# Where the kernel's column blocks run on AMX tiles (engine.amx_rows > 0), a draft's level in one kernel call
# (block_draft_level) runs its products of this many rows and more on them: an EAGLE head's int8 level costs about the
# same from 1 to 9 rows there (widening to bf16 included), while the vector product's cost grows with every row and
# is the cheaper up to 2 rows (docs/notebook/run-84.md).
DRAFT_LEVEL_TILE_ROWS = 3


class DraftLevelCall:
    """The kernel's block_draft_level with its products on AMX tiles from `tile_rows` rows (0 = never)."""

    def __init__(self, module, tile_rows: int) -> None:
        self.module = module
        self.tile_rows = tile_rows

    def __call__(self, *arguments) -> list:  # [hidden, log-probs], as block_draft_level returns them
        return self.module.block_draft_level(*arguments, self.tile_rows)


class TileRows:
    """From how many rows the column blocks' products run on AMX tiles: `min_rows` inside `permitted()`, never outside.

    The tiles' fp32 sums are not bitwise the vector product's, so a forward whose rows must
    give bitwise a one-token step's bf16 logits keeps the vector product. With engine.batch_invariant the target
    never takes them; without it, it permits them for a branched tree's verify
    (specpipe.target.TargetModel.forward_trees) and a chain's keeps the vector product. The permission is per thread:
    requests decoded in parallel threads share one model."""

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self._permission = ThreadFlag()

    def rows(self) -> int:
        """`min_rows` where this thread's forward may take the tiles, else 0 (never)."""
        return self.min_rows if self._permission.is_raised() else 0

    def permitted(self) -> ContextManager:
        return self._permission.raised()


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
        # gguf_tile_pack(blocks [out, in / 32 * block bytes] uint8, format, in) -> Q4_1 or Q8_0 blocks reordered for
        # the AMX tile product (gguf_weights.TILE_FORMATS), where this CPU has AMX tiles, Linux grants them and the
        # product passes its check; else None, and `gguf_tiles_reason` says why
        self.gguf_tile_pack = None
        self.gguf_tiles_reason = ""
        # quantized_product(x [..., in], weight [out, in] int8, scale [out] fp32, bias [out] fp32 or None) ->
        # [..., out]: the product over int8 weights (specpipe.engine.quantize); set and cleared with `product`
        self.quantized_product = None
        # invariant_product(x, weight, bias): `product` with each row summed in the order a row alone gets, whatever
        # rows come with it (engine.batch_invariant); None where its check fails (`invariant_reason` says why)
        self.invariant_product = None
        self.invariant_reason = ""
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
        # native_layer(...): a target's decoder layer over GGUF blocks in one call (the C++ native_decoder_layer, made
        # of the parts above: set where the norm and the attention passed their checks); native_layers(...): all the
        # decoder layers of a forward in one call (native_decoder_layers, the same layer one after another)
        self.native_layer = None
        self.native_layers = None
        # whether the attention's bf16 heads of 64 dims run on AMX tiles (set_attention_tiles)
        self.attention_tiles = False
        # gate(gate_up [..., 2n]) -> [..., n]: silu(gate) * up, bitwise torch's where `serves_gate` says so
        self.gate = None
        self.reason = ""
        self.norm_reason = ""
        self.attention_reason = ""
        self.gate_reason = ""
        self.isa = kernel_isa()
        settings = (weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows)
        # which build of the source: part of the engine's description, so a cost curve measured with
        # another version of the kernel (or another ISA's build) is not reused
        try:
            self.build = build_name(self.isa, *settings)
        except FileNotFoundError as error:  # an installation without the kernel's source files
            self.build = ""
            self.reason = f"specpipe's CPU kernel cannot be built: {error}"
            return
        self.reason = _unsupported_cpu()
        if self.reason:
            return
        module = self._load_products(build_dir, settings, amx_rows)
        if module is not None:
            self._take_checked_parts(module)

    def _load_products(self, build_dir: Path | None, settings: tuple[str, int, bool, int], amx_rows: int):
        """The extension built with `settings` (build_flags' weight_prefetch, block_lookahead_kb, attention_pairs,
        block_lookahead_rows), its products taken and checked, and the AMX tiles where `amx_rows` > 0 asks for them;
        None, with `reason` saying why, where it cannot be built or run."""
        try:
            module = build_kernel(build_dir, self.isa, *settings)
            self.product, self.quantized_product = module.weight_product, module.quantized_product
            self.gguf_product, self.gguf_widen = module.gguf_product, module.gguf_widen
            if self.isa == "avx512_bf16":
                self.blocks = BlockProduct(module.pair_blocks, module.int8_pair_blocks, module.block_product,
                                           module.block_decoder_layer, DraftLevelCall(module, 0))
            self_check(self.product, self.quantized_product, self.blocks)
            gguf_check(self.gguf_product, self.gguf_widen)
            self._take_gguf_tiles(module)
            self.invariant_reason = invariant_mismatch(module.invariant_weight_product)
            self.invariant_product = None if self.invariant_reason else module.invariant_weight_product
            if amx_rows > 0:
                self._take_amx(module, amx_rows)
        except native_cache.UnsafeFolder as error:  # said whole: the folder and the fix
            self.product = self.quantized_product = self.blocks = None
            self.reason = f"specpipe's CPU kernel is not built or loaded: {error}"
            return None
        except Exception as error:  # a missing compiler or ninja, a failed build: engine=fast goes on without it
            self.product = self.quantized_product = self.blocks = self.gguf_product = self.gguf_widen = None
            self.reason = f"specpipe's CPU kernel could not be built or run ({_first_line(error)[:300]})"
            return None
        return module

    def _take_checked_parts(self, module) -> None:
        """`module`'s RMSNorm, attention and SiLU gate, each where it passes its check against torch, else its
        reason (`norm_reason`, `attention_reason`, `gate_reason`)."""
        # The norm repeats torch's order of sums (ATen's AVX2 cascade sum): where this torch sums in
        # another order, it would round differently from transformers' norm, so it is checked here
        mismatch = norm_mismatch(module.rms_norm)
        if mismatch:
            self.norm_reason = f"its RMSNorm is not bitwise torch's here ({mismatch})"
        else:
            self.norm = module.rms_norm
        # bf16 heads of 64 dims attend on AMX tiles where Linux granted them (the GGUF tiles' request): a process-wide
        # setting of the loaded module, made before any forward, and checked against SDPA as the vector path is
        def attention_check() -> str:
            return attention_mismatch(module.tree_attention) or ragged_mismatch(module.ragged_tree_attention,
                                                                                module.tree_attention)

        self.attention_tiles = self.gguf_tile_pack is not None and module.set_attention_tiles(True)
        mismatch = attention_check()
        if mismatch and self.attention_tiles:
            self.attention_tiles = module.set_attention_tiles(False)
            mismatch = attention_check()
        if mismatch:
            self.attention_reason = f"its attention disagrees with SDPA here ({mismatch})"
        else:
            self.attention = module.tree_attention
            self.ragged_attention = module.ragged_tree_attention
        try:
            mismatch = gate_mismatch(module.silu_gate)
        except RuntimeError as error:  # e.g. a torch without Sleef's exp among its symbols
            mismatch = _first_line(error)[:200]
        if mismatch:
            self.gate_reason = f"its SiLU gate is not bitwise torch's here ({mismatch})"
        else:
            self.gate = module.silu_gate
        if self.norm is not None and self.attention is not None:
            self.native_layer = module.native_decoder_layer
            self.native_layers = module.native_decoder_layers

    def _take_gguf_tiles(self, module) -> None:
        """The Q4_1 and Q8_0 product on AMX tiles (gguf_tile_pack), where this build and CPU have the tiles, Linux
        grants them and the product passes its check; else `gguf_tiles_reason`."""
        if self.isa != "avx512_bf16":
            self.gguf_tiles_reason = f"the kernel's {self.isa} build has no AMX tile product"
        elif "amx_bf16" not in cpu_flags():
            self.gguf_tiles_reason = "this CPU has no AMX tiles"
        elif not module.amx_request():
            self.gguf_tiles_reason = ("Linux did not grant this process the AMX tile state "
                                      "(arch_prctl ARCH_REQ_XCOMP_PERM)")
        else:
            try:
                mismatch = gguf_tiles_mismatch(module.gguf_tile_pack, module.gguf_product, module.gguf_widen)
            except RuntimeError as error:  # a compiler without the tile intrinsics builds the product as an error
                mismatch = _first_line(error)[:200]
            if mismatch:
                self.gguf_tiles_reason = f"its product on AMX tiles fails its check here ({mismatch})"
            else:
                self.gguf_tile_pack = module.gguf_tile_pack

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

            mismatch = amx_mismatch(tiles_from(1), self.blocks)
            if mismatch:
                self.amx_reason = f"its AMX product disagrees with the column blocks' here ({mismatch})"
            else:
                tiles, vector_product = TileRows(min_rows), self.blocks.product

                def tiles_where_permitted(x, blocks, out_features, scale, bias):
                    rows = tiles.rows()
                    if rows == 0:
                        return vector_product(x, blocks, out_features, scale, bias)
                    return module.amx_block_product(x, blocks, out_features, scale, bias, rows)

                self.blocks = self.blocks._replace(product=tiles_where_permitted,
                                                   draft_level=DraftLevelCall(module, DRAFT_LEVEL_TILE_ROWS))
                self.tiles = tiles
                self.amx = True


def _unsupported_cpu() -> str:
    """Why this machine cannot run the kernel (not an x86 CPU, or one without AVX2/FMA), else ''."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"specpipe's CPU kernel is for x86 CPUs, this is {platform.machine()}"
    if not {"avx2", "fma"} <= cpu_flags():
        return "this CPU has no AVX2/FMA for specpipe's CPU kernel"
    return ""
