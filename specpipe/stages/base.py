"""The stage protocols of one decoding step: Retrieve/Draft -> TreeBuild -> Verify -> Commit."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from specpipe.types import DecodeState, DraftTree, Proposal, SamplingConfig, VerifyResult


@runtime_checkable
class Proposer(Protocol):
    """A Retrieve or Draft stage: proposes continuations of the committed text."""

    name: str

    def reset(self, state: DecodeState) -> None:
        """A new sequence starts (the prompt is in `state.tokens`). Per-sequence state goes into
        `state.stage_state[self]`: one stage serves concurrent requests."""

    def propose(self, state: DecodeState) -> Proposal: ...

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        """`state.tokens` now holds the newly committed tokens."""

    def on_finish(self, state: DecodeState) -> None:
        """The sequence is complete (`state.generated` is the whole answer). Optional: the decoder
        calls it where a stage has it."""


@runtime_checkable
class StepDrafter(Proposer, Protocol):
    """A model drafter a tree builder can expand node by node (`pipeline.drafters`, `tree=eagle2`).

    Per step the builder calls `start` once, then `step` once per depth with the tree grown so
    far; nodes only ever get appended to that tree within a step.
    """

    def start(self, state: DecodeState) -> Tensor:
        """Catches up with the committed tokens; returns the draft's log-probs [vocab] after the root."""

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]
             ) -> tuple[Tensor, Tensor]:
        """tokens, parents [n]: the tree so far (-1 = child of the root); frontier [m]: node ids to
        expand (-1 = the root). Returns each frontier node's top-k next tokens [m, k] and their
        log-probs [m, k]."""


@runtime_checkable
class Augmenter(Protocol):
    """Before decoding: finds documents for the question and writes them into the prompt (RAG)."""

    def retrieve(self, question: str, documents=None, k: int | None = None) -> list:
        """The best chunks for `question` (from `documents` when given: strings or a store)."""

    def render(self, question: str, chunks: list) -> str:
        """The augmented user message."""


@runtime_checkable
class TreeBuilder(Protocol):
    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter]) -> DraftTree: ...


@runtime_checkable
class Verifier(Protocol):
    """An acceptance rule over the target's logits for [root | tree nodes]."""

    lossless: bool  # output distributed exactly as the target alone would produce it
    supports_sampling: bool  # handles temperature > 0 (else greedy only)

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator | None,
               sampling: SamplingConfig | None = None) -> VerifyResult:
        """logits [n + 1, vocab]: row 0 after the root, row i + 1 after node i."""
