"""The decode loop: Retrieve/Draft -> TreeBuild -> Verify -> Commit, one step at a time, for one sequence
or for a batch of them verified in one target forward.

`SpeculativeDecoder.start` prefills a request and returns its `Sequence` (`begin` and `advance`: the same a
forward at a time); `step` advances every sequence of a batch by one step; `decode` is the loop for one sequence
alone (a batch of one). The batch engine (specpipe.serving) calls `begin`, `advance` and `step`; nothing else
decodes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

import specpipe.distributed as distributed
from specpipe.cost import OnlineCostCurve
from specpipe.pipelines.speculation_gate import SpeculationGate
from specpipe.pipelines.step_observer import StepObserver
from specpipe.pipelines.stopping import StopCondition
from specpipe.prefix_cache import PrefillInProgress, PrefixCache
from specpipe.stages.base import Committer, LookaheadBranch, Proposer, StepDrafter, TreeBuilder, Verifier
from specpipe.target import TargetModel, VerifyRows
from specpipe.types import NO_BUDGET, DecodeState, DraftTree, SamplingConfig, StepBudget, StepStats


@dataclass(frozen=True)
class StepOutput:
    """What one step committed. `drafted` of the tokens came from accepted draft nodes."""

    tokens: list[int]
    drafted: int
    stats: StepStats
    finished: bool
    reused_prompt_tokens: int = 0  # the prefill's: prompt tokens whose rows came from the prefix cache


@dataclass(eq=False)
class Sequence:
    """One request being decoded: its state (tokens, stage state, generator), its target cache and when it stops."""

    state: DecodeState
    cache: object  # the target's PositionIndexedCache: it covers every committed token but the last
    stop: StopCondition
    finished: bool = False
    steps: int = 0  # steps after the prefill
    # With a prefix cache: the target's hidden states (and captured layers' states) of the rows the cache holds, in
    # order (the prompt's, then each step's committed rows), so a finished sequence's rows can be kept for a prompt
    # that goes on from it (a conversation's next turn)
    row_hidden: list = field(default_factory=list)
    row_aux_hidden: list = field(default_factory=list)


@dataclass(eq=False)
class Starting:
    """A request being prefilled (`SpeculativeDecoder.begin`); `sequence` and its first step `output` once started."""

    prompt: list[int]
    stop: StopCondition
    sampling: SamplingConfig
    documents: tuple[tuple[int, ...], ...]
    rng: torch.Generator | None
    cache: object  # the target's PositionIndexedCache being filled
    seconds: dict[str, float] = field(default_factory=dict)  # the prefill's time (StepObserver.timing)
    prefill: PrefillInProgress | None = None  # through a prefix cache; None: one forward of the whole prompt
    sequence: Sequence | None = None
    output: StepOutput | None = None


@dataclass(eq=False)
class _Plan:
    """One sequence's part of a step while it is being put together."""

    sequence: Sequence
    proposals: list = field(default_factory=list)
    riding: list = field(default_factory=list)  # (lookahead branch, its LookaheadRows)
    tree: DraftTree = field(default_factory=DraftTree.empty)
    seconds: dict[str, float] = field(default_factory=dict)  # per stage (StepObserver.timing)
    plain: bool = False  # a plain step: nothing proposed or drafted (SpeculationGate)
    undrafted: bool = False  # a step of the proposers' trees alone: no drafter grown (the decoder's draft_gate)

    @property
    def rows(self) -> int:
        return 1 + len(self.tree) + self.sequence.state.lookahead_rows


