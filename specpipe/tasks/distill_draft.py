"""`task=distill_draft`: a small draft LM for the target, distilled on the target's own answers (the self-distilled
chat corpus, so the draft learns the distribution it is verified against). The draft
(specpipe.distill.draft_model) is a few of the target's decoder layers, copied and then trained, around the
target's own embedding, final norm and LM head (shared, frozen); `init_from=DRAFT.safetensors` grows a trained
draft instead, its layers kept and new ones added with their residual outputs zeroed, in a run folder of its
own. This module reads `distill_draft.*` (specpipe/conf/task/distill_draft.yaml), refuses bad settings before
any work, and runs specpipe.training's stages, each resumable: the teacher's top-k logits (the target in fp32,
through `engine`), the training on the forward KL from them with a checkpoint every `checkpoint_every` steps,
evals on the held-out answers, and exports of the draft with a JSON sidecar holding the command, corpus,
training and eval. Training is deterministic on one machine (a run stopped and resumed exports the bytes an
uninterrupted one does); the command that built the shipped draft is in its sidecar, and docs/training.md
gives it with its timings."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specpipe.distill.draft_model import build_draft, grow_draft
from specpipe.training.resumable import AT_LEAST_ONE, check_folder, check_output_file, check_task_settings, lock_folder
from specpipe.errors import ConfigError
from specpipe.models import cache_root
from specpipe.paths import local_path, package_path
from specpipe.pipelines.builder import build_engine, load_model
from specpipe.stages.draft.reduced_vocab import corpus_ranking
from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint
from specpipe.tasks import task_command
from specpipe.training.draft import DraftEvalSettings, DraftRun, DraftTrainer, TeacherCache, teacher_logits
from specpipe.training.examples import pad_id_of
from specpipe.training.scaffold import CorpusSplit, Records, Schedule, read_split, task_log

_log = task_log("distill_draft")


def check_settings(cfg: DictConfig) -> None:
    d = cfg.distill_draft
    check_task_settings(d, "distill_draft", {key: AT_LEAST_ONE for key in
                                             ("teacher_top_k", "teacher_batch", "loss_chunk", "eval_batch")})
    if d.get("out") and Path(str(d.out)).suffix != ".safetensors":
        raise ConfigError(f"distill_draft.out={d.out}: the draft is one .safetensors file (drafter.path reads it by "
                          f"that suffix); name it ...{Path(str(d.out)).stem}.safetensors")


def check_out(d: DictConfig, out: Path, init_from: Path | None, vocab: int) -> None:
    if init_from and out.resolve() == init_from.resolve():
        raise ConfigError(f"distill_draft.out is distill_draft.init_from ({out}): the exports would overwrite the "
                          f"draft being grown (and a resumed run would no longer find it); write the grown draft "
                          f"elsewhere, e.g. distill_draft.out={out.with_name(out.stem + '_grown.safetensors')}")
    if int(d.teacher_top_k) > vocab:
        raise ConfigError(f"distill_draft.teacher_top_k must be at most the vocabulary size "
                          f"{vocab}, got {d.teacher_top_k}")


def run_distill_draft(cfg: DictConfig) -> dict:
    d = cfg.distill_draft
    check_settings(cfg)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(d.seed))
    loaded = load_model(cfg.model)
    target, tokenizer = loaded.model.eval(), loaded.tokenizer
    if target.dtype != torch.float32:
        raise ConfigError(f"task=distill_draft runs the target in fp32 (teacher logits, training); got "
                          f"model.dtype={cfg.model.dtype}: use model.dtype=fp32")
    layers = [int(layer) for layer in d.layers]
    init_from = local_path(d.init_from) if d.get("init_from") else None
    # checks the layers (and the draft grown from) before any long stage
    draft = grow_draft(target, tokenizer, init_from, layers) if init_from else build_draft(target, layers)
    # The teacher runs through the pipeline's engine (about twice transformers' own forward's speed in fp32,
    # the same top-1 at every position, only the float rounding of the logits differs), after
    # the draft copied its layers: the engine rewrites the target's linears into its own modules. The
    # draft shares the target's original embedding, norm and output layer, which the engine leaves as
    # they are. Engines change only the float rounding, so the teacher cache does not pin them.
    build_engine(cfg).apply(target)
    out = package_path(d.out) if d.get("out") else package_path(f"data/draft/{loaded.name}_draft.safetensors")
    check_output_file(out, "distill_draft.out", f"{loaded.name}_draft.safetensors")
    check_out(d, out, init_from, int(target.config.vocab_size))
    corpus = local_path(d.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    split = read_split(corpus, str(d.corpus), "distill_draft.corpus", tokenizer, fingerprint["vocab_sha256"],
                       loaded.name, int(d.max_seq_len), cfg.get("system_prompt"),
                       int(d.limit) if d.get("limit") else None, float(d.eval_fraction))
    folder = package_path(d.checkpoint_dir) if d.get("checkpoint_dir") else cache_root() / "distill_draft" / loaded.name
    check_folder(folder, "distill_draft.checkpoint_dir")
    pad_id = pad_id_of(tokenizer)
    grown = f" (grown from {init_from}, trained from layers {draft.grown_from['target_layers']})" if init_from else ""
    _log(f"{split.summary()}; draft = target layers {layers}{grown}; checkpoints in {folder}")

    # The lock is the open file: it is held until this block ends (two runs would write the same shards).
    with lock_folder(folder, "distill_draft"):
        cache = TeacherCache(folder / "teacher")
        pin = {"model": loaded.name, "tokenizer": fingerprint["vocab_sha256"], "max_seq_len": int(d.max_seq_len),
               "system_prompt": split.system_prompt}
        teacher = teacher_logits(target, split.examples, cache, pin, int(d.teacher_top_k), int(d.teacher_batch),
                                 pad_id, bool(d.progress), _log)
        if d.get("teacher_only"):
            _log(f"teacher logits of {len(teacher)} answers in {cache.folder}; stopping there (teacher_only)")
            return {"teacher": str(cache.folder), "answers": len(teacher)}
        return train(cfg, loaded, draft, teacher, split, folder, out, init_from, pad_id, fingerprint)


def train(cfg: DictConfig, loaded, draft, teacher: dict, split: CorpusSplit, folder: Path, out: Path,
          init_from: Path | None, pad_id: int, fingerprint: dict) -> dict:
    """Trains the draft (every eval exports it), resumed from its run folder's checkpoints."""
    d = cfg.distill_draft
    layers = [int(layer) for layer in d.layers]
    # A grown draft trains in a folder of its own: its checkpoints continue another draft's weights.
    init_sha256 = sha256_file(init_from) if init_from else None
    grown_tag = f"-from-{init_sha256[:12]}" if init_sha256 else ""
    run_folder = folder / f"train-layers-{'-'.join(map(str, layers))}{grown_tag}"
    run_folder.mkdir(parents=True, exist_ok=True)
    trainer = DraftTrainer(draft, split.train, teacher, OmegaConf.to_container(d, resolve=True), run_folder, pad_id)
    command = task_command("distill_draft")
    grown = ({"init_from": {"file": str(d.init_from), "sha256": init_sha256,
                            "target_layers": draft.grown_from["target_layers"]}} if init_from else {})
    records = Records(report={"layers": layers, "model": loaded.name, "command": command,
                              "settings": OmegaConf.to_container(d)},
                      export={"base_model": loaded.name, "target_layers": layers, "tokenizer": fingerprint, **grown,
                              "command": command},
                      training={"teacher_top_k": int(d.teacher_top_k), "lr": float(d.lr), "batch_tokens": int(d.batch),
                                "max_seq_len": int(d.max_seq_len)})
    settings = DraftEvalSettings(int(d.batch), int(d.loss_chunk), int(d.chain_depth), int(d.seed), int(d.eval_chains),
                                 int(d.eval_batch))
    schedule = Schedule(int(d.steps), int(d.checkpoint_every), int(d.eval_every), bool(d.eval_init), bool(d.progress))
    ranking = corpus_ranking(str(split.path), loaded.tokenizer)  # exported beside the draft
    run = DraftRun(draft, teacher, settings, pad_id, layers, ranking, trainer, schedule, split, out, records, _log)
    run.start()
    return run.train()
