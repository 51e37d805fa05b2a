"""Merges the benchmark summaries of a Hydra multirun into one table and one plot.

    python run.py -m task=bench pipeline=prompt_lookup,lookahead_trie bench.per_category=2

Each job writes its own `summary.json` into its job dir; at the end of the sweep the
`MergeBenchSummaries` callback (registered by `conf/task/bench.yaml`) writes
`SWEEP_DIR/summary.json`, `SWEEP_DIR/summary.md` and `SWEEP_DIR/speedup.png`.

Jobs share the `hf_generate` / `hf_pld` methods, so merged rows are keyed `JOB / METHOD`,
where JOB names the overrides that differ between jobs (e.g. `pipeline=prompt_lookup`):
every job keeps its own reference rows, measured in its own process run.
`python -m specpipe.tasks.sweep SWEEP_DIR` re-runs the merge by hand.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specpipe.tasks.bench_machine import machine_line
from specpipe.tasks.bench_render import ROW_SEPARATOR, TABLE_LEGEND, markdown_table, plot_speedup, sources_section
from specpipe.tasks.bench_report import write_text

log = logging.getLogger(__name__)
SUMMARY = "summary.json"


class MergeBenchSummaries(Callback):
    """At the end of a multirun, merges the jobs' bench summaries found under the sweep dir."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if config.get("task", {}).get("name") != "bench":
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        merged = merge_sweep(sweep_dir, since=self.started)
        if merged is None:
            log.warning("no bench summaries found under %s; nothing merged", sweep_dir)
        else:
            log.info("merged bench summaries: %s", sweep_dir / "summary.md")
            print(f"bench sweep: merged table in {sweep_dir / 'summary.md'}", file=sys.stderr)


def find_job_summaries(sweep_dir: Path, since: float | None = None) -> list[Path]:
    """Bench summaries written by the sweep's jobs (below the sweep dir, not the merged one)."""
    found = []
    for path in sorted(sweep_dir.rglob(SUMMARY)):
        if path.parent == sweep_dir:
            continue
        if since is not None and path.stat().st_mtime < since - 1.0:
            continue  # left there by an earlier sweep into the same dir
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(summary, dict) and {"overall", "categories", "meta"} <= summary.keys():
            found.append(path)
    return found


def job_labels(metas: list[dict]) -> list[str]:
    """A short, unique name per job: the overrides that are not shared by all jobs."""
    overrides = [list(meta.get("overrides") or []) for meta in metas]
    shared = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    labels = []
    for meta, job_overrides in zip(metas, overrides):
        label = ",".join(o for o in job_overrides if o not in shared) or str(meta.get("pipeline"))
        labels.append(label)
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label}#{metas[i].get('job_num', i)}"
    return labels


def merge_summaries(summaries: list[dict]) -> dict:
    """One summary-shaped dict whose rows are `JOB / METHOD`, plus the list of jobs."""
    metas = [summary["meta"] for summary in summaries]
    labels = job_labels(metas)
    merged: dict = {"overall": {}, "categories": {}, "jobs": []}
    for label, summary, meta in zip(labels, summaries, metas):
        for method, metrics in summary["overall"].items():
            merged["overall"][f"{label}{ROW_SEPARATOR}{method}"] = metrics
        for category, by_method in summary["categories"].items():
            target = merged["categories"].setdefault(category, {})
            for method, metrics in by_method.items():
                target[f"{label}{ROW_SEPARATOR}{method}"] = metrics
        merged["jobs"].append({key: meta.get(key) for key in
                               ("pipeline", "model", "dtype", "methods", "overrides", "job_num", "command",
                                "prompts", "per_category", "max_new_tokens", "machine")} | {"label": label})
    return merged


def merge_sweep(sweep_dir: Path, since: float | None = None) -> dict | None:
    """Writes SWEEP_DIR/summary.json, summary.md and speedup.png; None when no job wrote a bench summary."""
    paths = find_job_summaries(sweep_dir, since)
    if not paths:
        return None
    summaries = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    merged = merge_summaries(summaries)
    for job, path in zip(merged["jobs"], paths):
        job["dir"] = str(path.parent)
    write_text(sweep_dir / "summary.md", sweep_markdown(merged))
    plot_speedup(merged, sweep_dir / "speedup.png", f"bench sweep: {len(paths)} jobs")
    write_text(sweep_dir / SUMMARY, json.dumps(merged, indent=2) + "\n")
    return merged


def sweep_markdown(merged: dict) -> str:
    lines = [f"# specpipe bench sweep: {len(merged['jobs'])} jobs", "", markdown_table(merged), "",
             TABLE_LEGEND + " Rows are `JOB / METHOD`: each job measured its own `hf_generate` reference.",
             *sources_section(merged), "",
             "| job | pipeline | model | dtype | overrides | dir |", "|---|---|---|---|---|---|"]
    for job in merged["jobs"]:
        lines.append(f"| {job['label']} | {job['pipeline']} | {job['model']} | {job['dtype']} | "
                     f"`{' '.join(job.get('overrides') or [])}` | {job.get('dir', '')} |")
    machine = merged["jobs"][0].get("machine") or {}
    if machine:
        lines += ["", f"- machine: {machine_line(machine)}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specpipe.tasks.sweep SWEEP_DIR")
    if merge_sweep(Path(sys.argv[1])) is None:
        sys.exit(f"no bench summaries found under {sys.argv[1]}")
    print(Path(sys.argv[1]) / "summary.md")
