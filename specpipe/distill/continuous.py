"""Continuous batching for the self-distilled corpus: many prompts decoded at once, each at its own
length, a finished answer's slot refilled with the next prompt at the next step.

Why not HF `generate` on left-padded batches (`BatchedGreedy`): a batch runs until its longest
answer ends, so slots whose answer ended early idle (answers here run 20-256 tokens), every row
pays for the padding in attention, and the padded batch prefill grows much faster than its prompts
(tens of seconds for 64 prompts on a 2-core CPU). Here each prompt is prefilled alone (no padding) and joins
the running batch; every decoding step feeds one token per slot through the target's engine.

- `SlotCache`: transformers' Cache API over per-slot KV buffers `[slots, kv_heads, capacity,
  head_dim]`; slot s holds `lengths[s]` entries and a step writes each slot's new entry at its own
  position. The step's attention mask hides every slot's unused positions.
- `ContinuousGreedy`: the greedy answers of a stream of prompts, yielded as they finish. Each
  answer is what the prompt decodes to alone, up to float rounding of the batched products (the
  tests check equality on a model without near-ties; see `BatchedGreedy`).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.distill.corpus import Answer, CorpusError, chat_prompt_ids, eos_and_pad_ids
from specpipe.distill.prompts import ChatPrompt
from specpipe.kv_cache import PositionIndexedCache
from specpipe.target import resolve_attention


class SlotCache(Cache):
    """KV entries of `slots` independent sequences for one-token-per-slot decoding steps."""

    def __init__(self, slots: int, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(layers=[])
        shape = (slots, kv_heads, capacity, head_dim)
        self.key_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.value_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] valid entries per slot
        self.capacity = capacity
        self._rows = torch.arange(slots, device=device)  # [slots]
        self._width = 1  # key positions the current step reads: the longest slot plus its new entry

    @property
    def slots(self) -> int:
        return int(self.lengths.shape[0])

    def insert(self, slot: int, prefilled: PositionIndexedCache) -> None:
        """Slot `slot` takes over the entries of a one-sequence cache (a prompt prefilled alone)."""
        length = prefilled.get_seq_length()
        if length >= self.capacity:
            raise CorpusError(f"a prompt of {length} tokens leaves no room in a KV cache of {self.capacity} positions")
        for layer, keys, values in zip(prefilled.layers, self.key_buffers, self.value_buffers, strict=True):
            keys[slot, :, :length] = layer.keys[0]      # [kv_heads, length, head_dim]
            values[slot, :, :length] = layer.values[0]
        self.lengths[slot] = length

    def step_mask(self) -> Tensor:
        """[slots, 1, 1, width] bool: slot s attends to its `lengths[s]` entries and the one this step
        writes at position `lengths[s]`. Also fixes the width the step's attention reads."""
        self._width = int(self.lengths.max()) + 1
        if self._width > self.capacity:
            raise CorpusError(f"a sequence outgrew its KV cache of {self.capacity} positions")
        positions = torch.arange(self._width, device=self.lengths.device)  # [width]
        return (positions[None] <= self.lengths[:, None])[:, None, None]

    def advance(self) -> None:
        """Every slot now holds the entry its last step wrote."""
        self.lengths += 1

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # key_states, value_states: [slots, kv_heads, 1, head_dim], slot s's entry goes to position lengths[s]
        if key_states.shape[2] != 1:
            raise CorpusError("SlotCache takes one new token per slot and step; prefill prompts alone and insert()")
        keys, values = self.key_buffers[layer_idx], self.value_buffers[layer_idx]
        keys[self._rows, :, self.lengths] = key_states[:, :, 0]
        values[self._rows, :, self.lengths] = value_states[:, :, 0]
        return keys[:, :, : self._width], values[:, :, : self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max())


class ContinuousGreedy:
    """Greedy answers of a stream of prompts, `slots` decoded together (see the module doc).

    `model` is run as it is: apply the engine (OneDNNEngine) before, as the task does.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 slots: int, system_prompt: str | None = None) -> None:
        if max_new_tokens < 1 or slots < 1:
            raise CorpusError(f"max_new_tokens and the batch size must be >= 1, got {max_new_tokens} and {slots}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.slots = int(slots)
        self.system_prompt = system_prompt
        self.eos_token_ids, self.pad_token_id = eos_and_pad_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        attention = resolve_attention("sdpa", self.device)  # specpipe's masked SDPA: per-slot boolean masks
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)

    def encode(self, prompt: ChatPrompt) -> list[int]:
        return chat_prompt_ids(self.tokenizer, prompt.text, self.system_prompt, prompt.history)

    def _new_cache(self, capacity: int) -> SlotCache:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        return SlotCache(self.slots, config.num_hidden_layers, config.num_key_value_heads, head_dim, capacity,
                         dtype, self.device)

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[int]) -> tuple[PositionIndexedCache, int]:
        """(the prompt's KV entries, its first answer token)."""
        cache = PositionIndexedCache()
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, L]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, int(out.logits[0, -1].argmax())

    def stream(self, prompts: Sequence[ChatPrompt], encoded: Sequence[list[int]] | None = None) -> Iterator[Answer]:
        """Yields one Answer per prompt, in the order they finish."""
        encoded = [self.encode(p) for p in prompts] if encoded is None else encoded
        if not prompts:
            return
        eos = set(self.eos_token_ids)
        cache = self._new_cache(max(len(ids) for ids in encoded) + self.max_new_tokens)
        occupant: list[int | None] = [None] * self.slots  # prompt index decoding in each slot
        answers: list[list[int]] = [[] for _ in range(self.slots)]
        next_input = torch.full((self.slots,), self.pad_token_id, dtype=torch.long, device=self.device)  # [slots]
        waiting = iter(range(len(prompts)))

        def finish(slot: int) -> Answer:
            ids = answers[slot]
            finished = ids[-1] in eos
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            answer = Answer(prompts[occupant[slot]], ids, text, finished)
            occupant[slot], answers[slot] = None, []
            cache.lengths[slot] = 0  # an idle slot decodes padding from position 0 (rows ignored) until refilled
            next_input[slot] = self.pad_token_id
            return answer

        while True:
            for slot in range(self.slots):
                while occupant[slot] is None:  # an answer of one token (EOS first) frees its slot at once
                    index = next(waiting, None)
                    if index is None:
                        break
                    prefilled, first = self._prefill(list(encoded[index]))
                    cache.insert(slot, prefilled)
                    occupant[slot], answers[slot] = index, [first]
                    next_input[slot] = first
                    if first in eos or self.max_new_tokens == 1:
                        yield finish(slot)
            active = [slot for slot in range(self.slots) if occupant[slot] is not None]
            if not active:
                return
            with torch.inference_mode():
                mask = cache.step_mask()  # [slots, 1, 1, width]
                out = self.model(input_ids=next_input[:, None], position_ids=cache.lengths[:, None],
                                 attention_mask=mask, past_key_values=cache, use_cache=True)
                cache.advance()
                next_input.copy_(out.logits[:, -1].argmax(-1))  # [slots]; in place: stays a normal tensor
            for slot, token in zip(active, next_input[active].tolist()):
                answers[slot].append(token)
                if token in eos or len(answers[slot]) == self.max_new_tokens:
                    yield finish(slot)
