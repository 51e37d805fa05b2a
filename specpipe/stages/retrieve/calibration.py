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

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, max_depth: int = 8,
                 memory: float = float("inf")) -> None:
        if memory < 1:
            raise ValueError(f"calibration memory must be >= 1 observation, got {memory}")
        self.max_depth = max_depth
        # Each observation scales the old counts by `keep`: about the last `memory` observations
        # count, so the estimate follows a change of text (a new prompt, another task).
        self._keep = 1.0 - 1.0 / memory
        self._accepted: dict[tuple[int, int], float] = defaultdict(lambda: prior * prior_weight)
        self._predicted: dict[tuple[int, int], float] = defaultdict(lambda: prior_weight)

    def factor(self, bucket: int, depth: int) -> float:
        key = (bucket, min(depth, self.max_depth))
        return self._accepted[key] / self._predicted[key]

    def observe(self, bucket: int, depth: int, raw: float, accepted: bool) -> None:
        key = (bucket, min(depth, self.max_depth))
        self._accepted[key] = self._accepted[key] * self._keep + float(accepted)
        self._predicted[key] = self._predicted[key] * self._keep + raw


class CalibrationPolicy:
    """Which calibration a retriever's requests learn in: one shared by every request (`shared`), or a
    fresh one each. Shared, the estimates gather all requests' evidence (one request's ~50 steps leave
    most buckets at the prior); apart, a request's tree sizes depend on it alone."""

    def __init__(self, prior: float = 0.5, memory: float = 4000.0, shared: bool = True) -> None:
        calibration = AcceptanceCalibration(prior=prior, memory=memory)  # checks the settings now
        self.prior, self.memory = prior, memory
        self.shared = calibration if shared else None

    def for_request(self) -> AcceptanceCalibration:
        if self.shared is not None:
            return self.shared
        return AcceptanceCalibration(prior=self.prior, memory=self.memory)
