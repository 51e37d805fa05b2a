"""`task=bench_load`: many requests at once through the batch engine, for a pipeline and `vanilla` alike.

    python run.py task=bench_load pipeline=lookahead_trie 'bench_load.compare=[eagle_mix]' \
        'bench_load.concurrency=[1,2,4,8]' bench_load.dtype=bf16

For each concurrency level (in `bench_load.rounds` rounds), N clients each submit a request, read its steps to the end and submit the next
(closed loop), over the first turns of the prompt file's questions; with `bench_load.rates`, requests instead
arrive at a Poisson rate (requests per second), each read by its own client. The methods of a level run one
after another, their order rotated from level to level, all on one target: the configured pipeline, `vanilla`
(the same target and engine without drafting, through the same batch engine) and `bench_load.compare`'s
pipelines. Reported per level and method: total output tokens/s, per-request tokens/s, time to first token
p50/p90, mean accepted tokens per step, rows per request per step and sequences per forward. Written to
`bench_load.out` (default: the Hydra run dir): summary.json, summary.md and load.png.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig
from tqdm import tqdm

from specpipe.cost import OtherProcessesLoad
from specpipe.errors import InvalidRequest
from specpipe.pipelines.builder import assemble_pipeline, build_target, load_model, with_pipeline
from specpipe.pipelines.pipeline import Pipeline, PreparedPrompt
from specpipe.serving import RequestHandle, SchedulerLimits
from specpipe.tasks.bench_machine import machine_info, machine_line
from specpipe.tasks.bench_metrics import VANILLA
from specpipe.tasks.bench_questions import read_questions, resolve_prompts_path, select_questions
from specpipe.tasks.bench_report import write_text
from specpipe.tasks.bench_settings import benchmark_settings, hydra_job_info, output_dir

T = TypeVar("T")

@dataclass(frozen=True)
class LoadSettings:
    prompts: Path
    per_category: int
    max_new_tokens: int
    dtype: str
    concurrency: tuple[int, ...]
    rates: tuple[float, ...]  # Poisson arrivals per second (open loop); empty = closed loop at `concurrency`
    requests: int  # requests per level and method (0 = one per prompt, at least 2 per client)
    compare: tuple[str, ...]
    warmup: int
    seed: int
    out: Path
    rounds: int = 1  # every level and method this many times, in turns


@dataclass
class RequestRecord:
    """One request of a level: when it was submitted, got its first token and ended, relative to the level's
    start (s); what it committed."""

    submitted: float
    first_token: float
    finished: float
    tokens: int
    steps: int  # decoding steps after the prefill
    rows: list[int] = field(default_factory=list)  # per step: this request's rows in the forward
    batch_sizes: list[int] = field(default_factory=list)  # per step: the sequences of that forward


def read_settings(cfg: DictConfig) -> LoadSettings:
    bench = benchmark_settings(cfg, "bench_load", "the load benchmark")

    def positive_ints(key: str) -> tuple[int, ...]:
        values = bench.get(key)
        values = [values] if isinstance(values, int) else list(values or [])
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise InvalidRequest(f"bench_load.{key} must be a list of positive integers, got {bench.get(key)!r}")
        return tuple(values)

    rates = bench.get("rates") or []
    rates = [rates] if isinstance(rates, (int, float)) else list(rates)
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in rates):
        raise InvalidRequest(f"bench_load.rates must be a list of positive request rates (per second), got {rates!r}")
    for key in ("max_new_tokens", "per_category"):
        value = bench.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidRequest(f"bench_load.{key} must be a positive integer, got {value!r}")
    rounds = bench.get("rounds", 1)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise InvalidRequest(f"bench_load.rounds must be a positive integer, got {rounds!r}")
    for key in ("requests", "warmup", "seed"):
        value = bench.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequest(f"bench_load.{key} must be an integer >= 0, got {value!r}")
    compare = bench.get("compare") or []
    compare = [compare] if isinstance(compare, str) else list(compare)
    return LoadSettings(resolve_prompts_path(str(bench.prompts)), bench.per_category, bench.max_new_tokens,
                        str(bench.dtype), positive_ints("concurrency"), tuple(float(r) for r in rates),
                        bench.requests, tuple(compare), bench.warmup, bench.seed, output_dir(bench.get("out"),
                                                                                             "bench_load.out"),
                        rounds)


def closed_loop_clients(clients: int, requests: int, request: Callable[[int], T]) -> tuple[list[threading.Thread], list[T]]:
    """`clients` threads (not started), each running `request(i)` for the next i < `requests` as soon as its previous
    request ended, and the list their results land in."""
    next_index = iter(range(requests))
    lock = threading.Lock()
    results: list[T] = []

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            result = request(index)
            with lock:
                results.append(result)

    return [threading.Thread(target=client) for _ in range(clients)], results


def run_closed_loop(pipeline: Pipeline, prompts: Sequence[PreparedPrompt], clients: int, requests: int,
                    max_new_tokens: int) -> tuple[list[RequestRecord], float]:
    """`clients` threads, each submitting the next prompt as soon as its previous request ended."""
    started = time.perf_counter()
    threads, records = closed_loop_clients(
        clients, requests, lambda index: _consume(pipeline.submit(prompts[index % len(prompts)], max_new_tokens),
                                                  started))
    pipeline.scheduler.hold()  # this thread runs the engine, before any client could
    for thread in threads:
        thread.start()
    _drive_until_done(pipeline, threads)
    return records, time.perf_counter() - started


def run_poisson(pipeline: Pipeline, prompts: Sequence[PreparedPrompt], rate: float, requests: int,
                max_new_tokens: int, seed: int) -> tuple[list[RequestRecord], float]:
    """Requests arriving at `rate` per second (exponential gaps, seeded), each read by a thread of its own."""
    rng = random.Random(seed)
    records: list[RequestRecord] = []
    lock = threading.Lock()
    threads = []
    started = time.perf_counter()

    def client(index: int) -> None:
        record = _consume(pipeline.submit(prompts[index % len(prompts)], max_new_tokens), started)
        with lock:
            records.append(record)

    def arrivals() -> None:
        arrival = 0.0
        for index in range(requests):
            arrival += rng.expovariate(rate)
            delay = started + arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            threads.append(threading.Thread(target=client, args=(index,)))
            threads[-1].start()

    dispatcher = threading.Thread(target=arrivals)
    pipeline.scheduler.hold()
    dispatcher.start()
    _drive_until_done(pipeline, [dispatcher], threads)
    return records, time.perf_counter() - started


def _drive_until_done(pipeline: Pipeline, *thread_lists: list[threading.Thread]) -> None:
    """Runs the pipeline's engine in this (the main) thread until every thread of the lists has ended (a list may
    grow while the threads before it run): the clients only submit and read."""
    stop = threading.Event()

    def watch() -> None:
        for threads in thread_lists:
            index = 0
            while index < len(threads):
                threads[index].join()
                index += 1
        stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    pipeline.scheduler.run(stop)
    watcher.join()


def _consume(handle: RequestHandle, origin: float) -> RequestRecord:
    tokens, rows, batch_sizes, steps = 0, [], [], -1
    for step in handle.steps():
        tokens += len(step.tokens)
        steps += 1
        if steps:  # the prefill's token has no verify rows
            rows.append(step.stats.rows)
            batch_sizes.append(step.stats.batch_size)
    return RequestRecord(handle.submitted - origin, handle.first_token - origin, handle.finished - origin, tokens,
                         steps, rows, batch_sizes)


def level_metrics(records: Sequence[RequestRecord], wall_seconds: float) -> dict:
    """What one level of one method measured."""
    tokens = sum(record.tokens for record in records)
    ttft = sorted(record.first_token - record.submitted for record in records)
    per_request = [record.tokens / (record.finished - record.submitted) for record in records]
    rows = [r for record in records for r in record.rows]
    sizes = [b for record in records for b in record.batch_sizes]
    steps = sum(record.steps for record in records)
    return {
        "requests": len(records),
        "tokens": tokens,
        "seconds": wall_seconds,
        "throughput_tok_s": tokens / wall_seconds,
        "request_tok_s": statistics.mean(per_request),
        "ttft_p50_ms": 1000 * _quantile(ttft, 0.5),
        "ttft_p90_ms": 1000 * _quantile(ttft, 0.9),
        # tokens per decoding step (the prefill's token aside), as Spec-Bench counts accepted tokens
        "mean_accepted": (tokens - len(records)) / steps if steps else 0.0,
        "rows_per_request": statistics.mean(rows) if rows else 1.0,
        "batch_size": statistics.mean(sizes) if sizes else 1.0,
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks of `ordered` (ascending)."""
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_bench_load(cfg: DictConfig, loaded=None) -> dict:
    settings = read_settings(cfg)
    questions = select_questions(read_questions(settings.prompts), settings.per_category)
    if not questions:
        raise InvalidRequest(f"{settings.prompts} holds no questions")
    loaded = loaded or load_model(cfg.model)
    target, engine = build_target(cfg, loaded)
    pipeline = assemble_pipeline(cfg, target, loaded, engine)
    methods: dict[str, Pipeline] = {pipeline.name: pipeline}
    if pipeline.name != VANILLA:
        methods[VANILLA] = pipeline.without_drafting(VANILLA)
    for name in settings.compare:
        other = assemble_pipeline(with_pipeline(cfg, name), target, loaded, engine)
        if other.name in methods:
            raise InvalidRequest(f"bench_load.compare: {other.name!r} is already a method of this run")
        methods[other.name] = other
    limits = SchedulerLimits(max_sequences=max([*settings.concurrency, pipeline.limits.max_sequences]),
                             max_queued=max(pipeline.limits.max_queued, 4 * len(questions)),
                             max_tokens_in_flight=pipeline.limits.max_tokens_in_flight)
    for method in methods.values():  # each method's own engine, the same limits (before its first request)
        method.limits = limits
    prompts = {name: [method.prepare([{"role": "user", "content": q.turns[0]}]) for q in questions]
               for name, method in methods.items()}
    levels = [("rate", rate) for rate in settings.rates] or [("clients", c) for c in settings.concurrency]
    names = list(methods)
    for name in names:  # warm-up: every method's caches, kernels and cost curve, none of it counted
        for index in range(settings.warmup):
            methods[name].generate(prompts[name][index % len(questions)], settings.max_new_tokens)
    print(f"bench_load: {len(questions)} prompts x {len(names)} methods ({', '.join(names)}) x "
          f"{len(levels)} levels on {pipeline.target.name} {settings.dtype}, max_new_tokens={settings.max_new_tokens}",
          file=sys.stderr)
    runs: dict[tuple[str, float], list[tuple[list[RequestRecord], float]]] = {}
    with OtherProcessesLoad() as others, tqdm(total=settings.rounds * len(levels) * len(names), desc="bench_load",
                                              unit="run", file=sys.stderr) as bar:
        for round_index in range(settings.rounds):  # rounds of every level and method: a drift hits all alike
            for level_index, (kind, value) in enumerate(levels):
                shift = (round_index + level_index) % len(names)
                for name in names[shift:] + names[:shift]:
                    requests = settings.requests or max(len(questions), 2 * int(value) if kind == "clients" else 0)
                    bar.set_postfix_str(f"{kind}={value} {name}", refresh=False)
                    if kind == "clients":
                        run = run_closed_loop(methods[name], prompts[name], int(value), requests,
                                              settings.max_new_tokens)
                    else:
                        run = run_poisson(methods[name], prompts[name], value, requests, settings.max_new_tokens,
                                          settings.seed + level_index)
                    runs.setdefault((name, value), []).append(run)
                    bar.update()
    results: list[dict] = []
    for kind, value in levels:
        for name in names:
            measured = runs[(name, value)]
            records = [record for run_records, _ in measured for record in run_records]
            row = {"method": name, kind: value, **level_metrics(records, sum(wall for _, wall in measured))}
            row["round_tok_s"] = [sum(r.tokens for r in run_records) / wall for run_records, wall in measured]
            results.append(row)
    single = next((row for row in results if row["method"] == VANILLA and row.get("clients") == 1), None)
    for row in results:
        same_level = next(other for other in results if other["method"] == VANILLA
                          and other.get("clients") == row.get("clients") and other.get("rate") == row.get("rate"))
        row["vs_batched_vanilla"] = row["throughput_tok_s"] / same_level["throughput_tok_s"]
        row["vs_single_vanilla"] = row["throughput_tok_s"] / single["throughput_tok_s"] if single else None
    gates = {name: gate_measures(method) for name, method in methods.items()}
    meta = {"pipeline": pipeline.name, "methods": names, "speculation_gate": gates, "model": pipeline.target.name, "engine": pipeline.target.engine,
            "dtype": settings.dtype, "settings": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in asdict(settings).items()},
            "prompts": len(questions), **hydra_job_info(),
            "machine": {**machine_info(), "other_processes_cpus": others.cores, "cpus": others.cpus}}
    summary = {"levels": results, "meta": meta}
    write_report(summary, settings.out)
    print(load_table(summary))
    if others.competed():
        print(f"bench_load: warning: other processes kept {others.cores:.1f} of the {others.cpus} CPUs busy",
              file=sys.stderr)
    print(f"bench_load: report written to {settings.out}", file=sys.stderr)
    return summary


