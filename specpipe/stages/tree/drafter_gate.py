"""Whether a model drafter's tree is worth drafting this step, next to what the retrievers already propose."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from specpipe.types import DecodeState, DraftTree


@dataclass
class _Estimate:
    """Recency-weighted means of what one drafter's tree brought in one bucket."""

    weight: float
    gained: float  # accepted tokens that only the drafter proposed, summed over weighted steps
    nodes: float  # the drafter's nodes in the verified tree
    ms: float  # wall time of growing its tree
    skipped: int = 0  # steps skipped in a row (a skip teaches nothing: every so often it drafts anyway)


@dataclass
class _LastTree:
    """One request's last verified tree, to credit its drafters once the target has spoken."""

    tokens: list[int]
    parents: list[int]
    sources: tuple[str, ...]
    committed: int  # len(state.tokens) when it was built
    drafted: dict[str, tuple[int, float]] = field(default_factory=dict)  # drafter -> (bucket, ms), those that drafted


class DrafterGate:
    """Learns what a drafter adds beside the other sources, and skips it where that does not pay.

    In a mixed pipeline the n-gram trie often already holds the next tokens (a summary copying its
    article, a translation, RAG): there the drafter's nodes are rarely the ones the target takes, yet
    its forwards (a head level ~0.5-0.7 ms, a draft model's more) cost 5-20% of a CPU step.

    The bucket is the other sources' best first-token score (their estimate that the next token is
    theirs), in tenths. Per drafter and bucket the gate keeps recency-weighted means of the accepted
    tokens only the drafter proposed (the merged tree credits a node to its first source, the
    retrievers), the nodes it adds and the milliseconds its tree takes. A step drafts when the other
    sources' best cut plus the drafter's expected tokens, at the cost of its nodes and its time, beats
    the other sources alone in tokens per millisecond. A prior of `prior_tokens` worth `prior_weight`
    steps makes a new bucket draft until it has evidence; a bucket that skips drafts anyway every
    `explore_every` steps so that its estimate follows the text. Skipping changes which tokens are
    drafted, never which are emitted: outputs stay exact.

    One gate serves every request of its pipeline (the tree builder is shared), as the retrievers'
    shared calibration: one request's steps leave most buckets at the prior.
    """

    def __init__(self, buckets: int = 10, prior_tokens: float = 1.0, prior_weight: float = 4.0,
                 memory: float = 1000.0, explore_every: int = 8) -> None:
        if buckets < 1 or prior_weight <= 0 or memory < 1 or explore_every < 1:
            raise ValueError(f"drafter gate: buckets, explore_every and memory must be >= 1, prior_weight > 0; got "
                             f"{buckets}, {explore_every}, {memory}, {prior_weight}")
        self.buckets = buckets
        self.explore_every = explore_every
        self._keep = 1.0 - 1.0 / memory
        self._prior = (prior_weight, prior_tokens * prior_weight)
        self._estimates: dict[tuple[str, int], _Estimate] = {}

    def bucket(self, top_score: float) -> int:
        return min(int(top_score * self.buckets), self.buckets - 1)

    def _estimate(self, drafter: str, bucket: int) -> _Estimate:
        key = (drafter, bucket)
        if key not in self._estimates:
            weight, gained = self._prior
            # with no timing yet, nodes and milliseconds read 0: the first steps draft
            self._estimates[key] = _Estimate(weight, gained, 0.0, 0.0)
        return self._estimates[key]

    def should_draft(self, drafter: str, bucket: int, rate_without: float, expected_without: float,
                     cost_with: Callable[[float, float], float]) -> bool:
        """`cost_with(nodes, ms)`: the step's cost in ms with `nodes` more nodes and `ms` more drafting."""
        estimate = self._estimate(drafter, bucket)
        mean = 1.0 / estimate.weight
        rate_with = (expected_without + estimate.gained * mean) / cost_with(estimate.nodes * mean, estimate.ms * mean)
        if rate_with >= rate_without:
            estimate.skipped = 0
            return True
        estimate.skipped += 1
        if estimate.skipped >= self.explore_every:
            estimate.skipped = 0
            return True
        return False

    def observe(self, drafter: str, bucket: int, gained: int, nodes: int, ms: float) -> None:
        estimate = self._estimate(drafter, bucket)
        keep = self._keep
        estimate.weight = estimate.weight * keep + 1.0
        estimate.gained = estimate.gained * keep + gained
        # timings carry no prior: the first observation sets them
        if estimate.ms == 0.0 and estimate.nodes == 0.0:
            estimate.nodes, estimate.ms = nodes * estimate.weight, ms * estimate.weight
        else:
            estimate.nodes = estimate.nodes * keep + nodes
            estimate.ms = estimate.ms * keep + ms

    def remember(self, state: DecodeState, tree: DraftTree, drafted: dict[str, tuple[int, float]]) -> None:
        """Keeps this step's tree to credit its drafters at the next step; `drafted`: drafter -> (bucket, ms
        its tree took), for the drafters that drafted."""
        state.stage_state[self] = _LastTree(tree.tokens.tolist(), tree.parents.tolist(), tree.sources,
                                            len(state.tokens), drafted)

    def learn(self, state: DecodeState) -> None:
        """Credits the drafters of the request's last tree with the accepted tokens only they proposed."""
        last: _LastTree | None = state.stage_state.pop(self, None)
        if last is None or not last.drafted:
            return
        emitted = state.tokens[last.committed:]
        credited: defaultdict[str, int] = defaultdict(int)
        node, depth = -1, 0
        children: defaultdict[int, list[int]] = defaultdict(list)
        for index, parent in enumerate(last.parents):
            children[parent].append(index)
        while depth < len(emitted):
            match = next((c for c in children[node] if last.tokens[c] == emitted[depth]), None)
            if match is None:
                break
            if last.sources:
                credited[last.sources[match]] += 1
            node, depth = match, depth + 1
        for drafter, (bucket, ms) in last.drafted.items():
            self.observe(drafter, bucket, credited[drafter], last.sources.count(drafter), ms)
