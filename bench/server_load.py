"""Load on OpenAI-compatible servers with the `openai` client: specpipe's (`run.py task=serve`) and llama.cpp's
`llama-server`, on the same prompts and machine, levels and servers in turns.

    .venv/bin/python bench/server_load.py --dtype bf16 --pipelines vanilla eagle_mix \\
        --llama-server /path/to/llama-server --gguf /path/to/model-bf16.gguf --concurrency 1 4 8 --rounds 2 \\
        --out bench_out/server_load

Each server is started once (specpipe: `task=serve serve.port=0`; llama-server: `-np 4 -cb`, continuous batching
over 4 slots) and stays up; for each round, concurrency level and server in turn, N clients stream the first turns
of the dev questions (each client sends its next request when one ends) with `stream_options.include_usage`. Per
level and server: output tokens/s over all clients, tokens/s per request, time to first token (first content
chunk) p50/p90, for specpipe the accepted tokens per step (its `specpipe` usage field), and the share of prompt
tokens a server reports reused from its prompt cache (`usage.prompt_tokens_details.cached_tokens`: llama-server keeps
each slot's last prompt, specpipe's prefix cache the blocks of the prompts and answers it saw). Writes summary.json,
summary.md and server_load.png.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specpipe.tasks.bench_questions import read_questions, select_questions  # noqa: E402
from specpipe.tasks.bench_load import RequestRecord, closed_loop_clients, level_metrics  # noqa: E402


class Served:
    """A server process and how to ask it."""

    def __init__(self, name: str, command: list[str], model: str, url_pattern: str | None = None,
                 port: int | None = None, request_fields: dict | None = None) -> None:
        self.name, self.model = name, model
        self.request_fields = request_fields or {}  # sent with every request (extra_body)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.lines: list[str] = []
        self.url = f"http://127.0.0.1:{port}" if port else None
        deadline = time.monotonic() + 600
        while self.url is None:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} exited:\n{''.join(self.lines[-20:])}")
            self.lines.append(line)
            found = re.search(url_pattern, line)
            if found:
                self.url = found.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start")
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.process.stdout], daemon=True).start()
        self._wait_healthy(deadline)
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=600)

    def _wait_healthy(self, deadline: float) -> None:
        import urllib.request

        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{''.join(self.lines[-20:])}")
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} is not healthy")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def stream_one(served: Served, question: str, max_tokens: int, origin: float
               ) -> tuple[RequestRecord, float | None, tuple[int, int]]:
    """One streamed chat request: its record (times from `origin`), specpipe's accepted tokens per step, and (prompt
    tokens, those of them the server reports reused from its cache: llama-server's prompt cache)."""
    submitted = time.perf_counter()
    first, tokens, accepted, prompt = None, 0, None, (0, 0)
    for event in served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body=served.request_fields or None):
        if event.choices and event.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if getattr(event, "usage", None) is not None:
            tokens = event.usage.completion_tokens
            details = getattr(event.usage, "prompt_tokens_details", None)
            prompt = (event.usage.prompt_tokens or 0, getattr(details, "cached_tokens", None) or 0)
            extension = (event.model_extra or {}).get("specpipe") or {}
            accepted = extension.get("mean_accepted_tokens")
    finished = time.perf_counter()
    first = first or finished
    return RequestRecord(submitted - origin, first - origin, finished - origin, tokens, 0), accepted, prompt


