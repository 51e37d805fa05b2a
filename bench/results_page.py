"""The Results page (docs/BENCHMARKS.md) and the README's speed table, written from the benchmark summaries
committed under docs/results/, so that no number on them is typed by hand.

    python bench/results_page.py           # rewrite docs/BENCHMARKS.md and the README's marked table
    python bench/results_page.py --check   # exit 1, changing nothing, where either differs from the summaries

Each docs/results/NAME/ is one measurement: `summary.json`, exactly as its benchmark (`task=bench`,
`task=bench_load`, `bench/server_load.py`) wrote it, and `source.json`, what the summary does not record:
`notebook` (the lab notebook page that discusses the run), `machine` and `weights` in words, and where needed
`environment` (variables the command ran under), `command` (for summaries without one), `alongside` (the server
the benchmark talked to) and `alongside_build` (how that server was built), `label` (the measurement's name in
its table) and `plot` (a committed figure under docs/).
The page's prose lives here; its tables come from the summaries alone.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script, the checkout's specpipe is the one whose renderers apply

from specpipe.tasks.bench_load import load_table  # noqa: E402

RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "BENCHMARKS.md"
README = ROOT / "README.md"
README_BEGIN = ("<!-- results:begin (written by bench/results_page.py from docs/results/; edit those, not this "
                "table) -->")
README_END = "<!-- results:end -->"
REFRESH = "python bench/results_page.py"

LLAMA_CPP = "llama_cpp"
REFERENCE = "hf_generate"

# The measurements each part of the page quotes (folder names under docs/results/).
DEV_SET = ("run-76-dev-fp32", "run-76-dev-bf16")
AGAINST_LLAMA_CPP = ("run-78-llamacpp-amx-fp32-1", "run-78-llamacpp-amx-fp32-2")
AVX2_HELD_BACK = ("run-78-llamacpp-avx2-fp32-layer-calls", "run-78-llamacpp-avx2-fp32-op-by-op")
AVX2_ZEN3 = ("run-79-llamacpp-zen3-fp32-before", "run-79-llamacpp-zen3-fp32-shuffle", "run-79-llamacpp-zen3-fp32-after")
AVX2_ZEN3_LATER = ("run-80-llamacpp-zen3-fp32-attention",)
LOAD_NATIVE = ("run-78-load-native-bf16", "run-78-load-native-fp32")
LOAD_TILES = ("run-82-load-tiles-bf16", "run-82-load-tiles-fp32")
LOAD_GATES = ("run-83-load-gates-bf16", "run-83-load-gates-fp32")
LOAD_ARGMAX_TILES = ("run-84-load-bf16", "run-84-load-fp32")
LOAD_DENSE = ("run-73-load-dense-bf16", "run-73-load-dense-fp32")
SERVER_LOAD = "run-73-server-load-bf16"
LOAD_ZEN3 = "run-80-load-zen3-fp32"
SERVER_LOAD_ZEN3 = "run-80-server-load-zen3-fp32"
SERVER_LOAD_ZEN3_NO_PROMPT_CACHE = "run-80-server-load-zen3-fp32-no-prompt-cache"
SERVER_LOAD_ZEN3_PREFIX_CACHE = "run-81-server-load-zen3-fp32-prefix-cache"
README_METHODS = ("vanilla", "lookahead_trie", "eagle_mix")
README_LOAD = "run-78-load-native-bf16"
WHOLE_DEV_SET_PAGE = "run-71.md"  # measured on another machine, whose summaries are not under docs/results/


@dataclass(frozen=True)
class Measurement:
    """One docs/results/NAME/: a benchmark's summary.json and the source.json that places it."""

    name: str
    summary: dict
    source: dict

    @property
    def notebook(self) -> str:
        return self.source["notebook"]

    @property
    def run(self) -> str:
        """'run 74' for notebook/run-74.md."""
        return Path(self.notebook).stem.replace("-", " ")

    @property
    def dtype(self) -> str:
        meta = self.summary.get("meta") or self.summary.get("args") or {}
        return meta["dtype"]

    @property
    def command(self) -> str:
        command = self.source.get("command") or self.summary["meta"]["command"]
        environment = self.source.get("environment")
        return f"{environment} {command}" if environment else command

    @property
    def label(self) -> str:
        return self.source.get("label", self.name)


