"""`task=generate`: stream one answer to the terminal, marking text that came from accepted drafts."""
from __future__ import annotations

import sys
import time

from omegaconf import DictConfig, OmegaConf

from specpipe.pipelines.builder import build_pipeline
from specpipe.pipelines.pipeline import GenerationStats, IncrementalText

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
    for step in steps:
        stats.add(step)
        drafted = text.push(step.tokens[: step.drafted])
        plain = text.push(step.tokens[step.drafted:])
        if drafted:
            out.write(f"{start_mark}{drafted}{end_mark}")
        out.write(plain)
        out.flush()
    out.write(text.flush())
    stats.seconds = time.perf_counter() - started
    out.write(f"\n\n[{pipeline.name}] {stats.summary()}\n")
    return stats
