"""EAGLE-1 as a drafter stage (Li et al. 2024): `EagleDrafter`, the StepDrafter (and Proposer) the pipeline
runs over an EAGLE head (specpipe.stages.draft.eagle_net), its per-request state, and `load_eagle`, which
`drafter=eagle` configures (the checkpoint reading is specpipe.stages.draft.eagle_checkpoint's). Per request
the draft keeps its own KV cache with one row per committed position. The target's features arrive with the
prompt's prefill (`DecodeState.prompt_hidden`) and with every verify forward (`VerifyResult.hidden`: the
root's and the accepted nodes' rows); they are fed in one causal forward at the start of the next step. Tree
nodes have no target feature yet: a node's row reads the feature the draft predicted at its parent, attends
to the committed rows, its ancestors and itself, and is dropped when the next step cuts the cache back to the
committed rows. `output_head` (the target's output layer, or one over its most frequent tokens) is shared
with the Medusa drafter.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.cost import CostCurve
from specpipe.engine.draft_level import DraftRows, KernelDraftLevel, fill_the_rest
from specpipe.engine.quantize import checked_quantization
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.stages.base import StageResources, StepDrafter, draft_token_ids
from specpipe.stages.draft.draft_model import causal_rows, root_and_tree_rows, tree_rows, unfed_ancestors_first
from specpipe.stages.draft.draft_vocab import pinned_vocab_path
from specpipe.stages.draft.eagle_checkpoint import default_eagle_dir, read_eagle_net
from specpipe.stages.draft.eagle_net import EagleNet
from specpipe.stages.draft.head_checkpoint import head_folder
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead, head_logprobs, output_weight, reduced_ids
from specpipe.target import RaggedBatch, TargetModel
from specpipe.types import DecodeState, DraftTree, Proposal, VerifyResult

log = logging.getLogger(__name__)
ROOT = -1


@dataclass
class EagleSession:
    """One request's draft cache: rows for positions 0..synced-1 (committed), then this step's
    tree nodes. `pending_*` are committed rows whose target features came in but were not fed."""

    cache: PositionIndexedCache
    synced: int = 0
    unfed: int = 0  # committed positions that never got a cache row (`context_rows`); the rest have one each
    rows: int = 0  # committed rows accounted for: synced + pending
    pending_features: list[Tensor] = field(default_factory=list)  # [k, hidden] each
    pending_tokens: list[int] = field(default_factory=list)
    root_feature: Tensor | None = None  # [hidden] the draft's predicted feature at the root
    root_logprobs: Tensor | None = None  # [vocab]
    slots: dict[int, int] = field(default_factory=dict)  # tree node id -> cache row, this step
    features: dict[int, Tensor] = field(default_factory=dict)  # node -> predicted feature at it [hidden]
    logprobs: dict[int, Tensor] = field(default_factory=dict)  # node -> [vocab] after it


class _Rows(NamedTuple):
    """One request's rows of a draft level, as `EagleDrafter._level` takes them."""

    features: Tensor  # [q, hidden]
    tokens: Tensor  # [q] int64
    positions: Tensor  # [q] int64
    mask: Tensor  # [q, kv] bool over the cache's rows then these
    cache: PositionIndexedCache
    logprob_rows: int  # log-probs of the last rows wanted


