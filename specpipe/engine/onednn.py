"""A faster CPU forward for transformers' models: every linear layer runs through oneDNN with
its weight prepacked once, and projections that read the same input run as one product.
Why: a decoding step on CPU is dominated by small-M matrix products over weights streamed from
memory. `F.linear` goes through a plain sgemm whose cost jumps from 1 to 2 rows (so verifying
two tokens costs ~2x one) and leaves most of the memory bandwidth unused; oneDNN with a
prepacked (blocked) weight reads it at close to bandwidth for any small M on an AVX-512 CPU. On
AVX2 CPUs oneDNN's kernels stream only ~13 GB/s for a few rows, and one-row fp32 products run
instead as one batched GEMM over row blocks of a plain copy of the weight, a block per thread
(`split_linear`). Each call also has a fixed cost, so q/k/v (and gate/up) are packed together and
computed in one call.
The model definition stays transformers' own: only `nn.Linear` children are swapped for modules
with the same call signature. A fused group hands each member its slice of the shared product;
a member called with any other input computes its own slice, so a model that uses the
projections differently is still correct, only not faster.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from specpipe.engine.base import (ENGINE_ATTRIBUTE, REWRITE_ATTRIBUTE, ROW_INVARIANCE_ATTRIBUTE, TILES_ATTRIBUTE,
                                  ThreadFlag, claim_model, spread_description)
from specpipe.engine.cpu import DTYPE_NAMES, LinearPath, auto_kernel_rows, probe_linear_path
from specpipe.errors import ConfigError
# The linear layers this engine swaps in (re-exported here: `from specpipe.engine.onednn import PackedWeight` works).
from specpipe.engine.packed_weight import OneDNNLinear, PackedWeight
from specpipe.engine.quantize import checked_quantization

if TYPE_CHECKING:
    from specpipe.engine.cpu_kernel import CpuKernel
    from specpipe.engine.cpu_kernel_build import BlockProduct
    from specpipe.engine.gguf_weights import GgufWeight

log = logging.getLogger(__name__)

# Children of one module that always read the same input in transformers' model families.
DEFAULT_FUSE_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
BF16_COMPUTE_CHOICES = ("auto", "fp32")
TARGET_WEIGHTS = ("auto", "native", "dense", "int8", "int4")
AUTO_NATIVE_ROWS = 64


@dataclass
class OneDNNEngine:
    """Swaps a CPU model's linear layers for prepacked oneDNN ones (in place) before decoding, and
    with `lean_blocks` the Llama attention/MLP blocks for lean ones over the fused products
    (specpipe.engine.blocks).

    Which prepacked path the model's dtype gets is probed on this CPU once per apply
    (`specpipe.engine.cpu.probe_linear_path`) and logged in one line. Where there is none (no
    oneDNN, not on the CPU, fp16) the model is left exactly as it is, with a warning, so a config
    that asks for this engine never fails a run. Every replacement module is built before the
    first one is swapped in, so a failure part-way also leaves the model untouched.
    """

    fuse: bool = True
    lean_blocks: bool = True  # swap Llama attention/MLP blocks for lean ones over the fused products
    lean_forward: bool = True  # run LlamaModel's layers in one lean loop (specpipe.engine.lean_model)
    # bf16 models: "auto" = oneDNN's native bf16 kernels where the CPU has them, else weights packed
    # in fp32 (inputs upcast); "fp32" = always the latter.
    bf16_compute: str = "auto"
    # With bf16 weights packed in fp32: products of up to this many rows run bf16 F.linear on the
    # original weights (half the bytes; on an AVX2 CPU faster for 1-3 rows, 2-3x slower from 8).
    bf16_small_rows: int = 3
    # bf16 models: products of up to this many rows run specpipe's CPU kernel on the bf16 weights
    # (specpipe.engine.cpu_kernel, built once per machine; where it cannot be built the paths below serve
    # every product); "auto" = specpipe.engine.cpu.auto_kernel_rows for this CPU; 0 = never.
    bf16_kernel_rows: int | str = "auto"
    # fp32 models: products of up to this many rows run the same kernel on the fp32 weights; "auto" =
    # specpipe.engine.cpu.auto_kernel_rows for this CPU; 0 = never.
    fp32_kernel_rows: int | str = "auto"
    # Products computed in fp32 (fp32 models, and bf16 weights packed in fp32 above bf16_small_rows)
    # of up to this many rows run as one batched GEMM over a row block per thread of a plain fp32
    # copy of the weights (specpipe.engine.cpu.split_linear; the copy doubles the weights' memory);
    # "auto" = specpipe.engine.cpu.auto_split_rows for this CPU's oneDNN kernel.
    fp32_split_rows: int | str = "auto"
    # fp32 and bf16 models: the lean forward runs LlamaRMSNorm as one C++ call (specpipe.engine.cpu_kernel's
    # extension, built where the product kernel builds; bitwise transformers' norm, checked when it loads)
    kernel_norm: bool = True
    # fp32 and bf16 models: the lean forward's decoding steps, tree verifies and prompts (up to
    # lean_model.KERNEL_ATTENTION_MAX_ROWS query rows) run their attention in the same extension
    # (fp32 sums; checked against SDPA when it loads) instead of SDPA over folded heads
    kernel_attention: bool = True
    # fp32 and bf16 models: the lean MLP blocks' silu(gate) * up runs as one call of the same extension over
    # both threads where it is bitwise torch's (checked when it loads; rows of under 32768 values)
    kernel_gate: bool = True
    # bf16 models where the kernel's build multiplies bf16 pairs (AVX512_BF16): its products run over the
    # weights repacked once in column blocks (CpuKernel.block_product) in place of the weights as loaded;
    # false = over the weights as loaded (the row-by-row product, weight_product)
    kernel_blocks: bool = True
    # with the blocks, the norm and the attention kernel: a draft head's Llama decoder layers (an EAGLE head's)
    # run one kernel call each (draft_level.BlockLayers); false = op by op like the target's
    draft_layers: bool = True
    # with draft_layers: a draft's whole level in one kernel call (draft_level.KernelDraftLevel): an EAGLE head's (fc,
    # its layers, its output layer's log-probs), and a draft model's where the model is applied as a drafter; false =
    # the layers' calls (an EAGLE head's) or the lean forward (a draft model's) with torch ops and Python between them
    draft_level: bool = True
    # with the kernel's norm and attention: the target's decoder layers over GGUF blocks (native, int8, int4 weights) run
    # in one kernel call a forward where every op of theirs runs in the kernel anyway (steps and verifies), bitwise the
    # op-by-op lean loop (native_layers); false = op by op
    native_layers: bool = True
    # the cache hint of the kernel's software prefetch of the weights: "nta" keeps a forward's streamed
    # weights from evicting the KV cache, the activations and a draft head from L2/L3; "t0" caches them
    weight_prefetch: str = "nta"
    # the kernel's products (column blocks, and row by row over fp32 or int8 weights) of block_lookahead_rows rows or
    # more also ask L2 for the weight this many KiB ahead of the line they read (their arithmetic then takes as long as
    # the memory, and the near prefetch comes too late); 0 = not
    block_lookahead_kb: int = 32
    # with the lookahead on: from how many rows of a product on it asks (1-16); "auto" =
    # cpu_kernel.auto_block_lookahead_rows (1 on AMX CPUs, 5 elsewhere)
    block_lookahead_rows: int | str = "auto"
    # with column blocks on CPUs with AMX, batch_invariant off (and a drafter's products): a branched tree's verify runs
    # its products of this many rows and more on AMX tiles (one TDPBF16PS does 16 rows x 16 pairs of k of a block), so
    # up to 16 rows cost about what the weights' memory costs; fewer rows keep the vector product, faster there (below
    # 7). Only branched trees: the tiles' sums are not bitwise the vector product's, and a chain's verify keeps giving
    # bitwise a one-token step's bf16 logits (cpu_kernel.TileRows). "auto" = cpu_kernel.auto_amx_rows (7 on CPUs with
    # AMX); 0 = never
    amx_rows: int | str = "auto"
    # bf16 models on the kernel's AVX512_BF16 build: the attention rounds its softmax weights to bf16 (as transformers'
    # eager attention and ATen's flash attention do) and multiplies them by two value rows per vdpbf16ps, ~1.6x
    # faster; false = fp32 weights, one value row per multiply-add
    attention_pairs: bool = True
    # The target's linear weights: "native" = as its GGUF file holds them (gguf_weights.NATIVE_FORMATS, widened in
    # registers to the very fp32 weights transformers dequantized from the file; a model loaded from a GGUF file, like
    # the embedded one), "dense" = as loaded (fp32 or bf16), "auto" = native where the model has them, "int8"/"int4" =
    # a dense target quantized at load to Q8_0/Q4_1 blocks (gguf_weights.quantize_linears)
    target_weights: str = "auto"
    # With native weights: products of up to this many rows run over the blocks (larger ones, prompts, over the dense
    # weights); "auto" = 64
    native_rows: int | str = "auto"
    # With native weights on CPUs with AMX tiles: Q4_1 and Q8_0 blocks reordered once for the kernel's tile product
    # (gguf_tiles.h: codes widened to bf16 on the tiles, fp32 rows as three exact bf16 parts, per-block fp32 scaling),
    # whose cost grows far slower with the rows than the vector product's. Its sums are in another order than the
    # vector product's (not bitwise alike); each row's output is still the same whatever rows come with it. "auto" =
    # where the kernel's tile product serves; true = that, else ConfigError; false = the vector product
    native_tiles: bool | str = "auto"
    # The target's decoding steps and verifies compute every row as its one-row forward would, bit for bit: their
    # products run over the native blocks, the column blocks or the kernel's invariant_product at any row count (never
    # oneDNN's or AMX tiles', whose sums change with the row count), so a tree node's logits are its path's one-token
    # step's, in every dtype, whatever the tree or the batch around it. Prefills keep the fastest paths. false = the
    # fastest paths for every forward (bf16 and quantized answers may then differ from vanilla's where a near-tie
    # flips).
    batch_invariant: bool = True
    name: str = "fast"

    def __post_init__(self) -> None:
        if self.bf16_compute not in BF16_COMPUTE_CHOICES:
            raise ConfigError(f"engine.bf16_compute must be one of {BF16_COMPUTE_CHOICES}, got {self.bf16_compute!r}")
        for name in ("bf16_kernel_rows", "fp32_kernel_rows"):
            rows = getattr(self, name)
            if rows != "auto" and not (isinstance(rows, int) and rows >= 0):
                raise ConfigError(f"engine.{name} must be 'auto' or a row count >= 0, got {rows!r}")
        from specpipe.engine.cpu_kernel_build import WEIGHT_PREFETCH_HINTS

        if self.weight_prefetch not in WEIGHT_PREFETCH_HINTS:
            raise ConfigError(f"engine.weight_prefetch must be one of {sorted(WEIGHT_PREFETCH_HINTS)}, got "
                              f"{self.weight_prefetch!r}")
        from specpipe.engine.cpu_kernel_build import MAX_BLOCK_LOOKAHEAD_KB

        if not (type(self.block_lookahead_kb) is int and 0 <= self.block_lookahead_kb <= MAX_BLOCK_LOOKAHEAD_KB):
            raise ConfigError(f"engine.block_lookahead_kb must be an integer from 0 to {MAX_BLOCK_LOOKAHEAD_KB} (KiB), "
                              f"got {self.block_lookahead_kb!r}")
        from specpipe.engine.cpu_kernel_build import MAX_BLOCK_LOOKAHEAD_ROWS

        rows = self.block_lookahead_rows
        if rows != "auto" and not (type(rows) is int and 1 <= rows <= MAX_BLOCK_LOOKAHEAD_ROWS):
            raise ConfigError(f"engine.block_lookahead_rows must be 'auto' or an integer from 1 to "
                              f"{MAX_BLOCK_LOOKAHEAD_ROWS}, got {rows!r}")
        if self.amx_rows != "auto" and not (type(self.amx_rows) is int and self.amx_rows >= 0):
            raise ConfigError(f"engine.amx_rows must be 'auto' or a row count >= 0 (0 = never), got {self.amx_rows!r}")
        if self.native_tiles not in ("auto", True, False):
            raise ConfigError(f"engine.native_tiles must be auto, true or false, got {self.native_tiles!r}")
        if type(self.batch_invariant) is not bool:
            raise ConfigError(f"engine.batch_invariant must be true or false, got {self.batch_invariant!r}")
        if type(self.native_layers) is not bool:
            raise ConfigError(f"engine.native_layers must be true or false, got {self.native_layers!r}")
        if type(self.attention_pairs) is not bool:
            raise ConfigError(f"engine.attention_pairs must be true or false, got {self.attention_pairs!r}")
        if self.target_weights not in TARGET_WEIGHTS:
            raise ConfigError(f"engine.target_weights must be one of {', '.join(TARGET_WEIGHTS)}, got "
                              f"{self.target_weights!r}")
        if self.native_rows != "auto" and not (type(self.native_rows) is int and self.native_rows >= 0):
            raise ConfigError(f"engine.native_rows must be 'auto' or a row count >= 0, got {self.native_rows!r}")
        if self.fp32_split_rows != "auto" and not (isinstance(self.fp32_split_rows, int) and self.fp32_split_rows >= 0):
            raise ConfigError(f"engine.fp32_split_rows must be 'auto' or a row count >= 0, got {self.fp32_split_rows!r}")

    def apply(self, model: nn.Module, quantize: str | None = None, drafter: bool = False,
              native: dict[str, GgufWeight] | None = None) -> nn.Module:
        """Rewrites `model` in place. `quantize="int8"` (a drafter's weights, specpipe.engine.quantize): its
        products of up to the kernel's rows run over int8 weights; where the kernel does not serve, a warning
        says why and the weights stay in the model's dtype. "auto": the same without the warning. `drafter`: a
        draft model, whose drafter may run its whole level in one kernel call (draft_level.KernelDraftLevel; its
        layers' SiLU may differ from transformers' by a bf16 step, which a target's forward must not). `native`: given
        for the target only (None for a drafter or a stage's modules): its linears in the GGUF blocks of the file it
        was loaded from by module name (LoadedModel.native, maybe empty), used as `target_weights` says."""
        checked_quantization(quantize, f"engine={self.name}")
        path = self._linear_path(model)
        if isinstance(path, str):
            self._leave_as_loaded(path, quantize, native)
            return model
        if getattr(model, ENGINE_ATTRIBUTE, "hf") == self.name:
            return model  # already rewritten (a model shared by several pipelines)
        path, kernel = self._with_kernel(path)
        product = kernel.product if kernel is not None else None
        blocks = kernel.blocks if kernel is not None and path.kernel_blocks else None
        quantized = kernel.quantized_product if kernel is not None and quantize in ("int8", "auto") else None
        if quantize == "int8" and quantized is None:
            log.warning("engine=%s: %s weights need specpipe's CPU kernel, which does not serve here (%s); the "
                        "weights stay %s", self.name, quantize, self._no_kernel_reason(path), path.dtype)
        target = native is not None
        native, native_kernel, native_rows = self._native(model, native, kernel, path)
        invariance = ThreadFlag() if target and self.batch_invariant else None
        invariant_product = kernel.invariant_product if kernel is not None and invariance is not None else None
        swaps = self._packed_swaps(model, path, product, quantized, blocks, native, native_kernel, native_rows,
                                   invariance, invariant_product)
        if swaps is None:
            return model
        claim_model(model, self.name)
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        if invariance is not None:
            setattr(model, ROW_INVARIANCE_ATTRIBUTE, invariance)
            path = replace(path, kernel_amx_rows=0)  # the target's tiles are never permitted
        elif blocks is not None and kernel.tiles is not None:
            setattr(model, TILES_ATTRIBUTE, kernel.tiles)
        extension = kernel if kernel is not None else self._extension(path)
        lean, lean_models, layers, whys = self._swap_lean(model, path, extension, blocks, drafter)
        names = _native_names(swaps)
        rewrite = self._rewrite_line(path, names, native_rows, quantized is not None, layers, lean, lean_models, whys)
        if invariance is not None:
            # the lean forwards: their steps' and verifies' attention in the kernel at any row count
            attending = [module for module in model.modules() if getattr(module, "attention_kernel", None) is not None]
            for module in attending:
                setattr(module, ROW_INVARIANCE_ATTRIBUTE, invariance)
            rewrite += f"; {self._invariance_line(swaps, bool(attending))}"
        setattr(model, REWRITE_ATTRIBUTE, rewrite)
        weights = (f"native {names} weights" if names is not None else
                   f"{DTYPE_NAMES.get(path.dtype, path.dtype)} weights")
        kernel_name = f"specpipe's CPU kernel ({extension.isa})" if extension is not None else "no native kernel"
        log.info("engine=%s: %s, %s, %d attention/MLP blocks lean (the whole path at log level DEBUG)", self.name, weights,
                 kernel_name, lean)
        log.debug("engine=%s: %s", self.name, rewrite)
        return model

    def _invariance_line(self, swaps: list[tuple[nn.Module, str, OneDNNLinear]], kernel_attends: bool) -> str:
        """What engine.batch_invariant gives the target's steps and verifies, in words, logged where a part of the
        forward cannot promise it (a product without the kernel, the attention in SDPA)."""
        gaps = []
        if any(packed.native_kernel is None and packed.blocks is None and packed.invariant_kernel is None
               for packed in (replacement.packed for _, _, replacement in swaps)):
            gaps.append("some products have no row-invariant kernel path (the kernel does not serve them here)")
        if not kernel_attends:
            gaps.append("the attention runs in SDPA")
        if gaps:
            log.info("engine=%s: engine.batch_invariant is on, but %s: a verify row's logits may differ from its "
                     "one-token step's", self.name, " and ".join(gaps))
            return f"batch_invariant asked, not held ({', '.join(gaps)})"
        return ("steps and verifies row-invariant (batch_invariant: blocks or the row-invariant kernel product at any "
                "row count, never a path picked by the row count)")

    def _leave_as_loaded(self, why: str, quantize: str | None, native: dict[str, GgufWeight] | None) -> None:
        """Where oneDNN's prepacked products do not serve the model (`why`): ConfigError where the target's weights
        were asked for in another form than loaded, else a warning that transformers' own forward runs."""
        if native is not None and self.target_weights not in ("auto", "dense"):
            raise ConfigError(f"engine.target_weights={self.target_weights} needs engine=fast's own products, "
                              f"which do not serve this model ({why}); use target_weights=dense")
        kept = f" ({quantize} weights need specpipe's CPU kernel: they stay as loaded)" if quantize == "int8" else ""
        log.warning("engine=%s: %s; running transformers' own forward%s", self.name, why, kept)

    def _packed_swaps(self, model: nn.Module, path: LinearPath, product: Callable | None, quantized: Callable | None,
                      blocks: BlockProduct | None, native: dict[str, GgufWeight], native_kernel: Callable | None,
                      native_rows: int, invariance: ThreadFlag | None = None,
                      invariant_product: Callable | None = None) -> list[tuple[nn.Module, str, OneDNNLinear]] | None:
        """(module, child name, OneDNNLinear) for every linear of `model` (`_replacements`), all built before the
        first is swapped in; None, with a warning, where a real weight cannot be packed."""
        try:
            return [(module, name, replacement) for prefix, module in model.named_modules()
                    for name, replacement in self._replacements(module, path, product, quantized, blocks, prefix,
                                                                native, native_kernel, native_rows, invariance,
                                                                invariant_product)]
        except RuntimeError as error:  # the probe passed but a real weight cannot be packed
            log.warning("engine=%s: packing the weights failed (%s); running transformers' own forward",
                        self.name, str(error).splitlines()[0])
            return None

    def _swap_lean(self, model: nn.Module, path: LinearPath, extension: CpuKernel | None, blocks: BlockProduct | None,
                   drafter: bool) -> tuple[int, int, str, list[str]]:
        """Swaps in the lean attention/MLP blocks and model forwards, with the extension's parts where they serve;
        returns how many blocks and model forwards went lean, what of a draft's layers the kernel runs in one call
        (for the rewrite line) and why parts that were asked for run in torch."""
        lean = 0
        gate, gate_why = self._kernel_part(self.kernel_gate, path, extension, "gate", "SiLU gate in torch",
                                           "SiLU gate in the kernel")
        if self.fuse and self.lean_blocks:
            from specpipe.engine.blocks import swap_lean_blocks  # it builds on the PackedWeights swapped in above

            lean = swap_lean_blocks(model, gate_kernel=gate)
        lean_models, layer, level = 0, None, None
        norm_why = attention_why = ""  # read only where a model forward went lean
        if self.lean_forward:
            from specpipe.engine.lean_model import swap_lean_model

            norm, norm_why = self._kernel_part(self.kernel_norm, path, extension, "norm", "RMSNorm in torch",
                                               f"RMSNorm in specpipe's kernel {getattr(extension, 'build', '')}")
            on_tiles = (" (bf16 heads of 64 dims on AMX tiles)" if path.dtype == torch.bfloat16
                        and getattr(extension, "attention_tiles", False) else "")
            attention, attention_why = self._kernel_part(self.kernel_attention, path, extension, "attention",
                                                         "attention in SDPA",
                                                         f"decoding attention in the kernel{on_tiles}")
            layer = (blocks.decoder_layer if self.draft_layers and blocks is not None and norm is not None
                     and attention is not None else None)
            level = blocks.draft_level if layer is not None and self.draft_level else None
            lean_models = swap_lean_model(model, norm_kernel=norm, attention_kernel=attention,
                                          ragged_attention_kernel=getattr(extension, "ragged_attention", None) if attention is not None
                                          else None,
                                          attention_isa=extension.isa if extension is not None else "avx2",
                                          layer_kernel=layer, level_kernel=level, draft_model=drafter,
                                          native_layer_kernel=getattr(extension, "native_layers", None)
                                          if self.native_layers and not drafter else None,
                                          bf16_on_tiles=path.dtype == torch.bfloat16 and "amx" in path.kernel)
        layers = ("; a draft head's decoder layers one kernel call each" if lean_models and layer is not None and any(
            getattr(module, "layer_kernel", None) is layer for module in model.modules()) else "")
        if layers and level is not None:
            layers += ", its whole draft level one call where the head's other products serve"
        elif drafter and lean_models and level is not None:
            layers = "; a draft model's whole level one kernel call where its products serve"
        if lean_models and any(getattr(module, "native_layer_kernel", None) is not None for module in model.modules()):
            layers += "; the decoder layers over native blocks one kernel call a forward in steps and verifies"
        whys = [why for why in (norm_why, attention_why) if why] if lean_models else []
        whys += [gate_why] if lean and gate_why else []
        return lean, lean_models, layers, whys

    def _rewrite_line(self, path: LinearPath, native_names: str | None, native_rows: int, int8: bool, layers: str,
                      lean: int, lean_models: int, whys: list[str]) -> str:
        """The whole path in one line (the model's REWRITE_ATTRIBUTE, logged at DEBUG, part of a cost curve's key):
        native blocks (`native_names`' formats) for up to `native_rows` rows, then `path`, int8 weights, the draft
        layers' kernel calls, how many blocks and model forwards went lean, and `whys`."""
        int8_rows = f"; int8 weights for products of up to {path.kernel_rows} rows" if int8 else ""
        if native_names is not None:
            source = ("the model file's GGUF blocks" if self.target_weights in ("auto", "native") else
                      f"{self.target_weights}: quantized at load to GGUF blocks")
            natives = (f"native {native_names} weights ({source}, widened in registers) for up to {native_rows} rows, "
                       f"then ")
        else:
            natives = ""
        rewrite = (f"{natives}{path.describe()}{int8_rows}{layers}; {lean} attention/MLP blocks lean, {lean_models} "
                   f"model forward{'' if lean_models == 1 else 's'} lean")
        if whys:
            rewrite += f" ({'; '.join(whys)})"
        return rewrite

    def _linear_path(self, model: nn.Module) -> LinearPath | str:
        spread = spread_description(model)
        if spread is not None:
            return f"{spread}; oneDNN prepacking is for a whole model on the CPU"
        parameter = next(model.parameters())
        if parameter.device.type != "cpu":
            return f"the model is on {parameter.device.type}, oneDNN prepacking is for the CPU"
        return probe_linear_path(parameter.dtype, prefer_fp32_compute=self.bf16_compute == "fp32",
                                 small_rows=self.bf16_small_rows, split_rows=self.fp32_split_rows)

    def _with_kernel(self, path: LinearPath) -> tuple[LinearPath, CpuKernel | None]:
        """The path with specpipe's product kernel where it applies and builds, and the kernel."""
        name = "bf16_kernel_rows" if path.dtype == torch.bfloat16 else "fp32_kernel_rows"
        rows = getattr(self, name)
        auto = rows == "auto"
        if auto:  # whether the kernel serves at all, if it loads with the column blocks asked for (checked below)
            rows = self._auto_rows_as_asked(path)
        if rows <= 0:
            return path, None
        from specpipe.engine.cpu_kernel import CpuKernel

        blocks = self._blocks_asked(path)
        amx_rows = self._amx_rows()
        kernel = CpuKernel(weight_prefetch=self.weight_prefetch, block_lookahead_kb=self.block_lookahead_kb,
                           attention_pairs=self.attention_pairs, block_lookahead_rows=self._lookahead_rows(),
                           amx_rows=amx_rows if blocks else 0)
        if kernel.product is None:
            return replace(path, reason=f"{path.reason}; {kernel.reason}"), None
        if blocks and amx_rows > 0 and not kernel.amx:
            (log.info if self.amx_rows == "auto" else log.warning)(
                "engine=%s: engine.amx_rows=%s, but the column blocks run without AMX tiles: %s", self.name,
                self.amx_rows, kernel.amx_reason)
        path = replace(path, kernel_blocks=blocks and kernel.blocks is not None,
                       kernel_amx_rows=amx_rows if kernel.amx else 0)
        if auto:
            rows = auto_kernel_rows(path, kernel.isa)
            if rows <= 0:  # on AMX CPUs the kernel outruns oneDNN only in column blocks, and they did not load
                return replace(path, reason=f"{path.reason}; specpipe's kernel outruns oneDNN's {path.kernel} only "
                                            f"in column blocks, which its {kernel.isa} build lacks"), None
            why = f"specpipe's kernel outran oneDNN's {path.kernel} for up to {rows} rows on such CPUs"
        else:
            why = f"engine.{name}={rows}"
        return replace(path, kernel_rows=rows, kernel_build=kernel.build, reason=f"{path.reason}; {why}"), kernel

    def _amx_rows(self) -> int:
        from specpipe.engine.cpu_kernel import auto_amx_rows

        return auto_amx_rows() if self.amx_rows == "auto" else self.amx_rows

    def _lookahead_rows(self) -> int:
        from specpipe.engine.cpu_kernel import auto_block_lookahead_rows

        return auto_block_lookahead_rows() if self.block_lookahead_rows == "auto" else self.block_lookahead_rows

    def _blocks_asked(self, path: LinearPath) -> bool:
        return self.kernel_blocks and path.dtype == torch.bfloat16

    def _auto_rows_as_asked(self, path: LinearPath) -> int:
        """`auto_kernel_rows` for `path` on this CPU's kernel build, were it to load with the blocks asked for."""
        from specpipe.engine.cpu_kernel_build import kernel_isa

        return auto_kernel_rows(replace(path, kernel_blocks=self._blocks_asked(path)), kernel_isa())

    def _no_kernel_reason(self, path: LinearPath) -> str:
        """Why `_with_kernel` gave no kernel for `path`, in words."""
        name = "bf16_kernel_rows" if path.dtype == torch.bfloat16 else "fp32_kernel_rows"
        rows = getattr(self, name)
        if rows == 0:
            return f"engine.{name}=0"
        if rows == "auto":
            if self._auto_rows_as_asked(path) == 0:
                return f"engine.{name}=auto: oneDNN's {path.kernel} outruns it on such CPUs"
        return path.reason  # a kernel that could not be built or run says why there

    def _extension(self, path: LinearPath) -> CpuKernel | None:
        """The extension for the lean forward's norm and attention where the product path did not load it."""
        if not (self.kernel_norm or self.kernel_attention or self.kernel_gate) or path.dtype not in (torch.float32,
                                                                                                     torch.bfloat16):
            return None
        from specpipe.engine.cpu_kernel import CpuKernel

        return CpuKernel(weight_prefetch=self.weight_prefetch, block_lookahead_kb=self.block_lookahead_kb,
                           attention_pairs=self.attention_pairs, block_lookahead_rows=self._lookahead_rows())

    @staticmethod
    def _kernel_part(enabled: bool, path: LinearPath, kernel: CpuKernel | None, part: str, instead: str,
                     served: str) -> tuple[Callable | None, str]:
        """The extension's `part` (CpuKernel.norm, .attention or .gate) where the config enables it and it serves
        this dtype, and what the log line says about it: `served`, or why `instead` runs."""
        if not enabled or kernel is None or path.dtype not in (torch.float32, torch.bfloat16):
            return None, ""
        if kernel.product is None:
            return None, f"{instead}: {kernel.reason}"
        function = getattr(kernel, part)
        if function is None:
            return None, f"{instead}: {getattr(kernel, part + '_reason')}"
        return function, served

    def _native(self, model: nn.Module, native: dict[str, GgufWeight] | None, kernel: CpuKernel | None,
                path: LinearPath) -> tuple[dict, Callable | None, int]:
        """The weights in GGUF blocks to use (the model file's, or the linears quantized now for int8/int4), the
        kernel's product over them and up to how many rows, as `target_weights` asks; where native, int8 or int4 was
        asked and cannot be served, ConfigError says why."""
        from specpipe.engine.gguf_weights import QUANTIZE_AT_LOAD, on_tiles, quantize_linears

        asked = self.target_weights
        if native is None or asked == "dense" or (asked == "auto" and not native):
            return {}, None, 0  # not the target (a drafter's weights follow its own `quantize`), or dense asked
        if asked == "native" and not native:
            raise ConfigError("engine.target_weights=native: this model has no weights in GGUF blocks (a model loaded "
                              "from a GGUF file has them: model=smollm2_135m or model=gguf model.path=FILE); use "
                              "target_weights=dense, int8, int4 or auto")
        kernel = kernel if kernel is not None else self._extension(path)  # the kernel's products may be off for `path`
        product = getattr(kernel, "gguf_product", None) if kernel is not None else None
        if product is None:
            if asked != "auto":
                raise ConfigError(f"engine.target_weights={asked} needs specpipe's CPU kernel, which does not serve "
                                  f"here ({self._no_kernel_reason(path)})")
            log.info("engine=%s: native weights need specpipe's CPU kernel (%s): the dense weights serve", self.name,
                     self._no_kernel_reason(path))
            return {}, None, 0
        if asked in QUANTIZE_AT_LOAD:
            native = quantize_linears(model, asked)
        else:
            native = self._matching_blocks(model, native, kernel.gguf_widen)
        if self.native_tiles is not False:
            if kernel.gguf_tile_pack is not None:
                native = on_tiles(native, kernel.gguf_tile_pack)
            elif self.native_tiles is True:
                raise ConfigError(f"engine.native_tiles=true: the kernel's AMX tile product does not serve here "
                                  f"({kernel.gguf_tiles_reason}); use native_tiles=auto or false")
        return native, product, AUTO_NATIVE_ROWS if self.native_rows == "auto" else self.native_rows

    def _matching_blocks(self, model: nn.Module, native: dict[str, GgufWeight], widen: Callable) -> dict:
        """The blocks whose first rows widen to the model's own weights (rounded to its dtype): a file whose tensor
        names or row order this code maps otherwise than transformers' loader did keeps its dense weights, with a
        warning, instead of answering with other weights."""
        modules = dict(model.named_modules())
        matching, mismatched = {}, []
        for name, weight in native.items():
            module = modules.get(name)
            dense = getattr(module, "weight", None)
            rows = min(64, weight.out_features)
            if (dense is not None and tuple(dense.shape) == (weight.out_features, weight.in_features)
                    and torch.equal(widen(weight.blocks[:rows], weight.type_id, weight.in_features).to(dense.dtype),
                                    dense.detach()[:rows].cpu())):
                matching[name] = weight
            else:
                mismatched.append(name)
        if mismatched:
            log.warning("engine=%s: the GGUF blocks of %d linears (%s) do not hold the weights transformers loaded "
                        "from the file; they multiply their dense weights", self.name, len(mismatched),
                        ", ".join(mismatched[:3]) + (", ..." if len(mismatched) > 3 else ""))
        return matching

    def _replacements(self, module: nn.Module, path: LinearPath, kernel: Callable | None = None,
                      quantized_kernel: Callable | None = None, block_kernel: BlockProduct | None = None,
                      prefix: str = "", native: dict[str, GgufWeight] | None = None,
                      native_kernel: Callable | None = None, native_rows: int = 0,
                      invariance: ThreadFlag | None = None,
                      invariant_product: Callable | None = None) -> list[tuple[str, nn.Module]]:
        """(child name, OneDNNLinear) for every plain nn.Linear child, fused groups sharing one packing. Linears with
        native blocks (`native`, by module name) multiply them; a group fuses only where its members' blocks are of
        one format (a K-quant file holds q and k in Q4_K, v in Q6_K)."""
        linears = {name: child for name, child in module.named_children() if type(child) is nn.Linear}
        if not linears:
            return []
        native = native or {}

        def native_format(name: str) -> str | None:
            weight = native.get(f"{prefix}.{name}" if prefix else name)
            return weight.format if weight is not None else None

        groups: list[tuple[str, ...]] = []
        if self.fuse:
            for group in DEFAULT_FUSE_GROUPS:
                members = [linears.get(name) for name in group]
                if (all(members) and len({(m.in_features, m.weight.dtype) for m in members}) == 1
                        and len({native_format(name) for name in group}) == 1):
                    groups.append(group)
        fused = {name for group in groups for name in group}
        groups += [(name,) for name in linears if name not in fused]
        replacements = []
        for group in groups:
            members = [native.get(f"{prefix}.{name}" if prefix else name) for name in group]
            members = members if all(members) else None
            packed = PackedWeight([linears[name] for name in group], path.compute_dtype, path.small_rows,
                                  path.split_rows, kernel, path.kernel_rows, quantized_kernel, block_kernel,
                                  members, native_kernel, native_rows, invariance, invariant_product)
            replacements += [(name, OneDNNLinear(packed, index)) for index, name in enumerate(group)]
        return replacements


def _native_names(swaps: list[tuple[nn.Module, str, OneDNNLinear]]) -> str | None:
    """The GGUF formats the swapped-in linears multiply in their native blocks ("Q8_0/Q6_K"), None where none does."""
    native_formats = sorted({replacement.packed.native_format for _, _, replacement in swaps
                             if replacement.packed.native_blocks is not None})
    if not native_formats:
        return None
    from specpipe.engine.gguf_weights import NATIVE_FORMATS, TILE_FORMAT_NAMES, TILE_FORMATS

    names = {type_id: name for name, type_id in NATIVE_FORMATS.items()}
    names.update({type_id: TILE_FORMAT_NAMES[name] for name, type_id in TILE_FORMATS.items()})
    return "/".join(names[type_id] for type_id in native_formats)
