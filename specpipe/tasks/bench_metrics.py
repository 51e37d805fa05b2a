"""The benchmark's numbers: one flat record per question and method, the metrics of each method per reported
category and overall (`summarize`), and the paired bootstrap speed ratios of `bench.relative_to`. Kept apart from
the files and the rendering so that the sweep merge, the report and the tests compute them one way, with nothing
heavier than numpy. Every metric is defined in `group_metrics`; a run's `hf_generate` is the speedup reference and
its `vanilla` (specpipe's loop and engine without drafting) the second baseline.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specpipe.tasks.bench_records import QuestionRun

REFERENCE = "hf_generate"  # transformers' greedy generate: speedup 1.0
VANILLA = "vanilla"  # specpipe's own loop without drafting: the second baseline

# ---- per-prompt records ----------------------------------------------------------------
def run_records(runs: Sequence["QuestionRun"], groups: dict[str, str] | None = None) -> list[dict]:
    """One flat record per question x method, with `exact` against hf_generate's output, `same_as_vanilla`
    against specpipe's own `vanilla` (the engine's plain greedy answer, the one speculation must reproduce in every
    dtype) and the `group` (reported category) of its category under `groups`."""
    groups = groups or {}
    reference = {run.question.question_id: run.output_ids for run in runs if run.method == REFERENCE}
    vanilla = {run.question.question_id: run.output_ids for run in runs if run.method == VANILLA}
    records = []
    for run in runs:
        q = run.question
        accept_lengths = [n for turn in run.turns for n in turn.accept_lengths]
        records.append({
            "question_id": q.question_id,
            "category": q.category,
            "group": groups.get(q.category, q.category),
            "method": run.method,
            "turns": len(run.turns),
            "new_tokens": run.new_tokens,
            "seconds": run.seconds,
            "tok_s": run.tokens_per_second,
            "forwards": run.forwards,
            "mean_accepted": run.new_tokens / run.forwards if run.forwards else 0.0,
            "exact": run.output_ids == reference[q.question_id] if q.question_id in reference else None,
            "same_as_vanilla": run.output_ids == vanilla[q.question_id] if q.question_id in vanilla else None,
            "new_tokens_per_turn": [len(t.tokens) for t in run.turns],
            "seconds_per_turn": [t.seconds for t in run.turns],
            "forwards_per_turn": [t.forwards for t in run.turns],
            "accept_lengths": accept_lengths,
            "drafted": _sum_or_none(t.drafted for t in run.turns),
            "drafted_by_source": _merge_counts(t.drafted_by_source for t in run.turns),
            "prompt_tokens_per_turn": [len(p.token_ids) for p in run.prompts],
            "prompt_ids": [list(p.token_ids) for p in run.prompts],
            "retrieved": retrieved_chunks(run),
            "output_ids": run.output_ids,
            "answers": list(run.texts),
        })
    return records


def _sum_or_none(values) -> int | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _merge_counts(counts) -> dict[str, int] | None:
    """Per-source counts summed over turns; None when a turn's method could not tell."""
    merged: dict[str, int] = {}
    for turn_counts in counts:
        if turn_counts is None:
            return None
        for source, count in turn_counts.items():
            merged[source] = merged.get(source, 0) + count
    return merged


def retrieved_chunks(run: "QuestionRun") -> list[list[dict]]:
    """Per turn, the chunks a RAG pipeline retrieved into the prompt, best first ([] without RAG)."""
    return [[{"chunk_id": int(c.chunk_id), "title": str(c.title), "source": str(c.source), "score": float(c.score)}
             for c in prompt.retrieved] for prompt in run.prompts]


def source_shares(records: Sequence[dict]) -> tuple[dict[str, float] | None, float | None]:
    """(share of all new tokens per draft source, share of the target's bonus tokens); (None, None)
    when a record's method could not tell where its tokens came from (the HF methods)."""
    if not records or any(r["drafted_by_source"] is None or r["drafted"] is None for r in records):
        return None, None
    new_tokens = sum(r["new_tokens"] for r in records)
    if not new_tokens:
        return None, None
    counts = _merge_counts(r["drafted_by_source"] for r in records)
    # The bonus share comes from the steps' own drafted counts, not from 1 - sum(shares): the two
    # agree only when every accepted draft token is attributed to a source.
    bonus = sum(r["new_tokens"] - r["drafted"] for r in records) / new_tokens
    return {source: count / new_tokens for source, count in counts.items()}, bonus


