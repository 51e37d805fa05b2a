"""A draft's decoder layers and its whole level in one call each of specpipe's CPU kernel (the AVX512_BF16
build's block_decoder_layer and block_draft_level over weights in column blocks, specpipe/kernels/cpu/draft_level.h):
`BlockLayers` runs a draft head's Llama decoder layers one call each, `KernelDraftLevel` an EAGLE head's or a draft
model's whole level from the token embeddings to the output layer's log-probs. Why: op by op, much of a bf16 draft
level is small torch ops and the Python between them around its products and attention; the calls run the same ops,
rounded as the op-by-op path rounds them but for the SiLU's exp (see BlockLayers), so only drafts take them: their
tokens are verified, and the target's forward stays the lean loop of specpipe.engine.lean_model, bitwise
transformers'. The engine hands the kernel's functions to the models it rewrites
(specpipe.engine.lean_model.swap_lean_model); the drafters build these from them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specpipe.engine.blocks import FusedQKVAttention, rotary_tables
from specpipe.engine.rotary import RotaryTables


def block_layer_arguments(layers) -> tuple[list[tuple], list[int], list[float], int] | None:
    """What the kernel's block_decoder_layer takes of each of `layers` (its weight arguments, in its order), their
    attentions' layer_idx and score scales, and the most rows all their products run over column blocks; None where
    a layer is not served (another block, another dtype, a product the engine runs elsewhere)."""
    from specpipe.engine.blocks import FusedGatedMLP
    from specpipe.engine.packed_weight import OneDNNLinear

    arguments, layer_ids, scalings, max_rows = [], [], [], []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if type(attention) is not FusedQKVAttention or type(mlp) is not FusedGatedMLP:
            return None
        linears = [attention.o_proj, mlp.down_proj]
        if not all(isinstance(linear, OneDNNLinear) and len(linear.packed.splits) == 1 for linear in linears):
            return None
        packed = [attention.qkv, linears[0].packed, mlp.gate_up, linears[1].packed]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if (any(weight.blocks is None or weight.kernel_rows < 1 for weight in packed)
                or type(norms[1]) is not LlamaRMSNorm or type(norms[0]) not in (nn.Identity, LlamaRMSNorm)
                or any(norm.weight.dtype != torch.bfloat16 or norm.weight.dim() != 1
                       for norm in norms if type(norm) is LlamaRMSNorm)
                or (type(norms[0]) is LlamaRMSNorm and norms[0].variance_epsilon != norms[1].variance_epsilon)):
            return None
        input_norm = norms[0].weight if type(norms[0]) is LlamaRMSNorm else None
        arguments.append((input_norm, norms[1].weight, norms[1].variance_epsilon,
                          [weight.blocks for weight in packed], [weight.scale for weight in packed],
                          [weight.kernel_bias for weight in packed], attention.query_heads, attention.kv_heads,
                          mlp.intermediate_size))
        layer_ids.append(attention.layer_idx)
        scalings.append(attention.scaling)
        max_rows.append(min(weight.kernel_rows for weight in packed))
    return (arguments, layer_ids, scalings, min(max_rows)) if arguments else None


class BlockLayers:
    """A draft head's Llama decoder layers, each run in one call of the CPU kernel's block_decoder_layer
    (its AVX512_BF16 build): the norms, the products over the weights' column blocks, the rotary embedding,
    the cache writes, the attention and the residual adds of a layer without a torch op between them.

    Why: op by op, about half of a level of the embedded model's bf16 EAGLE head is ~100 small torch ops and
    the Python around them. The layer's SiLU rounds like transformers' but
    for an exp that may differ by a bf16 step now and then (see the source), so only draft heads run it:
    their drafts are verified, the target's forward stays the op-by-op lean loop that is bitwise transformers'.
    `of` gives None where a layer is not served (another block, another dtype, a product the engine runs
    elsewhere); `serves` says which calls it takes (one bf16 sequence on the CPU, up to the rows the
    engine routes to the kernel, a PositionIndexedCache)."""

    def __init__(self, layer_kernel, arguments: list[tuple], layer_ids: list[int], scalings: list[float],
                 max_rows: int) -> None:
        self.layer_kernel = layer_kernel
        self.arguments = arguments  # per layer: block_decoder_layer's weight arguments, in its order
        self.layer_ids = layer_ids  # per layer: its attention's layer_idx (its rows in the cache)
        self.scalings = scalings  # per layer: its attention's score scale
        self.max_rows = max_rows

    @classmethod
    def of(cls, layer_kernel, layers) -> BlockLayers | None:
        if layer_kernel is None:
            return None
        found = block_layer_arguments(layers)
        return cls(layer_kernel, *found) if found is not None else None

    def serves(self, hidden: Tensor, mask: Tensor | None, cache) -> bool:
        """hidden [batch, q, hidden_size]; mask as `__call__` takes it; cache: what the layers append to."""
        from specpipe.kv_cache import PositionIndexedCache

        return (hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and hidden.shape[0] == 1
                and 1 <= hidden.shape[1] <= self.max_rows and isinstance(cache, PositionIndexedCache)
                and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                      and mask.shape[:3] == (1, 1, hidden.shape[1]))))

    def __call__(self, hidden: Tensor, mask: Tensor | None, position_embeddings: tuple[Tensor, Tensor],
                 cache) -> Tensor:
        """hidden [1, q, hidden_size]; mask [1, 1, q, kv] bool over the cached rows then these, or None (causal);
        position_embeddings (cos, sin) [1, q, head_dim] -> [1, q, hidden_size]. Appends q rows to `cache`."""
        q = hidden.shape[1]
        cos, signed_sin = (table[0, :, 0].contiguous() for table in rotary_tables(position_embeddings))  # [q, hd]
        rows = hidden[0].contiguous()  # [q, hidden_size]
        started = cache.get_seq_length()
        try:
            for arguments, layer_idx, scaling in zip(self.arguments, self.layer_ids, self.scalings):
                like = rows.new_empty(1, arguments[7], 0, cos.shape[-1])  # [1, kv_heads, 0, head_dim]
                keys, values, length = cache.rows_to_write(layer_idx, like, q)
                layer_mask = mask[0, 0] if mask is not None else (
                    torch.ones(q, length + q, dtype=torch.bool).tril(length) if q > 1 else None)  # [q, kv]
                rows = self.layer_kernel(rows, *arguments, cos, signed_sin, keys, values, length, layer_mask, scaling)
        except BaseException:
            cache.crop(started)  # rows_to_write counted rows a failed call never wrote
            raise
        return rows[None]


# The most rows one call takes where the level's products run on AMX tiles (cpu_kernel.DraftLevelCall.tile_rows): a
# batch's catch-up after plain steps (each request's committed rows) in one call rather than in one call per request
# or op by op; a batch's level of more rows than that runs op by op in one forward, which oneDNN's products then make
# the faster (8 requests x 8 / 16 / 32 rows: 2.8 / 5.3 / 10.3 ms in calls of 64 rows, 7.3 / 5.2 / 8.2 ms in calls of
# 12 and op by op; docs/notebook/run-84.md).
TILED_LEVEL_MAX_ROWS = 64


class KernelDraftLevel:
    """A draft's whole level in one call of the CPU kernel's block_draft_level (its AVX512_BF16 build): an EAGLE
    head's (the rows' token embeddings beside their features through `fc`) or a draft model's (the embeddings alone,
    and its final norm after the layers), the decoder layers as BlockLayers runs them, and the output layer's
    log-probs, without a torch op or a line of Python between them.

    Why: with the layers one kernel call each, about a third of a bf16 level of the embedded model's EAGLE head
    is still outside its products and attention: the embedding, the cat, `fc`, the rotary lookup, the cache's
    bookkeeping, the output layer and its log-softmax are small torch ops with the Python around them.
    The call runs the same ops and products: an EAGLE level's outputs are bitwise those
    of its level op by op (its layers through BlockLayers), except where its products run on AMX tiles (from
    cpu_kernel.DRAFT_LEVEL_TILE_ROWS rows, where the engine has them). `of` gives None where a part is not served (a
    layer BlockLayers does not take, an embedding that renormalizes, a product the engine does not run over column
    blocks, no rotary tables); `serves` says which calls it takes: those whose products every path runs over the
    column blocks (up to `max_rows` rows, the output layer's up to `max_logprob_rows`; on the tiles
    TILED_LEVEL_MAX_ROWS), over a plain PositionIndexedCache."""

    def __init__(self, level_kernel, layer_arguments: tuple, fc, head, embedding: Tensor, rotary: RotaryTables,
                 final_norm: Tensor | None) -> None:
        arguments, self.layer_ids, scalings, max_rows = layer_arguments  # block_layer_arguments' of the layers
        self.level_kernel = level_kernel
        self.fc, self.head = fc, head  # PackedWeight (fc: None for a draft model), each one member over column blocks
        self.embedding = embedding  # [vocab, hidden_size] bf16
        self.rotary = rotary
        self.final_norm = final_norm  # [hidden_size] bf16 or None
        self.tiled = getattr(level_kernel, "tile_rows", 0) > 0
        if self.tiled:
            # its products of several rows run on AMX tiles, not as the op-by-op path runs them (oneDNN above the
            # weights' kernel_rows): nothing to keep it alike, and a drafter's catch-up of many rows costs little
            self.max_rows = self.max_logprob_rows = TILED_LEVEL_MAX_ROWS
        else:
            self.max_rows = min(max_rows, fc.kernel_rows) if fc is not None else max_rows
            self.max_logprob_rows = head.kernel_rows
        self.input_norms, self.post_norms, self.blocks, self.scales, self.biases = [], [], [], [], []
        for input_norm, post_norm, _, blocks, scales, biases, *_ in arguments:
            self.input_norms.append(input_norm)
            self.post_norms.append(post_norm)
            self.blocks.extend(blocks)
            self.scales.extend(scales)
            self.biases.extend(biases)
        _, _, self.eps, _, _, _, self.heads, self.kv_heads, self.intermediate = arguments[0]
        self.scaling = scalings[0]

    @classmethod
    def of(cls, level_kernel, layers, fc: nn.Module | None, head: nn.Module | None, embedding: nn.Module,
           rotary: RotaryTables | None, final_norm: nn.Module | None = None) -> KernelDraftLevel | None:
        """layers: the draft's decoder layers; fc: an EAGLE head's nn.Linear slot (None: a draft model's level reads
        the embeddings alone); head: the module whose product gives the logits the log-probs are over; embedding:
        the token embedding; rotary: the draft's RotaryTables; final_norm: a draft model's norm after its layers."""
        found = block_layer_arguments(layers) if level_kernel is not None and rotary is not None else None
        products = [_block_product(fc) if fc is not None else None, _block_product(head)]
        if found is None or products[1] is None or (fc is not None and products[0] is None):
            return None
        if (type(embedding) is not nn.Embedding or embedding.max_norm is not None
                or embedding.weight.dtype != torch.bfloat16 or embedding.weight.device.type != "cpu"):
            return None  # max_norm renormalizes rows in place
        arguments, _, scalings, _ = found
        width = embedding.weight.shape[1]
        eps = {layer_arguments[2] for layer_arguments in arguments}
        if (len({(layer_arguments[2], *layer_arguments[6:9]) for layer_arguments in arguments}) != 1
                or len(set(scalings)) != 1
                or (fc is not None and (products[0].in_features, products[0].out_features) != (2 * width, width))
                or products[1].in_features != width):
            return None
        if final_norm is not None and (type(final_norm) is not LlamaRMSNorm or final_norm.variance_epsilon not in eps
                                       or final_norm.weight.dtype != torch.bfloat16 or final_norm.weight.dim() != 1):
            return None
        return cls(level_kernel, found, products[0], products[1], embedding.weight, rotary,
                   final_norm.weight if final_norm is not None else None)

    def serves(self, rows: int, logprob_rows: int, cache) -> bool:
        return self.serves_many([(rows, logprob_rows, cache)])

    def serves_many(self, sequences: list[tuple[int, int, object]]) -> bool:
        """Whether one call takes these sequences' rows: (rows, log-prob rows, cache) each."""
        from specpipe.kv_cache import PositionIndexedCache

        return (1 <= sum(rows for rows, _, _ in sequences) <= self.max_rows
                and sum(logprob_rows for _, logprob_rows, _ in sequences) <= self.max_logprob_rows
                # a subclass of the cache (LayerSubsetCache) lays its rows out otherwise
                and all(1 <= logprob_rows <= rows and type(cache) is PositionIndexedCache
                        for rows, logprob_rows, cache in sequences))

    def __call__(self, token_ids: Tensor, features: Tensor | None, positions: Tensor, mask: Tensor | None, cache,
                 logprob_rows: int) -> tuple[Tensor, Tensor] | None:
        """token_ids [q] int64, features [q, hidden_size] bf16 (an EAGLE head's; None for a draft model), positions [q]
        int64, mask [q, length + q] bool over the cached rows then these (None: causal) -> (hidden [q, hidden_size]:
        an EAGLE head's predicted features, a draft model's normed last hidden states; log-probs [logprob_rows, vocab]
        fp32 of the last rows), q rows appended to `cache`; None (nothing written) where the rotary tables no longer
        serve."""
        rows = DraftRows(int(token_ids.shape[0]), mask, cache, logprob_rows)
        return self.many(token_ids, features, positions, [rows])

    def many(self, token_ids: Tensor, features: Tensor | None, positions: Tensor, sequences: list["DraftRows"]
             ) -> tuple[Tensor, Tensor] | None:
        """`__call__` for several sequences' rows side by side (token_ids [R], features [R, hidden_size] or None,
        positions [R]), each sequence's `rows` over its own cache and mask: (hidden [R, hidden_size], log-probs
        [sum of logprob_rows, vocab] of each sequence's last rows, in order); each sequence's rows bitwise what its
        rows alone give. None (nothing written) where the rotary tables no longer serve."""
        tables = self.rotary.signed_tables(self.embedding, int(positions.max()) + 1)
        if tables is None:
            return None
        starts = [sequence.cache.get_seq_length() for sequence in sequences]
        try:
            keys, values, lengths, masks = [], [], [[] for _ in sequences], []
            like = self.embedding.new_empty(1, self.kv_heads, 0, tables[0].shape[-1])  # [1, kv_heads, 0, head_dim]
            for layer_idx in self.layer_ids:  # layer-major: the kernel reads layer l's caches of every sequence
                for index, sequence in enumerate(sequences):
                    key_buffer, value_buffer, length = sequence.cache.rows_to_write(layer_idx, like, sequence.rows)
                    keys.append(key_buffer)
                    values.append(value_buffer)
                    lengths[index].append(length)
            for sequence, found in zip(sequences, lengths):
                if len(set(found)) != 1:
                    raise RuntimeError(f"the draft cache's layers hold different numbers of rows "
                                       f"({sorted(set(found))})")
                mask = sequence.mask
                if mask is None and sequence.rows > 1:
                    mask = torch.ones(sequence.rows, found[0] + sequence.rows, dtype=torch.bool).tril(found[0])
                masks.append(mask)
            fc = (self.fc.blocks, self.fc.scale, self.fc.kernel_bias) if self.fc is not None else (None, None, None)
            return tuple(self.level_kernel(
                token_ids, features, self.embedding, *fc, *tables,
                positions, self.input_norms, self.post_norms, self.eps, self.blocks, self.scales, self.biases,
                self.heads, self.kv_heads, self.intermediate, keys, values, [found[0] for found in lengths],
                [sequence.rows for sequence in sequences], masks, self.scaling,
                self.final_norm, self.head.blocks, self.head.out_features, self.head.scale, self.head.kernel_bias,
                [sequence.logprob_rows for sequence in sequences]))
        except BaseException:
            for sequence, start in zip(sequences, starts):
                sequence.cache.crop(start)  # rows_to_write counted rows a failed call never wrote
            raise

    def in_groups(self, calls: list[tuple[Tensor, Tensor | None, Tensor, "DraftRows"]]
                  ) -> list[tuple[Tensor, Tensor] | None]:
        """Several sequences' levels, (token_ids, features, positions, DraftRows) each, in as few calls of `many` as its
        row limits allow (each sequence into the first group it fits): per sequence (hidden [rows, hidden_size],
        log-probs [logprob_rows, vocab]), or None where no call takes it (more rows than one call takes, a cache laid
        out otherwise) or the rotary tables no longer serve."""
        sequences = [(rows.rows, rows.logprob_rows, rows.cache) for *_, rows in calls]
        if self.tiled and sum(rows for rows, _, _ in sequences) > self.max_rows:
            # more rows than one call takes: one forward op by op (oneDNN's products over all of them) is the faster
            return [None] * len(calls)
        groups: list[list[int]] = []
        for index, sequence in enumerate(sequences):
            if not self.serves_many([sequence]):
                continue
            group = next((group for group in groups
                          if self.serves_many([*(sequences[i] for i in group), sequence])), None)
            if group is None:
                groups.append([index])
            else:
                group.append(index)
        out: list[tuple[Tensor, Tensor] | None] = [None] * len(calls)
        for group in groups:
            chosen = [calls[index] for index in group]
            features = [call[1] for call in chosen]
            done = self.many(torch.cat([call[0] for call in chosen]),
                             torch.cat(features) if features[0] is not None else None,
                             torch.cat([call[2] for call in chosen]), [call[3] for call in chosen])
            if done is None:
                continue
            hidden, logprobs = done
            row = logprob_row = 0
            for index, (*_, rows) in zip(group, chosen):
                out[index] = (hidden[row:row + rows.rows], logprobs[logprob_row:logprob_row + rows.logprob_rows])
                row += rows.rows
                logprob_row += rows.logprob_rows
        return out


class DraftRows(NamedTuple):
    """One sequence's rows in a KernelDraftLevel call: how many, their mask [rows, cached + rows] bool over its cache
    then them (None: causal), its cache, and how many of its last rows' log-probs are wanted."""

    rows: int
    mask: Tensor | None
    cache: object
    logprob_rows: int


def fill_the_rest(out: list, feeds: list, alone, together) -> list:
    """`out` (a batch's results, None for a feed no kernel call took) with those feeds' results: a lone one through
    `alone(feed)`, several through `together(feeds)` (one forward for all of them)."""
    rest = [index for index, result in enumerate(out) if result is None]
    if len(rest) == 1:
        out[rest[0]] = alone(feeds[rest[0]])
    elif rest:
        for index, result in zip(rest, together([feeds[index] for index in rest])):
            out[index] = result
    return out


def _block_product(module: nn.Module | None):
    """The PackedWeight of a lone OneDNNLinear whose products the engine runs over column blocks, else None."""
    from specpipe.engine.packed_weight import OneDNNLinear

    packed = getattr(module, "packed", None)
    if (isinstance(module, OneDNNLinear) and len(packed.splits) == 1 and packed.blocks is not None
            and packed.kernel_rows >= 1):
        return packed
    return None
