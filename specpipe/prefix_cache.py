"""Prompt prefixes computed once: the target's KV rows (and the hidden states the drafters read) of every block of
`block_tokens` prompt tokens, kept by the tokens before and in the block, so a request whose prompt starts as an
earlier one's (a system prompt, a RAG template, a chat's earlier turns, the same question again) prefills only the
tokens after what they share (`prefix_cache.*`; vLLM's automatic prefix caching and llama.cpp's `cache_prompt` do
the like).

Reused rows must be the rows a prefill of the whole prompt would compute, or a request's tokens would depend on what
ran before it. A dense prefill's rows change in their last bits with how many rows share its products, so where this
cache serves, every prefill runs row-invariant (engine.batch_invariant: each row computed as its one-row forward
would be, in chunks of `chunk_tokens` rows): a prompt's rows and its first token's logits are then bitwise the same
however much of it was reused, and bitwise what one-token decoding steps give. An engine without row-invariant
forwards gets no prefix cache (the builder says so in the log).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.target import ForwardOutput, TargetModel


@dataclass(eq=False)
class _Block:
    """The rows of one block of prompt tokens, after the blocks of its parent chain."""

    key: tuple[int, tuple[int, ...]]  # (its parent's serial, 0 for the first block; its tokens)
    serial: int
    keys: Tensor  # [layers, kv_heads, block_tokens, head_dim]
    values: Tensor  # [layers, kv_heads, block_tokens, head_dim]
    hidden: Tensor  # [block_tokens, width]: the target's last hidden states (DecodeState.prompt_hidden)
    aux_hidden: Tensor | None  # [block_tokens, k * width] (DecodeState.prompt_aux_hidden), or None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = [self.keys, self.values, self.hidden] + ([self.aux_hidden] if self.aux_hidden is not None else [])
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@dataclass(frozen=True)
class PrefixPrefill:
    """A prefill through the prefix cache: the target's output over the whole prompt (logits of its last token,
    hidden states of every token), and how many of its tokens came from the cache."""

    output: ForwardOutput
    reused_tokens: int


class PrefixCache:
    """Blocks of prompt rows by the tokens up to their end, least recently used evicted first (a block that a
    longer prefix extends goes after it), within `max_bytes`. Used by the batch engine's thread; a lock keeps
    two engines sharing one cache apart."""

    def __init__(self, max_bytes: int, block_tokens: int = 16, chunk_tokens: int = 256) -> None:
        for name, value in (("max_bytes", max_bytes), ("block_tokens", block_tokens),
                            ("chunk_tokens", chunk_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"prefix_cache: {name} must be a positive integer, got {value!r}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()  # by key, least recently used first
        self._serials = 0
        self._children: dict[int, list[_Block]] = {}  # by the parent's serial (0: first blocks); none: a leaf
        self._aux_layers: tuple[int, ...] | None = None  # the target's captured layers the blocks hold
        self._lock = threading.Lock()
        self.bytes = 0
        self.queried_tokens = 0  # prompt tokens of every prefill through the cache
        self.reused_tokens = 0  # of those, the tokens whose rows came from the cache

    def empty_copy(self) -> PrefixCache:
        """A cache of the same settings, with nothing in it."""
        return PrefixCache(self.max_bytes, self.block_tokens, self.chunk_tokens)

    def __len__(self) -> int:
        return len(self._blocks)

    def prefill(self, target: TargetModel, prompt: Sequence[int], cache: PositionIndexedCache) -> PrefixPrefill:
        """Prefills `prompt` into the empty `cache` through the cache, all at once (`begin`, advanced to its end)."""
        prefill = self.begin(target, prompt, cache)
        while not prefill.advance():
            pass
        return prefill.result

    def begin(self, target: TargetModel, prompt: Sequence[int], cache: PositionIndexedCache) -> PrefillInProgress:
        """Starts prefilling `prompt` into the empty `cache`: the rows of its longest prefix the cache holds (whole
        blocks, then the first rows of one more; short of the last token, whose logits a forward must give) are
        copied in at once; `advance` computes the rest, a forward of `chunk_tokens` rows at a time, so that a batch
        engine can run its decoding steps in between."""
        prompt = list(prompt)
        with self._lock:
            if self._aux_layers != target.aux_layers:  # the blocks hold other layers' states than it gives
                self._clear()
                self._aux_layers = target.aux_layers
            chain = self._match(prompt)
            partial = self._partial(prompt, chain)
            self.queried_tokens += len(prompt)
            self.reused_tokens += len(chain) * self.block_tokens + (partial[1] if partial else 0)
        if chain or partial:
            self._load(chain, partial, cache)
        return PrefillInProgress(self, target, prompt, cache, chain, partial)

    def keep(self, target: TargetModel, tokens: Sequence[int], cache: PositionIndexedCache, hidden: Tensor,
             aux_hidden: Tensor | None, extends: Sequence[_Block] = ()) -> None:
        """Keeps the whole blocks of `tokens`, whose rows `cache` holds (a prompt just prefilled, or a finished
        request's prompt and answer, computed row-invariant alike), with their hidden states hidden
        [len(tokens), width] and aux_hidden [len(tokens), k * width] (None where the target captures no layers).
        `extends`: the cached blocks these tokens begin with (those a prefill reused)."""
        with self._lock:
            if self._aux_layers != target.aux_layers:
                return
            chain = list(extends)
            if any(self._blocks.get(block.key) is not block for block in chain):  # evicted meanwhile: from the top
                chain = []
            self._insert(list(tokens), chain, cache, hidden, aux_hidden)

    # ---- under the lock ------------------------------------------------------------------------------------
    @staticmethod
    def _key(parent: _Block | None, tokens: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        return (parent.serial if parent is not None else 0, tuple(tokens))

    def _partial(self, prompt: list[int], chain: list[_Block]) -> tuple[_Block, int] | None:
        """After `chain` (the whole blocks that begin `prompt`), the cached block that goes on as `prompt` does for
        the most tokens, short of its last one, and how many: every row depends only on the tokens up to its own,
        so the first rows of a block are reused however it ends (None where no block begins with the next token)."""
        start = len(chain) * self.block_tokens
        wanted = prompt[start:min(start + self.block_tokens, len(prompt) - 1)]
        best, best_rows = None, 0
        for block in self._children.get(chain[-1].serial if chain else 0, ()):
            rows = 0
            for token, cached in zip(wanted, block.key[1]):
                if token != cached:
                    break
                rows += 1
            if rows > best_rows:
                best, best_rows = block, rows
        if best is None:
            return None
        self._blocks.move_to_end(best.key)
        return best, best_rows

    def _match(self, prompt: list[int]) -> list[_Block]:
        """The cached blocks that begin `prompt`, in order, covering at most all but its last token."""
        chain: list[_Block] = []
        size = self.block_tokens
        for start in range(0, len(prompt) - size, size):  # blocks that end before the last token
            block = self._blocks.get(self._key(chain[-1] if chain else None, prompt[start:start + size]))
            if block is None:
                break
            chain.append(block)
        for block in chain:
            self._blocks.move_to_end(block.key)
        return chain

    def _insert(self, prompt: list[int], chain: list[_Block], cache: PositionIndexedCache, hidden: Tensor,
                aux_hidden: Tensor | None) -> None:
        """Keeps the whole blocks of `prompt` after `chain` (its reused ones), their rows read from `cache`;
        hidden [len(prompt), width], aux_hidden [len(prompt), k * width] or None."""
        size = self.block_tokens
        parent = chain[-1] if chain else None
        protected = {block.key for block in chain}
        for start in range(len(chain) * size, len(prompt) - size + 1, size):
            key = self._key(parent, prompt[start:start + size])
            block = self._blocks.get(key)
            if block is None:
                end = start + size
                keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
                values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
                self._serials += 1
                block = _Block(key, self._serials, keys, values, hidden[start:end].clone(),
                               aux_hidden[start:end].clone() if aux_hidden is not None else None)
                if not self._make_room(block.nbytes, protected):
                    return
                self._blocks[key] = block
                self._children.setdefault(key[0], []).append(block)
                self.bytes += block.nbytes
            else:
                self._blocks.move_to_end(key)
            protected.add(key)
            parent = block

    def _make_room(self, nbytes: int, protected: set) -> bool:
        """Evicts the least recently used blocks that no other block extends (never those of `protected`) until
        `nbytes` more fit; False where they cannot."""
        while self.bytes + nbytes > self.max_bytes:
            victim = next((block for block in self._blocks.values()
                           if block.serial not in self._children and block.key not in protected), None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            siblings = self._children[victim.key[0]]
            siblings.remove(victim)
            if not siblings:
                del self._children[victim.key[0]]
            self.bytes -= victim.nbytes
        return True

    def _clear(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self.bytes = 0

    # ---- outside the lock ----------------------------------------------------------------------------------
    @staticmethod
    def _load(chain: list[_Block], partial: tuple[_Block, int] | None, cache: PositionIndexedCache) -> None:
        """Writes the rows of `chain`, then the first rows of `partial`'s block, into the empty `cache`, each layer's
        in one copy."""
        parts = [(block, block.keys.shape[2]) for block in chain] + ([partial] if partial else [])
        keys = torch.cat([block.keys[:, :, :rows] for block, rows in parts], dim=2)  # [layers, kv_heads, n, hd]
        values = torch.cat([block.values[:, :, :rows] for block, rows in parts], dim=2)
        rows = keys.shape[2]
        like = keys[:1, :, :0]  # [1, kv_heads, 0, head_dim]: a new layer's shape and dtype
        for layer in range(keys.shape[0]):
            key_buffer, value_buffer, start = cache.rows_to_write(layer, like, rows)
            key_buffer[0, :, start:start + rows].copy_(keys[layer])
            value_buffer[0, :, start:start + rows].copy_(values[layer])


class PrefillInProgress:
    """A prompt's prefill through a PrefixCache (`PrefixCache.begin`), a forward at a time; `result` once done."""

    def __init__(self, owner: PrefixCache, target: TargetModel, prompt: list[int], cache: PositionIndexedCache,
                 chain: list[_Block], partial: tuple[_Block, int] | None = None) -> None:
        self.owner, self.target, self.prompt, self.cache, self.chain = owner, target, prompt, cache, chain
        parts = [(block, owner.block_tokens) for block in chain] + ([partial] if partial else [])
        self.reused_tokens = sum(rows for _, rows in parts)
        self.position = self.reused_tokens  # the next token to compute
        self._hidden = [block.hidden[:rows] for block, rows in parts]
        self._aux_hidden = [block.aux_hidden[:rows] for block, rows in parts] if target.aux_layers else []
        self.result: PrefixPrefill | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    def advance(self) -> bool:
        """Computes the next chunk of the prompt; True once the whole prompt is in the cache (its blocks kept)."""
        if self.done:
            return True
        out = self.target.prefill_invariant(self.prompt, self.cache, self.position, self.owner.chunk_tokens)
        self.position += out.hidden.shape[0]
        self._hidden.append(out.hidden)
        if out.aux_hidden is not None:
            self._aux_hidden.append(out.aux_hidden)
        if self.position < len(self.prompt):
            return False
        hidden = torch.cat(self._hidden)
        aux_hidden = torch.cat(self._aux_hidden) if self._aux_hidden else None
        self.owner.keep(self.target, self.prompt, self.cache, hidden, aux_hidden, extends=self.chain)
        self.result = PrefixPrefill(ForwardOutput(out.logits, hidden, aux_hidden=aux_hidden), self.reused_tokens)
        return True
