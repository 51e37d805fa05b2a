"""Whether a batched step speculates: measured, per batch size, against plain steps of the same batch size."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Rate:
    """A decayed mean of tokens per millisecond over recent steps of one kind."""

    count: int = 0
    tokens: float = 0.0
    milliseconds: float = 0.0

    def add(self, tokens: int, milliseconds: float, keep: float) -> None:
        self.count += 1
        self.tokens = self.tokens * keep + tokens
        self.milliseconds = self.milliseconds * keep + milliseconds

    @property
    def value(self) -> float:
        return self.tokens / self.milliseconds if self.milliseconds > 0 else 0.0


@dataclass
class _Bucket:
    speculating: _Rate
    plain: _Rate
    steps: int = 0
    last_speculated: bool = True
    speculate_next: int = 0  # steps still to speculate in a row (an exploration)


class SpeculationGate:
    """Turns speculation off for a batch size where plain steps commit more tokens per millisecond, and back on.

    Trees are sized by a model of the step's cost (the cost curve, each sequence's share of the rest) and of each
    node's chance of acceptance (its score); where either is off, a batch can speculate at a loss, and under load
    the proposers and draft forwards cost even when every node is cut. So for each batch size of 2 and more the
    decoder also measures what it gets: tokens committed per millisecond of the whole step, for steps that
    speculate and for plain steps (nothing proposed or drafted, one row per sequence). It speculates unless plain
    steps are measurably faster there, and tries the other kind every `explore_every` steps (every
    `explore_every * 8` while one leads by more than a quarter), so that a change of load or of text is seen.
    A batch of one is left to the cost curve alone."""

    def __init__(self, explore_every: int = 8, first_steps: int = 2, memory: float = 32.0, margin: float = 0.03) -> None:
        if explore_every < 2 or first_steps < 1 or memory < 1 or not 0 <= margin < 1:
            raise ValueError(f"speculation gate: explore_every >= 2, first_steps >= 1, memory >= 1 and margin in [0, 1) "
                             f"expected, got {explore_every}, {first_steps}, {memory}, {margin}")
        self.explore_every = explore_every
        self.first_steps = first_steps
        self._keep = 1.0 - 1.0 / memory
        self.margin = margin
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes by powers of two (2, 3-4, 5-8, 9-16, ...: the bucket's largest size): a batch under load
        moves between neighbouring sizes as requests end and join, and each size alone would be measured seldom."""
        return 1 << math.ceil(math.log2(batch_size))

    def speculate(self, batch_size: int) -> bool:
        """Whether the next step of `batch_size` sequences speculates."""
        if batch_size < 2:
            return True
        state = self._buckets.setdefault(self.bucket(batch_size), _Bucket(_Rate(), _Rate()))
        state.steps += 1
        if state.speculate_next > 0:
            state.speculate_next -= 1
            return True
        if state.speculating.count < self.first_steps:
            return True
        if state.plain.count < self.first_steps:
            return False
        speculating, plain = state.speculating.value, state.plain.value
        # speculating must win by the margin: at a measured tie the load benchmark found batches that speculated
        # a few percent slower than plain ones, and nothing is lost by not speculating where it does not win
        better = speculating > plain * (1.0 + self.margin)
        lead = max(speculating, plain) / max(min(speculating, plain), 1e-12)
        every = self.explore_every * (1 if lead < 1.05 else 4 if lead < 1.25 else 8)
        if state.steps % every != 0:
            return better
        if better:
            return False  # a plain step, to look again
        state.speculate_next = 1  # two speculating steps: only the second is measured (see `observe`)
        return True

    def observe(self, batch_size: int, speculated: bool, tokens: int, milliseconds: float) -> None:
        if batch_size < 2 or milliseconds <= 0:
            return
        state = self._buckets.setdefault(self.bucket(batch_size), _Bucket(_Rate(), _Rate()))
        # A speculating step after a plain one pays for what the drafters skipped (an EAGLE head feeds the rows
        # committed meanwhile): measured, it would price speculation by its catch-ups and keep it off
        if speculated and not state.last_speculated:
            state.last_speculated = True
            return
        state.last_speculated = speculated
        (state.speculating if speculated else state.plain).add(tokens, milliseconds, self._keep)

    def rates(self, batch_size: int) -> tuple[float, float]:
        """(tokens per ms speculating, plain) measured for a batch size (0 where not measured yet)."""
        state = self._buckets.get(self.bucket(batch_size))
        return (state.speculating.value, state.plain.value) if state is not None else (0.0, 0.0)