def load_measurements(results: Path = RESULTS) -> dict[str, Measurement]:
    """Every measurement under `results`, by folder name."""
    measurements = {}
    for folder in sorted(path for path in results.iterdir() if path.is_dir()):
        measurements[folder.name] = Measurement(folder.name, json.loads((folder / "summary.json").read_text()),
                                                json.loads((folder / "source.json").read_text()))
    return measurements


# ---- cells --------------------------------------------------------------------------------------------
def joined(cells: Sequence[str]) -> str:
    """One cell for several runs: 'a / b', or 'a' where every run shows the same."""
    return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def value_range(values: Sequence[float], digits: int = 2, suffix: str = "") -> str:
    """'low-high' of several runs at the shown precision ('low' where they round alike)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low}{suffix}" if low == high else f"{low}-{high}{suffix}"


def over_llama_cpp(summary: dict, method: str) -> float:
    overall = summary["overall"]
    return overall[method]["tok_s"] / overall[LLAMA_CPP]["tok_s"]


def lowest_task_over_llama_cpp(summary: dict, method: str) -> tuple[str, float]:
    """The category where `method` gains least over llama.cpp, and that ratio of mean tok/s."""
    ratios = {category: methods[method]["tok_s"] / methods[LLAMA_CPP]["tok_s"]
              for category, methods in summary["categories"].items()}
    category = min(ratios, key=ratios.get)
    return category, ratios[category]


def by_speed(summary: dict) -> list[str]:
    """The methods of a `task=bench` summary, slowest first."""
    return sorted(summary["overall"], key=lambda method: summary["overall"][method]["tok_s"])


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]], align_right_from: int | None = None) -> str:
    rule = ["---:" if align_right_from is not None and index >= align_right_from else "---"
            for index in range(len(header))]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


# ---- provenance ---------------------------------------------------------------------------------------
def provenance(measurements: Sequence[Measurement]) -> str:
    """Where a table comes from: the notebook page, the machine, dtype and weights, each run's command and
    summary. The measurements of one table share their page, machine, dtype and weights."""
    first = measurements[0]
    lines = [f"From [{first.run}](notebook/{first.notebook}): {first.source['machine']}; {first.dtype}; "
             f"{first.source['weights']}."]
    if first.source.get("alongside"):
        build = first.source.get("alongside_build")
        build = f" (llama.cpp built with `{build}`)" if build else ""
        lines.append(f"Beside `{first.source['alongside']}`{build}.")
    for measurement in measurements:
        own = f", {measurement.label}" if len(measurements) > 1 else ""
        lines.append(f"Command{own}: `{measurement.command}` "
                     f"([summary.json](results/{measurement.name}/summary.json)).")
    return "\n".join(lines)


# ---- tables -------------------------------------------------------------------------------------------
def llama_cpp_headline_table(runs: Sequence[dict]) -> str:
    """Per method, over the runs: tok/s, its ratio to llama.cpp's, the category where that ratio is lowest,
    mean accepted tokens and `exact`."""
    rows = []
    for method in [LLAMA_CPP, *(m for m in by_speed(runs[0]) if m not in (LLAMA_CPP, REFERENCE))]:
        lowest = [lowest_task_over_llama_cpp(run, method) for run in runs]
        lowest_cell = "" if method == LLAMA_CPP else (
            joined([f"{ratio:.2f}x" for _, ratio in lowest]) + f" ({lowest[0][0]})"
            if len({category for category, _ in lowest}) == 1
            else " / ".join(f"{ratio:.2f}x ({category})" for category, ratio in lowest))
        rows.append([f"`{method}`", joined([f"{run['overall'][method]['tok_s']:.1f}" for run in runs]),
                     joined([f"{over_llama_cpp(run, method):.2f}x" for run in runs]), lowest_cell,
                     joined([f"{run['overall'][method]['mean_accepted']:.2f}" for run in runs]),
                     joined([f"{run['overall'][method]['exact_rate']:.2f}" for run in runs])])
    return markdown(["method", "tok/s", "over llama.cpp", "lowest task over llama.cpp", "accepted", "exact"], rows,
                    align_right_from=1)


def per_category_table(runs: Sequence[dict]) -> str:
    """Per method and category, over the runs: speedup over `hf_generate`; then overall accepted, tok/s, exact."""
    categories = list(runs[0]["categories"])
    rows = []
    for method in by_speed(runs[0]):
        speedups = [joined([f"{run['categories'][category][method]['speedup']:.2f}x" for run in runs])
                    for category in categories]
        overall = [run["overall"][method] for run in runs]
        rows.append([f"`{method}`", *speedups, joined([f"{o['speedup']:.2f}x" for o in overall]),
                     joined([f"{o['mean_accepted']:.2f}" for o in overall]),
                     joined([f"{o['tok_s']:.1f}" for o in overall]),
                     joined([f"{o['exact_rate']:.2f}" for o in overall])])
    return markdown(["method", *categories, "overall", "accepted", "tok/s", "exact"], rows,
                    align_right_from=len(categories) + 2)


def held_back_table(measurements: Sequence[Measurement]) -> str:
    """One column per measurement: llama.cpp's tok/s, then each specpipe method's tok/s with its ratio to
    llama.cpp's in the same column, its lowest category by that ratio and its mean accepted tokens."""
    summaries = [measurement.summary for measurement in measurements]
    rows = [[f"`{LLAMA_CPP}` tok/s", *(f"{summary['overall'][LLAMA_CPP]['tok_s']:.1f}" for summary in summaries)]]
    for method in (m for m in by_speed(summaries[0]) if m not in (LLAMA_CPP, REFERENCE)):
        cells = []
        for summary in summaries:
            category, lowest = lowest_task_over_llama_cpp(summary, method)
            accepted = summary["overall"][method]["mean_accepted"]
            cells.append(f"{summary['overall'][method]['tok_s']:.1f} ({over_llama_cpp(summary, method):.2f}x; "
                         f"{category} {lowest:.2f}x; {accepted:.2f} accepted)")
        rows.append([f"`{method}`", *cells])
    return markdown(["method", *(measurement.label for measurement in measurements)], rows, align_right_from=1)


