"""Drafting from the prompt and the output so far: Prompt Lookup (one chain) and Alibaba
Lookahead (many matches merged into a trie)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specpipe.stages.base import Proposer
from specpipe.stages.retrieve.calibration import CalibrationPolicy
from specpipe.stages.retrieve.continuation_trie import ContinuationTrie, TrieSequence
from specpipe.stages.retrieve.ngram_index import NgramIndex
from specpipe.types import DecodeState, Proposal, VerifyResult


# What the n-gram index covers: the prompt and the output so far ("context"), or the documents
# retrieved for the request and the output so far ("documents"; RAG chunks kept out of the prompt
# or beyond it).
TEXTS = ("context", "documents")
SEPARATOR = -1  # between documents: no token id, so no n-gram matches across it


class PromptNgram(Proposer):
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
                 memory: float = 4000.0, shared_calibration: bool = True, text: str = "context") -> None:
        if max_matches < 1 or max_length < 1:
            raise ValueError(f"{name}: max_matches and max_length must be >= 1")
        if text not in TEXTS:
            raise ValueError(f"{name}: text must be one of {TEXTS}, got {text!r}")
        NgramIndex(min_ngram, max_ngram)  # checks the sizes now, not at the first request
        self.calibration = CalibrationPolicy(prior, memory, shared_calibration)
        self.name = name
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_matches = max_matches
        self.max_length = max_length
        self.text = text

    def reset(self, state: DecodeState) -> None:
        index = NgramIndex(self.min_ngram, self.max_ngram)
        if self.text == "context":
            index.reset(list(state.tokens))
        else:  # the documents, then the context's last tokens: the suffix to look up, and the output after it
            index.reset([t for document in state.documents for t in (*document, SEPARATOR)]
                        + list(state.tokens[-self.max_ngram:]))
        state.stage_state[self] = NgramSequence(self.calibration.for_request(), proposed_at=len(state.tokens),
                                                index=index)

    def propose(self, state: DecodeState) -> Proposal:
        sequence: NgramSequence = state.stage_state[self]
        trie = ContinuationTrie()
        for match_length, continuation in sequence.index.continuations(self.max_matches, self.max_length):
            if SEPARATOR in continuation:  # a continuation ends with its document
                continuation = continuation[:continuation.index(SEPARATOR)]
            if continuation:
                trie.add(continuation, match_length)
        return sequence.propose(trie, len(state.tokens), self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        sequence: NgramSequence = state.stage_state[self]
        sequence.index.extend(sequence.learn(state.tokens))

    def on_finish(self, state: DecodeState) -> None:
        pass


@dataclass
class NgramSequence(TrieSequence):
    """PromptNgram's per-sequence state: the n-gram index over this sequence's tokens as well."""

    index: NgramIndex = field(default_factory=lambda: NgramIndex(1, 1))
