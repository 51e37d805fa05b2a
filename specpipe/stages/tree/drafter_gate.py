"""Whether a step drafter's tree is worth growing beside the other sources' proposals, learned online.

A model drafter is not free on a CPU: an EAGLE head's first level after a target forward took
1.3-1.5 ms of a ~10 ms bf16 step (its weights are read from memory again), and in a RAG answer the
retrieval trie already drafts most of what the head would (2.55 vs 2.76 accepted tokens per step).
The gate skips a drafter in steps where, judged by what its nodes added in earlier steps like this
one, its time would buy fewer tokens than the same time spent on the verify forward yields.

"Steps like this one" are those whose other sources' best node score falls in the same bucket (the
trie's first node is likely or not). Per drafter and bucket the gate keeps decayed means of the
tokens the drafter's nodes added to the accepted path (beyond the longest accepted prefix the other
sources drafted too) and of the milliseconds growing its tree took: its draft levels, and feeding it
the rows the step before committed. Where the drafter was not grown in the request's step before, its
first feed also takes the rows of the steps it skipped, or the whole prompt: 5-16 ms in a RAG answer
against ~1 ms. Those rows are fed whenever it next grows, whatever this step decides, so such a step is
charged the drafter's usual feed instead: charged in full, a catch-up would price a bucket by how long
the drafter had been skipped there. It grows the drafter while a
bucket has fewer than `warmup` observations, and afterwards iff

    tokens added > milliseconds x the other sources' expected tokens per millisecond,

which is when the step's tokens per millisecond rise with the drafter (the trie builder's best cut
gives the rate without it). Every `explore_every`-th skip in a bucket grows it anyway, so that a
bucket's estimate follows the text. Which tree is verified never changes the output (greedy or
sampled): only which tokens are drafted.

The statistics are shared by the requests a pipeline decodes (they describe the drafter, not one
answer) and guarded by a lock; what one request drafted last step is kept in its DecodeState. As the
decisions follow measured times, two runs of one prompt give the same tokens but may split them into
different steps; `pipeline.tree.gate=null` makes the steps repeat too.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specpipe.types import DecodeState


@dataclass
class _Bucket:
    weight: float = 0.0  # decayed number of observations
    added: float = 0.0  # decayed sum of tokens added by the drafter's nodes
    milliseconds: float = 0.0  # decayed sum of the time growing its tree took
    skipped: int = 0  # skips since the drafter last grew in this bucket


@dataclass
class _LastStep:
    """One request's previous step: the committed length before it, its tree and which drafters grew."""

    length: int
    tokens: list[int]
    parents: list[int]
    sources: list[str]
    grown: dict[str, tuple[int, float]] = field(default_factory=dict)  # drafter -> (bucket, ms)


class DrafterGate:
    """Per drafter and bucket of the other sources' best score: decayed means of the tokens its nodes
    added and of its milliseconds, and the decision to grow it (see the module doc)."""

    def __init__(self, buckets: int = 5, warmup: int = 4, explore_every: int = 8, decay: float = 0.97) -> None:
        if buckets < 1 or warmup < 1 or explore_every < 1 or not 0.0 < decay <= 1.0:
            raise ValueError(f"drafter gate: buckets, warmup and explore_every must be >= 1 and decay in (0, 1], "
                             f"got {buckets}, {warmup}, {explore_every}, {decay}")
        self.buckets = buckets
        self.warmup = warmup
        self.explore_every = explore_every
        self.decay = decay
        self._stats: dict[tuple[str, int], _Bucket] = {}
        self._feeds: dict[str, tuple[float, float]] = {}  # drafter -> decayed (observations, sum of feed ms)
        self._lock = threading.Lock()

    def bucket(self, best_other_score: float) -> int:
        """The bucket of a step whose other sources' best node score (in [0, 1]) is `best_other_score`."""
        return min(self.buckets - 1, max(0, int(best_other_score * self.buckets)))

    def should_grow(self, drafter: str, bucket: int, other_rate: float) -> bool:
        """Whether to grow `drafter` this step; `other_rate`: the other sources' best cut's expected tokens
        per millisecond of verify forward."""
        with self._lock:
            stats = self._stats.setdefault((drafter, bucket), _Bucket())
            if stats.weight < self.warmup:
                return True
            if stats.added > stats.milliseconds * other_rate:
                stats.skipped = 0
                return True
            stats.skipped += 1
            if stats.skipped >= self.explore_every:
                stats.skipped = 0
                return True
            return False

    def observe(self, drafter: str, bucket: int, added_tokens: int, milliseconds: float) -> None:
        with self._lock:
            stats = self._stats.setdefault((drafter, bucket), _Bucket())
            stats.weight = stats.weight * self.decay + 1.0
            stats.added = stats.added * self.decay + added_tokens
            stats.milliseconds = stats.milliseconds * self.decay + milliseconds

    def charge(self, drafter: str, sync_ms: float, levels_ms: float, caught_up: bool) -> float:
        """The milliseconds a growth of `drafter` is charged: `levels_ms` of draft levels and `sync_ms` of
        feeding it the committed rows. Where it `caught_up` (was not grown in the request's step before),
        the feed is priced at its usual one (0 until one was seen), not at `sync_ms`: see the module doc."""
        with self._lock:
            weight, milliseconds = self._feeds.get(drafter, (0.0, 0.0))
            if caught_up:
                return levels_ms + (milliseconds / weight if weight else 0.0)
            self._feeds[drafter] = (weight * self.decay + 1.0, milliseconds * self.decay + sync_ms)
            return levels_ms + sync_ms

    def estimate(self, drafter: str, bucket: int) -> tuple[float, float, float]:
        """(observations, mean tokens added, mean milliseconds) of one drafter in one bucket (decayed)."""
        with self._lock:
            stats = self._stats.get((drafter, bucket), _Bucket())
            if stats.weight == 0.0:
                return 0.0, 0.0, 0.0
            return stats.weight, stats.added / stats.weight, stats.milliseconds / stats.weight

    # ---- one request's steps -----------------------------------------------------------------
    def learn_last_step(self, state: DecodeState) -> frozenset[str]:
        """Credits the drafters grown in this request's previous step with the tokens their nodes added to
        what the verifier accepted (read from the tokens committed since); returns their names (none where
        the step was not gated)."""
        last: _LastStep | None = state.stage_state.pop(self, None)
        if last is None or not last.grown:
            return frozenset()
        committed = state.tokens[last.length:]
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for node, (token, parent) in enumerate(zip(last.tokens, last.parents)):
            children.setdefault((parent, token), node)
        path, parent = [], -1
        for token in committed:  # the accepted nodes, then the bonus token, which no node holds
            node = children.get((parent, token))
            if node is None:
                break
            path.append(node)
            parent = node
        for drafter, (bucket, milliseconds) in last.grown.items():
            # the longest accepted prefix another source drafted too (a node both drafted is the other's)
            others = next((depth for depth, node in enumerate(path) if last.sources[node] == drafter), len(path))
            self.observe(drafter, bucket, len(path) - others, milliseconds)
        return frozenset(last.grown)

    def remember_step(self, state: DecodeState, tree_tokens: list[int], parents: list[int], sources: list[str],
                      grown: dict[str, tuple[int, float]]) -> None:
        """Keeps this step's tree (its nodes' tokens, parents and sources) and the drafters grown for it
        (name -> (bucket, milliseconds)) in the request's state, for the next step's `learn_last_step`."""
        state.stage_state[self] = _LastStep(len(state.tokens), tree_tokens, parents, sources, grown)

