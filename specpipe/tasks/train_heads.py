"""`task=train_heads`: an EAGLE-1, EAGLE-3, Medusa or Hydra head for the target (`train_heads.kind`), trained on
the target's own answers (the self-distilled chat corpus, split by a hash of the prompt id exactly as
`task=distill_draft` splits it). This module reads `train_heads.*` (specpipe/conf/task/train_heads.yaml),
refuses bad settings before any work, and runs specpipe.training's stages, each resumable (kill the run at any
time and start it again): the target's features over prompt + answer (in `model.dtype`, through `engine`),
the training with a checkpoint every `checkpoint_every` steps, evals on the held-out answers (top-1
agreement and greedy chain acceptance per depth, drafted as the pipeline drafts), and exports in the released
layout to `out` with the command, corpus, training and eval in config.json's `specpipe` entry;
`eval_of=DIR` only scores the head(s) of `kind` in DIR on this split. The shipped heads' commands are in
docs/training.md."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specpipe.training.resumable import AT_LEAST_ONE, check_folder, check_task_settings, lock_folder
from specpipe.errors import ConfigError
from specpipe.models import cache_root
from specpipe.paths import local_path, package_path
from specpipe.pipelines.builder import build_engine, load_model
from specpipe.stages.draft.eagle3 import aux_layers_of
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.tasks import task_command
from specpipe.training.eagle import head_from, init_layer_state
from specpipe.training.examples import pad_id_of
from specpipe.training.features import head_features
from specpipe.training.head_run import KINDS, HeadRun, evaluate_trained, head_inputs, head_ranking, trained_head
from specpipe.training.heads import HeadInputs, HeadSettings, HeadTrainer
from specpipe.training.scaffold import CorpusSplit, Records, Schedule, read_split, task_log

_log = task_log("train_heads")


def rollout_steps(h: DictConfig) -> int:
    """train_heads.rollout_steps, null meaning the kind's default: 3 for EAGLE-3 (its recipe), 1 (no
    rollouts) for EAGLE-1, whose released recipe trains on the target's features only."""
    steps = h.get("rollout_steps")
    steps = (3 if h.kind == "eagle3" else 1) if steps is None else int(steps)
    if steps < 1:
        raise ConfigError(f"train_heads.rollout_steps must be >= 1 (1 = no rollouts), got {steps}")
    return steps


def check_settings(h: DictConfig) -> int:
    """Refuses settings that are out of range or do not combine, before any work; returns the EAGLE-1 head's layers."""
    if h.kind not in KINDS:
        raise ConfigError(f"train_heads.kind={h.kind!r}: choose one of {', '.join(KINDS)}")
    check_task_settings(h, "train_heads", {**{key: AT_LEAST_ONE
                                              for key in ("feature_batch", "medusa_heads", "medusa_layers", "eagle_layers")},
                                           "vocab_top_k": (lambda v: v >= 0 and v == int(v),
                                                           "a whole number >= 0 (0: the full vocabulary)")})
    if h.get("eval_of") and (h.get("init_from") or h.get("init_layer") is not None):
        raise ConfigError("train_heads.eval_of evaluates a trained head and trains nothing: drop train_heads.init_from "
                          "and train_heads.init_layer")
    if h.get("init_from") and (h.kind != "eagle" or h.get("init_layer") is not None):
        raise ConfigError("train_heads.init_from starts an EAGLE-1 head (kind=eagle) from a trained one; it does not "
                          f"combine with kind={h.kind}" + (" or init_layer" if h.kind == "eagle" else ""))
    eagle_layers = int(h.get("eagle_layers") or 1)
    if eagle_layers != 1 and h.kind != "eagle":
        raise ConfigError(f"train_heads.eagle_layers={eagle_layers} sizes an EAGLE-1 head (kind=eagle); kind={h.kind} "
                          f"has its own layout")
    if eagle_layers != 1 and h.get("init_layer") is not None:
        raise ConfigError(f"train_heads.init_layer starts a one-layer head from a target layer; it does not combine with "
                          f"train_heads.eagle_layers={eagle_layers}")
    rollout_steps(h)
    return eagle_layers


