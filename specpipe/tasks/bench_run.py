"""The benchmark's run loop: after an uncounted warm-up, every question through every method in turn, each method
carrying its own answers into a question's later turns, and every method answering the very same prompt ids
(`Pipeline.prepare` of the chat messages, which for a RAG pipeline retrieves chunks for the turn's question and
renders them into its message, before the methods' clocks start). Methods are interleaved question by question so
that the machine's slow drift hits them alike, and a run cut short (time limit, Ctrl-C, SIGTERM) keeps only the
questions every method finished, so each comparison stays question by question.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm import tqdm

from specpipe.pipelines.pipeline import Pipeline, PreparedPrompt
from specpipe.stages.retrieve.past_outputs import PastOutputsRetriever
from specpipe.tasks.bench_methods import Method, PipelineDecode
from specpipe.tasks.bench_records import Question, QuestionRun


def prepare_prompt(pipeline: Pipeline, messages: list[dict], prepared: dict[str, PreparedPrompt]) -> PreparedPrompt:
    """`pipeline.prepare(messages)`, once per distinct conversation of a question: the methods' first
    turns, and later turns where their earlier answers agree, get the very same ids and retrieval."""
    key = json.dumps(messages, sort_keys=True)
    if key not in prepared:
        prepared[key] = pipeline.prepare(messages)
    return prepared[key]


def run_question(pipeline: Pipeline, method_name: str, method: Method, question: Question,
                 max_new_tokens: int, prepared: dict[str, PreparedPrompt] | None = None) -> QuestionRun:
    """All turns of one question; the method's own answer goes into the next turn's messages.
    `prepared` memoizes the prompts across the methods run on this question."""
    prepared = {} if prepared is None else prepared
    run = QuestionRun(question, method_name)
    messages: list[dict] = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        prompt = prepare_prompt(pipeline, messages, prepared)
        output = method(prompt, max_new_tokens)
        text = pipeline.decode_text(output.tokens)
        run.turns.append(output)
        run.texts.append(text)
        run.prompts.append(prompt)
        messages.append({"role": "assistant", "content": text})
    return run


@contextmanager
def learning_paused(*pipelines: Pipeline) -> Iterator[None]:
    """Stages that learn from finished answers (the store of past outputs) learn nothing during the
    warm-up: the counted run of the same question would otherwise draft from its own earlier answer."""
    learners = [p for pipeline in pipelines for p in pipeline.decoder.proposers
                if isinstance(p, PastOutputsRetriever) and p.learn is True]
    for proposer in learners:
        proposer.learn = False
    try:
        yield
    finally:
        for proposer in learners:
            proposer.learn = True


@dataclass
class MethodRuns:
    """What `run_methods` measured: every method's run of each question it finished, in order, and why
    it stopped before the last question (None when it ran them all)."""

    runs: list[QuestionRun]
    stopped: str | None = None


def run_methods(pipeline: Pipeline, methods: dict[str, Method], questions: Sequence[Question],
                max_new_tokens: int, warmup: int = 1, progress: bool = True,
                time_limit_s: float | None = None) -> MethodRuns:
    """Warms every method up on the first `warmup` questions (not counted), then runs each question
    through every method in turn (interleaved, so slow drift of the machine hits all methods alike).

    It stops early, keeping only questions that every method finished (so each comparison stays
    question by question), when the next question would end past `time_limit_s` (seconds from the
    start of the warm-up; judged by the mean time of the questions so far), or on KeyboardInterrupt
    (Ctrl-C, or SIGTERM under `stop_signals_interrupt`) once at least one question is done."""
    started = time.monotonic()
    # the pipelines that decode here: the configured one and bench.compare's (each once)
    decoding = [method.pipeline for method in methods.values() if isinstance(method, PipelineDecode)]
    with learning_paused(*decoding):
        for question in questions[:warmup]:
            prepared: dict[str, PreparedPrompt] = {}
            for name, method in methods.items():
                run_question(pipeline, name, method, question, max_new_tokens, prepared)
    measured = MethodRuns([])
    counted = time.monotonic()
    with tqdm(total=len(questions) * len(methods), desc="bench", unit="run", disable=not progress,
              file=sys.stderr) as bar:
        for done, question in enumerate(questions):
            if time_limit_s is not None and done > 0:
                now = time.monotonic()
                if now - started + (now - counted) / done > time_limit_s:  # + the mean question's time
                    measured.stopped = (f"bench.time_limit_s={time_limit_s:g}: stopped after {done} of "
                                        f"{len(questions)} questions")
                    break
            prepared = {}
            finished = []
            try:
                for name, method in methods.items():
                    bar.set_postfix_str(f"{question.category} #{question.question_id} {name}", refresh=False)
                    finished.append(run_question(pipeline, name, method, question, max_new_tokens, prepared))
                    bar.update()
            except KeyboardInterrupt:
                if done == 0:
                    raise
                measured.stopped = f"interrupted: stopped after {done} of {len(questions)} questions"
                break
            measured.runs.extend(finished)
    return measured


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM (a job scheduler's or `timeout`'s end of the time) raises KeyboardInterrupt while the
    benchmark runs, as Ctrl-C does, so the questions already finished are still reported."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