def gate_measures(pipeline: Pipeline) -> dict[int, dict[str, float]]:
    """What a pipeline's speculation gate measured per batch size: tokens per ms speculating and plain (decayed means
    over each kind's steps), and the ratio it decides on (from the two kinds measured close together)."""
    gate, draft_gate = pipeline.decoder.gate, pipeline.decoder.draft_gate
    if gate is None:
        return {}
    measured = {}
    for size in range(2, pipeline.limits.max_sequences + 1):
        speculating, plain = gate.rates(size)
        if speculating or plain:
            measured[gate.bucket(size)] = {"speculating": speculating, "plain": plain,  # the sizes up to it
                                           "ratio": gate.ratio(size)}
            if draft_gate is not None and draft_gate.ratio(size):
                measured[gate.bucket(size)]["drafting_ratio"] = draft_gate.ratio(size)
    return measured


def gate_lines(gates: dict) -> str:
    """The speculation gates' measures as text: per method, tokens/ms speculating / plain at each batch size, and the
    paired ratio the gate decides on (older reports have none)."""
    lines = [f"- `{name}`: " + ", ".join(f"{size}: {m['speculating']:.3f} / {m['plain']:.3f}"
                                        + (f" (paired {m['ratio']:.2f}x" if m.get("ratio") else "")
                                        + (f"; drafting {m['drafting_ratio']:.2f}x" if m.get("drafting_ratio") else "")
                                        + (")" if m.get("ratio") else "")
                                        for size, m in sorted(measured.items(), key=lambda item: int(item[0])))
             for name, measured in gates.items() if measured]
    return ("\nSpeculation gate, tokens per ms speculating / plain by batch size, and speculating over plain in runs "
            "taken close together (the gate speculates where that is above 1.03x; `drafting`: steps that grew the "
            "drafters over steps of the proposers' trees alone, the same way):\n"
            + "\n".join(lines) + "\n") if lines else ""


