"""Typical acceptance (Medusa): accept plausible tokens, not only the argmax. Not lossless."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from specpipe.sampling import sample, target_probs
from specpipe.stages.verify.greedy import greedy_accept
from specpipe.stages.base import Verifier
from specpipe.types import DraftTree, SamplingConfig, VerifyResult


class TypicalAcceptanceVerifier(Verifier):
    """Accepts a drafted token x when p(x) > min(epsilon, delta * exp(-H(p))), p being the
    target's distribution at its parent and H its entropy; takes the longest accepted path
    in the tree (ties: the earlier node), then draws the bonus from p after it.

    Medusa's rule: confident positions (low entropy) demand the token be near the top,
    uncertain ones accept anything reasonably likely. The output is plausible text but not
    the target's own distribution, so it is not lossless. Temperature 0 is greedy.
    """

    lossless = False
    supports_sampling = True

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3) -> None:
        if not (0 < epsilon <= 1 and delta > 0):
            raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0, got {epsilon}, {delta}")
        self.epsilon = epsilon
        self.delta = delta

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator | None = None,
               sampling: SamplingConfig | None = None) -> VerifyResult:
        if sampling is None or sampling.greedy:
            return greedy_accept(tree, logits)
        probs = target_probs(logits, sampling)  # [n + 1, vocab]
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # [n + 1]
        threshold = [min(self.epsilon, self.delta * math.exp(-float(h))) for h in entropy]
        tokens = tree.tokens.tolist()
        ok = [float(probs[parent + 1, token]) > threshold[parent + 1]
              for token, parent in zip(tokens, tree.parents.tolist())]
        # Longest path of accepted nodes from the root; parents come before children.
        length: list[int] = []
        for node, parent in enumerate(tree.parents.tolist()):
            reachable = ok[node] and (parent < 0 or length[parent] > 0)
            length.append((length[parent] if parent >= 0 else 0) + 1 if reachable else 0)
        accepted: list[int] = []
        if length and max(length) > 0:
            node = max(range(len(length)), key=lambda i: (length[i], -i))
            parents = tree.parents.tolist()
            while node >= 0:
                accepted.append(node)
                node = parents[node]
            accepted.reverse()
        last_row = accepted[-1] + 1 if accepted else 0
        return VerifyResult(accepted=accepted, bonus=sample(probs[last_row], rng), logits=logits)
