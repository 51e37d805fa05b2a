"""A model's linear weights as its GGUF file holds them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks of 32 weights, Q4_K,
Q5_K, Q6_K super-blocks of 256), for `engine=fast` to multiply in place of the dense weights transformers dequantized
from the same file (`engine.target_weights=native`); and a dense model's weights quantized to such blocks at load
(`engine.target_weights=int8|int4`).

The blocks are read as they are and only reordered where transformers reorders the dense weight: the q and k
projections of the "llama" architecture, whose rows llama.cpp's converter permuted for its rotary layout and
transformers' loader permutes back. The engine checks the first rows of every linear against the weights transformers
loaded (OneDNNEngine._matching_blocks) and keeps the dense weights where they differ.
A block holds consecutive weights of one row, so rows move whole. Formats the CPU kernel does not read (F32, F16,
BF16, Q2_K, Q3_K, the IQ formats) are left out: those linears keep their dense weights.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor, nn

from specpipe.errors import ModelNotAvailable

# The block formats specpipe's CPU kernel multiplies: ggml's type id (what gguf_product takes); weights and bytes
# per block (gguf-py's table)
NATIVE_FORMATS = {name: int(GGMLQuantizationType[name])
                  for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
BLOCK_VALUES = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] for name in NATIVE_FORMATS}
BLOCK_BYTES = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] for name in NATIVE_FORMATS}
# Blocks reordered for the kernel's AMX tile product (gguf_tiles.h), by the format they come from: the format id
# gguf_product takes for them (0x100 + the blocks' ggml type id; not a ggml type id)
TILE_FORMATS = {f"{name}_TILES": 0x100 + NATIVE_FORMATS[name] for name in ("Q4_1", "Q8_0")}
TILE_FORMAT_NAMES = {f"{name}_TILES": f"{name} (on AMX tiles)" for name in ("Q4_1", "Q8_0")}
# engine.target_weights: a dense model's weights quantized at load to these formats (gguf-py's quantizers, which
# reproduce ggml's): int8 = Q8_0 (an fp16 step per 32 weights), int4 = Q4_1 (an fp16 step and minimum per 32)
QUANTIZE_AT_LOAD = {"int8": "Q8_0", "int4": "Q4_1"}
# GGUF tensor names of a Llama-family model -> the module names transformers gives the same weights
LLAMA_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
LLAMA_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class GgufWeight:
    """One linear's weight in GGUF blocks: [out_features, in_features / block values * block bytes] uint8."""

    blocks: Tensor  # [out, row bytes] uint8, contiguous
    format: str  # a key of NATIVE_FORMATS or TILE_FORMATS
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def type_id(self) -> int:
        return NATIVE_FORMATS[self.format] if self.format in NATIVE_FORMATS else TILE_FORMATS[self.format]

    def nbytes(self) -> int:
        return self.blocks.numel()