def server_table(summary: dict) -> str:
    """`bench/server_load.py`'s rows: per stream count and server, total tok/s (the rounds' range), the ratio
    to one stream of specpipe's `vanilla`, per-request tok/s, time to first token and mean accepted tokens."""
    rows = summary["rows"]
    one_vanilla = next(row["throughput_tok_s"] for row in rows if row["clients"] == 1
                       and row["server"] == "specpipe vanilla")

    def server_name(name: str) -> str:
        return f"specpipe `{name.removeprefix('specpipe ')}`" if name.startswith("specpipe ") else name

    cached = all("cached_prompt_share" in row for row in rows)  # reported from run 81 on
    return markdown(
        ["streams", "server", "tok/s (rounds)", "vs 1 stream of specpipe `vanilla`", "req tok/s", "TTFT p50 ms",
         "TTFT p90 ms", "accepted", *(["prompt cached"] if cached else [])],
        [[str(row["clients"]), server_name(row["server"]),
          f"{row['throughput_tok_s']:.1f} ({min(row['round_tok_s']):.0f}-{max(row['round_tok_s']):.0f})",
          f"{row['throughput_tok_s'] / one_vanilla:.2f}x", f"{row['request_tok_s']:.1f}", f"{row['ttft_p50_ms']:.0f}",
          f"{row['ttft_p90_ms']:.0f}", "-" if row["mean_accepted"] is None else f"{row['mean_accepted']:.2f}",
          *([f"{row['cached_prompt_share']:.0%}"] if cached else [])]
         for row in sorted(rows, key=lambda row: (row["clients"], row["server"]))])


def server_section(measurement: Measurement, text: str) -> str:
    """`text` and a link to the measurement's plot, where it comes from, and its `bench/server_load.py` table."""
    plot = measurement.source["plot"]
    return f"{prose(f'{text} ([plot]({plot})):')}\n\n{provenance([measurement])}\n\n{server_table(measurement.summary)}"


