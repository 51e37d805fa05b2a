"""The benchmark's result records: a question, and what one method did with each of its turns.

The benchmark's run (`specpipe.tasks.bench_run`) makes them; its metrics, tables and report files read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specpipe.pipelines.pipeline import PreparedPrompt


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


@dataclass
class TurnOutput:
    """One turn of one question through one method."""

    tokens: list[int]
    seconds: float
    forwards: int  # target forwards, the prefill included
    accept_lengths: list[int]  # new tokens committed per forward
    # Of `tokens`, those that came from accepted draft nodes, in all and per proposer; None for
    # methods that cannot tell (transformers' generate). The rest are the target's bonus tokens.
    drafted: int | None = None
    drafted_by_source: dict[str, int] | None = None


@dataclass
class QuestionRun:
    """One question (all its turns) through one method."""

    question: Question
    method: str
    turns: list[TurnOutput] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    prompts: list[PreparedPrompt] = field(default_factory=list)  # per turn: the ids the method saw

    @property
    def new_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)

    @property
    def forwards(self) -> int:
        return sum(t.forwards for t in self.turns)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_ids(self) -> list[list[int]]:
        return [t.tokens for t in self.turns]
