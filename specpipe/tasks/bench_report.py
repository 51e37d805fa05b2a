"""The benchmark's report: summary.json, summary.md, results.parquet, answers/, speedup.png.

Metrics, per method, over all prompts (`overall`) and within each category:

- `tok_s`: mean over prompts of a prompt's new tokens (all turns) over its wall time;
- `speedup`: that mean over the same mean for `hf_generate` (a ratio of means, as in
  Spec-Bench; null when `hf_generate` was not run);
- `mean_accepted`: new tokens per target forward, the prefill counted as one forward
  (total tokens over total forwards of the group);
- `exact_rate`: the share of prompts whose output tokens, all turns, equal
  `hf_generate`'s (null when `hf_generate` was not run);
- `speedup_vs_vanilla`: the same ratio of means over specpipe's `vanilla` (our loop and
  engine, no drafting; null when it was not run).

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
    from specpipe.tasks.bench import QuestionRun

REFERENCE = "hf_generate"
VANILLA = "vanilla"  # specpipe's own loop without drafting: the second baseline
METRICS = ("speedup", "tok_s", "mean_accepted", "exact_rate")
ROW_SEPARATOR = " / "  # merged sweep rows are "JOB / METHOD"


# ---- per-prompt records ----------------------------------------------------------------
def run_records(runs: Sequence["QuestionRun"]) -> list[dict]:
    """One flat record per question x method, with `exact` against hf_generate's output."""
    reference = {run.question.question_id: run.output_ids for run in runs if run.method == REFERENCE}
    records = []
    for run in runs:
        q = run.question
        accept_lengths = [n for turn in run.turns for n in turn.accept_lengths]
        records.append({
            "question_id": q.question_id,
            "category": q.category,
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
            "output_ids": run.output_ids,
            "answers": list(run.texts),
        })
    return records


def group_metrics(records: Sequence[dict], reference_tok_s: float | None, vanilla_tok_s: float | None = None) -> dict:
    tok_s = sum(r["tok_s"] for r in records) / len(records)
    forwards = sum(r["forwards"] for r in records)
    exact = [r["exact"] for r in records if r["exact"] is not None]
    return {
        "speedup": tok_s / reference_tok_s if reference_tok_s else None,
        "speedup_vs_vanilla": tok_s / vanilla_tok_s if vanilla_tok_s else None,
        "tok_s": tok_s,
        "mean_accepted": sum(r["new_tokens"] for r in records) / forwards if forwards else 0.0,
        "exact_rate": sum(exact) / len(exact) if exact else None,
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "seconds": sum(r["seconds"] for r in records),
    }


def summarize(records: Sequence[dict], methods: Sequence[str]) -> dict:
    """{"overall": {METHOD: metrics}, "categories": {CATEGORY: {METHOD: metrics}}}."""
    def mean_tok_s(group: list[dict], method: str) -> float | None:
        rows = [r for r in group if r["method"] == method]
        return sum(r["tok_s"] for r in rows) / len(rows) if rows else None

    def metrics_by_method(group: list[dict]) -> dict:
        reference_tok_s, vanilla_tok_s = mean_tok_s(group, REFERENCE), mean_tok_s(group, VANILLA)
        return {m: group_metrics([r for r in group if r["method"] == m], reference_tok_s, vanilla_tok_s)
                for m in methods if any(r["method"] == m for r in group)}

    categories = list(dict.fromkeys(r["category"] for r in records))
    return {
        "overall": metrics_by_method(list(records)),
        "categories": {c: metrics_by_method([r for r in records if r["category"] == c]) for c in categories},
    }


# ---- rendering -------------------------------------------------------------------------
def _cell(metrics: dict | None) -> str:
    if not metrics:
        return "-"
    speedup = "n/a" if metrics.get("speedup") is None else f"{metrics['speedup']:.2f}x"
    return f"{speedup} / {metrics['mean_accepted']:.2f}"


