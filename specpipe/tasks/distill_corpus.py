"""`task=distill_corpus`: the self-distilled chat corpus behind the REST token datastore.

Generates the target's greedy answers to the prompt source (specpipe.distill.prompts), then a
second turn for each answered first turn (`distill.follow_ups`), with continuous batching
(`distill.generator=continuous`; `hf`: HF `generate` per padded batch) into resumable shards,
then merges them into the file the repository ships. An empty shard folder starts from the
answers already in that file (`distill.extend`), so a run extends the shipped corpus. The command
that built `data/self_distill/smollm2_135m_chat.parquet` (run from the repository root; kill it at
any time and run it again to resume):

    OMP_WAIT_POLICY=PASSIVE nohup .venv/bin/python run.py task=distill_corpus distill.merge=false \\
        >> data/self_distill/shards/distill.log 2>&1 &

then `python run.py task=distill_corpus distill.merge_only=true` merges what the shards hold.
Throughput of HF `generate` batch sizes and dtypes on this machine: `python -m specpipe.distill.throughput`.
"""
from __future__ import annotations

import sys

import torch
from omegaconf import DictConfig

from specpipe.distill.corpus import (AnswerStream, BatchedGreedy, DistillStats, ShardFolder, distill,
                                     merge_shards, shards_from_corpus)
from specpipe.distill.magpie import QUERIES_FILE, MagpieSampler, MagpieSettings
from specpipe.distill.prompts import ChatPrompt, build_prompt_source, follow_up_prompts
from specpipe.training.resumable import check_folder, check_output_file, check_task_settings
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import load_model
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.paths import package_path
from specpipe.tasks import hydra_overrides

LINEARS = ("onednn", "torch")
GENERATORS = ("continuous", "hf")
PROMPT_SOURCES = ("templates", "magpie")
COMMAND = ("OMP_WAIT_POLICY=PASSIVE python run.py task=distill_corpus distill.merge=false, then "
           "python run.py task=distill_corpus distill.merge_only=true")