def load_section(measurement: Measurement) -> str:
    plot = f" ([plot]({measurement.source['plot']}))" if measurement.source.get("plot") else ""
    return f"{measurement.dtype}{plot}:\n\n{provenance([measurement])}\n\n{load_table(measurement.summary)}"


# ---- the page -----------------------------------------------------------------------------------------
INTRO = f"""\
# Results

<!-- Written by `{REFRESH}` from docs/results/: edit those (or the script's prose), not this page. -->

Every table below is rendered by `{REFRESH}` from a benchmark's own summary.json, committed under
`docs/results/`, one folder per measurement (how to add one: [Measuring](benchmarking.md#where-results-go)).
Each table names its notebook page (the protocol, the caveats), its machine, dtype and command.
Every speed is wall-clock on a 2-core CPU VM with the embedded SmolLM2-135M-Instruct, 128 new tokens per turn,
greedy; `exact` is the share of questions whose output tokens equal plain transformers `generate`'s. These VMs
drift by 10-25% between runs: compare methods within one table.
Every run so far: [the lab notebook](notebook/index.md)."""


def prose(text: str) -> str:
    """A paragraph wrapped as the other docs pages are (links and code spans kept whole)."""
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False)


def render_page(measurements: dict[str, Measurement]) -> str:
    """docs/BENCHMARKS.md as the summaries give it."""
    amx = [measurements[name] for name in AGAINST_LLAMA_CPP]
    amx_runs = [measurement.summary for measurement in amx]
    held = [measurements[name] for name in AVX2_HELD_BACK]
    zen3 = [measurements[name] for name in AVX2_ZEN3]
    zen3_later = [measurements[name] for name in AVX2_ZEN3_LATER]
    server = measurements[SERVER_LOAD]
    bench_meta = amx_runs[0]["meta"]
    load_settings = measurements[LOAD_NATIVE[0]].summary["meta"]["settings"]
    dev = [measurements[name] for name in DEV_SET]
    dev_meta = dev[0].summary["meta"]
    parts = [
        INTRO,
        "## The dev set in both dtypes",
        prose(f"`task=bench` on the first {dev_meta['per_category']} dev questions of each category "
              f"({dev_meta['questions']} questions, every turn), every method on the same prompts in one run per "
              "dtype: transformers' greedy `generate` (`hf_generate`, the reference), its prompt lookup "
              "(`hf_pld`), specpipe's loop without drafting (`vanilla`) and two pipelines. Per category, speedup "
              "over `hf_generate` (ratio of mean tok/s), with the overall mean accepted tokens per target forward; "
              "in bf16 `exact` compares with `hf_generate` on the bf16 model, whose products round otherwise than "
              "specpipe's kernel over the file's blocks, so most answers part after some tokens (run 76 predates "
              "`engine.batch_invariant`, which makes every pipeline's bf16 answer specpipe's own bf16 `vanilla`'s: "
              "run 77)."),
        *(f"{measurement.dtype}:\n\n{provenance([measurement])}\n\n{per_category_table([measurement.summary])}"
          for measurement in dev),
        "## Against llama.cpp on the same file",
        prose(f"`task=bench` on the first {bench_meta['per_category']} dev questions of each category "
              f"({bench_meta['questions']} questions), specpipe and llama.cpp's `llama-server` (the `llama_cpp` "
              f"method) on the same Q4_1 file, {len(amx)} runs (cells: run 1 / run 2 where they differ). Ratios to "
              "llama.cpp are of mean tok/s; `exact`: answers equal to transformers' greedy `generate` on the fp32 "
              "model (llama.cpp rounds its activations to int8 for the Q4_1 dot products)."),
        provenance(amx),
        llama_cpp_headline_table(amx_runs),
        prose("Per category, speedup over `hf_generate` (ratio of mean tok/s), with the overall mean accepted "
              "tokens per target forward:"),
        per_category_table(amx_runs),
        prose("Held back to AVX2 on the same CPU (specpipe and a llama.cpp built for AVX2 only), one column per "
              "run; each cell: tok/s (its ratio to llama.cpp's in the same column; the category where that ratio "
              "is lowest; mean accepted tokens). The two columns differ in `engine.native_layers` (the target's "
              "decoder layers one kernel call each, or op by op) and in the machine's drift, llama.cpp's most of "
              "all: compare within a column."),
        provenance(held),
        held_back_table(held),
        prose("On an AVX2-only CPU of its own (AMD Zen 3), the same benchmark, one column per run: before and after "
              "the AVX2 widening of the Q4/Q5 blocks changed, each cell as above. llama.cpp is at home there, "
              "specpipe's kernel widens every weight to fp32 (to keep the fp32 model's answers) where llama.cpp "
              "multiplies int8 codes:"),
        provenance(zen3),
        held_back_table(zen3),
        prose("The same benchmark on the same Zen 3 later, with the attention's query heads of one KV head streamed "
              "together over the cache (bitwise the same answers):"),
        provenance(zen3_later),
        held_back_table(zen3_later),
        "## Many requests at once",
        prose(f"`task=bench_load`: a closed loop over the first turns of {load_settings['per_category']} dev "
              f"questions per category, {load_settings['max_new_tokens']} new tokens, every method on one target "
              f"in turns, {load_settings['rounds']} rounds (the parenthesis is the rounds' range). On the embedded "
              "model's own Q4_1 blocks:"),
        *(load_section(measurements[name]) for name in LOAD_NATIVE),
        prose("The same benchmark with the blocks on AMX tiles (`engine.native_tiles`, run 82; the VM ran slower "
              "than in run 78, so compare within a table): a forward of 16 rows costs 0.4x (bf16) to 0.6x (fp32) "
              "of the vector product's and one request speculates with bigger trees; from 4 requests the gate "
              "keeps most batches plain (accepted 1.0-1.2), the head's drafting and the wider verify costing "
              "about what they bring:"),
        *(load_section(measurements[name]) for name in LOAD_TILES),
        prose("With the speculation gates of run 83 (speculating and plain steps compared only in pairs taken close "
              "together; a draft gate that drops the head's levels before the trie's nodes: `eagle_mix` at 4 "
              "requests speculates with the trie alone) and a batch's draft level in kernel calls; the VM ran slower "
              "still, and two runs of one setting move by about 5% at 8 requests:"),
        *(load_section(measurements[name]) for name in LOAD_GATES),
        prose("With the verifier's argmax taken by numpy (ATen's walked each 49152-wide row element by element), a "
              "batch's draft level on AMX tiles from 3 rows, and bf16 prompts of more than 64 tokens attended by "
              "SDPA's flash path (run 84):"),
        *(load_section(measurements[name]) for name in LOAD_ARGMAX_TILES),
        "The same benchmark on dense weights:",
        *(load_section(measurements[name]) for name in LOAD_DENSE),
        prose("On an AVX2-only CPU (AMD Zen 3), the embedded model's Q4_1 blocks. Every product is compute-bound "
              "there from ~4 rows on (the blocks widened to fp32 and multiplied in fp32), so a batch's throughput "
              "grows far less than on the Xeon and speculation's extra rows do not pay: the gate keeps the batches "
              "plain (accepted ~1.0), and the speculative pipelines do not beat batched `vanilla` there:"),
        load_section(measurements[LOAD_ZEN3]),
        server_section(server, "Through the server (`task=serve`, the `openai` client, streaming) against "
                       "`llama-server` on a BF16 GGUF of the same weights"),
        server_section(measurements[SERVER_LOAD_ZEN3],
                       "On the AVX2-only Zen 3, against `llama-server` on the embedded model's own Q4_1 file "
                       "(specpipe in fp32 over the same blocks, every answer the fp32 model's). llama-server keeps "
                       "each slot's last prompt and reuses its longest common prefix (`cache_prompt`, on by "
                       "default), which specpipe did not do then (it does from run 81, below); every prompt here "
                       "comes back in each round"),
        server_section(measurements[SERVER_LOAD_ZEN3_NO_PROMPT_CACHE],
                       "In a run of its own, llama-server reused almost every prompt token at 4 and 8 streams (its "
                       "prompt cache; `bench/server_load.py` reports the share, see run 80). The same comparison "
                       "with every prompt prefilled on both sides (`--no-llama-prompt-cache`: `cache_prompt=false` "
                       "with each request to llama-server)"),
        server_section(measurements[SERVER_LOAD_ZEN3_PREFIX_CACHE],
                       "With specpipe's prefix cache (on by default in `task=serve`: the rows of the prompts and "
                       "answers it saw kept and reused, every prefill row-invariant so that reuse is exact; "
                       "[Serving](SERVING.md#prompt-prefixes-computed-once)) against llama-server with its own "
                       "prompt cache, both reporting the share of prompt tokens they reused"),
        "## On a GPU",
        prose("The end-to-end runs on an H100 ([run 36](notebook/run-36.md), the first full table in "
              "[run 42](notebook/run-42.md)) were measured on a lent machine whose summaries were not kept: their "
              "tables stay on those pages."),
        "## The whole dev set",
        prose("All 72 dev questions with both turns, the mixed pipelines over `lookahead_trie` with paired "
              f"bootstrap intervals, on a 2-core AMD Zen 5 EPYC: [run 71](notebook/{WHOLE_DEV_SET_PAGE}) (its "
              "summaries are not under docs/results/, so its tables stay on that page)."),
    ]
    return "\n\n".join(parts) + "\n"


