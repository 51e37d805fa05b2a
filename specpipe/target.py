"""The target model runner: prefill and one forward over [last committed token | draft tree].

Tree verification goes through transformers' attention plug-in point: the model runs with
the attention implementation registered here, which receives an explicit 4D boolean mask
(`[batch, 1, queries, cache + queries]`) and explicit position ids. No modeling file is
forked and no module attribute carries the tree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specpipe.engine.base import offers_row_invariance, row_invariant, tiles_permitted
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.stages.base import LookaheadRows
from specpipe.types import DraftTree

TREE_ATTENTION = "specpipe_tree"
SDPA_ATTENTION = "specpipe_sdpa"

# cuDNN's attention, torch's first choice for SDPA on Hopper GPUs, builds an execution plan for each new
# shape of queries, keys and mask. A draft forward meets a new shape at almost every step (its keys grow
# token by token), so drafting would pay a plan build at almost every level, about ten times its own cost on
# an H100. Flash, memory-efficient and math attention set nothing up per shape.
PLAN_FREE_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 **kwargs) -> tuple[Tensor, None]:
    """transformers' SDPA attention (same arguments and result), kept off cuDNN's per-shape plans
    (PLAN_FREE_SDPA_BACKENDS) off the CPU, for the masked forwards of drafters and tree verification."""
    ragged_batch = kwargs.pop("ragged_batch", None)
    if ragged_batch is not None:
        return ragged_batch.attend(sdpa_forward, module, query, key, value, attention_mask, **kwargs)
    if query.device.type == "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with sdpa_kernel(list(PLAN_FREE_SDPA_BACKENDS)):  # it takes a list only
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def folded_attention_bias(attention_mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """attention_mask [batch, 1, q, kv] bool (True = attend) -> [batch, 1, groups * q, kv] additive bias in
    `dtype`: 0 where a row attends, -inf elsewhere, each row repeated for the `groups` query heads
    tree_attention_forward folds onto one KV head.

    Why: given the boolean mask, every layer folded it (a copy) and SDPA turned it into this bias (one
    more op) again: 60 ops per forward of a 30-layer model. The lean model forward makes it once per
    forward and hands it to every layer; SDPA adds the same 0 / -inf values either way, so the output
    is bitwise the same (tested)."""
    batch, _, q, kv = attention_mask.shape
    folded = attention_mask[:, :, None].expand(batch, 1, groups, q, kv).reshape(batch, 1, groups * q, kv)
    return torch.zeros(folded.shape, dtype=dtype, device=folded.device).masked_fill_(~folded, float("-inf"))


class RaggedBatch:
    """The rows of several sequences in one forward: the linear layers run over all rows at once (one pass
    over the weights for the whole batch), the attention per sequence over its own cache and its own mask.

    The model is called with the rows side by side ([1, R] ids and positions), no cache and this object as the
    keyword argument `ragged_batch`, which transformers hands to every attention function; an attention
    function that receives it calls `attend`, which appends each sequence's new keys and values to its cache
    and attends its rows alone."""

    def __init__(self, caches: Sequence[PositionIndexedCache], rows: Sequence[int],
                 masks: Sequence[Tensor | None]) -> None:
        self.caches = list(caches)
        self.masks = list(masks)  # per sequence [q_i, cached_i + q_i] bool over its cache then its rows, or None (q_i = 1)
        self.rows = list(rows)  # per sequence: its rows in the forward, in order
        self.starts = [0]
        for count in rows:
            self.starts.append(self.starts[-1] + count)

    def attend(self, attention, module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
               scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
        """query [1, heads, R, head_dim], key/value [1, kv_heads, R, head_dim] (the rows' own) -> [1, R, heads,
        head_dim]; `attention` is an attention function (transformers' signature) for one sequence. The
        whole forward's `attention_mask` is not read: each sequence attends under its own."""
        outputs = []
        for index, cache in enumerate(self.caches):
            start, end = self.starts[index], self.starts[index + 1]
            keys, values = cache.update(key[:, :, start:end], value[:, :, start:end], module.layer_idx)
            mask = self.masks[index]
            out, _ = attention(module, query[:, :, start:end], keys, values,
                               mask[None, None].to(query.device) if mask is not None else None,
                               scaling=scaling, **kwargs)
            outputs.append(out)
        return torch.cat(outputs, dim=1), None


def tree_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0,
                           attention_bias: Tensor | None = None, ragged_batch: RaggedBatch | None = None,
                           **kwargs) -> tuple[Tensor, None]:
    """query [batch, heads, q, head_dim], key/value [batch, kv_heads, kv, head_dim],
    attention_mask [batch, 1, q, kv] bool (True = attend) or None (causal prefill / one token).
    Returns [batch, q, heads, head_dim], as transformers' SDPA attention does.

    `attention_bias`: folded_attention_bias(attention_mask, heads // kv_heads, query.dtype) when the
    caller has made it once for all layers; None = fold the boolean mask here. `ragged_batch`: the rows of
    several sequences (RaggedBatch), each attending its own cache.

    On CPU SDPA with a boolean mask is exact for trees; the Triton kernel registers its own
    implementation (specpipe.kernels.tree_attention), chosen by `attention=`.

    Decode and verify steps fold the query heads that share a KV head into the query rows
    ([batch, kv_heads, groups * q, head_dim]) so SDPA reads each KV head once instead of
    copying it `groups` times (transformers' repeat_kv) or taking SDPA's slow GQA path: measured
    here 2-5x faster for q = 1-16 over 256-1024 cached tokens. A mask-free prefill (causal
    over q > 1 rows, which folding would misalign) keeps transformers' own path (`sdpa_forward`), and
    so does a GPU: the folding was measured on CPUs only (`attention=auto` picks the Triton kernel there).
    """
    if ragged_batch is not None:
        return ragged_batch.attend(tree_attention_forward, module, query, key, value, scaling=scaling,
                                   dropout=dropout)
    batch, heads, q, head_dim = query.shape
    kv_heads = key.shape[1]
    if dropout or (attention_mask is None and q > 1) or heads % kv_heads or query.device.type != "cpu":
        return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    groups = heads // kv_heads
    folded_query = query.reshape(batch, kv_heads, groups * q, head_dim)  # rows ordered (group, query)
    mask = None
    if attention_bias is not None:  # [batch, 1, groups * q, kv]
        mask = attention_bias
    elif attention_mask is not None:  # [batch, 1, q, kv] -> [batch, 1, groups * q, kv], the same rows per group
        kv = attention_mask.shape[-1]
        mask = attention_mask[:, :, None].expand(batch, 1, groups, q, kv).reshape(batch, 1, groups * q, kv)
    out = F.scaled_dot_product_attention(folded_query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
AttentionInterface.register(SDPA_ATTENTION, sdpa_forward)
# Prompt prefill passes no mask: build it the way SDPA's own path does (None when plain causal).
ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, sdpa_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_ATTENTION, sdpa_mask)