def group_metrics(records: Sequence[dict], reference_tok_s: float | None, vanilla_tok_s: float | None = None) -> dict:
    """One method's metrics over `records` (its prompts of one reported category, or all of them):

    - `tok_s`: mean over prompts of a prompt's new tokens (all turns) over its wall time;
    - `speedup`: that mean over the same mean for `hf_generate` (`reference_tok_s`; a ratio of means, as in
      Spec-Bench; null when `hf_generate` was not run);
    - `mean_accepted`: new tokens per target forward, the prefill counted as one forward (total tokens over
      total forwards of the group);
    - `exact_rate`: the share of prompts whose output tokens, all turns, equal `hf_generate`'s (null when
      `hf_generate` was not run);
    - `same_as_vanilla_rate`: the share of prompts whose output tokens equal specpipe's `vanilla`'s (null when it
      was not run): 1 for every greedy pipeline in every dtype where the engine's rows are batch-invariant;
    - `speedup_vs_vanilla`: the same ratio of means over specpipe's `vanilla` (`vanilla_tok_s`; null when it
      was not run);
    - `drafted_by_source`: for specpipe's methods, the share of all new tokens that came from accepted drafts of
      each proposer ({} for `vanilla`; null for the HF methods, which cannot tell); `bonus_share`: the share
      that were the target's own tokens. They sum to 1.
    """
    tok_s = sum(r["tok_s"] for r in records) / len(records)
    forwards = sum(r["forwards"] for r in records)
    exact = [r["exact"] for r in records if r["exact"] is not None]
    same = [r["same_as_vanilla"] for r in records if r.get("same_as_vanilla") is not None]
    shares, bonus_share = source_shares(records)
    return {
        "speedup": tok_s / reference_tok_s if reference_tok_s else None,
        "speedup_vs_vanilla": tok_s / vanilla_tok_s if vanilla_tok_s else None,
        "tok_s": tok_s,
        "mean_accepted": sum(r["new_tokens"] for r in records) / forwards if forwards else 0.0,
        "exact_rate": sum(exact) / len(exact) if exact else None,
        "same_as_vanilla_rate": sum(same) / len(same) if same else None,
        "drafted_by_source": shares,
        "bonus_share": bonus_share,
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "seconds": sum(r["seconds"] for r in records),
    }


def summarize(records: Sequence[dict], methods: Sequence[str]) -> dict:
    """{"overall": {METHOD: metrics}, "categories": {GROUP: {METHOD: metrics}}}: categories are the
    records' reported `group`s."""
    def mean_tok_s(group: list[dict], method: str) -> float | None:
        rows = [r for r in group if r["method"] == method]
        return sum(r["tok_s"] for r in rows) / len(rows) if rows else None

    def metrics_by_method(group: list[dict]) -> dict:
        reference_tok_s, vanilla_tok_s = mean_tok_s(group, REFERENCE), mean_tok_s(group, VANILLA)
        return {m: group_metrics([r for r in group if r["method"] == m], reference_tok_s, vanilla_tok_s)
                for m in methods if any(r["method"] == m for r in group)}

    groups = list(dict.fromkeys(r["group"] for r in records))
    return {
        "overall": metrics_by_method(list(records)),
        "categories": {g: metrics_by_method([r for r in records if r["group"] == g]) for g in groups},
    }


def paired_speed_ratios(records: Sequence[dict], methods: Sequence[str], baseline: str, level: float = 0.9,
                        resamples: int = 2000, seed: int = 0) -> dict:
    """Each method's speed over `baseline`, per reported group and overall: the ratio of their mean tok/s
    over the questions both ran, and a `level` percentile interval of that ratio over `resamples` paired
    bootstrap draws of the questions (both methods' times of a drawn question enter together, so the
    drift a question saw cancels; overall draws within each group, keeping the groups' sizes).

    Why: on a shared VM two identical pipelines built in one run differ by several percent in a small
    category, so "no category slower" is judged by the interval's upper end.
    Returns {"baseline", "level", "resamples", "overall": {method: cell}, "categories": {group: {method:
    cell}}} with cells {"ratio", "low", "high", "questions"}."""
    import numpy as np

    def tok_s_by_question(group: Sequence[dict], method: str) -> dict:
        return {r["question_id"]: r["tok_s"] for r in group if r["method"] == method}

    groups = {g: [r for r in records if r["group"] == g] for g in dict.fromkeys(r["group"] for r in records)}
    generator = np.random.default_rng(seed)
    tail = (1.0 - level) / 2.0
    result: dict = {"baseline": baseline, "level": level, "resamples": resamples, "overall": {},
                    "categories": {g: {} for g in groups}}
    for method in methods:
        if method == baseline:
            continue
        drawn_sums, sums, questions = np.zeros((resamples, 2)), np.zeros(2), 0  # (method, baseline) tok/s sums
        for name, group in groups.items():
            base, other = tok_s_by_question(group, baseline), tok_s_by_question(group, method)
            shared = [q for q in base if q in other]
            if not shared:
                continue
            pairs = np.array([[other[q], base[q]] for q in shared])  # [n, 2]: method, baseline
            drawn = pairs[generator.integers(0, len(shared), size=(resamples, len(shared)))].sum(axis=1)  # [B, 2]
            result["categories"][name][method] = _ratio_cell(pairs.sum(axis=0), drawn, tail, len(shared))
            drawn_sums += drawn
            sums += pairs.sum(axis=0)
            questions += len(shared)
        if questions:
            result["overall"][method] = _ratio_cell(sums, drawn_sums, tail, questions)
    return result


def _ratio_cell(sums, drawn, tail: float, questions: int) -> dict:
    """sums [2] (method, baseline), drawn [B, 2] -> the ratio and its percentile interval."""
    import numpy as np

    ratios = drawn[:, 0] / drawn[:, 1]
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return {"ratio": float(sums[0] / sums[1]), "low": float(low), "high": float(high), "questions": questions}

