"""Interleaved A/B of pipelines in one process: accepted tokens, speed and where each step's time goes.

The benchmark (`python run.py task=bench`) compares methods each on its own; on a VM whose speed
drifts by 15-25% within minutes, small differences between two variants of one pipeline need
both in one process, taking turns question by question (two rounds, the second in reverse
order). Per-stage times are the decoder's own `StepStats` (propose, tree = drafting and tree
building, forward = the verify forward, verify, commit), per step after the prefill.

    python bench/stage_profile.py --dtype fp32 --prompts bench/dev_chat_prompts.jsonl \\
        eagle eagle@full_vocab 'eagle_mix+pipeline.tree.max_nodes=16'

A method is a pipeline name, `+override` for each config override of its own (`++override` for
an override that starts with `+`, e.g. `rag_lookahead++retriever@pipeline.proposers.rest=token_datastore`),
and optionally `@full_vocab`: its drafters hand the tree builder log-probs over the whole vocabulary even where
their head scores a reduced one (how EAGLE drafted before run 16). `vanilla` (the first pipeline
without drafting) is always added. `--warmup` questions (1) go through every method first, uncounted
(what a pipeline loads at its first request, such as a RAG store, would otherwise fall on whichever method
meets the first question first). First turns only; each question is a new request. Stages that learn
from finished answers (the store of past outputs) learn nothing here: the second round would draft from
the first round's answer to the same question. `task=bench` measures them learning across questions.
"""
from __future__ import annotations

import argparse
import collections
import re
import time

from specpipe.pipelines.pipeline import Pipeline
from specpipe.tasks.bench_questions import read_questions, resolve_prompts_path, select_questions
from specpipe.tasks.bench_run import learning_paused

STAGES = ("propose", "tree", "forward", "verify", "commit")


def build(method: str, dtype: str, overrides: list[str]) -> Pipeline:
    name, _, mode = method.rpartition("@")
    if mode != "full_vocab":  # an '@' inside an override (retriever@pipeline.proposers.X=...)
        name, mode = method, ""
    pipeline, *own = re.split(r"(?<!\+)\+", name)  # '++x' adds the override '+x'
    own = [override for override in own if override]
    built = Pipeline.from_config([f"pipeline={pipeline}", f"model.dtype={dtype}", *own, *overrides])
    if mode == "full_vocab":
        for drafter in built.decoder.drafters:
            drafter.draft_vocab = None
    elif mode:
        raise SystemExit(f"unknown mode @{mode} in {method!r}: the only one is @full_vocab")
    return built


def first_turn_steps(pipeline: Pipeline, question, max_new_tokens: int):
    """The steps of one question's first turn, as a new request."""
    return pipeline.steps([{"role": "user", "content": question.turns[0]}], max_new_tokens=max_new_tokens)


def run_rounds(order: list[tuple[str, Pipeline]], questions: list, max_new_tokens: int,
               totals: dict[str, dict[str, collections.Counter]]) -> None:
    """Two rounds, the second in reverse order, each question through every method in turn."""
    for round_order in (order, order[::-1]):
        for question in questions:
            for method, pipeline in round_order:
                sums = totals[method][question.category]
                started = time.perf_counter()
                for step in first_turn_steps(pipeline, question, max_new_tokens):
                    if "prefill" in step.stats.seconds:
                        continue
                    sums["steps"] += 1
                    sums["tokens"] += len(step.tokens)
                    sums["nodes"] += step.stats.tree_size
                    sums.update(step.stats.seconds)
                sums["seconds"] += time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="+")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompts", default="bench/dev_chat_prompts.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--override", action="append", default=[], help="a config override for every method")
    parser.add_argument("--warmup", type=int, default=1,
                        help="questions run through every method first, not counted (as the benchmark's bench.warmup)")
    parser.add_argument("--history", default=None,
                        help="a question JSONL whose first turns go through every method before the warm-up, not counted: "
                             "what the benchmark's earlier categories teach the calibrations, the drafter gate and the "
                             "online cost curve before it meets the last ones")
    parser.add_argument("--history-per-category", type=int, default=4)
    args = parser.parse_args()

    questions = select_questions(read_questions(resolve_prompts_path(args.prompts)), args.per_category)
    history = [] if args.history is None else select_questions(
        read_questions(resolve_prompts_path(args.history)), args.history_per_category)
    pipelines = {method: build(method, args.dtype, args.override) for method in args.methods}
    pipelines["vanilla"] = next(iter(pipelines.values())).without_drafting()
    totals = {method: collections.defaultdict(collections.Counter) for method in pipelines}  # method -> category -> sums
    order = list(pipelines.items())
    with learning_paused(*pipelines.values()):
        for question in [*history, *questions[: args.warmup]]:
            for _, pipeline in order:
                for _ in first_turn_steps(pipeline, question, args.max_new_tokens):
                    pass
        run_rounds(order, questions, args.max_new_tokens, totals)

    def rate(sums: collections.Counter) -> float:
        return sums["tokens"] / sums["seconds"]

    vanilla = sum(totals["vanilla"].values(), collections.Counter())
    print(f"{args.dtype}, {len(questions)} questions of {args.prompts}, {args.max_new_tokens} new tokens, 2 rounds"
          + (f", after {len(history)} questions of {args.history}" if history else ""))
    print("| method | accepted | nodes | tok/s | vs vanilla | " + " | ".join(f"{s} ms" for s in STAGES) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(STAGES))
    for method in pipelines:
        sums = sum(totals[method].values(), collections.Counter())
        steps = sums["steps"]
        stages = " | ".join(f"{1000 * sums[stage] / steps:.2f}" for stage in STAGES)
        print(f"| {method} | {sums['tokens'] / steps:.2f} | {sums['nodes'] / steps:.1f} | {rate(sums):.1f} | "
              f"{rate(sums) / rate(vanilla):.2f}x | {stages} |")
    print("\nper category, vs vanilla / accepted:")
    for method in pipelines:
        cells = [f"{category} {rate(sums) / rate(totals['vanilla'][category]):.2f}x / {sums['tokens'] / sums['steps']:.2f}"
                 for category, sums in sorted(totals[method].items())]
        print(f"  {method}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
