"""Whether a batched step speculates: measured, per batch size, against plain steps of the same batch size."""
from __future__ import annotations

import math
from collections import deque
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


def _window_rate(window: deque) -> float:
    milliseconds = sum(ms for _, ms in window)
    return sum(tokens for tokens, _ in window) / milliseconds if milliseconds > 0 else 0.0


@dataclass
class _Bucket:
    speculating: _Rate
    plain: _Rate
    # the latest `window` measured steps of each kind, (tokens, ms): an exploration's are compared with the other
    # kind's steps just before it
    recent: dict[bool, deque]
    log_ratio: float = 0.0  # decayed mean of log(speculating / plain) over such pairs
    weight: float = 0.0  # the pairs' decayed count
    pairs: int = 0
    steps: int = 0
    exploring: bool | None = None  # the kind an exploration under way tries, and its steps measured so far
    explored: int = 0
    confirmed: int = 0  # explorations in a row that left the decision as it was


class SpeculationGate:
    """Turns speculation off for a batch size where plain steps commit more tokens per millisecond, and back on.

    Trees are sized by a model of the step's cost (the cost curve, each sequence's share of the rest) and of each
    node's chance of acceptance (its score); where either is off, a batch can speculate at a loss, and under load
    the proposers and draft forwards cost even when every node is cut. So for each batch size of 2 and more the
    decoder also measures what it gets: tokens committed per millisecond of the whole step, for steps that
    speculate and for plain steps (nothing proposed or drafted, one row per sequence).

    The two kinds are compared only in pairs taken close together: a short run of one kind (an exploration, or the
    first measures) against the latest steps of the other kind just before it. A virtual machine's speed drifts by
    tens of percent within a minute, so a rate of speculating steps measured a minute ago says nothing against plain
    steps measured now. The decision follows a decayed mean of those pairs' log ratios: speculate unless plain steps
    are measurably faster (`margin`). Every `explore_every` steps the other kind is tried for `window` measured
    steps (every `explore_every * 4` while one kind leads by more than 5%, `* 8` by more than 25%, and twice and four
    times as seldom after two and four explorations in a row that agreed with the decision, eight times after six), so a
    change of load or of text is seen; until `sure_pairs` pairs are in, every `explore_every` steps whatever the
    lead: one pair of a few steps says little (a speculating step commits 1 to 3 tokens a request, by luck). A
    speculating try after plain steps costs more than its steps: the drafters first catch up on every row committed
    meanwhile (~3 plain steps' time for an EAGLE head at 8 requests). So a batch size measured for the first time
    starts plain where a smaller one found plain steps more than 25% faster (`_inherit`). A batch of one is left to
    the cost curve alone."""

    sure_pairs = 3
    _PLAIN_LEAD = 1.25  # a smaller batch size's lead of plain steps that a larger one starts from (`_inherit`)

    def __init__(self, explore_every: int = 8, first_steps: int = 2, memory: float = 32.0, margin: float = 0.03,
                 window: int = 3, pair_memory: float = 6.0) -> None:
        if (explore_every < 2 or first_steps < 1 or memory < 1 or not 0 <= margin < 1 or window < 1
                or pair_memory < 1):
            raise ValueError(f"speculation gate: explore_every >= 2, first_steps >= 1, memory >= 1, margin in [0, 1), "
                             f"window >= 1 and pair_memory >= 1 expected, got {explore_every}, {first_steps}, "
                             f"{memory}, {margin}, {window}, {pair_memory}")
        self.explore_every = explore_every
        self.first_steps = first_steps
        self._keep = 1.0 - 1.0 / memory
        self.margin = margin
        self.window = window
        self._pair_keep = 1.0 - 1.0 / pair_memory
        self._buckets: dict[int, _Bucket] = {}
        self._last_speculated = True  # whether the decoder's last step speculated, whatever its batch size

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes by powers of two (2, 3-4, 5-8, 9-16, ...: the bucket's largest size): a batch under load
        moves between neighbouring sizes as requests end and join, and each size alone would be measured seldom."""
        return 1 << math.ceil(math.log2(batch_size))

    def _state(self, batch_size: int) -> _Bucket:
        bucket = self.bucket(batch_size)
        if bucket not in self._buckets:
            recent = {kind: deque(maxlen=self.window) for kind in (True, False)}
            self._buckets[bucket] = _Bucket(_Rate(), _Rate(), recent)
        return self._buckets[bucket]

    def _better(self, state: _Bucket) -> bool:
        return state.log_ratio > math.log1p(self.margin)

    def speculate(self, batch_size: int) -> bool:
        """Whether the next step of `batch_size` sequences speculates."""
        if batch_size < 2:
            return True
        state = self._state(batch_size)
        state.steps += 1
        if state.exploring is not None:
            return state.exploring
        if state.weight == 0.0 and not self._inherit(state, self.bucket(batch_size)):
            return state.speculating.count < self.first_steps  # the first measures: speculating steps, then plain
        better = self._better(state)
        lead = math.exp(abs(state.log_ratio))
        every = self.explore_every * (1 if lead < 1.05 or state.pairs < self.sure_pairs else 4 if lead < 1.25 else 8)
        every <<= min(3, state.confirmed // 2)
        if state.steps % every != 0:
            return better
        state.exploring, state.explored = not better, 0  # `window` measured steps of the other kind
        return state.exploring

    def _inherit(self, state: _Bucket, bucket: int) -> bool:
        """Starts a bucket not measured yet from a smaller batch size's measure where plain steps won there by more
        than `_PLAIN_LEAD`: speculation pays less as the batch grows (more rows per forward turn its cost from
        streaming the weights to computing), so a larger batch is taken to lose as much, until its own explorations
        say otherwise. Whether it did."""
        smaller = [size for size, other in self._buckets.items() if size < bucket and other.pairs >= self.sure_pairs]
        if not smaller:
            return False
        nearest = self._buckets[max(smaller)]
        if nearest.log_ratio >= -math.log(self._PLAIN_LEAD):
            return False
        state.log_ratio, state.weight, state.pairs, state.confirmed = nearest.log_ratio, 1.0, self.sure_pairs, 2
        return True

    def observe(self, batch_size: int, speculated: bool, tokens: int, milliseconds: float) -> None:
        # A speculating step after a plain one, of any batch size, pays for what the drafters skipped (an EAGLE head
        # feeds the rows committed meanwhile): measured, it would price speculation by its catch-ups and keep it off
        after_plain = speculated and not self._last_speculated
        self._last_speculated = speculated
        if batch_size < 2 or milliseconds <= 0 or after_plain:
            return
        state = self._state(batch_size)
        (state.speculating if speculated else state.plain).add(tokens, milliseconds, self._keep)
        state.recent[speculated].append((tokens, milliseconds))
        if state.weight == 0.0:
            if not speculated and state.plain.count >= self.first_steps:
                self._pair(state)  # the first measures of both kinds
        elif state.exploring == speculated:
            state.explored += 1
            if state.explored >= self.window:
                state.exploring = None
                self._pair(state)

    def _pair(self, state: _Bucket) -> None:
        """The steps just measured of one kind against the other kind's latest, taken just before them."""
        speculating, plain = _window_rate(state.recent[True]), _window_rate(state.recent[False])
        if speculating <= 0 or plain <= 0:
            return
        before = self._better(state) if state.weight > 0 else None
        ratio = math.log(speculating / plain)
        kept = state.weight * self._pair_keep
        state.log_ratio = (state.log_ratio * kept + ratio) / (kept + 1.0)
        state.weight = kept + 1.0
        state.pairs += 1
        # a pair that disagrees with the decision brings the next exploration near again, even where the mean has
        # not turned yet: the text or the load may have changed
        state.confirmed = state.confirmed + 1 if before == (ratio > math.log1p(self.margin)) else 0

    def rates(self, batch_size: int) -> tuple[float, float]:
        """(tokens per ms speculating, plain) measured for a batch size (0 where not measured yet): decayed means
        over the recent steps of each kind, whenever they were taken."""
        state = self._buckets.get(self.bucket(batch_size))
        return (state.speculating.value, state.plain.value) if state is not None else (0.0, 0.0)

    def ratio(self, batch_size: int) -> float:
        """What the gate decides on: speculating steps' tokens per ms over plain ones', from pairs of runs taken
        close together (0 where none was compared yet)."""
        state = self._buckets.get(self.bucket(batch_size))
        return math.exp(state.log_ratio) if state is not None and state.weight > 0 else 0.0