def render_readme_table(measurements: dict[str, Measurement]) -> str:
    """The README's speed table: the pipelines over llama.cpp and over transformers (both runs' range) and
    bf16 tok/s at one and four concurrent requests."""
    runs = [measurements[name] for name in AGAINST_LLAMA_CPP]
    load = measurements[README_LOAD]
    llama_page, load_page = (f"[notebook](docs/notebook/{m.notebook})" for m in (runs[0], load))

    def load_tok_s(clients: int, method: str) -> str:
        return next(f"{level['throughput_tok_s']:.1f}" for level in load.summary["levels"]
                    if level["clients"] == clients and level["method"] == method)

    rows = [
        [f"one request, {runs[0].dtype}, its Q4_1 GGUF weights, {runs[0].summary['meta']['questions']} dev questions: "
         "over llama.cpp on the same file",
         *(value_range([over_llama_cpp(run.summary, method) for run in runs], suffix="x") for method in README_METHODS),
         llama_page],
        ["the same, over transformers `generate`",
         *(value_range([run.summary["overall"][method]["speedup"] for run in runs], suffix="x")
           for method in README_METHODS), llama_page],
        [f"one request, {load.dtype}, its Q4_1 weights, tok/s", *(load_tok_s(1, m) for m in README_METHODS), load_page],
        [f"4 concurrent requests, {load.dtype}, its Q4_1 weights, total tok/s",
         *(load_tok_s(4, m) for m in README_METHODS), load_page],
    ]
    header = ["workload", *(f"`{method}`" for method in README_METHODS), "measured in"]
    lines = markdown(header, rows, align_right_from=1).splitlines()
    lines[1] = "| --- |" + " ---: |" * len(README_METHODS) + " --- |"
    return "\n".join(lines)


def readme_block(readme_text: str) -> tuple[int, int]:
    """The character span of the README's generated table, between its two markers (markers excluded)."""
    begin, end = readme_text.find(README_BEGIN), readme_text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md lacks the markers {README_BEGIN!r} ... {README_END!r} around its speed table")
    return begin + len(README_BEGIN), end


def with_readme_table(readme_text: str, table: str) -> str:
    start, end = readme_block(readme_text)
    return readme_text[:start] + "\n" + table + "\n" + readme_text[end:]


def difference(committed: str, rendered: str, name: str) -> str:
    """A unified diff of a committed file against what the summaries give ('' where they are equal)."""
    return "".join(difflib.unified_diff(committed.splitlines(keepends=True), rendered.splitlines(keepends=True),
                                        f"{name} (committed)", f"{name} (from docs/results/)"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a file is stale")
    args = parser.parse_args(argv)
    measurements = load_measurements()
    readme = README.read_text()
    targets = {PAGE: render_page(measurements), README: with_readme_table(readme, render_readme_table(measurements))}
    stale = [path for path, text in targets.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(difference(path.read_text(), targets[path], path.name), end="")
        if stale:
            print(f"stale: {', '.join(path.name for path in stale)}; run `{REFRESH}`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(targets[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