def run_level(served: Served, questions: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    origin = time.perf_counter()
    threads, results = closed_loop_clients(
        clients, requests, lambda index: stream_one(served, questions[index % len(questions)], max_tokens, origin))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = [record for record, _, _ in results]
    accepted = [mean for _, mean, _ in results if mean is not None]
    metrics = level_metrics(records, time.perf_counter() - origin)
    metrics.pop("mean_accepted"), metrics.pop("rows_per_request"), metrics.pop("batch_size")
    metrics["mean_accepted"] = sum(accepted) / len(accepted) if accepted else None
    metrics["prompt_tokens"] = sum(prompt for _, _, (prompt, _) in results)
    metrics["cached_prompt_tokens"] = sum(cached for _, _, (_, cached) in results)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--pipelines", nargs="*", default=["vanilla", "eagle_mix"])
    parser.add_argument("--llama-server", help="the llama-server binary (llama.cpp's tools/server)")
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF file for llama-server (repeat for more)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots (-np)")
    parser.add_argument("--llama-prompt-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="let llama-server reuse cached prompt prefixes (its default; the benchmark's prompts "
                             "come back every round); --no-llama-prompt-cache sends cache_prompt=false with every "
                             "request")
    parser.add_argument("--specpipe-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="specpipe's prefix cache (task=serve's default, prefix_cache.*); "
                             "--no-specpipe-prefix-cache serves with prefix_cache.memory_mb=0")
    parser.add_argument("--prompts", default=str(REPO / "bench" / "dev_prompts.jsonl"))
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench_out" / "server_load"))
    args = parser.parse_args()

    questions = [q.turns[0] for q in select_questions(read_questions(Path(args.prompts)), args.per_category)]
    servers: list[Served] = []
    try:
        for pipeline in args.pipelines:
            servers.append(Served(f"specpipe {pipeline}", [
                sys.executable, "run.py", "task=serve", f"pipeline={pipeline}", f"model.dtype={args.dtype}",
                "serve.port=0", f"threads={args.threads}", f"scheduler.max_sequences={max(args.concurrency)}",
                *([] if args.specpipe_prefix_cache else ["prefix_cache.memory_mb=0"])],
                "smollm2_135m", url_pattern=r"on (http://[\d.]+:\d+)/v1"))
        for index, gguf in enumerate(args.gguf):
            port = 18080 + index
            servers.append(Served(f"llama-server {Path(gguf).stem}", [
                args.llama_server, "-m", gguf, "-np", str(args.slots), "-cb", "-t", str(args.threads), "-tb",
                str(args.threads), "-c", str(args.slots * 2048), "--port", str(port), "--host", "127.0.0.1"],
                Path(gguf).stem, port=port,
                request_fields=None if args.llama_prompt_cache else {"cache_prompt": False}))
        for served in servers:  # warm-up: caches, kernels, cost curves
            run_level(served, questions, 1, 2, args.max_tokens)
        results: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for level_index, clients in enumerate(args.concurrency):
                shift = (round_index + level_index) % len(servers)
                for served in servers[shift:] + servers[:shift]:
                    requests = max(len(questions), 2 * clients)
                    print(f"round {round_index + 1}, {clients} clients: {served.name}", file=sys.stderr, flush=True)
                    results.setdefault((served.name, clients), []).append(
                        run_level(served, questions, clients, requests, args.max_tokens))
    finally:
        for served in servers:
            served.stop()
    rows = []
    for (name, clients), runs in results.items():
        total_tokens = sum(run["tokens"] for run in runs)
        seconds = sum(run["seconds"] for run in runs)
        accepted = [run["mean_accepted"] for run in runs if run["mean_accepted"] is not None]
        rows.append({"server": name, "clients": clients, "throughput_tok_s": total_tokens / seconds,
                     "round_tok_s": [run["throughput_tok_s"] for run in runs],
                     "request_tok_s": sum(run["request_tok_s"] for run in runs) / len(runs),
                     "ttft_p50_ms": sum(run["ttft_p50_ms"] for run in runs) / len(runs),
                     "ttft_p90_ms": sum(run["ttft_p90_ms"] for run in runs) / len(runs),
                     "mean_accepted": sum(accepted) / len(accepted) if accepted else None,
                     # the share of prompt tokens the server reused from its prompt cache instead of prefilling
                     "cached_prompt_share": (sum(run["cached_prompt_tokens"] for run in runs)
                                             / max(sum(run["prompt_tokens"] for run in runs), 1))})
    write(rows, args, Path(args.out))


def write(rows: list[dict], args, out: Path) -> None:
    from specpipe.tasks.bench_machine import machine_info, machine_line

    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    (out / "summary.json").write_text(json.dumps({"rows": rows, "args": vars(args), "machine": machine}, indent=1))
    single = {row["server"]: row["throughput_tok_s"] for row in rows if row["clients"] == 1}
    vanilla_one = single.get("specpipe vanilla")
    lines = ["| clients | server | tok/s (rounds) | vs 1 stream of specpipe vanilla | req tok/s | TTFT p50 ms | "
             "TTFT p90 ms | accepted | prompt cached |", "|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r["clients"], r["server"])):
        rounds, accepted = row["round_tok_s"], row["mean_accepted"]
        versus = f"{row['throughput_tok_s'] / vanilla_one:.2f}x" if vanilla_one else "-"
        lines.append(f"| {row['clients']} | {row['server']} | {row['throughput_tok_s']:.1f} ({min(rounds):.0f}-"
                     f"{max(rounds):.0f}) | {versus} | {row['request_tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | "
                     f"{row['ttft_p90_ms']:.0f} | {f'{accepted:.2f}' if accepted is not None else '-'} | "
                     f"{row['cached_prompt_share']:.0%} |")
    table = "\n".join(lines)
    command = "python bench/server_load.py " + " ".join(sys.argv[1:])
    (out / "summary.md").write_text(f"# Server load ({args.dtype}, {args.max_tokens} tokens)\n\n{machine_line(machine)}"
                                    f"\n\n`{command}`\n\n{table}\n")
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, server in enumerate(dict.fromkeys(row["server"] for row in rows)):
        mine = sorted((row for row in rows if row["server"] == server), key=lambda row: row["clients"])
        xs, color = [row["clients"] for row in mine], f"C{index}"
        left.plot(xs, [row["throughput_tok_s"] for row in mine], marker="o", color=color, label=server)
        right.plot(xs, [row["ttft_p50_ms"] for row in mine], marker="o", color=color, label=f"{server} p50")
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    right.set(xlabel="concurrent streams", ylabel="ms", title="time to first token", yscale="log")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "server_load.png", dpi=110)


if __name__ == "__main__":
    main()
