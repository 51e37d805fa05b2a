"""EAGLE-2's dynamic draft tree, for any StepDrafter, merged with the other sources' proposals."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.sampling import draw_without_replacement, target_probs
from specpipe.stages.base import StepDrafter, TreeBuilder, draft_token_ids, start_each, step_each, to_full_vocab
from specpipe.stages.tree.drafter_gate import DrafterGate
from specpipe.stages.tree.trie import TrieTreeBuilder, check_budget
from specpipe.types import NO_BUDGET, DecodeState, DraftTree, Proposal, StepBudget

ROOT = -1


def learn_level_cost(draft_cost: CostCurve | None, rows: int, started: float) -> None:
    """Tells a drafter's online cost curve (an OnlineCostCurve; a fixed curve has no `observe`) that a level of
    `rows` frontier nodes, begun at perf_counter() `started`, has just ended: the next levels are priced by what
    levels take in this process, not by the cached curve alone."""
    observe = getattr(draft_cost, "observe", None)
    if observe is not None:
        observe(rows, 1000.0 * (time.perf_counter() - started))


class Eagle2TreeBuilder(TreeBuilder):
    """Grows each drafter's tree depth by depth, then keeps the best nodes of all sources.

    Expansion (EAGLE-2): at every depth the `top_k` newest nodes with the highest cumulative
    draft probability (the product of the draft's probabilities along the path, which tracks the
    chance that the target accepts the path) are expanded into their `children` most likely
    children, in one draft forward. Only the frontier's best nodes whose expected children pay for
    their draft rows (the drafter's measured `cost_curve`, where it has one; under `cost_curve=online` corrected by
    the levels' own times, see `learn_level_cost`) and verify rows are
    expanded; expansion stops after `depth` levels, once no frontier node is at least `min_score`
    likely, or once no frontier node pays. The other sources' proposals count in that decision:
    where the retrievers already fill the best cut, a deeper level pays less.

    Reranking: every drafted node, with the other sources' proposals, goes to the trie builder's
    selection: nodes best first (a child never outscores its parent, so every prefix of that
    order is a tree closed under ancestors), as many as maximise expected tokens per
    millisecond on the measured cost curve, drafting time included.

    With `fixed_size` the sizes are EAGLE-2's own, fixed: `depth` levels of `top_k` expanded nodes while they are
    `min_score` likely, and the `max_nodes` best nodes kept, whatever the cost curves say: on a CPU such trees
    accept more tokens per step than the cost curve's sizes, for less speed.

    Sampling (temperature > 0): children are drawn without replacement from the draft's
    distribution warped as the target's is, and handed to the verifier with the distribution
    each was drawn from (SpecInfer's multi-draft rejection sampling). How many children each
    frontier node gets is decided before drawing them, from the same expected-tokens-per-
    millisecond rule, and every drawn node is kept: a node kept or dropped for its own token
    would bias the output.

    With `gate` (a DrafterGate), in greedy steps with other sources' proposals, a drafter is grown
    only where, judged by what its nodes added in earlier steps like this one, it pays for its time.
    """

    expands_drafters = True
    batches_drafters = True

    def __init__(self, cost_curve: CostCurve, depth: int = 6, top_k: int = 8, children: int = 8,
                 max_nodes: int = 48, min_gain: float = 1.0, min_score: float = 0.02,
                 gate: DrafterGate | None = None, fixed_size: bool = False) -> None:
        for key, value in (("depth", depth), ("top_k", top_k), ("children", children)):
            if value < 1:
                raise ConfigError(f"tree=eagle2: pipeline.tree.{key} must be >= 1, got {value}")
        if not 0.0 <= min_score < 1.0:
            raise ConfigError(f"tree=eagle2: pipeline.tree.min_score must be in [0, 1) (a node's cumulative draft "
                              f"probability below which expansion stops), got {min_score}")
        check_budget(max_nodes, min_gain, "eagle2")
        self.depth = depth
        self.top_k = top_k
        self.children = children
        self.min_score = min_score
        # EAGLE-2 as published: `depth` levels of the `top_k` best frontier nodes, the `max_nodes` best drafted
        # nodes kept (its total_tokens), sizes never priced; the pipeline's cost curves are set aside
        self.fixed_size = fixed_size
        if fixed_size:
            cost_curve = CostCurve.flat()
        self.selector = TrieTreeBuilder(cost_curve, max_nodes=max_nodes, min_gain=min_gain)
        self.gate = gate

    @property
    def cost_curve(self) -> CostCurve:
        return self.selector.cost_curve

    def _price(self, queries: int, budget: StepBudget) -> float:
        """The step's milliseconds with `queries` rows of this sequence beside the batch's others (`budget`)."""
        return self.cost_curve(budget.rows + queries) + budget.milliseconds

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter] = ()) -> DraftTree:
        return self.build_many([state], [proposals], drafters)[0]

    def build_many(self, states: list[DecodeState], proposals: list[list[Proposal]],
                   drafters: list[StepDrafter] = ()) -> list[DraftTree]:
        """`build` for the sequences of a batch at once: each drafter's levels run for every greedy sequence that
        grows it in one draft forward per level (StepDrafter.start_many / step_many), each sequence's tree still
        chosen on its own (its `state.budget`). Sampled sequences grow one at a time, as alone."""
        plans = [_GrowthPlan.of(self, state, state_proposals, bool(drafters))
                 for state, state_proposals in zip(states, proposals)]
        grown: list[list[Proposal]] = [[] for _ in states]
        drafting_ms = [0.0] * len(states)
        for drafter in drafters:
            name = drafter.name
            members = [i for i, plan in enumerate(plans) if plan.grows(self, name)]
            together = [i for i in members if states[i].sampling.greedy]
            for index in (i for i in members if not states[i].sampling.greedy):
                started = time.perf_counter()
                root_logprobs = drafter.start(states[index])
                synced = time.perf_counter()
                proposal, milliseconds = self._grow_sampled(states[index], drafter, root_logprobs,
                                                            plans[index].other_scores)
                plans[index].charge(self, name, synced - started, time.perf_counter() - synced)
                grown[index].append(proposal)
                drafting_ms[index] += milliseconds
            if not together:
                continue
            started = time.perf_counter()
            start_each(drafter, [states[i] for i in together])
            synced = time.perf_counter()
            results = self._grow_top_together(drafter, [states[i] for i in together],
                                              [plans[i].other_scores for i in together])
            levels = time.perf_counter() - synced
            for index, (proposal, milliseconds) in zip(together, results):
                # a batched forward is shared: each sequence is charged its share
                plans[index].charge(self, name, (synced - started) / len(together), levels / len(together))
                grown[index].append(proposal)
                drafting_ms[index] += milliseconds
        trees = []
        for state, state_proposals, plan, mine, milliseconds in zip(states, proposals, plans, grown, drafting_ms):
            tree = dataclasses.replace(self.selector.build(state, [*state_proposals, *mine], overhead_ms=milliseconds),
                                       drafting_ms=milliseconds)
            plan.remember(self, state, tree)
            trees.append(tree)
        return trees

    def grow(self, state: DecodeState, drafter: StepDrafter, other_scores: list[float] = ()
             ) -> tuple[Proposal, float]:
        """The drafter's expanded tree as one proposal (scores: cumulative draft probability), and the
        estimated milliseconds its draft forwards took. `other_scores`: the other sources' node scores,
        which the tree will hold too (whether one more level pays depends on them)."""
        root_logprobs = drafter.start(state)
        if state.sampling.greedy:
            return self._grow_top_together(drafter, [state], [list(other_scores)])[0]
        return self._grow_sampled(state, drafter, root_logprobs, list(other_scores))

    def _grow_top_together(self, drafter: StepDrafter, states: list[DecodeState], other_scores: list[list[float]]
                           ) -> list[tuple[Proposal, float]]:
        """Greedy growth of each state's tree (`_grow_top`), every level one `step_each` call for all the states that
        expand at it; a level's time teaches the drafter's curve, at all the rows it fed."""
        draft_cost = None if self.fixed_size else drafter.cost_curve
        growers = {index: self._grow_top(state, drafter, others, draft_cost)
                   for index, (state, others) in enumerate(zip(states, other_scores))}
        results: list = [None] * len(states)
        levels: dict[int, tuple] = {}
        for index, grower in list(growers.items()):
            try:
                levels[index] = next(grower)
            except StopIteration as done:
                results[index] = done.value
        while levels:
            order = list(levels)
            calls = [(states[index], *levels[index][1:]) for index in order]
            started = time.perf_counter()
            outputs = step_each(drafter, calls)
            rows = {index: len(levels[index][3]) for index in order if levels[index][0] > 0}
            if rows:  # the root's log-probs came with `start`: a deeper level is a draft forward
                learn_level_cost(draft_cost, sum(rows.values()), started)
            fed = sum(rows.values())
            for index, logprobs in zip(order, outputs):
                try:  # what the others fed at this level prices this sequence's next one as a share of a forward
                    levels[index] = growers[index].send((logprobs, fed - rows.get(index, 0)))
                except StopIteration as done:
                    results[index] = done.value
                    del levels[index]
        return results

    def _grow_top(self, state: DecodeState, drafter: StepDrafter, other_scores: list[float],
                  draft_cost: CostCurve | None):
        """EAGLE-2's greedy growth of one tree, as a generator: it yields each level it wants drafted as (depth,
        tokens, parents, frontier) and is sent (the drafter's log-probs [m, vocab] or [m, k] after each frontier node,
        the rows the batch's other sequences fed at that level); it returns (the proposal, the priced ms)."""
        draft_vocab = drafter.draft_vocab  # [k] target ids of the columns, or None
        tokens: list[int] = []
        parents: list[int] = []
        log_scores: list[float] = []
        frontier, frontier_scores = [ROOT], [0.0]
        drafting_ms, other_rows = 0.0, 0
        for depth in range(self.depth):
            if depth > 0:
                level_cost = shared_level_cost(draft_cost, other_rows)
                expand, step_ms = self._frontier_to_expand([*other_scores, *(math.exp(s) for s in log_scores)],
                                                           [math.exp(s) for s in frontier_scores], drafting_ms,
                                                           level_cost, child_rate, state.budget)
                if not expand:
                    break
                frontier, frontier_scores = frontier[:expand], frontier_scores[:expand]
                drafting_ms += step_ms
            logprobs, other_rows = yield depth, tokens, parents, frontier  # [m, vocab] or [m, k]
            top = logprobs.float().topk(min(self.children, logprobs.shape[-1]), dim=-1)  # [m, c] each
            best_children = top.values[:, 0].tolist()  # [m]
            child_rate = sum(map(math.exp, best_children)) / len(best_children)  # how sure the draft was at this level
            chosen = draft_token_ids(top.indices, draft_vocab)  # [m, c]
            cumulative = torch.tensor(frontier_scores, device=top.values.device)[:, None] + top.values  # [m, c]
            first_new = len(tokens)
            for node, row_tokens, row_scores in zip(frontier, chosen.tolist(), cumulative.tolist()):
                tokens.extend(row_tokens)
                parents.extend([node] * len(row_tokens))
                log_scores.extend(row_scores)
            best = cumulative.flatten().topk(min(self.top_k, len(tokens) - first_new))
            frontier_scores = best.values.tolist()
            if math.exp(frontier_scores[0]) < self.min_score:
                break
            frontier = [first_new + index for index in best.indices.tolist()]
        proposal = Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                            scores=torch.tensor(log_scores).exp(), source=drafter.name)
        return proposal, drafting_ms

    def _grow_sampled(self, state: DecodeState, drafter: StepDrafter, root_logprobs: Tensor,
                      other_scores: list[float]) -> tuple[Proposal, float]:
        sampling = state.sampling
        draft_cost = None if self.fixed_size else drafter.cost_curve
        draft_vocab = drafter.draft_vocab

        def full_vocab(logprobs: Tensor) -> Tensor:  # the verifier needs each node's whole distribution
            if draft_vocab is None:  # the rows cover the whole vocabulary (state.logits may be unset)
                return logprobs
            return to_full_vocab(logprobs, draft_vocab, state.logits.shape[-1])  # [m, vocab]

        frontier_probs = target_probs(full_vocab(root_logprobs[None]), sampling)  # [1, vocab]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        draft_probs: list[Tensor] = []  # [vocab] per node: what it was drawn from
        frontier, frontier_scores = [ROOT], [1.0]
        budget = state.budget
        expected, drafting_ms = 1.0 + budget.tokens, 0.0  # the whole step's: the batch's other sequences too
        for depth in range(self.depth):
            if depth > 0:
                child_rate = float(frontier_probs.max(dim=-1).values.mean())  # the level just drawn from
                expand, step_ms = self._frontier_to_expand([*other_scores, *scores], frontier_scores, drafting_ms,
                                                           draft_cost, child_rate, budget)
                if not expand:
                    break
                frontier, frontier_scores = frontier[:expand], frontier_scores[:expand]
                drafting_ms += step_ms
                level_started = time.perf_counter()
                frontier_probs = target_probs(full_vocab(drafter.step(state, tokens, parents, frontier)),
                                              sampling)  # [m, vocab]
                learn_level_cost(draft_cost, len(frontier), level_started)
            counts, expected = self._allot_children(frontier_probs, frontier_scores, expected, len(tokens), drafting_ms,
                                                    budget)
            if depth == 0 and not self._beats_plain_step(expected, sum(counts), drafting_ms, budget):
                counts = [0] * len(counts)
            if not any(counts):
                break
            first_new = len(tokens)
            for row, count in enumerate(counts):
                drawn, conditionals = self._draw(frontier_probs[row], count, state.rng)
                for token, conditional in zip(drawn, conditionals):
                    tokens.append(token)
                    parents.append(frontier[row])
                    scores.append(frontier_scores[row] * float(frontier_probs[row, token]))
                    draft_probs.append(conditional)
            ranked = sorted(range(first_new, len(tokens)), key=lambda node: -scores[node])[: self.top_k]
            frontier, frontier_scores = ranked, [scores[node] for node in ranked]
        vocab = frontier_probs.shape[-1]
        proposal = Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                            scores=torch.tensor(scores, dtype=torch.float32), source=drafter.name,
                            draft_probs=torch.stack(draft_probs) if draft_probs else frontier_probs.new_empty(0, vocab))
        return proposal, drafting_ms

    def _allot_children(self, probs: Tensor, frontier_scores: list[float], expected: float, nodes: int,
                        drafting_ms: float, budget: StepBudget = NO_BUDGET) -> tuple[list[int], float]:
        """How many children to draw for each frontier node (probs [m, vocab]), before drawing any.

        The j-th draw of a node is valued as its j-th most likely token would be under top-k
        drafting (path probability): slots are taken best first while they raise expected tokens
        per millisecond. Returns the counts [m] and the expected tokens with them."""
        top = probs.topk(min(self.children, probs.shape[-1]), dim=-1).values  # [m, c]
        values = torch.tensor(frontier_scores, device=top.device)[:, None] * top  # [m, c]
        counts = [0] * len(frontier_scores)
        for flat in values.flatten().argsort(descending=True).tolist():
            value = float(values.flatten()[flat])
            taken = nodes + sum(counts)
            if value < self.min_score or value <= 0.0 or taken >= self.selector.max_nodes:
                break
            rate_now = expected / (self._price(taken + 1, budget) + drafting_ms)
            if (expected + value) / (self._price(taken + 2, budget) + drafting_ms) < rate_now:
                break
            counts[flat // values.shape[1]] += 1
            expected += value
        return counts, expected

    def _beats_plain_step(self, expected: float, nodes: int, drafting_ms: float, budget: StepBudget = NO_BUDGET) -> bool:
        """`expected`: the step's tokens with these `nodes` (the batch's other sequences' included)."""
        return nodes > 0 and expected / (self._price(nodes + 1, budget) + drafting_ms) >= \
            self.selector.min_gain * self.selector.plain_rate(budget=budget)

    def _frontier_to_expand(self, scores: list[float], frontier_scores: list[float], drafting_ms: float,
                            draft_cost: CostCurve | None, child_rate: float,
                            budget: StepBudget = NO_BUDGET) -> tuple[int, float]:
        """How many of the frontier's best nodes (`frontier_scores`, best first) one more level should
        expand (0 = stop), and the estimated milliseconds of that draft forward.

        A node is expected to add its probability times `child_rate` (how likely the draft's best
        child was at the level just drafted) for one more verified node. The level grows the frontier
        prefix that raises expected tokens per millisecond most over the best cut of the nodes drafted
        so far (`scores`), its draft forward included: beside seven unlikely nodes, a likely one is
        grown alone, where pricing all eight would stop the tree. (Pricing all, with every child sure
        to be accepted, the embedded draft never grew past depth 2; growing every prefix that could
        pay at best drafted deeper levels that did not pay for their time.)"""
        ranked = sorted(scores, reverse=True)[: self.selector.max_nodes]
        best_size, best_expected, best_rate = self.selector.best_cut(ranked, drafting_ms, budget=budget)
        expand, expand_ms, gain = 0, 0.0, 0.0
        for count, score in enumerate(frontier_scores, start=1):
            gain += score * child_rate
            step_ms = draft_cost(count) if draft_cost is not None else 0.0
            estimated = (best_expected + gain) / (self._price(best_size + count + 1, budget) + drafting_ms + step_ms)
            if estimated > best_rate:
                expand, expand_ms, best_rate = count, step_ms, estimated
        return expand, expand_ms

    @staticmethod
    def _draw(probs: Tensor, count: int, rng: torch.Generator | None) -> tuple[list[int], Tensor]:
        """`count` children from probs [vocab], and the distribution each was drawn from [count, vocab]."""
        return draw_without_replacement(probs, count, rng)


def shared_level_cost(draft_cost: CostCurve | None, other_rows: int) -> CostCurve | None:
    """What a draft level of `count` rows adds to a forward that already feeds `other_rows` rows of the batch's
    other sequences (the whole level's cost where there are none); None where the drafter has no curve."""
    if draft_cost is None or other_rows <= 0:
        return draft_cost
    base = draft_cost(other_rows)
    return lambda count: draft_cost(other_rows + count) - base


@dataclass
class _GrowthPlan:
    """One sequence's part of `build_many`: the other sources' node scores, and what the drafter gate decided
    and must learn for it."""

    other_scores: list[float]
    gated: bool = False
    bucket: int = 0
    other_rate: float = 0.0
    grown_before: frozenset = frozenset()
    timed: dict = field(default_factory=dict)

    @classmethod
    def of(cls, builder: "Eagle2TreeBuilder", state: DecodeState, proposals: list[Proposal],
           any_drafter: bool) -> "_GrowthPlan":
        # the other sources' node scores, best first: the cut the drafters' nodes must improve on (only
        # drafters read them, and a step with none skips the sort)
        other_scores = sorted((score for proposal in proposals for score in proposal.scores.tolist()),
                              reverse=True)[: builder.selector.max_nodes] if any_drafter else []
        gate = builder.gate
        # greedy steps only: a sampled tree keeps the drafter's nodes beside equal ones of other sources,
        # so the committed tokens do not tell whose node was accepted
        plan = cls(other_scores, gated=gate is not None and bool(other_scores) and state.sampling.greedy)
        # the step before this one only: the drafters grown in it fed all but its own committed rows
        plan.grown_before = gate.learn_last_step(state) if gate is not None else frozenset()
        if plan.gated:
            plan.bucket = gate.bucket(other_scores[0])  # the other sources' best node score
            plan.other_rate = builder.selector.best_cut(other_scores, budget=state.budget)[2]
        return plan

    def grows(self, builder: "Eagle2TreeBuilder", name: str) -> bool:
        return not self.gated or builder.gate.should_grow(name, self.bucket, self.other_rate)

    def charge(self, builder: "Eagle2TreeBuilder", name: str, sync_seconds: float, level_seconds: float) -> None:
        if self.gated:
            self.timed[name] = (self.bucket, builder.gate.charge(name, sync_ms=1000.0 * sync_seconds,
                                                                 levels_ms=1000.0 * level_seconds,
                                                                 caught_up=name not in self.grown_before))

    def remember(self, builder: "Eagle2TreeBuilder", state: DecodeState, tree: DraftTree) -> None:
        if self.gated:
            builder.gate.remember_step(state, tree.tokens.tolist(), tree.parents.tolist(), list(tree.sources),
                                       self.timed)
