"""What the decode loop measures, kept out of the loop: each step's stage times and what they teach.

`StepObserver` times the stages of every sequence of a step (the `seconds` of its StepStats) and, once the
step has ended, learns from its time what a step costs: the online cost curve (a step of one sequence), what
each further sequence of a batch adds (a batched step) and the speculation gate's rates.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from specpipe.cost import OnlineCostCurve
from specpipe.stages.base import TreeBuilder

if TYPE_CHECKING:
    from specpipe.pipelines.speculation_gate import SpeculationGate

clock = time.perf_counter

# The order StepStats.seconds lists a step's stages in (`prefill` for the first step of a sequence). A lookahead
# branch's time is listed after the forward: it is building its rows and reading their logits after it.
STAGE_ORDER = ("prefill", "propose", "tree", "forward", "lookahead", "verify", "commit")


class RunningMean:
    """A mean over recent values (exponential decay over about `memory` of them)."""

    def __init__(self, memory: float = 64.0) -> None:
        self._keep = 1.0 - 1.0 / memory
        self._weight = 0.0
        self._sum = 0.0

    def add(self, value: float) -> None:
        self._weight = self._weight * self._keep + 1.0
        self._sum = self._sum * self._keep + value

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight else 0.0


class StepObserver:
    """Times the stages of the decode loop and learns from each step's time.

    `forward_costs`: the tree builder's online cost curve (cost_curve=online), taught each step's time; None
    keeps the curve as measured. `sequence_ms`: what each further sequence of a batch adds to a step beyond its
    rows on the cost curve (its attention, proposers, verify and commit): in a batch, what the other sequences add
    to a tree's price.
    """

    def __init__(self, tree_builder: TreeBuilder | None, forward_costs: OnlineCostCurve | None = None) -> None:
        self.tree_builder = tree_builder
        self.forward_costs = forward_costs
        self._sequence_ms = RunningMean()
        self._step_started = 0.0

    @property
    def sequence_ms(self) -> float:
        return self._sequence_ms.value

    # ---- timing -----------------------------------------------------------------------------------------
    @contextmanager
    def timing(self, stage: str, *records: dict[str, float], shared: bool = False) -> Iterator[None]:
        """Adds the time of the block to `stage` in each of `records` (a sequence's stage seconds): all of it to
        each, or with `shared` an equal share to each. Nothing where the block raises."""
        mark = clock()
        yield
        seconds = clock() - mark
        if shared:
            seconds /= len(records)
        for record in records:
            record[stage] = record.get(stage, 0.0) + seconds

    @staticmethod
    def in_order(seconds: dict[str, float]) -> dict[str, float]:
        """A sequence's stage seconds in the order of STAGE_ORDER."""
        return {stage: seconds[stage] for stage in STAGE_ORDER if stage in seconds}

    # ---- learning ---------------------------------------------------------------------------------------
    def start_step(self) -> None:
        self._step_started = clock()

    def end_step(self, plans: Iterable, results: list, total_rows: int, speculated: bool,
                 gate: SpeculationGate | None) -> None:
        """After a step: `plans`, the decoder's plans of the sequences that did not fail; `results`, per sequence of
        the batch its StepOutput or the exception that failed it; `total_rows` verified in the step's forward.
        Teaches the gate (None: none) whether speculating paid."""
        self._learn_step_cost(list(plans), total_rows)
        if gate is not None:
            gate.observe(len(results), speculated, committed_tokens(results), self._step_milliseconds())

    def end_step_drafting(self, results: list, drafted: bool, draft_gate: SpeculationGate, measured: bool) -> None:
        """After a step, teaches the draft gate whether growing the drafters paid: a speculating step's tokens per ms,
        drafted or of the proposers' trees alone; a plain step (`measured` false) only that the drafters fell
        behind (the next drafted step catches up)."""
        draft_gate.observe(len(results), drafted, committed_tokens(results),
                           self._step_milliseconds() if measured else 0.0)

    def _step_milliseconds(self) -> float:
        return 1000.0 * (clock() - self._step_started)

    def _learn_step_cost(self, plans: list, total_rows: int) -> None:
        """Learns what a step costs. Trees are sized for expected tokens per millisecond of the whole step, which
        costs more than its verify forward: the proposers, a drafter's first forward (feeding the committed rows),
        verify, commit. Priced at the forward alone, those fixed costs would be missing from every tree's price,
        so extra rows would look dearer, against the step, than they are. The draft levels are left out: the
        builder prices them itself, with the drafters' own curves.

        A step of one sequence teaches the online cost curve (its rows, the step's milliseconds). A batched step
        teaches what each further sequence adds beyond its rows on the curve (its attention over its own cache,
        its proposers, verify and commit): `StepBudget.milliseconds` prices a tree's batch with it."""
        if not plans:
            return
        drafting_ms = sum(plan.tree.drafting_ms for plan in plans)
        step_ms = self._step_milliseconds() - drafting_ms
        if len(plans) > 1:
            curve = self.forward_costs or (self.tree_builder.cost_curve if self.tree_builder is not None else None)
            if curve is not None:
                self._sequence_ms.add(max(step_ms - curve(total_rows), 0.0) / (len(plans) - 1))
            return
        # The first step after a prefill finds the caches full of the prompt's work, and would price one
        # row as if all were so
        (plan,) = plans
        if self.forward_costs is not None and plan.sequence.steps > 1:
            self.forward_costs.observe(total_rows, step_ms)


def committed_tokens(results: list) -> int:
    """The tokens a step committed: `results` per sequence its StepOutput, the exception that failed it, or None."""
    return sum(len(result.tokens) for result in results if result is not None and not isinstance(result, BaseException))
