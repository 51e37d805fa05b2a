"""The decode loop: Retrieve/Draft -> TreeBuild -> Verify -> Commit, one step at a time."""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specpipe import distributed
from specpipe.cost import OnlineCostCurve
from specpipe.pipelines.stopping import StopCondition
from specpipe.stages.base import LookaheadBranch, Proposer, StepDrafter, TreeBuilder, Verifier
from specpipe.stages.commit.kv_compact import KVCompactCommit
from specpipe.target import TargetModel
from specpipe.types import DecodeState, DraftTree, SamplingConfig, StepStats


@dataclass(frozen=True)
class StepOutput:
    """What one step committed. `drafted` of the tokens came from accepted draft nodes."""

    tokens: list[int]
    drafted: int
    stats: StepStats
    finished: bool


class SpeculativeDecoder:
    """Runs one sequence through the stages; owns no model state of its own.

    With no proposers (or when the tree builder drafts nothing) a step is exactly a plain
    decoding step: one query token through the target.
    """

    def __init__(self, target: TargetModel, proposers: list[Proposer], tree_builder: TreeBuilder | None,
                 verifier: Verifier, committer: KVCompactCommit | None = None,
                 drafters: list[StepDrafter] = (), forward_costs: OnlineCostCurve | None = None) -> None:
        self.target = target
        self.proposers = list(proposers)
        self.drafters = list(drafters)  # expanded by the tree builder itself (tree=eagle2)
        self.tree_builder = tree_builder
        self.verifier = verifier
        self.committer = committer or KVCompactCommit()
        self.forward_costs = forward_costs  # the tree builder's curve, taught each step's time

    def decode(self, prompt: list[int], stop: StopCondition, sampling: SamplingConfig = SamplingConfig(),
               documents: tuple[tuple[int, ...], ...] = ()) -> Iterator[StepOutput]:
        seed = sampling.seed
        if seed is None and not sampling.greedy and distributed.active():
            # tensor-parallel ranks must sample the same tokens: one fresh seed, drawn on rank 0 from
            # the OS (torch.seed() would also reseed rank 0's global generator, and only rank 0's)
            seed = distributed.broadcast_from_main(int.from_bytes(os.urandom(8), "little") >> 1)
        rng = torch.Generator().manual_seed(seed) if seed is not None else None
        cache = self.target.new_cache()
        clock = time.perf_counter
        started = clock()
        first = self.target.prefill(prompt, cache)
        result = self.verifier.accept(DraftTree.empty(), first.logits, rng, sampling)
        emitted, finished = stop.cut([result.bonus])
        state = DecodeState(tokens=list(prompt) + emitted, prompt_length=len(prompt), sampling=sampling,
                            hidden=first.hidden[-1], logits=first.logits[-1], prompt_hidden=first.hidden,
                            prompt_aux_hidden=first.aux_hidden,
                            documents=documents, rng=rng)
        yield StepOutput(emitted, 0, StepStats(1, 0, {"prefill": clock() - started}), finished)
        stages = [*self.proposers, *self.drafters]
        # Stages with a lookahead branch (drafter=jacobi) add query rows to every verify forward.
        branches = [stage for stage in stages if isinstance(stage, LookaheadBranch)]
        for stage in stages:
            stage.reset(state)
        first_step = True
        while not finished:
            seconds: dict[str, float] = {}
            step_started = mark = clock()
            proposals = [proposer.propose(state) for proposer in self.proposers]
            seconds["propose"] = clock() - mark

            mark = clock()
            riding = [(branch, branch.lookahead_rows(state)) for branch in branches]
            riding = [(branch, rows) for branch, rows in riding if rows is not None and len(rows)]
            state.lookahead_rows = sum(len(rows) for _, rows in riding)
            lookahead_seconds = clock() - mark

            mark = clock()
            built = self.tree_builder is not None and bool(proposals or self.drafters)
            tree = self.tree_builder.build(state, proposals, self.drafters) if built else DraftTree.empty()
            seconds["tree"] = clock() - mark
            # the draft levels' time as the builder priced them (drafters' own curves)
            drafting_ms = getattr(self.tree_builder, "last_drafting_ms", 0.0) if built else 0.0

            mark = clock()
            forward = self.target.forward_tree(state.tokens[-1], tree, cache, [rows for _, rows in riding])
            seconds["forward"] = clock() - mark
            query_rows = len(tree) + 1 + state.lookahead_rows

            mark = clock()
            for (branch, _), logits in zip(riding, forward.lookahead_logits):
                branch.on_lookahead(state, logits)  # before the commit: the rows were built on this root
            if branches:  # pipelines without a lookahead branch report the same stages as before
                seconds["lookahead"] = lookahead_seconds + clock() - mark

            mark = clock()
            result = self.verifier.accept(tree, forward.logits, rng, sampling)
            result = dataclasses.replace(result, hidden=forward.hidden, aux_hidden=forward.aux_hidden)
            tree_tokens = tree.tokens.tolist()
            emitted, finished = stop.cut([tree_tokens[i] for i in result.accepted] + [result.bonus])
            seconds["verify"] = clock() - mark

            mark = clock()
            self.committer.commit(state, cache, tree, result, emitted)
            for stage in stages:
                stage.on_commit(state, result)
            seconds["commit"] = clock() - mark

            drafted = min(len(result.accepted), len(emitted))
            by_source: dict[str, int] = {}
            for node in result.accepted[:drafted]:
                source = tree.sources[node] if tree.sources else "draft"
                by_source[source] = by_source.get(source, 0) + 1
            if self.forward_costs is not None and not first_step:
                # Trees are sized for expected tokens per millisecond of the whole step, which costs more than
                # its verify forward: the proposers, a drafter's first forward (feeding the committed rows),
                # verify, commit (bf16 `eagle` on the 2-core EPYC: ~2 ms of an 11 ms step). Priced at the
                # forward alone, those fixed costs were missing from every tree's price, so extra rows looked
                # dearer, against the step, than they are. The draft levels are left out: the builder prices
                # them itself, with the drafters' own curves. The caller's time between steps is not the
                # decoder's and is left out too.
                # The first step after a prefill finds the caches full of the prompt's work: 4-8% slower than
                # the next ones (2-core Zen 5, fp32 and bf16), and it would price one row as if all were so
                self.forward_costs.observe(query_rows, 1000.0 * (clock() - step_started) - drafting_ms)
            first_step = False
            if finished:
                for stage in stages:
                    finish = getattr(stage, "on_finish", None)  # optional: stages before it need not change
                    if finish is not None:
                        finish(state)
            yield StepOutput(emitted, drafted, StepStats(len(emitted), len(tree), seconds, by_source), finished)
