"""The stage protocols of one decoding step: Retrieve/Draft -> TreeBuild -> Verify -> Commit.

Everything the pipeline builder and the decoder use of a stage is declared here. A stage subclasses its
protocol (`class MyRetriever(Proposer)`) and inherits the documented defaults of what it does not override;
the builder and the decoder read nothing else. One stage object serves every sequence: per-sequence state
lives in `state.stage_state[stage]`, and what a step produced travels in what the stage returns.
docs/WRITING_A_STAGE.md walks through a stage written against this module alone.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from specpipe.types import DecodeState, DraftTree, Proposal, SamplingConfig, VerifyResult

if TYPE_CHECKING:
    from torch import nn
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from specpipe.kv_cache import PositionIndexedCache

# milliseconds of a forward of q query rows (specpipe.cost.CostCurve or OnlineCostCurve)
CostFunction = Callable[[int], float]


@dataclass(frozen=True)
class StageResources:
    """What a Retrieve/Draft stage brings that the pipeline builder fits to the target (`Proposer.resources`).
    The default, nothing, is right for a stage that only reads text."""

    # the stage's own tokenizer: refused unless it has the target's vocabulary (draft ids are verified as ids)
    tokenizer: PreTrainedTokenizerBase | None = None
    draft_model: nn.Module | None = None  # a model of its own: rewritten by the target's engine, as a drafter
    engine_modules: tuple[nn.Module, ...] = ()  # weights it runs outside that model (heads): rewritten too
    weight_quantization: str | None = None  # int8 for the weights above (engine.quantize), or None
    # what one draft level runs (`new_cache`, `prefill`, `forward_tree`, a name): the builder measures a
    # StepDrafter's `cost_curve` on it; None: drafting costs nothing the builder can measure
    cost_runner: object | None = None


@runtime_checkable
class Proposer(Protocol):
    """A Retrieve or Draft stage: proposes continuations of the committed text."""

    name: str

    def resources(self) -> StageResources:
        """What the builder must fit to the target once the stage is made (its own tokenizer, model, heads,
        cost runner). Default: nothing. A stage that needs the target or the tokenizer at run time takes them as
        constructor arguments `target` / `tokenizer` and is configured `_partial_: true`."""
        return StageResources()

    def reset(self, state: DecodeState) -> None:
        """A new sequence starts (the prompt is in `state.tokens`). Per-sequence state goes into
        `state.stage_state[self]`: one stage serves concurrent requests. Default: nothing."""

    def propose(self, state: DecodeState) -> Proposal: ...

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        """`state.tokens` now holds the newly committed tokens. A step may have skipped this stage's `propose`
        (and a lookahead branch's rows): a plain step of a batch under load (SpeculationGate); the stage must
        still learn what was committed, and nothing from a proposal it did not make. Default: nothing."""

    def on_finish(self, state: DecodeState) -> None:
        """The sequence is complete (`state.generated` is the whole answer). Default: nothing."""


@runtime_checkable
class StepDrafter(Proposer, Protocol):
    """A model drafter a tree builder can expand node by node (`pipeline.drafters`, `tree=eagle2`).

    Per step the builder calls `start` once, then `step` once per depth with the tree grown so
    far; nodes only ever get appended to that tree within a step.

    A drafter that drafts for the sequences of a batch in one forward overrides `start_many(states)` and
    `step_many(calls)` (calls: (state, tokens, parents, frontier) per sequence), giving per sequence what `start`
    and `step` give; the tree builder calls them through `start_each` / `step_each`. The defaults here call
    `start` / `step` once per sequence.
    """

    # ms per draft level of q rows: set by the pipeline builder, measured on `resources().cost_runner` (None
    # there: stays None, and the tree builder counts levels as free)
    cost_curve: CostFunction | None = None
    # A drafter that scores only part of the vocabulary sets this to the [k] target token ids of its columns:
    # `start` and `step` then return log-probs over those tokens only ([k], [m, k]; column j is token
    # draft_vocab[j]), sparing the builder a top-k over the whole vocabulary. None: they cover the whole vocabulary.
    draft_vocab: Tensor | None = None
    # Where the drafter's checkpoint was read, for the files that belong beside it (tree=static's calibrated
    # tree.json); None where it has no folder.
    folder: Path | None = None

    def start(self, state: DecodeState) -> Tensor:
        """Catches up with the committed tokens; returns the draft's log-probs [vocab] after the root."""

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """tokens, parents [n]: the tree so far (-1 = child of the root); frontier [m]: node ids to
        expand (-1 = the root). Returns the draft's next-token log-probs [m, vocab] after each
        frontier node; the tree builder takes the top children or samples them."""

    def start_many(self, states: list[DecodeState]) -> list[Tensor]:
        """`start` for each of `states`, in one draft forward where the drafter batches."""
        return [self.start(state) for state in states]

    def step_many(self, calls: list[tuple[DecodeState, list[int], list[int], list[int]]]) -> list[Tensor]:
        """`step(*call)` for each call (one per sequence), in one draft forward where the drafter batches."""
        return [self.step(*call) for call in calls]


def start_each(drafter: StepDrafter, states: list[DecodeState]) -> list[Tensor]:
    """`drafter.start` for the sequences of a batch: `start_many` for two or more (one draft forward where the
    drafter batches, the same results as one `start` each), `start` for one."""
    return drafter.start_many(states) if len(states) > 1 else [drafter.start(state) for state in states]


def step_each(drafter: StepDrafter, calls: list[tuple[DecodeState, list[int], list[int], list[int]]]) -> list[Tensor]:
    """`drafter.step(state, tokens, parents, frontier)` for each call of a batch (one per sequence): `step_many`
    for two or more, `step` for one."""
    return drafter.step_many(calls) if len(calls) > 1 else [drafter.step(*call) for call in calls]


def draft_token_ids(columns: Tensor, draft_vocab: Tensor | None) -> Tensor:
    """The token ids of a drafter's log-prob columns (any shape): StepDrafter's `draft_vocab`, or
    the columns themselves where it is None (they cover the whole vocabulary)."""
    return columns if draft_vocab is None else draft_vocab[columns]


def to_full_vocab(values: Tensor, draft_vocab: Tensor | None, vocab_size: int) -> Tensor:
    """[..., vocab_size] from a drafter's logits or log-probs [..., k] over `draft_vocab` [k] (-inf at every
    other token), or the values themselves where it is None (they cover the whole vocabulary)."""
    if draft_vocab is None:
        return values
    full = values.new_full((*values.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, draft_vocab, values)


@dataclass(frozen=True)
class LookaheadRows:
    """Query rows a stage adds to the verify forward, after the root and the tree nodes.

    Every row sees the whole committed cache, never a tree node, and no tree node (nor the
    root) sees any of these rows; within [root | these rows] the stage chooses with `mask`.
    So the rows cannot change the verify logits, and their cache entries, appended after
    the tree's, are dropped by the commit like any rejected node's.
    """

    tokens: Tensor  # [r] int64 token ids
    positions: Tensor  # [r] int64 absolute position ids (the root sits at len(state.tokens) - 1)
    mask: Tensor  # [r, 1 + r] bool over [root | these rows]: mask[i, 0] = row i sees the root

    def __post_init__(self) -> None:
        r = int(self.tokens.shape[0])
        if self.positions.shape != (r,) or self.mask.shape != (r, 1 + r):
            raise ValueError(f"lookahead rows: tokens [r], positions [r] and mask [r, 1 + r] expected; got "
                             f"{tuple(self.tokens.shape)}, {tuple(self.positions.shape)}, {tuple(self.mask.shape)}")
        if r and not bool(self.mask[:, 1:].diagonal().all()):
            raise ValueError("lookahead rows: every row must see itself (an all-masked row has no softmax)")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class LookaheadBranch(Protocol):
    """A stage that rides its own query rows along in the verify forward (Lookahead Decoding's
    lookahead branch): the decoder asks for the rows after the tree is built and hands back
    their logits after the forward, before the commit (`state.tokens` still ends with the
    root the rows were built on). The verifier never sees these rows."""

    def lookahead_rows(self, state: DecodeState) -> LookaheadRows | None:
        """This step's rows, or None for none."""

    def on_lookahead(self, state: DecodeState, logits: Tensor) -> None:
        """logits [1 + r, vocab]: row 0 = the root's (shared with the verify branch), then row i + 1 =
        the stage's row i."""


@runtime_checkable
class Augmenter(Protocol):
    """Before decoding: finds documents for the question and writes them into the prompt (RAG)."""

    def retrieve(self, question: str, documents=None, k: int | None = None) -> list:
        """The best chunks for `question` (from `documents` when given: strings or a store)."""

    def render(self, question: str, chunks: list) -> str:
        """The augmented user message."""


@runtime_checkable
class TreeBuilder(Protocol):
    """Merges a step's proposals (and grows its drafters) into one DraftTree under one node budget.

    What a build found out travels with the tree, never on the builder (which serves every sequence):
    `DraftTree.scores` (each node's chance of acceptance), `expected_tokens`, and `drafting_ms` (the draft levels'
    time as the builder priced them, which the decoder leaves out of the step's price). The rest of the batch is
    in `state.budget` while a tree is built.
    """

    # the curve trees are sized on (ms per verify forward of q rows; the builder passes it as `cost_curve`);
    # None: trees are not sized, and the decoder keeps a batch's trees whole
    cost_curve: CostFunction | None = None
    expands_drafters: bool = False  # grows `pipeline.drafters` (StepDrafters); else only merges proposals
    # `build_many` grows the drafters of a whole batch at once (one draft forward per level), each tree priced
    # against the others' plain rows; False: the decoder builds one tree at a time, each priced against the
    # trees built before it
    batches_drafters: bool = False

    def attach(self, drafters: list[StepDrafter]) -> None:
        """Called by the pipeline builder once the drafters exist (e.g. to read their checkpoint folders).
        Default: nothing."""

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter]) -> DraftTree: ...

    def build_many(self, states: list[DecodeState], proposals: list[list[Proposal]],
                   drafters: list[StepDrafter]) -> list[DraftTree]:
        """The trees of several sequences (`batches_drafters`). Default: one `build` each."""
        return [self.build(state, mine, drafters) for state, mine in zip(states, proposals)]


@runtime_checkable
class Verifier(Protocol):
    """An acceptance rule over the target's logits for [root | tree nodes]."""

    lossless: bool = False  # output distributed exactly as the target alone would produce it
    supports_sampling: bool = False  # handles temperature > 0 (else greedy only: the builder refuses sampling)

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator | None,
               sampling: SamplingConfig | None = None) -> VerifyResult:
        """logits [n + 1, vocab]: row 0 after the root, row i + 1 after node i."""


@runtime_checkable
class Committer(Protocol):
    """Commit (`conf/commit/`): after Verify, keeps the cache rows of the root and the accepted path, drops the
    rest, and extends the committed text. The decoder then calls every Proposer's `on_commit`."""

    def commit(self, state: DecodeState, cache: PositionIndexedCache, tree: DraftTree, result: VerifyResult,
               emitted: list[int]) -> None:
        """The cache holds [committed but the last | root | tree nodes | lookahead rows]; `emitted` are the
        accepted nodes' tokens then the bonus, possibly cut short by a stop condition. Afterwards the cache covers
        every committed token but the last, and `state.tokens`, `state.hidden`, `state.logits` follow the text."""
