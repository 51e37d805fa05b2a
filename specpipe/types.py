"""The data contracts shared by every stage of a decoding step.

Vocabulary: the *root* of a draft tree is the last committed token. Its key/value
entries are not in the target's cache yet (the cache always covers all committed
tokens but the last), so every verify forward runs the root plus the tree nodes, and
row 0 of the verify logits is the target's prediction after the committed text.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from specpipe.errors import InvalidRequest


@dataclass(frozen=True)
class Proposal:
    """A scored token tree from one source.

    A single continuation is a tree with one branch; several retrieved continuations
    are a trie. Nodes are in topological order (a parent comes before its children).
    """

    tokens: Tensor  # [n] int64 token ids
    parents: Tensor  # [n] int64, index of the parent node in this proposal, -1 = child of the root
    scores: Tensor  # [n] float, estimated probability that the node is accepted (cumulative along its path)
    source: str
    # [n, vocab] sampled drafts (temperature > 0): the distribution node i was drawn from, given the
    # siblings drawn before it; None = deterministic drafts. Which sampled nodes exist may depend on
    # what was drawn before them, never on their own tokens, so tree builders keep them whole.
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.parents.shape != (n,) or self.scores.shape != (n,) or (
                self.draft_probs is not None and self.draft_probs.shape[0] != n):
            raise ValueError(
                f"Proposal from {self.source!r}: tokens, parents and scores must all be [n]; got "
                f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, {tuple(self.scores.shape)}"
            )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(source: str) -> "Proposal":
        return Proposal(
            tokens=torch.empty(0, dtype=torch.long),
            parents=torch.empty(0, dtype=torch.long),
            scores=torch.empty(0, dtype=torch.float32),
            source=source,
        )

    @staticmethod
    def chain(tokens: list[int], scores: list[float], source: str) -> "Proposal":
        """One continuation: node i is the child of node i-1."""
        n = len(tokens)
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=torch.arange(-1, n - 1, dtype=torch.long),
            scores=torch.tensor(scores, dtype=torch.float32),
            source=source,
        )


def merge_by_prefix(proposals: list[Proposal]) -> tuple[list[int], list[int], list[float], list[str]]:
    """Deterministic proposals merged into one trie: (tokens, parents, scores, sources) per merged
    node in topological order. A node proposed twice keeps its best score and its first source; a
    child's score is capped at its parent's, so every best-first prefix of the nodes is a tree."""
    return merge_node_lists([(proposal.tokens.tolist(), proposal.parents.tolist(), proposal.scores.tolist(),
                              proposal.source) for proposal in proposals])


def merge_node_lists(trees: list[tuple[list[int], list[int], list[float], str]]
                     ) -> tuple[list[int], list[int], list[float], list[str]]:
    """merge_by_prefix over trees given as (tokens, parents, scores, source) lists, for a proposer that
    merges its own tries before it makes one Proposal of them (no tensors in between)."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    sources: list[str] = []
    index_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for tree_tokens, tree_parents, tree_scores, source in trees:
        local_to_merged: list[int] = []
        for token, parent, score in zip(tree_tokens, tree_parents, tree_scores):
            merged_parent = local_to_merged[parent] if parent >= 0 else -1
            if merged_parent >= 0:
                score = min(score, scores[merged_parent])
            key = (merged_parent, token)
            node = index_of.get(key)
            if node is None:
                node = len(tokens)
                index_of[key] = node
                tokens.append(token)
                parents.append(merged_parent)
                scores.append(score)
                sources.append(source)
            elif score > scores[node]:
                scores[node] = score
            local_to_merged.append(node)
    return tokens, parents, scores, sources


