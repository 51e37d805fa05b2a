"""Merge every proposal into one token trie and keep the nodes worth verifying."""
from __future__ import annotations

import torch

from specpipe.cost import CostCurve
from specpipe.types import DecodeState, DraftTree, Proposal


class TrieTreeBuilder:
    """Merges proposals by prefix, then keeps the best-scored nodes under a node budget.

    A node's score estimates the probability that it is accepted, so the expected tokens
    of a step that verifies a set of nodes is 1 + the sum of their scores. Nodes are taken
    best first (a child never outscores its parent, so every prefix of that order is a
    tree), and the tree size is the one that maximises expected tokens per millisecond on
    the measured cost curve; when no size beats a plain one-token step, nothing is drafted.
    """

    def __init__(self, cost_curve: CostCurve, max_nodes: int = 32, min_gain: float = 1.0) -> None:
        if max_nodes < 0:
            raise ValueError(f"tree max_nodes must be >= 0, got {max_nodes}")
        self.cost_curve = cost_curve
        self.max_nodes = max_nodes
        self.min_gain = min_gain
        self.last_expected_tokens = 1.0

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list = ()) -> DraftTree:
        tokens, parents, scores, sources = self._merge(proposals)
        if not tokens or self.max_nodes == 0:
            self.last_expected_tokens = 1.0
            return DraftTree.empty()
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.max_nodes]
        size = self._best_size([scores[i] for i in order])
        self.last_expected_tokens = 1.0 + sum(scores[i] for i in order[:size])
        if size == 0:
            return DraftTree.empty()
        kept = sorted(order[:size])  # node order stays topological
        new_index = {old: new for new, old in enumerate(kept)}
        return DraftTree.from_parents(
            torch.tensor([tokens[i] for i in kept], dtype=torch.long),
            torch.tensor([new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept], dtype=torch.long),
            sources=tuple(sources[i] for i in kept),
        )

    def _best_size(self, ranked_scores: list[float]) -> int:
        """The number of nodes maximising expected tokens per unit of cost (0 = plain step)."""
        one_step = self.cost_curve(1)
        best_size, best_rate = 0, 1.0 / one_step
        expected = 1.0
        for size, score in enumerate(ranked_scores, start=1):
            expected += score
            rate = expected / self.cost_curve(size + 1)
            if rate > best_rate:
                best_size, best_rate = size, rate
        if best_rate * one_step < self.min_gain:
            return 0
        return best_size

    @staticmethod
    def _merge(proposals: list[Proposal]) -> tuple[list[int], list[int], list[float], list[str]]:
        """One trie over all proposals; a node proposed twice keeps its best score."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        sources: list[str] = []
        index_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
        for proposal in proposals:
            local_to_merged: list[int] = []
            for token, parent, score in zip(proposal.tokens.tolist(), proposal.parents.tolist(),
                                            proposal.scores.tolist()):
                merged_parent = local_to_merged[parent] if parent >= 0 else -1
                if merged_parent >= 0:
                    score = min(score, scores[merged_parent])  # keeps every best-first prefix a tree
                key = (merged_parent, token)
                node = index_of.get(key)
                if node is None:
                    node = len(tokens)
                    index_of[key] = node
                    tokens.append(token)
                    parents.append(merged_parent)
                    scores.append(score)
                    sources.append(proposal.source)
                elif score > scores[node]:
                    scores[node] = score
                local_to_merged.append(node)
        return tokens, parents, scores, sources
