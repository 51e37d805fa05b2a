"""Greedy verification: the lossless reference acceptance rule."""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.sampling import greedy_tokens
from specpipe.stages.base import Verifier
from specpipe.types import DraftTree, SamplingConfig, VerifyResult


class GreedyVerifier(Verifier):
    """Accepts the longest tree path whose every token is the target's argmax.

    From the root, the target's argmax token is looked up among the current node's
    children; a match is accepted and the walk continues from it, otherwise the argmax is
    the bonus token. The output equals plain greedy decoding token for token.
    """

    lossless = True
    supports_sampling = False

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator | None = None,
               sampling: SamplingConfig | None = None) -> VerifyResult:
        return greedy_accept(tree, logits)


def greedy_accept(tree: DraftTree, logits: Tensor) -> VerifyResult:
    """The greedy rule itself; the sampling verifiers fall back to it at temperature 0.

    logits: [n + 1, vocab]; row 0 follows the root, row i + 1 follows node i.
    """
    best = greedy_tokens(logits)  # [n + 1]
    tokens = tree.tokens.tolist()
    children = tree.children()
    accepted: list[int] = []
    node = -1
    while True:
        wanted = best[node + 1]
        match = next((c for c in children.get(node, ()) if tokens[c] == wanted), None)
        if match is None:
            return VerifyResult(accepted=accepted, bonus=wanted, logits=logits)
        accepted.append(match)
        node = match