def read_native_weights(path: str | Path, num_heads: int, num_kv_heads: int,
                        tied_embeddings: bool) -> dict[str, GgufWeight]:
    """Module name (as in transformers' model: "model.layers.0.self_attn.q_proj", "lm_head") -> its GgufWeight, for
    every linear of the file in a format the kernel reads. Raises ModelNotAvailable for an unreadable file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise ModelNotAvailable(f"the GGUF file {path} cannot be read: {error}") from None
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[-1]).decode() if field is not None else ""
    if architecture not in LLAMA_ARCHITECTURES:
        return {}  # other families: their tensor names and layouts are not mapped here
    # transformers' loader undoes llama.cpp's rotary permutation of q and k for the "llama" architecture only
    permuted = architecture == "llama"
    has_output = any(tensor.name == "output.weight" for tensor in reader.tensors)
    weights: dict[str, GgufWeight] = {}
    for tensor in reader.tensors:
        format_name = tensor.tensor_type.name
        if format_name not in NATIVE_FORMATS:
            continue
        name = _module_name(tensor.name, tied_embeddings or not has_output)
        if name is None:
            continue
        blocks = np.asarray(tensor.data)  # [out, row bytes] uint8
        in_features = int(tensor.shape[0])  # GGUF lists the fastest dimension first
        if permuted and name.endswith("q_proj"):
            blocks = blocks[rotary_rows(blocks.shape[0], num_heads)]
        elif permuted and name.endswith("k_proj"):
            blocks = blocks[rotary_rows(blocks.shape[0], num_kv_heads)]
        weights[name] = GgufWeight(torch.from_numpy(np.array(blocks, copy=True)), format_name, in_features)
    return weights


def on_tiles(weights: dict[str, GgufWeight],
             tile_pack: Callable[[Tensor, int, int], Tensor]) -> dict[str, GgufWeight]:
    """`weights` with every Q4_1 and Q8_0 weight whose output features are a multiple of 16 reordered for the kernel's
    AMX tile product (`tile_pack`: CpuKernel.gguf_tile_pack; same bytes, same weights), the others as they are."""
    return {name: GgufWeight(tile_pack(weight.blocks, weight.type_id, weight.in_features), f"{weight.format}_TILES",
                             weight.in_features)
            if f"{weight.format}_TILES" in TILE_FORMATS and weight.out_features % 16 == 0 else weight
            for name, weight in weights.items()}


def _module_name(tensor: str, output_from_embedding: bool) -> str | None:
    found = _BLOCK_TENSOR.match(tensor)
    if found:
        member = LLAMA_LINEARS.get(found.group(2))
        return f"model.layers.{found.group(1)}.{member}" if member else None
    if tensor == "output.weight":
        return "lm_head"
    if tensor == "token_embd.weight" and output_from_embedding:
        return "lm_head"  # the output layer multiplies the embedding's rows
    return None


def rotary_rows(rows: int, heads: int) -> np.ndarray:
    """The order transformers' GGUF loader gives q or k rows (LlamaTensorProcessor._reverse_permute_weights): within
    each head, the file's pairs of rows (2i, 2i + 1) become rows i and dim + i."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


def quantize_linears(model: nn.Module, kind: str) -> dict[str, GgufWeight]:
    """Every nn.Linear of `model` whose inputs fill whole blocks quantized to QUANTIZE_AT_LOAD[kind], by module name;
    each linear's dense weight is replaced by the weights its blocks hold (rounded to its dtype), so every path of the
    engine multiplies the same quantized model. A tied output layer quantizes the embedding with it."""
    from gguf import GGMLQuantizationType, quants

    format_name = QUANTIZE_AT_LOAD[kind]
    quant_type = GGMLQuantizationType[format_name]
    weights: dict[str, GgufWeight] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module.in_features % BLOCK_VALUES[format_name]:
            continue
        dense = module.weight.detach()
        blocks = quants.quantize(dense.float().cpu().numpy(), quant_type)  # [out, row bytes] uint8
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(quants.dequantize(blocks, quant_type)).to(dense.dtype))
        weights[name] = GgufWeight(torch.from_numpy(np.ascontiguousarray(blocks)), format_name, module.in_features)
    return weights


# Where each format's fp16 steps lie in a block (byte offsets): random_blocks sets them to moderate values.
_STEP_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(format_name: str, rows: int, in_features: int, generator: np.random.Generator,
                  step: float = 0.01) -> np.ndarray:
    """Blocks of random codes and scales with fp16 steps of about `step` (whatever a file may hold, for checks):
    [rows, in_features / block values * block bytes] uint8."""
    count = in_features // BLOCK_VALUES[format_name]
    blocks = generator.integers(0, 256, size=(rows, count, BLOCK_BYTES[format_name]), dtype=np.uint8)
    for offset in _STEP_OFFSETS[format_name]:
        steps = (generator.uniform(0.25, 1.0, size=(rows, count)) * step).astype(np.float16)
        if offset == 2 and format_name in ("Q4_1", "Q5_1"):
            steps = -steps * 8  # a block's minimum
        blocks[:, :, offset:offset + 2] = steps[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
