"""int8 weights for drafters: each weight row quantized symmetrically with its own step (`scale`).

Why: on a CPU a draft level reads the draft's weights from memory again after every target forward has
streamed the target's through the caches (an EAGLE head for SmolLM2-135M: ~18 MB of bf16 weights, whose
reading is most of a level's time). int8 halves those bytes. Only
drafters are quantized: the target's products stay in its own dtype, so greedy output stays exact; a
quantized draft proposes slightly different tokens, which costs or gains acceptance, never exactness.
"""
from __future__ import annotations

import torch
from torch import Tensor

QUANTIZATIONS = ("int8",)  # what the weights can be quantized to
# A drafter's `weight_quantization` and engine.apply's `quantize`: besides None (the model's dtype), "int8"
# (a warning where the engine cannot), or "auto": int8 where the engine's CPU kernel serves the products,
# else the model's dtype without a warning (a GPU, engine=hf). int8 was never slower than bf16 or fp32
# weights for 1-24 rows of an EAGLE head's shapes, AVX-512 and AVX2 builds alike (docs/notebook/run-56.md).
QUANTIZE_CHOICES = ("auto", *QUANTIZATIONS)
INT8_LEVELS = 127  # symmetric: codes in [-127, 127], so -w quantizes to -code


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (codes [out, in] int8, scale [out] fp32), weight ~= codes * scale[:, None]: each
    row's largest magnitude maps to 127 (round to nearest); an all-zero row gets scale 1."""
    rows = weight.detach().float()
    largest = rows.abs().amax(dim=1)  # [out]
    scale = torch.where(largest > 0, largest / INT8_LEVELS, torch.ones_like(largest))  # [out]
    codes = torch.round(rows / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


def dequantize_rows(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """codes [out, in] int8, scale [out] -> the weight they stand for [out, in], rounded to `dtype`."""
    return (codes.float() * scale[:, None]).to(dtype)


def checked_quantization(value: str | None, name: str) -> str | None:
    """A drafter's `weight_quantization` setting, or a ConfigError that names the drafter and the choices."""
    if value is not None and value not in QUANTIZE_CHOICES:
        from specpipe.errors import ConfigError

        raise ConfigError(f"{name}: weight_quantization must be one of {list(QUANTIZE_CHOICES)} or null (the "
                          f"model's dtype), got {value!r}")
    return value