def head_settings(h: DictConfig, top_k: int, eagle_layers: int) -> HeadSettings:
    return HeadSettings(kind=str(h.kind), top_k=top_k, batch=int(h.batch), seed=int(h.seed),
                        chain_depth=int(h.chain_depth), eval_chains=int(h.eval_chains), progress=bool(h.progress),
                        class_weight=h.class_weight, feature_noise=float(h.feature_noise), rollouts=rollout_steps(h),
                        rollout_decay=h.rollout_decay, medusa_decay=h.medusa_decay, medusa_heads=int(h.medusa_heads),
                        medusa_layers=int(h.medusa_layers), eagle_layers=eagle_layers)


def requested_aux_layers(h: DictConfig, target) -> tuple[int, ...] | None:
    """kind=eagle3: the layers its head fuses (train_heads.aux_layers, else EAGLE-3's default), checked before any
    feature pass (an out-of-range layer failed mid-extraction); with eval_of and none given, the head's own."""
    if h.kind == "eagle3" and (h.get("aux_layers") or not h.get("eval_of")):
        given = {"eagle_aux_hidden_state_layer_ids": list(h.aux_layers)} if h.get("aux_layers") else {}
        return aux_layers_of(given, int(target.config.num_hidden_layers), "train_heads.aux_layers")
    return None


def given_heads(h: DictConfig, target, tokenizer, top_k: int, aux_layers, eagle_layers: int):
    """The heads the settings name, read (and refused) before any feature pass: (eval_of's path, its head(s) and
    the ids they draft over, or None; the layers an EAGLE-3 head fuses; init_from's head, or None)."""
    evaluated_path = local_path(str(h.eval_of)) if h.get("eval_of") else None
    evaluated = trained_head(h.kind, evaluated_path, target, tokenizer, top_k) if evaluated_path else None
    if evaluated is not None and h.kind == "eagle3" and aux_layers != evaluated[0].aux_layers:
        if h.get("aux_layers"):
            raise ConfigError(f"train_heads.aux_layers={list(h.aux_layers)}: the head in train_heads.eval_of fuses "
                              f"layers {list(evaluated[0].aux_layers)}; drop train_heads.aux_layers")
        aux_layers = evaluated[0].aux_layers
    initial = head_from(h.init_from, target, tokenizer) if h.get("init_from") else None
    if initial is not None and len(initial.layers) != eagle_layers:
        raise ConfigError(f"train_heads.init_from={h.init_from}: that head has {len(initial.layers)} decoder layer(s), "
                          f"train_heads.eagle_layers={eagle_layers}: set it to {len(initial.layers)} to fine-tune it")
    return evaluated_path, evaluated, aux_layers, initial


