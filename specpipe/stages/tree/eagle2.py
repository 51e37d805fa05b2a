"""EAGLE-2's dynamic draft tree, for any StepDrafter, merged with the other sources' proposals."""
from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import Tensor

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.sampling import draw_without_replacement, target_probs
from specpipe.stages.base import StepDrafter, draft_token_ids, to_full_vocab
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


class Eagle2TreeBuilder:
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
    `min_score` likely, and the `max_nodes` best nodes kept, whatever the cost curves say (on the 2-core EPYC,
    10 nodes of depth 5 accept more per step than the cost curve's ~6, for less speed: docs/BENCHMARKS.md run 59).

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
        # the other sources' node scores, best first: the cut the drafters' nodes must improve on (only
        # drafters read them, and a step with none skips the sort)
        other_scores = sorted((score for proposal in proposals for score in proposal.scores.tolist()),
                              reverse=True)[: self.selector.max_nodes] if drafters else []
        # greedy steps only: a sampled tree keeps the drafter's nodes beside equal ones of other sources,
        # so the committed tokens do not tell whose node was accepted
        gated = self.gate is not None and bool(other_scores) and state.sampling.greedy
        # the step before this one only: the drafters grown in it fed all but its own committed rows
        grown_before = self.gate.learn_last_step(state) if self.gate is not None else frozenset()
        if gated:
            bucket = self.gate.bucket(other_scores[0])  # the other sources' best node score
            other_rate = self.selector.best_cut(other_scores, budget=state.budget)[2]
        grown, drafting_ms, timed = [], 0.0, {}
        for drafter in drafters:
            name = getattr(drafter, "name", "draft")
            if gated and not self.gate.should_grow(name, bucket, other_rate):
                continue
            started = time.perf_counter()
            root_logprobs = drafter.start(state)
            synced = time.perf_counter()
            proposal, milliseconds = self._grow_from(state, drafter, root_logprobs, other_scores)
            if gated:
                timed[name] = (bucket, self.gate.charge(name, sync_ms=1000.0 * (synced - started),
                                                        levels_ms=1000.0 * (time.perf_counter() - synced),
                                                        caught_up=name not in grown_before))
            grown.append(proposal)
            drafting_ms += milliseconds
        tree = dataclasses.replace(self.selector.build(state, [*proposals, *grown], overhead_ms=drafting_ms),
                                   drafting_ms=drafting_ms)
        if gated:
            self.gate.remember_step(state, tree.tokens.tolist(), tree.parents.tolist(), list(tree.sources), timed)
        return tree

    def grow(self, state: DecodeState, drafter: StepDrafter, other_scores: list[float] = ()
             ) -> tuple[Proposal, float]:
        """The drafter's expanded tree as one proposal (scores: cumulative draft probability), and the
        estimated milliseconds its draft forwards took. `other_scores`: the other sources' node scores,
        which the tree will hold too (whether one more level pays depends on them)."""
        return self._grow_from(state, drafter, drafter.start(state), other_scores)

    def _grow_from(self, state: DecodeState, drafter: StepDrafter, root_logprobs: Tensor,
                   other_scores: list[float]) -> tuple[Proposal, float]:
        """`grow` after `drafter.start(state)` returned `root_logprobs` ([vocab], or [k] over its draft_vocab)."""
        if state.sampling.greedy:
            return self._grow_top(state, drafter, other_scores)
        return self._grow_sampled(state, drafter, root_logprobs, other_scores)

    def _grow_top(self, state: DecodeState, drafter: StepDrafter, other_scores: list[float]) -> tuple[Proposal, float]:
        draft_cost = None if self.fixed_size else getattr(drafter, "cost_curve", None)
        draft_vocab = getattr(drafter, "draft_vocab", None)  # [k] target ids of the columns, or None
        tokens: list[int] = []
        parents: list[int] = []
        log_scores: list[float] = []
        frontier, frontier_scores = [ROOT], [0.0]
        drafting_ms = 0.0
        for depth in range(self.depth):
            if depth > 0:
                expand, step_ms = self._frontier_to_expand([*other_scores, *(math.exp(s) for s in log_scores)],
                                                           [math.exp(s) for s in frontier_scores], drafting_ms, draft_cost,
                                                           child_rate, state.budget)
                if not expand:
                    break
                frontier, frontier_scores = frontier[:expand], frontier_scores[:expand]
                drafting_ms += step_ms
            level_started = time.perf_counter()
            logprobs = drafter.step(state, tokens, parents, frontier)  # [m, vocab] or [m, k]
            top = logprobs.float().topk(min(self.children, logprobs.shape[-1]), dim=-1)  # [m, c] each
            if depth > 0:  # the root's log-probs came with `start`: a deeper level is a draft forward, priced above
                learn_level_cost(draft_cost, len(frontier), level_started)
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
                            scores=torch.tensor(log_scores).exp(), source=getattr(drafter, "name", "draft"))
        return proposal, drafting_ms

    def _grow_sampled(self, state: DecodeState, drafter: StepDrafter, root_logprobs: Tensor,
                      other_scores: list[float]) -> tuple[Proposal, float]:
        sampling = state.sampling
        draft_cost = None if self.fixed_size else getattr(drafter, "cost_curve", None)
        draft_vocab = getattr(drafter, "draft_vocab", None)

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
                            scores=torch.tensor(scores, dtype=torch.float32), source=getattr(drafter, "name", "draft"),
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
