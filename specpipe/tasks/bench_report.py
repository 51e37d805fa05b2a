"""The benchmark's report: summary.json, summary.md, results.parquet, answers/, speedup.png.

Metrics, per method, over all prompts (`overall`) and within each category (after
`bench.group_categories`: Spec-Bench's eight MT-bench categories are reported as `mt_bench`;
results.parquet keeps each prompt's own `category` beside its reported `group`):

- `tok_s`: mean over prompts of a prompt's new tokens (all turns) over its wall time;
- `speedup`: that mean over the same mean for `hf_generate` (a ratio of means, as in
  Spec-Bench; null when `hf_generate` was not run);
- `mean_accepted`: new tokens per target forward, the prefill counted as one forward
  (total tokens over total forwards of the group);
- `exact_rate`: the share of prompts whose output tokens, all turns, equal
  `hf_generate`'s (null when `hf_generate` was not run);
- `speedup_vs_vanilla`: the same ratio of means over specpipe's `vanilla` (our loop and
  engine, no drafting; null when it was not run);
- `drafted_by_source`: for specpipe's methods, the share of all new tokens that came from
  accepted drafts of each proposer ({} for `vanilla`; null for the HF methods, which cannot
  tell); `bonus_share`: the share that were the target's own tokens. They sum to 1.

With `bench.relative_to=METHOD`, summary.json's `relative` and summary.md add each method's speed over
that method, per category and overall, with a paired bootstrap interval over the questions (see
`paired_speed_ratios`): one run's cell is a draw, and whether a pipeline is slower than another in a
category is a question of that interval, not of the cell alone.

The sweep merge (`specpipe.tasks.sweep`) renders its table and plot with the same
functions, from summaries whose row names are `JOB / METHOD`.
"""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specpipe.tasks.bench_records import QuestionRun

REFERENCE = "hf_generate"
VANILLA = "vanilla"  # specpipe's own loop without drafting: the second baseline
METRICS = ("speedup", "tok_s", "mean_accepted", "exact_rate")
ROW_SEPARATOR = " / "  # merged sweep rows are "JOB / METHOD"


# ---- per-prompt records ----------------------------------------------------------------
def run_records(runs: Sequence["QuestionRun"], groups: dict[str, str] | None = None) -> list[dict]:
    """One flat record per question x method, with `exact` against hf_generate's output and the
    `group` (reported category) of its category under `groups`."""
    groups = groups or {}
    reference = {run.question.question_id: run.output_ids for run in runs if run.method == REFERENCE}
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
    tok_s = sum(r["tok_s"] for r in records) / len(records)
    forwards = sum(r["forwards"] for r in records)
    exact = [r["exact"] for r in records if r["exact"] is not None]
    shares, bonus_share = source_shares(records)
    return {
        "speedup": tok_s / reference_tok_s if reference_tok_s else None,
        "speedup_vs_vanilla": tok_s / vanilla_tok_s if vanilla_tok_s else None,
        "tok_s": tok_s,
        "mean_accepted": sum(r["new_tokens"] for r in records) / forwards if forwards else 0.0,
        "exact_rate": sum(exact) / len(exact) if exact else None,
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


# ---- rendering -------------------------------------------------------------------------
def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of `header` and `rows` (each as long as the header)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(cells) + " |" for cells in rows)])


def _cell(metrics: dict | None) -> str:
    if not metrics:
        return "-"
    speedup = "n/a" if metrics.get("speedup") is None else f"{metrics['speedup']:.2f}x"
    return f"{speedup} / {metrics['mean_accepted']:.2f}"


def markdown_table(summary: dict) -> str:
    """Rows = methods (or `JOB / METHOD`), columns = categories + overall; cells `speedup / mean accepted`."""
    categories = list(summary["categories"])
    header = ["method", *categories, "overall", "vs vanilla", "tok/s", "exact"]
    rows = []
    for row, overall in summary["overall"].items():
        exact = "n/a" if overall.get("exact_rate") is None else f"{overall['exact_rate']:.2f}"
        vs_vanilla = "n/a" if overall.get("speedup_vs_vanilla") is None else f"{overall['speedup_vs_vanilla']:.2f}x"
        rows.append([row, *(_cell(summary["categories"][c].get(row)) for c in categories), _cell(overall),
                     vs_vanilla, f"{overall['tok_s']:.1f}", exact])
    return _markdown(header, rows)


def _sources_cell(metrics: dict | None) -> str:
    if not metrics or metrics.get("drafted_by_source") is None:
        return "-"
    shares = sorted(metrics["drafted_by_source"].items(), key=lambda item: -item[1])
    return " · ".join([*(f"{source} {share:.2f}" for source, share in shares), f"bonus {metrics['bonus_share']:.2f}"])


