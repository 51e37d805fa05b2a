"""A position-indexed KV cache that transformers' models write into through the Cache API.

Each layer owns preallocated `[batch, kv_heads, capacity, head_dim]` buffers and writes new
entries in place at the current length (gpt-fast style), so appending n tokens costs O(n)
instead of the O(length) `torch.cat` of `DynamicCache`. After a verify forward the tree's
entries sit after the committed ones; `keep` moves the accepted path's rows down and drops
the rest, which is O(accepted) work.
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer


class PositionIndexedLayer(DynamicLayer):
    """One layer's keys and values; `length` rows of the buffers are valid."""

    initial_capacity = 512

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, head_dim = key_states.shape
        self._key_buffer = key_states.new_empty(batch, heads, self.initial_capacity, head_dim)
        self._value_buffer = value_states.new_empty(batch, value_states.shape[1], self.initial_capacity,
                                                    value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        capacity = self._key_buffer.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], old.shape[1], new_capacity, old.shape[3])
            grown[:, :, : self.length].copy_(old[:, :, : self.length])
            setattr(self, name, grown)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # key_states, value_states: [batch, kv_heads, new_tokens, head_dim]
        start = self.rows_to_write(key_states, value_states, key_states.shape[-2])
        try:
            self._key_buffer[:, :, start : self.length].copy_(key_states)
            self._value_buffer[:, :, start : self.length].copy_(value_states)
        except BaseException:
            self.length = start  # states that do not fit the buffers: nothing was written
            raise
        return self.keys, self.values

    def rows_to_write(self, key_like: Tensor, value_like: Tensor, new_tokens: int) -> int:
        """Makes room for `new_tokens` rows after the valid ones and counts them as written; returns the first.
        key_like, value_like [batch, kv_heads, any, head_dim] give a new layer its buffers' shape and dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        start = self.length
        self._reserve(start + new_tokens)
        self.length = start + new_tokens
        return start

    @property
    def keys(self) -> Tensor | None:  # [batch, kv_heads, length, head_dim]
        return self._key_buffer[:, :, : self.length] if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:  # the base class assigns None before initialization
        if value is not None:
            raise AttributeError("PositionIndexedLayer keys are written through update()")

    @property
    def values(self) -> Tensor | None:  # [batch, kv_heads, length, head_dim]
        return self._value_buffer[:, :, : self.length] if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("PositionIndexedLayer values are written through update()")

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if self.is_initialized:
            self.length = min(self.length, max_length)

    def keep(self, start: int, rows: Tensor) -> None:
        """Keeps rows `start + rows` (ascending) as rows `start ... start + len(rows) - 1`."""
        count = int(rows.shape[0])
        source = rows.to(self._key_buffer.device) + start  # [count]; layers of a device map differ in device
        for buffer in (self._key_buffer, self._value_buffer):
            buffer[:, :, start : start + count] = buffer.index_select(2, source)
        self.length = start + count

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0


class PositionIndexedCache(Cache):
    """The target's KV cache for one decoding run."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=PositionIndexedLayer)

    @torch.inference_mode()
    def keep(self, start: int, rows: list[int]) -> None:
        """Drops every entry after `start` except rows `start + rows` (ascending)."""
        if rows == list(range(len(rows))):  # a chain's accepted prefix: nothing moves
            self.crop(start + len(rows))
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.layers[0].keys.device)  # [k]
        for layer in self.layers:
            layer.keep(start, index)

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def rows_to_write(self, layer_idx: int, like: Tensor, new_tokens: int) -> tuple[Tensor, Tensor, int]:
        """For a writer that fills layer `layer_idx`'s next `new_tokens` rows in place (the CPU kernel's
        block_decoder_layer): its key and value buffers [batch, kv_heads, capacity, head_dim], with room for
        them, and the first of them; they count as written from here on. `like` [batch, kv_heads, any, head_dim]
        gives a new layer its shape and dtype."""
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx]
        start = layer.rows_to_write(like, like, new_tokens)
        return layer._key_buffer, layer._value_buffer, start
