"""Online calibration of a retriever's acceptance estimates, learned from what the target accepted."""
from __future__ import annotations

from collections import defaultdict


class AcceptanceCalibration:
    """P(node accepted | its parent accepted) ~= factor[bucket, depth] * raw frequency ratio.

    The factor is a ratio of counts with a prior of `prior_accepts / prior_trials`:
    accepted nodes over the raw ratios predicted for them, over every node whose parent
    turned out to be on the committed path. `bucket` is the source's own notion of match
    quality (here: the n-gram match length).
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, max_depth: int = 8) -> None:
        self.max_depth = max_depth
        self._accepted: dict[tuple[int, int], float] = defaultdict(lambda: prior * prior_weight)
        self._predicted: dict[tuple[int, int], float] = defaultdict(lambda: prior_weight)

    def factor(self, bucket: int, depth: int) -> float:
        key = (bucket, min(depth, self.max_depth))
        return self._accepted[key] / self._predicted[key]

    def observe(self, bucket: int, depth: int, raw: float, accepted: bool) -> None:
        key = (bucket, min(depth, self.max_depth))
        self._accepted[key] += float(accepted)
        self._predicted[key] += raw
