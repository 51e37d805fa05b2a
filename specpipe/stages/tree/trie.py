"""Merge every proposal into one token trie and keep the nodes worth verifying."""
from __future__ import annotations

import math

import torch

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.stages.base import TreeBuilder
from specpipe.types import NO_BUDGET, DecodeState, DraftTree, Proposal, StepBudget, merge_by_prefix


def check_budget(max_nodes: int, min_gain: float, tree: str = "trie") -> None:
    """Refuses a node budget or a minimum gain no tree can be built with, naming the config keys."""
    if max_nodes < 1:
        raise ConfigError(f"tree={tree}: pipeline.tree.max_nodes must be >= 1, got {max_nodes} "
                          f"(pipeline=vanilla decodes without drafting)")
    if not math.isfinite(min_gain) or min_gain < 0:
        raise ConfigError(f"tree={tree}: pipeline.tree.min_gain must be >= 0 (a tree is verified when it is expected "
                          f"to beat a plain step by this factor), got {min_gain}")


class TrieTreeBuilder(TreeBuilder):
    """Merges proposals by prefix, then keeps the best-scored nodes under a node budget.

    A node's score estimates the probability that it is accepted, so the expected tokens
    of a step that verifies a set of nodes is 1 + the sum of their scores. Nodes are taken
    best first (a child never outscores its parent, so every prefix of that order is a
    tree), and the tree size is the one that maximises expected tokens per millisecond on
    the measured cost curve; when no size beats a plain one-token step, nothing is drafted.
    """

    def __init__(self, cost_curve: CostCurve, max_nodes: int = 32, min_gain: float = 1.0) -> None:
        check_budget(max_nodes, min_gain)
        self.cost_curve = cost_curve
        self.max_nodes = max_nodes
        self.min_gain = min_gain

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list = (),
              overhead_ms: float = 0.0) -> DraftTree:
        """`overhead_ms`: time this step already spent drafting, for the tokens-per-millisecond choice.

        Sampled proposals (with `draft_probs`) are kept whole, first: which sampled nodes exist was
        decided by their drafter before each was drawn, and choosing among them by their tokens
        would bias what rejection sampling emits. The deterministic nodes are merged and chosen
        after them, under the budget they leave.
        """
        sampled = [proposal for proposal in proposals if proposal.draft_probs is not None and len(proposal)]
        fixed_tokens, fixed_parents, fixed_sources, fixed_expected = self._concatenate(sampled)
        tokens, parents, scores, sources = merge_by_prefix([p for p in proposals if p.draft_probs is None])
        budget = max(0, self.max_nodes - len(fixed_tokens))
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:budget]
        size = self._best_size([scores[i] for i in order], overhead_ms, len(fixed_tokens), fixed_expected,
                               state.lookahead_rows, state.budget)
        if size == 0 and not fixed_tokens:
            return DraftTree.empty()
        kept = sorted(order[:size])  # node order stays topological
        offset = len(fixed_tokens)
        new_index = {old: offset + new for new, old in enumerate(kept)}
        all_tokens = torch.tensor(fixed_tokens + [tokens[i] for i in kept], dtype=torch.long)  # [n]
        all_scores = torch.tensor([score for proposal in sampled for score in proposal.scores.tolist()]
                                  + [scores[i] for i in kept], dtype=torch.float32)  # [n]
        draft_probs = None
        if sampled:
            device = sampled[0].draft_probs.device  # the drafters' (the target's) device
            deterministic = torch.zeros(len(kept), sampled[0].draft_probs.shape[1], device=device)  # [kept, vocab]
            deterministic[torch.arange(len(kept)), all_tokens[offset:]] = 1.0  # one-hot
            draft_probs = torch.cat([*(proposal.draft_probs.float().to(device) for proposal in sampled), deterministic])
        return DraftTree.from_parents(
            all_tokens,
            torch.tensor(fixed_parents + [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept],
                         dtype=torch.long),
            sources=tuple(fixed_sources + [sources[i] for i in kept]),
            draft_probs=draft_probs,
            scores=all_scores,
        )

    def best_cut(self, ranked_scores: list[float], overhead_ms: float = 0.0, fixed_nodes: int = 0,
                 fixed_expected: float = 0.0, extra_rows: int = 0,
                 budget: StepBudget = NO_BUDGET) -> tuple[int, float, float]:
        """(size, expected tokens, expected tokens per ms) of the best prefix of `ranked_scores` (best
        first) to verify after `fixed_nodes` nodes already in the tree that are expected to yield
        `fixed_expected` tokens; size 0 = none of them. `overhead_ms` is added to every size's cost,
        and `extra_rows` (lookahead rows riding in the same forward) to every size's query count; the
        expected tokens and the rate are the whole step's, the other sequences of its batch (`budget`) included."""
        expected = 1.0 + fixed_expected + budget.tokens
        base = fixed_nodes + extra_rows + 1 + budget.rows
        overhead_ms += budget.milliseconds
        best = (0, expected, expected / (self.cost_curve(base) + overhead_ms))
        for size, score in enumerate(ranked_scores, start=1):
            expected += score
            rate = expected / (self.cost_curve(base + size) + overhead_ms)
            if rate > best[2]:
                best = (size, expected, rate)
        return best

    def plain_rate(self, overhead_ms: float = 0.0, extra_rows: int = 0, budget: StepBudget = NO_BUDGET) -> float:
        """Expected tokens per ms of the step with no tree for this sequence (its root and lookahead rows only)."""
        return (1.0 + budget.tokens) / (self.cost_curve(1 + extra_rows + budget.rows) + overhead_ms
                                        + budget.milliseconds)

    def _best_size(self, ranked_scores: list[float], overhead_ms: float = 0.0, fixed_nodes: int = 0,
                   fixed_expected: float = 0.0, extra_rows: int = 0, budget: StepBudget = NO_BUDGET) -> int:
        """The number of nodes maximising expected tokens per unit of cost (0 = none), after
        `fixed_nodes` nodes already in the tree that are expected to yield `fixed_expected` tokens."""
        size, _, rate = self.best_cut(ranked_scores, overhead_ms, fixed_nodes, fixed_expected, extra_rows, budget)
        if not fixed_nodes and rate < self.min_gain * self.plain_rate(overhead_ms, extra_rows, budget):
            return 0
        return size

    @staticmethod
    def _concatenate(proposals: list[Proposal]) -> tuple[list[int], list[int], list[str], float]:
        """Proposals side by side, unmerged: tokens, parents, sources, and the sum of their scores."""
        tokens: list[int] = []
        parents: list[int] = []
        sources: list[str] = []
        expected = 0.0
        for proposal in proposals:
            offset = len(tokens)
            tokens += proposal.tokens.tolist()
            parents += [parent + offset if parent >= 0 else -1 for parent in proposal.parents.tolist()]
            sources += [proposal.source] * len(proposal)
            expected += float(proposal.scores.sum())
        return tokens, parents, sources, expected
