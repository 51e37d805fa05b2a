"""engine=fast's linear layers: `PackedWeight`, the weight of one or more linear layers prepacked once for
oneDNN (with the other paths a product of few rows takes, see specpipe.engine.onednn), and `OneDNNLinear`, the
drop-in for `nn.Linear` over it.

They live apart from the engine that swaps them in (specpipe.engine.onednn.OneDNNEngine, which re-exports them) so
that the lean blocks and forward (specpipe.engine.blocks, specpipe.engine.lean_model), which build on these modules
and which the engine swaps in after them, do not import the engine back.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpipe.engine.cpu import pack_weight, packed_linear, row_blocks, split_linear
from specpipe.engine.quantize import dequantize_rows, quantize_rows

if TYPE_CHECKING:
    from specpipe.engine.base import ThreadFlag
    from specpipe.engine.cpu_kernel_build import BlockProduct
    from specpipe.engine.gguf_weights import GgufWeight


class PackedWeight(nn.Module):
    """`out_features` rows of one or more linear layers, concatenated and prepacked for oneDNN
    (and, for products of up to `split_rows` rows, kept plain for `split_linear`)."""

    def __init__(self, linears: Sequence[nn.Linear], compute_dtype: torch.dtype | None = None,
                 small_rows: int = 0, split_rows: int = 0,
                 kernel: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None, kernel_rows: int = 0,
                 quantized_kernel: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None,
                 block_kernel: BlockProduct | None = None, native: Sequence[GgufWeight] | None = None,
                 native_kernel: Callable | None = None, native_rows: int = 0,
                 invariance: ThreadFlag | None = None, invariant_kernel: Callable | None = None) -> None:
        super().__init__()
        # Inside invariance.raised() (a decoding step's or verify's forward, engine.batch_invariant) a product runs over
        # the native blocks, the column blocks or `invariant_kernel` (the row-by-row product with one order per row),
        # whose per-row sums do not depend on the row count, at any row count.
        self.invariance = invariance
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum out, in]
        # The weights as the model's GGUF file holds them (the members' blocks, one format): products of up to
        # `native_rows` rows run `native_kernel` (CpuKernel.gguf_product) over them, widened in registers to the very
        # fp32 weights `weight` holds; larger products (prefills) run the dense paths below.
        self.native_blocks: Tensor | None = None  # [sum out, in / 32 * block bytes] uint8
        self.native_format = 0  # ggml's type id
        self.native_rows = 0
        if native and native_kernel is not None and native_rows > 0:
            self.native_blocks = torch.cat([member.blocks for member in native]) if len(native) > 1 else native[0].blocks
            self.native_format, self.native_rows = native[0].type_id, native_rows
        self.native_kernel = native_kernel if self.native_blocks is not None else None
        # int8 weights (a drafter's, specpipe.engine.quantize): products of up to `kernel_rows` rows run
        # `quantized_kernel` over the int8 codes; every other path multiplies the weight they stand for, rounded
        # to the model's dtype, so all paths compute with the same weights up to that rounding.
        self.codes: Tensor | None = None  # [sum out, in] int8
        self.scale: Tensor | None = None  # [sum out] fp32
        kernel_serves = kernel is not None and weight.dtype in (torch.float32, torch.bfloat16) and kernel_rows > 0
        self.quantized_kernel = quantized_kernel if kernel_serves else None
        if self.quantized_kernel is not None:
            self.codes, self.scale = quantize_rows(weight)
            weight = dequantize_rows(self.codes, self.scale, weight.dtype)
        self.compute_dtype = compute_dtype or weight.dtype  # packed in and computed in; inputs are cast to it
        # Products of at most `kernel_rows` rows of the model's own dtype run `kernel` (the product of
        # specpipe.engine.cpu_kernel) on the weight itself: bf16 weights (bf16 rows), whether packed in
        # fp32 or in bf16 for oneDNN above those rows, or fp32 weights (fp32 rows).
        self.kernel = kernel if kernel_serves else None
        self.kernel_rows = kernel_rows if self.kernel is not None else 0
        self.kernel_input = weight.dtype  # the rows the kernel serves: of the weight's own dtype
        # bf16 weights where the kernel's build multiplies bf16 pairs: its products run over the weight repacked
        # once in column blocks (CpuKernel.block_product, no horizontal sums), in place of the weight itself
        self.out_features = int(weight.shape[0])
        # (int16 blocks of the int8 codes, which take their scale)
        self.blocks: Tensor | None = None  # [ceil(sum out / 16), ceil(in / 2), 16] int32, or int16 for codes
        self.block_product = None
        if block_kernel is not None and self.kernel is not None and weight.dtype == torch.bfloat16:
            self.blocks = block_kernel.pack(weight) if self.codes is None else block_kernel.pack_int8(self.codes)
            self.block_product = block_kernel.product
        # Products of at most `small_rows` rows (above kernel_rows) run F.linear on the weight in its own
        # dtype (see LinearPath): kept only when the packing is in another dtype.
        self.small_rows = small_rows if self.compute_dtype != weight.dtype and small_rows > self.kernel_rows else 0
        self.small_weight = (weight if self.small_rows or (self.kernel_rows and self.codes is None and self.blocks is None)
                             else None)  # [sum out, in]
        self.in_features = int(weight.shape[1])
        self.splits = [linear.out_features for linear in linears]
        self.packed = pack_weight(weight.to(self.compute_dtype))
        # Products of at most `split_rows` rows computed in fp32 run split_linear on a plain fp32
        # copy (above `small_rows` for a bf16 weight packed in fp32); bf16 split GEMMs measured no
        # faster than F.linear.
        self.split_rows = (split_rows if self.compute_dtype == torch.float32
                           and split_rows > max(self.small_rows, self.kernel_rows) else 0)
        self.plain = weight.to(self.compute_dtype).contiguous() if self.split_rows else None  # [sum out, in]
        self._blocked: tuple[int, Tensor] | None = None  # (threads, row_blocks(plain, threads)), made on first use
        biases = [linear.bias.detach() if linear.bias is not None else None for linear in linears]
        if all(bias is None for bias in biases):
            self.bias = None
        else:
            self.bias = torch.cat([bias if bias is not None else weight.new_zeros(linear.out_features)
                                   for bias, linear in zip(biases, linears)]).to(self.compute_dtype)  # [sum out]
        self.small_bias = self.bias.to(weight.dtype) if self.small_rows and self.bias is not None else None
        self.invariant_kernel = (invariant_kernel if self.kernel is not None and self.blocks is None
                                 and self.codes is None else None)
        # the kernel adds an fp32 bias to its fp32 sums (a bf16 packing's bias is bf16: widened exactly)
        self.kernel_bias = (self.bias.float() if (self.kernel is not None or self.native_kernel is not None)
                            and self.bias is not None else None)
        # The last input's shared product, per thread: requests decoded in parallel threads each
        # run their own forwards through the same modules.
        self._last = threading.local()

    def product(self, x: Tensor) -> Tensor:
        # x [..., in] -> [..., sum out], in x's dtype
        invariant = self.invariance is not None and self.invariance.is_raised()
        if (self.native_kernel is not None and (invariant or x.numel() <= self.native_rows * self.in_features)
                and x.dtype in (torch.float32, torch.bfloat16)):
            return self.native_kernel(x, self.native_blocks, self.native_format, self.in_features, self.kernel_bias)
        if invariant and self.invariant_kernel is not None and x.dtype == self.kernel_input:
            return self.invariant_kernel(x, self.small_weight, self.kernel_bias)
        if ((x.numel() <= self.kernel_rows * self.in_features or (invariant and self.blocks is not None))
                and x.dtype == self.kernel_input):
            # one call: a bf16 x is summed in fp32 inside (widened, or multiplied in bf16 pairs), the fp32 bias
            # added to the fp32 sums, and they are rounded to bf16
            if self.blocks is not None:
                return self.block_product(x, self.blocks, self.out_features, self.scale, self.kernel_bias)
            if self.codes is not None:
                return self.quantized_kernel(x, self.codes, self.scale, self.kernel_bias)
            return self.kernel(x, self.small_weight, self.kernel_bias)
        if x.dtype == self.compute_dtype:
            if x.numel() <= self.split_rows * self.in_features:
                return split_linear(x, self._row_blocks(), self.bias)
            return packed_linear(x, self.packed, self.bias)
        if x.numel() <= self.small_rows * self.in_features:
            return F.linear(x, self.small_weight, self.small_bias)
        if x.numel() <= self.split_rows * self.in_features:
            return split_linear(x.to(self.compute_dtype), self._row_blocks(), self.bias).to(x.dtype)
        return packed_linear(x.to(self.compute_dtype), self.packed, self.bias).to(x.dtype)

    def _row_blocks(self) -> Tensor:
        # [blocks, sum out / blocks, in]: one block per thread of the current thread count
        threads = torch.get_num_threads()
        if self._blocked is None or self._blocked[0] != threads:
            self._blocked = (threads, row_blocks(self.plain, threads))
        return self._blocked[1]

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a product of `rows` rows streams."""
        if self.native_blocks is not None and rows <= self.native_rows:
            return sum(t.numel() * t.element_size() for t in (self.native_blocks, self.kernel_bias) if t is not None)
        if rows <= self.kernel_rows and self.codes is not None:
            codes = self.blocks if self.blocks is not None else self.codes
            return sum(t.numel() * t.element_size() for t in (codes, self.scale, self.kernel_bias) if t is not None)
        if rows <= self.kernel_rows:
            weight, bias = self.blocks if self.blocks is not None else self.small_weight, self.kernel_bias
        elif rows <= self.small_rows:
            weight, bias = self.small_weight, self.small_bias
        else:
            weight, bias = (self.plain if rows <= self.split_rows else self.packed), self.bias
        return sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)

    def part(self, x: Tensor, index: int) -> Tensor:
        """Member `index`'s output for input x: [..., in] -> [..., out_index].

        The first member called with a new input computes the whole product; the others reuse it.
        The input is held weakly, so a later tensor reusing its memory is never mistaken for it.
        """
        last = self._last
        previous = last.input() if getattr(last, "input", None) is not None else None
        if previous is not x:
            last.parts = self.product(x).split(self.splits, dim=-1)
            last.input = weakref.ref(x)
        return last.parts[index]


class OneDNNLinear(nn.Module):
    """Drop-in for `nn.Linear` (same call, same output shape) backed by a PackedWeight."""

    def __init__(self, packed: PackedWeight, index: int = 0) -> None:
        super().__init__()
        self.packed = packed
        self.index = index
        self.in_features = packed.in_features
        self.out_features = packed.splits[index]

    def forward(self, x: Tensor) -> Tensor:
        if len(self.packed.splits) == 1:
            return self.packed.product(x)
        return self.packed.part(x, self.index)

    def extra_repr(self) -> str:
        split = f", split GEMMs up to {self.packed.split_rows} rows" if self.packed.split_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked{split}"
