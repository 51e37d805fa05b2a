"""Drafting from the prompt and the output so far: Prompt Lookup (one chain) and Alibaba
Lookahead (many matches merged into a trie)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specpipe.stages.retrieve.calibration import AcceptanceCalibration
from specpipe.stages.retrieve.ngram_index import NgramIndex
from specpipe.types import DecodeState, Proposal, VerifyResult


@dataclass
class _TrieNode:
    token: int
    parent: int
    depth: int
    count: int = 0
    match_length: int = 0  # longest n-gram match among the continuations through this node
    children: dict[int, int] = field(default_factory=dict)


class PromptNgram:
    """Finds the current suffix (longest n-gram first) earlier in the prompt + output and
    proposes what followed it.

    `max_matches=1` is Prompt Lookup Decoding: the continuation of the longest, most recent
    match, one chain. With more matches the continuations are merged into a trie by prefix
    (Alibaba Lookahead's multi-branch drafts). Node scores estimate the probability that the
    node is accepted: along a path, the product of the branch frequency (how many matches
    continue that way) times an online calibration factor learned from what the target
    actually accepted, per match length and depth.
    """

    def __init__(self, name: str = "prompt_ngram", min_ngram: int = 1, max_ngram: int = 4,
                 max_matches: int = 1, max_length: int = 16, prior: float = 0.5,
                 memory: float = float("inf")) -> None:
        if max_matches < 1 or max_length < 1:
            raise ValueError(f"{name}: max_matches and max_length must be >= 1")
        self.name = name
        self.max_matches = max_matches
        self.max_length = max_length
        self.index = NgramIndex(min_ngram, max_ngram)
        self.calibration = AcceptanceCalibration(prior=prior, memory=memory)
        self._trie: list[_TrieNode] = []
        self._proposed_at = 0

    def reset(self, state: DecodeState) -> None:
        self.index.reset(list(state.tokens))
        self._trie = []

    def propose(self, state: DecodeState) -> Proposal:
        self._proposed_at = len(state.tokens)
        trie = self._build_trie(self.index.continuations(self.max_matches, self.max_length))
        self._trie = trie
        if not trie:
            return Proposal.empty(self.name)
        scores: list[float] = []
        for node, ratio in zip(trie, self._raw_ratios(trie)):
            parent_score = scores[node.parent] if node.parent >= 0 else 1.0
            conditional = self.calibration.factor(node.match_length, node.depth) * ratio
            scores.append(parent_score * min(1.0, conditional))
        return Proposal(
            tokens=torch.tensor([node.token for node in trie], dtype=torch.long),
            parents=torch.tensor([node.parent for node in trie], dtype=torch.long),
            scores=torch.tensor(scores, dtype=torch.float32),
            source=self.name,
        )

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        emitted = state.tokens[self._proposed_at:]
        self._learn(emitted)
        self.index.extend(emitted)

    def _build_trie(self, continuations: list[tuple[int, list[int]]]) -> list[_TrieNode]:
        trie: list[_TrieNode] = []
        root_children: dict[int, int] = {}
        for match_length, continuation in continuations:
            children, parent = root_children, -1
            for depth, token in enumerate(continuation):
                index = children.get(token)
                if index is None:
                    index = len(trie)
                    trie.append(_TrieNode(token, parent, depth))
                    children[token] = index
                node = trie[index]
                node.count += 1
                node.match_length = max(node.match_length, match_length)
                children, parent = node.children, index
        return trie

    @staticmethod
    def _raw_ratios(trie: list[_TrieNode]) -> list[float]:
        """Per node, the fraction of the matches reaching its parent that continue with it."""
        matches = sum(node.count for node in trie if node.parent < 0)
        return [node.count / (trie[node.parent].count if node.parent >= 0 else matches) for node in trie]

    def _learn(self, emitted: list[int]) -> None:
        """Scores each proposed node whose parent lies on the committed path against the truth.

        Under greedy decoding a node was right exactly when its token is what got
        committed at its depth, whether or not the tree builder kept it.
        """
        trie = self._trie
        on_path = {-1}
        for index, (node, ratio) in enumerate(zip(trie, self._raw_ratios(trie))):
            if node.parent not in on_path or node.depth >= len(emitted):
                continue
            accepted = node.token == emitted[node.depth]
            self.calibration.observe(node.match_length, node.depth, ratio, accepted)
            if accepted:
                on_path.add(index)