def markdown_table(summary: dict) -> str:
    """Rows = methods (or `JOB / METHOD`), columns = categories + overall; cells `speedup / mean accepted`."""
    categories = list(summary["categories"])
    header = ["method", *categories, "overall", "vs vanilla", "tok/s", "exact"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, overall in summary["overall"].items():
        exact = "n/a" if overall.get("exact_rate") is None else f"{overall['exact_rate']:.2f}"
        vs_vanilla = "n/a" if overall.get("speedup_vs_vanilla") is None else f"{overall['speedup_vs_vanilla']:.2f}x"
        cells = [row, *(_cell(summary["categories"][c].get(row)) for c in categories), _cell(overall),
                 vs_vanilla, f"{overall['tok_s']:.1f}", exact]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLE_LEGEND = ("Cells: wall-clock speedup over `hf_generate` (ratio of mean tok/s over prompts) / mean "
                "accepted tokens per target forward (prefill counted). `vs vanilla`: overall speedup over specpipe's "
                "own loop without drafting (same engine). `tok/s`: mean over prompts; `exact`: "
                "share of prompts whose output tokens (all turns) equal `hf_generate`'s.")


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
    from specpipe.engine.cpu import cpu_description

    description = cpu_description()
    return {
        "cpu": cpu,
        "cpu_capability": description["aten_capability"],  # ATen's vector ISA (AVX2, AVX512, ...)
        "isa_flags": " ".join(description["isa_flags"]),
        "onednn_max_cpu_isa": description["onednn_max_cpu_isa"] or "unset",
        "onednn_linear": ", ".join(f"{dtype} {path}" for dtype, path in description["onednn_linear"].items()),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def machine_line(machine: dict) -> str:
    """The CPU with the ISA its kernels ran (reports from CPUs of different classes do not compare)."""
    isa = (f" (ATen {machine['cpu_capability']}, oneDNN cap {machine.get('onednn_max_cpu_isa', 'unset')}, "
           f"prepacked linears: {machine.get('onednn_linear', '?')})" if machine.get("cpu_capability") else "")
    return (f"{machine.get('cpu')}{isa}, {machine.get('cores')} cores, torch threads {machine.get('torch_threads')}, "
            f"torch {machine.get('torch')}, transformers {machine.get('transformers')}")


def _decoding(sampling: dict | None) -> str:
    if not sampling or sampling.get("temperature", 0) <= 0:
        return "greedy"
    return (f"sampling at temperature {sampling['temperature']} (top_k {sampling.get('top_k', 0)}, top_p "
            f"{sampling.get('top_p', 1.0)}, seed {sampling.get('seed')}): exact rates are not expected to be 1")


def summary_markdown(summary: dict, meta: dict) -> str:
    machine = meta["machine"]
    lines = [
        f"# specpipe bench: `{meta['pipeline']}` on `{meta['model']}` ({meta['dtype']})",
        "",
        markdown_table(summary),
        "",
        TABLE_LEGEND,
        "",
        f"- prompts: `{meta['prompts']}`, first {meta['per_category']} per category ({meta['questions']} "
        f"questions), max_new_tokens {meta['max_new_tokens']} per turn, warm-up {meta['warmup']} question(s), "
        f"{_decoding(meta.get('sampling'))}, batch 1",
        f"- methods: {', '.join(f'`{m}`' for m in meta['methods'])} (`hf_pld` = HF `generate("
        f"prompt_lookup_num_tokens={meta['pld_tokens']})`); engine `{meta.get('engine', 'hf')}` for specpipe's "
        f"methods, transformers' stock forward for the HF ones",
        f"- machine: {machine_line(machine)}, python {machine['python']}; 1-min load average "
        f"{machine.get('load_avg_before', float('nan')):.2f} before the runs, "
        f"{machine.get('load_avg_after', float('nan')):.2f} after (the run itself adds about its thread count; "
        f"more means other processes shared the CPU and the timings are noisy)",
        f"- dtype: {meta['dtype']}",
        f"- command: `{meta['command']}`",
    ]
    return "\n".join(lines) + "\n"


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


def write_parquet(records: Sequence[dict], path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame.from_records(list(records))
    if len({type(q) for q in frame["question_id"]}) > 1:
        frame["question_id"] = frame["question_id"].astype(str)  # parquet columns have one type
    write_atomically(path, lambda p: frame.to_parquet(p, index=False))


def write_answers(runs: Sequence["QuestionRun"], meta: dict, folder: Path) -> None:
    """answers/METHOD.jsonl in Spec-Bench's own answer format, one line per question."""
    folder.mkdir(parents=True, exist_ok=True)
    for method in meta["methods"]:
        lines = []
        for run in (r for r in runs if r.method == method):
            choice = {
                "index": 0,
                "turns": list(run.texts),
                "new_tokens": [len(t.tokens) for t in run.turns],
                "wall_time": [t.seconds for t in run.turns],
                "decoding_steps": [t.forwards for t in run.turns],
                "accept_lengths": [n for t in run.turns for n in t.accept_lengths],
            }
            lines.append(json.dumps({
                "question_id": run.question.question_id,
                "category": run.question.category,
                "answer_id": f"{run.question.question_id}-{method}",
                "model_id": f"{meta['model']}-{method}-{meta['dtype']}",
                "choices": [choice],
                "tstamp": time.time(),
            }, ensure_ascii=False))
        write_text(folder / f"{method}.jsonl", "".join(line + "\n" for line in lines))


def write_report(runs: Sequence["QuestionRun"], meta: dict, out: Path) -> dict:
    """Writes every report file into `out`; returns the summary (summary.json's content)."""
    out.mkdir(parents=True, exist_ok=True)
    records = run_records(runs)
    summary = summarize(records, meta["methods"])
    write_parquet(records, out / "results.parquet")
    write_answers(runs, meta, out / "answers")
    write_text(out / "summary.md", summary_markdown(summary, meta))
    plot_speedup(summary, out / "speedup.png",
                 f"{meta['pipeline']} on {meta['model']} ({meta['dtype']}), max_new_tokens {meta['max_new_tokens']}")
    summary = {**summary, "meta": meta}
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")  # last: marks a complete report
    return summary
