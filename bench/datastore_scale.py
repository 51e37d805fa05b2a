"""How the REST token datastore scales: build time, size on disk, load time and propose time
per decoding step for datastores of 1M and 10M tokens of real text.

    chrt -f 1 .venv/bin/python bench/datastore_scale.py [--sizes 1000000 10000000] [--steps 2000]

Run it alone: the forward it weighs a propose step against runs OpenMP threads that spin between ops
(as in a pipeline), and they slow down many times over when another process competes for the cores.

The corpus is the CPython standard library's source plus Python's documentation topics
(`pydoc_data.topics`), tokenized with the embedded model's tokenizer, files in a seeded
shuffled order (repeated in a new order when a size needs more text than there is). The
contexts looked up are every position of held-out stdlib files that are not in any store,
the last 16 tokens each, as a decoding step would see them.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specpipe.cost import measure_cost_curve  # noqa: E402
from specpipe.pipelines.builder import build_target, compose_config, load_model  # noqa: E402
from specpipe.stages.retrieve.rest import RestRetriever  # noqa: E402
from specpipe.stores.manifest import tokenizer_fingerprint  # noqa: E402
from specpipe.stores.token_datastore import TokenDatastore  # noqa: E402
from specpipe.stores.token_datastore_build import build_token_datastore  # noqa: E402
from specpipe.types import DecodeState  # noqa: E402

HELD_OUT_FILES = 40
# REST's settings that shape a step's lookups, read from conf/retriever/token_datastore.yaml (the shipped ones)
REST_SETTINGS = ("max_span", "min_span", "max_candidates", "max_length", "max_occurrences", "shorter_spans")


def rest_options() -> dict:
    retriever = compose_config(["pipeline=rest"]).pipeline.proposers.rest
    return {key: retriever[key] for key in REST_SETTINGS}


def corpus_texts(seed: int) -> tuple[list[str], list[str]]:
    """(store texts, held-out texts): stdlib .py files and documentation topics, shuffled."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib.rglob("*.py") if "site-packages" not in path.parts)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    import pydoc_data.topics

    rng = random.Random(seed)
    rng.shuffle(texts)
    held_out = texts[:HELD_OUT_FILES]
    return texts[HELD_OUT_FILES:] + list(pydoc_data.topics.topics.values()), held_out


def tokenize(tokenizer, texts: list[str], batch: int = 64) -> tuple[list[np.ndarray], float]:
    started = time.perf_counter()
    documents = []
    for start in range(0, len(texts), batch):
        ids = tokenizer(texts[start:start + batch], add_special_tokens=False, verbose=False)["input_ids"]
        documents.extend(np.asarray(row, dtype=np.int32) for row in ids if row)
    return documents, time.perf_counter() - started


def documents_of_size(documents: list[np.ndarray], size: int, seed: int) -> tuple[list[np.ndarray], int]:
    """Whole documents until `size` tokens (the last one cut), repeating in new orders if needed."""
    chosen, total, rounds = [], 0, 0
    rng = random.Random(seed)
    while total < size:
        order = list(range(len(documents)))
        if rounds:
            rng.shuffle(order)
        rounds += 1
        for index in order:
            document = documents[index][: size - total]
            chosen.append(document)
            total += len(document)
            if total >= size:
                break
    return chosen, rounds