ATTENTION_CHOICES = ("sdpa", "triton", "auto")


def resolve_attention(choice: str, device: torch.device) -> str:
    """The attention implementation name for `attention=choice` (sdpa | triton | auto) on `device`.

    `auto` is the Triton kernel on CUDA when Triton imports, SDPA elsewhere. Triton is imported
    here, only when its kernel is wanted, so specpipe works where it is not installed.
    """
    if choice not in ATTENTION_CHOICES:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice == "sdpa" or (choice == "auto" and device.type != "cuda"):
        return TREE_ATTENTION
    try:
        from specpipe.kernels import tree_attention as triton_kernel
    except Exception as error:  # ImportError, or a Triton that cannot initialize on this machine
        if choice == "auto":
            return TREE_ATTENTION
        raise ConfigError(f"attention=triton needs Triton, which does not import here ({type(error).__name__}: "
                          f"{error}). Install it (pip install triton, or the project's [dev] extra) or use "
                          f"attention=sdpa") from None
    if device.type != "cuda" and not triton_kernel.INTERPRETED:
        raise ConfigError(f"attention=triton runs on CUDA but the model is on {device}: use attention=sdpa (or "
                          f"auto) here, or set TRITON_INTERPRET=1 before starting to interpret the kernel "
                          f"(~1000x slower; for tests)")
    return triton_kernel.TRITON_TREE_ATTENTION


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model reads its inputs and where its outputs are gathered.

    Under an accelerate device map the first layers' weights may sit on the CPU or on disk while
    they run on a GPU, so the device comes from the map (its first GPU, as accelerate's main
    device), not from a parameter.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        gpus = [device for device in device_map.values() if device not in ("cpu", "disk", "meta")]
        if not gpus:
            return torch.device("cpu")
        return torch.device(f"cuda:{gpus[0]}" if isinstance(gpus[0], int) else gpus[0])
    return next(model.parameters()).device


