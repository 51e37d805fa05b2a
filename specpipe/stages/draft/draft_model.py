"""A smaller causal LM drafts for the target: a chain (SpS) through `propose`, or, as a
StepDrafter, any tree a tree builder grows frontier by frontier (`tree=eagle2`).
The draft keeps its own KV cache per request. It is never rolled back token by token: at the
start of each step the cache is cut back to the committed text it had fed, and whatever was
committed since (the accepted path and the bonus token) is fed in one causal
forward. Tree nodes fed while drafting sit after the committed entries, each attending to the
committed text and its own ancestors (an explicit mask), and are dropped by that same cut. The draft
is loaded by specpipe.stages.draft.draft_checkpoint; its reduced output layer is specpipe.stages.draft.reduced_vocab's.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.cost import CostCurve
from specpipe.engine.draft_level import DraftRows, KernelDraftLevel, fill_the_rest
from specpipe.engine.lean_model import LeanLlamaModel
from specpipe.engine.quantize import checked_quantization
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.sampling import sample, target_probs
from specpipe.stages.base import StageResources, StepDrafter, draft_token_ids, to_full_vocab
from specpipe.stages.draft.draft_checkpoint import load_draft_model
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead, head_logprobs, reduce_vocabulary
from specpipe.target import ForwardOutput, TargetModel
from specpipe.types import DecodeState, DraftTree, Proposal, VerifyResult

ROOT = -1  # the frontier id of the root: the last committed token


def causal_rows(cached: int, q: int) -> Tensor:
    """[q, cached + q] bool: q new rows that see every cached row, then each other causally."""
    mask = torch.ones(q, cached + q, dtype=torch.bool)
    mask[:, cached:] = torch.ones(q, q, dtype=torch.bool).tril()
    return mask


def unfed_ancestors_first(nodes: list[int], parents: list[int], fed) -> list[int]:
    """Every node of `nodes` not in `fed`, with its ancestors not in `fed`, parents before children."""
    order: list[int] = []
    for node in nodes:
        path = []
        walk = node
        while walk != ROOT and walk not in fed and walk not in order and walk not in path:
            path.append(walk)
            walk = parents[walk]
        order.extend(reversed(path))
    return order


def tree_rows(nodes: list[int], parents: list[int], slots: dict[int, int], committed: int,
              cached: int, unfed: int = 0) -> tuple[Tensor, Tensor]:
    """Mask [q, cached + q] bool and positions [q] of tree nodes fed as q new rows after `cached`
    cache rows: each sees the `committed` cache rows (the root is the last, at position
    committed + unfed - 1, where `unfed` committed positions never got a row), its ancestors' rows
    and its own (`slots`: node -> cache row, the new nodes included)."""
    q = len(nodes)
    # built in numpy: torch's indexed assignments cost ~15 us each, an eighth of a draft level of 8 rows
    mask = np.zeros((q, cached + q), dtype=bool)
    mask[:, :committed] = True
    rows, columns, depths = [], [], []
    for row, node in enumerate(nodes):
        path = path_to(node, parents)
        rows.extend([row] * len(path))
        columns.extend(slots[walk] for walk in path)
        depths.append(committed + unfed - 1 + len(path))
    mask[rows, columns] = True
    return torch.from_numpy(mask), torch.tensor(depths, dtype=torch.long)


def path_to(node: int, parents: list[int]) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root itself): its depth is the length."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


@dataclass
class DraftSession:
    """One request's draft cache: entries for the request's first `synced` tokens (root included;
    a request's committed tokens only ever grow), then one entry per fed tree node of this step."""

    cache: PositionIndexedCache
    synced: int = 0
    root_logprobs: Tensor | None = None  # [vocab] the draft's next-token log-probs after the root
    slots: dict[int, int] = field(default_factory=dict)  # tree node id -> cache row, this step
    logprobs: dict[int, Tensor] = field(default_factory=dict)  # tree node id -> [vocab] after it, this step


class DraftModelDrafter(StepDrafter):
    """Drafts with `draft` (a causal LM sharing the target's tokenizer).

    `propose` returns one chain of up to `chain_length` tokens scored by the draft's own cumulative
    probability (speculative sampling's draft, for `tree=trie`): greedy, or under temperature > 0
    sampled from the draft's distribution warped as the target's is, which it hands to the
    verifier. `step` gives the tree builder (`tree=eagle2`) the draft's distributions after
    any tree nodes; the builder picks or samples the children.
    """

    def __init__(self, target: TargetModel, tokenizer: PreTrainedTokenizerBase, draft: PreTrainedModel,
                 draft_tokenizer: PreTrainedTokenizerBase | None = None, name: str = "draft_model",
                 chain_length: int = 5, min_score: float = 0.05,
                 new_cache: Callable[[], PositionIndexedCache] | None = None,
                 weight_quantization: str | None = None) -> None:
        if chain_length < 1:
            raise ConfigError(f"{name}: chain_length must be >= 1, got {chain_length}")
        draft_vocab = int(draft.config.vocab_size)
        if draft_vocab != target.vocab_size:
            raise ConfigError(f"{name}: the draft model's vocabulary has {draft_vocab} entries and the target's "
                              f"{target.vocab_size}: a drafter must share the target's tokenizer")
        self.name = name
        self.tokenizer = draft_tokenizer or tokenizer  # the builder checks it against the target's
        self.chain_length = chain_length
        self.min_score = min_score  # a chain stops once the draft's own probability of it falls below
        # The draft runs through the same runner as the target (tree masks through the attention
        # plug-in point, a position-indexed cache), on CPU always SDPA.
        self.runner = TargetModel(draft, name=f"{target.name}-{name}-{_shape_name(draft)}", attention="sdpa",
                                  engine=getattr(draft, "specpipe_engine", "hf"))
        self.cost_curve: CostCurve | None = None  # ms per draft forward of q rows; set by the pipeline builder
        # "int8", or "auto" where the engine's CPU kernel serves: the pipeline builder has the engine run the
        # draft's own products over int8 weights (specpipe.engine.quantize); layers shared with the target stay its
        self.weight_quantization = checked_quantization(weight_quantization, name)
        self.vocab_size = target.vocab_size
        # A reduced output layer hands out log-probs over its own tokens only (StepDrafter's `draft_vocab`):
        # no -inf scatter, log-softmax and top-k over all 49152 columns per draft level.
        head = draft.get_output_embeddings()
        self.draft_vocab: Tensor | None = head.target_ids if hasattr(head, "reduced_logits") else None  # [k]
        if new_cache is not None:  # a draft with its own cache layout (layer_skip); measuring its cost uses it too
            self.runner.new_cache = new_cache
        self.new_cache = self.runner.new_cache
        self.cost_runner = DraftLevelRunner(self)  # what the pipeline builder measures the cost curve on

    def resources(self) -> StageResources:
        return StageResources(tokenizer=self.tokenizer, draft_model=self.runner.model,
                              weight_quantization=self.weight_quantization, cost_runner=self.cost_runner)

    # ---- Proposer ---------------------------------------------------------------------------
    def reset(self, state: DecodeState) -> None:
        state.stage_state[self] = DraftSession(self.new_cache())

    def propose(self, state: DecodeState) -> Proposal:
        logprobs = self.start(state)  # [vocab]
        sampled = not state.sampling.greedy
        tokens: list[int] = []
        scores: list[float] = []
        draft_probs: list[Tensor] = []  # [vocab] per sampled node
        cumulative = 1.0
        for depth in range(self.chain_length):
            if sampled:
                # Whether to draw one more is decided before drawing it: a node kept or dropped for
                # its own token would bias the drafts the verifier tests (and so the output).
                full = to_full_vocab(logprobs[None], self.draft_vocab, self.vocab_size)  # [1, vocab]
                probs = target_probs(full, state.sampling)[0]  # [vocab]
                if cumulative * float(probs.max()) < self.min_score:
                    break
                token = sample(probs, state.rng)
                draft_probs.append(probs)
                cumulative *= float(probs[token])
            else:
                column = logprobs.argmax()  # over draft_vocab's columns, or the token itself
                if cumulative * math.exp(float(logprobs[column])) < self.min_score:
                    break
                cumulative *= math.exp(float(logprobs[column]))
                token = int(draft_token_ids(column, self.draft_vocab))
            tokens.append(token)
            scores.append(cumulative)
            if depth + 1 < self.chain_length:
                self._feed(state, tokens, list(range(-1, depth)), [depth])
                logprobs = state.stage_state[self].logprobs[depth]
        chain = Proposal.chain(tokens, scores, self.name)
        if sampled:
            empty = logprobs.new_empty(0, logprobs.shape[-1], dtype=torch.float32)
            chain = dataclasses.replace(chain, draft_probs=torch.stack(draft_probs) if draft_probs else empty)
        return chain

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        pass  # the next step's `start` cuts the cache back to the committed text

    def on_finish(self, state: DecodeState) -> None:
        state.stage_state.pop(self, None)  # free the draft cache with the request

    # ---- StepDrafter ------------------------------------------------------------------------
    def start(self, state: DecodeState) -> Tensor:
        """Syncs the draft cache with the committed tokens; returns log-probs [vocab] after the root."""
        return self.start_many([state])[0]

    def start_many(self, states: list[DecodeState]) -> list[Tensor]:
        """`start` for the sequences of a batch: their new committed tokens fed in one forward of the draft."""
        feeds = []
        for state in states:
            session: DraftSession = state.stage_state[self]
            tokens = state.tokens
            if session.synced == len(tokens) and session.root_logprobs is not None:
                session.cache.crop(session.synced)  # only this step's tree entries go
            else:
                shared = min(session.synced, len(tokens) - 1)  # the root is always fed again: its log-probs are needed
                session.cache.crop(shared)
                new = torch.tensor(tokens[shared:], dtype=torch.long)  # [q]
                q = int(new.shape[0])
                # only the root's row is read: a prompt's rows through the output layer would cost a third of
                # the draft's prefill
                feeds.append((session, (new, torch.arange(shared, shared + q), causal_rows(shared, q),
                                        session.cache, 1)))
            session.synced = len(tokens)
            session.slots, session.logprobs = {}, {}
        for (session, _), logprobs in zip(feeds, self._levels([feed for _, feed in feeds])):
            session.root_logprobs = logprobs[-1]
        return [state.stage_state[self].root_logprobs for state in states]

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """The draft's next-token log-probs [m, vocab] after each frontier node.

        `tokens`/`parents` are the whole tree so far (node ids in order, parents before children,
        -1 = the root); `frontier` [m] the node ids to expand (ROOT for the root). `start` must
        have run this step; nodes are fed to the draft cache once, when first expanded (their
        ancestors too, if the builder never expanded them).
        """
        return self.step_many([(state, tokens, parents, frontier)])[0]

    def step_many(self, calls: list[tuple[DecodeState, list[int], list[int], list[int]]]) -> list[Tensor]:
        """`step` for the sequences of a batch: every sequence's unfed nodes in one forward of the draft."""
        sessions, feeds = [], []
        for state, tokens, parents, frontier in calls:
            session: DraftSession = state.stage_state[self]
            sessions.append(session)
            order, feed = self._rows_to_feed(session, tokens, parents, [node for node in frontier if node != ROOT])
            if order:
                feeds.append((session, order, feed))
        for (session, order, _), logprobs in zip(feeds, self._levels([feed for _, _, feed in feeds])):
            for row, node in enumerate(order):
                session.logprobs[node] = logprobs[row]
        return [torch.stack([session.root_logprobs if node == ROOT else session.logprobs[node] for node in frontier])
                for session, (_, _, _, frontier) in zip(sessions, calls)]  # [m, vocab] each

    def _feed(self, state: DecodeState, tokens: list[int], parents: list[int], nodes: list[int]) -> None:
        """Feeds every node of `nodes` not fed yet this step, and its unfed ancestors, through the
        draft in one forward: each row attends to the committed text, its ancestors and itself."""
        session: DraftSession = state.stage_state[self]
        order, feed = self._rows_to_feed(session, tokens, parents, nodes)
        if order:
            logprobs = self._forward_logprobs(*feed)  # [q, vocab or k]
            for row, node in enumerate(order):
                session.logprobs[node] = logprobs[row]

    @staticmethod
    def _rows_to_feed(session: DraftSession, tokens: list[int], parents: list[int], nodes: list[int]
                      ) -> tuple[list[int], tuple | None]:
        """The nodes of `nodes` not fed yet this step, with their unfed ancestors first, given their cache rows;
        and their forward's arguments (input_ids, positions, mask, cache, rows) as `_forward_logprobs` takes them."""
        order = unfed_ancestors_first(nodes, parents, session.slots)
        if not order:
            return order, None
        cached = session.cache.get_seq_length()
        for row, node in enumerate(order):
            session.slots[node] = cached + row
        mask, positions = tree_rows(order, parents, session.slots, session.synced, cached)  # [q, kv], [q]
        input_ids = torch.tensor([tokens[node] for node in order], dtype=torch.long)  # [q]
        return order, (input_ids, positions, mask, session.cache, len(order))

    def _levels(self, feeds: list[tuple[Tensor, Tensor, Tensor, PositionIndexedCache, int]]) -> list[Tensor]:
        """`_forward_logprobs` of each feed; several feeds over plain caches in as few calls of the kernel's level as
        its row limit allows where the engine gave the draft's level one (KernelDraftLevel.in_groups), the others in
        one forward of the draft, each row attending its own cache (TargetModel.forward_rows)."""
        if len(feeds) <= 1 or any(type(feed[3]) is not PositionIndexedCache for feed in feeds):
            return [self._forward_logprobs(*feed) for feed in feeds]  # a layer subset's cache lays rows out its way
        level = self._kernel_level()
        out: list[Tensor | None] = [None] * len(feeds)
        if level is not None:
            with torch.inference_mode():
                done = level.in_groups([(ids, None, positions, DraftRows(int(ids.shape[0]), mask, cache, rows))
                                        for ids, positions, mask, cache, rows in feeds])
            out = [result[1] if result is not None else None for result in done]
        return fill_the_rest(out, feeds, lambda feed: self._forward_logprobs(*feed), self._ragged_logprobs)

    def _ragged_logprobs(self, feeds: list[tuple[Tensor, Tensor, Tensor, PositionIndexedCache, int]]) -> list[Tensor]:
        """Several feeds in one forward of the draft, each row attending its own cache."""
        reduced = self._reduced_head()
        wanted, start = [], 0
        for input_ids, _, _, _, rows in feeds:  # each feed's last `rows` rows
            q = int(input_ids.shape[0])
            wanted.extend(range(start + q - rows, start + q))
            start += q
        outputs = self.runner.forward_rows([(ids, positions, mask, cache) for ids, positions, mask, cache, _ in feeds],
                                           logits_rows=self._logits_rows(reduced, wanted))
        return [self._logprobs(out, reduced, int(feed[0].shape[0]) - feed[4]) for out, feed in zip(outputs, feeds)]

    def _forward_logprobs(self, input_ids: Tensor, positions: Tensor, mask: Tensor, cache: PositionIndexedCache,
                          rows: int) -> Tensor:
        """One draft forward of q rows (input_ids, positions [q], mask [q, cache + q] bool) -> the log-probs [rows,
        vocab] (or [rows, k] over `draft_vocab`) after its last `rows` rows: in one kernel call where the engine gave
        the draft's level one (KernelDraftLevel), else through the runner."""
        q = int(input_ids.shape[0])
        level = self._kernel_level()
        if level is not None and level.serves(q, rows, cache):
            with torch.inference_mode():
                done = level(input_ids, None, positions, mask, cache, rows)
            if done is not None:
                return done[1]
        reduced = self._reduced_head()
        out = self.runner.forward_masked(input_ids, positions, mask, cache,
                                         logits_rows=self._logits_rows(reduced, None if rows == q else
                                                                       list(range(q - rows, q))))
        return self._logprobs(out, reduced, q - rows)

    def _kernel_level(self) -> KernelDraftLevel | None:
        """The draft's whole level in one kernel call where the engine serves it: a bf16 Llama draft on the CPU whose
        layers and output layer run over column blocks (made once per kernel and output layer)."""
        draft = self.runner.model
        model = getattr(draft, "model", None)
        kernel = getattr(model, "level_kernel", None)
        reduced = self._reduced_head()
        head = getattr(reduced, "linear", None) if reduced is not None else draft.get_output_embeddings()
        made = self.__dict__.get("_made_kernel_level")
        if made is None or made[0] is not kernel or made[1] is not head:
            level = None
            if kernel is not None and type(model) is LeanLlamaModel and self.runner.device.type == "cpu":
                level = KernelDraftLevel.of(kernel, model.layers[: model.config.num_hidden_layers], None, head,
                                            model.embed_tokens, model.rotary_lookup, final_norm=model.norm)
            made = (kernel, head, level)
            self.__dict__["_made_kernel_level"] = made
        return made[2]

    def _reduced_head(self) -> nn.Module | None:
        """The draft's reduced output layer where it hands out log-probs over `draft_vocab`, else None
        (read each forward: the engine may have rewritten the layer since, `draft_vocab` set to None)."""
        head = self.runner.model.get_output_embeddings()
        return head if self.draft_vocab is not None and hasattr(head, "reduced_logits") else None

    @staticmethod
    def _logits_rows(reduced: nn.Module | None, rows: list[int] | None) -> Tensor | None:
        """The rows whose full-vocabulary logits the forward computes: none where the reduced layer
        scores the hidden states itself, else `rows` (None = all)."""
        if reduced is not None:
            return torch.empty(0, dtype=torch.long)
        return None if rows is None else torch.tensor(rows, dtype=torch.long)

    @staticmethod
    def _logprobs(out: ForwardOutput, reduced: nn.Module | None, first_row: int) -> Tensor:
        """Log-probs [r, k] over the reduced layer's tokens for the hidden rows from `first_row` on, or
        [r, vocab] from the logits the forward computed."""
        if reduced is not None:
            return head_logprobs(reduced, out.hidden[first_row:], reduced=True)
        return torch.log_softmax(out.logits, dim=-1)


class DraftLevelRunner:
    """A draft forward as the cost-curve measurement sees a model (`new_cache`, `prefill`, `forward_tree`), run the
    way the drafter runs its levels (`_forward_logprobs`: in one kernel call where the engine serves it, its log-probs
    over the draft vocabulary): the curve prices what a level costs the tree builder. Measured through the model's
    runner instead, a level would be priced at the op-by-op forward's cost, about twice the kernel call's."""

    def __init__(self, drafter: DraftModelDrafter) -> None:
        self.drafter = drafter
        runner = drafter.runner
        self.name, self.model = runner.name, runner.model
        self.attn_implementation, self.vocab_size = runner.attn_implementation, runner.vocab_size
        self.dtype, self.device = runner.dtype, runner.device

    @property
    def engine(self) -> str:  # the engine rewrites the draft after the drafter is made
        return getattr(self.model, "specpipe_engine", "hf")

    def new_cache(self) -> PositionIndexedCache:
        return self.drafter.new_cache()

    def prefill(self, prompt: list[int], cache: PositionIndexedCache) -> None:
        q = len(prompt)
        self.drafter._forward_logprobs(torch.tensor(prompt), torch.arange(q), causal_rows(0, q), cache, rows=1)

    def forward_tree(self, root_token: int, tree: DraftTree, cache: PositionIndexedCache) -> Tensor:
        tokens, positions, mask = root_and_tree_rows(root_token, tree, cache.get_seq_length())
        return self.drafter._forward_logprobs(tokens, positions, mask, cache, rows=int(tokens.shape[0]))


def root_and_tree_rows(root_token: int, tree: DraftTree, committed: int) -> tuple[Tensor, Tensor, Tensor]:
    """A draft forward over the root then every node of `tree` after `committed` cache rows (a cost curve's sample):
    tokens [q], positions [q] and mask [q, committed + q] bool, q = 1 + len(tree)."""
    q = 1 + len(tree)
    mask = torch.zeros(q, committed + q, dtype=torch.bool)  # [q, kv]
    mask[:, :committed + 1] = True
    mask[1:, committed + 1:] = tree.mask
    tokens = torch.cat([torch.tensor([root_token]), tree.tokens])  # [q]
    positions = torch.cat([torch.tensor([committed]), tree.depth + committed + 1])  # [q]
    return tokens, positions, mask


def _shape_name(draft: PreTrainedModel) -> str:
    """Layers and output width, which set a draft forward's cost (its cost curve is cached by name)."""
    layers = len(getattr(getattr(draft, "model", draft), "layers", ()))
    head = draft.get_output_embeddings()
    width = int(head.ids.shape[0]) if isinstance(head, ReducedVocabHead) else int(draft.config.vocab_size)
    return f"{layers}L{width}V"


def load_drafter(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None = None,
                 name: str = "draft_model", chain_length: int = 5,
                 min_score: float = 0.05, vocab_top_k: int = 0,
                 vocab_counts: str | None = None, weight_quantization: str | None = None) -> DraftModelDrafter:
    """The drafter `drafter=draft_model` configures: `path` = a local Hugging Face model directory
    (any causal LM with the target's tokenizer), a draft file written by `task=distill_draft`, or
    None for the draft distilled for the embedded model (data/draft/). Never downloads.

    `vocab_top_k` > 0 drafts over that many most frequent tokens only (ReducedVocabHead), counted
    in `vocab_counts` (a Parquet of the target's answers); None = the ranking pinned beside the draft
    (`pinned_vocab_path`), else the shipped chat corpus when it is this tokenizer's, else the full
    vocabulary (logged)."""
    draft, draft_tokenizer, pinned = load_draft_model(target, tokenizer, path, name)
    reduce_vocabulary(draft, tokenizer, vocab_top_k, vocab_counts, name, pinned)
    return DraftModelDrafter(target, tokenizer, draft, draft_tokenizer, name=name, chain_length=chain_length,
                             min_score=min_score, weight_quantization=weight_quantization)
