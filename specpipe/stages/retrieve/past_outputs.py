"""Drafting from earlier answers: the store of past outputs (specpipe.stores.past_outputs), shared by
every request of a pipeline, grows with each finished answer and proposes its continuations."""
from __future__ import annotations

from pathlib import Path

from specpipe.stages.base import Proposer
from specpipe.stages.retrieve.calibration import CalibrationPolicy
from specpipe.stages.retrieve.continuation_trie import ContinuationTrie, TrieSequence
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.stores.past_outputs import PastOutputs
from specpipe.types import DecodeState, Proposal, VerifyResult


class PastOutputsRetriever(Proposer):
    """Proposes what followed the context's longest suffix in earlier answers, merged into a trie.

    `learn=False` keeps the store as it is (nothing inserted): requests then draft from a fixed
    store and do not influence each other. `path` loads a saved store at start (when it exists)
    and `save()` writes it back.
    """

    def __init__(self, name: str = "past_outputs", max_tokens: int = 100_000, min_ngram: int = 2,
                 max_ngram: int = 4, max_matches: int = 8, max_length: int = 16, prior: float = 0.5,
                 memory: float = 4000.0, shared_calibration: bool = True, learn: bool = True,
                 path: str | None = None,
                 store: PastOutputs | None = None, tokenizer=None, target=None) -> None:
        # `target` is what the pipeline builder hands every partial stage; this one needs only the tokenizer.
        if max_matches < 1 or max_length < 1:
            raise ValueError(f"{name}: max_matches and max_length must be >= 1")
        self.calibration = CalibrationPolicy(prior, memory, shared_calibration)
        self.name = name
        self.max_matches, self.max_length = max_matches, max_length
        self.learn = learn
        self.path = Path(path).expanduser() if path else None
        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        if store is not None:
            self.store = store
        elif self.path is not None and self.path.exists():
            self.store = PastOutputs.load(self.path, fingerprint, max_tokens)
        else:
            self.store = PastOutputs(max_tokens, min_ngram, max_ngram, fingerprint)

    def reset(self, state: DecodeState) -> None:
        state.stage_state[self] = TrieSequence(self.calibration.for_request(), proposed_at=len(state.tokens))

    def propose(self, state: DecodeState) -> Proposal:
        trie = ContinuationTrie()
        for match_length, continuation in self.store.continuations(state.tokens, self.max_matches, self.max_length):
            trie.add(continuation, match_length)
        return state.stage_state[self].propose(trie, len(state.tokens), self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        state.stage_state[self].learn(state.tokens)

    def on_finish(self, state: DecodeState) -> None:
        if self.learn:
            self.store.insert(state.generated)

    def save(self, path: str | Path | None = None) -> None:
        target = Path(path) if path else self.path
        if target is None:
            raise ValueError(f"{self.name}: give a path to save the store of past outputs to")
        self.store.save(target)