@dataclass(frozen=True)
class DraftTree:
    """The tree handed to Verify, tensorized. Nodes exclude the root.

    Node i sees node j iff j is an ancestor of i or i itself; every node sees the root
    and the whole committed context.
    """

    tokens: Tensor  # [n] int64
    parents: Tensor  # [n] int64, -1 = child of the root (the last committed token)
    depth: Tensor  # [n] int64, 0 for children of the root
    mask: Tensor  # [n, n] bool, mask[i, j] = j is an ancestor-or-self of i
    sources: tuple[str, ...] = ()  # [n] which proposal each node came from (the first, on merges)
    # [n, vocab] the distribution each node's token was sampled from, for rejection sampling;
    # None = deterministic drafts (retrieval, n-grams, argmax), i.e. one-hot at the token.
    draft_probs: Tensor | None = None
    # [n] float: each node's estimated probability of being accepted (never above its parent's), as the tree
    # builder ranked it; None where the builder gives none (the batch budget then keeps the tree whole)
    scores: Tensor | None = None
    # what growing the tree cost: the draft levels' time as the tree builder priced them (ms), which the
    # decoder leaves out of the step's price when it corrects the target's cost curve
    drafting_ms: float = 0.0

    @staticmethod
    def from_parents(tokens: Tensor, parents: Tensor, sources: tuple[str, ...] = (),
                     draft_probs: Tensor | None = None, scores: Tensor | None = None) -> "DraftTree":
        """Derives depth and the ancestor mask; parents must point to earlier nodes."""
        n = int(tokens.shape[0])
        parent_list = parents.tolist()
        mask = torch.zeros(n, n, dtype=torch.bool)
        depth = [0] * n
        for i, p in enumerate(parent_list):
            if p >= i:
                raise ValueError(f"draft tree node {i} has parent {p}: parents must come first")
            if p >= 0:
                mask[i] = mask[p]
                depth[i] = depth[p] + 1
            mask[i, i] = True
        return DraftTree(
            tokens=tokens.to(torch.long),
            parents=parents.to(torch.long),
            depth=torch.tensor(depth, dtype=torch.long),
            mask=mask,
            sources=sources,
            draft_probs=draft_probs,
            scores=None if scores is None else scores.to(torch.float32),
        )

    @staticmethod
    def empty() -> "DraftTree":
        none = torch.empty(0, dtype=torch.long)
        return DraftTree(none, none, none, torch.empty(0, 0, dtype=torch.bool))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expected_tokens(self) -> float:
        """Tokens a step verifying this tree is expected to commit: the target's own token, plus each node's
        probability of being accepted (1 with no scores: the tree's nodes are then not counted)."""
        return 1.0 + (float(self.scores.sum()) if self.scores is not None else 0.0)

    def keep(self, nodes: list[int]) -> "DraftTree":
        """The tree of `nodes` (ascending, closed under ancestors): the same tokens, sources and scores, parents
        renumbered. Deterministic drafts only: which sampled nodes exist must not depend on their tokens."""
        if self.draft_probs is not None:
            raise ValueError("a tree of sampled drafts is kept whole")
        index = {old: new for new, old in enumerate(nodes)}
        parents = [index[p] if p >= 0 else -1 for p in self.parents[nodes].tolist()]  # KeyError: not closed
        chosen = torch.tensor(nodes, dtype=torch.long)
        return dataclasses.replace(
            DraftTree.from_parents(self.tokens[chosen], torch.tensor(parents, dtype=torch.long),
                                   tuple(self.sources[i] for i in nodes) if self.sources else (),
                                   scores=self.scores[chosen] if self.scores is not None else None),
            drafting_ms=self.drafting_ms)

    def is_chain(self) -> bool:
        """Whether every node is the one before it's child (no branches; an empty tree is one)."""
        return bool(torch.equal(self.parents, torch.arange(-1, len(self) - 1)))

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in node order; -1 is the root."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents.tolist()):
            children.setdefault(parent, []).append(node)
        return children


