"""The benchmark's report as people read it: the markdown tables (speedup and accepted length per category,
tokens by source, speed over `bench.relative_to`), summary.md around them, and the speedup plot. The sweep merge
(`specpipe.tasks.sweep`) renders its table and plot with the same functions, from summaries whose row names are
`JOB / METHOD`, so one run's report and a merged sweep's read alike.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specpipe.tasks.bench_machine import machine_line
from specpipe.tasks.bench_metrics import REFERENCE

ROW_SEPARATOR = " / "  # merged sweep rows are "JOB / METHOD"


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
    header = ["method", *categories, "overall", "vs vanilla", "tok/s", "exact", "= vanilla"]
    rows = []
    for row, overall in summary["overall"].items():
        exact = "n/a" if overall.get("exact_rate") is None else f"{overall['exact_rate']:.2f}"
        same = "n/a" if overall.get("same_as_vanilla_rate") is None else f"{overall['same_as_vanilla_rate']:.2f}"
        vs_vanilla = "n/a" if overall.get("speedup_vs_vanilla") is None else f"{overall['speedup_vs_vanilla']:.2f}x"
        rows.append([row, *(_cell(summary["categories"][c].get(row)) for c in categories), _cell(overall),
                     vs_vanilla, f"{overall['tok_s']:.1f}", exact, same])
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
                "share of prompts whose output tokens (all turns) equal `hf_generate`'s; `= vanilla`: equal to "
                "specpipe's own `vanilla`'s (the engine's plain greedy answer, in any dtype).")



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