def sources_table(summary: dict) -> str:
    """Rows = specpipe methods that draft, columns = categories + overall; cells: the share of new
    tokens per draft source and of the target's bonus tokens. Empty when no method drafts."""
    categories = list(summary["categories"])
    rows = [row for row, overall in summary["overall"].items() if overall.get("drafted_by_source")]
    if not rows:
        return ""
    return _markdown(["method", *categories, "overall"],
                     [[row, *(_sources_cell(summary["categories"][c].get(row)) for c in categories),
                       _sources_cell(summary["overall"][row])] for row in rows])


SOURCES_LEGEND = ("Where the new tokens came from: the share of all new tokens that were accepted drafts of "
                  "each proposer (a node proposed by several counts for the first), and `bonus`, the target's "
                  "own token after each accepted path; per row they sum to 1.")


def sources_section(summary: dict) -> list[str]:
    """The markdown lines of the sources table with its legend ([] when no method drafts)."""
    table = sources_table(summary)
    return ["", "## Tokens by source", "", table, "", SOURCES_LEGEND] if table else []


TABLE_LEGEND = ("Cells: wall-clock speedup over `hf_generate` (ratio of mean tok/s over prompts) / mean "
                "accepted tokens per target forward (prefill counted). `vs vanilla`: overall speedup over specpipe's "
                "own loop without drafting (same engine). `tok/s`: mean over prompts; `exact`: "
                "share of prompts whose output tokens (all turns) equal `hf_generate`'s.")


