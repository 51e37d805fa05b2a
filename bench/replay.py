"""Retrieval drafting replayed offline against recorded greedy answers: acceptance in seconds, not minutes.

Under greedy decoding the target's answer does not depend on the drafts, so what a retriever's tree
would have accepted at each step follows from the answer alone. `record` runs plain decoding once and
keeps every turn's prompt ids and answer; `replay` then steps each configured pipeline's proposers and
tree builder over those answers exactly as the decoder does (propose, build, accept the longest tree
path the answer follows, commit, learn), with no target forward. It reports accepted tokens and nodes
per step, and a modelled speed over plain decoding from the pipeline's own cost curve:
tokens x cost(1) / sum over steps of (cost(rows) + overhead). Only the interleaved benchmark
(`bench/stage_profile.py`) measures speed; this is for sweeping a retriever's settings.

    python bench/replay.py record --dtype fp32 --per-category 6 --out /tmp/greedy_fp32.json
    python bench/replay.py replay --answers /tmp/greedy_fp32.json rest 'rest+pipeline.proposers.rest.max_candidates=16'

Pipelines with model drafters (EAGLE, a draft model) are refused: their drafts read the target's
hidden states, which a replay does not have.
"""
from __future__ import annotations

import argparse
import collections
import json

from stage_profile import build as build_method  # bench/ is on the path of a script run from it

from specpipe.pipelines.pipeline import Pipeline
from specpipe.tasks.bench_questions import read_questions, resolve_prompts_path, select_questions
from specpipe.types import DecodeState, DraftTree


def record(args: argparse.Namespace) -> None:
    questions = select_questions(read_questions(resolve_prompts_path(args.prompts)), args.per_category)
    pipeline = Pipeline.from_config(["pipeline=vanilla", f"model.dtype={args.dtype}"])
    turns = []
    for question in questions:
        messages: list[dict] = []
        for turn in question.turns[: args.turns]:
            messages.append({"role": "user", "content": turn})
            prompt = pipeline.prepare(messages)
            answer = pipeline.generate(prompt, args.max_new_tokens)
            turns.append({"question_id": question.question_id, "category": question.category,
                          "turn": (len(messages) + 1) // 2, "prompt_ids": list(prompt.token_ids), "answer_ids": answer.token_ids})
            messages.append({"role": "assistant", "content": answer.text})
        print(f"{question.category} {question.question_id}: {sum(len(t['answer_ids']) for t in turns)} tokens so far")
    with open(args.out, "w") as out:
        json.dump({"dtype": args.dtype, "prompts": args.prompts, "turns": turns}, out)


def build(method: str, dtype: str) -> Pipeline:
    built = build_method(method, dtype, [])  # stage_profile's method syntax: pipeline[+override...]
    if built.decoder.drafters or built.augmenter is not None:
        raise SystemExit(f"{method}: only retrieval pipelines without an augmenter replay (no drafters, no RAG)")
    return built


def replay_turn(pipeline: Pipeline, prompt: list[int], answer: list[int], sums: collections.Counter,
                overhead_ms: float) -> None:
    decoder = pipeline.decoder
    cost = decoder.tree_builder.cost_curve
    state = DecodeState(tokens=list(prompt) + answer[:1], prompt_length=len(prompt))
    for stage in decoder.proposers:
        stage.reset(state)
    done = 1
    while done < len(answer):
        proposals = [proposer.propose(state) for proposer in decoder.proposers]
        tree = decoder.tree_builder.build(state, proposals) if any(len(p) for p in proposals) else DraftTree.empty()
        truth = answer[done:]
        tokens, children = tree.tokens.tolist(), tree.children()
        accepted, node = [], -1
        while len(accepted) < len(truth) - 1:
            match = next((c for c in children.get(node, ()) if tokens[c] == truth[len(accepted)]), None)
            if match is None:
                break
            accepted.append(match)
            node = match
        emitted = truth[: len(accepted) + 1]
        state.tokens.extend(emitted)
        for stage in decoder.proposers:
            stage.on_commit(state, None)
        done += len(emitted)
        sums["steps"] += 1
        sums["tokens"] += len(emitted)
        sums["nodes"] += len(tree)
        sums["ms"] += cost(len(tree) + 1) + overhead_ms
        sums["plain_ms"] += len(emitted) * cost(1)
    for stage in decoder.proposers:
        finish = getattr(stage, "on_finish", None)
        if finish is not None:
            finish(state)


def replay(args: argparse.Namespace) -> None:
    with open(args.answers) as source:
        recorded = json.load(source)
    turns = [t for t in recorded["turns"] if t["turn"] <= args.turns]
    print(f"{recorded['dtype']} answers of {recorded['prompts']}, {len(turns)} turns; modelled speed: overhead "
          f"{args.overhead_ms} ms per drafting step")
    print("| method | accepted | nodes | modelled vs plain | " + " | ".join(f"turn {k}" for k in range(1, args.turns + 1))
          + " |")
    print("|---|---:|---:|---:|" + "---:|" * args.turns)
    for method in args.methods:
        pipeline = build(method, recorded["dtype"])
        by_turn = collections.defaultdict(collections.Counter)
        by_category = collections.defaultdict(collections.Counter)
        for turn in turns:
            sums = collections.Counter()
            replay_turn(pipeline, turn["prompt_ids"], turn["answer_ids"], sums, args.overhead_ms)
            by_turn[turn["turn"]].update(sums)
            by_category[turn["category"]].update(sums)
        total = sum(by_turn.values(), collections.Counter())
        cells = " | ".join(f"{by_turn[k]['tokens'] / max(1, by_turn[k]['steps']):.2f}" for k in range(1, args.turns + 1))
        print(f"| {method} | {total['tokens'] / total['steps']:.3f} | {total['nodes'] / total['steps']:.2f} | "
              f"{total['plain_ms'] / total['ms']:.3f}x | {cells} |")
        if args.categories:
            print("    " + ", ".join(f"{c} {s['tokens'] / s['steps']:.2f}" for c, s in sorted(by_category.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="plain greedy answers of the dev questions, with their prompt ids")
    rec.add_argument("--dtype", default="fp32")
    rec.add_argument("--prompts", default="bench/dev_chat_prompts.jsonl")
    rec.add_argument("--per-category", type=int, default=2)
    rec.add_argument("--turns", type=int, default=2)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--out", required=True)
    rep = commands.add_parser("replay", help="pipelines' retrieval drafting over recorded answers")
    rep.add_argument("methods", nargs="+", help="pipeline[+override...]")
    rep.add_argument("--answers", required=True)
    rep.add_argument("--turns", type=int, default=2)
    rep.add_argument("--overhead-ms", type=float, default=0.0, help="Python per drafting step, added to its cost")
    rep.add_argument("--categories", action="store_true")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
