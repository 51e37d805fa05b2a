"""`task=generate`: stream one answer to the terminal, marking text that came from accepted drafts."""
from __future__ import annotations

import sys
import time

from omegaconf import DictConfig, OmegaConf

from specpipe.pipelines.builder import build_pipeline
from specpipe.pipelines.pipeline import GenerationStats, IncrementalText, Pipeline, PreparedPrompt

DRAFTED_STYLE = "\033[32;4m"  # green, underlined
RESET = "\033[0m"


def run_generate(cfg: DictConfig, out=sys.stdout) -> GenerationStats:
    """Streams one answer; tokens that came from accepted drafts are marked."""
    pipeline = build_pipeline(cfg)
    prompt = OmegaConf.to_container(cfg.messages, resolve=True) if cfg.get("messages") else cfg.prompt
    color = cfg.task.get("color", "auto")
    use_color = color == "always" or (color == "auto" and out.isatty())
    start_mark, end_mark = (DRAFTED_STYLE, RESET) if use_color else ("[", "]")
    started = time.perf_counter()
    prepared = pipeline.prepare(prompt)  # RAG pipelines retrieve here (the first time: load or build the store)
    retrieval_seconds = time.perf_counter() - started
    started = time.perf_counter()  # tok/s counts decoding only, as `generate` does for a prepared prompt
    # the values as given (a number-looking stop string arrives as a float, a list as a ListConfig): the pipeline
    # checks them as it checks any request, rather than a cast here turning 5.7 into 5 or "4." into ["4", "."]
    stop = OmegaConf.to_container(cfg.stop) if OmegaConf.is_list(cfg.stop) else cfg.stop
    steps = pipeline.steps(prepared, cfg.max_new_tokens, stop)  # validates the request
    out.write(f"# pipeline={pipeline.name} model={pipeline.target.name} dtype={cfg.model.dtype}; "
              f"{'marked' if use_color else '[bracketed]'} text came from accepted drafts\n")
    if prepared.retrieved:
        out.write(f"# question: {prompt if isinstance(prompt, str) else prompt[-1]['content']}\n")
        for rank, chunk in enumerate(prepared.retrieved, start=1):
            used = "in the prompt" if rank <= pipeline.augmenter.k else "drafting only"
            out.write(f"# retrieved [{rank}] {chunk.title} (score {chunk.score:.3f}, {used})\n")
        out.write(f"# retrieval took {retrieval_seconds:.1f} s (loading the store included)\n")
        out.write("\n")
    text = IncrementalText(pipeline)
    stats = GenerationStats()
    token_ids: list[int] = []
    for step in steps:
        stats.add(step)
        token_ids.extend(step.tokens)
        drafted = text.push(step.tokens[: step.drafted])
        plain = text.push(step.tokens[step.drafted:])
        if drafted:
            out.write(f"{start_mark}{drafted}{end_mark}")
        out.write(plain)
        out.flush()
    out.write(text.flush())
    stats.seconds = time.perf_counter() - started
    out.write(f"\n\n[{pipeline.name}] {stats.summary()}\n")
    if cfg.task.get("compare_plain", False):
        write_plain_comparison(pipeline, prepared, cfg.max_new_tokens, stop, token_ids, stats, out)
    return stats


def write_plain_comparison(pipeline: Pipeline, prepared: PreparedPrompt, max_new_tokens: int, stop,
                           token_ids: list[int], stats: GenerationStats, out) -> GenerationStats:
    """Decodes the same prepared prompt without drafting (the same target, verifier and loop) and writes what
    speculation bought: the speed-up, the tokens per step, and whether the answers are the same."""
    out.write("# the same prompt without speculation (plain decoding, one token per target forward) ...\n")
    out.flush()
    plain = pipeline.without_drafting().generate(prepared, max_new_tokens, stop)
    same = "yes" if plain.token_ids == token_ids else "NO (bf16 verifies round differently; fp32 is exact)"
    speedup = stats.tokens_per_second / plain.stats.tokens_per_second if plain.stats.tokens_per_second else 0.0
    out.write(f"[plain] {plain.stats.new_tokens} tokens at {plain.stats.tokens_per_second:.1f} tok/s\n"
              f"speculation: {stats.tokens_per_second:.1f} tok/s, {speedup:.2f}x plain decoding, "
              f"{stats.mean_accepted:.2f} tokens per target forward; the same answer: {same}\n")
    return plain.stats
