"""EAGLE-2's dynamic draft tree, for any StepDrafter, merged with the other sources' proposals."""
from __future__ import annotations

import math

import torch

from specpipe.cost import CostCurve
from specpipe.stages.base import StepDrafter
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.types import DecodeState, DraftTree, Proposal

ROOT = -1


class Eagle2TreeBuilder:
    """Grows each drafter's tree depth by depth, then keeps the best nodes of all sources.

    Expansion (EAGLE-2): at every depth the `top_k` newest nodes with the highest cumulative
    draft log-probability (the product of the draft's probabilities along the path, which tracks
    the chance that the target accepts the path) are expanded into their `top_k` most likely
    children, in one draft forward. Expansion stops after `depth` levels, or once no frontier
    node is at least `min_score` likely.

    Reranking: every drafted node, with the other sources' proposals, goes to the trie builder's
    selection: nodes best first (a child never outscores its parent, so every prefix of that
    order is a tree closed under ancestors), as many as maximise expected tokens per
    millisecond on the measured cost curve.
    """

    expands_drafters = True

    def __init__(self, cost_curve: CostCurve, depth: int = 6, top_k: int = 8, max_nodes: int = 48,
                 min_gain: float = 1.0, min_score: float = 0.02) -> None:
        if depth < 1 or top_k < 1:
            raise ValueError(f"tree=eagle2: depth and top_k must be >= 1, got {depth}, {top_k}")
        self.depth = depth
        self.top_k = top_k
        self.min_score = min_score
        self.selector = TrieTreeBuilder(cost_curve, max_nodes=max_nodes, min_gain=min_gain)

    @property
    def cost_curve(self) -> CostCurve:
        return self.selector.cost_curve

    @property
    def last_expected_tokens(self) -> float:
        return self.selector.last_expected_tokens

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter] = ()) -> DraftTree:
        grown = [self.grow(state, drafter) for drafter in drafters]
        return self.selector.build(state, [*proposals, *grown])

    def grow(self, state: DecodeState, drafter: StepDrafter) -> Proposal:
        """The drafter's whole expanded tree as one proposal, scored by cumulative draft probability."""
        drafter.start(state)
        tokens: list[int] = []
        parents: list[int] = []
        log_scores: list[float] = []
        frontier, frontier_scores = [ROOT], [0.0]
        for _ in range(self.depth):
            child_tokens, child_logprobs = drafter.step(state, tokens, parents, frontier)  # [m, k] each
            cumulative = torch.tensor(frontier_scores)[:, None] + child_logprobs.float()  # [m, k]
            first_new = len(tokens)
            for row, node in enumerate(frontier):
                tokens.extend(child_tokens[row].tolist())
                parents.extend([node] * child_tokens.shape[1])
                log_scores.extend(cumulative[row].tolist())
            width = min(self.top_k, len(tokens) - first_new)
            best = cumulative.flatten().topk(width)
            if math.exp(float(best.values[0])) < self.min_score:
                break
            frontier = [first_new + int(i) for i in best.indices]
            frontier_scores = best.values.tolist()
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                        scores=torch.tensor(log_scores).exp(), source=getattr(drafter, "name", "draft"))