class EagleDrafter(StepDrafter):
    """EAGLE-1 as a StepDrafter (`pipeline.drafters`, grown by `tree=eagle2`), or one greedy chain
    per step as a Proposer (`pipeline.proposers`, `tree=trie`)."""

    def __init__(self, target: TargetModel, net: nn.Module, head: nn.Module, name: str = "eagle",
                 chain_length: int = 5, min_score: float = 0.05, aux_hidden: bool = False,
                 context_rows: int | None = None, weight_quantization: str | None = None) -> None:
        if chain_length < 1:
            raise ConfigError(f"{name}: chain_length must be >= 1, got {chain_length}")
        if context_rows is not None and context_rows < 1:
            raise ConfigError(f"{name}: context_rows must be >= 1 (or null: feed every committed row), got {context_rows}")
        self.name = name
        self.target = target
        self.net = net.to(device=target.device, dtype=target.dtype).eval()
        self.embed = target.model.get_input_embeddings()  # the target's own, frozen
        self.head = head  # the target's output layer, or a ReducedVocabHead over its weights
        # The pipeline builder runs the draft's own output layer under the target's engine (the
        # target's output layer already is).
        self.engine_modules = (head,) if isinstance(head, ReducedVocabHead) else ()
        # A head over a reduced vocabulary hands out log-probs over its own tokens only (StepDrafter's
        # `draft_vocab`): a top-k over 8192 columns instead of all 49152 saves ~0.5 ms per draft level.
        self.draft_vocab: Tensor | None = head.target_ids if hasattr(head, "reduced_logits") else None  # [k]
        self.chain_length = chain_length
        self.min_score = min_score
        # Committed rows read the target's last hidden states (EAGLE-1), or with `aux_hidden` the
        # layers the target runner captures for the head (EAGLE-3, specpipe.stages.draft.eagle3).
        self.aux_hidden = aux_hidden
        # At most this many committed rows are fed at once: a long prompt's last ones, or the last ones of
        # the steps a drafter gate skipped. The older ones never get a row and the head never attends to them.
        self.context_rows = context_rows
        # "int8", or "auto" where the engine's CPU kernel serves: the pipeline builder has the engine run the
        # head's products over int8 weights (specpipe.engine.quantize), half the bytes a draft level reads
        self.weight_quantization = checked_quantization(weight_quantization, name)
        self.runner = EagleRunner(self)  # what the pipeline builder measures a cost curve on
        self.cost_curve: CostCurve | None = None

    def resources(self) -> StageResources:
        return StageResources(draft_model=self.runner.model, engine_modules=self.engine_modules,
                              weight_quantization=self.weight_quantization, cost_runner=self.runner)

    # ---- Proposer ---------------------------------------------------------------------------
    def reset(self, state: DecodeState) -> None:
        features = state.prompt_aux_hidden if self.aux_hidden else state.prompt_hidden
        if features is None:
            field_name = "prompt_aux_hidden" if self.aux_hidden else "prompt_hidden"
            raise ConfigError(f"{self.name}: the decoder gave no prompt features (DecodeState.{field_name}); "
                              f"an EAGLE head drafts from the target's own hidden states")
        session = EagleSession(PositionIndexedCache())
        session.rows = min(state.prompt_length, len(state.tokens) - 1)  # the root has no feature yet
        session.pending_features.append(features[:session.rows])  # rows 0..rows-1
        session.pending_tokens.extend(state.tokens[1:session.rows + 1])
        state.stage_state[self] = session

    def propose(self, state: DecodeState) -> Proposal:
        logprobs = self.start(state)
        tokens: list[int] = []
        scores: list[float] = []
        cumulative = 1.0
        for depth in range(self.chain_length):
            column = logprobs.argmax()
            cumulative *= math.exp(float(logprobs[column]))
            if cumulative < self.min_score:
                break
            tokens.append(int(draft_token_ids(column, self.draft_vocab)))
            scores.append(cumulative)
            if depth + 1 < self.chain_length:
                logprobs = self.step(state, tokens, list(range(-1, depth)), [depth])[0]
        return Proposal.chain(tokens, scores, self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        session: EagleSession = state.stage_state[self]
        hidden = result.aux_hidden if self.aux_hidden else result.hidden
        if hidden is None:
            raise ConfigError(f"{self.name}: the verify step gave no hidden states; an EAGLE head needs them")
        new = len(state.tokens) - 1 - session.rows  # committed rows this step: the root, then each kept node
        kept = [0] + [node + 1 for node in result.accepted[: new - 1]]  # rows of the verify forward
        session.pending_features.append(hidden[kept])  # [new, hidden] ([new, 3 * hidden] with aux_hidden)
        session.pending_tokens.extend(state.tokens[-new:])
        session.rows += new

    def on_finish(self, state: DecodeState) -> None:
        state.stage_state.pop(self, None)

    # ---- StepDrafter ------------------------------------------------------------------------
    def start(self, state: DecodeState) -> Tensor:
        """Feeds the committed rows not fed yet; returns the draft's log-probs [vocab] after the root
        ([k] over `draft_vocab` where the head scores a reduced vocabulary, as `step`'s rows)."""
        return self.start_many([state])[0]

    def start_many(self, states: list[DecodeState]) -> list[Tensor]:
        """`start` for the sequences of a batch: their committed rows fed in one forward of the head."""
        sessions: list[EagleSession] = [state.stage_state[self] for state in states]
        feeds, fed = [], []
        for session in sessions:
            committed_rows = session.synced - session.unfed
            session.cache.crop(committed_rows)  # this step's tree rows go
            if session.pending_tokens:
                q = len(session.pending_tokens)
                unfed = q - min(q, self.context_rows or q)  # the oldest pending rows, beyond `context_rows`
                features = torch.cat(session.pending_features)[unfed:].to(self.target.dtype)  # [q - unfed, hidden]
                tokens = torch.tensor(session.pending_tokens[unfed:], dtype=torch.long)  # [q - unfed]
                feeds.append(_Rows(features, tokens, torch.arange(session.synced + unfed, session.synced + q),
                                   causal_rows(committed_rows, q - unfed), session.cache, 1))
                fed.append((session, q, unfed))
            session.slots, session.features, session.logprobs = {}, {}, {}
        for (session, q, unfed), (predicted, logprobs) in zip(fed, self._levels(feeds)):
            session.root_feature = predicted[-1]
            session.root_logprobs = logprobs[0]
            session.synced += q
            session.unfed += unfed
            session.pending_features, session.pending_tokens = [], []
        return [session.root_logprobs for session in sessions]

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """The draft's log-probs [m, vocab] after each frontier node (ROOT = the root). Nodes are fed
        once, when first expanded, with their unfed ancestors first."""
        session: EagleSession = state.stage_state[self]
        unfed = unfed_ancestors_first(frontier, parents, session.slots)
        while unfed:  # a node's input is its parent's predicted feature: feed level by level
            ready = [node for node in unfed if parents[node] == ROOT or parents[node] in session.features]
            fed = self._feed([(session, tokens, parents, ready)])[0]
            if ready == frontier:  # the usual level: the frontier is the nodes just fed, in their order
                return fed
            unfed = [node for node in unfed if node not in session.features]
        return torch.stack([session.root_logprobs if node == ROOT else session.logprobs[node]
                            for node in frontier])  # [m, vocab]

    def step_many(self, calls: list[tuple[DecodeState, list[int], list[int], list[int]]]) -> list[Tensor]:
        """`step` for the sequences of a batch: where each call's frontier is the nodes to feed next (the usual
        level), one forward of the head for all of them; any other call alone."""
        results: list[Tensor | None] = [None] * len(calls)
        together = []
        for index, (state, tokens, parents, frontier) in enumerate(calls):
            session: EagleSession = state.stage_state[self]
            unfed = unfed_ancestors_first(frontier, parents, session.slots)
            if unfed and unfed == frontier and all(parents[node] == ROOT or parents[node] in session.features
                                                   for node in frontier):
                together.append((index, (session, tokens, parents, frontier)))
            else:
                results[index] = self.step(state, tokens, parents, frontier)
        for (index, _), logprobs in zip(together, self._feed([call for _, call in together])):
            results[index] = logprobs
        return results

    def _feed(self, calls: list[tuple[EagleSession, list[int], list[int], list[int]]]) -> list[Tensor]:
        """Feeds each call's `nodes` (their parents fed) as one level of the head, all calls in one forward;
        returns their log-probs [len(nodes), vocab] per call."""
        feeds = []
        for session, tokens, parents, nodes in calls:
            cached = session.cache.get_seq_length()
            for row, node in enumerate(nodes):
                session.slots[node] = cached + row
            mask, positions = tree_rows(nodes, parents, session.slots, session.synced - session.unfed, cached,
                                        session.unfed)  # [q, kv], [q]
            features = torch.stack([session.root_feature if parents[node] == ROOT else session.features[parents[node]]
                                    for node in nodes])  # [q, hidden]
            ids = torch.tensor([tokens[node] for node in nodes], dtype=torch.long)  # [q]
            feeds.append(_Rows(features, ids, positions, mask, session.cache, len(nodes)))
        out = []
        for (session, _, _, nodes), (predicted, logprobs) in zip(calls, self._levels(feeds)):
            for row, node in enumerate(nodes):  # [q, hidden], [q, vocab]
                session.features[node] = predicted[row]
                session.logprobs[node] = logprobs[row]
            out.append(logprobs)
        return out

    @torch.inference_mode()
    def _levels(self, feeds: list["_Rows"]) -> list[tuple[Tensor, Tensor]]:
        """One draft level of each feed's rows (one request's, over its own cache): (predicted features [q, hidden],
        log-probs [logprob_rows, vocab] of its last rows) each. A lone feed runs as `_level`; several, in as few kernel
        calls as the kernel's row limit allows where the engine gave the head's level one (KernelDraftLevel.in_groups),
        else in one forward of the head whose rows attend each its own cache (specpipe.target.RaggedBatch)."""
        if len(feeds) <= 1:
            return [self._level(*feed) for feed in feeds]
        level = self._kernel_level()
        if level is not None and all(feed.features.dtype == torch.bfloat16 for feed in feeds):
            out = level.in_groups([(feed.tokens, feed.features, feed.positions,
                                    DraftRows(len(feed.tokens), feed.mask, feed.cache, feed.logprob_rows))
                                   for feed in feeds])
        else:
            out = [None] * len(feeds)
        return fill_the_rest(out, feeds, lambda feed: self._level(*feed), self._ragged_level)

    def _ragged_level(self, feeds: list["_Rows"]) -> list[tuple[Tensor, Tensor]]:
        """Several feeds' level op by op, in one forward of the head whose rows attend each its own cache."""
        device = self.target.device
        ragged = RaggedBatch([feed.cache for feed in feeds], [len(feed.tokens) for feed in feeds],
                             [feed.mask for feed in feeds])
        embeds = self.embed(torch.cat([feed.tokens for feed in feeds]).to(device))  # [R, hidden]
        features = torch.cat([feed.features for feed in feeds]).to(device)  # [R, hidden]
        positions = torch.cat([feed.positions for feed in feeds]).to(device)  # [R]
        predicted = self.net.rows(embeds[None], features[None], positions[None], None, None,
                                  ragged_batch=ragged)[0]  # [R, hidden]
        last = torch.cat([torch.arange(end - feed.logprob_rows, end)
                          for feed, end in zip(feeds, ragged.starts[1:])])  # each feed's last rows
        logprobs = self._logprobs(predicted[last.to(device)])
        out, row = [], 0
        for feed, start, end in zip(feeds, ragged.starts, ragged.starts[1:]):
            out.append((predicted[start:end], logprobs[row:row + feed.logprob_rows]))
            row += feed.logprob_rows
        return out

    @torch.inference_mode()
    def _level(self, features: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor, cache: PositionIndexedCache,
               logprob_rows: int) -> tuple[Tensor, Tensor]:
        """One draft forward of q rows (features [q, hidden], tokens [q], positions [q], mask [q, kv] as `_forward`
        takes them) -> (predicted features [q, hidden], log-probs [logprob_rows, vocab] of the last rows): in one
        kernel call where the engine gave the head's level one (KernelDraftLevel), else op by op."""
        level = self._kernel_level()
        if level is not None and level.serves(tokens.shape[0], logprob_rows, cache) and features.dtype == torch.bfloat16:
            done = level(tokens, features, positions, mask, cache, logprob_rows)
            if done is not None:
                return done
        predicted = self._forward(features, tokens, positions, mask, cache)
        return predicted, self._logprobs(predicted[-logprob_rows:])

    def _kernel_level(self) -> KernelDraftLevel | None:
        """The head's level in one kernel call where the engine serves it (made once per kernel the engine gave)."""
        net = self.net
        kernel = getattr(net, "level_kernel", None)
        made = self.__dict__.get("_made_kernel_level")
        if made is None or made[0] is not kernel:
            level = None
            if kernel is not None and type(net) is EagleNet and net.lean and self.target.device.type == "cpu":
                reduced = self.draft_vocab is not None
                level = KernelDraftLevel.of(kernel, net.layers, net.fc,
                                            getattr(self.head, "linear", None) if reduced else self.head, self.embed,
                                            net.rotary_lookup)
            made = (kernel, level)
            self.__dict__["_made_kernel_level"] = made
        return made[1]

    @torch.inference_mode()
    def _forward(self, features: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor,
                 cache: PositionIndexedCache) -> Tensor:
        device = self.target.device
        return self.net(self.embed(tokens.to(device)), features.to(device), positions.to(device), mask.to(device),
                        cache)

    @torch.inference_mode()
    def _logprobs(self, features: Tensor) -> Tensor:
        """features [q, hidden] -> log-probs [q, vocab], or [q, k] over `draft_vocab`."""
        return head_logprobs(self.head, features, reduced=self.draft_vocab is not None)


class EagleRunner:
    """The draft forward as the cost-curve measurement sees a model (`new_cache`, `prefill`,
    `forward_tree`): rows of the head plus its output layer, with zero features."""

    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter
        target = drafter.target
        layers = drafter.net.config.num_hidden_layers
        width = getattr(drafter.head, "width", target.vocab_size)  # the draft vocabulary the head scores
        kind = "eagle3" if drafter.aux_hidden else drafter.name
        self.name = f"{target.name}-{kind}-{layers}L{width}V"
        self.model = drafter.net
        self.engine = getattr(drafter.net, "specpipe_engine", "hf")
        self.attn_implementation = "sdpa"
        self.vocab_size = target.vocab_size
        self.dtype = target.dtype
        self.device = target.device

    def new_cache(self) -> PositionIndexedCache:
        return PositionIndexedCache()

    def prefill(self, prompt: list[int], cache: PositionIndexedCache) -> None:
        q = len(prompt)
        features = torch.zeros(q, self.drafter.net.config.hidden_size, dtype=self.dtype)
        self.drafter._level(features, torch.tensor(prompt), torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril(),
                            cache, logprob_rows=1)

    def forward_tree(self, root_token: int, tree: DraftTree, cache: PositionIndexedCache) -> Tensor:
        tokens, positions, mask = root_and_tree_rows(root_token, tree, cache.get_seq_length())
        q = int(tokens.shape[0])
        features = torch.zeros(q, self.drafter.net.config.hidden_size, dtype=self.dtype)
        return self.drafter._level(features, tokens, positions, mask, cache, logprob_rows=q)[1]


def frequent_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, vocab_top_k: int, vocab_counts: str | None,
                 name: str, pinned: Path | None = None) -> Tensor | None:
    """The `vocab_top_k` most frequent token ids (`reduced_ids`: counted in `vocab_counts`; None = the
    ranking `pinned` beside the head where it exists, else the shipped chat corpus where it is this
    tokenizer's, else None with a warning: the full vocabulary); None for 0."""
    if not vocab_top_k:
        return None
    found = reduced_ids(tokenizer, vocab_size, vocab_top_k, vocab_counts, pinned, name)
    if found is None:
        return None
    ids, coverage, source = found
    log.info("%s: drafting over the %d most frequent tokens of %s (%.1f%% of its tokens)", name, vocab_top_k,
             source, 100 * coverage)
    return ids