def load_table(summary: dict) -> str:
    rows = summary["levels"]
    kind = "rate" if any("rate" in row for row in rows) else "clients"
    header = [kind, "method", "tok/s (rounds)", "vs batched vanilla", "vs 1 vanilla", "req tok/s", "TTFT p50 ms",
              "TTFT p90 ms", "accepted", "rows/req", "batch"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in sorted(rows, key=lambda r: (r.get(kind), r["method"])):
        single = row.get("vs_single_vanilla")
        lines.append("| " + " | ".join([
            f"{row[kind]:g}", f"`{row['method']}`", f"{row['throughput_tok_s']:.1f}" + _spread(row),
            f"{row['vs_batched_vanilla']:.2f}x", f"{single:.2f}x" if single else "-", f"{row['request_tok_s']:.1f}",
            f"{row['ttft_p50_ms']:.0f}", f"{row['ttft_p90_ms']:.0f}", f"{row['mean_accepted']:.2f}",
            f"{row['rows_per_request']:.1f}", f"{row['batch_size']:.1f}"]) + " |")
    return "\n".join(lines)


def _spread(row: dict) -> str:
    """The lowest and highest of the rounds' throughputs, where there were several."""
    rounds = row.get("round_tok_s") or []
    return f" ({min(rounds):.0f}-{max(rounds):.0f})" if len(rounds) > 1 else ""


def write_report(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "summary.json", json.dumps(summary, indent=1, default=str))
    meta = summary["meta"]
    text = (f"# Load benchmark: {meta['pipeline']} on {meta['model']} ({meta['dtype']}, engine={meta['engine']})\n\n"
            f"{machine_line(meta['machine'])}\n\n`{meta.get('command', '')}`\n\n{load_table(summary)}\n"
            f"{gate_lines(meta.get('speculation_gate') or {})}")
    write_text(out / "summary.md", text)
    plot_load(summary, out / "load.png")


def plot_load(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["levels"]
    kind = "rate" if any("rate" in row for row in rows) else "clients"
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, method in enumerate(summary["meta"]["methods"]):
        mine = sorted((row for row in rows if row["method"] == method), key=lambda row: row[kind])
        xs, color = [row[kind] for row in mine], f"C{index}"  # a method's colour in both panels
        left.plot(xs, [row["throughput_tok_s"] for row in mine], marker="o", color=color, label=method)
        right.plot(xs, [row["ttft_p50_ms"] for row in mine], marker="o", color=color, label=f"{method} p50")
        right.plot(xs, [row["ttft_p90_ms"] for row in mine], marker="x", linestyle="--", color=color,
                   label=f"{method} p90")
    xlabel = "Poisson arrivals per second" if kind == "rate" else "concurrent requests"
    left.set(xlabel=xlabel, ylabel="output tokens/s (all requests)", title="throughput")
    right.set(xlabel=xlabel, ylabel="ms", title="time to first token")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    meta = summary["meta"]
    figure.suptitle(f"{meta['model']} {meta['dtype']}, {meta['machine'].get('cpu', '')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
