"""The checks specpipe's CPU kernel passes when it loads (specpipe.engine.cpu_kernel.CpuKernel), each part
against what torch computes on this machine: the products against fp32 products on awkward sizes, the GGUF
widening bitwise gguf-py's, the AMX tiles against the vector product, the attention against SDPA, the RMSNorm and
the SiLU gate bitwise torch's. Why: the kernel is compiled here, against whatever torch and CPU it finds, and its
norm and gate repeat ATen's order of operations to round as transformers does; a part that disagrees is left
unused, with the reason, rather than trusted. `serves_gate` and NORM_MAX_WIDTH say where the gate and the norm
can be bitwise torch's at all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specpipe.engine.cpu_kernel_build import BlockProduct


# What the norm serves: a single row of ATen's grain size (32768) or more is summed by ATen in two
# passes over threads, an order the norm does not repeat; every released LLM's hidden size is below this.
NORM_MAX_WIDTH = 16384
NORM_DTYPES = (torch.float32, torch.bfloat16)


def self_check(product, quantized_product, blocks: BlockProduct | None = None) -> None:
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


def invariant_mismatch(invariant_product) -> str:
    """'' where the row-invariant product agrees with an fp32 product (bf16 and fp32 weights and rows, a vector tail,
    odd features) and gives every row of a 1-33-row product bitwise that row's one-row product; else what differs."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(37, 75, generator=generator)  # [out, in]
    bias = torch.randn(37, generator=generator)  # [out]
    x = torch.randn(33, 75, generator=generator)  # [rows, in]
    for weight_dtype in (torch.float32, torch.bfloat16):
        for x_dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2 ** -7)):
            w, rows = weight.to(weight_dtype), x.to(x_dtype)
            expected = rows.float() @ w.float().t() + bias
            alone = torch.cat([invariant_product(rows[r:r + 1], w, bias) for r in range(len(rows))])
            if not torch.allclose(alone.float(), expected, rtol=tolerance, atol=1e-3):
                return f"it disagrees with an fp32 product ({weight_dtype} weights, {x_dtype} rows)"
            for count in (2, 3, 7, 8, 11, 12, 13, 33):
                if not torch.equal(invariant_product(rows[:count], w, bias), alone[:count]):
                    return f"a row of {count} differs from its one-row product ({weight_dtype} weights, {x_dtype} rows)"
    return ""


def gguf_check(gguf_product, gguf_widen) -> None:
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


def gguf_tiles_mismatch(tile_pack, gguf_product, gguf_widen) -> str:
    """How the product over Q4_1 and Q8_0 blocks packed for AMX tiles (gguf_tile_pack) disagrees with the fp32 weights
    the blocks hold (fp32 and bf16 rows; its sums are not bitwise the vector product's) or with itself across row
    counts (a row's output must not depend on the rows beside it, 1-40 rows); '' where it agrees."""
    import numpy as np

    from specpipe.engine.gguf_weights import NATIVE_FORMATS, TILE_FORMATS, random_blocks

    generator = torch.Generator().manual_seed(5)
    for name in ("Q4_1", "Q8_0"):
        file_id, tiles_id = NATIVE_FORMATS[name], TILE_FORMATS[f"{name}_TILES"]
        for out_features, in_features in ((48, 96), (32, 576)):
            blocks = torch.from_numpy(random_blocks(name, out_features, in_features, np.random.default_rng(5)))
            tiles = tile_pack(blocks, file_id, in_features)
            weight = gguf_widen(blocks, file_id, in_features)  # [out, in] fp32
            if not torch.equal(gguf_widen(tiles, tiles_id, in_features), weight):
                return f"its {name} tiles do not hold the blocks' weights"
            bias = torch.randn(out_features, generator=generator)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(40, in_features, generator=generator).to(dtype)  # [rows, in]
                alone = torch.cat([gguf_product(x[row:row + 1], tiles, tiles_id, in_features, bias)
                                   for row in range(40)])
                expected = (x.double() @ weight.double().t() + bias.double()).to(dtype)
                wide = dtype == torch.float32
                if not torch.allclose(alone.double(), expected.double(), rtol=1e-4 if wide else 2 ** -7,
                                      atol=1e-4 if wide else 1e-2):
                    return f"it disagrees with an fp64 product of the {name} blocks' weights ({dtype} rows)"
                for rows in (2, 3, 5, 6, 16, 17, 40):
                    if not torch.equal(gguf_product(x[:rows], tiles, tiles_id, in_features, bias), alone[:rows]):
                        return f"a row of {rows} differs from its one-row product ({name}, {dtype} rows)"
    return ""


def amx_mismatch(amx_product, blocks: BlockProduct) -> str:
    """How the AMX product disagrees with the column blocks' (fp32 sums of bf16 products both, in the order of k,
    maybe not bitwise alike) or with itself across row counts (a row's output must not depend on the rows beside
    it); '' where it agrees. Widths of 16 pairs and more (the tiles' step), odd features, 1-33 rows, bf16 and int8
    blocks (widened to bf16 on their way to the tiles)."""
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((37, 96), (16, 32), (50, 576)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()  # [out, in]
        codes = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        bias = torch.randn(out_features, generator=generator)  # [out]
        x = torch.randn(33, in_features, generator=generator).bfloat16()  # [rows, in]
        steps = torch.rand(out_features, generator=generator) / 64  # [out]: the int8 codes' scale
        for kind, packed, scale in (("bf16", blocks.pack(weight), None), ("int8", blocks.pack_int8(codes), steps)):
            alone = torch.cat([amx_product(x[row:row + 1], packed, out_features, scale, bias) for row in range(33)])
            for rows in (1, 3, 16, 19, 33):
                out = amx_product(x[:rows], packed, out_features, scale, bias)  # [rows, out]
                if not torch.equal(out, alone[:rows]):
                    return (f"{rows} rows of {in_features} inputs differ from the same rows one at a time "
                            f"({kind} blocks)")
                expected = blocks.product(x[:rows], packed, out_features, scale, bias)
                if not torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3):
                    gap = (out.float() - expected.float()).abs().max()
                    return f"{rows} rows of {in_features} inputs: off by up to {gap:.3g} ({kind} blocks)"
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


def attention_mismatch(attention) -> str:
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


def ragged_mismatch(ragged, attention) -> str:
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


def gate_mismatch(gate) -> str:
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


def norm_mismatch(norm) -> str:
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