def run_train_heads(cfg: DictConfig) -> dict:
    h = cfg.train_heads
    eagle_layers = check_settings(h)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(h.seed))
    loaded = load_model(cfg.model)
    init_state = init_layer_state(loaded.model, None if h.get("init_layer") is None else int(h.init_layer))
    # The features come from the forward the pipeline's target runs (cfg.engine; engines change only
    # the float rounding, like the batch, so the feature cache does not pin it): 1.8x transformers'
    # own forward on SmolLM2 in fp32 with engine=fast.
    build_engine(cfg).apply(loaded.model)
    target, tokenizer = loaded.model.eval(), loaded.tokenizer
    aux_layers = requested_aux_layers(h, target)
    corpus = local_path(h.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    split = read_split(corpus, str(h.corpus), "train_heads.corpus", tokenizer, fingerprint["vocab_sha256"], loaded.name,
                       int(h.max_seq_len), cfg.get("system_prompt"), int(h.limit) if h.get("limit") else None,
                       float(h.eval_fraction), usable=lambda e: e.n_pred >= 2)
    folder = package_path(h.checkpoint_dir) if h.get("checkpoint_dir") else cache_root() / "train_heads" / loaded.name
    check_folder(folder, "train_heads.checkpoint_dir")
    out = package_path(h.out) if h.get("out") else package_path(f"data/{h.kind}/{loaded.name}")
    check_folder(out, "train_heads.out")
    vocab = int(target.config.vocab_size)
    top_k = int(h.vocab_top_k) or vocab  # 0: the full vocabulary, as drafter.vocab_top_k=0 means (>= 0: the rules above)
    if top_k > vocab:
        raise ConfigError(f"train_heads.vocab_top_k must be between 0 (the full vocabulary) and {vocab}, "
                          f"got {h.vocab_top_k}")
    evaluated_path, evaluated, aux_layers, initial = given_heads(h, target, tokenizer, top_k, aux_layers, eagle_layers)
    settings = head_settings(h, top_k, eagle_layers)
    pad_id = pad_id_of(tokenizer)
    dtype = str(cfg.model.dtype)
    _log(f"{split.summary()}; features in {dtype}; checkpoints in {folder}")
    # The lock is the open file: it is held until this block ends (two runs would write the same shards).
    with lock_folder(folder, "train_heads"):
        pin = {"model": loaded.name, "tokenizer": fingerprint["vocab_sha256"], "system_prompt": split.system_prompt}
        aux_layers = tuple(aux_layers) if h.kind == "eagle3" else ()  # EAGLE-3's inputs: a second feature cache
        features, aux_features = head_features(target, split.examples, folder, dtype, pin, aux_layers,
                                               int(h.feature_batch), pad_id, bool(h.progress), _log)
        if evaluated is not None:  # only the eval, of a head trained elsewhere: over the vocabulary it drafts with
            inputs = head_inputs(target, features, aux_features, aux_layers, evaluated[1], pad_id)
            return evaluate_trained(evaluated[0], evaluated_path, inputs, split.held_out, settings, folder, dtype,
                                    task_command("train_heads"), OmegaConf.to_container(h), _log)
        ranking = head_ranking(corpus, local_path(h.init_from) if h.get("init_from") else None, tokenizer, vocab)
        reduced_ids = torch.arange(vocab) if top_k == vocab else ranking.top(top_k, "train_heads")[0]
        inputs = head_inputs(target, features, aux_features, aux_layers, reduced_ids, pad_id)
        net = KINDS[h.kind].new_net(target, inputs, settings, init_state) if initial is None else initial
        return train(h, net, inputs, settings, ranking, split, folder / run_name(settings, dtype), out,
                     records(h, settings, loaded.name, fingerprint["vocab_sha256"], dtype))


def run_name(settings: HeadSettings, dtype: str) -> str:
    """The run's folder in the checkpoint folder: heads of other depths train beside the one-layer head on the
    same features."""
    layers = settings.eagle_layers
    return f"{settings.kind}-{dtype}" if layers == 1 else f"{settings.kind}-{layers}L-{dtype}"


def records(h: DictConfig, settings: HeadSettings, model: str, vocab_sha256: str, dtype: str) -> Records:
    command = task_command("train_heads")
    return Records(report={"kind": h.kind, "model": model, "command": command, "settings": OmegaConf.to_container(h)},
                   export={"target": model, "vocab_sha256": vocab_sha256, "feature_dtype": dtype, "command": command},
                   training={"lr": float(h.lr), "batch_tokens": int(h.batch), "max_seq_len": int(h.max_seq_len),
                             "vocab_top_k": settings.top_k, "seed": int(h.seed), "init_layer": h.get("init_layer"),
                             "init_from": h.get("init_from"), "rollout_steps": settings.rollouts,
                             "feature_noise": float(h.feature_noise)})


def train(h: DictConfig, net: torch.nn.Module, inputs: HeadInputs, settings: HeadSettings, ranking, split: CorpusSplit,
          run_folder: Path, out: Path, run_records: Records) -> dict:
    """Trains `net` (resumed from `run_folder`'s checkpoints, which pin the settings `h`), exporting to `out`."""
    loss_of = KINDS[settings.kind].loss_of(net, inputs, settings)
    run_folder.mkdir(parents=True, exist_ok=True)
    trainer = HeadTrainer(net, loss_of, split.train, OmegaConf.to_container(h, resolve=True), run_folder)
    schedule = Schedule(int(h.steps), int(h.checkpoint_every), int(h.eval_every), bool(h.eval_init), bool(h.progress))
    run = HeadRun(net, inputs, settings, ranking, trainer, schedule, split, out, run_records, _log)
    run.start()
    return run.train()
