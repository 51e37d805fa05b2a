"""A static sparse tree (Medusa's, EAGLE-1's): fixed top-k choices per depth over each drafter."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.stages.base import StepDrafter, draft_token_ids
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.types import DecodeState, DraftTree, Proposal

ROOT = -1


class StaticTreeBuilder:
    """Expands each drafter along `choices`: a path (i0, i1, ..., id) is the node reached by taking the
    i0-th most likely token after the root, then the i1-th most likely after that one, and so on
    (Medusa's `medusa_choices`). Every listed node is drafted and verified, whatever the measured cost
    of the forward: the tree's shape is the configuration. Other sources' proposals are merged in
    the same trie (a node proposed twice is verified once).
    """

    expands_drafters = True

    def __init__(self, choices: Sequence[Sequence[int]], cost_curve: CostCurve | None = None) -> None:
        paths = [tuple(int(i) for i in path) for path in choices]
        if not paths or any(not path or min(path) < 0 for path in paths):
            raise ConfigError(f"tree=static: choices must be non-empty paths of top-k indices >= 0, got {list(choices)}")
        listed = set(paths)
        for path in paths:
            if path[:-1] and path[:-1] not in listed:
                raise ConfigError(f"tree=static: choice {list(path)} has no parent {list(path[:-1])} in the list: "
                                  f"a tree needs every prefix of its paths")
        self.choices = sorted(listed, key=lambda path: (len(path), path))  # parents before children
        self.cost_curve = cost_curve or CostCurve.flat()  # not used for sizing: the shape is fixed
        self.merger = TrieTreeBuilder(CostCurve.flat(), max_nodes=len(self.choices) + 256, min_gain=0.0)

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter] = ()) -> DraftTree:
        grown = [self.grow(state, drafter) for drafter in drafters]
        return self.merger.build(state, [*proposals, *grown])

    def grow(self, state: DecodeState, drafter: StepDrafter) -> Proposal:
        """The drafter's tree over `choices` (scores: the product of the draft's probabilities on the path)."""
        drafter.start(state)
        draft_vocab = getattr(drafter, "draft_vocab", None)  # [k] target ids of the columns, or None
        node_of: dict[tuple[int, ...], int] = {(): ROOT}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depth = 1
        while True:
            level = [path for path in self.choices if len(path) == depth]
            if not level:
                break
            expanded = sorted({path[:-1] for path in level}, key=lambda path: node_of[path])
            frontier = [node_of[path] for path in expanded]
            logprobs = drafter.step(state, tokens, parents, frontier).float()  # [m, vocab] or [m, k]
            width = 1 + max(path[-1] for path in level)
            top = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)  # [m, width] each
            chosen = draft_token_ids(top.indices, draft_vocab)  # [m, width]
            row_of = {path: row for row, path in enumerate(expanded)}
            for path in level:
                row, rank = row_of[path[:-1]], path[-1]
                if rank >= top.indices.shape[1] or not math.isfinite(float(top.values[row, rank])):
                    continue  # the drafter has no such candidate here (e.g. past Medusa's last head)
                parent = node_of[path[:-1]]
                node_of[path] = len(tokens)
                tokens.append(int(chosen[row, rank]))
                parents.append(parent)
                parent_score = scores[parent] if parent != ROOT else 1.0
                scores.append(parent_score * math.exp(float(top.values[row, rank])))
            depth += 1
            if not any(path in node_of for path in level):
                break
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                        scores=torch.tensor(scores, dtype=torch.float32), source=getattr(drafter, "name", "draft"))