def realtime_throttling(settings: Path = Path("/proc/sys/kernel")) -> str:
    """Where this process runs under a real-time policy (`chrt -f 1` runs it SCHED_FIFO) and the kernel
    caps real-time tasks to a share of each period (Linux's default: 950000 of 1000000 us): a decode
    that keeps every core busy then stalls for the rest of each period, ~50 ms a second, falling on
    whichever forward spans it, which then takes several times its median. "" otherwise."""
    try:
        policy = os.sched_getscheduler(0)
        runtime = int((settings / "sched_rt_runtime_us").read_text())
        period = int((settings / "sched_rt_period_us").read_text())
    except (AttributeError, OSError, ValueError):
        return ""
    names = {os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    if policy not in names or runtime < 0 or runtime >= period:
        return ""
    return f"{names[policy]}, throttled to {runtime} of every {period} us"


def machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import specpipe.distributed as distributed
    from specpipe.cost import openmp_wait_settings
    from specpipe.engine.cpu import cpu_description

    description = cpu_description()
    wait_policy, spin_count = openmp_wait_settings()
    return {
        "cpu": cpu,
        "cpu_capability": description["aten_capability"],  # ATen's vector ISA (AVX2, AVX512, ...)
        "isa_flags": " ".join(description["isa_flags"]),
        "onednn_max_cpu_isa": description["onednn_max_cpu_isa"] or "unset",
        "mkl_enable_instructions": description["mkl_enable_instructions"] or "unset",
        "onednn_linear": ", ".join(f"{dtype} {path}" for dtype, path in description["onednn_linear"].items()),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # sleeping OpenMP threads (PASSIVE) wake late for every parallel region: every step is slower
        "omp_wait_policy": wait_policy or "unset",
        "gomp_spincount": spin_count or "unset",
        "realtime_throttling": realtime_throttling() or "none",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "world_size": distributed.world_size(),  # > 1: a tensor-parallel run under torchrun
    }


def machine_line(machine: dict) -> str:
    """The CPU with the ISA its kernels ran (reports from CPUs of different classes do not compare)."""
    mkl = machine.get("mkl_enable_instructions", "unset")
    isa = (f" (ATen {machine['cpu_capability']}, oneDNN cap {machine.get('onednn_max_cpu_isa', 'unset')}"
           f"{'' if mkl == 'unset' else f', MKL cap {mkl}'}, "
           f"prepacked linears: {machine.get('onednn_linear', '?')})" if machine.get("cpu_capability") else "")
    gpus = f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ""
    ranks = f", tensor parallel over {machine['world_size']} processes" if machine.get("world_size", 1) > 1 else ""
    waits = "".join(f", {name} {machine[key]}" for key, name in (("omp_wait_policy", "OMP_WAIT_POLICY"),
                                                                   ("gomp_spincount", "GOMP_SPINCOUNT"))
                    if machine.get(key, "unset") != "unset")
    throttling = machine.get("realtime_throttling", "none")
    throttled = "" if throttling == "none" else f", real-time {throttling}: stalls the rest of each period (noisy times)"
    return (f"{machine.get('cpu')}{isa}, {machine.get('cores')} cores, torch threads {machine.get('torch_threads')}"
            f"{waits}{throttled}{gpus}{ranks}, torch {machine.get('torch')}, transformers {machine.get('transformers')}")


def _decoding(sampling: dict | None) -> str:
    if not sampling or sampling.get("temperature", 0) <= 0:
        return "greedy"
    return (f"sampling at temperature {sampling['temperature']} (top_k {sampling.get('top_k', 0)}, top_p "
            f"{sampling.get('top_p', 1.0)}, seed {sampling.get('seed')}): exact rates are not expected to be 1")


def relative_table(relative: dict) -> str:
    """Rows = methods, columns = groups + overall; cells `ratio (low-high)`, bold where the whole interval
    is below 1 (slower than the baseline beyond the run's noise)."""
    groups = list(relative["categories"])

    def cell(metrics: dict | None) -> str:
        if not metrics:
            return "-"
        text = f"{metrics['ratio']:.2f}x ({metrics['low']:.2f}-{metrics['high']:.2f})"
        return f"**{text}**" if metrics["high"] < 1.0 else text

    return _markdown(["method", *groups, "overall"],
                     [[method, *(cell(relative["categories"][g].get(method)) for g in groups), cell(overall)]
                      for method, overall in relative["overall"].items()])


def relative_section(summary: dict) -> list[str]:
    """The markdown lines of the speed over `bench.relative_to` ([] when it was not set)."""
    relative = summary.get("relative")
    if not relative:
        return []
    return ["", f"## Speed over `{relative['baseline']}`", "", relative_table(relative), "",
            f"Cells: mean tok/s over `{relative['baseline']}`'s on the same questions, and a "
            f"{relative['level']:.0%} interval over {relative['resamples']} paired bootstrap draws of the questions; "
            f"bold: the whole interval is below 1."]


def summary_markdown(summary: dict, meta: dict) -> str:
    machine = meta["machine"]
    lines = [
        f"# specpipe bench: `{meta['pipeline']}` on `{meta['model']}` ({meta['dtype']})",
        "",
        markdown_table(summary),
        "",
        TABLE_LEGEND,
        *relative_section(summary),
        *sources_section(summary),
        "",
        f"- prompts: `{meta['prompts']}`, first {meta['per_category']} per category ({meta['questions']} "
        f"questions), max_new_tokens {meta['max_new_tokens']} per turn, warm-up {meta['warmup']} question(s), "
        f"{_decoding(meta.get('sampling'))}, batch 1",
        *([f"- **stopped early** ({meta['stopped']}): the table covers the {meta['questions']} questions every "
           f"method finished"] if meta.get("stopped") else []),
        *_grouping_lines(summary, meta),
        *(["- RAG: every method ran on the same augmented prompt token ids (the pipeline's retrieval for each "
           "turn's question); the chunks retrieved per question are in results.parquet (`retrieved`) and "
           "answers/"] if meta.get("augmented") else []),
        f"- methods: {', '.join(f'`{m}`' for m in meta['methods'])} (`hf_pld` = HF `generate("
        f"prompt_lookup_num_tokens={meta['pld_tokens']})`); engine `{meta.get('engine', 'hf')}` for specpipe's "
        f"methods, transformers' stock forward for the HF ones",
        f"- machine: {machine_line(machine)}, python {machine['python']}; 1-min load average "
        f"{machine.get('load_avg_before', float('nan')):.2f} before the runs, "
        f"{machine.get('load_avg_after', float('nan')):.2f} after (the run itself adds about its thread count; "
        f"more means other processes shared the CPU and the timings are noisy)"
        + (f"; other processes kept {machine['other_processes_cpus']:.2f} of the {machine['cpus']} CPUs busy "
           f"during the runs (/proc/stat)" if machine.get("other_processes_cpus") is not None else ""),
        f"- dtype: {meta['dtype']}",
        f"- command: `{meta['command']}`",
    ]
    return "\n".join(lines) + "\n"


def _grouping_lines(summary: dict, meta: dict) -> list[str]:
    """Which reported categories merge several of the prompts file's (only those in this report)."""
    groups: dict[str, list[str]] = {}
    for category, group in (meta.get("group_categories") or {}).items():
        if group in summary["categories"]:
            groups.setdefault(group, []).append(category)
    return [f"- `{group}` reports the categories {', '.join(categories)} together (bench.group_categories); "
            f"per_category counts each of them" for group, categories in groups.items()]


def plot_speedup(summary: dict, path: Path, title: str) -> None:
    """Grouped bars: one group per category (+ overall), one bar per row; hf_generate is the 1.0 line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = [*summary["categories"], "overall"]
    by_group = {**summary["categories"], "overall": summary["overall"]}
    has_reference = any(m.get("speedup") is not None for m in summary["overall"].values())
    metric = "speedup" if has_reference else "tok_s"
    rows = [row for row in summary["overall"] if not (has_reference and _is_reference(row))]
    figure = Figure(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(rows)) ** 0.5 + 2), 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(groups))]
        values = [(by_group[group].get(row) or {}).get(metric) or 0.0 for group in groups]
        axes.bar(xs, values, width, label=row)
    if has_reference:
        axes.axhline(1.0, color="black", linewidth=1, linestyle="--", label=f"{REFERENCE} (1.0)")
    axes.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    axes.set_ylabel(f"speedup over {REFERENCE}" if has_reference else "tokens / s")
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _is_reference(row: str) -> bool:
    return row.split(ROW_SEPARATOR)[-1] == REFERENCE


# ---- files -----------------------------------------------------------------------------
def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    write(staging)
    os.replace(staging, path)


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda p: p.write_text(text, encoding="utf-8"))


def _parquet_types():
    """Columns whose type cannot be inferred from every report: {} (vanilla's sources) would be a struct
    with no fields, which Parquet refuses, [] (no retrieval) a list of nulls, and None (the HF
    methods' drafted count) would turn the integers into floats."""
    import pyarrow as pa

    chunk = pa.struct([("chunk_id", pa.int64()), ("title", pa.string()), ("source", pa.string()),
                       ("score", pa.float64())])
    return {"drafted": pa.int64(), "drafted_by_source": pa.map_(pa.string(), pa.int64()),
            "retrieved": pa.list_(pa.list_(chunk))}


def write_parquet(records: Sequence[dict], path: Path) -> None:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame.from_records(list(records))
    if len({type(q) for q in frame["question_id"]}) > 1:
        frame["question_id"] = frame["question_id"].astype(str)  # parquet columns have one type
    typed = {name: kind for name, kind in _parquet_types().items() if name in frame}
    table = pa.Table.from_pandas(frame.drop(columns=list(typed)), preserve_index=False)
    for name, kind in typed.items():  # from the records: pandas has turned None among ints into NaN
        table = table.append_column(name, pa.array([record[name] for record in records], type=kind))
    table = table.select(list(frame.columns))
    write_atomically(path, lambda p: pq.write_table(table, p))


def write_answers(runs: Sequence["QuestionRun"], meta: dict, folder: Path) -> None:
    """answers/METHOD.jsonl in Spec-Bench's own answer format, one line per question, by question_id as
    Spec-Bench sorts its answer files (the questions ran with their categories taking turns)."""
    folder.mkdir(parents=True, exist_ok=True)

    def by_question_id(run: "QuestionRun") -> tuple[bool, int | str]:
        return isinstance(run.question.question_id, str), run.question.question_id  # ints first, then strings

    for method in meta["methods"]:
        lines = []
        for run in sorted((r for r in runs if r.method == method), key=by_question_id):
            choice = {
                "index": 0,
                "turns": list(run.texts),
                "new_tokens": [len(t.tokens) for t in run.turns],
                "wall_time": [t.seconds for t in run.turns],
                "decoding_steps": [t.forwards for t in run.turns],
                "accept_lengths": [n for t in run.turns for n in t.accept_lengths],
                "prompt_tokens": [len(p.token_ids) for p in run.prompts],
            }
            lines.append(json.dumps({
                "question_id": run.question.question_id,
                "category": run.question.category,
                "answer_id": f"{run.question.question_id}-{method}",
                "model_id": f"{meta['model']}-{method}-{meta['dtype']}",
                "choices": [choice],
                **({"retrieved": retrieved_chunks(run)} if meta.get("augmented") else {}),
                "tstamp": time.time(),
            }, ensure_ascii=False))
        write_text(folder / f"{method}.jsonl", "".join(line + "\n" for line in lines))


def write_report(runs: Sequence["QuestionRun"], meta: dict, out: Path) -> dict:
    """Writes every report file into `out`; returns the summary (summary.json's content)."""
    out.mkdir(parents=True, exist_ok=True)
    records = run_records(runs, meta.get("group_categories"))
    summary = summarize(records, meta["methods"])
    if meta.get("relative_to"):
        summary["relative"] = paired_speed_ratios(records, meta["methods"], meta["relative_to"])
    write_parquet(records, out / "results.parquet")
    write_answers(runs, meta, out / "answers")
    write_text(out / "summary.md", summary_markdown(summary, meta))
    plot_speedup(summary, out / "speedup.png",
                 f"{meta['pipeline']} on {meta['model']} ({meta['dtype']}), max_new_tokens {meta['max_new_tokens']}")
    summary = {**summary, "meta": meta}
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")  # last: marks a complete report
    return summary
