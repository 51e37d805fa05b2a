"""`task=distill_corpus`: the self-distilled chat corpus behind the REST token datastore.

Generates the target's greedy answers to the prompt source (specpipe.distill.prompts) in
batches, into resumable shards, then merges them into the file the repository ships. The
command that built `data/self_distill/smollm2_135m_chat.parquet` (run from the repository root;
niced because it runs for hours beside benchmarks; kill it at any time and run it again to resume):

    OMP_WAIT_POLICY=PASSIVE nice -n 19 nohup .venv/bin/python run.py task=distill_corpus \\
        >> data/self_distill/shards/distill.log 2>&1 &

Merge what the shards hold so far without generating: `python run.py task=distill_corpus
distill.merge_only=true`. Throughput of batch sizes and dtypes on this machine:
`python -m specpipe.distill.throughput`.
"""
from __future__ import annotations

import sys

import torch
from omegaconf import DictConfig

from specpipe.distill.corpus import BatchedGreedy, ShardFolder, distill, merge_shards
from specpipe.distill.prompts import build_prompt_source
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import load_model
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.tasks import hydra_overrides, repo_path

LINEARS = ("onednn", "torch")
COMMAND = "OMP_WAIT_POLICY=PASSIVE nice -n 19 python run.py task=distill_corpus"


def run_distill_corpus(cfg: DictConfig) -> dict | None:
    d = cfg.distill
    if d.linears not in LINEARS:
        raise ConfigError(f"distill.linears must be one of {LINEARS}, got {d.linears!r}")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    source = build_prompt_source(seed=int(d.seed))
    prompts = source.prompts[: int(d.limit)] if d.get("limit") else source.prompts
    shards = ShardFolder(repo_path(d.shards))
    loaded = load_model(cfg.model)
    settings = {
        "model": loaded.name, "dtype": str(cfg.model.dtype), "linears": str(d.linears),
        "max_new_tokens": int(d.max_new_tokens), "system_prompt": cfg.get("system_prompt"),
        "tokenizer": tokenizer_fingerprint(loaded.tokenizer), "seed": int(d.seed),
    }
    if not d.merge_only:
        if d.linears == "onednn":
            # Prepacked oneDNN linears only: transformers' own blocks stay, so batches with a padding
            # mask run through `generate` unchanged (the lean blocks are single-sequence).
            from specpipe.engine.onednn import OneDNNEngine

            OneDNNEngine(fuse=True, lean_blocks=False).apply(loaded.model)
        shards.pin_settings(settings)
        generator = BatchedGreedy(loaded.model, loaded.tokenizer, int(d.max_new_tokens), cfg.get("system_prompt"))
        budget = int(d.token_budget) if d.get("token_budget") else None
        print(f"distill_corpus: {len(prompts)} prompts, batch {d.batch_size}, {settings['dtype']}/{d.linears}, "
              f"token budget {budget}, shards in {shards.folder}", file=sys.stderr, flush=True)
        # A start line and an end line: a killed run (the usual way one ends) still leaves its start.
        shards.log_run({"event": "start", "overrides": hydra_overrides(), "batch_size": int(d.batch_size)})
        stats = distill(generator, prompts, shards, int(d.batch_size), budget, progress=bool(d.progress))
        shards.log_run({"event": "end", "new_prompts": stats.new_prompts, "new_tokens": stats.new_tokens,
                        "seconds": round(stats.seconds, 1)})
        print(f"distill_corpus: {stats.prompts_done} prompts / {stats.tokens_done} answer tokens in the shards; "
              f"this run {stats.new_tokens} tokens in {stats.seconds:.0f} s ({stats.tokens_per_second:.1f} tok/s)",
              file=sys.stderr, flush=True)
    if not (d.merge or d.merge_only):
        return None
    generated_with = shards.settings() or settings
    if generated_with.get("tokenizer") != settings["tokenizer"]:
        raise ConfigError(f"the shards in {shards.folder} hold token ids of another tokenizer "
                          f"({generated_with.get('tokenizer')}) than model={loaded.name}'s; merge them with that model")
    metadata = {
        "model": generated_with.get("model"), "dtype": generated_with.get("dtype"),
        "linears": generated_with.get("linears"), "max_new_tokens": generated_with.get("max_new_tokens"),
        "system_prompt": generated_with.get("system_prompt"), "tokenizer": settings["tokenizer"],
        "decoding": "greedy, chat template applied, one user turn",
        "prompt_source": {"module": "specpipe.distill.prompts", **source.describe(),
                          "limit": int(d.limit) if d.get("limit") else None},
        "command": COMMAND,
        "runs": shards.runs(),  # every generation run into these shards: overrides, tokens, seconds
    }
    info = merge_shards(shards, repo_path(d.out), prompts, metadata)
    print(f"distill_corpus: merged {info['answers']} answers / {info['answer_tokens']} tokens into {repo_path(d.out)} "
          f"({info['bytes'] / 1e6:.2f} MB)", file=sys.stderr)
    return info
