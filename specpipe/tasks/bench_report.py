"""The benchmark's report files: summary.json, summary.md, results.parquet, answers/METHOD.jsonl and speedup.png,
written by `write_report` from a run's QuestionRuns and its meta. Each file is staged and renamed into place, and
summary.json comes last, so a folder holding it holds a complete report; the metrics themselves are defined in
`specpipe.tasks.bench_metrics`, the tables and plot in `specpipe.tasks.bench_render`.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specpipe.tasks.bench_metrics import paired_speed_ratios, retrieved_chunks, run_records, summarize
from specpipe.tasks.bench_render import plot_speedup, summary_markdown

if TYPE_CHECKING:
    from specpipe.tasks.bench_records import QuestionRun


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(staging)` into a file beside `path`, then renamed onto it: a reader never sees half a file."""
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