def timed(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return times


def step_contexts(held_out: list[np.ndarray], steps: int, span: int, seed: int) -> list[list[int]]:
    """`steps` decoding contexts (the last `span` tokens) at random positions of held-out text."""
    rng = random.Random(seed)
    long_enough = [doc for doc in held_out if len(doc) > span]
    contexts = []
    for _ in range(steps):
        doc = rng.choice(long_enough)
        end = rng.randrange(span, len(doc))
        contexts.append(doc[end - span:end].tolist())
    return contexts


def one_token_forward_seconds(dtype: str, cached: int = 256) -> float:
    """Median time of the target's one-token decoding forward as a pipeline runs it (engine=fast, the
    config's defaults) in `dtype` over a `cached`-token KV cache: what a propose step is weighed
    against, measured in the same process under the same machine load."""
    cfg = compose_config(["model=smollm2_135m", f"model.dtype={dtype}"])
    target, _ = build_target(cfg, load_model(cfg.model))
    return measure_cost_curve(target, queries=(1,), kv_length=cached, rounds=21).milliseconds[0] / 1000


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="where to build the stores (default: a temp dir)")
    args = parser.parse_args()

    options = rest_options()
    tokenizer = load_model(compose_config(["model=smollm2_135m"]).model).tokenizer
    forward_seconds = {dtype: one_token_forward_seconds(dtype) for dtype in ("fp32", "bf16")}
    texts, held_out_texts = corpus_texts(args.seed)
    documents, tokenize_seconds = tokenize(tokenizer, texts)
    held_out, _ = tokenize(tokenizer, held_out_texts)
    corpus_tokens = sum(len(doc) for doc in documents)
    print(f"corpus: {len(documents)} documents, {corpus_tokens:,} tokens, tokenized in {tokenize_seconds:.1f} s "
          f"({corpus_tokens / tokenize_seconds:,.0f} tokens/s); held out: {len(held_out)} files, "
          f"{sum(len(d) for d in held_out):,} tokens", file=sys.stderr)
    contexts = step_contexts(held_out, args.steps, options["max_span"], args.seed)
    fingerprint = tokenizer_fingerprint(tokenizer)

    rows = []
    with tempfile.TemporaryDirectory(prefix="datastore-scale-") as scratch:
        root = args.out or Path(scratch)
        for size in args.sizes:
            chosen, rounds = documents_of_size(documents, size, args.seed)
            path = root / f"tokens_{size}"
            manifest = build_token_datastore(path, chosen, fingerprint, ["bench"], progress=False)
            load_seconds = min(timed(lambda: TokenDatastore.load(path, tokenizer), 5))
            checksum_seconds = min(timed(lambda: TokenDatastore.load(path, tokenizer, verify_checksums=True), 2))
            store = TokenDatastore.load(path, tokenizer)
            rest = RestRetriever(datastore=store, **options)
            states = [DecodeState(tokens=context, prompt_length=len(context)) for context in contexts]
            for state in states:
                rest.reset(state)  # its per-request calibration
            for state in states[:50]:  # warm the page cache and the interpreter's paths
                rest.propose(state)
            lookup_times, propose_times, lengths, nodes = [], [], [], []
            for state in states:
                started = time.perf_counter()
                match = store.lookup(state.tokens, rest.max_span, rest.min_span, rest.max_length,
                                     rest.max_candidates, rest.max_occurrences)
                lookup_times.append(time.perf_counter() - started)
                started = time.perf_counter()
                proposal = rest.propose(state)
                propose_times.append(time.perf_counter() - started)
                lengths.append(match.match_length)
                nodes.append(len(proposal))
            rows.append({
                "tokens": len(store), "rounds": rounds, "build_s": manifest.stats["build_seconds"],
                "mb": manifest.stats["bytes"] / 1e6, "load_ms": 1000 * load_seconds,
                "checksum_load_ms": 1000 * checksum_seconds,
                "lookup_mean_us": 1e6 * statistics.fmean(lookup_times),
                "lookup_p50_us": 1e6 * percentile(lookup_times, 50), "lookup_p99_us": 1e6 * percentile(lookup_times, 99),
                "propose_mean_us": 1e6 * statistics.fmean(propose_times),
                "propose_p50_us": 1e6 * percentile(propose_times, 50),
                "propose_p99_us": 1e6 * percentile(propose_times, 99),
                "matched": sum(length > 0 for length in lengths) / len(lengths),
                "match_length": statistics.fmean(length for length in lengths if length) if any(lengths) else 0.0,
                "nodes": statistics.fmean(nodes),
            })
            print(f"{size:,} tokens done", file=sys.stderr)

    settings = ", ".join(f"{key} {value}" for key, value in options.items())
    print(f"REST token datastore scale: {args.steps} steps at random positions of held-out stdlib code; {settings} "
          f"(conf/retriever/token_datastore.yaml). 'lookup' = the longest match's lookup alone; 'propose' = the "
          f"whole propose stage (every lookup, the tries, their scores).")
    print(f"Corpus tokenized at {corpus_tokens / tokenize_seconds:,.0f} tokens/s ({corpus_tokens:,} tokens in "
          f"{tokenize_seconds:.1f} s), not in 'build s' (suffix sort + keys + write + manifest checksums). "
          f"'load' = manifest, sizes, tokenizer fingerprint, mmap. One-token forward of the target (engine=fast, "
          f"256 cached tokens), same process: {1000 * forward_seconds['fp32']:.1f} ms fp32, "
          f"{1000 * forward_seconds['bf16']:.1f} ms bf16.\n")
    print("| tokens | build s | on disk MB | load ms (+SHA-256) | lookup µs mean / p50 / p99 | "
          "propose µs mean / p50 / p99 | propose / forward fp32, bf16 | steps matched | mean match len | nodes/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        share = ", ".join(f"{row['propose_mean_us'] / (1e6 * seconds):.1%}" for seconds in forward_seconds.values())
        print(f"| {row['tokens']:,}{' (x%d)' % row['rounds'] if row['rounds'] > 1 else ''} | {row['build_s']:.1f} | "
              f"{row['mb']:.0f} | {row['load_ms']:.0f} ({row['checksum_load_ms']:.0f}) | "
              f"{row['lookup_mean_us']:.0f} / {row['lookup_p50_us']:.0f} / {row['lookup_p99_us']:.0f} | "
              f"{row['propose_mean_us']:.0f} / {row['propose_p50_us']:.0f} / {row['propose_p99_us']:.0f} | "
              f"{share} | {row['matched']:.0%} | {row['match_length']:.1f} | {row['nodes']:.1f} |")


if __name__ == "__main__":
    main()
