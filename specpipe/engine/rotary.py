"""The cos/sin of a Llama rotary embedding looked up per position, for engine=fast's lean forwards.

Why: `LlamaRotaryEmbedding` computes the cos and sin of every position again at each forward, in small
ops paid by each target forward and by each level of a draft head, where they are a noticeable share of
a sub-millisecond level. Every value it returns is elementwise in the position
(position x inv_freq, then cos or sin, times the scaling, cast to the dtype), so a position's row does not
depend on the positions beside it; the tables here are made by the module itself, a slice of positions at a
time, and a lookup returns bitwise what the module returns (tested, and spot-checked each time a table grows).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

# RoPE types whose inverse frequencies are fixed when the module is made: dynamic and longrope ones change
# them with the sequence length inside the forward, so those keep the module.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# Positions per call of the module while a table grows: its elementwise ops run whole vectors on one thread
# (256 x head_dim values; ATen splits an op across threads from 32768).
SLICE_POSITIONS = 256


class RotaryTables:
    """(cos, sin) [batch, q, head_dim] of `rotary` for position_ids [batch, q], as `rotary(hidden, position_ids)`
    gives them, from tables per (device, dtype) grown to the largest position asked so far. Only CPU tensors
    are looked up (a GPU forward would wait for the largest position); elsewhere the module runs."""

    def __init__(self, rotary: nn.Module) -> None:
        if not self.serves(rotary):
            raise ValueError(f"RotaryTables serves LlamaRotaryEmbedding of the RoPE types {sorted(STATIC_ROPE_TYPES)}, "
                             f"not {type(rotary).__name__} ({getattr(rotary, 'rope_type', None)!r})")
        self.rotary = rotary
        # False once a table's rows differed from the module's own (see _grown): the module serves from then on
        self.exact = True
        self.tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, dtype, inv_freq's state) -> cos, sin [n, hd]
        self.signed: tuple[Tensor, Tensor] | None = None  # signed_tables' (cos, signed_sin) [n, hd] of the current table

    @staticmethod
    def serves(rotary: nn.Module) -> bool:
        return type(rotary) is LlamaRotaryEmbedding and getattr(rotary, "rope_type", None) in STATIC_ROPE_TYPES

    def __call__(self, hidden: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [batch, q, ...] (only its dtype and device count); position_ids [batch, q]."""
        if not self.exact or hidden.device.type != "cpu" or position_ids.numel() == 0:
            return self.rotary(hidden, position_ids)
        tables = self._tables(hidden, int(position_ids.max()) + 1)
        if tables is None:
            return self.rotary(hidden, position_ids)
        cos, sin = tables
        return cos[position_ids], sin[position_ids]

    def signed_tables(self, hidden: Tensor, positions: int) -> tuple[Tensor, Tensor] | None:
        """(cos, signed_sin) [n >= positions, head_dim] of positions 0 .. n - 1 for CPU rows of hidden's dtype, signed_sin
        being sin with its first half negated (blocks.rotary_tables' form, what the CPU kernel's layers take); None
        where the tables do not serve (the module's own rows differed from them)."""
        if not self.exact or hidden.device.type != "cpu":
            return None
        tables = self._tables(hidden, positions)
        if tables is None:
            return None
        cos, sin = tables
        if self.signed is None or self.signed[0] is not cos:
            half = sin.shape[-1] // 2
            self.signed = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        return self.signed

    def _tables(self, hidden: Tensor, needed: int) -> tuple[Tensor, Tensor] | None:
        """(cos, sin) [n >= needed, head_dim] for hidden's dtype and device, grown where shorter; None once inexact."""
        inverse = self.rotary.inv_freq
        key = (hidden.device, hidden.dtype, inverse.data_ptr(), inverse._version)  # a changed inv_freq: new tables
        cos, sin = self.tables.get(key, (None, None))
        if cos is None or cos.shape[0] < needed:
            cos, sin = self._grown(hidden, cos, sin, needed)
            self.tables = {key: (cos, sin)}  # one dtype and device at a time: older tables go
            if not self.exact:
                return None
        return cos, sin

    def _grown(self, hidden: Tensor, cos: Tensor | None, sin: Tensor | None, needed: int) -> tuple[Tensor, Tensor]:
        have = 0 if cos is None else cos.shape[0]
        size = max(needed, 2 * have)
        size = -(-size // SLICE_POSITIONS) * SLICE_POSITIONS
        probe = hidden.new_empty(0)
        cos_rows, sin_rows = ([] if cos is None else [cos]), ([] if sin is None else [sin])
        for first in range(have, size, SLICE_POSITIONS):
            positions = torch.arange(first, first + SLICE_POSITIONS, device=hidden.device)[None]  # [1, slice]
            slice_cos, slice_sin = self.rotary(probe, positions)  # [1, slice, hd]
            cos_rows.append(slice_cos[0])
            sin_rows.append(slice_sin[0])
        cos, sin = torch.cat(cos_rows), torch.cat(sin_rows)  # [size, hd]
        # the premise, checked once per table: a few positions alone give the rows made among others
        spot = torch.tensor([[0, size // 3, size - 1]], device=hidden.device)
        alone_cos, alone_sin = self.rotary(probe, spot)
        self.exact = torch.equal(alone_cos[0], cos[spot[0]]) and torch.equal(alone_sin[0], sin[spot[0]])
        return cos, sin