def output_head(target: TargetModel, tokenizer: PreTrainedTokenizerBase, vocab_top_k: int, vocab_counts: str | None,
                name: str, pinned: Path | None = None) -> nn.Module:
    """The target's output layer, or with `vocab_top_k` > 0 a ReducedVocabHead over its most frequent tokens."""
    model: PreTrainedModel = target.model
    ids = frequent_ids(tokenizer, target.vocab_size, vocab_top_k, vocab_counts, name, pinned)
    if ids is None:
        return model.get_output_embeddings()
    return ReducedVocabHead(output_weight(model, name), ids, target.vocab_size)


def load_eagle(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None = None,
               name: str = "eagle", chain_length: int = 5, min_score: float = 0.05, vocab_top_k: int = 8192,
               vocab_counts: str | None = None, context_rows: int | None = None,
               weight_quantization: str | None = None) -> EagleDrafter:
    """The drafter `drafter=eagle` configures: `path` = a local EAGLE-1 head directory, or None for
    the head trained for the embedded model (data/eagle/): the one trained on features in the
    target's dtype where one ships (`eagle_checkpoint.DTYPE_HEAD_SUFFIX`), else the fp32-trained one. Never
    downloads."""
    folder = head_folder(path, default_eagle_dir(target.dtype), name, "EAGLE head", "python run.py task=train_heads")
    net = read_eagle_net(folder, tokenizer, int(target.model.config.hidden_size), target.vocab_size, name)
    head = output_head(target, tokenizer, vocab_top_k, vocab_counts, name, pinned_vocab_path(folder))
    return EagleDrafter(target, net, head, name=name, chain_length=chain_length, min_score=min_score,
                        context_rows=context_rows, weight_quantization=weight_quantization)