def verify_inputs(root_token: int, tree: DraftTree, committed: int, lookahead: Sequence[LookaheadRows] = ()
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A verify forward's rows over a cache of `committed` rows: the root, the tree's nodes, then each block of
    lookahead rows. Returns input_ids [q], position_ids [q] and the mask [q, committed + q] bool over the cache
    then these rows (None for one row, which sees everything)."""
    n = len(tree)
    if n == 0 and not lookahead:  # a plain decoding step: one query sees everything
        return torch.tensor([root_token]), torch.tensor([committed]), None
    sizes = [len(block) for block in lookahead]
    q = 1 + n + sum(sizes)
    input_ids = torch.empty(q, dtype=torch.long)  # [q]
    input_ids[0] = root_token
    input_ids[1:n + 1] = tree.tokens
    position_ids = torch.empty(q, dtype=torch.long)  # [q]
    position_ids[0] = committed
    position_ids[1:n + 1] = tree.depth + (committed + 1)
    mask = torch.zeros(q, committed + q, dtype=torch.bool)  # [q, kv]
    mask[:, :committed + 1] = True  # every row sees the committed cache and the root
    mask[1:n + 1, committed + 1:committed + n + 1] = tree.mask  # nodes see their ancestors and themselves
    start = n + 1  # row of the current block's first token
    for block, size in zip(lookahead, sizes):
        end = start + size
        input_ids[start:end] = block.tokens
        position_ids[start:end] = block.positions
        mask[start:end, committed] = block.mask[:, 0]
        mask[start:end, committed + start:committed + end] = block.mask[:, 1:]
        start = end
    return input_ids, position_ids, mask


@dataclass(frozen=True)
class ForwardOutput:
    logits: Tensor  # [q, vocab] fp32
    hidden: Tensor  # [q, hidden]
    lookahead_logits: tuple[Tensor, ...] = ()  # per lookahead block [1 + r, vocab]: root row, then its rows
    # [q, len(aux_layers) * hidden]: the hidden states entering the layers `capture_layers` asked
    # for, side by side (EAGLE-3 heads draft from them); None when none were asked for.
    aux_hidden: Tensor | None = None


@dataclass(frozen=True)
class VerifyRows:
    """One sequence's part of a verify forward: its root, tree and lookahead blocks over its own cache."""

    root_token: int
    tree: DraftTree
    cache: PositionIndexedCache
    lookahead: tuple[LookaheadRows, ...] = ()

    def split(self, out: ForwardOutput) -> ForwardOutput:
        """The forward's rows of this sequence (root, nodes, lookahead blocks) -> what a verifier reads: rows
        0..n, and each lookahead block's logits after the root's row."""
        if not self.lookahead:
            return out
        n = len(self.tree)
        blocks: list[Tensor] = []
        start = n + 1
        for block in self.lookahead:  # each block's logits with the root's row first: [1 + r, vocab]
            blocks.append(torch.cat([out.logits[:1], out.logits[start:start + len(block)]]))
            start += len(block)
        aux_hidden = out.aux_hidden[:n + 1] if out.aux_hidden is not None else None
        return ForwardOutput(out.logits[:n + 1], out.hidden[:n + 1], tuple(blocks), aux_hidden)


class TargetModel:
    """Runs a Hugging Face causal LM for speculative decoding (batch 1 for now; tensors keep the batch dim)."""

    def __init__(self, model: PreTrainedModel, name: str = "target", attention: str = "sdpa",
                 engine: str = "hf") -> None:
        self.model = model
        self.name = name
        self.engine = engine  # which engine rewrote the model's forward (keys measured cost curves)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.attn_implementation = resolve_attention(attention, self.device)  # a registered AttentionInterface name
        self.layer_count = int(getattr(config, "num_hidden_layers", 0) or 0)
        self.aux_layers: tuple[int, ...] = ()
        self._use_attention()

    def capture_layers(self, layers: tuple[int, ...], requester: str) -> None:
        """Every forward from now on also returns `aux_hidden`: the hidden states entering each of
        `layers` (transformers' `hidden_states[i]`, i.e. the output of layer i - 1), concatenated.

        One set of layers per runner: a second, different request (two EAGLE-3 heads with other
        layers in one pipeline) is refused rather than silently serving one of them wrong rows.
        """
        layers = tuple(int(layer) for layer in layers)
        if not layers or any(not 0 <= layer < self.layer_count for layer in layers):
            raise ConfigError(f"{requester}: asks for the hidden states entering layers {list(layers)}, but "
                              f"{self.name} has layers 0..{self.layer_count - 1}")
        if self.aux_layers and self.aux_layers != layers:
            raise ConfigError(f"{requester}: asks for the hidden states of layers {list(layers)}, but another "
                              f"stage of this pipeline already reads layers {list(self.aux_layers)}; one target "
                              f"runner captures one set")
        self.aux_layers = layers

    def _aux_hidden(self, hidden_states: tuple[Tensor, ...]) -> Tensor | None:
        # hidden_states: transformers' per-layer states, each [1, q, hidden] -> [q, k * hidden]
        if not self.aux_layers:
            return None
        return torch.cat([hidden_states[layer][0].to(self.device) for layer in self.aux_layers], dim=-1)

    def _use_attention(self) -> None:
        """Several runners may share one model with different attention choices: each forward uses its own."""
        if self.model.config._attn_implementation != self.attn_implementation:
            self.model.set_attn_implementation(self.attn_implementation)

    def new_cache(self) -> PositionIndexedCache:
        return PositionIndexedCache()

    @torch.inference_mode()
    def prefill(self, prompt: list[int], cache: PositionIndexedCache) -> ForwardOutput:
        """Runs the whole prompt; returns the logits of its last token [1, vocab] and the last hidden
        states of all its tokens [L, hidden] (and `aux_hidden` [L, k * hidden] when layers are captured)."""
        self._use_attention()
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, L]
        return self._run(1, input_ids=input_ids, past_key_values=cache, use_cache=True)

    @property
    def row_invariant(self) -> bool:
        """Whether this target's engine computes every row of a forward as its one-row forward would
        (engine.batch_invariant), which `prefill_invariant` needs."""
        return offers_row_invariance(self.model)

    @torch.inference_mode()
    def prefill_invariant(self, prompt: list[int], cache: PositionIndexedCache, start: int, rows: int
                          ) -> ForwardOutput:
        """Prefills prompt[start:start + rows] onto `cache`, which holds prompt[:start], in one forward, every row
        computed as its one-row forward would be: a prompt's rows, and the logits of its last token, are bitwise the
        same however its prefill is cut into such forwards. Returns the hidden states [rows, hidden] (and
        `aux_hidden`) of these rows, and the logits [1, vocab] of the last one where it is the prompt's last token
        (else logits [0, vocab])."""
        if not self.row_invariant:
            raise ConfigError(f"{self.name}: its engine ({self.engine}) does not compute rows independently of the "
                              f"rows beside them (engine.batch_invariant on the CPU engine does)")
        end = min(start + rows, len(prompt))
        if not 0 <= start < end:
            raise ValueError(f"prefill of tokens {start}..{start + rows} of a prompt of {len(prompt)}")
        ids = torch.tensor(prompt[start:end], dtype=torch.long)  # [q]
        q = end - start
        mask = torch.ones(q, end, dtype=torch.bool).tril(start) if q > 1 else None  # causal after the cached rows
        keep = torch.tensor([q - 1] if end == len(prompt) else [], dtype=torch.long)  # only the last token's logits
        with row_invariant(self.model):
            return self.forward_masked(ids, torch.arange(start, end), mask, cache, logits_rows=keep)

    @torch.inference_mode()
    def forward_tree(self, root_token: int, tree: DraftTree, cache: PositionIndexedCache,
                     lookahead: Sequence[LookaheadRows] = ()) -> ForwardOutput:
        """One forward over the root (last committed token), every tree node, then each block of
        lookahead rows.

        Appends q = 1 + n + r entries to the cache in that order (the caller keeps the accepted
        ones; the lookahead rows come last, so keeping the root and a path drops them) and returns
        logits/hidden for rows 0..n only (row 0 = root, row i + 1 = node i): what a verifier reads.
        `lookahead_logits[b]` is [1 + r_b, vocab]: the root's row, then block b's rows.
        A lookahead row sees the whole cache plus what its block's mask allows in [root | block];
        tree nodes and lookahead rows never see each other, nor do two blocks.
        """
        return self.forward_trees([VerifyRows(root_token, tree, cache, tuple(lookahead))])[0]

    @torch.inference_mode()
    def forward_trees(self, batch: Sequence[VerifyRows]) -> list[ForwardOutput]:
        """`forward_tree` for several sequences in ONE forward: their rows side by side through the linear
        layers, each sequence's rows attending its own cache and tree (RaggedBatch). One sequence runs the
        plain forward over its own cache, as `forward_tree` always has."""
        built = [verify_inputs(item.root_token, item.tree, item.cache.get_seq_length(), item.lookahead)
                 for item in batch]
        # Where the engine offers it (engine.batch_invariant), every row is computed as its one-row forward would
        # be: a node's logits are its path's one-token step's, whatever the tree and the batch. Otherwise a
        # branched tree's products may take AMX tiles, while a chain's keep the vector product (in a batch, only when
        # every sequence's tree is branched).
        permitted = all(not item.tree.is_chain() for item in batch)
        with row_invariant(self.model), tiles_permitted(self.model, permitted):
            if len(batch) == 1:
                input_ids, position_ids, mask = built[0]
                outputs = [self.forward_masked(input_ids, position_ids, mask, batch[0].cache)]
            else:
                outputs = self._forward_ragged(batch, built)
        return [item.split(out) for item, out in zip(batch, outputs)]

    def _forward_ragged(self, batch: Sequence[VerifyRows], built: list[tuple[Tensor, Tensor, Tensor | None]]
                        ) -> list[ForwardOutput]:
        return self.forward_rows([(ids, positions, mask, item.cache) for item, (ids, positions, mask) in
                                  zip(batch, built)])

    @torch.inference_mode()
    def forward_rows(self, rows: Sequence[tuple[Tensor, Tensor, Tensor | None, PositionIndexedCache]],
                     logits_rows: Tensor | None = None) -> list[ForwardOutput]:
        """`forward_masked` for several sequences in ONE forward: per sequence (input_ids [q], position_ids [q], mask
        [q, cached + q] bool or None for one row, its cache). Returns per sequence its logits and hidden rows; with
        `logits_rows` [r] (row numbers of the whole forward, ascending) only those rows' logits, handed to the
        sequences they belong to (an empty tensor: no logits, for a drafter that scores hidden states itself)."""
        self._use_attention()
        counts = [len(ids) for ids, _, _, _ in rows]
        ragged = RaggedBatch([cache for _, _, _, cache in rows], counts, [mask for _, _, mask, _ in rows])
        input_ids = torch.cat([ids for ids, _, _, _ in rows])  # [R]
        position_ids = torch.cat([positions for _, positions, _, _ in rows])  # [R]
        started = [cache.get_seq_length() for _, _, _, cache in rows]
        try:
            whole = self._run(0 if logits_rows is None else logits_rows.to(self.device),
                              input_ids=input_ids[None].to(self.device), position_ids=position_ids[None].to(self.device),
                              use_cache=False, ragged_batch=ragged)
        except BaseException:
            for (_, _, _, cache), length in zip(rows, started):  # layers that ran have appended their rows
                cache.crop(length)
            raise
        outputs, start, kept = [], 0, 0
        for count in counts:
            end = start + count
            if logits_rows is None:
                logits = whole.logits[start:end]
            else:  # the kept rows of this sequence
                mine = int(((logits_rows >= start) & (logits_rows < end)).sum())
                logits, kept = whole.logits[kept:kept + mine], kept + mine
            aux = whole.aux_hidden[start:end] if whole.aux_hidden is not None else None
            outputs.append(ForwardOutput(logits, whole.hidden[start:end], aux_hidden=aux))
            start = end
        return outputs

    @torch.inference_mode()
    def forward_masked(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | None,
                       cache: PositionIndexedCache, logits_rows: Tensor | None = None) -> ForwardOutput:
        """input_ids, position_ids [q]; mask [q, cache + q] bool (True = attend) over the cached
        entries then the new ones, or None for one query that sees everything. Appends q entries
        to the cache; returns logits [q, vocab] (or [r, vocab] of the rows `logits_rows` [r] names: a
        drafter that reads one row, or scores its own vocabulary, skips the output layer's other rows)
        and last hidden states [q, hidden].

        The general form of a verify forward: drafters that keep their own cache use it to feed
        committed text (a causal mask) and tree nodes (an ancestor mask) alike.
        """
        self._use_attention()
        if mask is not None:
            mask = mask[None, None].to(self.device)  # [1, 1, q, kv]
        return self._run(0 if logits_rows is None else logits_rows, input_ids=input_ids[None].to(self.device),
                         position_ids=position_ids[None].to(self.device), attention_mask=mask, past_key_values=cache,
                         use_cache=True)

    def _run(self, logits_to_keep: int | Tensor, **inputs) -> ForwardOutput:
        """One forward of the model with `inputs` (its keyword arguments), every hidden state recorded, the logits
        of `logits_to_keep` (transformers' meaning)."""
        out = self.model(output_hidden_states=True, logits_to_keep=logits_to_keep, **inputs)
        # Under a device map the last layers may run on another GPU than the first: hand every
        # stage its rows on the runner's device (a no-op for a model on one device).
        return ForwardOutput(out.logits[0].float().to(self.device), out.hidden_states[-1][0].to(self.device),
                             aux_hidden=self._aux_hidden(out.hidden_states))  # gathered on self.device there
