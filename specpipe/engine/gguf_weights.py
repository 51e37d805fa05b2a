"""A model's linear weights as its GGUF file holds them (Q4_0, Q4_1, Q8_0 blocks), for `engine=fast` to multiply
in place of the dense weights transformers dequantized from the same file (`engine.target_weights=native`).

The blocks are read as they are (a memory map of the file) and only reordered where transformers reorders the
dense weight: Llama's q and k projections, whose rows llama.cpp's converter permuted for its rotary layout and
transformers' loader permutes back. A block is 32 weights of one row, so rows move whole. Formats the CPU kernel
does not read (F32, F16, the K-quants) are left out: those linears keep their dense weights.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specpipe.errors import ModelNotAvailable

# The block formats specpipe's CPU kernel multiplies (ggml's type ids, which gguf_product takes)
NATIVE_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_VALUES = 32
# GGUF tensor names of a Llama-family model -> the module names transformers gives the same weights
LLAMA_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
LLAMA_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class GgufWeight:
    """One linear's weight in GGUF blocks: [out_features, in_features / 32 blocks] as uint8 rows."""

    blocks: Tensor  # [out, in / 32 * block bytes] uint8, contiguous
    format: str  # "Q4_0", "Q4_1" or "Q8_0"
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def type_id(self) -> int:
        return NATIVE_FORMATS[self.format]

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
    weights: dict[str, GgufWeight] = {}
    for tensor in reader.tensors:
        format_name = tensor.tensor_type.name
        if format_name not in NATIVE_FORMATS:
            continue
        name = _module_name(tensor.name, tied_embeddings)
        if name is None:
            continue
        blocks = np.asarray(tensor.data)  # [out, row bytes] uint8
        in_features = int(tensor.shape[0])  # GGUF lists the fastest dimension first
        if name.endswith("q_proj"):
            blocks = blocks[rotary_rows(blocks.shape[0], num_heads)]
        elif name.endswith("k_proj"):
            blocks = blocks[rotary_rows(blocks.shape[0], num_kv_heads)]
        weights[name] = GgufWeight(torch.from_numpy(np.array(blocks, copy=True)), format_name, in_features)
    return weights


def _module_name(tensor: str, tied_embeddings: bool) -> str | None:
    found = _BLOCK_TENSOR.match(tensor)
    if found:
        member = LLAMA_LINEARS.get(found.group(2))
        return f"model.layers.{found.group(1)}.{member}" if member else None
    if tensor == "output.weight":
        return "lm_head"
    if tensor == "token_embd.weight" and tied_embeddings:
        return "lm_head"  # the output layer multiplies the embedding's rows
    return None


def rotary_rows(rows: int, heads: int) -> np.ndarray:
    """The order transformers' GGUF loader gives q or k rows (LlamaTensorProcessor._reverse_permute_weights): within
    each head, the file's pairs of rows (2i, 2i + 1) become rows i and dim + i."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)
