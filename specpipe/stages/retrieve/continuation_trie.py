"""Retrieved continuations merged by prefix into a scored trie: shared by the retrievers that
propose several continuations at once (n-gram matches in the context, a token datastore)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpipe.stages.retrieve.calibration import AcceptanceCalibration
from specpipe.types import Proposal, merge_node_lists


@dataclass(slots=True)
class TrieNode:
    token: int
    parent: int  # index of the parent node, -1 = child of the root
    depth: int  # 0 for children of the root
    count: int = 0  # retrieved continuations (or corpus occurrences) that go through this node
    match_length: int = 0  # longest context match among the continuations through this node
    children: dict[int, int] = field(default_factory=dict)  # token -> node index


class ContinuationTrie:
    """Continuations merged by prefix; a node's raw frequency ratio is the share of the
    continuations reaching its parent that go on with its token.

    Two ways to count, one per trie: `add(tokens)` counts every added continuation once on
    each node of its path; `add(tokens, prefix_counts)` takes counts already aggregated by
    the source (a suffix-array sample: how many occurrences start with each prefix). Then
    `total` must say how many occurrences the root stands for, since occurrences with
    nothing after them (a document ends) are part of the denominator but of no branch.
    """

    def __init__(self, total: int | None = None) -> None:
        self.nodes: list[TrieNode] = []
        self.total = total  # None: the number of continuations added below the root
        self._root_children: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, continuation: Sequence[int], match_length: int,
            prefix_counts: Sequence[int] | None = None) -> None:
        nodes = self.nodes
        children, parent = self._root_children, -1
        for depth, token in enumerate(continuation):
            index = children.get(token)
            if index is None:
                index = len(nodes)
                node = TrieNode(token, parent, depth, match_length=match_length)
                nodes.append(node)
                children[token] = index
            else:
                node = nodes[index]
                if match_length > node.match_length:
                    node.match_length = match_length
            if prefix_counts is None:
                node.count += 1
            else:
                node.count = prefix_counts[depth]
            children, parent = node.children, index

    def ratios(self) -> list[float]:
        """Per node, the fraction of the continuations reaching its parent that continue with it."""
        nodes = self.nodes
        total = self.total if self.total is not None else sum(node.count for node in nodes if node.parent < 0)
        return [node.count / (nodes[node.parent].count if node.parent >= 0 else total) for node in nodes]

    def to_nodes(self, calibration: AcceptanceCalibration) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, scores) per node. Scores are cumulative along each path: P(parent accepted) *
        min(1, factor * ratio), the factor being what the calibration learned for the node's match length
        and depth."""
        scores: list[float] = []
        factors: dict[tuple[int, int], float] = {}  # the calibration is fixed during one proposal
        for node, ratio in zip(self.nodes, self.ratios()):
            parent_score = scores[node.parent] if node.parent >= 0 else 1.0
            key = (node.match_length, node.depth)
            factor = factors.get(key)
            if factor is None:
                factor = factors[key] = calibration.factor(*key)
            conditional = factor * ratio
            scores.append(parent_score * (conditional if conditional < 1.0 else 1.0))
        return [node.token for node in self.nodes], [node.parent for node in self.nodes], scores

    def teach(self, emitted: list[int], calibration: AcceptanceCalibration) -> None:
        """Scores each node whose parent lies on the committed path against the truth.

        Under greedy decoding a node was right exactly when its token is what got
        committed at its depth, whether or not the tree builder kept it.
        """
        on_path = {-1}
        for index, (node, ratio) in enumerate(zip(self.nodes, self.ratios())):
            if node.parent not in on_path or node.depth >= len(emitted):
                continue
            accepted = node.token == emitted[node.depth]
            calibration.observe(node.match_length, node.depth, ratio, accepted)
            if accepted:
                on_path.add(index)


@dataclass
class TrieSequence:
    """What a trie-proposing retriever keeps per sequence: its acceptance calibration and the
    tries it last proposed (to learn from what the target then committed)."""

    calibration: AcceptanceCalibration
    tries: list[ContinuationTrie] = field(default_factory=list)
    proposed_at: int = 0  # len(state.tokens) when the tries were proposed, or when `learn` last ran

    def propose(self, trie: ContinuationTrie, committed: int, source: str) -> Proposal:
        return self.propose_merged([trie], committed, source)

    def propose_merged(self, tries: Sequence[ContinuationTrie], committed: int, source: str) -> Proposal:
        """Several tries (say, the continuations of matches of different lengths) as one proposal,
        merged by prefix: a node in several keeps its best score. Each trie keeps its own
        frequency ratios and all share the calibration, keyed by each node's match length."""
        self.tries, self.proposed_at = list(tries), committed
        trees = [trie.to_nodes(self.calibration) for trie in self.tries if len(trie)]
        if not trees:
            return Proposal.empty(source)
        tokens, parents, scores = trees[0] if len(trees) == 1 else merge_node_lists(
            [(*tree, source) for tree in trees])[:3]
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                        scores=torch.tensor(scores, dtype=torch.float32), source=source)

    def learn(self, tokens: list[int]) -> list[int]:
        """Teaches the calibration what was committed since the proposal (once: a step that did not propose, a
        plain step of a batch, teaches nothing); returns the tokens committed since the last call (or since the
        sequence started: `proposed_at` is set to its length then)."""
        emitted = tokens[self.proposed_at:]
        for trie in self.tries:
            trie.teach(emitted, self.calibration)
        self.tries, self.proposed_at = [], len(tokens)
        return emitted
