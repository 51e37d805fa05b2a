"""Lossless speculative sampling over draft trees (recursive rejection sampling, SpecInfer)."""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.sampling import sample, target_probs, uniform
from specpipe.stages.verify.greedy import greedy_accept
from specpipe.stages.base import Verifier
from specpipe.types import DraftTree, SamplingConfig, VerifyResult


class RejectionSamplingVerifier(Verifier):
    """Emits tokens distributed exactly as sampling from the target alone.

    At each node, with p the target's distribution there (temperature, top-k, top-p
    applied as plain sampling applies them), the children are tried in order: child x with
    draft distribution q is accepted with probability min(1, r(x) / q(x)), r being the
    residual, which starts as p and after each rejection becomes norm(max(0, r - q)). An
    accepted child continues the walk; when every child is rejected the bonus token is
    drawn from the residual. Deterministic drafts (retrieval, n-grams) have one-hot q, so
    a rejection removes that token from r. With temperature 0 this is greedy verification.
    """

    lossless = True
    supports_sampling = True

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator | None = None,
               sampling: SamplingConfig | None = None) -> VerifyResult:
        if sampling is None or sampling.greedy:
            return greedy_accept(tree, logits)
        probs = target_probs(logits, sampling)  # [n + 1, vocab]
        draft_probs = None if tree.draft_probs is None else tree.draft_probs.to(probs.device)  # [n, vocab]
        tokens = tree.tokens.tolist()
        children = tree.children()
        accepted: list[int] = []
        node = -1
        while True:
            residual = probs[node + 1]  # [vocab]
            for child in children.get(node, ()):
                token = tokens[child]
                q = draft_probs[child] if draft_probs is not None else None  # [vocab] or one-hot
                q_token = float(q[token]) if q is not None else 1.0
                if q_token > 0 and uniform(rng) < min(1.0, float(residual[token]) / q_token):
                    accepted.append(child)
                    node = child
                    break
                residual = self._reject(residual, token, q)
            else:
                return VerifyResult(accepted=accepted, bonus=sample(residual, rng), logits=logits)

    @staticmethod
    def _reject(residual: Tensor, token: int, q: Tensor | None) -> Tensor:
        """norm(max(0, r - q)); r [vocab], q [vocab] or None for one-hot at `token`."""
        if q is None:
            left = residual.clone()
            left[token] = 0.0
        else:
            left = (residual - q).clamp_min(0.0)
        total = float(left.sum())
        # r <= q everywhere means r == q, where the child is accepted surely: only rounding gets here.
        return left / total if total > 0 else residual