@dataclass(frozen=True)
class VerifyResult:
    """What the target said about one tree."""

    accepted: list[int]  # node indices on the accepted path, root to leaf (root excluded)
    bonus: int  # the target's own next token after the accepted path
    logits: Tensor  # [n + 1, vocab] target logits; row 0 = root, row i + 1 = node i
    hidden: Tensor | None = None  # [n + 1, hidden] last hidden states, same rows
    aux_hidden: Tensor | None = None  # [n + 1, k * hidden] TargetModel.capture_layers' states, same rows


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Refused up front: a negative temperature would silently decode greedily, a negative top_k fail
        # mid-answer in torch.topk, a top_p outside (0, 1] keep nothing or everything without a word, a seed
        # that is not an integer fail in torch.Generator after the prompt was prefilled.
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"sampling.temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"sampling.top_k must be an integer >= 0 (0 = no top-k cut), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"sampling.top_p must be a number in (0, 1] (1 = no nucleus cut), got {self.top_p!r}")
        if self.seed is not None and (not _is_integer(self.seed) or not -(1 << 63) <= self.seed < (1 << 64)):
            raise InvalidRequest(f"sampling.seed must be an integer (or null for a fresh seed), got {self.seed!r}")

    @staticmethod
    def of(value: "SamplingConfig | Mapping | None", default: "SamplingConfig") -> "SamplingConfig":
        """A request's sampling settings: a SamplingConfig as it is, a mapping of its fields (what JSON and
        config files give), or None for `default`."""
        if value is None:
            return default
        if isinstance(value, SamplingConfig):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(SamplingConfig)}
            unknown = sorted(str(key) for key in value if key not in known)
            if unknown:
                raise InvalidRequest(f"sampling has no setting {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            return SamplingConfig(**value)
        raise InvalidRequest(f"sampling must be a SamplingConfig or a mapping of its settings "
                             f"(temperature, top_k, top_p, seed), got {type(value).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class StepStats:
    """One decoding step: how many tokens were accepted and where time went."""

    accepted: int  # tokens emitted by this step (accepted draft tokens + the bonus)
    tree_size: int  # draft nodes verified (0 = a plain decoding step)
    seconds: dict[str, float] = field(default_factory=dict)  # stage name -> wall time
    # emitted draft tokens per proposer (the node's first proposer where several proposed it)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    rows: int = 1  # query rows this sequence put in the step's target forward (root, nodes, lookahead rows)
    batch_rows: int = 1  # query rows of the whole forward, every sequence of the batch
    batch_size: int = 1  # sequences the forward verified


@dataclass(frozen=True)
class StepBudget:
    """What the rest of a batched step costs and yields, for a tree builder sizing one sequence's tree: the
    other sequences' query rows in the same target forward, the tokens they are expected to commit, and the
    step's milliseconds outside the forward that are not this sequence's (their draft levels, their proposers
    and commits). The step's price is the cost curve at the TOTAL rows, so an extra node must pay for its row
    against the whole batch's tokens per millisecond: under load trees shrink, at batch 1 this is all zeros."""

    rows: int = 0
    tokens: float = 0.0
    milliseconds: float = 0.0


NO_BUDGET = StepBudget()


@dataclass
class DecodeState:
    """The state of one sequence being decoded.

    `tokens` holds every committed token (prompt + generated); the target's KV cache
    covers `tokens[:-1]`. Stages keep their own state and update it in `on_commit`.
    """

    tokens: list[int]
    prompt_length: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # The root (last committed token) has not been through the target yet: these belong to
    # the token before it, whose logits chose the root (heads and EAGLE drafters read them).
    hidden: Tensor | None = None  # [hidden] target's last hidden state at tokens[-2]
    logits: Tensor | None = None  # [vocab] target logits at tokens[-2]
    # The target's last hidden states over the prompt [prompt_length, hidden] (EAGLE drafters
    # build their own cache from them).
    prompt_hidden: Tensor | None = None
    # The same prompt rows' hidden states of the layers the target runner captures (EAGLE-3 heads):
    # [prompt_length, k * hidden], None when it captures none.
    prompt_aux_hidden: Tensor | None = None
    # Each stage's per-sequence state (n-gram index, last trie, calibration), keyed by the stage
    # object: stages are shared by concurrent requests and keep nothing per request themselves.
    stage_state: dict = field(default_factory=dict)
    # Token ids of the documents retrieved for this request (RAG), for stages that draft from them.
    documents: tuple[tuple[int, ...], ...] = ()
    # The request's seeded generator: drafters that sample draw from the verifier's own stream.
    rng: torch.Generator | None = None
    # Query rows a lookahead branch (drafter=jacobi) adds to this step's verify forward beside the
    # tree: tree builders count them in the forward's cost.
    lookahead_rows: int = 0
    # The other sequences of this step's batch (StepBudget): tree builders price this sequence's nodes against
    # the whole forward. Set by the decoder before each build.
    budget: StepBudget = NO_BUDGET

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]