class SpeculativeDecoder:
    """Runs sequences through the stages; owns no per-sequence state of its own.

    With no proposers (or when the tree builder drafts nothing) a step is exactly a plain
    decoding step: one query token per sequence through the target.

    A batched step: every sequence proposes and builds its tree, one tree at a time, each priced against the
    whole step (`DecodeState.budget`: the rows and expected tokens of the batch's other sequences, so under load
    trees shrink until speculation stops paying); then the nodes kept across the batch are chosen once more
    together (`_trim`); one target forward verifies every sequence's rows (TargetModel.forward_trees); each
    sequence verifies and commits alone. A stage that fails for one sequence fails that sequence only.

    What the loop measures (each stage's time, what a step costs) is the `observer`'s (StepObserver).
    """

    def __init__(self, target: TargetModel, proposers: list[Proposer], tree_builder: TreeBuilder | None,
                 verifier: Verifier, committer: Committer, drafters: list[StepDrafter] = (),
                 forward_costs: OnlineCostCurve | None = None, gate: SpeculationGate | None = None,
                 prefix_cache: PrefixCache | None = None, draft_gate: SpeculationGate | None = None) -> None:
        self.target = target
        self.proposers = list(proposers)
        self.drafters = list(drafters)  # expanded by the tree builder itself (tree=eagle2)
        self.tree_builder = tree_builder
        self.verifier = verifier
        self.committer = committer
        self.gate = gate  # whether a batched step speculates, measured against plain steps (None: it always does)
        # whether a batched speculating step grows the drafters too, measured against steps of the proposers' trees
        # alone (None: it always does): under load a draft model's or head's levels can cost more than they add
        # while the proposers' nodes, drafted for free, still pay, so speculation backs off a source at a time
        self.draft_gate = draft_gate
        self.prefix_cache = prefix_cache  # prompt prefixes' rows kept for later prompts (None: every prefill whole)
        # times the stages; teaches `forward_costs` (the tree builder's online curve) each step's time
        self.observer = StepObserver(tree_builder, forward_costs)
        self.stages = [*self.proposers, *self.drafters]
        # Stages with a lookahead branch (drafter=jacobi) add query rows to every verify forward.
        self.branches = [stage for stage in self.stages if isinstance(stage, LookaheadBranch)]
        self._rotation = 0  # which sequence builds its tree first: rotated so that no request is always last

    # ---- one sequence -----------------------------------------------------------------------------------
    def decode(self, prompt: list[int], stop: StopCondition, sampling: SamplingConfig = SamplingConfig(),
               documents: tuple[tuple[int, ...], ...] = ()) -> Iterator[StepOutput]:
        """One sequence decoded alone, step by step (the prefill's token first)."""
        sequence, first = self.start(prompt, stop, sampling, documents)
        yield first
        while not sequence.finished:
            (output,) = self.step([sequence])
            if isinstance(output, BaseException):
                raise output
            yield output

    def start(self, prompt: list[int], stop: StopCondition, sampling: SamplingConfig = SamplingConfig(),
              documents: tuple[tuple[int, ...], ...] = ()) -> tuple[Sequence, StepOutput]:
        """Prefills the prompt into a new cache and commits the target's first token."""
        starting = self.begin(prompt, stop, sampling, documents)
        while not self.advance(starting):
            pass
        return starting.sequence, starting.output

    def begin(self, prompt: list[int], stop: StopCondition, sampling: SamplingConfig = SamplingConfig(),
              documents: tuple[tuple[int, ...], ...] = ()) -> Starting:
        """A request to prefill a forward at a time (`advance`), so that a batch engine can run its decoding steps
        between the forwards of a long prompt: with a prefix cache, its chunks (prefix_cache.chunk_tokens); without
        one, the whole prompt in one forward."""
        seed = sampling.seed
        if seed is None and not sampling.greedy and distributed.active():
            # tensor-parallel ranks must sample the same tokens: one fresh seed, drawn on rank 0 from
            # the OS (torch.seed() would also reseed rank 0's global generator, and only rank 0's)
            seed = distributed.broadcast_from_main(int.from_bytes(os.urandom(8), "little") >> 1)
        rng = torch.Generator().manual_seed(seed) if seed is not None else None
        starting = Starting(list(prompt), stop, sampling, documents, rng, self.target.new_cache())
        if self.prefix_cache is not None:
            with self.observer.timing("prefill", starting.seconds):
                starting.prefill = self.prefix_cache.begin(self.target, starting.prompt, starting.cache)
        return starting

    def advance(self, starting: Starting) -> bool:
        """Runs the next forward of `starting`'s prefill; after its last, commits the target's first token
        (`starting.sequence` and its first step `starting.output`). True once the request has started."""
        if starting.sequence is not None:
            return True
        prompt, sampling, stop = starting.prompt, starting.sampling, starting.stop
        with self.observer.timing("prefill", starting.seconds):
            if starting.prefill is None:
                first, reused = self.target.prefill(prompt, starting.cache), 0
            elif not starting.prefill.advance():
                return False
            else:
                first, reused = starting.prefill.result.output, starting.prefill.result.reused_tokens
            result = self.verifier.accept(DraftTree.empty(), first.logits, starting.rng, sampling)
            emitted, finished = stop.cut([result.bonus])
            state = DecodeState(tokens=list(prompt) + emitted, prompt_length=len(prompt), sampling=sampling,
                                hidden=first.hidden[-1], logits=first.logits[-1], prompt_hidden=first.hidden,
                                prompt_aux_hidden=first.aux_hidden, documents=starting.documents, rng=starting.rng)
        sequence = Sequence(state, starting.cache, stop, finished)
        if self.prefix_cache is not None:
            sequence.row_hidden.append(first.hidden)
            if first.aux_hidden is not None:
                sequence.row_aux_hidden.append(first.aux_hidden)
            if finished:
                self._keep_rows(sequence)
        starting.output = StepOutput(emitted, 0, StepStats(1, 0, starting.seconds), finished,
                                     reused_prompt_tokens=reused)
        for stage in self.stages:
            stage.reset(state)
        starting.sequence = sequence
        return True

    # ---- one step of a batch ----------------------------------------------------------------------------
    def step(self, batch: list[Sequence]) -> list[StepOutput | BaseException]:
        """Advances every sequence of `batch` (none finished) by one step, verified in one target forward.
        Returns per sequence its StepOutput, or the exception that failed it (it is then finished)."""
        self.observer.start_step()
        results: list[StepOutput | BaseException | None] = [None] * len(batch)
        speculate = self.gate is None or self.gate.speculate(len(batch))
        # a sampled request speculates and drafts in any batch: its seed must give the same tokens whatever else runs
        draft = not speculate or self.draft_gate is None or self.draft_gate.speculate(len(batch))
        plans = {index: _Plan(sequence, plain=not speculate and sequence.state.sampling.greedy,
                              undrafted=not draft and sequence.state.sampling.greedy)
                 for index, sequence in enumerate(batch)}
        self._each(plans, results, self._propose)  # Retrieve / Draft
        self._build_trees(plans, results)  # TreeBuild
        if len(plans) > 1:
            self._trim(plans)
        forwards = self._forward(plans, results)  # Verify: every sequence's rows in one target forward
        total_rows = sum(plan.rows for plan in plans.values())
        for index, plan in list(plans.items()):  # Verify (accept) and Commit, each sequence alone
            try:
                results[index] = self._verify_and_commit(plan, forwards[index], total_rows, len(forwards))
            except Exception as error:  # noqa: BLE001 - a stage's failure is this sequence's alone
                self._fail(plan.sequence, results, index, error)
                del plans[index]
        self.observer.end_step(plans.values(), results, total_rows, speculate, self.gate)
        if self.draft_gate is not None:
            # a plain step only tells it that the drafters fell behind; so does a step where sampled requests drafted
            # and greedy ones did not (neither kind to measure)
            mixed = not draft and any(not plan.undrafted for plan in plans.values())
            self.observer.end_step_drafting(results, speculate and draft, self.draft_gate,
                                            measured=speculate and not mixed)
        return results

    def _each(self, plans: dict[int, _Plan], results: list, work) -> None:
        for index, plan in list(plans.items()):
            try:
                work(plan)
            except Exception as error:  # noqa: BLE001
                self._fail(plan.sequence, results, index, error)
                del plans[index]

    def _propose(self, plan: _Plan) -> None:
        state = plan.sequence.state
        if plan.plain:
            state.lookahead_rows = 0
            return
        with self.observer.timing("propose", plan.seconds):
            plan.proposals = [proposer.propose(state) for proposer in self.proposers]
        with self._lookahead_timing(plan):
            riding = [(branch, branch.lookahead_rows(state)) for branch in self.branches]
            plan.riding = [(branch, rows) for branch, rows in riding if rows is not None and len(rows)]
            state.lookahead_rows = sum(len(rows) for _, rows in plan.riding)

    def _lookahead_timing(self, plan: _Plan) -> AbstractContextManager:
        """Times a lookahead branch's work for the step's `lookahead` seconds (none without a branch)."""
        return self.observer.timing("lookahead", plan.seconds) if self.branches else nullcontext()

    def _build_trees(self, plans: dict[int, _Plan], results: list) -> None:
        """Each sequence's tree, priced against the rest of the batch as it stands when the tree is built (the
        others' plain rows, or the trees they have built already). Where the tree builder grows drafters for the
        whole batch at once (`build_many`: one draft forward per level for all sequences), every tree is priced
        against the others' plain rows, and `_trim` chooses among the nodes afterwards."""
        building = [index for index, plan in plans.items()
                    if self.tree_builder is not None and not plan.plain
                    and (plan.proposals or (self.drafters and not plan.undrafted))]
        for plan in plans.values():
            plan.seconds["tree"] = 0.0
        undrafted = [index for index in building if plans[index].undrafted]
        for index in undrafted:  # the proposers' trees alone
            self._build_one(plans, results, index, drafters=[])
        building = [index for index in building if index not in undrafted]
        if self.drafters and len(building) > 1 and self.tree_builder.batches_drafters:
            for index in building:
                self._set_budget(plans, index)
            try:
                with self.observer.timing("tree", *(plans[i].seconds for i in building), shared=True):
                    trees = self.tree_builder.build_many([plans[i].sequence.state for i in building],
                                                         [plans[i].proposals for i in building], self.drafters)
            except Exception:  # noqa: BLE001 - find whose build fails: each alone
                trees = None
            finally:
                for index in building:
                    plans[index].sequence.state.budget = NO_BUDGET
            if trees is not None:
                for index, tree in zip(building, trees):
                    plans[index].tree = tree
                return
        order = sorted(building)
        if order:
            self._rotation = (self._rotation + 1) % len(order)
            order = order[self._rotation:] + order[:self._rotation]
        for index in order:
            self._build_one(plans, results, index, self.drafters)

    def _build_one(self, plans: dict[int, _Plan], results: list, index: int, drafters: list[StepDrafter]) -> None:
        """Sequence `index`'s tree alone, priced against the batch as it stands."""
        plan = plans.get(index)
        if plan is None:
            return
        self._set_budget(plans, index)
        try:
            with self.observer.timing("tree", plan.seconds):
                plan.tree = self.tree_builder.build(plan.sequence.state, plan.proposals, drafters)
        except Exception as error:  # noqa: BLE001
            self._fail(plan.sequence, results, index, error)
            del plans[index]
        finally:
            plan.sequence.state.budget = NO_BUDGET

    def _set_budget(self, plans: dict[int, _Plan], index: int) -> None:
        """What the rest of the batch puts in the step, for sequence `index`'s tree builder (DecodeState.budget)."""
        others = [other for key, other in plans.items() if key != index]
        state = plans[index].sequence.state
        # a sampled request's tree is sized as if it were alone: a tree of another shape would draw other
        # numbers from its generator, and its seed would no longer give the same tokens in any batch
        state.budget = NO_BUDGET if not others or not state.sampling.greedy else StepBudget(
            rows=sum(other.rows for other in others),
            tokens=sum(other.tree.expected_tokens for other in others),
            milliseconds=sum(other.tree.drafting_ms for other in others) + len(others) * self.observer.sequence_ms)

    def _trim(self, plans: dict[int, _Plan]) -> None:
        """The batch's nodes chosen together: every tree's scored nodes ranked by their chance of acceptance, and
        the best prefix kept by expected tokens per millisecond of the whole step. Each tree was priced against
        the others as they stood when it was built; this corrects for the order they were built in. The trees of
        sampled requests (see `_build_trees`), or without scores, are kept whole."""
        curve = self.tree_builder.cost_curve if self.tree_builder is not None else None
        if curve is None:
            return
        fixed_rows, fixed_tokens, candidates = 0, 0.0, []
        milliseconds = sum(plan.tree.drafting_ms for plan in plans.values()) + \
            (len(plans) - 1) * self.observer.sequence_ms
        for index, plan in plans.items():
            tree = plan.tree
            fixed_rows += 1 + plan.sequence.state.lookahead_rows
            if not self._trimmable(plan):
                fixed_rows += len(tree)
                fixed_tokens += tree.expected_tokens
                continue
            fixed_tokens += 1.0
            candidates += [(-score, index, node) for node, score in enumerate(tree.scores.tolist())]
        if not candidates:
            return
        candidates.sort()
        best_count, best_rate, expected = 0, fixed_tokens / (curve(fixed_rows) + milliseconds), fixed_tokens
        for count, (negative_score, _, _) in enumerate(candidates, start=1):
            expected -= negative_score
            rate = expected / (curve(fixed_rows + count) + milliseconds)
            if rate > best_rate:
                best_count, best_rate = count, rate
        kept: dict[int, set[int]] = {}
        for _, index, node in candidates[:best_count]:
            kept.setdefault(index, set()).add(node)
        for index, plan in plans.items():
            tree = plan.tree
            if not self._trimmable(plan) or len(kept.get(index, ())) == len(tree):
                continue
            nodes, parents = [], tree.parents.tolist()
            chosen = kept.get(index, set())
            for node in range(len(tree)):  # parents first: a node stays only with its whole path
                if node in chosen and (parents[node] < 0 or parents[node] in nodes):
                    nodes.append(node)
            plan.tree = tree.keep(nodes)

    @staticmethod
    def _trimmable(plan: _Plan) -> bool:
        tree = plan.tree
        return tree.scores is not None and tree.draft_probs is None and plan.sequence.state.sampling.greedy

    def _forward(self, plans: dict[int, _Plan], results: list) -> dict[int, object]:
        """Every sequence's rows in one target forward; where that fails, each sequence alone (so that one
        sequence's failure fails it only)."""
        with self.observer.timing("forward", *(plan.seconds for plan in plans.values())):
            return self._forward_rows(plans, results)

    def _forward_rows(self, plans: dict[int, _Plan], results: list) -> dict[int, object]:
        order = list(plans)
        batch = [VerifyRows(plans[i].sequence.state.tokens[-1], plans[i].tree, plans[i].sequence.cache,
                            tuple(rows for _, rows in plans[i].riding)) for i in order]
        try:
            return dict(zip(order, self.target.forward_trees(batch)))
        except Exception as error:  # noqa: BLE001
            if len(order) == 1:
                self._fail(plans[order[0]].sequence, results, order[0], error)
                del plans[order[0]]
                return {}
        forwards = {}
        for index, rows in zip(order, batch):
            try:
                forwards[index] = self.target.forward_trees([rows])[0]
            except Exception as error:  # noqa: BLE001
                self._fail(plans[index].sequence, results, index, error)
                del plans[index]
        return forwards

    def _verify_and_commit(self, plan: _Plan, forward, total_rows: int, batch_size: int) -> StepOutput:
        sequence, tree, seconds = plan.sequence, plan.tree, plan.seconds
        state = sequence.state
        with self._lookahead_timing(plan):
            for (branch, _), logits in zip(plan.riding, forward.lookahead_logits):
                branch.on_lookahead(state, logits)  # before the commit: the rows were built on this root

        with self.observer.timing("verify", seconds):
            result = self.verifier.accept(tree, forward.logits, state.rng, state.sampling)
            result = dataclasses.replace(result, hidden=forward.hidden, aux_hidden=forward.aux_hidden)
            tree_tokens = tree.tokens.tolist()
            emitted, finished = sequence.stop.cut([tree_tokens[i] for i in result.accepted] + [result.bonus])

        with self.observer.timing("commit", seconds):
            cached = len(state.tokens) - 1  # the rows before this step's forward
            self.committer.commit(state, sequence.cache, tree, result, emitted)
            if self.prefix_cache is not None:  # the rows it kept: the root's, then the accepted path's
                rows = ([0] + [node + 1 for node in result.accepted])[:sequence.cache.get_seq_length() - cached]
                sequence.row_hidden.append(forward.hidden[rows])
                if forward.aux_hidden is not None:
                    sequence.row_aux_hidden.append(forward.aux_hidden[rows])
            for stage in self.stages:
                stage.on_commit(state, result)

        drafted = min(len(result.accepted), len(emitted))
        by_source: dict[str, int] = {}
        for node in result.accepted[:drafted]:
            source = tree.sources[node] if tree.sources else "draft"
            by_source[source] = by_source.get(source, 0) + 1
        sequence.steps += 1
        sequence.finished = finished
        if finished:
            self._finish(sequence)
        stats = StepStats(len(emitted), len(tree), self.observer.in_order(seconds), by_source, rows=plan.rows,
                          batch_rows=total_rows, batch_size=batch_size)
        return StepOutput(emitted, drafted, stats, finished)

    # ---- the end of a sequence --------------------------------------------------------------------------
    def _fail(self, sequence: Sequence, results: list, index: int, error: BaseException) -> None:
        sequence.finished = True
        results[index] = error
        sequence.cache.crop(max(len(sequence.state.tokens) - 1, 0))  # a failed forward's rows are not committed

    def _finish(self, sequence: Sequence) -> None:
        for stage in self.stages:
            stage.on_finish(sequence.state)
        if self.prefix_cache is not None:
            self._keep_rows(sequence)

    def _keep_rows(self, sequence: Sequence) -> None:
        """Keeps the whole blocks of a finished sequence's cached rows (its prompt's and its answer's) in the prefix
        cache, for a prompt that goes on from it."""
        hidden = torch.cat(sequence.row_hidden)
        aux_hidden = torch.cat(sequence.row_aux_hidden) if sequence.row_aux_hidden else None
        rows = min(sequence.cache.get_seq_length(), len(sequence.state.tokens) - 1, hidden.shape[0])
        self.prefix_cache.keep(self.target, sequence.state.tokens[:rows], sequence.cache, hidden[:rows],
                               aux_hidden[:rows] if aux_hidden is not None else None)
        sequence.row_hidden, sequence.row_aux_hidden = [], []