def run_distill_corpus(cfg: DictConfig) -> dict | None:
    d = cfg.distill
    check_task_settings(d, "distill", {"token_budget": (lambda v: v >= 1, ">= 1, or null for every prompt"),
                                       "seed": (lambda v: v == int(v), "an integer")})
    if d.linears not in LINEARS:
        raise ConfigError(f"distill.linears must be one of {LINEARS}, got {d.linears!r}")
    if d.generator not in GENERATORS:
        raise ConfigError(f"distill.generator must be one of {GENERATORS}, got {d.generator!r}")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    check_output_file(package_path(d.out), "distill.out", f"{cfg.model.name}_chat.parquet")
    check_folder(package_path(d.shards), "distill.shards")
    source_name = d.get("prompt_source", "templates")
    if source_name not in PROMPT_SOURCES:
        raise ConfigError(f"distill.prompt_source must be one of {PROMPT_SOURCES}, got {source_name!r}")
    magpie = magpie_settings(d) if source_name == "magpie" else None  # checked before the model loads
    shards = ShardFolder(package_path(d.shards))
    loaded = load_model(cfg.model)
    if magpie is None:
        source = build_prompt_source(seed=int(d.seed))
    else:
        sampler = MagpieSampler(loaded.model, loaded.tokenizer, cfg.get("system_prompt"), magpie,
                                shards.folder / QUERIES_FILE)
        if not d.merge_only:
            sampler.sample(progress=bool(d.progress))
        source = sampler.source()
    prompts = source.prompts[: int(d.limit)] if d.get("limit") else source.prompts
    settings = {
        "model": loaded.name, "dtype": str(cfg.model.dtype), "linears": str(d.linears),
        "max_new_tokens": int(d.max_new_tokens), "system_prompt": cfg.get("system_prompt"),
        "tokenizer": tokenizer_fingerprint(loaded.tokenizer), "seed": int(d.seed),
    }
    if magpie is not None:  # a resume under other sampling settings would mix two sources (more batches extend it)
        settings["magpie"] = sampler.sampled_with
    if not d.merge_only:
        carried = shards_from_corpus(shards, package_path(d.out), settings, loaded.tokenizer) if d.extend and magpie is None else 0
        if carried:
            print(f"distill_corpus: the shards start from the {carried} answers of {package_path(d.out)}",
                  file=sys.stderr, flush=True)
        generator = make_generator(loaded, d, cfg.get("system_prompt"))
        shards.pin_settings(settings)
        budget = int(d.token_budget) if d.get("token_budget") else None
        print(f"distill_corpus: {len(prompts)} prompts, {d.generator} batch {d.batch_size}, "
              f"{settings['dtype']}/{d.linears}, "
              f"token budget {budget}, shards in {shards.folder}", file=sys.stderr, flush=True)
        # A start line and an end line: a killed run (the usual way one ends) still leaves its start.
        shards.log_run({"event": "start", "overrides": hydra_overrides(), "batch_size": int(d.batch_size),
                        "generator": str(d.generator)})
        stats = distill(generator, prompts, shards, int(d.batch_size), budget, progress=bool(d.progress))
        if d.follow_ups and (budget is None or stats.tokens_done < budget):
            # Second turns only once the first turns are answered (or the budget allows more).
            second = distill(generator, follow_ups_of(shards, prompts, d), shards, int(d.batch_size),
                             None if budget is None else budget - stats.tokens_done, progress=bool(d.progress))
            stats = DistillStats(stats.prompts_done + second.prompts_done, stats.tokens_done + second.tokens_done,
                                 stats.new_prompts + second.new_prompts, stats.new_tokens + second.new_tokens,
                                 stats.seconds + second.seconds)
        shards.log_run({"event": "end", "new_prompts": stats.new_prompts, "new_tokens": stats.new_tokens,
                        "seconds": round(stats.seconds, 1)})
        print(f"distill_corpus: {stats.prompts_done} prompts / {stats.tokens_done} answer tokens in the shards; "
              f"this run {stats.new_tokens} tokens in {stats.seconds:.0f} s ({stats.tokens_per_second:.1f} tok/s)",
              file=sys.stderr, flush=True)
    if not (d.merge or d.merge_only):
        return None
    follow_ups = follow_ups_of(shards, prompts, d) if d.follow_ups else []
    generated_with = shards.settings() or settings
    if generated_with.get("tokenizer") != settings["tokenizer"]:
        raise ConfigError(f"the shards in {shards.folder} hold token ids of another tokenizer "
                          f"({generated_with.get('tokenizer')}) than model={loaded.name}'s; merge them with that model")
    metadata = {
        "model": generated_with.get("model"), "dtype": generated_with.get("dtype"),
        "linears": generated_with.get("linears"), "max_new_tokens": generated_with.get("max_new_tokens"),
        "system_prompt": generated_with.get("system_prompt"), "tokenizer": settings["tokenizer"],
        "decoding": "greedy, chat template applied; a second turn sees the first turn and its answer",
        "prompt_source": {"module": "specpipe.distill.magpie" if magpie else "specpipe.distill.prompts", **source.describe(),
                          "limit": int(d.limit) if d.get("limit") else None, "follow_ups": len(follow_ups)},
        "command": COMMAND,
        "runs": shards.runs(),  # every generation run into these shards: overrides, tokens, seconds
    }
    info = merge_shards(shards, package_path(d.out), [*prompts, *follow_ups], metadata, replace=bool(d.get("replace")))
    print(f"distill_corpus: merged {info['answers']} answers / {info['answer_tokens']} tokens into {package_path(d.out)} "
          f"({info['bytes'] / 1e6:.2f} MB)", file=sys.stderr)
    return info


def magpie_settings(d: DictConfig) -> MagpieSettings:
    """distill.magpie as MagpieSettings; an unknown key is refused with the known ones."""
    given = dict(d.get("magpie") or {})
    unknown = sorted(set(given) - set(MagpieSettings.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"distill.magpie has no key(s) {', '.join(unknown)}; it takes "
                          f"{', '.join(MagpieSettings.__dataclass_fields__)}")
    return MagpieSettings(**given)


def follow_ups_of(shards: ShardFolder, prompts: list[ChatPrompt], d: DictConfig) -> list[ChatPrompt]:
    """The second turns of the first turns answered in `shards` (specpipe.distill.prompts.follow_up_prompts)."""
    return follow_up_prompts(shards.answers_to(prompts), seed=int(d.seed))


def make_generator(loaded, d: DictConfig, system_prompt: str | None) -> AnswerStream:
    """The answer generator `distill.generator` names, on the model rewritten by `distill.linears`.

    Batches and generators change only the float rounding of the products, like the batch size,
    so neither is pinned in the shards' settings (the dtype and the linears are)."""
    if d.linears == "onednn":
        from specpipe.engine.onednn import OneDNNEngine

        # HF `generate` runs left-padded batches through transformers' own attention blocks, so it
        # gets the prepacked linears only; the continuous generator runs the whole lean engine.
        OneDNNEngine(fuse=True, lean_blocks=d.generator == "continuous",
                     lean_forward=d.generator == "continuous").apply(loaded.model)
    if d.generator == "continuous":
        from specpipe.distill.continuous import ContinuousGreedy

        return ContinuousGreedy(loaded.model, loaded.tokenizer, int(d.max_new_tokens), int(d.batch_size), system_prompt)
    return BatchedGreedy(loaded.model, loaded.tokenizer, int(d.max_new_tokens), system_prompt, int(d.batch_size))
